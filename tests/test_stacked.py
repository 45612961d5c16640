"""engine="stacked" and the stacked groups of engine="auto": which models are grouped, and
that a grouped call gives what the plain PyTorch expression gives."""

import collections
import contextlib
import copy
import io
import threading
import warnings

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import parsum
from parsum import _api, _engines
from parsum._engines import ModelParams
from parsum._grouping import AUTO_STACK_MAX_STATE_ELEMENTS, Batch, plan_units
from tests.test_errors import Boom
from tests.test_sum_models import TOL, assert_matches, assert_same_grads, run_both
from tests.zoo import (
    IN,
    OUT,
    Branchy,
    ConvNet,
    Probe,
    TwoLayers,
    clone_models,
    mlp,
    param_grads,
    plain_graph,
    plain_sum,
    thread_recorder,
    zeros_of_width_8,
)


def family(dtype=torch.float32, seed=0):
    """Three groups of identical architectures, interleaved, and two models of their own."""
    torch.manual_seed(seed)
    models = [
        mlp([8]),
        mlp([5, 7]),
        ConvNet(),
        mlp([8]),
        mlp([5, 7]),
        mlp([8], nn.ReLU),
        ConvNet(),
        mlp([8]),
        mlp([5, 7]),
        mlp([8]),
    ]
    return [m.to(dtype) for m in models]


def groups(models, engine, x=None, chunk_size=None, budget=2, forward_only=False):
    x = torch.randn(4, IN) if x is None else x
    found = [ModelParams.of(m) for m in models]
    units = plan_units(models, found, engine, Batch.of([x]), chunk_size, budget, None, forward_only)
    return [u.models for u in units if u.engine == "stacked"]


def test_identical_models_are_grouped_in_model_order():
    assert groups(family(), "stacked") == [(0, 3, 7, 9), (1, 4, 8), (2, 6)]
    assert groups(family(), "stacked", chunk_size=3) == [(0, 3, 7), (1, 4, 8), (2, 6)]
    assert groups(family(), "autograd") == []


def test_auto_groups_only_many_small_models():
    # Groups of 4 MLPs, 3 MLPs and 2 ConvNets: batched matmuls pay from 4 models, vmap from 8.
    assert groups(family(), "auto") == [(0, 3, 7, 9)]
    eight = [mlp([8]) for _ in range(8)] + [mlp([5])]
    assert groups(eight, "auto") == [tuple(range(8))]
    convs = [ConvNet() for _ in range(7)]
    assert groups(convs, "auto") == []
    assert groups([*convs, ConvNet()], "auto") == [tuple(range(8))]
    big = [mlp([1024, 1024]) for _ in range(8)]  # 1.06M parameters x 4 rows
    assert groups(big, "auto") == []
    assert groups(big, "stacked") == [tuple(range(8))]


def test_auto_groups_on_one_thread_by_their_layers(cores):
    # NOTE [ Small groups of few layers ]: on one thread a group of g models of L Linear
    # layers stacks where (g - 1) * L >= 8; on more, from 4 models as before.
    def shapes(n_models, widths):
        return [mlp(widths) for _ in range(n_models)] + [mlp([3])]

    for n_models, widths, on_one in [
        (4, [8], False),  # L=2: 6
        (5, [8], True),  # 8
        (4, [8, 6], True),  # L=3: 9
        (3, [8, 6, 5], False),  # fewer than 4: never
    ]:
        expected = [tuple(range(n_models))]
        models = shapes(n_models, widths)
        assert groups(models, "auto", budget=1) == (expected if on_one else []), widths
        assert groups(models, "auto", budget=2) == (expected if n_models >= 4 else [])
        assert groups(models, "stacked", budget=1) == expected
    linears = [nn.Linear(IN, OUT) for _ in range(9)]
    assert groups(linears[:8], "auto", budget=1) == []  # one layer: 7
    assert groups(linears, "auto", budget=1) == [tuple(range(9))]
    # One by one, the same values as stacked
    torch.manual_seed(0)
    models, x = shapes(4, [8]), torch.randn(6, IN)
    ref = copy.deepcopy(models)
    cores(1)
    y = parsum.sum_models(models, x)
    assert plain_graph(y)
    like_the_plain_loop(y, models, ref, x)


def test_a_forward_alone_groups_small_batches_by_their_layers(cores):
    # NOTE [ Small groups in a forward alone ]: with grad disabled, on a budget of 2 a batch
    # of fewer than 256 rows stacks by the layers saved, as one thread does; one Linear
    # stacks from 4 models on 1 thread too.
    def shapes(n_models, widths):
        return [mlp(widths) for _ in range(n_models)] + [mlp([3])]

    small, large = torch.randn(64, IN), torch.randn(256, IN)
    for n_models, widths, alone in [
        (4, [8], False),  # L=2: 6
        (5, [8], True),  # 8
        (4, [8, 6], True),  # L=3: 9
    ]:
        expected = [tuple(range(n_models))]
        models = shapes(n_models, widths)
        assert groups(models, "auto", small, forward_only=True) == (expected if alone else [])
        assert groups(models, "auto", large, forward_only=True) == expected
        assert groups(models, "auto", small) == expected  # a training step: from 4
        assert groups(models, "stacked", small, forward_only=True) == expected
    linears = [nn.Linear(IN, OUT) for _ in range(4)]
    assert groups(linears, "auto", small, budget=1, forward_only=True) == [(0, 1, 2, 3)]
    assert groups(linears, "auto", small, budget=1) == []  # one layer: 3 saved
    # Planned apart: a call with no graph, then one with a graph, over the same models
    torch.manual_seed(0)
    models = shapes(4, [8])
    ref = copy.deepcopy(models)
    cores(2)
    with torch.no_grad():
        y = parsum.sum_models(models, small)
    torch.testing.assert_close(y, plain_sum(ref, small))
    y = parsum.sum_models(models, small)
    like_the_plain_loop(y, models, ref, small)
    units = {key[-2]: d.units for key, d in _api.known_walk(models).derived.items()}
    assert [u.models for u in units[True] if u.engine == "stacked"] == []
    assert [u.models for u in units[False] if u.engine == "stacked"] == [(0, 1, 2, 3)]


def like_the_plain_loop(y, models, ref, x):
    """``y``, the sum of ``models`` at ``x``, and their gradients as the plain loop over
    ``ref``, their copies, gives them."""
    y.pow(2).sum().backward()
    y_ref = sum(m(x) for m in ref)
    y_ref.pow(2).sum().backward()
    torch.testing.assert_close(y, y_ref)
    for p, q in zip(param_grads(models), param_grads(ref)):
        torch.testing.assert_close(p, q)


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(50, 6)
        self.head = nn.Linear(6, OUT)

    def forward(self, x):
        return self.head(self.bag(x))


def test_auto_leaves_embedding_bags_unstacked():
    # NOTE [ Layers vmap loops over ]: no group, no vmap warning; engine="stacked" still stacks.
    torch.manual_seed(0)
    models, x = [_Bag() for _ in range(8)], torch.randint(0, 50, (4, 3))
    assert groups(models, "auto", x) == []
    assert groups(models, "stacked", x) == [tuple(range(8))]
    ref = copy.deepcopy(models)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # vmap's "performance drop" warning among them
        y = parsum.sum_models(models, x)
    like_the_plain_loop(y, models, ref, x)


def test_auto_groups_by_parameters_rows_and_budget():
    # NOTE [ Stacked groups ], NOTE [ Batched groups once features first ]: batched matmuls at
    # most 128K parameters a model and 6M parameter-rows on one thread, 320K and 24M on two;
    # on larger budgets 64K and 4M.
    medium = [mlp([128, 128]) for _ in range(8)]  # 17.8K parameters
    assert 17_000 < sum(p.numel() for p in medium[0].parameters()) < 18_000
    every = [tuple(range(8))]

    def stacked(models, rows, budget):
        x = torch.randn(rows, IN)
        found = [ModelParams.of(m) for m in models]
        units = plan_units(models, found, "auto", Batch.of([x]), None, budget)
        grouped = [u.models for u in units if u.engine == "stacked"]
        assert grouped in (every, [])
        return grouped == every

    for rows, budget, expected in [
        (256, 1, True),  # 4.6M parameter-rows
        (512, 1, False),  # 9.1M
        (1024, 2, True),  # 18.2M
        (2048, 2, False),  # 36.4M
        (128, 16, True),  # 2.3M
        (256, 16, False),
    ]:
        assert stacked(medium, rows, budget) == expected, (rows, budget)
    wide = [mlp([256, 256]) for _ in range(8)]  # 68K parameters
    assert stacked(wide, 4, 2) and stacked(wide, 4, 1) and not stacked(wide, 4, 16)
    huge = [mlp([1024, 1024]) for _ in range(8)]  # 1.06M: its copy in costs at any batch
    assert not stacked(huge, 4, 2)
    # Through vmap (not a Sequential), 64K parameters and 4M parameter-rows on any budget of
    # several threads.
    wrapped = [Wrapped(mlp([128, 128])) for _ in range(8)]
    assert stacked(wrapped, 128, 2) and not stacked(wrapped, 256, 2)


class Wrapped(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_stacks_big_models_on_cuda():
    # On a GPU the models' small kernels one at a time cost more than batched ones.
    big = [mlp([1024, 1024]).cuda() for _ in range(8)]
    assert groups(big, "auto", x=torch.randn(4, IN, device="cuda")) == [tuple(range(8))]


class WithBuffer(nn.Module):
    def __init__(self, elements):
        super().__init__()
        self.body = mlp([8])
        self.register_buffer("scale", torch.ones(elements))

    def forward(self, x):
        return self.body(x) * self.scale[0]


def test_auto_does_not_stack_models_with_large_buffers():
    # Buffers and frozen parameters are stacked on every call: a copy the compute must pay for.
    small = [WithBuffer(AUTO_STACK_MAX_STATE_ELEMENTS).eval() for _ in range(8)]
    assert groups(small, "auto") == [tuple(range(8))]
    large = [WithBuffer(AUTO_STACK_MAX_STATE_ELEMENTS + 1).eval() for _ in range(8)]
    assert groups(large, "auto") == []
    assert groups(large, "stacked") == [tuple(range(8))]
    frozen = [mlp([8]).requires_grad_(False) for _ in range(8)]
    for m in frozen:
        m[0].weight.requires_grad_(True)
    assert groups(frozen, "auto") == [tuple(range(8))]  # small frozen parameters: stacked
    x = torch.randn(4, IN)
    want = sum(m(x) for m in large)
    assert torch.allclose(parsum.sum_models(large, x), want, atol=1e-6)


def leaky(slope):
    return nn.Sequential(nn.Linear(IN, 4), nn.LeakyReLU(slope), nn.Linear(4, OUT))


@pytest.mark.parametrize(
    ("make", "grouped"),
    [
        (lambda: [leaky(0.1), leaky(0.2), leaky(0.1)], [(0, 2)]),  # a hyperparameter differs
        (lambda: [mlp([8]), mlp([9]), mlp([8]).double()], []),  # shapes, dtypes differ
        (lambda: [nn.Sequential(nn.Linear(IN, OUT), nn.Dropout(p)) for p in (0.1, 0.5)], []),
    ],
)
def test_models_that_differ_are_not_grouped(make, grouped):
    assert groups(make(), "stacked") == grouped


def test_models_vmap_could_not_run_as_their_own_forward_are_not_grouped():
    shared = nn.Linear(IN, OUT)
    bn = [nn.Sequential(nn.Linear(IN, OUT), nn.BatchNorm1d(OUT)) for _ in range(2)]
    assert groups(bn, "stacked") == []  # training BatchNorm updates its buffers
    assert groups([m.eval() for m in bn], "stacked") == [(0, 1)]
    assert groups([nn.Sequential(shared), nn.Sequential(shared)], "stacked") == []
    m = mlp([8])
    assert groups([m, m, mlp([8])], "stacked") == []  # a model repeated
    hooked = [mlp([8]) for _ in range(3)]
    hooked[1][0].register_forward_hook(lambda *a: None)
    assert groups(hooked, "stacked") == [(0, 2)]
    eight = [mlp([8]) for _ in range(8)]  # model 0 shares a layer with a model of another layout
    other = nn.Sequential(eight[0][0], nn.Tanh(), nn.Linear(8, 3), nn.Linear(3, OUT))
    assert groups([*eight, other], "stacked") == [tuple(range(1, 8))]
    act = nn.Tanh()  # a shared module without state is harmless
    assert groups([nn.Sequential(nn.Linear(IN, OUT), act) for _ in range(2)], "stacked") == [(0, 1)]


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = mlp([8], nn.GELU)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_checkpointed_models_run_one_by_one(n_jobs):
    # NOTE [ Checkpoints under vmap ]: stacked by auto, every backward raised CheckpointError
    # (found by tests/test_differential.py).
    models = [Checkpointed() for _ in range(10)]
    x = torch.randn(5, IN)
    for _ in range(2):  # the first call falls back, the next runs them one by one
        for m in models:
            m.zero_grad()
        assert_matches(*run_both(models, x, n_jobs=n_jobs))
    # torch 2.11's vmap refuses the checkpoint's function itself, before parsum looks
    with pytest.raises(parsum.ParsumError, match=r"model 0 \(Checkpointed\).*(recompute|vmap)"):
        parsum.sum_models([Checkpointed() for _ in range(3)], x, engine="stacked")
    stacked = [Checkpointed() for _ in range(4)]
    parsum.stack_(stacked)
    parsum.sum_models(stacked, x).sum().backward()  # the stack gives up its batched forward
    assert all(m.inner[0].weight.grad is not None for m in stacked)


class KeepsState(nn.Module):
    """Keeps a detached state for the next call, and counts its calls, in attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(IN, OUT)
        self.state = None
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        out = self.layer(x) if self.state is None else self.layer(x) + 0.5 * self.state
        self.state = out.detach()
        return out


class HoldsOne(nn.Module):
    """A model whose submodule assigns its attributes in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = KeepsState()
        self.head = nn.Linear(OUT, OUT)

    def forward(self, x):
        return self.head(self.inner(x))


def eight_and_copies(make, how):
    """8 identical models and a copy for the plain loop; with ``how == "beside another"`` a
    model of another architecture to pass beside them (and its copy), with ``"stack_"`` the
    eight in stacked storage."""
    torch.manual_seed(0)
    models = [make() for _ in range(8)]
    ref = copy.deepcopy(models)
    others = [mlp([5])] if how == "beside another" else []
    others_ref = copy.deepcopy(others)
    if how == "stack_":
        parsum.stack_(models)
    return models, ref, others, others_ref


def step_both(models, ref, x, n_jobs):
    """A step of parsum over ``models`` and one of the plain loop over ``ref``: the same sums."""
    y = parsum.sum_models(models, x, n_jobs=n_jobs)
    r = plain_sum(ref, x)
    y.pow(2).sum().backward()
    r.pow(2).sum().backward()
    torch.testing.assert_close(y, r)


def three_calls_of_both(models, ref, others, others_ref, how, n_jobs):
    """Three calls of parsum and of the plain loop (``eight_and_copies``' models), each a step
    (``step_both``) or, with ``how`` "no grad" or "inference mode", a sum without gradients:
    the same sums."""
    x = torch.randn(2, IN)
    no_grad = {"no grad": torch.no_grad, "inference mode": torch.inference_mode}.get(how)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stack_ says it gives up its batched forward
        for _ in range(3):
            if no_grad is not None:
                with no_grad():
                    y = parsum.sum_models(models, x, n_jobs=n_jobs)
                    torch.testing.assert_close(y, plain_sum(ref, x))
            else:
                step_both(models + others, ref + others_ref, x, n_jobs)


# NOTE [ Attributes assigned in forward ]: stacked, the attributes went to the batched
# forward's shadow, the modules kept their first values, and from the second call on the sum
# was not the plain loop's, silently (16 of these cases failed).
@pytest.mark.parametrize("make", [KeepsState, HoldsOne])
@pytest.mark.parametrize("how", ["auto", "beside another", "stack_", "no grad"])
@pytest.mark.parametrize("n_jobs", [1, 2])
def test_identical_models_that_assign_attributes_in_forward(make, how, n_jobs):
    models, ref, others, others_ref = eight_and_copies(make, how)
    three_calls_of_both(models, ref, others, others_ref, how, n_jobs)
    for m, m_ref in zip(models, ref):
        inner, inner_ref = (m, m_ref) if make is KeepsState else (m.inner, m_ref.inner)
        assert inner.calls == inner_ref.calls == 3
        torch.testing.assert_close(inner.state, inner_ref.state)
    if how != "no grad":
        for a, b in zip(param_grads(models), param_grads(ref)):
            torch.testing.assert_close(a, b)


def test_engine_stacked_names_the_attributes_a_forward_assigns():
    models = [KeepsState() for _ in range(4)]
    with pytest.raises(parsum.ParsumError, match=r"model 0 \(KeepsState\).*KeepsState\.state"):
        parsum.sum_models(models, torch.randn(2, IN), engine="stacked")
    assert all(m.state is None and m.calls == 0 for m in models)  # nothing assigned


class MaxNorm(nn.Module):
    """A max-norm constraint applied in forward: the weight's rows renormalized in place."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(IN, OUT)
        with torch.no_grad():
            self.layer.weight.mul_(3)

    def forward(self, x):
        with torch.no_grad():
            self.layer.weight.div_(self.layer.weight.norm(dim=1, keepdim=True).clamp(min=0.5))
        return self.layer(x)


# Stacked by auto, the constraint renormalized the stacked copies, never the models' weights:
# other weights, gradients and sums than the plain loop's, silently.
@pytest.mark.parametrize("how", ["auto", "beside another", "stack_", "inference mode"])
@pytest.mark.parametrize("n_jobs", [1, 2])
def test_identical_models_that_change_their_parameters_in_forward(how, n_jobs):
    # In stack_ storage the stacked tensors are the models' own: changed in place as theirs.
    models, ref, others, others_ref = eight_and_copies(MaxNorm, how)
    three_calls_of_both(models, ref, others, others_ref, how, n_jobs)
    for m, m_ref in zip(models, ref):
        torch.testing.assert_close(m.layer.weight, m_ref.layer.weight)
    if how != "inference mode":
        for a, b in zip(param_grads(models), param_grads(ref)):
            torch.testing.assert_close(a, b)
    with pytest.raises(parsum.ParsumError, match=r"model 0 \(MaxNorm\).*layer\.weight in place"):
        parsum.sum_models([MaxNorm() for _ in range(4)], torch.randn(2, IN), engine="stacked")


class CountsInBuffer(nn.Module):
    """Counts its calls in a buffer, in place, and scales its output by the count."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(IN, OUT)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        return self.layer(x) * (1 + 0.1 * self.count)


# In eval mode buffers are stacked too: the stacked copies counted and the models' buffers
# stayed 0, silently (also under inference_mode, whose copies kept no version to check).
@pytest.mark.parametrize("how", ["auto", "beside another", "stack_", "no grad", "inference mode"])
@pytest.mark.parametrize("n_jobs", [1, 2])
def test_identical_models_in_eval_mode_that_change_a_buffer_in_forward(how, n_jobs):
    models, ref, others, others_ref = eight_and_copies(lambda: CountsInBuffer().eval(), how)
    three_calls_of_both(models, ref, others, others_ref, how, n_jobs)
    assert [float(m.count) for m in models] == [3.0] * 8
    if "grad" not in how and how != "inference mode":
        for a, b in zip(param_grads(models), param_grads(ref)):
            torch.testing.assert_close(a, b)


class DoublesItsArgument(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(IN, OUT)

    def forward(self, x):
        x.mul_(2)
        return self.layer(x)


# Stacked, the batched forward doubled the argument once where the plain loop's models each
# doubled what those before them left: other outputs, and another argument after the call,
# silently (a backward then raises in both, as autograd's saved argument was modified). On
# several threads, run one by one, the call whose forwards run on the threads depends on their
# timing, with a warning, and the next run in model order (NOTE [ Arguments modified in place ]
# in parsum._function).
@pytest.mark.parametrize("how", ["auto", "stack_", "no grad", "inference mode"])
@pytest.mark.parametrize("n_jobs", [1, 2])
def test_identical_models_that_modify_their_argument_in_place(how, n_jobs):
    models, ref, _, _ = eight_and_copies(DoublesItsArgument, how)
    no_grad = {"no grad": torch.no_grad, "inference mode": torch.inference_mode}.get(how)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the forwards in order from now on; stack_ gives up
        for call in range(3):
            x = torch.randn(2, IN)
            x_ref = x.clone()
            with no_grad() if no_grad is not None else contextlib.nullcontext():
                y = parsum.sum_models(models, x, n_jobs=n_jobs)
                r = plain_sum(ref, x_ref)
            if n_jobs == 1 or call == 2:
                torch.testing.assert_close(y, r)
                torch.testing.assert_close(x, x_ref)


def test_identical_models_stay_stacked_under_inference_mode():
    # Inference tensors keep no version to check: the batched forward must not fail for it.
    models = [KeepsNothing() for _ in range(10)]
    x = torch.randn(2, IN)
    with torch.inference_mode():
        y = parsum.sum_models(models, x)
        torch.testing.assert_close(y, plain_sum(models, x))
    assert not any(m in _engines.VMAP_FAILED for m in models)


class KeepsNothing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(IN, OUT)

    def forward(self, x):
        return torch.tanh(self.layer(x))


def test_engine_vjp_refuses_a_forward_that_assigns_attributes():
    # It ran the forward on a copy, the state never reached the model: silently other sums.
    models = [KeepsState(), mlp([4])]
    with pytest.raises(parsum.ParsumError, match=r"model 0 \(KeepsState\).*KeepsState\.state.*vjp"):
        parsum.sum_models(models, torch.randn(2, IN), engine="vjp").sum().backward()
    assert models[0].state is None and models[0].calls == 0


class Tally:
    """A plain object of the user's."""

    def __init__(self) -> None:
        self.calls = 0


SHARED = {
    "list": list,
    "deque": collections.deque,
    "dict": dict,
    "set": set,
    "object": Tally,
    "tensor": lambda: torch.zeros(()),
}


class WritesShared(nn.Module):
    """Writes, in forward, into an object it shares with its twins (what it is: ``kind``)."""

    def __init__(self, kind: str, shared) -> None:
        super().__init__()
        self.layer = nn.Linear(IN, OUT)
        self.kind, self.shared = kind, shared

    def forward(self, x):
        out = self.layer(x)
        if self.kind in ("list", "deque"):
            self.shared.append(out.detach().sum())
        elif self.kind == "dict":
            self.shared["calls"] = self.shared.get("calls", 0) + 1
        elif self.kind == "set":
            self.shared.add(len(self.shared))
        elif self.kind == "object":
            self.shared.calls += 1
        else:
            self.shared.add_(1)
        return out


def what_was_written(shared):
    """What the forwards wrote into ``shared``, comparable across runs (a log's entries as
    plain floats, in order of value: forwards on threads may log in any order)."""
    if isinstance(shared, (list, collections.deque)):
        assert all(type(v) is torch.Tensor and not v.requires_grad for v in shared)
        return sorted(round(float(v), 4) for v in shared)
    if isinstance(shared, Tally):
        return shared.calls
    if isinstance(shared, torch.Tensor):
        return float(shared)
    return shared


# NOTE [ Attributes assigned in forward ] in _engines: identical models sharing a log, a dict,
# an object of the user's or a tensor they write into in forward were stacked by auto (the
# shared object is the same for all of them), and the batched forward wrote once for all,
# into a log a dead BatchedTensor: silently not the plain loop's (all 48 cases failed).
@pytest.mark.parametrize("kind", list(SHARED))
@pytest.mark.parametrize("how", ["auto", "beside another", "stack_", "no grad"])
@pytest.mark.parametrize("n_jobs", [1, 2])
def test_identical_models_that_write_into_a_shared_object_in_forward(kind, how, n_jobs):
    shared = SHARED[kind]()
    models, ref, others, others_ref = eight_and_copies(lambda: WritesShared(kind, shared), how)
    assert ref[0].shared is ref[7].shared is not shared  # the copies share their own
    three_calls_of_both(models, ref, others, others_ref, how, n_jobs)
    assert what_was_written(shared) == what_was_written(ref[0].shared)


@pytest.mark.parametrize("kind", list(SHARED))
def test_identical_models_that_only_read_a_shared_object_stay_stacked(kind):
    shared = SHARED[kind]()
    models = [KeepsNothing() for _ in range(8)]
    for m in models:
        m.shared = shared
    in_storage = [KeepsNothing() for _ in range(8)]
    for m in in_storage:
        m.shared = shared
    stack = parsum.stack_(in_storage)
    x = torch.randn(2, IN)
    for group in (models, in_storage):
        parsum.sum_models(group, x).sum().backward()
        torch.testing.assert_close(parsum.sum_models(group, x), plain_sum(group, x))
    assert not any(m in _engines.VMAP_FAILED for m in models)
    assert stack._broken is None


@pytest.mark.parametrize("engine", ["stacked", "vjp"])
def test_engines_stacked_and_vjp_name_a_shared_object_a_forward_writes_into(engine):
    log: list = []
    models = [WritesShared("list", log) for _ in range(4)]
    with pytest.raises(parsum.ParsumError, match=r"model 0 \(WritesShared\).*WritesShared\.shared"):
        parsum.sum_models(models, torch.randn(2, IN), engine=engine)
    assert log == []  # nothing written by the failed call


@pytest.mark.parametrize("storage", [False, True])
@pytest.mark.parametrize("hooks", ["checkpoint", "save_on_cpu"])
@pytest.mark.parametrize("n_jobs", [1, 2, None])
def test_identical_models_under_saved_tensor_hooks_around_the_call(n_jobs, hooks, storage):
    # NOTE [ Saved-tensor hooks ] in _pool: stacked by auto inside a non-reentrant checkpoint
    # around the call, the failed batched attempt's tensors counted in the checkpoint's
    # forward, and every backward raised CheckpointError; the models were also marked as ones
    # vmap cannot run, for good.
    torch.manual_seed(0)
    models = [mlp([8]) for _ in range(8)]
    ref = copy.deepcopy(models)
    stack = parsum.stack_(models) if storage else None
    x, x_ref = (torch.randn(5, IN, requires_grad=True) for _ in range(2))
    with torch.no_grad():
        x_ref.copy_(x)

    def around(f, t):
        if hooks == "checkpoint":
            return torch.utils.checkpoint.checkpoint(f, t, use_reentrant=False)
        with torch.autograd.graph.save_on_cpu():
            return f(t)

    around(lambda t: parsum.sum_models(models, t, n_jobs=n_jobs), x).pow(2).sum().backward()
    around(lambda t: sum(m(t) for m in ref), x_ref).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    for a, b in zip(param_grads(models), param_grads(ref)):
        torch.testing.assert_close(a, b)
    assert not any(m in _engines.VMAP_FAILED for m in models)  # stacked outside the hooks
    assert stack is None or stack._broken is None


class TwoLeaves(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(IN, 8), nn.Linear(8, OUT)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return {"y": self.b(h), "h": h}


@pytest.mark.parametrize(
    "make",
    [
        lambda: mlp([8]),  # batched layers
        TwoLeaves,  # vmap
        lambda: nn.Sequential(nn.Linear(IN, 10), nn.LayerNorm(10), nn.Linear(10, OUT)),
    ],
)
@pytest.mark.parametrize("how", ["stacked", "auto", "stack_"])
def test_groups_under_autocast_give_the_plain_loops_dtypes(make, how):
    # NOTE [ Autocast under vmap ]: vmap's Linear ran in float32 under autocast, so a group
    # returned float32 beside bfloat16 (found by tests/test_differential.py).
    torch.manual_seed(0)
    models = [make() for _ in range(10)]
    if how == "stack_":
        parsum.stack_(models)
    x = torch.randn(6, IN)
    for _ in range(2):
        with torch.autocast("cpu", torch.bfloat16):
            y = parsum.sum_models(models, x, engine="auto" if how == "stack_" else how)
            want = plain_sum(models, x)
        for got, ref in zip(pytree.tree_leaves(y), pytree.tree_leaves(want)):
            assert got.dtype == ref.dtype
            torch.testing.assert_close(got.float(), ref.float(), rtol=0.05, atol=0.1)
        sum(t.float().sum() for t in pytree.tree_leaves(y)).backward()
    assert all(p.grad is not None for m in models for p in m.parameters())


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_weighted_group_under_another_default_device(n_jobs):
    # The group's weights are made on the outputs' device: not on the default device (with
    # torch.set_default_device("cuda") and CPU models), nor on the weight tensor's (CPU
    # weights, CUDA models), either of which failed with a device mismatch.
    torch.manual_seed(0)
    models = [mlp([8]) for _ in range(8)]
    x = torch.randn(5, IN)
    weights = [0.5, -1.0, 2.0, 0.25, 1.5, -0.5, 3.0, 1.0]
    w_tensor = torch.tensor(weights, dtype=torch.float64, requires_grad=True)
    want = plain_sum(models, x, weights=weights)
    with torch.device("meta"):
        got = parsum.sum_models(models, x, weights=weights, engine="stacked", n_jobs=n_jobs)
        got_t = parsum.sum_models(models, x, weights=w_tensor, engine="stacked", n_jobs=n_jobs)
    got_t.sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_t, want)
    assert w_tensor.grad is not None and w_tensor.grad.device.type == "cpu"


_JIT_DEPRECATED = "ignore:.*torch.jit.script.* is deprecated:DeprecationWarning"


@pytest.mark.filterwarnings(_JIT_DEPRECATED)
@pytest.mark.parametrize("engine", ["stacked", "auto"])
@pytest.mark.parametrize("scripted", ["model", "layer"])
def test_torchscript_models_run_one_by_one(engine, scripted):
    # functional_call cannot run TorchScript modules: they are never stacked, not an error.
    def make():
        if scripted == "model":
            return torch.jit.script(mlp([8]))
        return nn.Sequential(torch.jit.script(nn.Linear(IN, 8)), nn.Tanh(), nn.Linear(8, OUT))

    torch.manual_seed(0)
    models = [make() for _ in range(8)]
    torch.manual_seed(0)
    ref = [make() for _ in range(8)]
    assert groups(models, engine) == []
    x = torch.randn(5, IN)
    parsum.sum_models(models, x, engine=engine, n_jobs=2).square().sum().backward()
    plain_sum(ref, x).square().sum().backward()
    assert_same_grads(models, ref)


@pytest.mark.filterwarnings(_JIT_DEPRECATED)
def test_vjp_engine_names_torchscript():
    models = [torch.jit.script(mlp([8])) for _ in range(2)]
    with pytest.raises(parsum.ParsumError, match="engine='vjp' cannot run TorchScript"):
        parsum.sum_models(models, torch.randn(3, IN), engine="vjp")


@pytest.mark.filterwarnings("ignore:.*non-full backward hook:UserWarning")
@pytest.mark.parametrize("hook", ["full", "pre", "old", "global"])
def test_vjp_engine_names_a_backward_hook(hook):
    # torch.func refuses a full hook's autograd.Function in forward; an old hook's module is
    # vjp's shadow, dead by backward. The other engines run both (tested with the models' zoo).
    models = [mlp([8]) for _ in range(2)]
    ref = copy.deepcopy(models)
    layer = models[1][2]
    handle = {
        "full": lambda: layer.register_full_backward_hook(lambda m, gi, go: None),
        "pre": lambda: models[1][0].register_full_backward_pre_hook(lambda m, go: None),
        "old": lambda: layer.register_backward_hook(lambda m, gi, go: None),
        "global": lambda: nn.modules.module.register_module_full_backward_hook(
            lambda m, gi, go: None
        ),
    }[hook]()
    try:
        first = 0 if hook == "global" else 1  # a global hook runs on every model
        message = (
            f"model {first} .*engine='vjp' cannot run a module with a backward hook"
            ".*use engine='autograd' or 'auto'"
        )
        with pytest.raises(parsum.ParsumError, match=message):
            parsum.sum_models(models, torch.randn(3, IN), engine="vjp").sum().backward()
        for m, r in zip(models, ref):
            for p, q in zip(m.parameters(), r.parameters()):
                assert p.grad is None and torch.equal(p, q)
    finally:
        handle.remove()


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("engine", ["stacked", "auto"])
@pytest.mark.parametrize("how", ["two calls", "retained graph", "clipped"])
def test_a_group_at_one_batch_row_gives_each_model_gradients_of_its_own(how, engine, n_jobs):
    # Without weights a group's cotangent is the sum's gradient expanded over its models, and
    # at one batch row a bias's gradient is a view of it: every model's .grad was the same
    # memory, so a second backward's accumulation, or an in-place clip, counted once per model
    # (a default call: 6 identical MLPs beside another model, batch 1).
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(IN, 5), nn.Tanh(), nn.Linear(5, OUT)) for _ in range(6)]
    models.append(nn.Linear(IN, OUT))
    plain = copy.deepcopy(models)
    xs = [torch.randn(1, IN) for _ in range(2)]
    for ms, run in ((models, lambda x: parsum.sum_models(models, x, engine=engine, n_jobs=n_jobs)),
                    (plain, lambda x: sum(m(x) for m in plain))):  # fmt: skip
        if how == "two calls":
            for x in xs:
                run(x).pow(2).sum().backward()
        else:
            y = run(xs[0])
            for _ in range(2 if how == "retained graph" else 1):
                y.pow(2).sum().backward(retain_graph=True)
            if how == "clipped":
                for m in ms:
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
    grads = [p.grad for m in models for p in m.parameters()]
    assert len({g.untyped_storage().data_ptr() + g.storage_offset() for g in grads}) == len(grads)
    for got, want in zip(grads, [p.grad for m in plain for p in m.parameters()]):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("engine", ["stacked", "auto"])
@pytest.mark.parametrize("weights", [None, "floats", "one float", "tensor_grad"])
def test_matches_plain_sum(engine, n_jobs, dtype, weights):
    # engine="auto" stacks the eight mlp([8]) and runs the rest one by one.
    models = family(dtype) + [mlp([8]).to(dtype) for _ in range(4)]
    assert len(groups(models, engine)) == (3 if engine == "stacked" else 1)
    x = torch.randn(5, IN, dtype=dtype, requires_grad=True)
    w = None
    if weights == "floats":
        w = [0.5, -1.0, 2.0, 0.25, 1.5, -0.5, 3.0, 1.0, 0.75, -2.0, 0.3, 0.6, -0.9, 1.2]
    elif weights == "one float":  # NOTE [ Weighted cotangents shared ]: one product, expanded
        w = [1 / len(models)] * len(models)
    elif weights == "tensor_grad":
        w = torch.linspace(-1, 2, len(models), dtype=dtype, requires_grad=True)
    assert_matches(*run_both(models, x, weights=w, engine=engine, n_jobs=n_jobs), **TOL[dtype])


@pytest.mark.parametrize("engine", ["stacked", "auto"])
def test_sequential_linear_groups_run_as_batched_matmuls_not_vmap(engine, monkeypatch):
    # NOTE [ Batched layers ]: as in stack_ storage, without vmap's per-call work.
    def no_vmap(*args, **kwargs):
        raise AssertionError("vmap ran")

    monkeypatch.setattr(torch, "vmap", no_vmap)
    torch.manual_seed(0)
    models = [mlp([8, 6], nn.LeakyReLU) for _ in range(9)]
    assert len(groups(models, engine)) == 1
    x = torch.randn(5, IN, requires_grad=True)
    assert_matches(*run_both(models, x, engine=engine))


@pytest.mark.parametrize("per_slice", [1, 2, 4])
@pytest.mark.parametrize("kind", ["one group", "stack_", "beside others"])
def test_batched_matmuls_in_slices_match_the_loop(per_slice, kind, monkeypatch):
    # NOTE [ Batched slices ]: 9 models in slices of 1, 2 or 4 (the last one shorter), stacked
    # on every call (alone or beside other models) or in stack_ storage,
    # against the plain loop.
    torch.manual_seed(0)
    models = [mlp([8, 6], nn.LeakyReLU) for _ in range(9)]
    x = torch.randn(5, IN, requires_grad=True)
    widest, rows = 8, 5  # features of the widest layer, batch rows
    monkeypatch.setattr(_engines, "SLICE_BYTES", per_slice * rows * widest * x.element_size())
    slices = []
    run_slice = _engines._run_slice
    monkeypatch.setattr(
        _engines,
        "_run_slice",
        lambda program, values, h: slices.append(1) or run_slice(program, values, h),
    )
    weights = [0.5, -1.0, 2.0, 0.25, 1.5, -0.5, 3.0, 1.0, 0.75]  # each model's output its own
    if kind == "stack_":
        parsum.stack_(models)
    elif kind == "beside others":
        models = [mlp([5]), *models, mlp([7, 3])]
        weights = [1.25, *weights, -0.75]
    assert_matches(*run_both(models, x, weights=weights, engine="stacked", n_jobs=2))
    assert len(slices) == -(-9 // per_slice)


def no_bias_mlp() -> nn.Sequential:
    """Starts with an activation and has a Linear without bias."""
    return nn.Sequential(
        nn.Tanh(), nn.Linear(IN, 6, bias=False), nn.ReLU(), nn.Linear(6, OUT, bias=True)
    )


@pytest.mark.parametrize("shape", [(IN,), (5, IN), (2, 3, IN), (0, IN)])
@pytest.mark.parametrize("kind", ["one group", "stack_", "beside others"])
@pytest.mark.parametrize("make", [lambda: mlp([8, 6]), no_bias_mlp])
def test_batched_matmuls_take_any_rows_and_give_a_result_in_order(shape, kind, make):
    # NOTE [ Features first ]: the layers run as (models, features, rows); the result comes
    # back in the input's row shape, contiguous like the loop's, so that .view works on it.
    torch.manual_seed(0)
    models = [make() for _ in range(6)]
    x = torch.randn(*shape, requires_grad=True)
    if kind == "stack_":
        parsum.stack_(models)
    elif kind == "beside others":  # each model's output a view of the batch's
        models = [mlp([5]), *models]
    loss = lambda y: (y.view(-1) ** 2).sum()  # noqa: E731
    got, want = run_both(models, x, engine="stacked", n_jobs=2, loss=loss)
    assert got[0].shape == want[0].shape and got[0].is_contiguous()
    assert_matches(got, want)


class Residual(nn.Module):
    """Not a Sequential, with a keyword argument: the group runs through vmap."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(IN, IN), nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.b(x + scale * torch.tanh(self.a(x)))


@pytest.mark.parametrize("per_chunk", [1, 2, 4])
@pytest.mark.parametrize("storage", [False, True])
def test_vmap_in_chunks_matches_the_loop(per_chunk, storage, monkeypatch):
    # NOTE [ Batched slices ]: a group vmap runs, in chunks of models sized from the input's
    # rows and the parameters' largest dimension (IN here).
    torch.manual_seed(0)
    models = [Residual() for _ in range(9)]
    x = torch.randn(5, IN, requires_grad=True)
    monkeypatch.setattr(_engines, "SLICE_BYTES", per_chunk * 5 * IN * x.element_size())
    chunks = []
    vmap = torch.vmap
    monkeypatch.setattr(
        torch, "vmap", lambda f, **kw: chunks.append(kw["chunk_size"]) or vmap(f, **kw)
    )
    ref = clone_models(models)
    if storage:
        parsum.stack_(models)
    weights = [0.5, -1.0, 2.0, 0.25, 1.5, -0.5, 3.0, 1.0, 0.75]
    y = parsum.sum_models(models, x, weights=weights, engine="stacked", scale=0.5)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = sum(w * m(x_ref, scale=0.5) for w, m in zip(weights, ref))
    torch.testing.assert_close(y, y_ref, **TOL[torch.float32])
    y.pow(2).sum().backward()
    y_ref.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL[torch.float32])
    assert_same_grads(models, ref, **TOL[torch.float32])
    assert chunks == [per_chunk]


# -- one group that holds every model, in the caller's graph ----------------------------------
# NOTE [ One group in the caller's graph ] in _stack


def one_group(dtype=torch.float32, n=9, kind="mlp"):
    torch.manual_seed(0)
    if kind == "residual":
        return [Residual().to(dtype) for _ in range(n)]
    return [mlp([8, 6], nn.LeakyReLU).to(dtype) for _ in range(n)]


def as_one_group(y: torch.Tensor) -> bool:
    """Whether the result came from the batched program in the caller's graph."""
    return type(y.grad_fn).__name__ not in ("ParallelSumBackward", "CallerGraphSumBackward")


@pytest.mark.parametrize("kind", ["mlp", "residual"])
@pytest.mark.parametrize("weights", [None, "floats", "tensor_grad"])
@pytest.mark.parametrize("engine", ["auto", "stacked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_group_matches_plain_sum(dtype, engine, weights, kind):
    models = one_group(dtype, kind=kind)
    x = torch.randn(5, IN, dtype=dtype, requires_grad=True)
    w = None
    if weights == "floats":
        w = [0.5 + k / 4 for k in range(len(models))]
    elif weights == "tensor_grad":
        w = torch.linspace(-1, 2, len(models), dtype=dtype, requires_grad=True)
    got, want = run_both(models, x, weights=w, engine=engine)
    assert as_one_group(got[0])
    # float32: vmap's batched kernels add in another order than the loop's (float64: 1e-12)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else TOL[dtype]
    assert_matches(got, want, **tol)


def test_one_group_gradcheck_and_bits_for_any_n_jobs():
    models = one_group(torch.float64, n=8)
    x = torch.randn(3, IN, dtype=torch.float64, requires_grad=True)
    w = torch.linspace(-1, 1, len(models), dtype=torch.float64, requires_grad=True)
    assert as_one_group(parsum.sum_models(models, x, weights=w))
    assert torch.autograd.gradcheck(lambda x, w: parsum.sum_models(models, x, weights=w), (x, w))
    results = []
    for n_jobs in (1, 2, 3):
        y = parsum.sum_models(models, x, weights=w, n_jobs=n_jobs)
        params = [p for m in models for p in m.parameters()]
        results.append([y, *torch.autograd.grad(y.sin().sum(), [x, w, *params])])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_one_group_runs_hooks_as_the_plain_loop_does():
    models = one_group()
    ref = clone_models(models)
    seen: dict[str, list] = {"tensor": [], "post": []}
    for ms, tag in ((models, ""), (ref, "ref")):
        ms[3][0].weight.register_hook(lambda g, tag=tag: seen["tensor"].append((tag, g.clone())))
        ms[5][2].bias.register_post_accumulate_grad_hook(
            lambda p, tag=tag: seen["post"].append((tag, p.grad.clone()))
        )
    x = torch.randn(4, IN)
    y = parsum.sum_models(models, x)
    assert as_one_group(y)
    y.pow(2).sum().backward()
    plain_sum(ref, x).pow(2).sum().backward()
    for kind in ("tensor", "post"):
        (tag, got), (ref_tag, want) = seen[kind]
        assert (tag, ref_tag) == ("", "ref")
        torch.testing.assert_close(got, want)
    assert_same_grads(models, ref)


def test_one_group_takes_keyword_arguments():
    models = one_group(kind="residual")
    ref = clone_models(models)
    x = torch.randn(4, IN)
    y = parsum.sum_models(models, x, scale=0.5)
    assert as_one_group(y)
    y_ref = sum(m(x, scale=0.5) for m in ref)
    torch.testing.assert_close(y, y_ref)
    y.pow(2).sum().backward()
    y_ref.pow(2).sum().backward()
    assert_same_grads(models, ref)


def test_one_group_bad_input_names_a_model_and_changes_nothing():
    models = one_group()
    with pytest.raises(parsum.ParsumError, match=r"model 0 \(Sequential\)"):
        parsum.sum_models(models, torch.randn(4, IN + 1)).sum().backward()
    assert all(g is None for g in param_grads(models))
    assert as_one_group(parsum.sum_models(models, torch.randn(4, IN)))


def test_eval_buffers_and_frozen_parameters_are_each_models_own():
    torch.manual_seed(0)
    models = []
    for k in range(3):
        m = nn.Sequential(nn.Linear(IN, OUT), nn.BatchNorm1d(OUT), nn.Linear(OUT, OUT))
        m[1].running_mean.fill_(k)  # every model has other statistics
        m[2].weight.requires_grad_(False)
        models.append(m.eval())
    assert groups(models, "stacked") == [(0, 1, 2)]
    x = torch.randn(4, IN, requires_grad=True)
    assert_matches(*run_both(models, x, engine="stacked"))
    assert all(m[2].weight.grad is None for m in models)


def test_gradcheck_float64():
    models = family(torch.float64)
    x = torch.randn(3, IN, dtype=torch.float64, requires_grad=True)
    w = torch.linspace(-1, 1, len(models), dtype=torch.float64, requires_grad=True)

    def f(x, w):
        return parsum.sum_models(models, x, weights=w, engine="stacked", n_jobs=2)

    assert torch.autograd.gradcheck(f, (x, w))
    # Parameters: the stacked group's gradients against the plain loop's, in float64.
    y = parsum.sum_models(models, x.detach(), engine="stacked")
    ref = sum(m(x.detach()) for m in models)
    for p in [p for m in models for p in m.parameters()]:
        got = torch.autograd.grad(y.sin().sum(), p, retain_graph=True)[0]
        want = torch.autograd.grad(ref.sin().sum(), p, retain_graph=True)[0]
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("engine", ["stacked", "auto"])
@pytest.mark.parametrize("chunk_size", [None, 1, 2, 3])
def test_bitwise_identical_for_any_n_jobs(engine, chunk_size):
    results = []
    for n_jobs in (1, 2, 3):
        models = family(seed=3) + [mlp([8]) for _ in range(4)]
        x = torch.randn(9, IN, generator=torch.Generator().manual_seed(5), requires_grad=True)
        w = torch.linspace(-1, 2, len(models), requires_grad=True)
        y = parsum.sum_models(
            models, x, weights=w, engine=engine, n_jobs=n_jobs, chunk_size=chunk_size
        )
        (y.sin() * 1e3).sum().backward()
        results.append([y, x.grad, w.grad, *param_grads(models)])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_no_grad_inference():
    models = family()
    x = torch.randn(4, IN)
    with torch.no_grad():
        y = parsum.sum_models(models, x, engine="stacked")
        torch.testing.assert_close(y, sum(m(x) for m in models))
    assert not y.requires_grad


def test_auto_runs_one_by_one_what_vmap_cannot_run():
    models = [Branchy() for _ in range(8)]
    assert groups(models, "auto") == [tuple(range(8))]
    x = torch.randn(4, IN, requires_grad=True)
    got, want = run_both(models, x, engine="auto")
    assert not as_one_group(got[0])  # nor in the caller's graph: the same vmap fails there
    assert_matches(got, want)
    # auto remembers the failure instead of trying vmap again on every call; "stacked" obeys.
    assert groups(models, "auto") == []
    for m in models:
        m.zero_grad()
    got, want = run_both(models, x.detach().requires_grad_(), engine="auto")  # one by one
    assert not as_one_group(got[0])
    assert_matches(got, want)
    assert groups(models, "stacked") == [tuple(range(8))]
    with pytest.raises(parsum.ParsumError, match=r"model 0 \(Branchy\), stacked with models"):
        parsum.sum_models(models, x, engine="stacked")


def test_error_in_a_stacked_model_names_it_and_changes_nothing():
    models = [Boom() for _ in range(2)]
    with pytest.raises(parsum.ParsumError, match=r"model 0 \(Boom\).*ValueError.*boom in forward"):
        parsum.sum_models(models, torch.randn(2, IN), engine="auto")
    assert all(p.grad is None for m in models for p in m.parameters())


def test_dropout_in_training_draws_a_mask_per_model():
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(IN, 64), nn.Dropout(0.5)) for _ in range(2)]
    with torch.no_grad():
        models[1][0].load_state_dict(models[0][0].state_dict())
    run = plan_units(models, [ModelParams.of(m) for m in models], "stacked", 2, None)
    assert [u.engine for u in run] == ["stacked"]
    x = torch.randn(2, IN)
    y = parsum.sum_models(models, x, weights=[1.0, -1.0], engine="stacked")
    # Equal weights under one shared mask would cancel exactly; about half the units differ.
    assert 0.2 < (y != 0).float().mean() < 0.8


def test_flat_grad_and_step_in_backward():
    models = family()
    flat = parsum.FlatGrad(models)
    x = torch.randn(4, IN)
    ref = clone_models(models)
    parsum.sum_models(models, x, engine="stacked").pow(2).sum().backward()
    sum(m(x) for m in ref).pow(2).sum().backward()
    assert_same_grads(models, ref)
    assert all(p.grad.data_ptr() != 0 for m in models for p in m.parameters())
    assert flat.flat.abs().sum() > 0

    models = family()
    ref = clone_models(models)
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
    parsum.sum_models(models, x, engine="stacked", step_in_backward=sib).pow(2).sum().backward()
    opt = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.1)
    sum(m(x) for m in ref).pow(2).sum().backward()
    opt.step()
    for m, r in zip(models, ref):
        for p, q in zip(m.parameters(), r.parameters()):
            assert p.grad is None
            torch.testing.assert_close(p, q)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n_cores", [1, 2, 16])
def test_small_models_stay_in_the_calling_thread_unless_told(cores, n_cores):
    # NOTE [ Threads that pay ] in parsum._grouping: with n_jobs unset the budget and the
    # models decide, whatever the engine (an explicit engine took every thread of the budget
    # until 2026-12-05: 64 tiny MLP classes with engine="autograd" 0.65x the plain loop).
    cores(n_cores)
    seen = []
    models = [Probe(thread_recorder(seen, 0.005)) for _ in range(6)]
    x = torch.randn(2, IN)
    for engine in ("auto", "autograd"):
        parsum.sum_models(models, x, chunk_size=1, engine=engine)
        assert set(seen) == {threading.current_thread().name}
        seen.clear()
        # an explicit n_jobs is obeyed
        parsum.sum_models(models, x, chunk_size=1, engine=engine, n_jobs=2)
        assert len(set(seen)) == min(2, n_cores)
        seen.clear()


def _storage_of(t):
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("flat", [False, True])
def test_a_copied_or_loaded_stack_trains_its_copied_models(flat):
    # NOTE [ A copied stack ]: copying a trainer's state (models, stack, optimizer) raised on
    # the stack's lock; with a FlatGrad over the stack, the copy forgot that the block was the
    # stacked .grad, and the next backward added to the copied step's gradients.
    torch.manual_seed(0)
    models = [mlp([8]) for _ in range(5)]
    stack = parsum.stack_(models)
    extra = (parsum.FlatGrad(stack),) if flat else ()
    opt = torch.optim.Adam(stack.parameters(), lr=1e-2)
    batches = [torch.randn(5, IN) for _ in range(4)]

    def train(models, opt, xs):
        for x in xs:
            opt.zero_grad()
            parsum.sum_models(models, x).pow(2).mean().backward()
            opt.step()

    train(models, opt, batches[:2])
    buffer = io.BytesIO()
    torch.save((models, stack, opt, *extra), buffer)
    buffer.seek(0)
    copies = [copy.deepcopy((models, stack, opt, *extra)), torch.load(buffer, weights_only=False)]
    before = [p.detach().clone() for m in models for p in m.parameters()]
    for twin_models, twin_stack, twin_opt, *_ in copies:
        assert list(twin_stack) == list(twin_models)
        stacked = dict(zip(twin_stack._trainable, twin_stack.parameters()))
        assert all(_storage_of(m[0].weight) == _storage_of(stacked["0.weight"])
                   for m in twin_models)  # fmt: skip
        assert twin_opt.param_groups[0]["params"][0] is stacked["0.weight"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # run as one: no warning of running one by one
            train(twin_models, twin_opt, batches[2:])
    after = [p.detach() for m in models for p in m.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # the copies' steps alone
    train(models, opt, batches[2:])
    for twin_models, *_ in copies:
        for p, q in zip((p for m in twin_models for p in m.parameters()),
                        (p for m in models for p in m.parameters())):  # fmt: skip
            assert torch.equal(p, q)

    # A stack that gave up copies as such: its copied models run one by one.
    stack.unstack_()
    twin_models, twin_stack = copy.deepcopy((models, stack))
    assert twin_stack._broken == "they were unstacked" and not list(twin_stack.parameters())
    ref = clone_models(twin_models)
    parsum.sum_models(twin_models, batches[0]).pow(2).sum().backward()
    sum(m(batches[0]) for m in ref).pow(2).sum().backward()
    assert_same_grads(twin_models, ref)


def test_a_stack_whose_models_are_gone_raises_instead_of_looking_empty():
    # A stack holds its models weakly: copy.deepcopy(stack) alone copies models that nothing
    # holds. That copy had the length of its models but no model to loop over, so an EMA loop
    # over zip(ema, stack) did nothing, silently.
    torch.manual_seed(0)
    models = [mlp([8]) for _ in range(4)]
    stack = parsum.stack_(models)
    ema = copy.deepcopy(stack)
    for use in (len, list, lambda s: s[0], lambda s: list(zip(s, stack))):
        with pytest.raises(parsum.ParsumError, match=r"its models are gone.*copy\.deepcopy"):
            use(ema)
    with pytest.raises(parsum.ParsumError, match="its models are gone"):
        parsum.sum_models(ema, torch.randn(5, IN))
    assert "models gone" in repr(ema)
    ema_models, ema = copy.deepcopy((models, stack))  # with its models: a working copy
    assert len(ema) == 4 and list(ema) == ema_models
    x = torch.randn(5, IN)
    torch.testing.assert_close(parsum.sum_models(ema, x), parsum.sum_models(stack, x))


def test_a_copied_stack_zeroes_a_frozen_layers_flatgrad_block_with_its_optimizer():
    # NOTE [ Gradients across a restack ]: a frozen name's block, kept as its stacked .grad,
    # was found when the stack was made again, before a copy's FlatGrad existed; the copy then
    # never zeroed it, and the frozen models' .grad kept the step of before the copy.
    torch.manual_seed(0)
    models = [mlp([8]) for _ in range(4)]
    stack = parsum.stack_(models)
    flat = parsum.FlatGrad(stack)
    opt = torch.optim.SGD(stack.parameters(), lr=0.1)
    x = torch.randn(5, IN)
    parsum.sum_models(models, x).pow(2).mean().backward()
    opt.step()
    for m in models:
        m[0].weight.requires_grad_(False)  # frozen with the gradients of that step
    parsum.sum_models(models, x).pow(2).mean().backward()
    opt.step()
    models, stack, opt, flat = copy.deepcopy((models, stack, opt, flat))
    assert all(m[0].weight.grad.any() for m in models)
    opt.zero_grad()
    parsum.sum_models(models, x).pow(2).mean().backward()
    assert all(not m[0].weight.grad.any() for m in models)  # zeroed, as None in the plain loop
    assert all(m[0].bias.grad.any() for m in models)


@pytest.mark.parametrize("zeroed", ["by the FlatGrad", "kept, then by the FlatGrad"])
def test_a_copied_stack_lets_a_layer_frozen_after_the_copy_rest(zeroed):
    # NOTE [ Frozen parameters' gradients ] in parsum._grads: a copy's stacked .grad is a copy
    # of the block, not the copied FlatGrad's block, so the FlatGrad's zero_() could not set
    # it to None for a layer frozen after the copy, and an optimizer over the stack stepped the
    # frozen layer with the gradients of before on every step (0.83 off the plain loop's after
    # one step, 4.5 after four).
    torch.manual_seed(0)
    models = [mlp([8]) for _ in range(6)]
    ref = copy.deepcopy(models)
    stack = parsum.stack_(models)
    flat = parsum.FlatGrad(stack)
    opt = torch.optim.SGD(stack.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.1, momentum=0.9)
    x = torch.randn(5, IN)
    for step in range(5):
        if step == 2:
            models, stack, opt, flat = copy.deepcopy((models, stack, opt, flat))
            for m in [*models, *ref]:
                m[0].weight.requires_grad_(False)
        if step != 2 or zeroed == "by the FlatGrad":
            flat.zero_()
            for m in ref:
                for p in m.parameters():
                    p.grad = torch.zeros_like(p) if p.requires_grad else None
        parsum.sum_models(models, x).pow(2).mean().backward()
        plain_sum(ref, x).pow(2).mean().backward()
        opt.step()
        ref_opt.step()
        for m, r in zip(models, ref):
            for a, b in zip(m.parameters(), r.parameters()):
                torch.testing.assert_close(a, b)
    assert stack.values["0.weight"].grad is None


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_a_retained_graph_backed_twice_at_one_batch_row_gives_each_model_its_own_grad(n_jobs):
    # In the caller's graph a stacked bias's gradient at one batch row was the sum's gradient
    # expanded over the models, so every model's .grad was one memory: the second backward
    # over the retained graph added into it once per model ((1 + M) / 2 times the plain
    # loop's; tests/test_differential.py, complex seed 214681).
    torch.manual_seed(0)
    models = [mlp([5]).double() for _ in range(5)]
    ref = copy.deepcopy(models)
    x = torch.randn(1, IN, dtype=torch.float64)
    y = parsum.sum_models(models, x, n_jobs=n_jobs, engine="stacked")
    y_ref = sum(m(x) for m in ref)
    for _ in range(2):
        y.pow(2).sum().backward(retain_graph=True)
        y_ref.pow(2).sum().backward(retain_graph=True)
    for got, want in zip(param_grads(models), param_grads(ref)):
        torch.testing.assert_close(got, want)
    ptrs = {m[-1].bias.grad.data_ptr() for m in models}
    assert len(ptrs) == len(models)


class _ReturnsItsScale(nn.Module):
    """A model one of whose outputs is a parameter itself: its gradient is the sum's."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(IN, 2)
        self.scale = nn.Parameter(torch.randn(2))

    def forward(self, x):
        return self.lin(x), self.scale


@pytest.mark.parametrize("rows", [1, 4])
def test_a_parameter_given_out_whole_keeps_a_grad_of_its_own_in_a_retained_graph(rows):
    # The aliasing above is not one of one batch row: a parameter that is an output (or
    # reaches one through views) has the sum's gradient, expanded over the models, as its
    # gradient at any batch size; before the fix every model's .grad was one memory here too.
    torch.manual_seed(0)
    models = [_ReturnsItsScale().double() for _ in range(5)]
    ref = copy.deepcopy(models)
    x = torch.randn(rows, IN, dtype=torch.float64)
    a, b = parsum.sum_models(models, x, engine="stacked")
    ref_a, ref_b = sum(m(x)[0] for m in ref), sum(m(x)[1] for m in ref)
    for _ in range(2):
        (a.pow(2).sum() + b.pow(3).sum()).backward(retain_graph=True)
        (ref_a.pow(2).sum() + ref_b.pow(3).sum()).backward(retain_graph=True)
    for got, want in zip(param_grads(models), param_grads(ref)):
        torch.testing.assert_close(got, want)
    assert len({m.scale.grad.data_ptr() for m in models}) == len(models)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["floats", "float64 tensor"])
def test_half_precision_weights_multiply_as_the_plain_terms(dtype, kind):
    # weigh_models: a stacked group's products and cotangents by float weights as w * out and
    # g * w compute them (in float32, the weight not rounded to the half type first), so the
    # stacked call gives the bits of the same models run one by one.
    torch.manual_seed(0)
    models = [
        nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype) for _ in range(12)
    ]
    one_by_one = copy.deepcopy(models)
    x = torch.randn(5, 8, dtype=dtype)
    w = [0.1 * (i + 1) + 0.0123 for i in range(12)]
    weights = w if kind == "floats" else torch.tensor(w, dtype=torch.float64)
    y = parsum.sum_models(models, x, weights=weights)
    want = parsum.sum_models(one_by_one, x, weights=weights, engine="autograd")
    assert y.grad_fn.name() != want.grad_fn.name()  # the stacked call, and not
    assert torch.equal(y, want)
    g = torch.randn_like(y)
    y.backward(g)
    want.backward(g)
    for m, twin in zip(models, one_by_one):
        for p, q in zip(m.parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad)


_ARMED = [0]  # how many more backward passes of _FailsWhenArmed raise


class _FailsWhenArmed(torch.autograd.Function):
    """tanh, whose backward raises while ``_ARMED`` holds a count above zero; runs under
    vmap."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x.tanh()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, g):
        if _ARMED[0] > 0:
            _ARMED[0] -= 1
            raise RuntimeError("fails in backward")
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


class _ArmedTanh(nn.Module):
    def forward(self, x):
        return _FailsWhenArmed.apply(x)


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("times", [1, 100])  # a failure that does not repeat, and one that does
def test_a_group_beside_others_failing_in_backward_is_named_and_changes_no_grad(times, n_jobs):
    # NOTE [ Stacked groups in the caller's graph ] in parsum._inline: the group's models share
    # one graph, pulled back again together and named by the first.
    torch.manual_seed(0)
    group = [nn.Sequential(nn.Linear(IN, 5), _ArmedTanh(), nn.Linear(5, OUT)) for _ in range(8)]
    models = [mlp([4]), *group[:4], mlp([7]), *group[4:], mlp([3])]
    ref = copy.deepcopy(models)
    x = torch.randn(4, IN)
    assert groups(models, "auto", x) == [(1, 2, 3, 4, 6, 7, 8, 9)]
    y = parsum.sum_models(models, x, n_jobs=n_jobs)
    assert type(y.grad_fn).__name__ == "CallerGraphSumBackward"
    _ARMED[0] = times
    try:
        with pytest.raises(
            parsum.ParsumError,
            match=r"model 1 \(Sequential\), stacked with models \[2, 3, 4, 6, 7, 8, 9\].*"
            r"fails in backward",
        ):
            y.pow(2).sum().backward()
    finally:
        _ARMED[0] = 0
    assert all(p.grad is None for m in models for p in m.parameters())
    parsum.sum_models(models, x, n_jobs=n_jobs).pow(2).sum().backward()  # usable after
    plain_sum(ref, x).pow(2).sum().backward()
    assert_same_grads(models, ref)


_GLOBAL_HOOKS = {
    # Each scales a Linear's output (or its input, or its output's gradient), so that a
    # module the hook did not run for gives other values, and records which modules it ran for.
    "forward": lambda seen: nn.modules.module.register_module_forward_hook(
        lambda m, i, o: seen.append(m) or (o * 1.5 if isinstance(m, nn.Linear) else o)
    ),
    "forward_pre": lambda seen: nn.modules.module.register_module_forward_pre_hook(
        lambda m, i: seen.append(m) or ((i[0] * 0.5,) if isinstance(m, nn.Linear) else i)
    ),
    "full_backward_pre": lambda seen: nn.modules.module.register_module_full_backward_pre_hook(
        lambda m, go: seen.append(m) or ((go[0] * 2,) if isinstance(m, nn.Linear) else go)
    ),
}


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("engine", ["auto", "stacked"])
@pytest.mark.parametrize("storage", [False, True])
@pytest.mark.parametrize("kind", ["Sequential", "class"])
@pytest.mark.parametrize("hook", list(_GLOBAL_HOOKS))
def test_a_global_module_hook_runs_for_every_module_of_identical_models(
    hook, kind, storage, engine, n_jobs
):
    # A stacked group ran none of its models' modules: identical Sequentials as batched
    # matmuls called no hook (a forward hook scaling each Linear's output by 1.5: values off by
    # 1.6 to 6, silently), classes through vmap ran it once a group on shadow modules. While a
    # global hook is registered the models run one by one through their own modules, also in
    # stack_ storage (gradients still into the stack's buffers), and stack again after.
    torch.manual_seed(0)
    models = [mlp([8]) if kind == "Sequential" else TwoLayers() for _ in range(8)]
    plain = copy.deepcopy(models)
    stack = parsum.stack_(models) if storage else None
    opts = [  # an optimizer over the stack's storage, and its twin over the plain models'
        torch.optim.SGD(params, lr=0.1)
        for params in (stack.parameters(), [p for m in plain for p in m.parameters()])
    ] if storage else []  # fmt: skip
    x = torch.randn(5, IN)
    parsum.sum_models(models, x, engine=engine, n_jobs=n_jobs)  # planned before the hook
    tol = TOL[torch.float32]
    seen_parsum, seen_plain, outputs = [], [], []
    for ms, seen in ((models, seen_parsum), (plain, seen_plain)):
        handle = _GLOBAL_HOOKS[hook](seen)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("error", "parsum")  # the stack is not given up
                if ms is models:
                    y = parsum.sum_models(models, x, engine=engine, n_jobs=n_jobs)
                else:
                    y = plain_sum(plain, x)
                y.pow(2).sum().backward()
        finally:
            handle.remove()
        outputs.append(y)
    torch.testing.assert_close(outputs[0], outputs[1], **tol)
    # The same modules, by their place among the models, as often as in the plain loop
    place = {
        id(m): f"{j}.{name}"
        for ms in (models, plain)
        for j, model in enumerate(ms)
        for name, m in model.named_modules()
    }
    assert sorted(place[id(m)] for m in seen_parsum) == sorted(place[id(m)] for m in seen_plain)
    assert_same_grads(models, plain, **tol)
    if storage:  # the stack's optimizer steps them, and the next call without it stacks again
        for opt in opts:
            opt.step()
        for m, q in zip(models, plain):
            for a, b in zip(m.parameters(), q.parameters()):
                torch.testing.assert_close(a, b, **tol)
        y = parsum.sum_models(models, x, engine=engine, n_jobs=n_jobs)
        torch.testing.assert_close(y, plain_sum(plain, x), **tol)
        assert parsum.stack_(models) is stack


@pytest.mark.parametrize("engine", ["auto", "stacked"])
@pytest.mark.parametrize("when", ["before the first call", "after it"])
@pytest.mark.parametrize("storage", [False, True])
def test_a_forward_assigned_to_a_layer_of_identical_models_runs(storage, when, engine):
    # The same function assigned as every model's first Linear's forward: one structure key,
    # so the models were stacked, and a group of Sequentials runs as batched matmuls, which
    # called no forward (values off by 1.3, silently; in stack_ storage, assigned after
    # stacking, off by 0.98). Now such models run one by one, calling it.
    torch.manual_seed(0)
    models = [mlp([8]) for _ in range(8)]
    plain = copy.deepcopy(models)
    for m in plain:
        m[0].forward = zeros_of_width_8
    x = torch.randn(5, IN)
    if when == "before the first call":
        for m in models:
            m[0].forward = zeros_of_width_8
        if storage:
            with pytest.raises(parsum.ParsumError, match=r"module '0' .* has a forward assigned"):
                parsum.stack_(models)
    else:
        if storage:
            parsum.stack_(models)
        parsum.sum_models(models, x, engine=engine)
        for m in models:
            m[0].forward = zeros_of_width_8
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = parsum.sum_models(models, x, engine=engine)
    if storage and when == "after it":  # the stack gives up, saying why
        assert any("given a forward of its own" in str(w.message) for w in caught)
    want = plain_sum(plain, x)
    torch.testing.assert_close(y, want, **TOL[torch.float32])
    y.pow(2).sum().backward()
    want.pow(2).sum().backward()
    assert_same_grads(models, plain, **TOL[torch.float32])


class _RoundsLinearOutputs(torch.overrides.TorchFunctionMode):
    """Fake quantization: every F.linear's output rounded."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out.round() if func is torch.nn.functional.linear else out


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("engine", ["auto", "stacked"])
@pytest.mark.parametrize("storage", [False, True])
@pytest.mark.parametrize("kind", ["Sequential", "class"])
def test_a_torch_function_mode_sees_every_models_calls(kind, storage, engine, n_jobs):
    # A stacked group's batched matmuls call addmm and baddbmm where each model calls F.linear:
    # a mode rounding every F.linear's output saw none of them (8 MLPs off by 1.6, silently).
    # Under a mode the models run one by one (NOTE [ Global module hooks and stacked groups ]).
    torch.manual_seed(0)
    models = [mlp([8]) if kind == "Sequential" else TwoLayers() for _ in range(8)]
    plain = copy.deepcopy(models)
    if storage:
        parsum.stack_(models)
    x = torch.randn(5, IN) * 3
    parsum.sum_models(models, x, engine=engine, n_jobs=n_jobs)  # planned outside the mode
    with _RoundsLinearOutputs():
        with warnings.catch_warnings():
            warnings.filterwarnings("error", "parsum")  # the stack is not given up
            y = parsum.sum_models(models, x, engine=engine, n_jobs=n_jobs)
        want = plain_sum(plain, x)
    torch.testing.assert_close(y, want, **TOL[torch.float32])
    torch.testing.assert_close(
        parsum.sum_models(models, x), plain_sum(plain, x), **TOL[torch.float32]
    )


class NormedHead(nn.Module):
    """A class of its own (its group runs through vmap) whose LayerNorm's weight, a 1-D
    tensor, its graph saves."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.norm, self.last = nn.Linear(IN, 8), nn.LayerNorm(8), nn.Linear(8, OUT)

    def forward(self, x):
        return self.last(self.norm(torch.tanh(self.first(x))))


# What each write reaches: (the model's tensor, whether the argument needs a gradient).
GROUP_WRITES = {
    "a later weight": (
        lambda m: m[-1].weight if isinstance(m, nn.Sequential) else m.last.weight,
        False,
    ),
    "a bias": (lambda m: m[-1].bias if isinstance(m, nn.Sequential) else m.last.bias, False),
    "the first weight": (
        lambda m: m[0].weight if isinstance(m, nn.Sequential) else m.first.weight,
        False,
    ),
    "the first weight, x needing a gradient": (
        lambda m: m[0].weight if isinstance(m, nn.Sequential) else m.first.weight,
        True,
    ),
    "a norm's weight": (
        lambda m: m[0].bias if isinstance(m, nn.Sequential) else m.norm.weight,
        False,
    ),
    # frozen on every model before the forward: the graph saves it all the same
    "a frozen later weight": (
        lambda m: m[-1].weight if isinstance(m, nn.Sequential) else m.last.weight,
        False,
    ),
}


def written_between_forward_and_backward(make, write, how, use_parsum):
    """Eight identical models (beside another where ``how`` says), a tensor of model 5 written
    in place after the forward; the error the backward raised, or None, and the models'
    gradients (their values where the optimizer steps in the backward)."""
    torch.manual_seed(3)
    models = [make() for _ in range(8)]
    if how == "beside another":
        models.insert(2, mlp([5, 7]))
    tensor_of, x_needs_grad = GROUP_WRITES[write]
    if "frozen" in write:
        for m in models:
            tensor_of(m).requires_grad_(False)
    x = torch.randn(6, IN, requires_grad=x_needs_grad)
    params = [p for m in models for p in m.parameters() if p.requires_grad]
    kwargs = {}
    if use_parsum and how == "stack_":
        parsum.stack_(models)
    if use_parsum and how == "n_jobs=2":
        kwargs["n_jobs"] = 2
    if how == "step_in_backward":
        if use_parsum:
            kwargs["step_in_backward"] = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
        else:
            opt = torch.optim.SGD(params, lr=0.1)
    y = parsum.sum_models(models, x, **kwargs) if use_parsum else plain_sum(models, x)
    target = models[6 if how == "beside another" else 5]
    with torch.no_grad():
        tensor_of(target).mul_(0.5)
    before = [p.detach().clone() for p in params]
    error = None
    try:
        if how == "create_graph":
            grads = torch.autograd.grad(y.pow(2).sum(), params, create_graph=True)
            sum(g.pow(2).sum() for g in grads).backward()
        else:
            y.pow(2).sum().backward()
            if how == "step_in_backward" and not use_parsum:
                opt.step()
    except Exception as exc:
        error = exc
    if error is not None and use_parsum:  # nothing written, nothing stepped
        assert all(p.grad is None for p in params)
        assert all(torch.equal(p, b) for p, b in zip(params, before))
    if how == "step_in_backward":
        return error, [p.detach() for p in params]
    return error, [p.grad for p in params]


@pytest.mark.parametrize("make", [lambda: mlp([8, 8]), NormedHead], ids=["Sequential", "class"])
@pytest.mark.parametrize("write", list(GROUP_WRITES))
@pytest.mark.parametrize(
    "how", ["auto", "beside another", "n_jobs=2", "stack_", "step_in_backward", "create_graph"]
)
def test_a_tensor_written_before_a_groups_backward_raises_where_the_plain_loop_does(
    make, write, how
):
    # NOTE [ Weights written before a group's backward ] in parsum._engines: the group's graph
    # saved its stacked copies (stack_ storage: aliases of the storage), which a model's own
    # weight written in place did not mark, and the backward ran on silently with the
    # forward's weights (stack_ storage: the new ones), where the plain loop raises.
    expected, expected_grads = written_between_forward_and_backward(make, write, how, False)
    error, grads = written_between_forward_and_backward(make, write, how, True)
    if expected is None:
        assert error is None
        tol = 1e-3 if how == "create_graph" else 1e-4  # second derivatives of float32 sums
        for a, b in zip(grads, expected_grads):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    else:
        assert "modified by an inplace operation" in str(expected)
        assert isinstance(error, parsum.ParsumError)
        kind = "Sequential" if isinstance(make(), nn.Sequential) else "NormedHead"
        named = 6 if how == "beside another" else 5
        assert f"model {named} ({kind}) raised RuntimeError in backward" in str(error)
        assert "modified by an inplace operation" in str(error)


@pytest.mark.parametrize("x_needs_grad", [False, True])
@pytest.mark.parametrize("how", ["auto", "beside another", "n_jobs=2", "stack_"])
def test_an_argument_written_before_a_groups_backward_is_named(how, x_needs_grad):
    # Every path raises autograd's error, as the plain loop does; one group alone, with no
    # node of parsum's before its graph, raised it naming no model (the others named the
    # first): its check names the first model too, before any gradient is written.
    torch.manual_seed(4)
    models = [mlp([8, 8]) for _ in range(8)]
    if how == "beside another":
        models.insert(2, mlp([5, 7]))
    if how == "stack_":
        parsum.stack_(models)
    leaf = torch.randn(6, IN, requires_grad=x_needs_grad)
    x = leaf.clone() if x_needs_grad else leaf
    y = parsum.sum_models(models, x, **({"n_jobs": 2} if how == "n_jobs=2" else {}))
    with torch.no_grad():
        x.mul_(2.0)
    with pytest.raises(parsum.ParsumError, match=r"model 0 \(Sequential\).*raised RuntimeError"):
        y.sum().backward()
    assert all(p.grad is None for m in models for p in m.parameters())
    assert leaf.grad is None
    y = plain_sum(models, x)  # the plain loop raises too
    with torch.no_grad():
        x.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("written", ["every name", "biases"])
@pytest.mark.parametrize("how", ["auto", "n_jobs=1", "n_jobs=2", "engine=stacked"])
def test_an_optimizer_over_a_stack_stepped_before_its_backward_is_named(how, written):
    # The stacked tensors themselves written (an optimizer over stack.parameters() stepped
    # early): the group's graph saved aliases of them, and autograd raised its own error,
    # naming no model. Now the first model is named (every model's slice was written), before
    # any gradient is written; a write that no graph saved (the biases) raises nothing.
    torch.manual_seed(6)
    models = [mlp([8, 8]) for _ in range(8)]
    twins = clone_models(models)
    stack = parsum.stack_(models)
    stacked = dict(zip(stack._trainable, stack.parameters()))
    opt = torch.optim.SGD(
        [t for name, t in stacked.items() if written == "every name" or "bias" in name], lr=0.1
    )
    x = torch.randn(6, IN)
    kwargs = {"n_jobs": int(how[-1])} if how.startswith("n_jobs") else {}
    if how == "engine=stacked":
        kwargs["engine"] = "stacked"
    y = parsum.sum_models(models, x, **kwargs)
    for t in opt.param_groups[0]["params"]:
        t.grad = torch.ones_like(t)
    opt.step()
    opt.zero_grad()
    after_step = [t.detach().clone() for t in stacked.values()]
    params = [p for m in models for p in m.parameters()]
    plain = plain_sum(twins, x)  # the plain loop, its weights written as the stack's were
    with torch.no_grad():
        for twin in twins:
            for name, p in twin.named_parameters():
                if written == "every name" or "bias" in name:
                    p.sub_(0.1)

    def backward(out: torch.Tensor, wrt: list[torch.Tensor]) -> list[torch.Tensor | None]:
        out.pow(2).sum().backward()
        return [p.grad for p in wrt]

    if written == "biases":
        got = backward(y, params)
        expected = backward(plain, [p for m in twins for p in m.parameters()])
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        return
    with pytest.raises(parsum.ParsumError, match=r"model 0 \(Sequential\) raised RuntimeError"):
        backward(y, params)
    assert all(p.grad is None for p in params)
    assert all(t.grad is None for t in stacked.values())
    assert all(torch.equal(t, was) for t, was in zip(stacked.values(), after_step))


@pytest.mark.parametrize("kwargs", [{}, {"n_jobs": 1}, {"n_jobs": 2}, {"engine": "autograd"}])
@pytest.mark.parametrize("grads", ["none", "set"])
def test_a_failed_backward_of_stack_models_run_one_by_one_leaves_their_gradients(kwargs, grads):
    # Three models run one by one; an optimizer over the stack wants their gradients in its
    # buffer, whose views the backward's start makes their .grad: undone where it fails.
    torch.manual_seed(5)
    models = [mlp([8, 8]) for _ in range(3)]
    stack = parsum.stack_(models)
    stacked = list(stack.parameters())  # an optimizer over them would ask for these
    if grads == "set":
        parsum.sum_models(models, torch.randn(6, IN), **kwargs).sum().backward()
    tensors = [*stacked, *(p for m in models for p in m.parameters())]
    before = [None if t.grad is None else t.grad.clone() for t in tensors]
    y = parsum.sum_models(models, torch.randn(6, IN), **kwargs)
    with torch.no_grad():
        models[1][-1].weight.mul_(0.5)
    with pytest.raises(parsum.ParsumError, match=r"model 1 \(Sequential\)"):
        y.sum().backward()
    for t, was in zip(tensors, before):
        assert t.grad is None if was is None else torch.equal(t.grad, was)
