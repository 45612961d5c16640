"""Models of known layers summed as a plain graph (NOTE [ Known layers in a plain graph ] in
parsum._plain_graph): the bits of the general paths, the plain loop's gradients, the general
path wherever the conditions fail, failures named."""

import contextlib
import math
import re
import threading

import pytest
import torch
from torch import nn

import parsum
from parsum import _api, _grouping, _plans, _pool
from parsum._engines import ModelParams
from parsum._grouping import Batch
from tests.zoo import (
    IN,
    OUT,
    clone_models,
    mlp,
    param_grads,
    plain_graph,
    plain_sum,
    through_parallel_sum,
    without_plain_graphs,
)

pytestmark = pytest.mark.timeout(60)


def heads(seed: int = 0) -> list[nn.Module]:
    """Sequentials of Linear layers and activations: repeated architectures (stacked groups,
    interleaved with each other) and models of their own."""
    torch.manual_seed(seed)
    # Two hidden layers: groups of 4 stack on one thread (NOTE [ Small groups of few layers ]
    # in parsum._grouping)
    models: list[nn.Module] = [
        mlp([(5, 7, 9)[i % 3] if i < 12 else 11 + i] * 2, (nn.Tanh, nn.ReLU, nn.GELU)[i % 3])
        for i in range(14)
    ]
    models.append(nn.Linear(IN, OUT))
    return models


WEIGHTS = {
    "none": None,
    "mean": [1 / 15] * 15,
    "distinct": [0.5 + 0.25 * i for i in range(15)],
    "a zero": [0.0] + [1.5] * 14,
}


def grads_of(models, x, weights, how, n_jobs, preset):
    """The sum and the gradients of a squared loss as ``how`` takes them: the parameters', and
    the argument's where it needs one (read through a leaf of its own)."""
    if preset:
        for p in (p for m in models for p in m.parameters()):
            p.grad = torch.full_like(p, 0.25)
    wrt_x = [x.detach().requires_grad_()] if x.requires_grad else []
    y = parsum.sum_models(models, wrt_x[0] if wrt_x else x, weights=weights, n_jobs=n_jobs)
    loss = y.pow(2).sum()
    params = [p for m in models for p in m.parameters()]
    if how == "backward":
        loss.backward()
        return y, plain_graph(y), param_grads(models) + [t.grad for t in wrt_x]
    if how == "inputs":
        loss.backward(inputs=params[::2] + wrt_x)
        return y, plain_graph(y), param_grads(models) + [t.grad for t in wrt_x]
    return y, plain_graph(y), list(torch.autograd.grad(loss, params + wrt_x))


@pytest.mark.parametrize("engine", ["auto", "autograd"])
@pytest.mark.parametrize("x_grad", [False, True])
@pytest.mark.parametrize("preset", [False, True])
@pytest.mark.parametrize("how", ["backward", "inputs", "autograd.grad"])
@pytest.mark.parametrize("weights", list(WEIGHTS))
def test_the_bits_of_the_general_paths(weights, how, preset, x_grad, engine, cores, monkeypatch):
    # With x_grad, the argument's gradient too (NOTE [ An argument that needs a gradient in a
    # plain graph ] in parsum._plain_graph); engine "autograd": every model one by one, their
    # outputs joined by one stack
    cores(1)  # one thread: the calling thread's intra-op count is every chunk's
    x = torch.randn(10, IN, requires_grad=x_grad)
    w = WEIGHTS[weights]
    base = heads()
    with parsum.config(engine=engine):
        the_same_bits_on_every_path(base, x, w, how, preset, monkeypatch)


def the_same_bits_on_every_path(base, x, weights, how, preset, monkeypatch):
    """Assert that copies of ``base`` give the same sum and gradients (``grads_of``) as a
    plain graph with n_jobs unset and 1, through the caller's graph and through ParallelSum at
    n_jobs 1-3; the plain graph's sum and gradients."""
    runs = []
    for n_jobs in (None, 1):
        runs.append(grads_of(clone_models(base), x, weights, how, n_jobs, preset))
    monkeypatch.setattr(_api, "sum_in_plain_graph", lambda *a: None)  # the caller's graph
    runs.append(grads_of(clone_models(base), x, weights, how, None, preset))
    through_parallel_sum(monkeypatch)
    for n_jobs in (1, 2, 3):
        runs.append(grads_of(clone_models(base), x, weights, how, n_jobs, preset))
    assert [r[1] for r in runs] == [True, True, False, False, False, False]
    y0, _, g0 = runs[0]
    for y, _, g in runs[1:]:
        assert torch.equal(y, y0)
        for a, b in zip(g, g0, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)
    return y0, g0


CONTEXTS = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.mark.parametrize("engine", ["auto", "autograd"])
@pytest.mark.parametrize("x_grad", [False, True])
@pytest.mark.parametrize("weights", [*WEIGHTS, "a tensor", "learned"])
@pytest.mark.parametrize("context", list(CONTEXTS))
def test_with_no_graph_the_bits_of_the_general_paths(context, weights, x_grad, engine, cores):
    # NOTE [ Known layers with no graph ] in parsum._plain_graph: the forward of the plain
    # graph with nothing recorded, the general path's bits (and the sum with a graph's).
    cores(1)
    base = heads(seed=11)
    x = torch.randn(10, IN, requires_grad=x_grad)
    if weights == "a tensor":
        w = torch.linspace(0.5, 2.0, len(base))
    elif weights == "learned":  # a weight tensor that needs a gradient, read with no graph
        w = torch.softmax(torch.linspace(-1.0, 1.0, len(base), requires_grad=True), 0)
    else:
        w = WEIGHTS[weights]
    with parsum.config(engine=engine):
        with_graph = parsum.sum_models(clone_models(base), x, weights=w)
        assert plain_graph(with_graph)
        with CONTEXTS[context]():
            y = parsum.sum_models(clone_models(base), x, weights=w)
        assert plain_graph(y) and not y.requires_grad
        assert torch.equal(y, with_graph.detach())
        with pytest.MonkeyPatch.context() as patch:
            without_plain_graphs(patch)
            for n_jobs in (None, 1, 2, 3):
                with CONTEXTS[context]():
                    general = parsum.sum_models(clone_models(base), x, weights=w, n_jobs=n_jobs)
                assert not plain_graph(general)
                assert torch.equal(general, y)
    expected = plain_sum(clone_models(base), x.detach(), weights=w)
    torch.testing.assert_close(y, expected.detach())
    # The same models with a graph after the call with none: their stacks' copies made with
    # no graph are not the backward's
    models = clone_models(base)
    with parsum.config(engine=engine):
        with CONTEXTS[context]():
            parsum.sum_models(models, x, weights=w)
        y = parsum.sum_models(models, x, weights=w)
    assert plain_graph(y) and torch.equal(y, with_graph)
    y.pow(2).sum().backward()
    reference = clone_models(base)
    plain_weights = w.detach() if isinstance(w, torch.Tensor) else w  # its graph was used
    plain_sum(reference, x.detach(), weights=plain_weights).pow(2).sum().backward()
    for a, b in zip(param_grads(models), param_grads(reference), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("context", [*CONTEXTS, "a graph"])
def test_a_plain_graph_teaches_the_walk_that_its_models_draw_nothing(context, cores, monkeypatch):
    # What the general path's first call learns (NOTE [ Models seen not to draw ] in
    # parsum._random): known layers draw nothing, so that the next call on workers runs its
    # forwards on them rather than in model order first.
    cores(2)
    models = heads(seed=12)
    x = torch.randn(10, IN)
    with CONTEXTS.get(context, contextlib.nullcontext)():
        assert plain_graph(parsum.sum_models(models, x))
    assert _plans.known_walk(models).draws_random is False
    workers = []
    run_ordered = _pool.run_ordered

    def spy(task, n_tasks, n_workers, *rest):
        workers.append(n_workers)
        run_ordered(task, n_tasks, n_workers, *rest)

    monkeypatch.setattr(_pool, "run_ordered", spy)
    with torch.no_grad():
        parsum.sum_models(models, x, n_jobs=2)
    assert workers == [2]  # the forwards' job, on 2 workers


def with_a_trunk(seed: int = 0) -> list[nn.Module]:
    """Heads over one trunk each model runs, a head of its own twice, and models that share
    nothing: parameters several models use (NOTE [ Parameters several models use in a plain
    graph ] in parsum._plain_graph)."""
    torch.manual_seed(seed)
    trunk = nn.Sequential(nn.Linear(IN, 6), nn.Tanh())
    models: list[nn.Module] = [
        nn.Sequential(trunk, nn.Linear(6, 3 + i % 3), nn.ReLU(), nn.Linear(3 + i % 3, OUT))
        for i in range(7)
    ]
    models.append(models[2])  # the same model twice: every parameter of it twice
    models += [mlp([5 + i]) for i in range(3)]
    models.insert(4, nn.Sequential(nn.Linear(IN, 6), trunk[1], nn.Linear(6, OUT)))
    return models


@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize("x_grad", [False, True])
@pytest.mark.parametrize("how", ["backward", "autograd.grad"])
@pytest.mark.parametrize("weights", ["none", "distinct"])
def test_parameters_several_models_use(weights, how, x_grad, chunk_size, cores, monkeypatch):
    # Their gradients added as the general path adds them: model by model within a chunk and
    # the chunks in order, or all at once where the argument's are (x_grad)
    cores(1)
    x = torch.randn(10, IN, requires_grad=x_grad)
    base = with_a_trunk()
    w = None if weights == "none" else [0.5 + 0.25 * i for i in range(len(base))]
    with parsum.config(chunk_size=chunk_size):
        y0, g0 = the_same_bits_on_every_path(base, x, w, how, False, monkeypatch)
    # And the plain loop's, within rounding
    reference = clone_models(base)
    xr = x.detach().requires_grad_(x_grad)
    expected = plain_sum(reference, xr, weights=w)
    torch.testing.assert_close(y0, expected)
    if how == "backward":
        expected.pow(2).sum().backward()
        wanted = param_grads(reference) + ([xr.grad] if x_grad else [])
    else:
        params = [p for m in reference for p in m.parameters()] + ([xr] if x_grad else [])
        wanted = list(torch.autograd.grad(expected.pow(2).sum(), params))
    for a, b in zip(g0, wanted, strict=True):
        torch.testing.assert_close(a, b)


def test_a_penalty_through_parameters_several_models_use(cores):
    # Second derivatives through a trunk's gradient, against the plain loop
    cores(1)
    base = with_a_trunk(seed=3)
    x = torch.randn(8, IN)

    def penalized(models, y):
        params = [p for m in models for p in m.parameters()]
        first = torch.autograd.grad(y.pow(2).sum(), params, create_graph=True)
        return torch.autograd.grad(sum(g.pow(2).sum() for g in first), params)

    models, reference = clone_models(base), clone_models(base)
    wide = [m.double() for m in clone_models(base)]
    y = parsum.sum_models(models, x)
    assert plain_graph(y)
    got, expected = penalized(models, y), penalized(reference, plain_sum(reference, x))
    exact = penalized(wide, plain_sum(wide, x.double()))
    for a, b, c in zip(got, expected, exact, strict=True):
        # float32 second derivatives of up to about 30: rounding of 1e-5 relative
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        scale = c.abs().max().item()
        assert (a.double() - c).abs().max() <= 1e-6 * scale + 1e-7


def weighted_by_a_tensor(models, x, kind, n_jobs):
    """The sum weighted by a tensor of ``kind``, and the gradients of a squared loss: the
    parameters', and the logits' or the weights' where they need one."""
    logits = torch.linspace(-1.0, 1.5, len(models)).requires_grad_(kind != "frozen")
    weights = {"a leaf": logits, "a softmax": torch.softmax(logits, 0), "frozen": logits}[kind]
    y = parsum.sum_models(models, x, weights=weights, n_jobs=n_jobs)
    y.pow(2).sum().backward()
    return y, plain_graph(y), [*param_grads(models), logits.grad]


@pytest.mark.parametrize("kind", ["a leaf", "a softmax", "frozen"])
def test_a_weight_tensor(kind, cores, monkeypatch):
    # NOTE [ A weight tensor in a plain graph ] in parsum._plain_graph: the sum, the
    # parameters' gradients and the weights' (a softmax's logits') those of the general paths
    cores(1)
    x = torch.randn(10, IN)
    base = heads(seed=14)
    runs = [weighted_by_a_tensor(clone_models(base), x, kind, n_jobs) for n_jobs in (None, 1)]
    monkeypatch.setattr(_api, "sum_in_plain_graph", lambda *a: None)  # the caller's graph
    runs.append(weighted_by_a_tensor(clone_models(base), x, kind, None))
    through_parallel_sum(monkeypatch)
    for n_jobs in (1, 2, 3):
        runs.append(weighted_by_a_tensor(clone_models(base), x, kind, n_jobs))
    assert [r[1] for r in runs] == [True, True, False, False, False, False]
    y0, _, g0 = runs[0]
    assert (g0[-1] is None) == (kind == "frozen")
    for y, _, g in runs[1:]:
        assert torch.equal(y, y0)
        for a, b in zip(g, g0, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)
    reference = clone_models(base)
    logits = torch.linspace(-1.0, 1.5, len(base)).requires_grad_(kind != "frozen")
    weights = torch.softmax(logits, 0) if kind == "a softmax" else logits
    plain_sum(reference, x, weights=weights).pow(2).sum().backward()
    for a, b in zip(g0, [*param_grads(reference), logits.grad], strict=True):
        assert (a is None and b is None) or torch.testing.assert_close(a, b) is None


def test_a_penalty_on_learned_weights(cores):
    # The weights' gradient differentiated again (create_graph=True): through the outputs
    # kept with their graph, it reaches the parameters as in the plain loop
    cores(1)
    x = torch.randn(8, IN)

    def penalty(models, total_of):
        logits = torch.linspace(-1.0, 1.0, len(models)).requires_grad_()
        total = total_of(models, x, torch.softmax(logits, 0))
        params = [p for m in models for p in m.parameters()]
        grads = torch.autograd.grad(total.pow(2).sum(), [logits, *params], create_graph=True)
        loss = sum(g.pow(2).sum() for g in grads)
        return torch.autograd.grad(loss, [logits, *params]), plain_graph(total)

    models = heads(seed=15)
    got, plain = penalty(models, lambda m, t, w: parsum.sum_models(m, t, weights=w))
    assert plain
    expected, _ = penalty(clone_models(models), lambda m, t, w: plain_sum(m, t, weights=w))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("weights", ["none", "distinct"])
def test_the_plain_loop_and_float64(weights, cores):
    cores(1)
    models = heads(seed=1)
    x = torch.randn(12, IN)
    w = WEIGHTS[weights]
    y = parsum.sum_models(models, x, weights=w)
    assert plain_graph(y)
    y.pow(2).sum().backward()
    reference = clone_models(models)
    for p in (p for m in reference for p in m.parameters()):
        p.grad = None
    expected = plain_sum(reference, x, weights=w)
    expected.pow(2).sum().backward()
    torch.testing.assert_close(y, expected)
    for a, b in zip(param_grads(models), param_grads(reference)):
        torch.testing.assert_close(a, b)
    exact = plain_sum([m.double() for m in clone_models(models)], x.double(), weights=w)
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)


def test_a_penalty_through_the_plain_graph(cores):
    cores(1)
    models = heads(seed=2)
    x = torch.randn(8, IN)
    params = [p for m in models for p in m.parameters()]

    def penalty(total):
        grads = torch.autograd.grad(total.pow(2).sum(), params, create_graph=True)
        return sum(g.pow(2).sum() for g in grads)

    y = parsum.sum_models(models, x)
    assert plain_graph(y)
    got = torch.autograd.grad(penalty(y), params)
    expected = torch.autograd.grad(penalty(plain_sum(models, x)), params)
    for a, b in zip(got, expected):  # batched matmuls in the stacked groups: other roundings
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_trunk_before_the_heads(cores, monkeypatch):
    # Heads over a trunk's features, which need a gradient: a plain graph, whose gradients
    # (the trunk's too) are the general path's bit for bit
    cores(1)
    x = torch.randn(11, IN)
    torch.manual_seed(12)
    trunk = nn.Sequential(nn.Linear(IN, IN), nn.Tanh())

    def step(general):
        if general:
            without_plain_graphs(monkeypatch)
        models, body = heads(seed=12), clone_models([trunk])[0]
        y = parsum.sum_models(models, body(x))
        assert plain_graph(y) is not general
        y.pow(2).sum().backward()
        monkeypatch.undo()
        return y, param_grads([body, *models])

    (y, grads), (y0, grads0) = step(False), step(True)
    assert torch.equal(y, y0)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads0))
    models, body = heads(seed=12), clone_models([trunk])[0]
    plain_sum(models, body(x)).pow(2).sum().backward()
    for a, b in zip(grads, param_grads([body, *models])):
        torch.testing.assert_close(a, b)


def test_a_gradient_penalty_in_the_argument(cores):
    # A WGAN-GP penalty: the sum's gradient in x, differentiated again
    cores(1)
    x = torch.randn(8, IN)

    def penalty(models, total_of):
        leaf = x.detach().requires_grad_()
        total = total_of(models, leaf)
        (g,) = torch.autograd.grad(total.sum(), leaf, create_graph=True)
        return (g.norm(dim=1) - 1).pow(2).mean() + total.pow(2).mean(), plain_graph(total)

    models = heads(seed=13)
    reference = clone_models(models)
    loss, plain = penalty(models, lambda m, t: parsum.sum_models(m, t))
    assert plain
    loss.backward()
    expected, _ = penalty(reference, plain_sum)
    expected.backward()
    for a, b in zip(param_grads(models), param_grads(reference)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_retained_graph_twice(cores):
    cores(1)
    models = heads(seed=3)
    reference = clone_models(models)
    x = torch.randn(8, IN)
    y = parsum.sum_models(models, x)
    assert plain_graph(y)
    loss = y.pow(2).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    expected = plain_sum(reference, x).pow(2).sum()
    expected.backward(retain_graph=True)
    expected.backward()
    for a, b in zip(param_grads(models), param_grads(reference)):
        torch.testing.assert_close(a, b)


def test_failures_named_by_the_general_path(cores):
    cores(1)
    models = heads(seed=4)
    with pytest.raises(parsum.ParsumError, match=r"model 0 \(Sequential\)"):
        parsum.sum_models(models, torch.randn(5, IN + 1)).sum().backward()
    models[6] = nn.Sequential(nn.Linear(IN, 4), nn.Tanh(), nn.Linear(4, OUT + 1))
    with pytest.raises(parsum.ParsumError, match=r"model 6 \(Sequential\)"):
        parsum.sum_models(models, torch.randn(5, IN))
    assert all(p.grad is None for m in models for p in m.parameters())


def written_before_backward(models, x, write, general, monkeypatch):
    """The error and the parameters' gradients of a backward after ``write(models, x)``,
    through the plain graph or, with ``general``, the general path."""
    if general:
        without_plain_graphs(monkeypatch)
    y = parsum.sum_models(models, x)
    assert plain_graph(y) is not general
    with torch.no_grad():
        write(models, x)
    try:
        y.pow(2).sum().backward()
    except parsum.ParsumError as exc:
        return str(exc), param_grads(models)
    finally:
        monkeypatch.undo()
    return None, param_grads(models)


WRITES = {
    # Saved by the models' graphs: autograd raises as it reaches them
    "a later layer's weight": (lambda m, x: m[13][2].weight.mul_(2.0), "model 13"),
    "the argument": (lambda m, x: x.add_(1.0), "model 0"),
    # Saved by none (the argument needs no gradient, a bias is never read): no error
    "a first layer's weight": (lambda m, x: m[13][0].weight.mul_(2.0), None),
    "a bias": (lambda m, x: m[12][2].bias.add_(1.0), None),
    # A stacked group saved its stacked copies, marked written with the model's own (NOTE
    # [ Weights written before a group's backward ] in parsum._engines): the model is named
    "a stacked model's weight": (lambda m, x: m[3][2].weight.mul_(2.0), "model 3"),
    "a stacked model's bias": (lambda m, x: m[3][2].bias.add_(1.0), None),
}


@pytest.mark.parametrize("write", list(WRITES))
def test_tensors_written_before_the_backward(write, cores, monkeypatch):
    # NOTE [ Tensors written before the backward ] in parsum._plain_graph: the model named as
    # the general path names it, no gradient written; where no graph saved the tensor, the
    # general path's gradients, bit for bit.
    cores(1)
    edit, named = WRITES[write]
    models = heads(seed=9)
    x = torch.randn(9, IN)
    general_models, general_x = clone_models(models), x.clone()
    error, grads = written_before_backward(models, x, edit, False, monkeypatch)
    expected, expected_grads = written_before_backward(
        general_models, general_x, edit, True, monkeypatch
    )
    # the same message, the tensors' version counts aside (the copies' histories differ)
    assert re.sub(r"version \d+", "version", str(error)) == re.sub(
        r"version \d+", "version", str(expected)
    )
    if named is None:
        assert error is None
        assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads))
    else:
        assert error is not None and f"{named} (Sequential)" in error
        assert "raised RuntimeError in backward" in error
        assert "modified by an inplace operation" in error
        assert all(g is None for g in grads)


def test_a_tensor_written_before_the_backward_with_learned_weights(cores):
    cores(1)
    models = heads(seed=16)
    logits = torch.zeros(len(models), requires_grad=True)
    y = parsum.sum_models(models, torch.randn(9, IN), weights=torch.softmax(logits, 0))
    assert plain_graph(y)
    with torch.no_grad():
        models[13][2].weight.mul_(2.0)
    with pytest.raises(parsum.ParsumError, match=r"model 13 \(Sequential\) raised RuntimeError"):
        y.pow(2).sum().backward()
    assert logits.grad is None
    assert all(p.grad is None for m in models for p in m.parameters())


@pytest.mark.parametrize("general", [False, True], ids=["plain graph", "general path"])
def test_a_weight_tensor_written_before_the_backward_raises_as_in_the_plain_loop(
    general, cores, monkeypatch
):
    # Read as floats, the weights were saved by the general path's node and by the plain
    # loop's products, not by the plain graph, whose backward ran on with the forward's floats.
    cores(1)
    models = heads(seed=17)
    weights = torch.linspace(0.5, 1.5, len(models))
    if general:
        without_plain_graphs(monkeypatch)
    y = parsum.sum_models(models, torch.randn(9, IN), weights=weights)
    assert plain_graph(y) is not general
    weights.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.pow(2).sum().backward()
    assert all(p.grad is None for m in models for p in m.parameters())


def test_the_check_reads_no_graph_where_nothing_was_written(cores, monkeypatch):
    cores(1)
    models = heads(seed=10)
    read = []
    unpack = parsum._plain_graph.unpack_saved
    monkeypatch.setattr(parsum._plain_graph, "unpack_saved", lambda roots: read.append(roots))
    y = parsum.sum_models(models, torch.randn(9, IN))
    assert plain_graph(y)
    y.pow(2).sum().backward(retain_graph=True)
    assert read == []
    with torch.no_grad():
        models[13][2].weight.mul_(2.0)
    monkeypatch.setattr(parsum._plain_graph, "unpack_saved", unpack)
    with pytest.raises(parsum.ParsumError, match=r"model 13 \(Sequential\)"):
        y.pow(2).sum().backward()


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
@pytest.mark.parametrize("context", ["anomaly detection", "saved-tensor hooks"])
def test_python_in_the_backward_takes_the_general_path(context, cores):
    # Python the backward would run in the models' graphs may fail there: the general path
    # names the model.
    cores(1)
    models = heads(seed=11)
    x = torch.randn(9, IN)

    def fails(t):
        raise ValueError("unpacked")

    if context == "anomaly detection":
        manager = torch.autograd.detect_anomaly(check_nan=False)
    else:
        manager = torch.autograd.graph.saved_tensors_hooks(lambda t: t, fails)
    with manager:
        y = parsum.sum_models(models, x)
    assert not plain_graph(y)
    if context == "anomaly detection":
        y.pow(2).sum().backward()
        reference = clone_models(models)
        for m in reference:
            m.zero_grad(set_to_none=True)
        plain_sum(reference, x).pow(2).sum().backward()
        for a, b in zip(param_grads(models), param_grads(reference)):
            torch.testing.assert_close(a, b)
    else:
        with pytest.raises(parsum.ParsumError, match=r"raised ValueError in backward: unpacked"):
            y.pow(2).sum().backward()
        assert all(p.grad is None for m in models for p in m.parameters())


def with_hook(models):
    models[3][0].weight.register_hook(lambda g: g * 0.5)
    return models


def in_place_first(models):
    models[0] = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(IN, OUT))
    return models


def dropout(models):
    models[5] = nn.Sequential(nn.Linear(IN, 4), nn.Dropout(0.5), nn.Linear(4, OUT)).eval()
    return models


def batch_norm(models):
    models[5] = nn.Sequential(nn.Linear(IN, 4), nn.BatchNorm1d(4), nn.Linear(4, OUT))
    return models


def own_class(models):
    class Own(nn.Sequential):
        pass

    models[0] = Own(nn.Linear(IN, OUT))
    return models


CHANGES = {
    "a hooked parameter": (with_hook, {}),
    "a first layer in place": (in_place_first, {}),
    "dropout": (dropout, {}),
    "batch norm": (batch_norm, {}),
    "a class of the user's": (own_class, {}),
    "an argument whose gradient is too large to sum at once": (
        lambda m: m,
        {"x_grad": True, "rows": 6000},
    ),
    "a weight tensor of integers": (lambda m: m, {"weights": torch.full((15,), 2)}),
    "float64": (lambda m: [x.double() for x in m], {"dtype": torch.float64}),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_the_general_path_where_the_conditions_fail(change, cores):
    cores(1)
    edit, options = CHANGES[change]
    models = edit(heads(seed=5))
    reference = clone_models(models)
    if edit is with_hook:  # a copy leaves the tensor hooks behind
        with_hook(reference)
    dtype = options.get("dtype", torch.float32)
    rows = options.get("rows", 9)
    x = torch.randn(rows, IN, dtype=dtype, requires_grad=options.get("x_grad", False))
    weights = options.get("weights")
    y = parsum.sum_models(models, x, weights=weights)
    assert not plain_graph(y)
    y.pow(2).sum().backward()
    expected = plain_sum(reference, x, weights=weights)
    torch.testing.assert_close(y, expected)
    expected.pow(2).sum().backward()
    for a, b in zip(param_grads(models), param_grads(reference)):
        # float32 gradients over up to 6000 rows, each adding in its own order
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_small_models_on_two_threads_run_as_a_plain_graph(cores):
    cores(2)
    small = heads(seed=6)
    x = torch.randn(16, IN)
    assert plain_graph(parsum.sum_models(small, x))
    assert plain_graph(parsum.sum_models(small, x.requires_grad_()))
    learned = torch.softmax(torch.zeros(len(small), requires_grad=True), 0)
    assert plain_graph(parsum.sum_models(small, x, weights=learned))
    x = x.detach()
    # Kernels that weigh more than their Python: workers, the general path
    torch.manual_seed(6)
    large = [
        nn.Sequential(nn.Linear(64, w), nn.Tanh(), nn.Linear(w, w), nn.Tanh(), nn.Linear(w, 10))
        for w in (128, 256, 384, 512) * 2
    ]
    assert not plain_graph(parsum.sum_models(large, torch.randn(64, 64)))
    # An explicit n_jobs keeps its chunks, each on its share of the intra-op threads
    assert not plain_graph(parsum.sum_models(small, x, n_jobs=1))


@pytest.mark.parametrize(
    "stacked, share", [(False, 1.5), (True, 1.5), (False, 2.5)], ids=["alone", "stacked", "above"]
)
def test_models_below_the_kernel_share_run_as_a_plain_graph(cores, stacked, share):
    # NOTE [ Known layers on one thread ] in parsum._plain_graph: below C / O 2, models that run
    # alone and stacked groups (three groups of four models here) alike run in one chunk; from
    # 2, models that run alone go to workers (stacked groups may keep one chunk: NOTE
    # [ Pullbacks of small models ] in parsum._grouping).
    cores(2)
    torch.manual_seed(7)
    widths = (96, 104, 112) * 4 if stacked else tuple(96 + 8 * i for i in range(12))
    models = [
        nn.Sequential(nn.Linear(64, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10))
        for w in widths
    ]
    mps = [ModelParams.of(m) for m in models]
    one_row = _grouping._kernel_share(mps, Batch(1))
    x = torch.randn(math.ceil(share / one_row), 64)
    below = _grouping._kernel_share(mps, Batch.of([x])) < _grouping.PLAIN_GRAPH_MAX_KERNEL_SHARE
    assert below == (share < 2)
    y = parsum.sum_models(models, x)
    assert plain_graph(y) == below
    reference = clone_models(models)
    y.pow(2).sum().backward()
    expected = plain_sum(reference, x)
    torch.testing.assert_close(y, expected)
    expected.pow(2).sum().backward()
    for a, b in zip(param_grads(models), param_grads(reference)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_concurrent_callers(cores):
    cores(1)
    models = heads(seed=7)
    xs = [torch.randn(6, IN) for _ in range(4)]
    params = [p for m in models for p in m.parameters()]
    alone = []
    for x in xs:
        y = parsum.sum_models(models, x)
        alone.append((y, torch.autograd.grad(y.pow(2).sum(), params)))
    got: list = [None] * len(xs)
    errors: list[BaseException] = []

    def call(k: int) -> None:
        try:
            torch.set_num_threads(1)
            for _ in range(20):
                y = parsum.sum_models(models, xs[k])
                got[k] = (y, torch.autograd.grad(y.pow(2).sum(), params))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(k,)) for k in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    for (y, grads), (y0, grads0) in zip(got, alone):
        assert torch.equal(y, y0)
        assert all(torch.equal(a, b) for a, b in zip(grads, grads0))


def test_a_global_module_hook_runs(cores):
    cores(1)
    models = heads(seed=8)
    seen: list[str] = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda module, args, out: seen.append(type(module).__name__)
    )
    try:
        y = parsum.sum_models(models, torch.randn(4, IN))
    finally:
        handle.remove()
    assert not plain_graph(y)
    assert "Linear" in seen


def _doubling_linear_forward(self, x):
    return torch.nn.functional.linear(x, self.weight, self.bias) * 2


def _halving_sequential_forward(self, x):
    for module in self:
        x = module(x)
    return x / 2


_ORIGINAL_LINEAR = torch.nn.functional.linear


def _tripling_linear(x, weight, bias=None):
    return _ORIGINAL_LINEAR(x, weight, bias) * 3


_ORIGINAL_CALL = nn.Module.__call__


def _negating_call(self, *args, **kwargs):
    out = _ORIGINAL_CALL(self, *args, **kwargs)
    return -out if isinstance(self, nn.Linear) else out


@pytest.mark.parametrize("engine", ["auto", "stacked", "autograd"])
@pytest.mark.parametrize("n_jobs", [None, 1, 2])
@pytest.mark.parametrize("budget", [1, 2])
@pytest.mark.parametrize(
    ("cls", "name", "replacement"),
    [
        (nn.Linear, "forward", _doubling_linear_forward),
        (nn.Sequential, "forward", _halving_sequential_forward),
        (nn.Module, "__call__", _negating_call),
        (torch.nn.functional, "linear", _tripling_linear),
    ],
)
def test_torch_nn_calls_replaced_on_the_class_are_run(
    cls, name, replacement, budget, n_jobs, engine, cores, monkeypatch
):
    # NOTE [ torch.nn's calls replaced ] in parsum._torch_calls: the layers called directly (plain
    # graphs, direct programs) and stacked groups' batched matmuls stood in for these and ran
    # torch's own (Linear's forward doubling: values off by 2.0-2.5, silently).
    cores(budget)
    models = heads(seed=9)
    twins = clone_models(models)
    x = torch.randn(4, IN)
    parsum.sum_models(models, x, n_jobs=n_jobs, engine=engine)  # planned before
    monkeypatch.setattr(cls, name, replacement)
    y = parsum.sum_models(models, x, n_jobs=n_jobs, engine=engine)
    want = plain_sum(twins, x)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    y.pow(2).sum().backward()
    want.pow(2).sum().backward()
    for got, expected in zip(param_grads(models), param_grads(twins)):  # rounding, scaled
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6 * expected.abs().max())


def test_torch_nn_calls_are_recognised_as_torchs_own_on_this_torch():
    # Told by their names and modules (NOTE [ torch.nn's calls replaced ]): a release that
    # renamed one would turn every shortcut off, silently slower; this says so instead.
    from parsum._torch_calls import _TORCH_NN_OWN, torch_nn_untouched

    assert None not in _TORCH_NN_OWN and torch_nn_untouched()
