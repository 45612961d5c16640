"""compensated_sum and the accumulator: accuracy, inf/nan, determinism, errors."""

import math

import pytest
import torch

import parsum
from parsum import _summation
from parsum._summation import ChunkPartials, CompensatedAccumulator, compensated_add_

N_JOBS = [1, 2, 3]


def naive(ts):
    total = ts[0].clone()
    for t in ts[1:]:
        total = total + t
    return total


@pytest.mark.parametrize("k", [1, 2, 7, 50])
@pytest.mark.parametrize("n_jobs", N_JOBS)
@pytest.mark.parametrize("chunk_size", [None, 1, 2, 5])
def test_cancellation_sums_exactly(k, n_jobs, chunk_size):
    xs = [torch.tensor([v], dtype=torch.float32) for v in [1e8, 1.0, -1e8] * k]
    got = parsum.compensated_sum(xs, n_jobs=n_jobs, chunk_size=chunk_size)
    assert got.item() == k
    assert naive(xs).item() != k  # the plain sum loses every 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_closer_to_exact_than_naive(dtype):
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(1000, generator=gen, dtype=dtype) * 10 ** (i % 7) for i in range(64)]
    exact = sum(x.double() for x in xs)  # exact enough for float32 data
    err_plain = (naive(xs).double() - exact).abs().sum()
    err_ours = (parsum.compensated_sum(xs).double() - exact).abs().sum()
    if dtype == torch.float32:
        # The floor is rounding the exact sum to float32; compensation gets within 2x of it.
        err_floor = (exact.float().double() - exact).abs().sum()
        assert err_ours <= 2 * err_floor
        assert err_plain > 4 * err_ours
    else:
        exact_fsum = torch.tensor(
            [math.fsum(col) for col in torch.stack(xs).T.tolist()], dtype=torch.float64
        )
        assert (parsum.compensated_sum(xs) - exact_fsum).abs().max() <= (
            (naive(xs) - exact_fsum).abs().max()
        )
        assert torch.allclose(parsum.compensated_sum(xs), exact_fsum, rtol=1e-15, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [None, 1, 3])
def test_bitwise_identical_for_any_n_jobs(chunk_size):
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(257, generator=gen) * 1e3 ** (i % 3) for i in range(29)]
    results = [parsum.compensated_sum(xs, n_jobs=n, chunk_size=chunk_size) for n in (1, 2, 3, 4)]
    for r in results[1:]:
        assert torch.equal(r, results[0])


INF, NAN = math.inf, math.nan
SPECIAL_CASES = [
    [INF, 1.0, 2.0],
    [1.0, INF, -1e30],
    [INF, -INF, 1.0],
    [-INF, -INF, 3.0],
    [NAN, 1.0, 1e8],
    [1.0, 2.0, NAN],
    [1e8, 1.0, INF, -1e8],
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("values", SPECIAL_CASES)
@pytest.mark.parametrize("chunk_size", [1, 2, 4])
def test_inf_and_nan_propagate_as_in_plain_sum(values, chunk_size, dtype):
    xs = [torch.tensor([v], dtype=dtype) for v in values]
    got = parsum.compensated_sum(xs, chunk_size=chunk_size, n_jobs=2).item()
    expected = naive(xs).item()
    if math.isnan(expected):
        assert math.isnan(got)
    elif math.isinf(expected):
        assert got == expected
    else:
        assert math.isfinite(got)


@pytest.mark.parametrize("chunk_size", [1, 2, 3])
def test_overflowing_running_sum(chunk_size):
    # float32 is summed in float64 (NOTE [ Compensated summation ]): a running sum that
    # overflows in float32 but not in float64 gives the exact sum, not the plain sum's inf.
    xs = [torch.tensor([v]) for v in [3e38, 3e38, -3e38]]
    assert naive(xs).item() == math.inf
    assert parsum.compensated_sum(xs, chunk_size=chunk_size).item() == xs[0].item()
    # A sum that does not fit float32 is inf, as it should be.
    assert parsum.compensated_sum(xs[:2], chunk_size=chunk_size).item() == math.inf
    # float64 has no wider type: its running sum overflows as the plain one does.
    big = [torch.tensor([v], dtype=torch.float64) for v in [1.7e308, 1.7e308, -1.7e308]]
    assert parsum.compensated_sum(big, chunk_size=chunk_size).item() == math.inf


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_narrow_dtypes_give_the_rounded_exact_sum(dtype):
    gen = torch.Generator().manual_seed(2)
    xs = [(torch.randn(300, generator=gen) * 4 ** (i % 5)).to(dtype) for i in range(40)]
    exact = torch.tensor(
        [math.fsum(col) for col in torch.stack(xs).double().T.tolist()], dtype=torch.float64
    )
    got = parsum.compensated_sum(xs, chunk_size=3)
    assert got.dtype == dtype
    assert torch.equal(got, exact.to(dtype))


@pytest.mark.parametrize("limit_bytes", [None, 1, 3 * 300 * 8])  # all at once, one by one, 3
def test_chunk_partials_give_the_rounded_exact_sum(monkeypatch, limit_bytes):
    # Partials of one tensor (borrowed, float32) and of several (already in float64), combined
    # in groups of as many as the byte limit holds: NOTE [ Combining chunk partials ].
    if limit_bytes is not None:
        monkeypatch.setattr(_summation, "PARTIALS_BYTES", limit_bytes)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(300, generator=gen) * 4 ** (i % 7) for i in range(23)]
    exact = torch.tensor([math.fsum(col) for col in torch.stack(xs).double().T.tolist()])
    copies = [x.clone() for x in xs]
    total = ChunkPartials()
    at = 0
    for size in [1, 3, 1, 1, 5, 2, 1, 4, 1, 1, 1, 2]:
        acc = CompensatedAccumulator()
        acc.add_all(xs[at : at + size])
        total.merge(acc)
        at += size
    assert at == len(xs)
    got = total.result()
    assert got.dtype == torch.float32
    assert torch.equal(got, exact.float())
    assert all(torch.equal(x, c) for x, c in zip(xs, copies))  # the borrowed ones unwritten


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_terms_added_times_their_weights_give_the_bits_of_each_product(dtype):
    # NOTE [ Weights in the reduction ]: terms of float weights (None: weighted already) added
    # in three chunks, then a chunk without weights, give the bits of the products added.
    torch.manual_seed(0)
    xs = [torch.randn(4, 3).to(dtype) * 10 ** (k % 5 - 2) for k in range(9)]
    weights = [0.1, None, -0.0, 1 / 3, 1 / 3, None, 2.0, 0.0, -1e-3]
    products = [x if w is None else x * w for x, w in zip(xs, weights)]
    got, want = ChunkPartials(), ChunkPartials()
    for start, stop in ((0, 2), (2, 6), (6, 9)):
        got.add_terms(xs[start:stop], weights[start:stop])
        want.add_terms(products[start:stop])
    got.add_terms(xs[:3])
    want.add_terms(xs[:3])
    a, b = got.result(), want.result()
    assert a.dtype == b.dtype == dtype
    assert torch.equal(a, b) and torch.equal(a.signbit(), b.signbit())


def test_accumulator_never_writes_its_inputs():
    xs = [torch.randn(5) for _ in range(4)]
    copies = [x.clone() for x in xs]
    acc = CompensatedAccumulator()
    for x in xs:
        acc.add(x)
    out = acc.result()
    for x, c in zip(xs, copies):
        assert torch.equal(x, c)
    assert out.data_ptr() not in {x.data_ptr() for x in xs}


def test_single_tensor_is_copied():
    x = torch.randn(3)
    out = parsum.compensated_sum([x])
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()


def test_integer_and_complex_tensors():
    ints = [torch.arange(4) * i for i in range(5)]
    assert torch.equal(parsum.compensated_sum(ints), sum(ints))
    zs = [torch.tensor([1e8 + 1e8j]), torch.tensor([1 + 1j]), torch.tensor([-1e8 - 1e8j])]
    zs = [z.to(torch.complex64) for z in zs]
    assert parsum.compensated_sum(zs).item() == 1 + 1j


def test_stacked_tensor_is_summed_over_first_dim():
    x = torch.randn(6, 4, dtype=torch.float64)
    assert torch.allclose(parsum.compensated_sum(x), x.sum(0), rtol=0, atol=1e-14)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(tensors=[]), "compensated_sum: tensors is empty"),
        (dict(tensors=3), "compensated_sum: tensors is an int; expected a sequence of tensors"),
        (dict(tensors=[torch.ones(2), 3.0]), r"tensors\[1\] is a float"),
        (dict(tensors=[torch.ones(2), torch.ones(3)]), r"tensors\[1\] has shape \(3,\)"),
        (dict(tensors=[torch.ones(2), torch.ones(2, dtype=torch.float64)]), "dtype"),
        (dict(tensors=[torch.eye(2).to_sparse()] * 2), r"tensors\[0\] has layout torch.sparse_coo"),
        (dict(tensors=[torch.ones(2)], chunk_size=0), "invalid chunk_size=0"),
        (dict(tensors=[torch.ones(2)], n_jobs=0), "invalid n_jobs=0"),
    ],
)
def test_errors(kwargs, match):
    tensors = kwargs.pop("tensors")
    with pytest.raises(parsum.ParsumError, match=match):
        parsum.compensated_sum(tensors, **kwargs)


def test_compensated_add_keeps_what_naive_accumulation_loses():
    totals = [torch.tensor([1e6], dtype=torch.float32), torch.tensor([1.0, 2.0])]
    comps = [torch.zeros(1), torch.zeros(2)]
    naive = torch.tensor([1e6], dtype=torch.float32)
    for _ in range(1000):
        compensated_add_(totals, comps, [torch.tensor([0.01]), torch.tensor([1e-9, -1e-9])])
        naive += 0.01
    assert naive.item() == 1e6
    assert totals[0].item() == 1e6 + 10
    exact = torch.tensor([1.0 + 1e-6, 2.0 - 1e-6], dtype=torch.float64)
    assert torch.equal(totals[1], exact.float())


def test_compensated_add_inf_and_nan_as_plain_accumulation():
    totals = [torch.tensor([1.0, float("inf"), 2.0, 3.0]), torch.tensor([5.0])]
    comps = [torch.zeros(4), torch.zeros(1)]
    xs = [torch.tensor([float("inf"), -float("inf"), float("nan"), 1.0]), torch.tensor([1.0])]
    want = [t + x for t, x in zip(totals, xs)]
    compensated_add_(totals, comps, xs)
    for got, w in zip(totals, want):
        torch.testing.assert_close(got, w, equal_nan=True)
    assert torch.equal(comps[0], torch.zeros(4))
