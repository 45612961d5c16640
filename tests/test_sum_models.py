"""sum_models against the plain PyTorch expression, float64 and gradcheck."""

import copy
import functools

import numpy as np
import pytest
import torch
import torch.nn.utils.prune
from torch import nn

import parsum
from parsum import _engines as engines
from tests.zoo import (
    IN,
    OUT,
    ReturnsItsArgument,
    TwoHeads,
    clone_models,
    doubling_hook,
    mlp,
    param_grads,
    plain_sum,
    unique_params,
    zoo,
)

ENGINES = ["autograd", "vjp", "auto"]
N_JOBS = [1, 2, 3]
DTYPES = [torch.float32, torch.float64]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}


def run_both(models, x, weights=None, loss=lambda y: (y**2).sum(), **kw):
    """Forward + backward with parsum and with the plain expression on copies."""
    ref_models = clone_models(models)
    x_ref = x.detach().clone().requires_grad_(x.requires_grad)
    w_ref = weights
    if isinstance(weights, torch.Tensor):
        w_ref = weights.detach().clone().requires_grad_(weights.requires_grad)
    elif isinstance(weights, list) and any(isinstance(w, torch.Tensor) for w in weights):
        w_ref = [w.detach().clone().requires_grad_(w.requires_grad) for w in weights]
    y = parsum.sum_models(models, x, weights=weights, **kw)
    loss(y).backward()
    y_ref = plain_sum(ref_models, x_ref, weights=w_ref)
    loss(y_ref).backward()
    return (y, x, models, weights), (y_ref, x_ref, ref_models, w_ref)


def assert_matches(got, want, **tol):
    """``run_both``'s two results alike: the sum, the argument's gradient, every parameter's,
    and a weight tensor's where it requires grad."""
    (y, x, models, w), (y_ref, x_ref, ref_models, w_ref) = got, want
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)
    assert_same_grads(models, ref_models, **tol)
    if isinstance(w, torch.Tensor) and w.requires_grad:
        torch.testing.assert_close(w.grad, w_ref.grad, **tol)


def assert_same_grads(models, ref_models, **tol):
    got, want = param_grads(models), param_grads(ref_models)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_jobs", N_JOBS)
@pytest.mark.parametrize("engine", ENGINES)
def test_matches_plain_sum(engine, n_jobs, dtype):
    models = zoo(dtype)
    x = torch.randn(5, IN, dtype=dtype, requires_grad=True)
    assert_matches(*run_both(models, x, engine=engine, n_jobs=n_jobs), **TOL[dtype])


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("weights_kind", ["floats", "tensor", "tensor_grad"])
def test_weights(engine, weights_kind):
    models = zoo(torch.float64)
    values = [0.5, -1.25, 2.0, 0.1, 3.0, -0.7, 1.0]
    weights = (
        values
        if weights_kind == "floats"
        else torch.tensor(values, dtype=torch.float64, requires_grad=weights_kind == "tensor_grad")
    )
    x = torch.randn(4, IN, dtype=torch.float64, requires_grad=True)
    assert_matches(
        *run_both(models, x, weights=weights, engine=engine, n_jobs=2), **TOL[torch.float64]
    )


@pytest.mark.parametrize("n_jobs", N_JOBS)
def test_weights_as_a_list_of_scalar_tensors_each_get_their_gradient(n_jobs):
    # As in the plain loop's w[i] * m_i(x): learned weights that are parameters of their own.
    torch.manual_seed(0)
    models = zoo(torch.float64)
    weights = [
        nn.Parameter(torch.tensor(0.25 * (i + 1), dtype=torch.float64)) if i % 3 else
        torch.tensor(-0.5, dtype=torch.float64)
        for i in range(len(models))
    ]  # fmt: skip
    x = torch.randn(4, IN, dtype=torch.float64, requires_grad=True)
    got, want = run_both(models, x, weights=weights, n_jobs=n_jobs)
    assert_matches(got, want, **TOL[torch.float64])
    ref_weights = want[3]
    for w, r in zip(weights, ref_weights):
        assert (w.grad is None) == (r.grad is None) == (not w.requires_grad)
        if w.grad is not None:
            torch.testing.assert_close(w.grad, r.grad, **TOL[torch.float64])


@pytest.mark.parametrize(
    ("bad", "match"),
    [([torch.tensor(0.5), 1.0], r"weights\[1\] is 1.0 \(float\) among weights that are tensors"),
     ([torch.ones(1), torch.ones(1)], r"weights\[0\] is tensor\(\[1.\]\) \(Tensor\)")],
)  # fmt: skip
def test_a_list_of_weights_mixing_tensors_is_refused(bad, match):
    models = zoo()[:2]
    with pytest.raises(parsum.ParsumError, match=match):
        parsum.sum_models(models, torch.randn(2, IN), weights=bad)
    assert all(p.grad is None for m in models for p in m.parameters())


def test_numpy_weights_are_its_floats():
    models = zoo()
    x = torch.randn(4, IN)
    values = np.linspace(-1.0, 2.0, len(models))  # float64, as numpy makes them
    want = parsum.sum_models(models, x, weights=[float(v) for v in values])
    torch.testing.assert_close(parsum.sum_models(models, x, weights=values), want, rtol=0, atol=0)


def test_average_with_float32_weight_tensor_keeps_output_dtype():
    models = zoo()
    w = torch.full((7,), 1 / 7, dtype=torch.float64)
    y = parsum.sum_models(models, torch.randn(2, IN), weights=w)
    assert y.dtype == torch.float32


@pytest.mark.parametrize("engine", ENGINES)
def test_gradcheck_inputs_and_weights(engine):
    models = zoo(torch.float64)[:4]
    x = torch.randn(3, IN, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)

    def f(x, w):
        return parsum.sum_models(models, x, weights=w, engine=engine, n_jobs=2)

    assert torch.autograd.gradcheck(f, (x, w))


def test_gradcheck_parameters_through_functional_call():
    models = zoo(torch.float64)[:3]
    x = torch.randn(3, IN, dtype=torch.float64)
    target = models[1][0].weight  # one parameter, checked numerically as an input

    def f(weight):
        with torch.nn.utils.stateless._reparametrize_module(models[1], {"0.weight": weight}):
            return parsum.sum_models(models, x, n_jobs=2)

    assert torch.autograd.gradcheck(f, (target.detach().clone().requires_grad_(),))


def complex_models(n=4):
    """Complex MLPs, two of them identical in shape (so that auto may stack them)."""
    widths = [3, 3, 5, 2][:n]
    return [
        nn.Sequential(
            nn.Linear(IN, w, dtype=torch.complex128), nn.Linear(w, OUT, dtype=torch.complex128)
        )
        for w in widths
    ]


@pytest.mark.parametrize("n_jobs", N_JOBS)
@pytest.mark.parametrize("engine", [*ENGINES, "stacked"])
@pytest.mark.parametrize("weight_dtype", [torch.float64, torch.complex128])
def test_complex_outputs_with_a_weight_tensor_get_pytorchs_gradients(weight_dtype, engine, n_jobs):
    # The cotangents carry conj(w) and the weights' gradient conj(output), its real part for a
    # real weight (NOTE [ Complex weights ]): both had been left out, silently.
    torch.manual_seed(0)
    models = complex_models()
    x = torch.randn(4, IN, dtype=torch.complex128, requires_grad=True)
    w = torch.randn(len(models), dtype=weight_dtype, requires_grad=True)
    got, want = run_both(
        models, x, weights=w, loss=lambda y: (y.abs() ** 2).sum() + y.real.sum(),
        engine=engine, n_jobs=n_jobs,
    )  # fmt: skip
    assert got[0].dtype == want[0].dtype == torch.complex128
    assert got[3].grad.dtype == weight_dtype
    assert_matches(got, want, **TOL[torch.float64])


@pytest.mark.parametrize("weight_dtype", [torch.float64, torch.complex128])
def test_gradcheck_complex_inputs_and_weights(weight_dtype):
    torch.manual_seed(0)
    models = complex_models(3)
    x = torch.randn(2, IN, dtype=torch.complex128, requires_grad=True)
    w = torch.randn(3, dtype=weight_dtype, requires_grad=True)
    for n_jobs in (1, 2):
        f = functools.partial(parsum.sum_models, models, n_jobs=n_jobs)
        assert torch.autograd.gradcheck(lambda x, w, f=f: f(x, weights=w), (x, w))


def _refusing_weights(engine, weights, match):
    """Calls with ``weights`` on models with BatchNorm raise a ParsumError matching ``match``
    for n_jobs 1 and 2, changing no buffer and no gradient; the models."""
    torch.manual_seed(0)
    models = [
        nn.Sequential(nn.Linear(IN, 4), nn.BatchNorm1d(4), nn.Linear(4, OUT)) for _ in range(3)
    ]
    if engine == "vjp":  # which runs no model that updates its buffers
        models = [m.eval() for m in models]
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    for n_jobs in (1, 2):
        with pytest.raises(parsum.ParsumError, match=match):
            parsum.sum_models(
                models, torch.randn(5, IN), weights=weights, engine=engine, n_jobs=n_jobs
            )
    for m, state in zip(models, before):
        for k, v in m.state_dict().items():
            assert torch.equal(v, state[k]), k
        assert all(p.grad is None for p in m.parameters())
    return models


@pytest.mark.parametrize("engine", [*ENGINES, "stacked"])
def test_complex_weights_on_real_outputs_are_refused_and_change_nothing(engine):
    w = torch.randn(3, dtype=torch.complex64, requires_grad=True)
    _refusing_weights(engine, w, "weights is a complex tensor")


def test_complex_weights_on_real_outputs_in_stacked_storage_are_refused():
    torch.manual_seed(0)
    models = [nn.Linear(IN, OUT) for _ in range(4)]
    parsum.stack_(models)
    w = torch.randn(4, dtype=torch.complex64)
    with pytest.raises(parsum.ParsumError, match="weights is a complex tensor"):
        parsum.sum_models(models, torch.randn(5, IN), weights=w)
    y = parsum.sum_models(models, torch.randn(5, IN), weights=w.real)  # still usable
    y.sum().backward()
    assert all(m.weight.grad is not None for m in models)


@pytest.mark.parametrize("engine", [*ENGINES, "stacked"])
def test_a_weight_tensor_on_another_device_is_refused_naming_the_model_and_changes_nothing(
    engine,
):
    # The plain loop cannot multiply CPU outputs by a weight on another device (a meta tensor
    # here, a CUDA one on a GPU machine): parsum names the devices and the model where it
    # raised PyTorch's device error from inside its sum, after running the models.
    w = torch.ones(3, device="meta", requires_grad=True)
    match = r"weights is a tensor on meta and model 0 \(Sequential\) returns an output on cpu"
    models = _refusing_weights(engine, w, match + r".*weights.to\('cpu'\)")
    x = torch.randn(5, IN)
    with pytest.raises(RuntimeError):
        plain_sum(clone_models(models), x, weights=w)
    # On the CPU, any weight tensor goes with CPU outputs, a double one with float outputs too.
    w = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    y = parsum.sum_models(models, x, weights=w, engine=engine)
    torch.testing.assert_close(y, plain_sum(clone_models(models), x, weights=w))


def test_weight_tensors_the_plain_loop_refuses_are_refused_inside_torch_func_transforms():
    # There the models run in the calling thread and their sum in plain operations (NOTE
    # [ Inside a transform ] in _transformed): the same refusals as outside, named.
    models = [mlp([4 + i]) for i in range(3)]
    x = torch.randn(5, IN)
    meta = torch.ones(3, device="meta")
    with pytest.raises(parsum.ParsumError, match=r"weights is a tensor on meta and model 0"):
        torch.func.vmap(lambda x: parsum.sum_models(models, x, weights=meta))(x.unsqueeze(0))
    complex_w = torch.ones(3, dtype=torch.complex64)
    with pytest.raises(parsum.ParsumError, match="weights is a complex tensor"):
        torch.func.grad(lambda x: parsum.sum_models(models, x, weights=complex_w).real.sum())(x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_weight_tensor_for_cpu_models_is_refused():
    torch.manual_seed(0)
    models = [mlp([8 + i]) for i in range(3)]
    w = torch.ones(3, device="cuda")
    with pytest.raises(parsum.ParsumError, match="weights is a tensor on cuda:0 and model 0"):
        parsum.sum_models(models, torch.randn(5, IN), weights=w)


class ReturnsItsParameter(nn.Module):
    """An output that is the parameter itself: its gradient is the cotangent as it comes."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.randn(1, OUT))

    def forward(self, x):
        return self.b


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("engine", [*ENGINES, "stacked"])
def test_parameters_returned_as_outputs_get_gradients_of_their_own(engine, n_jobs):
    # functorch hands the cotangent back as such a parameter's gradient, and without weights
    # every model's cotangent is one tensor: the models' .grad had been one memory, which the
    # second call's accumulation added to once per model (vjp's engine).
    torch.manual_seed(0)
    models = [ReturnsItsParameter() for _ in range(3)] + [nn.Linear(IN, OUT)]
    plain = clone_models(models)
    xs = [torch.randn(1, IN) for _ in range(2)]
    for x in xs:
        parsum.sum_models(models, x, engine=engine, n_jobs=n_jobs).pow(2).sum().backward()
        plain_sum(plain, x).pow(2).sum().backward()
    grads = [p.grad for m in models for p in m.parameters()]
    assert len({g.data_ptr() for g in grads}) == len(grads)
    assert_same_grads(models, plain)


class TwoInputs(nn.Module):
    """Several positional, nested and keyword tensor arguments; a pytree output."""

    def __init__(self, width):
        super().__init__()
        self.a = nn.Linear(IN, width)
        self.b = nn.Linear(IN, width)

    def forward(self, x, pair, *, scale, extra=None):
        h = torch.tanh(self.a(x)) * scale + self.b(pair[0]) * pair[1]["gate"]
        return {"sum": h.sum(-1), "parts": (h, h.mean(0) * extra["bias"])}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("n_jobs", [1, 2])
def test_nested_args_kwargs_and_pytree_outputs(engine, n_jobs):
    torch.manual_seed(0)
    models = [TwoInputs(4) for _ in range(3)]
    ref_models = clone_models(models)
    dt = torch.float64
    models = [m.to(dt) for m in models]
    ref_models = [m.to(dt) for m in ref_models]
    leaves = [
        torch.randn(2, IN, dtype=dt),
        torch.randn(2, IN, dtype=dt),
        torch.randn(2, 4, dtype=dt),
        torch.randn((), dtype=dt),
        torch.randn(4, dtype=dt),
    ]
    mine = [t.clone().requires_grad_() for t in leaves]
    ref = [t.clone().requires_grad_() for t in leaves]

    def call(fn, ms, t):
        return fn(ms, t[0], (t[1], {"gate": t[2]}), scale=t[3], extra={"bias": t[4], "n": 3})

    def loss(out):
        return out["sum"].sum() + (out["parts"][0] ** 2).sum() + out["parts"][1].sum() * 3

    y = call(
        lambda ms, *a, **k: parsum.sum_models(ms, *a, engine=engine, n_jobs=n_jobs, **k),
        models,
        mine,
    )
    y_ref = call(plain_sum, ref_models, ref)
    loss(y).backward()
    loss(y_ref).backward()
    assert set(y) == {"sum", "parts"} and isinstance(y["parts"], tuple)
    torch.testing.assert_close(y, y_ref)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a.grad, b.grad)
    assert_same_grads(models, ref_models)


@pytest.mark.parametrize("engine", ENGINES)
def test_same_module_twice_and_tied_parameters(engine):
    torch.manual_seed(0)
    shared_layer = nn.Linear(IN, OUT).double()
    a = mlp([4]).double()
    tied = nn.Sequential(shared_layer, nn.Tanh())
    models = [a, shared_layer, tied, a, mlp([3]).double()]  # a twice; shared_layer in two models
    x = torch.randn(3, IN, dtype=torch.float64, requires_grad=True)
    (y, x, models, _), (y_ref, x_ref, ref_models, _) = run_both(
        models, x, engine=engine, n_jobs=2, chunk_size=1
    )
    tol = TOL[torch.float64]
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)
    assert_same_grads(models, ref_models, **tol)


@pytest.mark.parametrize("engine", ENGINES)
def test_frozen_parameters_get_no_gradient(engine):
    models = zoo(torch.float64)
    for p in models[0].parameters():
        p.requires_grad_(False)
    models[3].conv.weight.requires_grad_(False)
    x = torch.randn(3, IN, dtype=torch.float64, requires_grad=True)
    (y, x, models, _), (y_ref, x_ref, ref_models, _) = run_both(models, x, engine=engine, n_jobs=2)
    torch.testing.assert_close(y, y_ref, **TOL[torch.float64])
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL[torch.float64])
    assert all(p.grad is None for p in models[0].parameters())
    assert models[3].conv.weight.grad is None
    assert_same_grads(models, ref_models, **TOL[torch.float64])


def test_only_parameters_need_grad():
    models = zoo()
    x = torch.randn(4, IN)  # no requires_grad
    (y, x, models, _), (y_ref, _, ref_models, _) = run_both(models, x, n_jobs=2)
    torch.testing.assert_close(y, y_ref, **TOL[torch.float32])
    assert x.grad is None
    assert_same_grads(models, ref_models, **TOL[torch.float32])


class _ReadsIndices(nn.Module):
    """A frozen table looked up at indices made from the argument: no gradient reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, OUT).requires_grad_(False)

    def forward(self, x):
        return self.table((x.abs() * 3).long().clamp(max=9)).sum(1)


@pytest.mark.parametrize("engine", ["auto", "autograd", "stacked", "functions"])
@pytest.mark.parametrize("n_jobs", [1, 2])
def test_a_sum_of_outputs_that_need_no_gradient_needs_none_as_in_the_plain_loop(engine, n_jobs):
    # An argument that needs a gradient, read by no model differentiably: the plain loop's sum
    # needs no gradient (its backward raises), and a weight that needs one is all it has.
    # Modules run in the caller's graph, plain functions through ParallelSum.
    models: list = [_ReadsIndices() for _ in range(3)]
    if engine == "functions":
        engine = "auto"
        models = [lambda x, m=m: m(x) for m in models]
    x = torch.randn(4, IN, requires_grad=True)
    want = sum(m(x) for m in models)
    y = parsum.sum_models(models, x, engine=engine, n_jobs=n_jobs)
    assert not want.requires_grad and not y.requires_grad
    torch.testing.assert_close(y, want)
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.sum().backward()
    w = torch.tensor([0.5, 2.0, -1.0], requires_grad=True)
    w_ref = w.detach().clone().requires_grad_()
    parsum.sum_models(models, x, weights=w, engine=engine, n_jobs=n_jobs).sum().backward()
    sum(w_ref[i] * m(x) for i, m in enumerate(models)).sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad)
    assert x.grad is None


def test_plain_callables_and_non_module_models():
    w = torch.randn(IN, OUT, dtype=torch.float64)
    fns = [lambda x: x @ w, lambda x: torch.sin(x) @ w, lambda x: (x**2) @ w]
    x = torch.randn(3, IN, dtype=torch.float64, requires_grad=True)
    for engine in ENGINES:
        assert torch.autograd.gradcheck(
            lambda x, e=engine: parsum.sum_models(fns, x, engine=e, n_jobs=2), (x,)
        )


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("engine", ["autograd", "stacked", "auto"])
def test_bound_methods_and_partials_of_modules_train_their_module(engine, n_jobs):
    # m.encode and functools.partial(m, ...) use m's parameters: they get gradients, as in the
    # plain loop; a module used by two entries gets the sum of both.
    torch.manual_seed(0)
    owners = [TwoHeads() for _ in range(3)]
    ref = clone_models(owners)

    def entries(ms):
        return [ms[0].encode, functools.partial(ms[1].encode, scale=2.0), ms[2], ms[2].encode]

    x = torch.randn(5, IN, dtype=torch.float32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y = parsum.sum_models(entries(owners), x, engine=engine, n_jobs=n_jobs)
    y.square().sum().backward()
    plain_sum(entries(ref), x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL[torch.float32])
    assert_same_grads(owners, ref, **TOL[torch.float32])
    assert all(p.grad is not None for p in owners[2].parameters())


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_callables_that_capture_what_needs_a_gradient_raise(n_jobs):
    # A lambda around a module, or one that captures a tensor that requires grad, would lose
    # that gradient: parsum says so instead, naming the model, and changes nothing.
    owner = TwoHeads()
    table = torch.randn(IN, OUT, requires_grad=True)
    outer = table * 2  # a tensor of the caller's graph
    x = torch.randn(3, IN, requires_grad=True)
    for i, bad in enumerate(
        [lambda x: owner(x), lambda x: x @ table, lambda x: x @ outer, lambda x: owner.head.bias]
    ):
        models = [owner, bad]
        with pytest.raises(
            parsum.ParsumError, match=r"model 1 \(function <lambda>\) raised .* not one of"
        ):
            parsum.sum_models(models, x, n_jobs=n_jobs, engine="autograd")
        assert x.grad is None and table.grad is None
        assert all(p.grad is None for p in owner.parameters()), i
    fine = [lambda x: x @ table.detach(), lambda x: torch.sin(x) @ table.detach(), owner.encode]
    parsum.sum_models(fine, x, n_jobs=n_jobs).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    plain_sum(fine, x_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)

    def slope(t, scale):  # differentiates with respect to an argument it marks itself
        t = t.requires_grad_()
        return torch.autograd.grad(torch.sin(t).sum(), t, create_graph=True)[0] * scale

    scale = torch.tensor(3.0, requires_grad=True)
    got = parsum.sum_models([slope, slope], torch.linspace(0, 1, 5), scale, n_jobs=n_jobs)
    got.sum().backward()
    torch.testing.assert_close(got, 6 * torch.cos(torch.linspace(0, 1, 5)))
    torch.testing.assert_close(scale.grad, 2 * torch.cos(torch.linspace(0, 1, 5)).sum())


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_models_reaching_what_needs_a_gradient_raise_on_data_that_needs_none(n_jobs):
    # With no parameter and no argument that needs a gradient the call builds no graph; the
    # outputs of such models needed one anyway and were summed detached, so the captured
    # module or table got no gradient, silently (found in the fortieth session).
    owner = TwoHeads()
    table = torch.randn(IN, OUT, requires_grad=True)

    class ReadsAGlobal(nn.Module):  # no parameters of its own
        def forward(self, x):
            return owner(x)

    x = torch.randn(3, IN)
    cases = [
        ([lambda x: owner(x), lambda x: x @ table], r"model 0 \(function <lambda>\).* not one of"),
        ([ReadsAGlobal(), ReadsAGlobal()], r"model 0 \(ReadsAGlobal\).* not its parameters"),
    ]
    for models, message in cases:
        for engine in ["auto", "autograd"]:
            with pytest.raises(parsum.ParsumError, match=message):
                parsum.sum_models(models, x, n_jobs=n_jobs, engine=engine)
        assert table.grad is None and all(p.grad is None for p in owner.parameters())
        with torch.no_grad():  # no gradient wanted: the plain sum
            torch.testing.assert_close(parsum.sum_models(models, x), plain_sum(models, x))
    fine = [lambda x: x @ table.detach(), lambda x: torch.sin(x) @ table.detach()]
    y = parsum.sum_models(fine, x, n_jobs=n_jobs)
    assert not y.requires_grad
    torch.testing.assert_close(y, plain_sum(fine, x))


def test_vjp_engine_refuses_bound_methods_with_what_to_use():
    owner = TwoHeads()
    x = torch.randn(3, IN)
    with pytest.raises(parsum.ParsumError, match=r"models\[1\] is a method of a TwoHeads"):
        parsum.sum_models([owner, owner.encode], x, engine="vjp")
    assert owner.body[0].weight.grad is None


def bn_models():
    torch.manual_seed(0)
    models = [
        nn.Sequential(nn.Linear(IN, 5), nn.BatchNorm1d(5), nn.Linear(5, OUT)) for _ in range(4)
    ]
    bn = nn.BatchNorm1d(5)
    models += [
        nn.Sequential(nn.Linear(IN, 5), bn, nn.Linear(5, OUT)) for _ in range(2)
    ]  # shared bn
    models.append(models[0])  # and one whole BatchNorm model twice
    return models


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_batchnorm_buffers_change_as_in_plain_loop(n_jobs):
    models = bn_models()
    ref_models = clone_models(models)
    close_models = clone_models(models)
    x = torch.randn(8, IN)
    # Bitwise against the plain loop at the intra-op thread count parsum gives each model
    # (BatchNorm's batch statistics differ in the last bit between 1 and 2 threads).
    same_threads = parsum._pool.intra_op_threads(len(models))
    for _ in range(3):
        y = parsum.sum_models(models, x, n_jobs=n_jobs, chunk_size=1)
        y.sum().backward()
        saved = torch.get_num_threads()
        torch.set_num_threads(same_threads)
        try:
            y_ref = plain_sum(ref_models, x)
        finally:
            torch.set_num_threads(saved)
        y_ref.sum().backward()
        plain_sum(close_models, x).sum().backward()
        torch.testing.assert_close(y, y_ref)
        for m, r, c in zip(models, ref_models, close_models):
            for b, rb, cb in zip(m.buffers(), r.buffers(), c.buffers()):
                assert torch.equal(b, rb)
                torch.testing.assert_close(b, cb)
        assert_same_grads(models, ref_models)


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_grad_and_inference_mode_save_nothing(n_jobs, mode):
    models = zoo()
    x = torch.randn(4, IN, requires_grad=True)
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
            return torch.zeros(x.shape[0], OUT)

    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        y = parsum.sum_models([*models, Probe(), Probe()], x, n_jobs=n_jobs, chunk_size=1)
        y_ref = plain_sum(models, x)
    assert not y.requires_grad and y.grad_fn is None
    assert y.is_inference() == (mode == "inference_mode")
    assert seen == [(False, mode == "inference_mode")] * 2
    torch.testing.assert_close(y, y_ref)


class _Widened(nn.Module):
    """A class of its own (no direct program) that takes a keyword and writes into the
    keywords it was given, which no other model may see."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(IN, width), nn.Linear(width, OUT)

    def forward(self, x, scale=1.0, **extra):
        assert not extra, extra  # a keyword dict of its own, as the plain loop gives it
        extra["seen"] = True
        return self.b(torch.tanh(self.a(x))) * scale


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("weights", [None, "floats"])
def test_an_evaluation_is_the_plain_loops_and_the_same_bits_for_every_n_jobs(mode, weights):
    # With no graph, the models of a flat call read one build of the arguments and their
    # outputs go straight to the sum's terms (NOTE [ Forwards with no graph ] in _function);
    # odd ones out (a pytree, another dtype) take the general way.
    torch.manual_seed(0)
    models = [_Widened(4 + 3 * (i % 5)) for i in range(12)]
    models.insert(5, functools.partial(lambda x, scale=1.0: x[:, :OUT] * scale))
    x = torch.randn(6, IN)
    w = [0.5 + 0.1 * i for i in range(len(models))] if weights else None
    wide = [copy.deepcopy(m).double() if isinstance(m, nn.Module) else m for m in models]
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with ctx():
        ref = sum(
            (1.0 if w is None else w[i]) * m(x.double(), scale=2.0) for i, m in enumerate(wide)
        )
        plain = sum((1.0 if w is None else w[i]) * m(x, scale=2.0) for i, m in enumerate(models))
        outs = [parsum.sum_models(models, x, weights=w, n_jobs=n, scale=2.0) for n in N_JOBS]
        outs.append(parsum.sum_models(models, x, weights=w, scale=2.0))
    for y in outs:
        assert torch.equal(y, outs[0])
        assert y.dtype == torch.float32 and y.is_inference() == (mode == "inference_mode")
    torch.testing.assert_close(outs[0], plain)
    # the compensated sum is the float64 sum rounded once
    torch.testing.assert_close(outs[0].double(), ref, rtol=1e-6, atol=1e-6)


def test_an_evaluation_names_a_model_whose_output_is_not_like_the_others():
    models = [_Widened(4), _Widened(6), lambda x: (x[:, :OUT],), _Widened(5)]
    with (
        torch.no_grad(),
        pytest.raises(parsum.ParsumError, match=r"model 2 \(function <lambda>\)"),
    ):
        parsum.sum_models(models, torch.randn(3, IN), n_jobs=1)


def test_autocast_is_reentered_in_workers():
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(torch.is_autocast_enabled("cpu"))
            return torch.zeros(x.shape[0], OUT, dtype=torch.bfloat16)

    models = [mlp([8]), mlp([4, 4]), mlp([12], nn.ReLU), Probe(), Probe()]
    x = torch.randn(4, IN, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = parsum.sum_models(models, x, n_jobs=2, chunk_size=1)
        assert seen == [True, True]
        y_ref = plain_sum(models, x)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)
    y.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32


@pytest.mark.parametrize("grads", ["own", "FlatGrad", "compensated FlatGrad", "stack"])
def test_a_grad_scaler_trains_as_with_the_plain_loop(grads):
    # A float16 loss scaled by torch.amp.GradScaler, unscaled and stepped after the backward:
    # the gradients parsum writes (FlatGrad views, the stack's tensors) are the scaler's too.
    torch.manual_seed(0)
    plain = [nn.Sequential(nn.Linear(IN, 8), nn.Tanh(), nn.Linear(8, OUT)) for _ in range(5)]
    models = copy.deepcopy(plain)
    params = [p for m in models for p in m.parameters()]
    if grads == "stack":
        params = list(parsum.stack_(models).parameters())
    elif grads != "own":
        flat = parsum.FlatGrad(models, compensated=grads.startswith("compensated"))  # noqa: F841
    runs = [
        (plain, torch.optim.SGD([p for m in plain for p in m.parameters()], lr=0.1), plain_sum),
        (models, torch.optim.SGD(params, lr=0.1), parsum.sum_models),
    ]
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in runs]
    x = torch.randn(6, IN)
    for _ in range(4):
        for (ms, opt, total), scaler in zip(runs, scalers):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                y = total(ms, x)
            scaler.scale(y.float().pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
    for got, want in zip(models, plain):
        for a, b in zip(got.parameters(), want.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=2e-4)  # float16 sums, rounded


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("chunk_size", [None, 1, 2, 3])
@pytest.mark.parametrize("weights", [None, "tensor"])
@pytest.mark.parametrize("costliest_first", [False, True])
def test_bitwise_identical_for_any_n_jobs(
    monkeypatch, engine, chunk_size, weights, costliest_first
):
    if not costliest_first:  # chunk order (NOTE [ Costliest chunks first ]), as a backward
        monkeypatch.setattr(parsum._api, "costliest_first", lambda *args: None)  # that steps
    results = []
    for n_jobs in (1, 2, 3, 4):
        models = zoo(seed=3)  # 7 models: an odd count
        x = torch.randn(9, IN, generator=torch.Generator().manual_seed(5), requires_grad=True)
        w = None if weights is None else torch.linspace(-1, 2, 7, requires_grad=True)
        y = parsum.sum_models(
            models, x, weights=w, engine=engine, n_jobs=n_jobs, chunk_size=chunk_size
        )
        (y.sin() * 1e3).sum().backward()
        results.append([y, x.grad, *param_grads(models), *([] if w is None else [w.grad])])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


class Scale(nn.Module):
    """x * a: with the inputs below every model's output is exact in float32."""

    def __init__(self, a):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(float(a)))

    def forward(self, x):
        return x * self.a


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_float32_more_accurate_than_plain_sum(n_jobs):
    scales = [1e8, 1.0, -1e8, 3.0, 1e7, -1e7] * 10  # sums to 40
    models = [Scale(a) for a in scales]
    x = (torch.randint(-8, 9, (64,)) / 4).requires_grad_()
    exact = x.detach().double() * 40
    y = parsum.sum_models(models, x, n_jobs=n_jobs)
    y_plain = plain_sum(models, x)
    assert (y_plain.double() - exact).abs().max() > 10  # the plain float32 sum loses the 1s
    assert torch.equal(y.double(), exact)
    # Input gradient: sum of weights that cancel.
    w = [1e8, 1.0, -1e8] * 5
    lin = [nn.Identity() for _ in w]
    x2 = torch.ones(3, requires_grad=True)
    parsum.sum_models(lin, x2, weights=w, n_jobs=n_jobs).sum().backward()
    x3 = torch.ones(3, requires_grad=True)
    plain_sum(lin, x3, weights=w).sum().backward()
    assert torch.equal(x2.grad, torch.full((3,), 5.0))
    assert not torch.equal(x3.grad, torch.full((3,), 5.0))


class _Votes(nn.Module):
    """A classifier's vote: booleans, which the plain sum counts (0 + True + ... in int64)."""

    def __init__(self, as_int=False):
        super().__init__()
        self.lin = nn.Linear(IN, OUT)
        self.as_int = as_int

    def forward(self, x):
        vote = self.lin(x) > 0
        return (10 * self.lin(x)).to(torch.int32) if self.as_int else vote


@pytest.mark.parametrize("weights", [None, "floats", "ints", "tensor"])
@pytest.mark.parametrize("how", ["distinct", "auto", "stacked", "stack_", "n_jobs=2", "vmap"])
@pytest.mark.parametrize("as_int", [False, True])
def test_boolean_and_integer_outputs_sum_as_the_plain_loop(as_int, how, weights):
    # Booleans came back as their logical or (a bool tensor) where the plain sum counts them,
    # engine="stacked" cast float weights to an integer or boolean output's dtype (0.5 -> 0),
    # and int weights were made floats (float votes where the plain loop counts in int64).
    torch.manual_seed(0)
    models = [_Votes(as_int) for _ in range(4)]
    if how == "stack_":
        parsum.stack_(models)
    w = {
        None: None,
        "floats": [0.5, 1.5, 2.0, 0.25],
        "ints": [1, 3, 2, np.int64(5)],
        "tensor": torch.tensor([0.5, 1.5, 2.0, 0.25]),
    }
    kwargs = {"weights": w[weights]}
    if how == "stacked":
        kwargs["engine"] = "stacked"
    if how == "n_jobs=2":
        kwargs["n_jobs"] = 2
    x = torch.randn(5, IN)
    if how == "vmap":
        got = torch.func.vmap(lambda r: parsum.sum_models(models, r, **kwargs))(x)
    else:
        got = parsum.sum_models(models, x, **kwargs)
    if weights is None:  # Python's sum, from 0 (tests.zoo.plain_sum starts from model 0)
        want = sum(m(x) for m in models)
    else:
        want = sum(wi * m(x) for wi, m in zip(w[weights], models))
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want)
    assert torch.equal(parsum.sum_models(models[:1], x), 0 + models[0](x))  # one model too


@pytest.mark.parametrize("engine", ["auto", "stacked"])
def test_int_weights_give_the_bits_of_the_same_floats(engine):
    models = zoo()[:3] if engine == "auto" else [mlp([4]) for _ in range(3)]
    x = torch.randn(5, IN)
    ints = parsum.sum_models(models, x, weights=[1, -2, 3], engine=engine)
    floats = parsum.sum_models(models, x, weights=[1.0, -2.0, 3.0], engine=engine)
    assert torch.equal(ints, floats)


@pytest.mark.parametrize(
    "weights",
    [
        [1 / 7] * 7,
        [0.5, -1.25, 2.0, 0.1, 3.0, -0.7, 1 / 3],
        [0.0, -0.0, 0.25, 0.25, -0.0, 1.5, 0.0],
    ],
    ids=["equal", "distinct", "signed-zeros"],
)
@pytest.mark.parametrize("how", [dict(n_jobs=1), dict(n_jobs=2), dict(n_jobs=3, chunk_size=2), {}])
def test_float_weights_give_the_bits_of_each_weighted_term(weights, how):
    # NOTE [ Weights in the reduction ]: the terms weighted inside the one reduction, and NOTE
    # [ Weighted cotangents shared ]: one cotangent for models of one weight. The sum has the
    # bits of the plain terms w * m(x) summed in float64, and each model's gradients those of
    # its own backward from w times the sum's gradient.
    torch.manual_seed(0)
    models = [mlp([3 + i % 4]) for i in range(7)]
    x = torch.randn(6, IN)
    terms = [w * m(x).detach() for w, m in zip(weights, models)]
    want = torch.stack(terms).sum(0, dtype=torch.float64).to(torch.float32)
    got = parsum.sum_models(models, x, weights=weights, **how)
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    g = torch.randn_like(got)
    got.backward(g)
    for w, m in zip(weights, models):
        want_grads = torch.autograd.grad(m(x), list(m.parameters()), g * w)
        for p, want_grad in zip(m.parameters(), want_grads):
            assert torch.equal(p.grad, want_grad)
            assert torch.equal(p.grad.signbit(), want_grad.signbit())


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("learned", [False, True], ids=["fixed", "learned"])
@pytest.mark.parametrize("how", [dict(n_jobs=1), dict(n_jobs=3, chunk_size=2), {}])
def test_weight_tensor_gives_the_bits_of_each_weighted_term(w_dtype, out_dtype, learned, how):
    # NOTE [ A weight tensor read as floats ] and NOTE [ Weight gradients at once ]: the sum has
    # the bits of the plain terms w[i] * m(x) (the tensor's elements, not floats) summed in
    # float64; each model's gradients those of its own backward from w[i] times the sum's
    # gradient; the weights' gradient, element i, the bits of (g * m_i(x)).sum().
    torch.manual_seed(0)
    models = [mlp([3 + i % 4]).to(out_dtype) for i in range(7)]
    x = torch.randn(6, IN, dtype=out_dtype)
    values = [0.5, -1.25, 2.0, 0.1, -0.0, -0.7, 1 / 3]
    logits = torch.tensor(values, dtype=torch.float64, requires_grad=learned)
    w = logits.to(w_dtype)  # a leaf's view, with a gradient where learned
    terms = [w[i].detach() * m(x).detach() for i, m in enumerate(models)]
    got = parsum.sum_models(models, x, weights=w, **how)
    if out_dtype == torch.float32:
        want = torch.stack(terms).sum(0, dtype=torch.float64).to(out_dtype)
    else:  # compensated in its own dtype (float64), or in float32 (bfloat16)
        want = parsum.sum_models(models, x, weights=w.detach().tolist(), **how)
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    g = torch.randn_like(got)
    got.backward(g)
    for i, m in enumerate(models):
        want_grads = torch.autograd.grad(m(x), list(m.parameters()), g * w[i].detach())
        for p, want_grad in zip(m.parameters(), want_grads):
            assert torch.equal(p.grad, want_grad)
    if learned:
        per_model = torch.stack([(g * m(x).detach()).sum() for m in models]).add(0)
        assert torch.equal(logits.grad, per_model.to(w_dtype).to(torch.float64))


def test_weight_tensor_changed_in_place_before_backward_raises_as_the_plain_loop():
    # NOTE [ A weight tensor read as floats ]: the tensor is still saved for backward.
    models = zoo()[:3]
    x = torch.randn(4, IN)
    for total in (plain_sum, parsum.sum_models):
        w = torch.tensor([0.5, 1.5, -2.0])
        y = total(models, x) if total is plain_sum else total(models, x, weights=w)
        if total is plain_sum:
            y = sum(w[i] * m(x) for i, m in enumerate(models))
        w.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


class _BiasOnly(nn.Module):
    """An output whose graph saves nothing of the argument."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(OUT))

    def forward(self, x):
        return self.bias.expand(x.shape[0], OUT) * 1.0


@pytest.mark.parametrize("n_jobs", [None, 1, 2])
@pytest.mark.parametrize("create_graph", [False, True])
def test_an_output_the_learned_weights_need_written_before_backward_raises(create_graph, n_jobs):
    # The plain loop's w[i] * m_i(x) saved the output, and autograd raises for it; parsum's
    # weights' gradient read the output's new value, silently (NOTE [ Outputs written before
    # they are summed ] in parsum._function).
    models = [_BiasOnly(), ReturnsItsArgument()]
    for total in (plain_sum, parsum.sum_models):
        w = torch.tensor([0.5, 2.0], requires_grad=True)
        x = torch.randn(2, IN)
        if total is plain_sum:
            y = sum(w[i] * m(x) for i, m in enumerate(models))
        else:
            y = parsum.sum_models(models, x, weights=w, n_jobs=n_jobs)
        x.mul_(3.0)
        error = RuntimeError if total is plain_sum else parsum.ParsumError
        match = (
            "modified by an inplace operation"
            if total is plain_sum
            else r"model 1 \(ReturnsItsArgument\) returned a tensor that was written in place since"
        )
        with pytest.raises(error, match=match):
            torch.autograd.grad(y.pow(2).sum(), w, create_graph=create_graph)
        assert w.grad is None and all(p.grad is None for p in models[0].parameters())


def test_identity_model_does_not_alias_input():
    x = torch.randn(3)
    y = parsum.sum_models([nn.Identity()], x)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    y += 1
    assert not torch.equal(y, x)


def test_nn_module_list_is_accepted():
    models = nn.ModuleList(zoo())
    x = torch.randn(2, IN)
    torch.testing.assert_close(parsum.sum_models(models, x), plain_sum(models, x))


def test_deepcopy_of_zoo_is_independent():
    models = zoo()
    copies = copy.deepcopy(models)
    assert all(
        p is not q for m, c in zip(models, copies) for p, q in zip(m.parameters(), c.parameters())
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ["autograd", "vjp"])
def test_module_reached_by_several_entries_at_once(engine):
    """A model repeated, or a submodule shared, while several threads run the forwards."""
    shared = mlp([32, 32])
    other = nn.Sequential(shared, nn.Tanh())
    models = [shared, other, shared, other]
    x = torch.randn(3, IN)
    for _ in range(20):
        ref = clone_models(models)
        run_both(models, x, n_jobs=2, chunk_size=1, engine=engine)
        plain_sum(ref, x).sum().backward()
        y = parsum.sum_models(models, x, n_jobs=2, chunk_size=1, engine=engine)
        for p in shared.parameters():
            p.grad = None
        y.sum().backward()
        for p, r in zip(shared.parameters(), ref[0].parameters()):
            assert isinstance(p, nn.Parameter) and p.requires_grad
            torch.testing.assert_close(p.grad, r.grad)


@pytest.mark.parametrize("engine", ENGINES)
def test_tensor_hooks_run_once_on_the_whole_gradient(engine):
    models = [mlp([8]), mlp([4])]
    shared = models[0][0]
    models.append(nn.Sequential(shared, nn.Tanh(), nn.Linear(8, OUT)))  # shared by two models
    ref = clone_models(models)
    calls = {"parsum": 0, "plain": 0}
    shared.weight.register_hook(doubling_hook(calls, "parsum"))
    ref[0][0].weight.register_hook(doubling_hook(calls, "plain"))
    x = torch.randn(4, IN)
    parsum.sum_models(models, x, engine=engine).pow(2).sum().backward()
    plain_sum(ref, x).pow(2).sum().backward()
    assert calls == {"parsum": 1, "plain": 1}
    assert_same_grads(models, ref)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(IN, OUT)

    def forward(self, x, *, scale, power=1):
        return self.a(x) * scale**power


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_flat_call_with_keyword_tensors_and_scalars(n_jobs):
    # A call of tensors and scalars only takes the path without pytree walks.
    torch.manual_seed(0)
    models = [Scaled().double() for _ in range(3)]
    ref_models = clone_models(models)
    x = torch.randn(4, IN, dtype=torch.float64, requires_grad=True)
    s = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    x_ref, s_ref = (t.detach().clone().requires_grad_() for t in (x, s))
    y = parsum.sum_models(models, x, scale=s, power=2, n_jobs=n_jobs)
    y_ref = sum(m(x_ref, scale=s_ref, power=2) for m in ref_models)
    (y**2).sum().backward()
    (y_ref**2).sum().backward()
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(s.grad, s_ref.grad)
    assert_same_grads(models, ref_models)


class Tagged(torch.Tensor):
    """A tensor subclass: its __torch_function__ sends pullbacks through autograd.grad."""


@pytest.mark.parametrize("how", ["engine", "autograd.grad", "subclass input"])
def test_pullbacks_give_the_same_bits_through_either_entry_point(monkeypatch, how):
    torch.manual_seed(0)
    models = zoo(torch.float32)
    x = torch.randn(5, IN)

    def grads(ms, inp):
        inp = inp.detach().clone().requires_grad_()
        parsum.sum_models(ms, inp, n_jobs=2, engine="autograd").pow(2).sum().backward()
        return [inp.grad, *param_grads(ms)]

    want = grads(clone_models(models), x)
    if how == "autograd.grad":
        monkeypatch.setattr(engines, "_run_engine", None)
    got = grads(models, x.as_subclass(Tagged) if how == "subclass input" else x)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            assert torch.equal(g.as_subclass(torch.Tensor), w)


class Checkpointed(nn.Module):
    """Recomputes its hidden layer in backward instead of keeping it."""

    def __init__(self, width):
        super().__init__()
        self.hidden, self.head = nn.Linear(IN, width), nn.Linear(width, OUT)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(
            lambda t: torch.tanh(self.hidden(t)), x, use_reentrant=False
        )
        return self.head(h)


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_activation_checkpointing_inside_models(n_jobs):
    # The recomputation runs inside each model's pullback, in the workers.
    torch.manual_seed(0)
    models = [Checkpointed(w) for w in (3, 5, 7)]
    x = torch.randn(6, IN, requires_grad=True)
    (y, x, models, _), (y_ref, x_ref, ref_models, _) = run_both(models, x, n_jobs=n_jobs)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert_same_grads(models, ref_models)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["autograd", "stacked", "auto"])
@pytest.mark.parametrize("weights", ["one", "distinct"])
def test_cuda_models_with_float_weights(engine, weights):
    # NOTE [ Weights in the reduction ]: the weights' column is made on the CPU, so a CUDA
    # sum multiplies by one weight or term by term.
    torch.manual_seed(0)
    models = [mlp([8]).cuda() for _ in range(8)]
    w = [0.125] * 8 if weights == "one" else [0.5 - 0.25 * i for i in range(8)]
    x = torch.randn(5, IN, device="cuda")
    (y, _, models, _), (y_ref, _, ref, _) = run_both(models, x, weights=w, engine=engine, n_jobs=2)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert_same_grads(models, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("engine", ["autograd", "stacked"])
def test_cuda_models_with_cpu_weights(engine):
    # The plain loop allows w[i] * m_i(x) with CPU weights and CUDA models; so does parsum,
    # and the weights' gradient comes back on the CPU.
    torch.manual_seed(0)
    models = [mlp([8]).cuda() for _ in range(8)]
    ref = clone_models(models)
    x = torch.randn(5, IN, device="cuda")
    w = torch.linspace(-1, 2, 8, dtype=torch.float64, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_()
    parsum.sum_models(models, x, weights=w, engine=engine, n_jobs=2).square().sum().backward()
    plain_sum(ref, x, weights=w_ref).square().sum().backward()
    assert w.grad.device.type == "cpu"
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-4, atol=1e-5)
    assert_same_grads(models, ref, rtol=1e-4, atol=1e-5)


class _Attention(nn.Module):
    def __init__(self, heads):
        super().__init__()
        self.attention = nn.MultiheadAttention(4, heads, batch_first=True)
        self.head = nn.Linear(4, OUT)

    def forward(self, x):
        seq = torch.stack([x[:, :4], x[:, -4:]], 1)  # two tokens of 4 features
        return self.head(self.attention(seq, seq, seq)[0].mean(1))


class _Recurrent(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.gru = nn.GRU(2, width, batch_first=True)
        self.head = nn.Linear(width, OUT)

    def forward(self, x):
        return self.head(self.gru(x.view(len(x), -1, 2))[0][:, -1])


class _SparseRows(nn.Module):
    """Rows of a table with sparse gradients, picked by the argument's signs."""

    def __init__(self, width):
        super().__init__()
        self.table = nn.Embedding(2 * IN, width, sparse=True)
        self.head = nn.Linear(width, OUT)

    def forward(self, x):
        ids = (x > 0).long() * IN + torch.arange(IN)
        return self.head(self.table(ids).mean(1))


class _PerSample(nn.Module):
    """A forward that runs per sample through torch.vmap, and takes its input gradient with
    torch.func (as physics-informed networks do)."""

    def __init__(self, width):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN, width), nn.Tanh(), nn.Linear(width, 1))

    def forward(self, x):
        params = dict(self.net.named_parameters())

        def u(p, row):
            return torch.func.functional_call(self.net, p, (row,)).squeeze()

        du = torch.vmap(torch.func.grad(u, argnums=1), in_dims=(None, 0))(params, x)
        return torch.cat([torch.vmap(lambda row: self.net(row))(x), du[:, : OUT - 1]], 1)


class _Clamp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x > 0)


class _Hooked(nn.Module):
    """A hook on an activation (a scaled gradient reversal) and a custom autograd Function."""

    def __init__(self, width):
        super().__init__()
        self.a, self.b = nn.Linear(IN, width), nn.Linear(width, OUT)

    def forward(self, x):
        h = _Clamp.apply(self.a(x))
        h.register_hook(lambda g: -0.5 * g)
        return self.b(h)


# Weights recomputed by forward pre-hooks, or with buffers a forward updates.
_REPARAMETRIZE = {
    "weight_norm (hooks)": lambda m: torch.nn.utils.weight_norm(m[0]),
    "pruned": lambda m: torch.nn.utils.prune.random_unstructured(m[0], "weight", amount=0.4),
    "spectral_norm (hooks)": lambda m: torch.nn.utils.spectral_norm(m[2]),
}


def _reparametrized(kind, i):
    m = mlp([3 + i])
    _REPARAMETRIZE[kind](m)
    return m


_USERS_MODELS = {
    **{kind: functools.partial(_reparametrized, kind) for kind in _REPARAMETRIZE},
    "attention": lambda i: _Attention((1, 2, 4)[i % 3]),
    "gru": lambda i: _Recurrent(3 + i),
    "sparse rows": lambda i: _SparseRows(3 + i),
    "per sample": lambda i: _PerSample(3 + i),
    "hooked": lambda i: _Hooked(3 + i),
    "fake quantized": lambda i: nn.Sequential(
        nn.Linear(IN, 4 + i), torch.ao.quantization.FakeQuantize(), nn.Linear(4 + i, OUT)
    ),
}


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("kind", list(_USERS_MODELS))
def test_models_of_the_kinds_users_train_match_the_plain_loop(kind, n_jobs):
    # Layers and patterns tried on 2026-12-01 (docs/testing.md): hooks that recompute a weight
    # in forward, buffers a forward updates, sparse gradients, torch.func inside a model,
    # hooks on activations, custom Functions. Built twice from one seed (a module reparametrized
    # by hooks cannot be deep-copied); two steps, the second on the plan kept from the first.
    def build():
        torch.manual_seed(0)
        return [_USERS_MODELS[kind](i).double() for i in range(4)]

    ours, theirs = build(), build()
    for _ in range(2):
        x = torch.randn(5, IN, dtype=torch.float64, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        for m in (*ours, *theirs):
            m.zero_grad(set_to_none=True)
        y = parsum.sum_models(ours, x, n_jobs=n_jobs)
        y_ref = plain_sum(theirs, x_ref)
        torch.testing.assert_close(y, y_ref)
        y.pow(2).sum().backward()
        y_ref.pow(2).sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad)
        for got, want in zip(param_grads(ours), param_grads(theirs)):
            assert (got is None) == (want is None)
            if got is not None:
                assert got.layout == want.layout
                torch.testing.assert_close(got.to_dense(), want.to_dense())
        for got, want in zip(
            (b for m in ours for b in m.buffers()), (b for m in theirs for b in m.buffers())
        ):
            torch.testing.assert_close(got, want)


class KeepsItsActivation(nn.Module):
    """Calls ``retain_grad`` on a hidden activation, to read its gradient after backward."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(IN, 5), nn.Linear(5, OUT)
        self.hidden: torch.Tensor | None = None

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h.retain_grad()
        self.hidden = h
        return self.b(h)


@pytest.mark.parametrize("n_jobs", [1, 2, None])
def test_an_activation_that_retains_its_grad(n_jobs):
    models = [KeepsItsActivation() for _ in range(4)]
    ref = clone_models(models)
    x = torch.randn(3, IN)
    parsum.sum_models(models, x, n_jobs=n_jobs, weights=[0.5] * 4).pow(2).sum().backward()
    plain_sum(ref, x, weights=[0.5] * 4).pow(2).sum().backward()
    for m, r in zip(models, ref, strict=True):
        assert m.hidden is not None and r.hidden is not None
        torch.testing.assert_close(m.hidden.grad, r.hidden.grad)
    for got, want in zip(param_grads(models), param_grads(ref), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("n_jobs", [1, 2, None])
def test_averaged_models_as_members(n_jobs):
    # torch.optim.swa_utils: each member's running average, updated between calls, summed as
    # the plain loop sums them.
    from torch.optim.swa_utils import AveragedModel

    members = zoo()
    averaged = [AveragedModel(m) for m in members]
    x = torch.randn(4, IN)
    for _ in range(3):
        with torch.no_grad():
            for m in members:
                for p in m.parameters():
                    p.add_(0.1 * torch.randn_like(p))
        for a, m in zip(averaged, members, strict=True):
            a.update_parameters(m)
        with torch.no_grad():
            torch.testing.assert_close(
                parsum.sum_models(averaged, x, n_jobs=n_jobs), plain_sum(averaged, x)
            )


class TaggedParameter(nn.Parameter):
    """A subclass of nn.Parameter, as libraries make to tag parameters."""


@pytest.mark.parametrize("n_jobs", [1, 2, None])
def test_parameters_of_a_subclass_and_a_non_contiguous_input(n_jobs):
    models = zoo()
    for m in models[:3]:
        for name, p in list(m.named_parameters()):
            owner = m.get_submodule(name.rpartition(".")[0])
            setattr(owner, name.rpartition(".")[2], TaggedParameter(p.detach().clone()))
    ref = clone_models(models)
    assert isinstance(ref[0][0].weight, TaggedParameter)
    x = torch.randn(IN, 5).t()  # a transposed view, not contiguous
    assert not x.is_contiguous()
    opts = [torch.optim.SGD(unique_params(ms), lr=0.01) for ms in (models, ref)]
    for _ in range(3):
        step_alike(models, ref, x, n_jobs, opts)


def step_alike(models, ref, x, n_jobs, opts, seed=None):
    """One step of ``opts`` (the models', then the plain twins') after ``sum_models`` and the
    plain loop, each from ``seed`` where given: outputs and gradients compared."""
    for opt in opts:
        opt.zero_grad()
    if seed is not None:
        torch.manual_seed(seed)
    y = parsum.sum_models(models, x, n_jobs=n_jobs)
    if seed is not None:
        torch.manual_seed(seed)
    y_ref = plain_sum(ref, x)
    torch.testing.assert_close(y, y_ref)
    y.pow(2).sum().backward()
    y_ref.pow(2).sum().backward()
    for got, want in zip(param_grads(models), param_grads(ref), strict=True):
        # gradients of tens: float32's rounding of two sums a few ulps from float64's
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * (1 + want.abs().max()))
    for opt in opts:
        opt.step()


class Votes(nn.Module):
    """An output of ``dtype``: rounded, scaled logits (large enough to wrap int8 and uint8
    around in a sum), or a boolean vote."""

    def __init__(self, dtype: torch.dtype, scale: float):
        super().__init__()
        self.lin, self.dtype, self.scale = nn.Linear(IN, OUT), dtype, scale

    def forward(self, x):
        if self.dtype == torch.bool:
            return self.lin(x) > 0
        return (self.lin(x) * self.scale).round().clamp(-128, 255).to(self.dtype)


@pytest.mark.parametrize("n_jobs", [1, 2, None])
@pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.uint8, torch.int32, torch.int64])
def test_integer_and_boolean_outputs_sum_as_pythons_sum(dtype, n_jobs):
    # docs/sum-models.md: integers in their dtype, wrapping around as the plain sum does;
    # booleans counted in int64 (sum starts from 0); a float weight makes them float, an int
    # weight keeps them integer.
    models = [Votes(dtype, 60.0 + 10 * i) for i in range(7)]
    x = torch.randn(5, IN)
    with torch.no_grad():
        y = parsum.sum_models(models, x, n_jobs=n_jobs)
        expected = sum(m(x) for m in models)
        assert y.dtype == expected.dtype == (torch.int64 if dtype == torch.bool else dtype)
        assert torch.equal(y, expected)
        floats = [0.5 + 0.25 * i for i in range(7)]
        y = parsum.sum_models(models, x, n_jobs=n_jobs, weights=floats)
        expected = sum(w * m(x) for w, m in zip(floats, models))
        assert y.dtype == torch.float32
        torch.testing.assert_close(y, expected)
        ints = list(range(1, 8))
        y = parsum.sum_models(models, x, n_jobs=n_jobs, weights=ints)
        expected = sum(w * m(x) for w, m in zip(ints, models))
        assert y.dtype == expected.dtype and torch.equal(y, expected)


@pytest.mark.parametrize("n_jobs", [1, 2, None])
def test_backward_hooks_that_change_gradients(n_jobs):
    # A module's full backward hook that scales its input's gradient, and a pre-hook that
    # clips its output's: every layer before it, and the argument, get the changed gradients.
    calls = []

    def halve_input_grad(module, grad_input, grad_output):
        calls.append(module)
        return tuple(None if g is None else g * 0.5 for g in grad_input)

    def clip_output_grad(module, grad_output):
        calls.append(module)
        return tuple(g.clamp(-0.1, 0.1) for g in grad_output)

    models = zoo()
    for m in models[:3]:
        m[-1].register_full_backward_hook(halve_input_grad)
    models[6][2].register_full_backward_pre_hook(clip_output_grad)
    ref = clone_models(models)  # a deep copy keeps the hooks
    x = torch.randn(4, IN, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    parsum.sum_models(models, x, n_jobs=n_jobs).pow(2).sum().backward()
    hooked = {id(m[-1]) for m in models[:3]} | {id(models[6][2])}
    assert len(calls) == 4 and {id(m) for m in calls} == hooked  # each hook once
    plain_sum(ref, x_ref).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    for got, want in zip(param_grads(models), param_grads(ref), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("n_jobs", [1, 2, None])
@pytest.mark.parametrize("path", ["caller's graph", "ParallelSum"])
def test_the_sum_changed_in_place_before_its_backward(path, n_jobs, monkeypatch):
    models = zoo()
    if path == "ParallelSum":
        monkeypatch.setattr(parsum._api, "fits_callers_graph", lambda *a: False)
    ref = clone_models(models)
    x = torch.randn(4, IN, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    w = torch.linspace(0.2, 1.0, 7, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_()
    y = parsum.sum_models(models, x, n_jobs=n_jobs, weights=w)
    y_ref = plain_sum(ref, x_ref, weights=w_ref)
    for t in (y, y_ref):
        t.mul_(2).add_(1)
    torch.testing.assert_close(y, y_ref)
    y.pow(2).sum().backward()
    y_ref.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(w.grad, w_ref.grad)
    for got, want in zip(param_grads(models), param_grads(ref), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("n_jobs", [1, 2, None])
def test_train_and_eval_toggled_every_step(n_jobs):
    # Dropout draws the plain loop's masks in training mode and none in eval; BatchNorm's
    # statistics are updated, then read: the plain loop's outputs, gradients and statistics.
    def member(i):
        width = 8 + i
        return nn.Sequential(
            nn.Linear(IN, width), nn.Dropout(0.3), nn.Tanh(), nn.BatchNorm1d(width),
            nn.Linear(width, OUT),
        )  # fmt: skip

    torch.manual_seed(0)
    models = [member(i) for i in range(5)]
    ref = clone_models(models)
    opts = [torch.optim.SGD(unique_params(ms), lr=0.01) for ms in (models, ref)]
    for step in range(8):
        for m in [*models, *ref]:
            m.train(step % 2 == 0)
        step_alike(models, ref, torch.randn(6, IN), n_jobs, opts, seed=100 + step)
    for m, r in zip(models, ref, strict=True):
        torch.testing.assert_close(m[3].running_mean, r[3].running_mean)
        torch.testing.assert_close(m[3].running_var, r[3].running_var)
