"""Derivatives of second and higher order through sum_models (NOTE [ Double backward ]):
gradient penalties, physics-informed losses, Hessian-vector products, against the plain sum
and numerically (gradgradcheck) in float64."""

from __future__ import annotations

import functools
import random
import sys
import threading
import time
import weakref

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import parsum
from parsum import _double_backward
from tests.test_callers_graph import _Spy
from tests.test_stacked import groups
from tests.zoo import IN, OUT, clone_models, mlp, param_grads, plain_sum, unique_params, zoo

WEIGHTS = [0.5, 1.0, 2.0, -1.0, 3.0, 0.25, 1.5]


def _mixed(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    acts = [nn.Tanh, nn.Softplus, nn.SiLU, nn.GELU, nn.Sigmoid]
    return [mlp([3 + i], acts[i % len(acts)]).to(dtype) for i in range(5)]


def _node(t: torch.Tensor) -> str:
    return type(t.grad_fn).__name__


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("weights", [None, "floats"])
def test_gradgradcheck_in_the_argument_and_the_parameters(n_jobs, weights):
    models = _mixed()
    w = WEIGHTS[: len(models)] if weights else None
    x = torch.randn(4, IN, dtype=torch.float64, requires_grad=True)
    params = unique_params(models)

    def f(*inputs):
        return parsum.sum_models(models, inputs[0], n_jobs=n_jobs, weights=w)

    assert _node(f(x)) == "CallerGraphSumBackward"
    assert torch.autograd.gradcheck(f, (x, *params))
    assert torch.autograd.gradgradcheck(f, (x, *params))


def test_gradgradcheck_of_the_zoo_in_the_argument():
    models = zoo(torch.float64)
    x = torch.randn(3, IN, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda t: parsum.sum_models(models, t, n_jobs=2), (x,))


def _penalized(forward, models, x):
    """A WGAN-GP-style step: the loss of the sum plus a penalty on its gradient in x."""
    x = x.detach().clone().requires_grad_()
    y = forward(models, x)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    loss = y.pow(2).mean() + 10 * (g.norm(dim=1) - 1).pow(2).mean()
    loss.backward()
    return [y.detach(), g.detach(), loss.detach(), x.grad, *param_grads(models)]


@pytest.mark.parametrize("n_jobs", [None, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradient_penalty_matches_the_plain_sum(n_jobs, dtype):
    models = zoo(dtype)
    x = torch.randn(5, IN, dtype=dtype)
    got = _penalized(lambda m, t: parsum.sum_models(m, t, n_jobs=n_jobs), models, x)
    want = _penalized(plain_sum, clone_models(models), x)
    assert all(g is not None for g in got)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_gradient_penalty_bits_do_not_depend_on_n_jobs():
    # (The default, n_jobs unset, may chunk differently on small budgets: docs/sum-models.md.)
    models = zoo()
    x = torch.randn(5, IN)
    runs = [
        _penalized(lambda m, t, n=n: parsum.sum_models(m, t, n_jobs=n), clone_models(models), x)
        for n in (1, 2, 3)
    ]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


def test_gradient_penalty_with_weights_and_an_unused_parameter():
    models = _mixed()
    models[2][0].bias.requires_grad_(False)  # frozen: no gradient of any order
    models.append(nn.Linear(IN, 3).double())
    models[-1].register_parameter("spare", nn.Parameter(torch.ones(2, dtype=torch.float64)))
    w = WEIGHTS[: len(models)]
    x = torch.randn(4, IN, dtype=torch.float64)
    got = _penalized(lambda m, t: parsum.sum_models(m, t, weights=w), models, x)
    want = _penalized(lambda m, t: plain_sum(m, t, weights=w), clone_models(models), x)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)
    assert models[-1].spare.grad is None and models[2][0].bias.grad is None


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_third_order_physics_informed_loss(n_jobs):
    # u'' + u = 0 on a grid: the loss holds second derivatives in x, its backward a third.
    models = _mixed()
    ref = clone_models(models)

    def step(forward, ms):
        t = torch.linspace(-1, 1, 7, dtype=torch.float64).reshape(-1, 1).repeat(1, IN)
        t.requires_grad_()
        u = forward(ms, t)
        (du,) = torch.autograd.grad(u.sum(), t, create_graph=True)
        (d2u,) = torch.autograd.grad(du.sum(), t, create_graph=True)
        loss = (d2u.sum(1, keepdim=True) + u).pow(2).mean() + du.pow(2).mean()
        loss.backward()
        return [loss.detach(), t.grad, *param_grads(ms)]

    got = step(lambda m, t: parsum.sum_models(m, t, n_jobs=n_jobs), models)
    want = step(plain_sum, ref)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


class _SpiedMLP(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.a, self.b = nn.Linear(IN, width).double(), nn.Linear(width, 2).double()

    def forward(self, x):
        return self.b(torch.tanh(_Spy.apply(self.a(x))))


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("penalties", [1, 2])
@pytest.mark.parametrize("how", ["backward", "autograd.grad"])
@pytest.mark.parametrize("weights", [None, "learned"])
def test_a_penalty_step_walks_the_models_graphs_once(n_jobs, penalties, how, weights):
    # NOTE [ One pullback for a sum and its derivatives ]: the last backward reaches the sum's
    # node and each penalty's derivative node, which plain autograd adds into each node of the
    # models' graphs first; pulled back apart, parsum walked them once a node. With learned
    # weights, the derivatives' weight gradient goes through the sum's node (NOTE [ The
    # weights' gradient carried by the sum's node ]).
    torch.manual_seed(0)
    models = [_SpiedMLP(4 + i) for i in range(5)]
    ref = clone_models(models)
    x0 = torch.randn(6, IN, dtype=torch.float64)
    found = []
    for sums, ms in (
        (functools.partial(parsum.sum_models, n_jobs=n_jobs, chunk_size=2), models),
        (plain_sum, ref),
    ):
        x = x0.clone().requires_grad_()
        logits = torch.linspace(-1.0, 1.0, len(ms), dtype=torch.float64, requires_grad=True)
        y = sums(ms, x, weights=torch.softmax(logits, 0) if weights else None)
        loss = y.pow(2).mean()
        for k in range(penalties):
            (g,) = torch.autograd.grad((y * (k + 1)).sum(), x, create_graph=True)
            loss = loss + (g.norm(dim=1) - 1).pow(2).mean()
        params = [*unique_params(ms), *([logits] if weights else [])]
        _Spy.calls = 0
        if how == "backward":
            loss.backward()
            grads = [x.grad, *(p.grad for p in params)]
        else:
            grads = list(torch.autograd.grad(loss, [x, *params]))
        found.append((_Spy.calls, grads))
    (calls, got), (plain_calls, want) = found
    assert calls == plain_calls == len(models)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.timeout(60, method="thread")
def test_penalty_backward_passes_at_once_in_two_threads_each_get_their_gradients():
    # NOTE [ One pullback for a sum and its derivatives ]: what a node leaves for the last to
    # run is kept by backward (graph task), not by sum: two backward passes through the same
    # retained graph at once must not take each other's.
    torch.manual_seed(0)
    models = [_SpiedMLP(4 + i) for i in range(6)]
    x = torch.randn(8, IN, dtype=torch.float64, requires_grad=True)
    y = parsum.sum_models(models, x, n_jobs=1)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    loss = y.pow(2).mean() + (g.norm(dim=1) - 1).pow(2).mean()
    params = unique_params(models)
    want = torch.autograd.grad(loss, [x, *params], retain_graph=True)
    for t in (y, g):  # before each node, a pause that lets the other thread's backward run
        t.register_hook(lambda grad: time.sleep(0.002))
    found: list = []
    start = threading.Barrier(2)

    def run():
        start.wait()
        for _ in range(10):
            found.append(torch.autograd.grad(loss, [x, *params], retain_graph=True))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(found) == 20
    for got in found:
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_hessian_vector_product_in_the_parameters():
    models = zoo(torch.float64)
    ref = clone_models(models)
    x = torch.randn(4, IN, dtype=torch.float64)

    def hvp(forward, ms):
        params = unique_params(ms)
        loss = forward(ms, x).pow(2).mean()
        grads = torch.autograd.grad(loss, params, create_graph=True)
        return torch.autograd.grad(grads, params, [torch.ones_like(g) for g in grads])

    for a, b in zip(hvp(parsum.sum_models, models), hvp(plain_sum, ref)):
        torch.testing.assert_close(a, b)


def test_backward_with_create_graph_leaves_differentiable_grads():
    models = _mixed()
    ref = clone_models(models)
    x = torch.randn(4, IN, dtype=torch.float64)
    parsum.sum_models(models, x).pow(2).sum().backward(create_graph=True)
    plain_sum(ref, x).pow(2).sum().backward(create_graph=True)
    got = sum(p.grad.pow(2).sum() for p in unique_params(models))
    want = sum(p.grad.pow(2).sum() for p in unique_params(ref))
    torch.testing.assert_close(got, want)
    got_params, want_params = unique_params(models), unique_params(ref)
    for a, b in zip(torch.autograd.grad(got, got_params), torch.autograd.grad(want, want_params)):
        torch.testing.assert_close(a, b)


class _NoSecondDerivative(torch.autograd.Function):
    """The identity, whose backward raises."""

    @staticmethod
    def forward(ctx, g):
        return g.view_as(g)

    @staticmethod
    def backward(ctx, gg):
        raise RuntimeError("no second derivative here")


class _OnceDifferentiable(torch.autograd.Function):
    """sin, whose first derivative cannot be differentiated."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return _NoSecondDerivative.apply(g * x.cos())


class _Sine(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(IN, 3).double()

    def forward(self, x):
        return _OnceDifferentiable.apply(self.lin(x))


@pytest.mark.parametrize("with_loss", [False, True])
def test_a_model_that_cannot_be_differentiated_twice_is_named(with_loss):
    # with_loss: the sum's node and its derivative's pull back together (NOTE [ One pullback
    # for a sum and its derivatives ]), one engine call, which fails
    models = [*_mixed()[:2], _Sine(), *_mixed(seed=1)[:1]]
    x = torch.randn(4, IN, dtype=torch.float64, requires_grad=True)
    y = parsum.sum_models(models, x)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    before = [p.grad for p in unique_params(models)]
    loss = g.pow(2).sum() + (y.pow(2).mean() if with_loss else 0)
    with pytest.raises(parsum.ParsumError, match=r"model 2 \(_Sine\) raised RuntimeError.*no sec"):
        loss.backward()
    assert [p.grad for p in unique_params(models)] == before == [None] * len(before)


def _with_groups(seed=0):
    """Two groups of identical models that auto stacks, interleaved with distinct ones: a
    Sequential's group runs as batched layers, a class's through vmap."""
    torch.manual_seed(seed)
    batched = [mlp([5], nn.Tanh).double() for _ in range(4)]
    through_vmap = [_Block(4, nn.SiLU).double() for _ in range(8)]
    others = _mixed()
    return [
        *batched[:2],
        others[0],
        *through_vmap[:5],
        *others[1:3],
        *batched[2:],
        *through_vmap[5:],
        *others[3:],
    ]


def _groups_of(models, x):
    return [g for g in groups(models, "auto", x) if len(g) > 1]


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("weights", [None, "floats", "learned"])
def test_gradgradcheck_with_stacked_groups_beside_other_models(n_jobs, weights):
    # NOTE [ Stacked groups in the caller's graph ] in parsum._inline: until 2026-12-05 the
    # second backward raised (the groups ran through ParallelSum).
    models = _with_groups()
    x = torch.randn(2, IN, dtype=torch.float64, requires_grad=True)
    # Some of each kind's (every element of every input is perturbed): a batched model's, a
    # vmapped one's, another's
    params = [models[1][0].weight, models[4].b.bias, models[8][0].bias, models[-4].a.weight]
    logits = torch.linspace(-1.0, 1.0, len(models), dtype=torch.float64, requires_grad=True)
    floats = [0.5 + 0.125 * i for i in range(len(models))]

    def f(x, logits, *params):
        w = {None: None, "floats": floats, "learned": torch.softmax(logits, 0)}[weights]
        return parsum.sum_models(models, x, n_jobs=n_jobs, weights=w)

    assert len(_groups_of(models, x)) == 2
    assert _node(f(x, logits)) == "CallerGraphSumBackward"
    inputs = (x, logits, *params)
    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


@pytest.mark.parametrize("make", ["_with_groups", "_with_shared"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_penalty_with_stacked_groups_or_shared_parameters_is_the_plain_loops(dtype, make, cores):
    # NOTE [ Stacked groups in the caller's graph ] and NOTE [ Parameters several models use
    # in the caller's graph ] in parsum._inline; the same bits for any n_jobs given. Left
    # unset on a budget of 2, n_jobs may plan apart (one chunk on both intra-op threads: NOTE
    # [ Threads that pay ] in parsum._grouping), a plain graph where the models are of known
    # layers (NOTE [ Parameters several models use in a plain graph ] in parsum._plain_graph)
    cores(2)
    models = [m.to(dtype) for m in globals()[make](1)]
    x = torch.randn(5, IN, dtype=dtype)
    want = _penalized(plain_sum, clone_models(models), x)
    runs = []
    for n_jobs in (None, 1, 2, 3):
        mine = clone_models(models)
        runs.append(_penalized(lambda m, t, n=n_jobs: parsum.sum_models(m, t, n_jobs=n), mine, x))
        for a, b in zip(runs[-1], want):
            torch.testing.assert_close(a, b)
    assert all(torch.equal(a, b) for run in runs[2:] for a, b in zip(run, runs[1]))


def _with_shared(seed=0):
    """Heads over one trunk, a model twice, and others (NOTE [ Parameters several models use
    in the caller's graph ] in parsum._inline)."""
    torch.manual_seed(seed)
    trunk = nn.Sequential(nn.Linear(IN, 5), nn.Tanh())
    heads = [
        nn.Sequential(trunk, nn.Linear(5, 3 + i), nn.SiLU(), nn.Linear(3 + i, OUT))
        for i in range(3)
    ]
    others = _mixed()
    models = [heads[0], others[0], others[1], heads[1], others[2], others[1], heads[2]]
    return [m.double() for m in models]


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("weights", [None, "floats", "learned"])
def test_gradgradcheck_with_parameters_several_models_use(n_jobs, weights):
    models = _with_shared()
    x = torch.randn(2, IN, dtype=torch.float64, requires_grad=True)
    params = [models[0][0][0].weight, models[1][0].bias, models[3][1].bias]  # trunk, twice, own
    logits = torch.linspace(-1.0, 1.0, len(models), dtype=torch.float64, requires_grad=True)
    floats = [0.5 + 0.125 * i for i in range(len(models))]

    def f(x, logits, *params):
        w = {None: None, "floats": floats, "learned": torch.softmax(logits, 0)}[weights]
        return parsum.sum_models(models, x, n_jobs=n_jobs, weights=w)

    assert _node(f(x, logits)) == "CallerGraphSumBackward"
    inputs = (x, logits, *params)
    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


def test_where_the_models_run_through_parallel_sum_a_second_backward_raises():
    models = _mixed()
    x = torch.randn(4, IN, dtype=torch.float64, requires_grad=True)
    y = parsum.sum_models(models, x, engine="vjp")
    assert _node(y) != "CallerGraphSumBackward"
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(parsum.ParsumError, match="not differentiable here"):
        g.pow(2).sum().backward()


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_gradgradcheck_with_a_learned_weight_tensor(n_jobs):
    # NOTE [ A learned weight tensor's derivatives ]: the weights' gradient and the sum's
    # derivatives in x and the parameters are differentiable again, the weights included.
    models = _mixed()
    x = torch.randn(4, IN, dtype=torch.float64, requires_grad=True)
    logits = torch.randn(len(models), dtype=torch.float64, requires_grad=True)
    params = unique_params(models)

    def f(x, logits, *params):
        w = torch.softmax(logits, 0)
        return parsum.sum_models(models, x, weights=w, n_jobs=n_jobs)

    assert _node(f(x, logits)) == "CallerGraphSumBackward"
    assert torch.autograd.gradcheck(f, (x, logits, *params))
    assert torch.autograd.gradgradcheck(f, (x, logits, *params))


def _learned_steps(how, forward, models, x):
    """A second-order step with learned weights, ``how`` says which; every gradient after it."""
    x = x.detach().clone().requires_grad_()
    logits = torch.linspace(-1.0, 1.0, len(models), dtype=x.dtype, requires_grad=True)
    y = forward(models, x, torch.softmax(logits, 0))
    if how == "penalty in x":  # the first backward wants x's gradient alone
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        (y.pow(2).mean() + 10 * (g.norm(dim=1) - 1).pow(2).mean()).backward()
    elif how == "weights only":  # ... the weights' gradient alone
        (gw,) = torch.autograd.grad(y.pow(2).sum(), logits, create_graph=True)
        gw.pow(2).sum().backward()
    elif how == "backward(create_graph=True)":  # ... every gradient
        y.pow(2).sum().backward(create_graph=True)
        gx, gw = x.grad, logits.grad
        x.grad = logits.grad = None
        for p in unique_params(models):
            p.grad = None
        (gx.pow(2).sum() + gw.pow(2).sum()).backward()
    else:  # third order in x and the weights
        gx, gw = torch.autograd.grad(y.pow(2).sum(), [x, logits], create_graph=True)
        hx, hw = torch.autograd.grad(gx.pow(2).sum() + gw.sum(), [x, logits], create_graph=True)
        (hx.sum() + hw.pow(2).sum()).backward()
    return [y.detach(), logits.grad, x.grad, *param_grads(models)]


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize(
    "how", ["penalty in x", "weights only", "backward(create_graph=True)", "third order"]
)
def test_learned_weights_in_derivatives_of_higher_order_match_the_plain_sum(how):
    models = _mixed()
    x = torch.randn(4, IN, dtype=torch.float64)
    want = _learned_steps(how, lambda m, t, w: plain_sum(m, t, weights=w), clone_models(models), x)
    runs = [
        _learned_steps(
            how,
            lambda m, t, w, n=n: parsum.sum_models(m, t, weights=w, n_jobs=n),
            clone_models(models),
            x,
        )
        for n in (1, 2, 3)
    ]
    assert runs[0][1] is not None
    for a, b in zip(runs[0], want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for other in runs[1:]:  # everything in the calling thread: the bits of any n_jobs
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(runs[0], other))


def test_a_learned_weight_tensor_through_parallel_sum_still_raises():
    # The models run through ParallelSum (engine="vjp"): no derivatives of higher order there.
    models = _mixed()
    w = torch.ones(len(models), dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, IN, dtype=torch.float64, requires_grad=True)
    y = parsum.sum_models(models, x, weights=w, engine="vjp")
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(parsum.ParsumError, match="not differentiable here"):
        g.pow(2).sum().backward()


class _Recorder(nn.Module):
    """An MLP that keeps a weak reference to each hidden activation it makes."""

    def __init__(self, width):
        super().__init__()
        self.a, self.b = nn.Linear(IN, width), nn.Linear(width, 2)
        self.made: list[weakref.ref] = []

    def forward(self, x):
        h = torch.tanh(self.a(x))
        self.made.append(weakref.ref(h))
        return self.b(h)


def test_repeated_penalty_steps_free_the_graphs_and_the_nodes(monkeypatch):
    made: list[weakref.ref] = []  # every derivative node's holdings, weakly
    add = _double_backward.Holds.add
    monkeypatch.setattr(
        _double_backward.Holds,
        "add",
        lambda self, held: (made.append(weakref.ref(held)), add(self, held)),
    )
    models = [_Recorder(4 + i) for i in range(4)]
    optimizer = torch.optim.SGD([p for m in models for p in m.parameters()], lr=1e-3)
    for _ in range(5):
        optimizer.zero_grad()
        x = torch.randn(5, IN, requires_grad=True)
        y = parsum.sum_models(models, x)
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        loss = y.pow(2).mean() + (g.norm(dim=1) - 1).pow(2).mean()
        loss.backward()
        optimizer.step()
        # Freed when the backward ends, as the plain loop's, although loss, y and g live on.
        assert all(ref() is None for m in models for ref in m.made)
    assert len(made) == 5
    del x, y, g, loss
    assert all(ref() is None for ref in made)  # no cycle: gone without the collector


def test_a_second_backward_through_freed_graphs_raises():
    models = [_Recorder(4 + i) for i in range(3)]
    x = torch.randn(5, IN, requires_grad=True)
    (g,) = torch.autograd.grad(parsum.sum_models(models, x).sum(), x, create_graph=True)
    penalty = g.pow(2).sum()
    penalty.backward()
    with pytest.raises(RuntimeError, match=r"second time|freed"):
        penalty.backward()


def test_retain_graph_keeps_the_graphs_for_another_second_backward():
    models = _mixed()
    ref = clone_models(models)
    x = torch.randn(4, IN, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = parsum.sum_models(models, x), plain_sum(ref, x_ref)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    (g_ref,) = torch.autograd.grad(y_ref.sum(), x_ref, create_graph=True)
    for _ in range(2):
        g.pow(2).sum().backward(retain_graph=True)
        g_ref.pow(2).sum().backward(retain_graph=True)
    for a, b in zip([*param_grads(models), x.grad], [*param_grads(ref), x_ref.grad]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("second", ["grad_params", "backward_inputs", "grad_x"])
def test_a_second_backward_with_respect_to_anything_matches_the_plain_sum(second):
    models = _mixed()
    ref = clone_models(models)
    x = torch.randn(4, IN, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    found = []
    for ms, t, out in (
        (models, x, parsum.sum_models(models, x)),
        (ref, x_ref, plain_sum(ref, x_ref)),
    ):
        params = unique_params(ms)
        grads = torch.autograd.grad(out.pow(2).sum(), [t, *params], create_graph=True)
        penalty = sum(g.pow(2).sum() for g in grads)
        if second == "grad_params":
            found.append(torch.autograd.grad(penalty, params))
        elif second == "backward_inputs":
            penalty.backward(inputs=params)
            found.append([p.grad for p in params])
            assert t.grad is None
        else:
            found.append(torch.autograd.grad(penalty, t))
    for a, b in zip(*found):
        torch.testing.assert_close(a, b)


# Random scenarios: mixes of models (some running through ParallelSum, where a second backward
# must raise), weights, n_jobs, engines, and what is differentiated; never silently wrong.
SCENARIOS = ("penalty", "hvp", "third order", "grad of grads")
KINDS = ("mlp", "mlp", "mlp", "random mlp", "layernorm", "conv", "parametrized", "low rank")
KINDS += ("batchnorm", "repeated", "tied", "checkpointed", "nested", "constant", "frozen")
KINDS += ("dropout", "bag", "compiled")


def _random_models(rng: random.Random) -> tuple[list[nn.Module], list[str]]:
    from tests.test_differential import ModelMaker, TreeOut

    if rng.random() < 0.1:
        kinds = ["tree"] * rng.randint(1, 4)
        return [TreeOut(rng.choice([4, 8])) for _ in kinds], kinds
    # Smooth activations where the differential test's kinds use ReLU, whose second
    # derivative is zero.
    acts = (nn.Tanh, nn.GELU, nn.SiLU, nn.Softplus, nn.ELU, nn.ReLU)
    maker = ModelMaker(rng, act=nn.Tanh, acts=acts)
    kinds = [maker.add(rng.choice(KINDS)) for _ in range(rng.randint(1, 7))]
    models = maker.models
    if not any(p.requires_grad for m in models for p in m.parameters()):  # constants alone
        models.append(mlp([8]))
        kinds.append("mlp")
    return models, kinds


class _Block(nn.Module):
    """A class of its own: stacked, it runs through vmap."""

    def __init__(self, width, act):
        super().__init__()
        self.a, self.b, self.act = nn.Linear(IN, width), nn.Linear(width, OUT), act()

    def forward(self, x):
        return self.b(self.act(self.a(x))) + 0.5 * x[..., :OUT]


def _with_copies(rng: random.Random, models, kinds, weights):
    """``models`` with a group of identical ones (a Sequential, which runs as batched layers,
    or a class, through vmap; each initialized anew) inserted at random places, which engine
    "auto" stacks beside the others; ``kinds`` and float ``weights`` to match."""
    width, act = rng.choice([3, 6]), rng.choice([nn.Tanh, nn.SiLU, nn.GELU])
    n = rng.randint(8, 10)
    if rng.random() < 0.5:
        copies = [mlp([width], act).double() for _ in range(n)]
    else:
        copies = [_Block(width, act).double() for _ in range(n)]
    floats = isinstance(weights, list)
    entries = list(zip(models, kinds, weights if floats else [None] * len(models)))
    for k, m in enumerate(copies):
        entries.insert(rng.randint(0, len(entries)), (m, "copies", 0.75 - 0.125 * k))
    models, kinds, found = (list(t) for t in zip(*entries))
    return models, kinds, found if floats else weights


def _leaf_sum(y):
    return sum(t.sum() for t in pytree.tree_leaves(y))


def _play(scenario: str, forward, models, x, weights=None) -> list[torch.Tensor | None]:
    """The scenario's results: what it differentiates, then every .grad it leaves. With
    ``weights="learned"``, the weights are a softmax of logits, whose gradient comes last."""
    x = x.detach().clone().requires_grad_()
    params = unique_params(models)
    trained = [p for p in params if p.requires_grad]
    logits = None
    if weights == "learned":
        logits = torch.linspace(-1.0, 1.0, len(models), dtype=x.dtype, requires_grad=True)
        weights = torch.softmax(logits, 0)
    y = forward(models, x, weights)
    if scenario == "penalty":
        (g,) = torch.autograd.grad(_leaf_sum(y), x, create_graph=True)
        loss = (
            sum(t.pow(2).mean() for t in pytree.tree_leaves(y)) + (g.norm(dim=1) - 1).pow(2).mean()
        )
        loss.backward()
        found = [loss.detach()]
    elif scenario == "hvp":
        grads = torch.autograd.grad(_leaf_sum(y).pow(2), trained, create_graph=True)
        found = list(torch.autograd.grad(grads, trained, [torch.ones_like(g) for g in grads]))
    elif scenario == "third order":
        (g,) = torch.autograd.grad(_leaf_sum(y), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.pow(2).sum(), x, create_graph=True)
        loss = gg.pow(2).sum() + _leaf_sum(y)
        loss.backward()
        found = [loss.detach()]
    else:  # "grad of grads": second order in every parameter and x at once
        grads = torch.autograd.grad(_leaf_sum(y).pow(2), [x, *trained], create_graph=True)
        sum(g.pow(2).sum() for g in grads).backward()
        found = []
    return [*found, x.grad, *(p.grad for p in params), None if logits is None else logits.grad]


def check_derivatives(seed: int) -> int:
    """Play scenario ``seed``; how many of its two parsum runs were refused (or failed as the
    plain loop fails: an op without a second derivative)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    models, kinds = _random_models(rng)
    models = [m.double() for m in models]
    scenario = rng.choice(SCENARIOS)
    weights = WEIGHTS[: len(models)] if len(models) <= len(WEIGHTS) and rng.random() < 0.4 else None
    engine = rng.choice(["auto", "auto", "autograd", "vjp"])
    if {"nested", "checkpointed", "batchnorm"} & set(kinds):  # what torch.func refuses to run
        engine = "auto"
    if "dropout" in kinds:  # stacked models draw from vmap's stream, not the plain loop's
        engine = "autograd"
    # NOTE [ A learned weight tensor's derivatives ] (drawn last: the draws before as they were)
    if weights is None and rng.random() < 0.3:
        weights = "learned"
    # NOTE [ Stacked groups in the caller's graph ] in parsum._inline (drawn last again)
    if rng.random() < 0.35 and "tree" not in kinds:  # (a tree's output is not a tensor)
        models, kinds, weights = _with_copies(rng, models, kinds, weights)
    # NOTE [ Tensor hooks in the caller's graph ] in parsum._inline (drawn last again): a
    # hook halving the gradient of a parameter or two, on every copy of the models
    hooked = []
    if rng.random() < 0.3:
        for _ in range(rng.choice([1, 2])):
            i = rng.randrange(len(models))
            n = len(list(models[i].parameters()))
            if n:
                hooked.append((i, rng.randrange(n)))

    def with_hooks(ms):
        for i, k in hooked:
            p = list(ms[i].parameters())[k]
            if p.requires_grad:
                p.register_hook(lambda g: g * 0.5)
        return ms

    x = torch.randn(5, IN, dtype=torch.float64)
    ref = with_hooks(clone_models(models))
    torch.manual_seed(seed)  # the same dropout masks: parsum draws in model order
    try:
        want = _play(scenario, lambda m, t, w: plain_sum(m, t, weights=w), ref, x, weights)
    except (RuntimeError, NotImplementedError) as plain_error:  # an op without a derivative
        for n_jobs in (1, 2):
            with pytest.raises((RuntimeError, NotImplementedError)) as raised:
                call = functools.partial(parsum.sum_models, n_jobs=n_jobs, engine=engine)
                _play(scenario, lambda m, t, w, c=call: c(m, t, weights=w), models, x, weights)
            message = str(raised.value)
            named = (
                message == str(plain_error)  # raised outside sum_models, as in the plain loop
                or f"raised {type(plain_error).__name__}" in message  # a model, named
                or "not differentiable here" in message
            )
            assert named, f"seed {seed}: {kinds}: {message}"
        return 2
    runs = []
    refused = 0
    for n_jobs in (1, 2):
        mine = with_hooks(clone_models(models))

        def call(m, t, w, n_jobs=n_jobs):
            return parsum.sum_models(m, t, weights=w, n_jobs=n_jobs, engine=engine)

        try:
            torch.manual_seed(seed)
            got = _play(scenario, call, mine, x, weights)
        except parsum.ParsumError as err:
            if "not differentiable here" in str(err) or "engine='vjp'" in str(err):
                refused += 1
                continue  # refused, not wrong (docs/limits.md)
            raise AssertionError(f"seed {seed}: {kinds}, {scenario}, {engine}: {err}") from err
        runs.append(got)
        for a, b in zip(got, want):
            assert (a is None) == (b is None), f"seed {seed}: {kinds}, {scenario}"
            if a is not None:
                torch.testing.assert_close(
                    a, b, msg=lambda m: f"seed {seed}: {kinds}, {scenario}: {m}"
                )
    if len(runs) == 2:
        assert all(a is b or torch.equal(a, b) for a, b in zip(*runs)), f"seed {seed}: bits"
    return refused


@pytest.mark.parametrize("seed", range(40))
def test_random_scenarios(seed):
    check_derivatives(seed)


def test_a_gradient_in_x_alone_differentiates_no_parameter(monkeypatch):
    # The parameters' derivatives with their graphs cost as much again; where the running
    # backward does not want them (autograd.grad with respect to x), none is made.
    made: list[_double_backward.Derivatives] = []
    add = _double_backward.Holds.add
    monkeypatch.setattr(
        _double_backward.Holds, "add", lambda self, held: (made.append(held), add(self, held))
    )
    models = _mixed()
    ref = clone_models(models)
    x = torch.randn(4, IN, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(parsum.sum_models(models, x).sum(), x, create_graph=True)
    n_params = len(made[0].plan.params)
    assert made[0].found[-n_params:] == [None] * n_params and made[0].found[0] is not None
    g.pow(2).sum().backward()  # the parameters' second-order terms still come through x's
    x_ref = x.detach().clone().requires_grad_()
    (g_ref,) = torch.autograd.grad(plain_sum(ref, x_ref).sum(), x_ref, create_graph=True)
    g_ref.pow(2).sum().backward()
    for a, b in zip([*param_grads(models), x.grad], [*param_grads(ref), x_ref.grad]):
        torch.testing.assert_close(a, b)


@pytest.mark.timeout(120, method="thread")
@pytest.mark.parametrize("make", [_mixed, _with_groups])
def test_concurrent_callers_differentiate_twice_on_shared_models(make):
    models = make()
    ref = clone_models(models)
    xs = [torch.randn(5, IN, dtype=torch.float64) for _ in range(4)]

    def second_order(forward, ms, x):
        x = x.clone().requires_grad_()
        y = forward(ms, x)
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        loss = (g.norm(dim=1) - 1).pow(2).mean() + y.pow(2).mean()
        return torch.autograd.grad(loss, unique_params(ms))

    want = [second_order(plain_sum, ref, x) for x in xs]
    failures: list[str] = []

    def work(k: int) -> None:
        try:
            for _ in range(5):
                got = second_order(lambda m, t: parsum.sum_models(m, t, n_jobs=2), models, xs[k])
                for a, b in zip(got, want[k]):
                    torch.testing.assert_close(a, b)
        except Exception as exc:  # reported by the caller's thread
            failures.append(repr(exc))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a caller hung"
    assert not failures, failures[0]


@pytest.mark.parametrize("holder", ["FlatGrad", "SumOfModels"])
def test_gradient_penalty_through_a_flatgrad_and_a_sum_of_models(holder):
    models = zoo(torch.float64)
    ref = clone_models(models)
    x = torch.randn(5, IN, dtype=torch.float64)
    if holder == "FlatGrad":
        flat = parsum.FlatGrad(models)
        forward = parsum.sum_models
    else:
        ensemble = parsum.SumOfModels(models, weights=WEIGHTS)
        forward = lambda m, t: ensemble(t)  # noqa: E731
    got = _penalized(forward, models, x)
    want = _penalized(
        lambda m, t: plain_sum(m, t, weights=None if holder == "FlatGrad" else WEIGHTS), ref, x
    )
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    if holder == "FlatGrad":  # the gradients landed in the buffer's views
        for p in unique_params(models):
            assert p.grad.untyped_storage().data_ptr() == flat.flat.untyped_storage().data_ptr()


def test_autograd_functional_hessian_hvp_and_vhp():
    models = _mixed()
    x = torch.randn(2, IN, dtype=torch.float64)
    v = torch.randn(2, IN, dtype=torch.float64)

    def ours(t):
        return parsum.sum_models(models, t).sum()

    def plain(t):
        return plain_sum(models, t).sum()

    functional = torch.autograd.functional
    torch.testing.assert_close(functional.hessian(ours, x), functional.hessian(plain, x))
    # Under vmap (NOTE [ Gradients under vmap ] in parsum._inline)
    vectorized = functional.hessian(ours, x, vectorize=True)
    torch.testing.assert_close(vectorized, functional.hessian(plain, x))
    for product in (functional.hvp, functional.vhp):  # hvp differentiates a vjp again
        torch.testing.assert_close(product(ours, x, v)[1], product(plain, x, v)[1])


if __name__ == "__main__":
    first, count = (int(a) for a in sys.argv[1:3])
    refusals = sum(check_derivatives(s) for s in range(first, first + count))
    print(
        f"{count} scenarios from seed {first}: all right ({refusals} of {2 * count} runs "
        "refused, or failing as the plain loop does)"
    )
