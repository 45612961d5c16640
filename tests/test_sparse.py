"""take_rows and row-sparse gradients: against ``weight[index]`` (dense gradient) and float64,
across models in sum_models, with optimizers, FlatGrad and StepInBackward."""

import copy
import gc
import math
import threading
import warnings

import pytest
import torch
from torch import nn

import parsum
from parsum import _sparse
from parsum._sparse import RowSparseAccumulator, coalesce_later, row_sparse
from tests.test_errors import BoomBackward

ROWS, DIM, K = 50, 4, 3


class Sampled(nn.Module):
    """Picks K rows of a table per sample by hashing its own hidden values (value-dependent),
    and scores them: SLIDE's sampled layer in small. ``dense`` indexes with ``table[idx]``."""

    def __init__(self, table: nn.Parameter, seed: int, dense: bool = False) -> None:
        super().__init__()
        self.table = table
        self.proj = nn.Linear(DIM, DIM, dtype=table.dtype)
        self.seed = seed
        self.dense = dense

    def rows(self, h: torch.Tensor) -> torch.Tensor:
        bits = (h > 0).long() * (2 ** torch.arange(DIM))
        code = bits.sum(1, keepdim=True) * 7 + self.seed
        return (code + torch.arange(K) * (self.seed + 1)) % self.table.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(x))
        idx = self.rows(h.detach())
        picked = self.table[idx] if self.dense else parsum.take_rows(self.table, idx)
        return torch.einsum("bd,bkd->bk", h, picked)


def ensemble(n=5, dtype=torch.float32, shared=True, seed=0):
    torch.manual_seed(seed)
    table = nn.Parameter(torch.randn(ROWS, DIM, dtype=dtype))
    return [
        Sampled(table if shared else nn.Parameter(torch.randn(ROWS, DIM, dtype=dtype)), k)
        for k in range(n)
    ]


def dense_copy(models):
    """The same models, sharing as the originals do, indexing with ``table[idx]``."""
    ref = copy.deepcopy(models)
    for m in ref:
        m.dense = True
    return ref


def tables(models):
    return list({id(m.table): m.table for m in models}.values())


def assert_row_sparse_like(grad, dense_grad, **tol):
    assert grad.layout == torch.sparse_coo and grad.sparse_dim() == 1
    rows = grad._indices()[0]
    assert torch.equal(rows, torch.unique(rows)), "rows sorted, each once"
    torch.testing.assert_close(grad.to_dense(), dense_grad, **tol)
    touched = dense_grad.abs().reshape(dense_grad.shape[0], -1).sum(1) > 0
    assert set(rows.tolist()) >= set(touched.nonzero().squeeze(1).tolist())


# -- take_rows on its own ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "index",
    [
        torch.tensor([3, 7, 3, 49]),
        torch.tensor([[0, -1], [-50, 2]]),
        torch.tensor([5, 1, 9], dtype=torch.int32),
        torch.tensor([], dtype=torch.int64),
        torch.tensor(4),
    ],
    ids=["duplicates", "negative-2d", "int32", "empty", "scalar"],
)
# A matrix goes through torch.embedding, other shapes through a Function; the weight's hook
# coalesces both.
@pytest.mark.parametrize("shape", [(ROWS, DIM), (ROWS,), (ROWS, 2, 3)], ids=["2d", "1d", "3d"])
def test_take_rows_is_weight_index_with_a_row_sparse_grad(index, shape):
    weight = torch.randn(*shape, requires_grad=True)
    ref = weight.detach().clone().requires_grad_()
    out = parsum.take_rows(weight, index)
    out_ref = ref[index.long()]
    assert torch.equal(out, out_ref)
    cot = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, weight, cot)
    (grad_ref,) = torch.autograd.grad(out_ref, ref, cot)
    assert grad.is_coalesced()
    assert grad._nnz() == torch.unique(index.long() % ROWS).numel()
    assert_row_sparse_like(grad, grad_ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.complex64])
def test_take_rows_dtypes(dtype):
    # embedding's autograd refuses complex outputs: those take the Function path.
    weight = torch.randn(ROWS, DIM, dtype=dtype, requires_grad=True)
    ref = weight.detach().clone().requires_grad_()
    index = torch.tensor([[3, 7], [3, 0]])
    out = parsum.take_rows(weight, index)
    cot = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, weight, cot)
    (grad_ref,) = torch.autograd.grad(ref[index], ref, cot)
    assert torch.equal(out, ref[index]) and grad.dtype == dtype and grad.is_coalesced()
    assert_row_sparse_like(grad, grad_ref)


def test_take_rows_keeps_trailing_dims():
    weight = torch.randn(10, 2, 3, requires_grad=True)
    index = torch.tensor([[1, 1], [9, 0]])
    out = parsum.take_rows(weight, index)
    assert out.shape == (2, 2, 2, 3)
    out.sum().backward()
    dense = weight.grad.to_dense()
    assert torch.equal(dense[1], torch.full((2, 3), 2.0))
    assert torch.equal(dense[5], torch.zeros(2, 3))


class Densify(torch.autograd.Function):
    """Identity whose backward densifies: gradcheck refuses sparse gradients of dense inputs,
    so this checks take_rows' sparse gradient values through one dense hop."""

    @staticmethod
    def forward(ctx, w):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        return g.to_dense()


@pytest.mark.parametrize("shape", [(20, 3), (20, 2, 2)])
def test_gradcheck_float64(shape):
    weight = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([3, 3, -1, 7, 0, 3])
    assert torch.autograd.gradcheck(lambda w: parsum.take_rows(Densify.apply(w), index), (weight,))


def test_duplicates_are_summed_and_rows_sorted():
    index = torch.tensor([4, 0, 4, 2, 4])
    values = torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0]])
    grad = row_sparse(index, values, torch.Size([6, 1]))
    assert grad.is_coalesced()
    assert grad._indices().tolist() == [[0, 2, 4]]
    assert grad._values().squeeze(1).tolist() == [2.0, 4.0, 9.0]


def test_no_grad_and_a_weight_that_needs_none():
    weight = torch.randn(ROWS, DIM)
    index = torch.tensor([1, 2])
    assert not parsum.take_rows(weight, index).requires_grad
    with torch.no_grad():
        out = parsum.take_rows(weight.requires_grad_(), index)
    assert not out.requires_grad and torch.equal(out, weight[index])


# -- the hook that coalesces a table's gradient --------------------------------------------


@pytest.mark.parametrize("shape", [(ROWS, DIM), (ROWS, 2, 2)], ids=["embedding", "function"])
def test_one_coalesce_for_every_use_of_a_table_in_a_backward(shape):
    weight = torch.randn(*shape, requires_grad=True)
    first, second = torch.tensor([9, 3, 9]), torch.tensor([3, 0])
    loss = parsum.take_rows(weight, first).sum() + 2 * parsum.take_rows(weight, second).sum()
    (grad,) = torch.autograd.grad(loss, weight)
    assert grad.is_coalesced() and grad._indices().tolist() == [[0, 3, 9]]
    assert grad._values().reshape(3, -1)[:, 0].tolist() == [2.0, 3.0, 2.0]
    assert len(weight._backward_hooks) == 1  # put on once, at the first call


def test_the_hook_waits_for_a_table_to_need_a_gradient():
    weight = torch.randn(ROWS, DIM)
    parsum.take_rows(weight, torch.tensor([1]))
    assert not weight._backward_hooks
    weight.requires_grad_()
    (grad,) = torch.autograd.grad(parsum.take_rows(weight, torch.tensor([4, 1, 4])).sum(), weight)
    assert grad.is_coalesced() and grad._indices().tolist() == [[1, 4]]


def test_the_hook_coalesces_other_sparse_gradients_and_passes_dense_ones():
    weight = torch.randn(ROWS, DIM, requires_grad=True)
    parsum.take_rows(weight, torch.tensor([0]))
    index = torch.tensor([6, 2, 6])
    (sparse,) = torch.autograd.grad(
        nn.functional.embedding(index, weight, sparse=True).sum(), weight
    )
    assert sparse.is_coalesced() and sparse._indices().tolist() == [[2, 6]]
    (dense,) = torch.autograd.grad(weight[index].sum(), weight)
    assert dense.layout == torch.strided and dense[6, 0] == 2.0


def test_a_hooked_table_saves_and_copies_without_its_hook(tmp_path):
    model = Sampled(nn.Parameter(torch.randn(ROWS, DIM)), seed=0)
    model(torch.randn(2, DIM))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.save warns about hooks it cannot save
        torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    twin = copy.deepcopy(model)
    for other in (loaded, twin):
        assert not other.table._backward_hooks
        assert torch.equal(other.table, model.table)
        other(torch.randn(3, DIM)).sum().backward()  # hooked again at its first call
        assert len(other.table._backward_hooks) == 1
        assert other.table.grad.coalesce()._nnz() <= 3 * K


def test_threads_reading_a_new_table_put_one_hook_on_it():
    for _ in range(20):
        weight = torch.randn(ROWS, DIM, requires_grad=True)
        start = threading.Barrier(8)

        def read(weight, start):
            start.wait(timeout=10)
            parsum.take_rows(weight, torch.tensor([1, 2]))

        threads = [threading.Thread(target=read, args=(weight, start)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        assert len(weight._backward_hooks) == 1


def test_tables_are_forgotten_with_their_weights():
    before = len(_sparse._tables)
    for _ in range(50):
        parsum.take_rows(torch.randn(ROWS, DIM, requires_grad=True), torch.tensor([1]))
    gc.collect()
    assert len(_sparse._tables) <= before


def test_a_table_loads_with_the_swap_off_around_it(swapping):
    # docs/limits.md ("Conversions that swap tensors"): take_rows holds the weights it read
    # weakly, which torch.utils.swap_tensors refuses; with the swap off the load copies in
    # place and the table's hook keeps coalescing its gradients.
    models = ensemble(n=3)
    checkpoint = copy.deepcopy(models[0].state_dict())
    x = torch.randn(4, DIM)
    parsum.sum_models(models, x).sum().backward()
    with torch.no_grad():
        models[0].table.add_(1.0)
    with pytest.raises(RuntimeError, match="weakref"):
        models[0].load_state_dict(checkpoint)
    torch.__future__.set_swap_module_params_on_conversion(False)  # the fixture restores it
    models[0].load_state_dict(checkpoint)
    assert torch.equal(models[0].table, checkpoint["table"])
    ref = dense_copy(models)
    for m in (*models, *ref):
        m.zero_grad()
    parsum.sum_models(models, x).sum().backward()
    sum(m(x) for m in ref).sum().backward()
    assert_row_sparse_like(models[0].table.grad, ref[0].table.grad)


def test_cost_follows_the_rows_touched_not_the_table():
    # Structural, not timed: nothing of the table's size is allocated by the backward.
    weight = torch.zeros(1_000_000, 8, requires_grad=True)
    index = torch.tensor([5, 999_999, 5])
    (grad,) = torch.autograd.grad(parsum.take_rows(weight, index).sum(), weight)
    assert grad._values().shape == (2, 8)
    assert grad._indices().tolist() == [[5, 999_999]]


@pytest.mark.parametrize(
    "weight, index, match",
    [
        ("table", torch.tensor([0]), r"take_rows: weight is a str; expected a dense tensor"),
        (torch.tensor(1.0), torch.tensor([0]), r"weight is a tensor of shape \(\)"),
        (torch.zeros(3, 2).to_sparse(), torch.tensor([0]), r"layout torch.sparse_coo"),
        (torch.zeros(3, 2), torch.tensor([0.0]), r"index is a torch.float32 tensor; expected"),
        (torch.zeros(3, 2), torch.tensor([True]), r"index is a torch.bool tensor.*mask.nonzero"),
        (torch.zeros(3, 2), [0, 1], r"index is a list"),
        (torch.zeros(3, 2), torch.tensor([0, 3]), r"index holds row 3, outside \[-3, 3\)"),
        (torch.zeros(3, 2), torch.tensor([-4, 1]), r"index holds row -4, outside \[-3, 3\)"),
        (torch.zeros(3, 2, 2), torch.tensor([5]), r"index holds row 5, outside \[-3, 3\)"),
        (torch.zeros(3, 2, device="meta"), torch.tensor([0]), r"index is on cpu, weight on meta"),
    ],
)
def test_bad_input(weight, index, match):
    if isinstance(weight, torch.Tensor) and weight.layout == torch.strided:
        weight.requires_grad_()
    with pytest.raises(parsum.ParsumError, match=match):
        parsum.take_rows(weight, index)
    if isinstance(weight, torch.Tensor):  # a failed call changes nothing
        assert not weight._backward_hooks and _sparse.sampled_elements(weight) is None


def test_refused_under_torch_func():
    weight = torch.randn(ROWS, DIM)
    index = torch.tensor([[1, 2], [3, 4]])
    with pytest.raises(parsum.ParsumError, match=r"torch.func transform .* sparse gradient"):
        torch.vmap(lambda i: parsum.take_rows(weight, i))(index)


# -- in sum_models ----------------------------------------------------------------------------


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shared_table_matches_plain_and_float64(n_jobs, dtype):
    models = ensemble(dtype=dtype)
    ref = dense_copy(models)
    x = torch.randn(8, DIM, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y = parsum.sum_models(models, x, n_jobs=n_jobs)
    y_ref = sum(m(x_ref) for m in ref)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(y, y_ref, **tol)
    (y**2).sum().backward()
    (y_ref**2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)
    (table,), (table_ref,) = tables(models), tables(ref)
    assert_row_sparse_like(table.grad.coalesce(), table_ref.grad, **tol)
    for m, r in zip(models, ref):
        torch.testing.assert_close(m.proj.weight.grad, r.proj.weight.grad, **tol)
    if dtype == torch.float32:
        # Every entry every model wrote, duplicate rows within a model included, summed once:
        # the rounded float64 sum of them all, within half an ulp.
        cotangent = (2 * y).detach()
        entries = []
        for m in models:
            with coalesce_later([table]):  # the raw entries, not a float32 coalesce
                (g,) = torch.autograd.grad(m(x.detach()), table, cotangent)
            assert not g.is_coalesced()
            entries.append(g.double())
        exact = torch.stack([e.coalesce().to_dense() for e in entries]).sum(0)
        err = (table.grad.to_dense().double() - exact).abs()
        assert bool((err <= 0.5 * torch.finfo(dtype).eps * exact.abs() + 1e-30).all())


def test_shared_table_reduction_is_compensated_float64():
    # Three models write 1e16, 1 and -1e16 into the same row: the plain sum loses the 1.
    grads = [
        torch.sparse_coo_tensor(
            [[2]], torch.tensor([[v]], dtype=torch.float64), (4, 1), check_invariants=True
        )
        for v in (1e16, 1.0, -1e16)
    ]
    acc = RowSparseAccumulator()
    for g in grads:
        acc.add(g.coalesce())
    total = acc.result()
    assert total.is_sparse and total._indices().tolist() == [[2]]
    assert total._values().item() == 1.0
    assert sum(g.to_dense() for g in grads)[2].item() == 0.0


def test_row_sparse_reduction_of_disjoint_and_overlapping_rows():
    shape = torch.Size([30, 2])
    for dtype in (torch.float32, torch.float64):
        for rows in ([[5, 1], [7], [0, 29]], [[5, 1], [7, 5], [1, 29, 5]]):
            parts = [
                torch.sparse_coo_tensor(
                    [r], torch.randn(len(r), 2, dtype=dtype), shape, check_invariants=True
                )
                for r in rows
            ]
            acc = RowSparseAccumulator()
            for p in parts:
                acc.add(p)
            total = acc.result()
            want = sorted({row for r in rows for row in r})
            assert total.is_coalesced() and total._indices().tolist() == [want]
            dense = torch.stack([p.to_dense() for p in parts]).double()
            exact = [[math.fsum(dense[:, i, j].tolist()) for j in range(2)] for i in range(30)]
            exact = torch.tensor(exact, dtype=torch.float64).to(dtype)
            if dtype == torch.float32:  # summed in float64 and rounded once
                assert torch.equal(total.to_dense(), exact)
            else:  # Neumaier: within an ulp of the exact sum
                torch.testing.assert_close(total.to_dense(), exact, rtol=2**-52, atol=0)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64]
)
def test_rows_of_two_entries_are_the_correctly_rounded_sum(dtype):
    # No row with three entries: one addition in the dtype itself (its own branch), which
    # must give the bits of the exact sum rounded once, as the wide path does.
    torch.manual_seed(0)
    n_rows, width = 40, 16
    rows = [torch.randperm(n_rows)[:25], torch.randperm(n_rows)[:25]]
    real = torch.float32 if dtype == torch.complex64 else dtype
    span = 6 if dtype == torch.float16 else 30  # far-apart exponents, no overflow
    scale = 2.0 ** torch.randint(-span, span, (2, 25, width))
    values = (torch.randn(2, 25, width, dtype=torch.float64) * scale).to(real)
    values[1, :5] = -values[0, :5] * (1 + 2.0**-10)  # cancellation where rows meet
    if dtype == torch.complex64:
        values = torch.complex(values, values.flip(1))
    acc = RowSparseAccumulator()
    for r, v in zip(rows, values):
        acc.add(torch.sparse_coo_tensor(r.unsqueeze(0), v, (n_rows, width), check_invariants=True))
    total = acc.result()
    assert total.is_coalesced() and total._values().dtype == dtype
    dense = [
        torch.zeros(n_rows, width, dtype=dtype).index_copy_(0, r, v) for r, v in zip(rows, values)
    ]

    def exact(parts):
        terms = torch.stack([p.double() for p in parts]).reshape(2, -1).T.tolist()
        sums = torch.tensor([math.fsum(t) for t in terms], dtype=torch.float64)
        return sums.reshape(n_rows, width).to(real)

    if dtype == torch.complex64:
        want = torch.complex(exact([d.real for d in dense]), exact([d.imag for d in dense]))
    else:
        want = exact(dense)
    assert torch.equal(total.to_dense(), want)


def test_row_sparse_reduction_propagates_inf_and_nan():
    values = [[math.inf], [1.0], [math.nan], [2.0]]
    rows = [[0], [0], [1], [3]]
    for dtype in (torch.float32, torch.float64):
        acc = RowSparseAccumulator()
        for r, v in zip(rows, values):
            acc.add(
                torch.sparse_coo_tensor(
                    [r], torch.tensor([v], dtype=dtype), (4, 1), check_invariants=True
                )
            )
        total = acc.result().to_dense().squeeze(1)
        plain = sum(
            torch.sparse_coo_tensor(
                [r], torch.tensor([v], dtype=dtype), (4, 1), check_invariants=True
            ).to_dense()
            for r, v in zip(rows, values)
        ).squeeze(1)
        torch.testing.assert_close(total, plain, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bitwise_identical_across_n_jobs_and_chunk_sizes(dtype):
    results = []
    for n_jobs, chunk_size in [(1, None), (2, None), (3, 2), (2, 1), (1, 4)]:
        models = ensemble(n=7, dtype=dtype, seed=3)
        x = torch.randn(16, DIM, dtype=dtype)
        y = parsum.sum_models(models, x, n_jobs=n_jobs, chunk_size=chunk_size)
        (grad,) = torch.autograd.grad(y.sum(), tables(models))
        results.append((y, grad))
    for y, grad in results[1:]:
        assert torch.equal(y, results[0][0])
        assert torch.equal(grad._indices(), results[0][1]._indices())
        assert torch.equal(grad._values(), results[0][1]._values())


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_only_shared_tables_defer_their_coalesce_and_only_inside_the_pullbacks(n_jobs):
    shared, own = ensemble(n=3), ensemble(n=3, shared=False, seed=1)
    models = shared + own
    x = torch.randn(8, DIM)
    got = torch.autograd.grad(
        parsum.sum_models(models, x, n_jobs=n_jobs).sum(), [*tables(shared), *tables(own)]
    )
    for g in got:  # the shared sum and the tables of their own: rows sorted, each once
        rows = g._indices()[0]
        assert torch.equal(rows, torch.unique(rows))
    (table,) = tables(shared)
    (g,) = torch.autograd.grad(parsum.take_rows(table, torch.tensor([3, 1, 3])).sum(), table)
    assert g.is_coalesced() and g._indices().tolist() == [[1, 3]]


def test_a_model_using_the_whole_table_makes_the_sum_dense():
    class Whole(nn.Module):
        def __init__(self, table):
            super().__init__()
            self.table = table

        def forward(self, x):
            return x @ self.table[:K].T + self.table.sum() * 0.01

    models = ensemble(n=3)
    models.insert(1, Whole(models[0].table))
    ref = copy.deepcopy(models)
    for m in ref:
        if isinstance(m, Sampled):
            m.dense = True
    x = torch.randn(8, DIM)
    for n_jobs, chunk_size in [(1, None), (2, 1)]:
        table = models[0].table
        table.grad = None
        parsum.sum_models(models, x, n_jobs=n_jobs, chunk_size=chunk_size).sum().backward()
        assert table.grad.layout == torch.strided
    sum(m(x) for m in ref).sum().backward()
    torch.testing.assert_close(models[0].table.grad, ref[0].table.grad)


def test_table_passed_as_an_argument_gets_a_row_sparse_input_gradient():
    table = torch.randn(ROWS, DIM, requires_grad=True)

    class Picks(nn.Module):
        def __init__(self, rows):
            super().__init__()
            self.rows = rows

        def forward(self, x, t):
            return x * parsum.take_rows(t, self.rows).sum(0)

    models = [Picks(torch.tensor([k, k + 1, 40])) for k in range(4)]
    x = torch.randn(2, DIM)
    y = parsum.sum_models(models, x, table, n_jobs=2)
    (grad,) = torch.autograd.grad(y.sum(), table)
    t_ref = table.detach().clone().requires_grad_()
    (grad_ref,) = torch.autograd.grad(sum(x * t_ref[m.rows].sum(0) for m in models).sum(), t_ref)
    assert_row_sparse_like(grad, grad_ref)
    assert grad._indices().tolist() == [[0, 1, 2, 3, 4, 40]]


def test_weights_scale_the_sparse_gradients():
    models = ensemble(n=3)
    ref = dense_copy(models)
    x = torch.randn(8, DIM)
    w = [0.5, -2.0, 3.0]
    parsum.sum_models(models, x, weights=w).sum().backward()
    sum(wi * m(x) for wi, m in zip(w, ref)).sum().backward()
    assert_row_sparse_like(tables(models)[0].grad.coalesce(), tables(ref)[0].grad)


def test_engines():
    x = torch.randn(8, DIM)
    models = ensemble(n=3)
    with pytest.raises(parsum.ParsumError, match=r"model 0 \(Sampled\) raised .*take_rows"):
        parsum.sum_models(models, x, engine="vjp")
    assert all(t.grad is None for t in tables(models))
    # Identical models with tables of their own: "stacked" fails naming the group, "auto" runs
    # them one by one and keeps the gradients sparse.
    torch.manual_seed(0)
    same = [Sampled(nn.Parameter(torch.randn(ROWS, DIM)), seed=1) for _ in range(8)]
    with pytest.raises(parsum.ParsumError, match=r"stacked with models \[1, 2"):
        parsum.sum_models(same, x, engine="stacked")
    ref = dense_copy(same)
    for _ in range(2):
        for m in same:
            m.table.grad = None
        parsum.sum_models(same, x, engine="auto").sum().backward()
    sum(m(x) for m in ref).sum().backward()
    for m, r in zip(same, ref):
        assert m.table.grad.layout == torch.sparse_coo
        torch.testing.assert_close(m.table.grad.to_dense(), r.table.grad)


def test_no_grad_call():
    models = ensemble(n=3)
    x = torch.randn(8, DIM)
    with torch.no_grad():
        y = parsum.sum_models(models, x, n_jobs=2)
    torch.testing.assert_close(y, sum(m(x) for m in dense_copy(models)))


# -- optimizers -------------------------------------------------------------------------------


def train(models, opt_cls, steps=3, use_parsum=True, **kw):
    params = list({id(p): p for m in models for p in m.parameters()}.values())
    sparse = [t for t in tables(models)]
    dense = [p for p in params if all(p is not t for t in sparse)]
    opts = [opt_cls(sparse, **kw), torch.optim.SGD(dense, lr=0.05)]
    torch.manual_seed(7)
    for _ in range(steps):
        x = torch.randn(8, DIM)
        y = parsum.sum_models(models, x) if use_parsum else sum(m(x) for m in models)
        (y**2).mean().backward()
        for o in opts:
            o.step()
            o.zero_grad()


@pytest.mark.parametrize(
    "opt_cls, kw",
    [(torch.optim.SGD, dict(lr=0.1)), (torch.optim.SparseAdam, dict(lr=0.01))],
    ids=["SGD", "SparseAdam"],
)
def test_optimizers_train_as_with_plain_sparse_pytorch(opt_cls, kw):
    models = ensemble()
    ref = copy.deepcopy(models)  # take_rows in both: plain PyTorch over the same sparse grads
    train(models, opt_cls, **kw)
    train(ref, opt_cls, use_parsum=False, **kw)
    for p, q in zip(
        tables(models) + [m.proj.weight for m in models], tables(ref) + [m.proj.weight for m in ref]
    ):
        torch.testing.assert_close(p, q)


def test_sgd_leaves_untouched_rows_unchanged():
    models = ensemble()
    (table,) = tables(models)
    before = table.detach().clone()
    x = torch.randn(8, DIM)
    touched = torch.unique(torch.cat([m.rows(torch.tanh(m.proj(x))).flatten() for m in models]))
    opt = torch.optim.SGD([table], lr=0.5)
    parsum.sum_models(models, x).sum().backward()
    opt.step()
    untouched = torch.ones(ROWS, dtype=torch.bool)
    untouched[touched] = False
    assert untouched.any() and touched.numel() > 0
    assert torch.equal(table.detach()[untouched], before[untouched])
    assert not torch.equal(table.detach()[touched], before[touched])


# -- FlatGrad and StepInBackward --------------------------------------------------------------


@pytest.mark.parametrize("compensated", [False, True])
@pytest.mark.parametrize("n_jobs", [1, 2])
def test_flatgrad_slot_takes_the_rows_in_place(compensated, n_jobs):
    models = ensemble(shared=False)
    ref = dense_copy(models)
    flat = parsum.FlatGrad(models, compensated=compensated)
    x = torch.randn(8, DIM)
    for _ in range(2):  # the second backward accumulates into the slots
        parsum.sum_models(models, x, n_jobs=n_jobs).sum().backward()
        sum(m(x) for m in ref).sum().backward()
    for m, r in zip(models, ref):
        assert m.table.grad.layout == torch.strided
        assert m.table.grad.data_ptr() >= flat.flat.data_ptr()
        torch.testing.assert_close(m.table.grad, r.table.grad)
    flat.zero_()
    for r in ref:
        r.zero_grad()
    parsum.sum_models(models, x).sum().backward()
    sum(m(x) for m in ref).sum().backward()
    for m, r in zip(models, ref):
        torch.testing.assert_close(m.table.grad, r.table.grad)


def test_flatgrad_shared_table_slot():
    models = ensemble()
    ref = dense_copy(models)
    flat = parsum.FlatGrad(models)
    x = torch.randn(8, DIM)
    parsum.sum_models(models, x, n_jobs=2).sum().backward()
    sum(m(x) for m in ref).sum().backward()
    (table,) = tables(models)
    assert table.grad.layout == torch.strided and table.grad._base is flat.flat
    torch.testing.assert_close(table.grad, tables(ref)[0].grad)


@pytest.mark.parametrize(
    "opt_cls, kw",
    [(torch.optim.SGD, dict(lr=0.1)), (torch.optim.SparseAdam, dict(lr=0.01))],
    ids=["SGD", "SparseAdam"],
)
def test_step_in_backward_with_tables_of_their_own(opt_cls, kw):
    models = ensemble(shared=False)
    for m in models:
        m.proj.requires_grad_(False)  # SparseAdam takes sparse gradients only
    ref = copy.deepcopy(models)
    sib = parsum.StepInBackward(models, opt_cls, **kw)
    opts = [opt_cls([m.table], **kw) for m in ref]
    x = torch.randn(8, DIM)
    before = [m.table.detach().clone() for m in models]
    for _ in range(2):
        parsum.sum_models(models, x, step_in_backward=sib, n_jobs=2).sum().backward()
        sum(m(x) for m in ref).sum().backward()
        for o in opts:
            o.step()
            o.zero_grad()
    for m, r, b in zip(models, ref, before):
        assert m.table.grad is None
        torch.testing.assert_close(m.table, r.table)
        changed = (m.table.detach() != b).any(1)
        assert changed.any()
        if opt_cls is torch.optim.SGD:  # the step touched the sampled rows only
            touched = torch.zeros(ROWS, dtype=torch.bool)
            touched[m.rows(torch.tanh(m.proj(x))).flatten()] = True
            assert torch.equal(changed, touched)


def test_step_in_backward_steps_with_coalesced_rows_and_refuses_a_users_hook():
    seen = []

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            seen.extend(p.grad.is_coalesced() for g in self.param_groups for p in g["params"])
            return super().step(closure)

    models = ensemble(n=2, shared=False)
    for m in models:
        m.proj.requires_grad_(False)
    sib = parsum.StepInBackward(models, Recording, lr=0.1)
    x = torch.randn(8, DIM)
    for _ in range(2):  # the second call finds take_rows' hook on the tables: accepted
        parsum.sum_models(models, x, step_in_backward=sib).sum().backward()
    assert seen == [True] * 4
    models[1].table.register_hook(lambda g: g)
    with pytest.raises(parsum.ParsumError, match=r"'table' of models\[1\] .* gradient hook"):
        parsum.sum_models(models, x, step_in_backward=sib)


def test_compensated_flatgrad_keeps_small_sparse_additions():
    table = nn.Parameter(torch.zeros(ROWS, 1))

    class Row(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = table

        def forward(self, c):
            return parsum.take_rows(self.table, torch.tensor([7])) * c

    flat = parsum.FlatGrad([table], compensated=True)
    models = [Row()]
    for c in [1.0] + [1e-8] * 100:  # micro-batches into one .grad
        parsum.sum_models(models, torch.tensor(c)).sum().backward()
    want = torch.tensor(math.fsum([1.0] + [1e-8] * 100), dtype=torch.float32)
    assert table.grad[7, 0] == want != 1.0
    assert table.grad._base is flat.flat and table.grad.count_nonzero() == 1


@pytest.mark.parametrize("with_flat", [False, True])
def test_failed_backward_changes_no_sparse_grad(with_flat):
    models = ensemble(n=4)
    (table,) = tables(models)
    models.insert(3, BoomBackward(DIM, K))
    flat = parsum.FlatGrad(models) if with_flat else None
    x = torch.randn(8, DIM)
    with pytest.raises(parsum.ParsumError, match=r"model 3 \(BoomBackward\) raised ValueError"):
        parsum.sum_models(models, x, n_jobs=2, chunk_size=1).sum().backward()
    if flat is None:
        assert table.grad is None
    else:
        assert table.grad._base is flat.flat and table.grad.count_nonzero() == 0
    assert not _sparse._deferred.ids  # take_rows coalesces again in this thread


def test_a_sampled_table_counts_its_rows_touched_in_the_thread_decision():
    # A large table read through take_rows is a small model's work: with n_jobs left to parsum,
    # auto keeps such models in the calling thread (NOTE [ Threads that pay ]).
    from parsum._engines import ModelParams
    from parsum._grouping import Batch, useful_workers
    from parsum._sparse import sampled_elements

    torch.manual_seed(0)
    big = nn.Parameter(torch.randn(200_000, DIM))
    models = [Sampled(big, k) for k in range(4)]
    x = torch.randn(8, DIM)
    params = [ModelParams.of(m) for m in models]
    assert sampled_elements(big) is None
    assert useful_workers(params, Batch.of([x]), 16) > 1  # 800K elements a model, times the batch
    parsum.sum_models(models, x)
    assert sampled_elements(big) == 8 * K * DIM
    assert useful_workers(params, Batch.of([x]), 16) == 1
    seen = []
    for m in models:
        m.register_forward_hook(lambda *_: seen.append(threading.current_thread()))
    parsum.sum_models(models, x, chunk_size=1)
    assert seen == [threading.current_thread()] * len(models)
