"""Plans reused across calls (NOTE [ Reused plans ]): every change that matters is noticed, the
bits are those of a fresh plan, and a kept plan keeps no model alive."""

import copy
import functools
import gc
import threading
import weakref

import pytest
import torch
from torch import nn

import parsum
from parsum import _plans
from parsum._plans import known_walk
from tests.zoo import (
    IN,
    OUT,
    Branchy,
    clone_models,
    mlp,
    narrow_in_place,
    param_grads,
    plain_sum,
    zoo,
)

pytestmark = pytest.mark.timeout(60)


class Scaled(nn.Module):
    """A class outside torch.nn: its own attributes are part of what a plan checks."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(IN, OUT)
        self.scale: float | torch.Tensor = 1.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


@pytest.fixture(autouse=True)
def no_table_elsewhere(monkeypatch):
    # A take_rows table that another test in this worker left alive keeps any plan from being
    # kept (NOTE [ Reused plans ]); these models use none.
    monkeypatch.setattr(_plans, "any_sampled", lambda: False)


def models_under_test() -> list[nn.Module]:
    torch.manual_seed(0)
    with_norm = nn.Sequential(nn.Linear(IN, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, OUT))
    return [*zoo(seed=2), with_norm, Scaled()]


def seeded(make):
    def made(*shape):
        torch.manual_seed(len(shape) + sum(shape))
        return make(*shape)

    return made


randn = seeded(torch.randn)


# Each change is applied the same way to the models and to a copy run by the plain loop.
def changed_alike(models: list[nn.Module], change) -> list[nn.Module]:
    """A copy of the models to compare against, then ``change`` made to both lists; the copy."""
    ref = clone_models(models)
    for ms in (models, ref):
        change(ms)
    return ref


CHANGES = {
    "attribute replaced": lambda ms: setattr(ms[8], "scale", 2.5),
    "parameter replaced": lambda ms: setattr(ms[0][0], "weight", nn.Parameter(randn(8, IN))),
    "parameter frozen": lambda ms: ms[1][0].weight.requires_grad_(False),
    "parameter data replaced": lambda ms: setattr(ms[0][0].weight, "data", randn(8, IN)),
    "parameter deleted": lambda ms: setattr(ms[1][0], "bias", None),
    "submodule replaced": lambda ms: ms[1].__setitem__(1, nn.Sigmoid()),
    "eval": lambda ms: ms[7].eval(),
    "buffer replaced": lambda ms: setattr(ms[7][1], "running_mean", randn(8)),
    "forward hook": lambda ms: ms[6].register_forward_hook(lambda m, i, out: 2 * out),
    "tensor attribute": lambda ms: setattr(ms[8], "scale", torch.tensor(2.0, requires_grad=True)),
    "state loaded with assign": lambda ms: ms[2].load_state_dict(
        {k: v + 1 for k, v in ms[2].state_dict().items()}, assign=True
    ),
    "layer appended": lambda ms: ms[1].append(nn.Tanh()),
    "submodules swapped": lambda ms: swap(ms[2], 1, 2),  # LayerNorm(10) and SiLU
    "forward pre-hook": lambda ms: ms[6].register_forward_pre_hook(lambda m, a: (2 * a[0],)),
    "parameter data made non-contiguous": lambda ms: setattr(
        ms[0][0].weight, "data", randn(IN, 8).t()
    ),
    # The same addresses, other shapes: a plan that compared addresses alone held.
    "parameter data narrowed in place": lambda ms: narrow_in_place(ms[0], 4),
}


def swap(sequential: nn.Sequential, i: int, j: int) -> None:
    first, second = sequential[i], sequential[j]
    sequential[i], sequential[j] = second, first


# Changes after which a plan may hold or not: the calls after them must still be right.
CHANGES_UNDONE_OR_IN_PLACE = {
    "forward hook added then removed": lambda ms: (
        ms[6].register_forward_hook(lambda m, i, out: 2 * out).remove()
    ),
    "bias frozen then unfrozen": lambda ms: ms[1][0].bias.requires_grad_(False).requires_grad_(),
    "weights changed in place under no_grad": lambda ms: scale_in_place(ms[3], 1.5),
}


@torch.no_grad()
def scale_in_place(module: nn.Module, factor: float) -> None:
    for p in module.parameters():
        p.mul_(factor)


@pytest.mark.parametrize("through", ["modules", "bound methods"])
@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_between_calls_is_noticed(change, n_jobs, through):
    models = models_under_test()
    x = torch.randn(5, IN)

    def calls():  # bound methods: new objects on every call, one plan (NOTE [ Reused plans ])
        return models if through == "modules" else [m.forward for m in models]

    parsum.sum_models(calls(), x, n_jobs=n_jobs).pow(2).mean().backward()
    assert known_walk(calls()) is not None  # the next call would reuse the plan
    ref = changed_alike(models, CHANGES[change])  # with the statistics the call updated
    for m in [*models, *ref]:
        m.zero_grad(set_to_none=True)
    assert known_walk(calls()) is None
    y = parsum.sum_models(calls(), x, n_jobs=n_jobs)
    y.pow(2).mean().backward()
    # Through m.forward a module's own hooks do not run, in the plain loop either.
    y_ref = plain_sum(ref, x) if through == "modules" else sum(m.forward(x) for m in ref)
    y_ref.pow(2).mean().backward()
    torch.testing.assert_close(y, y_ref)
    assert_changed_grads_match(models, ref, change)


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("change", list(CHANGES_UNDONE_OR_IN_PLACE))
def test_a_change_undone_or_made_in_place_between_calls(change, n_jobs):
    models = models_under_test()
    x = torch.randn(5, IN)
    parsum.sum_models(models, x, n_jobs=n_jobs).pow(2).mean().backward()
    ref = changed_alike(models, CHANGES_UNDONE_OR_IN_PLACE[change])
    for m in [*models, *ref]:
        m.zero_grad(set_to_none=True)
    y = parsum.sum_models(models, x, n_jobs=n_jobs)
    y.pow(2).mean().backward()
    y_ref = plain_sum(ref, x)
    y_ref.pow(2).mean().backward()
    torch.testing.assert_close(y, y_ref)
    assert_changed_grads_match(models, ref, change)


def assert_changed_grads_match(models, ref, change):
    grads, ref_grads = param_grads(models), param_grads(ref)
    assert [g is None for g in grads] == [g is None for g in ref_grads]
    for a, b in zip(grads, ref_grads):
        if a is not None:
            # Loading weights + 1 makes gradients of ~40 whose float32 rounding (both sums are
            # within a few ulps of float64) exceeds the default atol; a change not noticed
            # would differ by far more than this scaled tolerance.
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * (1 + b.abs().max().item()))
    if change == "tensor attribute":
        torch.testing.assert_close(models[8].scale.grad, ref[8].scale.grad)


def test_a_dtype_change_is_noticed():
    models = models_under_test()[:7]
    x = torch.randn(4, IN)
    parsum.sum_models(models, x, n_jobs=1).sum().backward()
    for m in models:
        m.double()
    assert known_walk(models) is None
    ref = clone_models(models)
    y = parsum.sum_models(models, x.double(), n_jobs=1)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, plain_sum(ref, x.double()))


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_identical_models_narrowed_in_place_are_grouped_anew(n_jobs):
    # Every third model's hidden layer narrowed by .data slices, which keep the addresses: the
    # plan held, and engine="stacked" stacked its old group of eight, which raised.
    torch.manual_seed(0)
    models = [mlp([8]) for _ in range(8)]
    x = torch.randn(5, IN)
    parsum.sum_models(models, x, engine="stacked", n_jobs=n_jobs).sum().backward()
    ref = changed_alike(models, lambda ms: [narrow_in_place(m, 4) for m in ms[::3]])
    for m in [*models, *ref]:
        m.zero_grad(set_to_none=True)
    y = parsum.sum_models(models, x, engine="stacked", n_jobs=n_jobs)
    y.pow(2).mean().backward()
    y_ref = plain_sum(ref, x)
    y_ref.pow(2).mean().backward()
    torch.testing.assert_close(y, y_ref)
    assert_changed_grads_match(models, ref, "narrowed")


@pytest.mark.parametrize("n_jobs", [1, 3])
def test_a_reused_plan_gives_the_bits_of_a_fresh_one(n_jobs):
    models = models_under_test()
    x = torch.randn(6, IN)
    results = []
    for fresh in (True, False, False):
        if fresh:
            _plans._plans.clear()
        else:
            assert known_walk(models) is not None
        for m in models:
            m.zero_grad(set_to_none=True)
        y = parsum.sum_models(models, x, n_jobs=n_jobs, chunk_size=3)
        y.pow(2).sum().backward()
        results.append((y.detach(), param_grads(models)))
    (y0, g0), *others = results
    for y, g in others:
        assert torch.equal(y, y0)
        assert all(torch.equal(a, b) for a, b in zip(g, g0))


class BoundAttribute(nn.Module):
    """Holds a method of its own as an attribute: a plan holding it would hold the module."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(IN, OUT)
        self.act = self.squash

    def squash(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))


@pytest.mark.parametrize("kind", ["zoo", "bound attributes"])
def test_a_kept_plan_keeps_no_model_alive(kind):
    # With every model holding a method of its own, no model goes first to drop the plan.
    models = models_under_test() if kind == "zoo" else [BoundAttribute() for _ in range(3)]
    key = tuple(map(id, models))
    parsum.sum_models(models, torch.randn(3, IN)).sum().backward()
    assert key in _plans._plans
    refs = [weakref.ref(m) for m in models]
    weights = weakref.ref(next(models[0].parameters()))
    del models
    gc.collect()
    assert all(r() is None for r in refs) and weights() is None
    assert key not in _plans._plans


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_a_table_of_other_models_changes_neither_the_plan_nor_the_bits(n_jobs, cores):
    # A take_rows table alive anywhere had made every call plan anew, and a walk made for one
    # call runs forwards with dropout in model order on the whole budget's threads, where
    # BatchNorm's statistics take other bits: a call's bits depended on whether the garbage
    # collector had taken some other models' table yet (found by tests/test_differential.py).
    cores(2)
    torch.manual_seed(0)
    make = [
        nn.Sequential(nn.Linear(IN, 7), nn.BatchNorm1d(7), nn.Linear(7, OUT)),
        nn.Sequential(nn.Linear(IN, 9), nn.ReLU(), nn.Dropout(0.3), nn.Linear(9, OUT)),
    ]
    x = torch.randn(16, IN)

    def outputs(models):
        found = []
        for step in range(3):
            torch.manual_seed(step)
            found.append(parsum.sum_models(models, x, n_jobs=n_jobs).detach())
        return found

    alone = outputs(clone_models(make))
    table = nn.Parameter(torch.randn(10, 4))
    parsum.take_rows(table, torch.tensor([1, 3]))
    models = clone_models(make)
    beside = outputs(models)
    assert known_walk(models) is not None
    assert all(torch.equal(a, b) for a, b in zip(alone, beside))
    del table


def test_at_most_max_plans_are_kept():
    ensembles = [[mlp([4]) for _ in range(2)] for _ in range(_plans.MAX_PLANS + 3)]
    for models in ensembles:
        parsum.sum_models(models, torch.randn(2, IN))
    assert len(_plans._plans) <= _plans.MAX_PLANS
    assert known_walk(ensembles[-1]) is not None and known_walk(ensembles[0]) is None


class TwoHeads(nn.Module):
    """A model called through its methods: each a head of its own on a shared body."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(IN, 6)
        self.a = nn.Linear(6, OUT)
        self.b = nn.Linear(6, OUT)

    def first(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(torch.tanh(self.body(x)))

    def second(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.sigmoid(self.body(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(x) + self.second(x)


def test_bound_methods_reuse_their_plan_until_something_changes():
    # A bound method is a new object on every call: known by its module and its function.
    torch.manual_seed(0)
    models = [TwoHeads() for _ in range(3)]
    ref = clone_models(models)
    x = torch.randn(5, IN)

    def methods(ms, which="first"):
        return [getattr(m, which) for m in ms] + [ms[0]]  # a module among them too

    for step in range(3):
        if step == 2:  # noticed, as for modules
            for ms in (models, ref):
                ms[1].a.weight.requires_grad_(False)
            assert known_walk(methods(models)) is None
        y = parsum.sum_models(methods(models), x, n_jobs=2, chunk_size=1)
        y.pow(2).sum().backward()
        y_ref = sum(f(x) for f in methods(ref))
        y_ref.pow(2).sum().backward()
        torch.testing.assert_close(y, y_ref)
        for a, b in zip(param_grads(models), param_grads(ref)):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b)
        if step < 2:
            assert known_walk(methods(models)) is not None
    # Another function of the same modules is another plan; so is another order.
    assert known_walk(methods(models, "second")) is None
    assert known_walk(methods(models)[::-1]) is None
    parsum.sum_models(methods(models, "second"), x)
    assert known_walk(methods(models, "second")) is not None
    assert known_walk(methods(models)) is not None


def test_a_plan_over_bound_methods_keeps_no_model_alive():
    models = [TwoHeads() for _ in range(2)]
    parsum.sum_models([m.first for m in models], torch.randn(3, IN)).sum().backward()
    assert known_walk([m.first for m in models]) is not None
    refs = [weakref.ref(m) for m in models]
    n_plans = len(_plans._plans)
    del models
    gc.collect()
    assert all(r() is None for r in refs)
    assert len(_plans._plans) == n_plans - 1


def test_partials_and_lazy_modules_are_planned_on_every_call():
    base = [mlp([4]), mlp([5])]
    partials = [functools.partial(m) for m in base]
    parsum.sum_models(partials, torch.randn(2, IN))
    assert known_walk(partials) is None
    lazy = [nn.Sequential(nn.LazyLinear(OUT)), mlp([3])]
    with pytest.raises(parsum.ParsumError, match="lazy"):
        parsum.sum_models(lazy, torch.randn(2, IN))
    assert known_walk(lazy) is None


@pytest.mark.filterwarnings("ignore:.*torch.jit.script.* is deprecated:DeprecationWarning")
@pytest.mark.parametrize("n_jobs", [1, 2, None])
@pytest.mark.parametrize("scripted", ["model", "layer"])
def test_torchscript_models_train_over_several_calls(scripted, n_jobs):
    # A TorchScript module's parameter and submodule dicts are views of C++ state, not dicts:
    # the second call on the same models raised TypeError from the kept plan's check. Such
    # models are planned on every call, and train as the plain loop trains them.
    def make(width):
        if scripted == "model":
            return torch.jit.script(mlp([width]))
        return nn.Sequential(
            torch.jit.script(nn.Linear(IN, width)), nn.Tanh(), nn.Linear(width, OUT)
        )

    torch.manual_seed(0)
    models = [make(w) for w in (4, 5, 6)]
    torch.manual_seed(0)
    ref = [make(w) for w in (4, 5, 6)]
    x = torch.randn(3, IN)
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    opt_ref = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        opt_ref.zero_grad()
        got = parsum.sum_models(models, x, n_jobs=n_jobs)
        want = plain_sum(ref, x)
        torch.testing.assert_close(got, want)
        got.square().sum().backward()
        want.square().sum().backward()
        for g, w in zip(param_grads(models), param_grads(ref)):
            torch.testing.assert_close(g, w)
        opt.step()
        opt_ref.step()
    assert known_walk(models) is None


def count_calls(monkeypatch, owner, name: str) -> list[int]:
    """How many times ``owner.name`` is called from here on (one element per call)."""
    calls: list[int] = []
    original = getattr(owner, name)

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls


STACKED_CHANGES = {
    "setting": lambda ms: setattr(ms[1][1], "negative_slope", 0.3),
    "submodule": lambda ms: ms[1].__setitem__(1, nn.ReLU()),
    "new attribute": lambda ms: setattr(ms[1][1], "inplace", True),
}


@pytest.mark.parametrize("change", list(STACKED_CHANGES))
def test_stacked_units_are_reused_until_a_setting_changes(change, monkeypatch):
    models = [mlp([4], nn.LeakyReLU) for _ in range(3)]
    x = torch.randn(2, IN)
    planned = count_calls(monkeypatch, parsum._api, "plan_units")
    for _ in range(3):
        parsum.sum_models(models, x, engine="stacked", n_jobs=1)
    assert len(planned) == 1
    ref = copy.deepcopy(models)
    for ms in (models, ref):
        STACKED_CHANGES[change](ms)  # model 1 no longer stacks with the others
    assert known_walk(models) is None
    y = parsum.sum_models(models, x, engine="stacked", n_jobs=1)
    torch.testing.assert_close(y, plain_sum(ref, x))


class HooksItsActivations(nn.Module):
    """Registers a tensor hook on every call: a hook handle is made on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(IN, OUT)
        self.seen: list[int] = []  # the same object throughout: a plan checks attributes

    def count(self, grad: torch.Tensor) -> None:
        self.seen.append(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h.register_hook(self.count)
        return h


def test_a_hook_registered_elsewhere_keeps_the_plan_one_on_a_model_does_not(monkeypatch):
    models = [HooksItsActivations(), mlp([4])]
    x = torch.randn(3, IN)
    planned = count_calls(monkeypatch, parsum._api, "plan_units")
    for _ in range(3):
        parsum.sum_models(models, x).sum().backward()
    assert len(planned) == 1 and len(models[0].seen) == 3
    models[1].register_forward_hook(lambda m, i, out: 2 * out)
    assert known_walk(models) is None
    ref = copy.deepcopy(models)
    torch.testing.assert_close(parsum.sum_models(models, x), plain_sum(ref, x))


def test_a_group_vmap_cannot_run_is_planned_again(monkeypatch):
    torch.manual_seed(0)
    models = [Branchy() for _ in range(parsum._grouping.AUTO_STACK_MIN_MODELS)]
    x = torch.randn(2, IN)
    tried = count_calls(monkeypatch, parsum._engines, "forward_on_copies")
    ref = copy.deepcopy(models)
    for _ in range(3):
        torch.testing.assert_close(parsum.sum_models(models, x), plain_sum(ref, x))
    # The first call tried the batched forward twice, as one group in the caller's graph and
    # then the general way (which runs them one by one and marks the group); then none
    assert len(tried) == 2


# NOTE [ Models planned one by one ] in _plans: a set of models not seen together before is
# planned from the models' own walks where they all hold.


def fresh_set(models: list[nn.Module]) -> list[nn.Module]:
    """The same models in another order: a set no walk is kept for."""
    return models[::-1]


def walk_one_by_one(models: list[nn.Module], x: torch.Tensor, n_jobs: int | None = None) -> None:
    """Give the models walks of their own: a set of models a kept walk holds is walked one by
    one (the models in a second order; ``fresh_set`` is a third)."""
    for members in (models, models[1:] + models[:1]):
        parsum.sum_models(members, x, n_jobs=n_jobs).pow(2).mean().backward()
    assert all(id(m) in _plans._model_walks for m in models)


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_new_set_of_known_models_notices_a_change(change, n_jobs):
    models = models_under_test()
    x = torch.randn(5, IN)
    walk_one_by_one(models, x, n_jobs)
    assert known_walk(fresh_set(models)) is None
    assert _plans.models_found(fresh_set(models))[1] is not None  # would be joined
    ref = changed_alike(models, CHANGES[change])
    for m in [*models, *ref]:
        m.zero_grad(set_to_none=True)
    assert _plans.models_found(fresh_set(models))[1] is None
    y = parsum.sum_models(fresh_set(models), x, n_jobs=n_jobs)
    y.pow(2).mean().backward()
    y_ref = plain_sum(fresh_set(ref), x)
    y_ref.pow(2).mean().backward()
    torch.testing.assert_close(y, y_ref)
    assert_changed_grads_match(models, ref, change)


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("kind", ["tensor hook", "post-accumulate hook"])
def test_a_new_set_of_known_models_runs_a_hook_registered_since(kind, n_jobs):
    # A set joined from its models' walks reads whether their parameters have hooks from the
    # last set that looked, at the same hook count: a hook registered since must be seen.
    models = models_under_test()
    ref = clone_models(models)
    x = torch.randn(5, IN)
    walk_one_by_one(models, x, n_jobs)
    for m in models:
        m.zero_grad(set_to_none=True)
    for members in (fresh_set(models)[1:], fresh_set(models)):  # joined; parameters looked at
        parsum.sum_models(members, x, n_jobs=n_jobs).pow(2).mean().backward()
        plain_sum([ref[models.index(m)] for m in members], x).pow(2).mean().backward()
    seen: dict[str, list[torch.Tensor]] = {"parsum": [], "plain": []}
    for name, ms in (("parsum", models), ("plain", ref)):
        p = next(ms[2].parameters())
        if kind == "tensor hook":
            p.register_hook(lambda g, name=name: seen[name].append(g.clone()))
        else:
            p.register_post_accumulate_grad_hook(
                lambda t, name=name: seen[name].append(t.grad.clone())
            )
    others = [models[k] for k in (5, 2, 0, 3)]  # a set not seen before; .grad set: captured
    assert known_walk(others) is None and _plans.models_found(others)[1] is not None
    parsum.sum_models(others, x, n_jobs=n_jobs).pow(2).mean().backward()
    plain_sum([ref[k] for k in (5, 2, 0, 3)], x).pow(2).mean().backward()
    assert len(seen["parsum"]) == len(seen["plain"]) == 1
    torch.testing.assert_close(seen["parsum"][0], seen["plain"][0])
    torch.testing.assert_close(param_grads(models), param_grads(ref))


def test_a_record_joined_from_models_is_the_walk_over_their_modules():
    models = models_under_test()
    walk_one_by_one(models, torch.randn(3, IN))
    others = fresh_set(models)
    found, joined = _plans.models_found(others)
    assert joined is not None
    walked = [parsum._engines.ModelParams.of(m) for m in others]
    assert [mp.names for mp in found] == [mp.names for mp in walked]
    assert all(
        list(map(id, a.tensors)) == list(map(id, b.tensors))
        and list(map(id, a.modules)) == list(map(id, b.modules))
        for a, b in zip(found, walked)
    )
    direct = _plans.Walk([], [], [], [], False)
    assert direct._record([m for mp in walked for m in mp.modules])
    for name in _plans._CONCATENATED:
        ours, theirs = getattr(joined, name), getattr(direct, name)
        if name == "_module_refs":
            ours, theirs = [r() for r in ours], [r() for r in theirs]
        assert list(map(id, ours)) == list(map(id, theirs)) or ours == theirs, name
    custom = [(k, key, held.get()) for k, key, held in joined._custom.attributes]
    expected = [(k, key, held.get()) for k, key, held in direct._custom.attributes]
    assert joined._custom.at == direct._custom.at and joined._custom.sizes == direct._custom.sizes
    assert len(custom) == len(expected) and all(
        a[:2] == b[:2] and a[2] is b[2] for a, b in zip(custom, expected)
    )
    programs = [parsum._engines.direct_program(m, mp) for m, mp in zip(others, walked)]
    assert [p is None for p in joined.programs] == [p is None for p in programs]
    assert any(p is not None for p in programs)  # the Sequentials run as their layers
    assert joined.model_modes == [tuple(m.training for m in mp.modules) for mp in walked]


@pytest.mark.parametrize("kind", ["a module in two models", "a model twice"])
def test_models_sharing_modules_are_walked_as_a_set(kind):
    torch.manual_seed(0)
    shared = nn.Linear(IN, 8)
    models = [nn.Sequential(shared, nn.Tanh(), nn.Linear(8, OUT)) for _ in range(3)]
    if kind == "a model twice":
        models = [mlp([8]), mlp([6])]
        models = [models[0], models[1], models[0]]
    x = torch.randn(4, IN)
    for model in models:  # each model's own walk exists
        walk_one_by_one([model, mlp([5])], x)
    ref = clone_models(models)  # shares as the models do
    for ms in (models, ref):
        for m in ms:
            m.zero_grad(set_to_none=True)
    assert _plans.models_found(models)[1] is None
    y = parsum.sum_models(models, x, n_jobs=2)
    y.pow(2).sum().backward()
    y_ref = plain_sum(ref, x)
    y_ref.pow(2).sum().backward()
    torch.testing.assert_close(y, y_ref)
    for a, b in zip(param_grads(models), param_grads(ref)):
        torch.testing.assert_close(a, b)


def test_models_own_walks_keep_no_model_alive():
    models = [mlp([8]) for _ in range(3)]
    walk_one_by_one(models, torch.randn(3, IN))
    keys = list(map(id, models))
    refs = [weakref.ref(m) for m in models]
    weights = weakref.ref(next(models[0].parameters()))
    del models
    gc.collect()
    assert all(r() is None for r in refs) and weights() is None
    assert all(k not in _plans._model_walks for k in keys)


def test_at_most_max_model_walks_are_kept(monkeypatch):
    monkeypatch.setattr(_plans, "MAX_MODEL_WALKS", 5)
    models = [mlp([4]) for _ in range(8)]
    for start in range(0, 8, 2):
        walk_one_by_one(models[start : start + 2], torch.randn(2, IN))
        assert len(_plans._model_walks) <= 5


def test_models_new_on_every_call_get_no_walks_of_their_own():
    x = torch.randn(3, IN)
    for _ in range(3):
        models = [mlp([6]) for _ in range(4)]  # copies made each step, say
        parsum.sum_models(models, x).sum().backward()
        assert all(id(m) not in _plans._model_walks for m in models)


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_members_drawn_each_step_train_as_the_plain_loop(n_jobs):
    """Every call a new set, mostly planned from the models' own walks: the same training as
    the plain loop's, step after step."""
    models = [*zoo(seed=4), Scaled()]
    ref = clone_models(models)
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.05)
    opt_ref = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.05)
    generator = torch.Generator().manual_seed(0)
    joined = 0
    for _ in range(12):
        picked = torch.randperm(len(models), generator=generator)[:5].sort().values.tolist()
        x = torch.randn(6, IN, generator=generator)
        joined += _plans.models_found([models[i] for i in picked])[1] is not None
        for ms, o in ((models, opt), (ref, opt_ref)):
            o.zero_grad(set_to_none=True)
            members = [ms[i] for i in picked]
            y = (
                parsum.sum_models(members, x, n_jobs=n_jobs)
                if ms is models
                else plain_sum(members, x)
            )
            y.pow(2).mean().backward()
            o.step()
    assert joined > 0
    for a, b in zip(models, ref):
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("identical", [False, True])
@pytest.mark.parametrize("n_jobs", [1, 2])
def test_threads_drawing_sets_of_shared_models_get_the_bits_of_one_thread(n_jobs, identical):
    """Four threads each summing new random sets of the same models (their walks made, joined
    and replaced concurrently; identical ones stacked, their keys kept by their walks): every
    result has the bits one thread computes."""
    torch.manual_seed(3)
    models = [mlp([4 if identical else 4 + i % 5]) for i in range(12)]
    x = torch.randn(5, IN, requires_grad=True)
    generator = torch.Generator().manual_seed(1)
    draws = [torch.randperm(12, generator=generator)[:7].tolist() for _ in range(48)]

    def result(draw):
        y = parsum.sum_models([models[i] for i in draw], x, n_jobs=n_jobs)
        (g,) = torch.autograd.grad(y.pow(2).sum(), x)  # no .grad written: threads share models
        return y.detach(), g

    expected = [result(draw) for draw in draws]
    _plans._model_walks.clear()
    _plans._plans.clear()
    got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    errors = []

    def work(first):
        try:
            for k in range(first, len(draws), 4):
                got[k] = result(draws[k])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    assert not any(t.is_alive() for t in threads) and not errors
    assert len(got) == len(draws)
    for k, (y, g) in enumerate(expected):
        assert torch.equal(got[k][0], y) and torch.equal(got[k][1], g)


# NOTE [ Structure keys kept by models' own walks ] in _plans: a set joined from its models' own
# walks groups them from the keys those walks keep, which watch the models' settings.


def stacked_models(n: int = 6) -> list[nn.Module]:
    torch.manual_seed(5)
    return [mlp([4], nn.LeakyReLU) for _ in range(n)]


def stacked_sum(models: list[nn.Module], x: torch.Tensor, n_jobs: int) -> torch.Tensor:
    return parsum.sum_models(models, x, engine="stacked", n_jobs=n_jobs)


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("change", list(STACKED_CHANGES))
def test_a_setting_changed_between_draws_splits_a_stacked_group(change, n_jobs):
    models = stacked_models()
    x = torch.randn(3, IN)
    walk_one_by_one(models, x, n_jobs)
    stacked_sum(fresh_set(models), x, n_jobs)  # joined: each model's key kept by its walk
    assert all(_plans._model_walks[id(m)].structure is not _plans._UNASKED for m in models)
    ref = changed_alike(models, STACKED_CHANGES[change])  # model 1 no longer stacks with the others
    other = models[2:] + models[:2]  # a set not seen yet
    assert _plans.models_found(other)[1] is None  # model 1's walk watched its settings
    y = stacked_sum(other, x, n_jobs)
    torch.testing.assert_close(y, plain_sum(ref[2:] + ref[:2], x))


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_a_set_joined_before_its_keys_were_kept_watches_its_settings_itself(n_jobs):
    """The first set joined from new walks asks their keys while it plans: its record, joined
    before, does not hold the settings those walks then watch, so its plan watches them."""
    models = stacked_models()
    x = torch.randn(3, IN)
    stacked_sum(models, x, n_jobs)  # a kept walk: the next set of these models is walked
    members = fresh_set(models)  # one by one, and joined
    stacked_sum(members, x, n_jobs)
    assert all(id(m) in _plans._model_walks for m in models)
    assert known_walk(members).parts and not any(known_walk(members).settings_watched)
    ref = changed_alike(models, STACKED_CHANGES["setting"])
    assert known_walk(members) is None
    torch.testing.assert_close(stacked_sum(members, x, n_jobs), plain_sum(fresh_set(ref), x))


def test_later_draws_ask_no_structure_key_and_watch_nothing_new(monkeypatch):
    models = stacked_models(8)
    x = torch.randn(3, IN)
    walk_one_by_one(models, x)
    stacked_sum(fresh_set(models), x, 1)  # every key asked once, its settings watched
    asked = count_calls(monkeypatch, _plans, "structure_key")
    grouped = count_calls(monkeypatch, parsum._grouping, "structure_key")
    watched = count_calls(monkeypatch, _plans.Walk, "_watch_settings")
    generator = torch.Generator().manual_seed(2)
    for _ in range(4):
        picked = torch.randperm(len(models), generator=generator)[:6].tolist()
        members = [models[i] for i in picked]
        assert known_walk(members) is None
        y = stacked_sum(members, x, 1)
        torch.testing.assert_close(y, plain_sum(members, x))
        (derived,) = known_walk(members).derived.values()
        assert [len(unit.models) for unit in derived.units] == [6]
    assert not asked and not grouped and not watched


def test_models_drawn_with_a_shared_buffer_run_their_forwards_in_order():
    """The buffers and generators each model's findings keep: two models sharing BatchNorm
    statistics, drawn in new sets, run in model order, updating them as the plain loop does."""
    torch.manual_seed(6)
    models = [
        nn.Sequential(nn.Linear(IN, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, OUT))
        for _ in range(6)
    ]
    ref = clone_models(models)
    for ms in (models, ref):
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            setattr(ms[3][1], name, getattr(ms[0][1], name))
    x = torch.randn(8, IN)
    walk_one_by_one(models, x, 2)
    for ms in (models, ref):  # the calls above updated the statistics: start again alike
        for m in ms:
            m[1].reset_running_stats()
    generator = torch.Generator().manual_seed(3)
    for _ in range(5):
        rest = [i for i in torch.randperm(6, generator=generator).tolist() if i not in (0, 3)]
        picked = [0, *rest[:2], 3]
        members = [models[i] for i in picked]
        joined = _plans.models_found(members)[1] is not None
        parsum.sum_models(members, x, n_jobs=2).pow(2).mean().backward()
        plain_sum([ref[i] for i in picked], x).pow(2).mean().backward()
        assert joined and known_walk(members).forward_in_order
    for a, b in zip(models, ref):
        torch.testing.assert_close(a[1].running_mean, b[1].running_mean)
        torch.testing.assert_close(a[1].running_var, b[1].running_var)


@pytest.mark.parametrize("n_jobs", [1, 2, None])
def test_a_module_without_parameters_shared_by_every_model_trains_as_in_the_plain_loop(n_jobs):
    """One BatchNorm1d(affine=False), its statistics the only state, inside 8 models: their
    forwards write it in model order, as the plain loop's, over 20 steps of SGD."""
    torch.manual_seed(8)
    norm = nn.BatchNorm1d(5, affine=False)
    models = [nn.Sequential(nn.Linear(IN, 5), norm, nn.Tanh(), nn.Linear(5, OUT)) for _ in range(8)]
    ref = clone_models(models)  # one deep copy: its models share one copy of the norm
    assert ref[0][1] is ref[7][1]
    optimizers = [torch.optim.SGD(unique(ms), lr=0.01) for ms in (models, ref)]
    generator = torch.Generator().manual_seed(4)
    for _ in range(20):
        x = torch.randn(6, IN, generator=generator)
        for opt in optimizers:
            opt.zero_grad()
        parsum.sum_models(models, x, n_jobs=n_jobs).pow(2).mean().backward()
        plain_sum(ref, x).pow(2).mean().backward()
        for opt in optimizers:
            opt.step()
    assert int(norm.num_batches_tracked) == int(ref[0][1].num_batches_tracked) == 160
    torch.testing.assert_close(norm.running_mean, ref[0][1].running_mean)
    torch.testing.assert_close(norm.running_var, ref[0][1].running_var)
    for got, want in zip(unique(models), unique(ref), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def unique(models: list[nn.Module]) -> list[torch.Tensor]:
    return list(dict.fromkeys(p for m in models for p in m.parameters()))


# NOTE [ Shared state of models planned one by one ] in _plans: a set joined from its models'
# own walks finds what they share from what each walk keeps.


class Logs(nn.Module):
    """A model of the user's own class holding a log, which other models may share."""

    def __init__(self, width: int, log: list) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(IN, width), nn.Linear(width, OUT)
        self.log = log

    def forward(self, x):
        return self.out(torch.tanh(self.lin(x)))


def test_a_set_joined_from_own_walks_finds_what_a_walk_finds_its_models_share():
    torch.manual_seed(7)
    logs = [[] for _ in range(3)]
    owners = [0, 1, 2, 0, 2, 0, 1, 2]  # the log each model holds
    models = [Logs(4 + i, logs[owner]) for i, owner in enumerate(owners)]
    features: list = []
    for m in models[1::3]:  # a hook whose closure reaches a list, shared by these models
        m.out.register_forward_hook(lambda mod, args, out: features.append(out.shape))
    x = torch.randn(3, IN)
    walk_one_by_one(models, x, 1)
    generator = torch.Generator().manual_seed(5)
    found_shared = 0
    for _ in range(10):
        picked = torch.randperm(len(models), generator=generator)[:5].tolist()
        members = [models[i] for i in picked]
        assert known_walk(members) is None and _plans.models_found(members)[1] is not None
        parsum.sum_models(members, x, n_jobs=1).sum().backward()
        walk = known_walk(members)
        assert walk is not None and walk.parts  # joined, and kept
        fresh = parsum._engines.shared_state([parsum._engines.ModelParams.of(m) for m in members])
        expected = [m if key is None else vars(m)[key] for m, key in fresh.named] + fresh.reached
        assert list(map(id, walk.shared_objects())) == list(map(id, expected))
        found_shared += bool(expected)
    assert found_shared > 0


FOREIGN: dict[str, torch.Tensor] = {}  # tensors a forward reads from a global


class Reads(nn.Module):
    """A model of the user's own class; with ``foreign``, its forward reads a global tensor
    under that name, which it does not own (NOTE [ Tensors a module does not own ] in
    _engines)."""

    def __init__(self, width: int, foreign: str | None = None) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(IN, width), nn.Linear(width, OUT)
        self.foreign = foreign

    def forward(self, x):
        y = self.out(torch.tanh(self.lin(x)))
        return y if self.foreign is None else y * FOREIGN[self.foreign]


def test_sets_of_models_looked_through_before_are_not_looked_through_again(monkeypatch):
    torch.manual_seed(8)
    models = [Reads(4 + i) for i in range(6)]
    x = torch.randn(3, IN)
    walk_one_by_one(models, x, 1)
    looked = count_calls(monkeypatch, parsum._function, "check_own_leaves")
    generator = torch.Generator().manual_seed(6)
    for _ in range(4):
        members = [models[i] for i in torch.randperm(6, generator=generator)[:4].tolist()]
        assert _plans.models_found(members)[1] is not None
        parsum.sum_models(members, x, n_jobs=1).sum().backward()
    assert not looked
    # With a new model: its set gets new walks, one a model, which have not looked yet, so the
    # set looks through every model once (the others quickly: NOTE [ Tensors a module does
    # not own ]), and other sets of them not again.
    with_new = [*models[:3], Reads(5)]
    for members in (with_new, with_new[::-1], with_new[1:] + with_new[:1]):
        parsum.sum_models(members, x, n_jobs=1).sum().backward()
    assert len(looked) == len(with_new)
    FOREIGN["scale"] = torch.ones(OUT, requires_grad=True)
    bad = Reads(6, "scale")
    for members in ([*models[:3], bad], [models[4], bad, models[5]]):
        with pytest.raises(parsum.ParsumError, match=r"model \d \(Reads\).* not its parameters"):
            parsum.sum_models(members, x, n_jobs=1)


def test_a_models_findings_keep_a_bounded_number_of_estimates():
    """New sets of the same models, planned from the findings their own walks keep, at a new
    batch shape every call (sequences of varying lengths, say): each model's findings keep at
    most MAX_ESTIMATES estimates."""
    models = [mlp([4 + i % 2]) for i in range(6)]
    walk_one_by_one(models, torch.randn(2, IN))
    generator = torch.Generator().manual_seed(4)
    for rows in range(1, 3 * parsum._grouping.MAX_ESTIMATES):
        members = [models[i] for i in torch.randperm(6, generator=generator).tolist()]
        parsum.sum_models(members, torch.randn(rows, IN)).sum().backward()
    found = [_plans._model_walks[id(m)].model_params[0].estimated for m in models]
    assert 0 < max(map(len, found)) <= parsum._grouping.MAX_ESTIMATES


class Leaky(nn.Module):
    """A model of the user's own class: auto stacks at least AUTO_STACK_MIN_MODELS of them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(IN, OUT)
        self.act = nn.LeakyReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))


def test_a_kept_set_plans_again_from_keys_found_now():
    """A set planned from its models' own walks keys them, but stacks fewer than auto needs
    and so watches none of their settings: planned again later (another engine), it keys them
    anew, not from their walks, whose watch of the settings its own check does not read."""
    torch.manual_seed(7)
    models = [Leaky() for _ in range(5)]
    x = torch.randn(4, IN)
    parsum.sum_models(models, x)  # a kept walk: the next set of these models is joined
    members = fresh_set(models)
    parsum.sum_models(members, x)
    walk = known_walk(members)
    assert walk.parts and all(part.structure is not _plans._UNASKED for part in walk.parts)
    assert all(len(unit.models) == 1 for d in walk.derived.values() for unit in d.units)
    ref = clone_models(models)
    for ms in (models, ref):
        ms[1].act.negative_slope = 0.3
    assert known_walk(members) is walk  # its check does not read model 1's settings
    y = parsum.sum_models(members, x, engine="stacked")
    torch.testing.assert_close(y, plain_sum(fresh_set(ref), x))


def test_ensembles_built_and_dropped_in_turn_are_planned_as_themselves():
    """Each round builds new models, often at the ids of the last round's, dropped (5 to 40
    rounds of 40 reused one here, with other tests run before or not): a plan kept for the
    dropped ones must never serve them (widths, depths and activations differ)."""
    generator = torch.Generator().manual_seed(11)
    acts = (nn.Tanh, nn.ReLU, nn.Sigmoid)
    x = torch.randn(4, IN)
    for round_ in range(40):
        draw = torch.randint(1, 9, (4, 3), generator=generator).tolist()
        models = [mlp([w for w in row[: 1 + row[0] % 3]], acts[row[1] % 3]) for row in draw]
        ref = clone_models(models)
        y = parsum.sum_models(models, x, n_jobs=1 + round_ % 2)
        y_ref = plain_sum(ref, x)
        torch.testing.assert_close(y, y_ref)
        y.pow(2).sum().backward()
        y_ref.pow(2).sum().backward()
        for got, want in zip(param_grads(models), param_grads(ref), strict=True):
            torch.testing.assert_close(got, want)
        del models, ref, y, y_ref
