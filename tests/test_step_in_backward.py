"""StepInBackward: per-model steps fused into the parallel backward equal plain training."""

import copy
import io
import threading
import warnings

import pytest
import torch
from torch import nn

import parsum
from tests.test_callers_graph import _ARMED, _FlakyHead, _FlakyInside
from tests.zoo import IN, OUT, TwoHeads, clone_models, mlp, plain_sum, zoo

pytestmark = pytest.mark.timeout(60)


def trainable(models):
    return [p for m in models for p in m.parameters() if p.requires_grad]


def snapshot(models):
    """Every model's parameters, copied."""
    return [[p.detach().clone() for p in m.parameters()] for m in models]


def changed(models, before):
    """Whether each model's parameters differ from ``before`` (a ``snapshot``)."""
    return [
        not all(torch.equal(p, b) for p, b in zip(m.parameters(), saved))
        for m, saved in zip(models, before)
    ]


def train_plain(models, batches, cls, kw, schedule=None):
    opt = cls(trainable(models), **kw)
    sched = schedule(opt) if schedule else None
    for x in batches:
        plain_sum(models, x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()


def train_fused(models, batches, cls, kw, schedule=None, **sum_kw):
    sib = parsum.StepInBackward(models, cls, **kw)
    scheds = [schedule(o) for o in sib.optimizers] if schedule else []
    for x in batches:
        parsum.sum_models(models, x, step_in_backward=sib, **sum_kw).pow(2).mean().backward()
        assert all(p.grad is None for p in trainable(models))
        for s in scheds:
            s.step()
    return sib


OPTIMIZERS = [
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, foreach=True)),
    (torch.optim.Adam, dict(lr=1e-2)),
    (torch.optim.Adam, dict(lr=1e-2, foreach=True)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, fused=True)),
]


@pytest.mark.parametrize(("cls", "kw"), OPTIMIZERS, ids=lambda v: getattr(v, "__name__", ""))
@pytest.mark.parametrize("engine", ["autograd", "vjp"])
def test_equals_plain_training(cls, kw, engine):
    models = zoo(torch.float64)
    ref = clone_models(models)
    batches = [torch.randn(6, IN, dtype=torch.float64) for _ in range(4)]
    train_fused(models, batches, cls, kw, engine=engine)
    train_plain(ref, batches, cls, kw)
    for p, r in zip(trainable(models), trainable(ref)):
        torch.testing.assert_close(p, r, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk_size", [None, 3])  # 3: small models step as one
def test_bitwise_for_any_n_jobs(chunk_size):
    batches = [torch.randn(6, IN) for _ in range(3)]
    finals = []
    for n_jobs in (1, 2, 3):
        models = zoo(seed=3)
        kw = dict(lr=1e-2)
        train_fused(models, batches, torch.optim.Adam, kw, n_jobs=n_jobs, chunk_size=chunk_size)
        finals.append([p.detach().clone() for p in trainable(models)])
    for other in finals[1:]:
        assert all(torch.equal(a, b) for a, b in zip(finals[0], other))


def chunks_planned(models, stepping):
    """The chunks of the models' plans for calls with (or without) steps in the backward."""
    walk = parsum._api.known_walk(models)
    return [d.chunks for key, d in walk.derived.items() if key[6] == stepping]


def test_steps_in_the_backward_keep_two_chunks_a_thread(cores, monkeypatch):
    # NOTE [ Chunks of models that step ] in parsum._grouping: each chunk costs an engine call
    # and a step, so a budget of 2 keeps 4 of about equal cost, whatever n_jobs; none holds
    # more than MERGED_STEP_ELEMENTS trainable elements unless one model does.
    cores(2)
    models = [mlp([4 + 2 * i]) for i in range(12)]
    x = torch.randn(3, IN)
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
    for n_jobs in (1, 2):
        parsum.sum_models(models, x, step_in_backward=sib, n_jobs=n_jobs).sum().backward()
    parsum.sum_models(models, x, n_jobs=2).sum().backward()
    (stepping,) = chunks_planned(models, True)
    assert len(stepping) == 4
    assert [k for chunk in stepping for k in chunk] == list(range(12))
    # Without steps, the budget's own (NOTE [ Chunks a thread ]): 2 a thread for these
    assert len(chunks_planned(models, False)[0]) == 4
    elements = [sum(p.numel() for p in m.parameters()) for m in models]  # 59 to 169
    monkeypatch.setattr(parsum._grouping, "MERGED_STEP_ELEMENTS", 200)
    bounded = [mlp([4 + 2 * i]) for i in range(12)]
    sib = parsum.StepInBackward(bounded, torch.optim.SGD, lr=0.1)
    parsum.sum_models(bounded, x, step_in_backward=sib, n_jobs=2).sum().backward()
    (chunks,) = chunks_planned(bounded, True)
    assert [k for chunk in chunks for k in chunk] == list(range(12))
    assert all(sum(elements[k] for k in chunk) <= 200 for chunk in chunks if len(chunk) > 1)
    assert len(chunks) > 4
    # Cut into as many chunks as without steps, or more: the chunks without steps.
    monkeypatch.setattr(parsum._grouping, "MERGED_STEP_ELEMENTS", 50)
    single = [mlp([4 + 2 * i]) for i in range(12)]
    sib = parsum.StepInBackward(single, torch.optim.SGD, lr=0.1)
    parsum.sum_models(single, x, step_in_backward=sib, n_jobs=2).sum().backward()
    assert chunks_planned(single, True) == [[range(k, k + 1) for k in range(12)]]


def test_lr_schedulers_per_optimizer():
    models = [mlp([8]).double(), mlp([4, 4]).double()]
    ref = clone_models(models)
    batches = [torch.randn(5, IN, dtype=torch.float64) for _ in range(5)]

    def schedule(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)

    sib = train_fused(models, batches, torch.optim.SGD, dict(lr=0.1), schedule)
    train_plain(ref, batches, torch.optim.SGD, dict(lr=0.1), schedule)
    assert sib.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.1**2)
    for p, r in zip(trainable(models), trainable(ref)):
        torch.testing.assert_close(p, r)


def test_input_gradients_and_weights_still_flow():
    models = [mlp([8]).double(), mlp([4]).double()]
    ref = clone_models(models)
    x = torch.randn(4, IN, dtype=torch.float64, requires_grad=True)
    w = torch.tensor([0.3, 0.7], dtype=torch.float64, requires_grad=True)
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
    parsum.sum_models(models, x, weights=w, step_in_backward=sib).pow(2).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    w_ref = w.detach().clone().requires_grad_()
    plain_sum(ref, x_ref, weights=w_ref).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(w.grad, w_ref.grad)


def test_gradients_of_the_whole_set_are_never_stored_at_once():
    models = [mlp([16, 16]) for _ in range(6)]
    seen_live = []

    class Watching(torch.optim.SGD):
        def step(self, closure=None):
            seen_live.append(sum(p.grad is not None for p in trainable(models)))
            return super().step(closure)

    sib = parsum.StepInBackward(models, Watching, lr=0.1)
    x = torch.randn(4, IN)
    parsum.sum_models(models, x, step_in_backward=sib, n_jobs=1).sum().backward()
    per_model = len(list(models[0].parameters()))
    assert seen_live == [per_model] * len(models)


def batched_calls(monkeypatch):
    """The units offered to a shared engine call (``_pull_back_batched``), call by call."""
    calls = []
    batched = parsum._function._pull_back_batched

    def spy(plan, units, *args, **kwargs):
        calls.append(list(units))
        return batched(plan, units, *args, **kwargs)

    monkeypatch.setattr(parsum._function, "_pull_back_batched", spy)
    return calls


def test_one_thread_pulls_back_chunk_by_chunk(monkeypatch):
    # At one thread the pullbacks of every chunk run in one engine call, except where each
    # chunk's gradients go somewhere as it ends (optimizer steps, FlatGrad slots): that call
    # held every model's gradients at once (32 models with 128 MiB of gradients: a peak of 140
    # MiB with StepInBackward at n_jobs=1, 20 chunk by chunk; benchmarks/bench_memory.py).
    calls = batched_calls(monkeypatch)
    models = [mlp([8]), mlp([4]), mlp([6])]
    x = torch.randn(3, IN)
    # ParallelSum, as with step_in_backward
    with monkeypatch.context() as patched:
        patched.setattr(parsum._api, "fits_callers_graph", lambda *a: False)
        four = [*(mlp([w]) for w in (8, 4, 6)), mlp([5])]
        parsum.sum_models(four, x, n_jobs=1, engine="autograd").sum().backward()
    assert calls == [[0, 1, 2, 3]]
    calls.clear()
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
    parsum.sum_models(models, x, step_in_backward=sib, n_jobs=1, chunk_size=1).sum().backward()
    assert calls == [[0], [1], [2]]
    calls.clear()  # the same for the slots of a compensated FlatGrad (405 -> 285 MiB there)
    others = [mlp([8]), mlp([4]), mlp([6])]
    parsum.FlatGrad(others, compensated=True)
    monkeypatch.setattr(parsum._api, "fits_callers_graph", lambda *a: False)
    parsum.sum_models(others, x, n_jobs=1, chunk_size=1).sum().backward()
    assert calls == [[0], [1], [2]]


def test_autograd_grad_does_not_step():
    models = [mlp([8]), mlp([4])]
    before = [p.detach().clone() for p in trainable(models)]
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
    y = parsum.sum_models(models, torch.randn(3, IN), step_in_backward=sib).sum()
    grads = torch.autograd.grad(y, trainable(models))
    assert all(g is not None for g in grads)
    assert all(torch.equal(p, b) for p, b in zip(trainable(models), before))


def test_a_parameter_with_a_hook_is_refused_up_front():
    model = mlp([8])
    model[0].weight.register_hook(lambda g: g * 0)
    sib = parsum.StepInBackward([model], torch.optim.SGD, lr=0.1)
    with pytest.raises(
        parsum.ParsumError,
        match=r"parameter '0.weight' of models\[0\] "
        r"\(Sequential\) has a gradient hook",
    ):
        parsum.sum_models([model], torch.randn(3, IN), step_in_backward=sib)


def test_state_dict_round_trip():
    models = [mlp([8]), mlp([4])]
    sib = parsum.StepInBackward(models, torch.optim.Adam, lr=1e-2)
    parsum.sum_models(models, torch.randn(3, IN), step_in_backward=sib).sum().backward()
    state = sib.state_dict()
    other = parsum.StepInBackward(models, torch.optim.Adam, lr=1e-2)
    other.load_state_dict(state)
    assert other.optimizers[1].state_dict()["state"][0]["step"] == 1
    with pytest.raises(parsum.ParsumError, match="state_dict"):
        other.load_state_dict({"optimizers": []})


class FailsInBackward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(IN, OUT)

    def forward(self, x):
        out = self.lin(x)
        out.register_hook(self._boom)
        return out

    def _boom(self, grad):
        raise ValueError("boom")


def test_failed_pullback_names_the_models_already_stepped():
    models = [mlp([8]), mlp([4]), FailsInBackward(), mlp([6])]
    before = snapshot(models)
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
    y = parsum.sum_models(models, torch.randn(3, IN), step_in_backward=sib, n_jobs=1, chunk_size=1)
    with pytest.raises(parsum.ParsumError) as info:
        y.sum().backward()
    message = str(info.value)
    assert "model 2 (FailsInBackward) raised ValueError in backward: boom" in message
    assert "already ran for models [0, 1]" in message
    assert isinstance(info.value.__cause__, ValueError)
    assert changed(models, before) == [True, True, False, False]
    assert all(p.grad is None for p in trainable(models))


def test_steps_in_the_backward_claim_the_costliest_chunks_first(monkeypatch):
    # NOTE [ Steps after a failure ]: the backward's chunks are claimed as the forward's.
    orders = []
    run_ordered = parsum._pool.run_ordered

    def spy(task, n_tasks, n_workers, consume, order=None, *rest):
        orders.append(order)
        run_ordered(task, n_tasks, n_workers, consume, order, *rest)

    monkeypatch.setattr(parsum._pool, "run_ordered", spy)
    models = [mlp([4]), mlp([64]), mlp([16])]
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
    y = parsum.sum_models(models, torch.randn(3, IN), step_in_backward=sib, n_jobs=2, chunk_size=1)
    y.sum().backward()
    assert orders == [(1, 2, 0), (1, 2, 0)]


# Not held by the models, which would then share state (their pullbacks would run in order on
# one thread: NOTE [ Pullbacks that write shared state ] in parsum._function).
PULLBACKS_GO = threading.Event()


class WaitsInBackward(nn.Module):
    """A model whose pullback waits for PULLBACKS_GO (at most 10 s)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(IN, OUT)

    def forward(self, x):
        out = self.lin(x)
        out.register_hook(lambda grad: (PULLBACKS_GO.wait(10), grad)[1])
        return out


class WideFailsInBackward(FailsInBackward):
    """The costliest chunk, whose pullback fails; PULLBACKS_GO set 50 ms later."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Sequential(nn.Linear(IN, 256), nn.Tanh(), nn.Linear(256, OUT))

    def _boom(self, grad):
        threading.Timer(0.05, PULLBACKS_GO.set).start()
        raise ValueError("boom")


def test_chunks_that_finish_or_start_after_a_failure_step_nothing(cores):
    # NOTE [ Steps after a failure ]: the failing chunk is claimed first; the other thread's
    # chunk ends after the failure, and the chunk before the failing one starts after it (to
    # find the failure a run on one thread meets first): neither steps its model.
    cores(2)
    PULLBACKS_GO.clear()
    models = [WaitsInBackward(), WideFailsInBackward(), WaitsInBackward()]
    before = snapshot(models)
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
    y = parsum.sum_models(models, torch.randn(3, IN), step_in_backward=sib, n_jobs=2, chunk_size=1)
    with pytest.raises(parsum.ParsumError) as info:
        y.sum().backward()
    assert PULLBACKS_GO.is_set()  # the pullbacks that waited went on after the failure
    message = str(info.value)
    assert "model 1 (WideFailsInBackward) raised ValueError in backward: boom" in message
    assert "already ran" not in message
    assert not any(changed(models, before))
    assert all(p.grad is None for p in trainable(models))


def test_a_failure_names_exactly_the_models_that_stepped():
    # On the threads, which chunks stepped before a failure depends on their timing: the call
    # names those, and no other model's parameters changed.
    import re

    for seed in range(6):
        torch.manual_seed(seed)
        models = [mlp([4 + 4 * (i % 3)]) for i in range(7)]
        models.insert(seed % 7, FailsInBackward())
        before = snapshot(models)
        sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
        y = parsum.sum_models(models, torch.randn(3, IN), step_in_backward=sib, n_jobs=2)
        with pytest.raises(parsum.ParsumError) as info:
            y.sum().backward()
        found = re.search(r"already ran for models \[([0-9, ]*)\]", str(info.value))
        named = set() if found is None else {int(i) for i in found.group(1).split(", ")}
        stepped = {i for i, moved in enumerate(changed(models, before)) if moved}
        assert stepped == named and seed % 7 not in stepped
        assert all(p.grad is None for p in trainable(models))


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("flaky", [_FlakyHead, _FlakyInside])
@pytest.mark.parametrize("position", [0, 3, 6])
def test_a_failure_that_does_not_repeat_names_its_model_and_the_models_that_stepped(
    position, flaky, n_jobs
):
    # NOTE [ A failure that does not repeat ] in parsum._inline: the failing model passes when
    # pulled back again; it is named all the same (before: the model after it, or no error at
    # all, the steps taken), and the models that stepped are named, none other changed.
    import re

    torch.manual_seed(0)
    models = [mlp([8 + i]) for i in range(6)]
    models.insert(position, flaky())
    before = snapshot(models)
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
    y = parsum.sum_models(models, torch.randn(5, IN), step_in_backward=sib, n_jobs=n_jobs)
    _ARMED[0] = True
    with pytest.raises(parsum.ParsumError, match=rf"model {position} \({flaky.__name__}\)") as info:
        y.pow(2).sum().backward()
    assert not _ARMED[0]
    found = re.search(r"already ran for models \[([0-9, ]*)\]", str(info.value))
    named = set() if found is None else {int(i) for i in found.group(1).split(", ")}
    stepped = {i for i, moved in enumerate(changed(models, before)) if moved}
    assert stepped == named and position not in stepped
    assert all(p.grad is None for p in trainable(models))


def test_failing_step_is_named():
    models = [mlp([8]), mlp([4])]

    class Broken(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("no step today")

    sib = parsum.StepInBackward(models, Broken, lr=0.1)
    y = parsum.sum_models(models, torch.randn(3, IN), step_in_backward=sib, n_jobs=1)
    with pytest.raises(
        parsum.ParsumError,
        match=r"model 0 \(Sequential\) raised RuntimeError "
        r"in its optimizer step: no step today",
    ):
        y.sum().backward()


# -- one step over a chunk's small models (NOTE [ One step over a chunk's small models ]) ----


def count_steps(monkeypatch, cls):
    """The optimizers of class ``cls`` stepped, in order, and the live ``.grad`` of
    ``watched`` (a list the test fills) at each step."""
    stepped, live, watched = [], [], []
    step = cls.step

    def counting(self, *args, **kwargs):
        stepped.append(self)
        live.append(sum(p.grad is not None for p in watched))
        return step(self, *args, **kwargs)

    monkeypatch.setattr(cls, "step", counting)
    return stepped, live, watched


def no_op_hook(optimizer, args, kwargs):
    return None


@pytest.mark.parametrize(("cls", "kw"), OPTIMIZERS, ids=lambda v: getattr(v, "__name__", ""))
def test_small_models_of_a_chunk_step_as_one(monkeypatch, cls, kw):
    # Six models in chunks of three: two steps, each over its chunk's parameters, with the
    # bits of one step a model (forced by a step hook, which a step as one would skip) and
    # the values of plain training; the models' optimizers hold the same state.
    batches = [torch.randn(5, IN, dtype=torch.float64) for _ in range(3)]
    base = [mlp([(4, 8, 6)[i % 3]]).double() for i in range(6)]
    merged, alone, ref = clone_models(base), clone_models(base), clone_models(base)
    stepped, live, watched = count_steps(monkeypatch, cls)
    watched.extend(trainable(merged))
    sib = train_fused(merged, batches, cls, kw, chunk_size=3, n_jobs=1)
    assert len(stepped) == 2 * len(batches)
    assert all(o not in sib.optimizers for o in stepped)
    assert live == [3 * 4] * len(stepped)  # one chunk's gradients at a time, 4 a model
    stepped.clear()
    sib_alone = parsum.StepInBackward(alone, cls, **kw)
    for o in sib_alone.optimizers:
        o.register_step_pre_hook(no_op_hook)
    for x in batches:
        y = parsum.sum_models(alone, x, step_in_backward=sib_alone, chunk_size=3, n_jobs=1)
        y.pow(2).mean().backward()
    assert stepped == sib_alone.optimizers * len(batches)
    for p, q in zip(trainable(merged), trainable(alone)):
        assert torch.equal(p, q)
    train_plain(ref, batches, cls, kw)
    for p, r in zip(trainable(merged), trainable(ref)):
        torch.testing.assert_close(p, r, rtol=1e-10, atol=1e-10)
    for o, a in zip(sib.optimizers, sib_alone.optimizers):
        mine, theirs = o.state_dict()["state"], a.state_dict()["state"]
        assert mine.keys() == theirs.keys()
        for key in mine:
            for name, value in mine[key].items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(theirs[key][name]))


def test_steps_as_one_keep_lr_schedulers_counting():
    # A scheduler per optimizer: the lr follows, and the scheduler sees its optimizer stepped
    # (no "lr_scheduler.step() before optimizer.step()" warning).
    models = [mlp([w]).double() for w in (8, 4, 6, 5)]
    ref = clone_models(models)
    batches = [torch.randn(5, IN, dtype=torch.float64) for _ in range(5)]

    def schedule(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        sib = train_fused(models, batches, torch.optim.SGD, dict(lr=0.1), schedule, chunk_size=4)
    train_plain(ref, batches, torch.optim.SGD, dict(lr=0.1), schedule)
    assert all(o.param_groups[0]["lr"] == pytest.approx(0.1 * 0.1**2) for o in sib.optimizers)
    for p, r in zip(trainable(models), trainable(ref)):
        torch.testing.assert_close(p, r)


def test_optimizers_with_other_settings_step_alone(monkeypatch):
    models = [mlp([w]) for w in (8, 4, 6)]
    before = snapshot(models)
    stepped, _, _ = count_steps(monkeypatch, torch.optim.SGD)
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
    sib.optimizers[1].param_groups[0]["lr"] = 0.0  # model 1 frozen by its own settings
    y = parsum.sum_models(models, torch.randn(3, IN), step_in_backward=sib, chunk_size=3)
    y.pow(2).mean().backward()
    assert stepped == sib.optimizers
    assert changed(models, before) == [True, False, True]


def test_an_optimizer_with_a_step_of_its_own_steps_alone():
    # A wrapper of one optimizer's step (clipping, logging) must run: that model steps alone,
    # through it, and the others still step as one.
    models = [mlp([w]) for w in (8, 4, 6)]
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
    wrapped = []
    step = sib.optimizers[2].step

    def logged(*args, **kwargs):
        wrapped.append(True)
        return step(*args, **kwargs)

    sib.optimizers[2].step = logged
    y = parsum.sum_models(models, torch.randn(3, IN), step_in_backward=sib, chunk_size=3)
    y.pow(2).mean().backward()
    assert wrapped == [True]


def test_an_optimizer_over_other_parameters_steps_alone():
    # One model's optimizer replaced by one over its weight alone: its bias must not step, as
    # one optimizer over every parameter of the chunk would step it.
    models = [mlp([w]) for w in (8, 4, 6)]
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
    sib.optimizers[1] = torch.optim.SGD([models[1][0].weight], lr=0.1)
    weight, bias = models[1][0].weight.detach().clone(), models[1][0].bias.detach().clone()
    y = parsum.sum_models(models, torch.randn(3, IN), step_in_backward=sib, chunk_size=3)
    y.pow(2).mean().backward()
    assert not torch.equal(models[1][0].weight, weight)
    assert torch.equal(models[1][0].bias, bias)


def test_steps_as_one_continue_from_a_loaded_state():
    # The state a step as one updates is each model's optimizer's own: saved, then loaded
    # back into the same optimizers (whose state dicts it replaces), it gives what training on
    # without the round trip gave, bit for bit.
    models = [mlp([w]) for w in (8, 4, 6, 5)]
    batches = [torch.randn(5, IN) for _ in range(4)]
    sib = train_fused(models, batches[:2], torch.optim.Adam, dict(lr=1e-2), chunk_size=4)
    saved_models = [copy.deepcopy(m.state_dict()) for m in models]
    saved_state = copy.deepcopy(sib.state_dict())

    def train_on():
        for x in batches[2:]:
            y = parsum.sum_models(models, x, step_in_backward=sib, chunk_size=4)
            y.pow(2).mean().backward()
        return [p.detach().clone() for p in trainable(models)]

    first = train_on()
    for m, saved in zip(models, saved_models):
        m.load_state_dict(saved)
    sib.load_state_dict(saved_state)
    again = train_on()
    assert sib.optimizers[0].state_dict()["state"][0]["step"] == 4
    assert all(torch.equal(p, q) for p, q in zip(first, again))


def test_a_step_in_backward_that_stepped_models_as_one_copies_and_pickles():
    # As before steps as one: the optimizer that steps them holds no state of its own
    # between steps (a dict subclass there had made copying fail).
    models = [mlp([w]) for w in (8, 4, 6)]
    batches = [torch.randn(5, IN) for _ in range(3)]
    sib = train_fused(models, batches[:2], torch.optim.Adam, dict(lr=1e-2), chunk_size=3)
    assert sib._merged  # they stepped as one
    copied = copy.deepcopy(sib)
    assert copied.state_dict()["optimizers"][1]["state"][0]["step"] == 2
    buffer = io.BytesIO()
    torch.save((models, sib), buffer)
    buffer.seek(0)
    torch.load(buffer, weights_only=False)
    y = parsum.sum_models(models, batches[2], step_in_backward=sib, chunk_size=3)
    y.pow(2).mean().backward()
    assert sib.optimizers[1].state_dict()["state"][0]["step"] == 3


def _copies(models, sib):
    """(models, sib) deep-copied, and saved and loaded with torch.save."""
    buffer = io.BytesIO()
    torch.save((models, sib), buffer)
    buffer.seek(0)
    return [copy.deepcopy((models, sib)), torch.load(buffer, weights_only=False)]


def _params(models):
    return [p.detach().clone() for m in models for p in m.parameters()]


@pytest.mark.parametrize("stacked", [False, True])
def test_a_copied_or_loaded_step_in_backward_trains_its_own_models(stacked):
    # NOTE [ A copied StepInBackward ]: a copy refused its own models, keyed by identity.
    torch.manual_seed(0)
    models = [mlp([6]) for _ in range(4)] if stacked else [mlp([w]) for w in (8, 4, 6)]
    if stacked:
        parsum.stack_(models)  # stepped as one over the stack: a step count shared
    batches = [torch.randn(5, IN) for _ in range(4)]
    sib = train_fused(models, batches[:2], torch.optim.Adam, dict(lr=1e-2))
    copies = _copies(models, sib)
    before = _params(models)
    for twin_models, twin_sib in copies:
        assert twin_sib.models[0] is twin_models[0] and twin_sib.index(twin_models[2]) == 2
        for x in batches[2:]:
            y = parsum.sum_models(twin_models, x, step_in_backward=twin_sib)
            y.pow(2).mean().backward()
        assert all(torch.equal(p, q) for p, q in zip(_params(models), before))  # untouched
    for x in batches[2:]:
        parsum.sum_models(models, x, step_in_backward=sib).pow(2).mean().backward()
    for twin_models, twin_sib in copies:
        for p, q in zip(_params(twin_models), _params(models)):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)  # stacked: other kernels
        for o, t in zip(sib.optimizers, twin_sib.optimizers):
            assert t.state_dict()["state"][0]["step"] == o.state_dict()["state"][0]["step"] == 4
        # Its parameters are watched as the original's: a gradient after the step raises.
        y = parsum.sum_models(twin_models, batches[0], step_in_backward=twin_sib)
        loss = y.pow(2).mean() + twin_models[1][0].weight.pow(2).sum()
        with pytest.raises(parsum.ParsumError, match="got a gradient from outside sum_models"):
            loss.backward()


def test_a_failing_step_as_one_names_its_models(monkeypatch):
    models = [mlp([w]) for w in (8, 4, 6, 5)]
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
    step = torch.optim.SGD.step

    def fails_as_one(self, *args, **kwargs):
        if self not in sib.optimizers:
            raise RuntimeError("no step today")
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.SGD, "step", fails_as_one)
    y = parsum.sum_models(models, torch.randn(3, IN), step_in_backward=sib, chunk_size=2)
    with pytest.raises(parsum.ParsumError) as info:
        y.sum().backward()
    message = str(info.value)
    assert "the optimizer step it took as one with models 0, 1: no step today" in message
    assert "already ran for models [0, 1]" in message
    assert all(p.grad is None for p in trainable(models))


def test_a_failed_pullback_drops_the_steps_waiting_in_its_chunk():
    models = [mlp([8]), mlp([4]), FailsInBackward(), mlp([6])]
    before = snapshot(models)
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
    y = parsum.sum_models(models, torch.randn(3, IN), step_in_backward=sib, n_jobs=1, chunk_size=2)
    with pytest.raises(parsum.ParsumError, match="already ran for models \\[0, 1\\]"):
        y.sum().backward()
    assert changed(models, before) == [
        True,
        True,
        False,
        False,
    ]  # model 3 waited for model 2, which failed
    assert all(p.grad is None for p in trainable(models))


def test_models_too_large_to_wait_step_after_their_pullback(monkeypatch):
    # MERGED_STEP_ELEMENTS bounds the gradients that wait: models above it step alone, and
    # the waiting ones step as soon as they reach it.
    models = [mlp([w]) for w in (8, 4, 6, 5)]  # 83, 43, 63 and 53 elements
    stepped, live, watched = count_steps(monkeypatch, torch.optim.SGD)
    watched.extend(trainable(models))
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
    monkeypatch.setattr(parsum._function, "MERGED_STEP_ELEMENTS", 100)
    y = parsum.sum_models(models, torch.randn(3, IN), step_in_backward=sib, chunk_size=4, n_jobs=1)
    y.sum().backward()
    # 83 waits; 83 + 43 reach 100: they step as one; 63 waits, 63 + 53 too.
    assert len(stepped) == 2 and live == [8, 8]
    assert all(o not in sib.optimizers for o in stepped)
    stepped.clear()
    monkeypatch.setattr(parsum._function, "MERGED_STEP_ELEMENTS", 50)
    y = parsum.sum_models(models, torch.randn(3, IN), step_in_backward=sib, chunk_size=4, n_jobs=1)
    y.sum().backward()
    # Each alone: only 43 fits, and nothing waits beside it.
    assert sorted(map(sib.optimizers.index, stepped)) == [0, 1, 2, 3]


def test_models_too_large_to_wait_are_pulled_back_alone(monkeypatch):
    # NOTE [ Large models pulled back alone ]: a chunk's engine call would hold every model's
    # gradients at once; a model that steps right after its pullback gets a call of its own.
    calls = batched_calls(monkeypatch)
    monkeypatch.setattr(parsum._function, "MERGED_STEP_ELEMENTS", 60)
    models = [mlp([w]) for w in (8, 4, 6, 3)]  # 83, 43, 63 and 33 elements
    copies = clone_models(models)
    x = torch.randn(3, IN)
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
    y = parsum.sum_models(models, x, step_in_backward=sib, chunk_size=4, n_jobs=1)
    y.sum().backward()
    assert calls == [[1, 3]]  # the two that wait share a call; 0 and 2 alone
    opt = torch.optim.SGD(trainable(copies), lr=0.1)
    plain_sum(copies, x).sum().backward()
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(trainable(models), trainable(copies)))


# -- bad input -----------------------------------------------------------------------------


def test_tied_parameters_across_models_are_refused():
    a, b = mlp([8]), mlp([8])
    b[0].weight = a[0].weight
    with pytest.raises(
        parsum.ParsumError,
        match=r"parameter '0.weight' of models\[1\] "
        r"\(Sequential\) is parameter '0.weight' of models\[0\]",
    ):
        parsum.StepInBackward([a, b], torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize(
    ("models", "cls", "kw", "match"),
    [
        (nn.Linear(2, 2), torch.optim.SGD, {"lr": 0.1}, "models is a single Linear"),
        ([], torch.optim.SGD, {"lr": 0.1}, "models is empty"),
        ([lambda x: x], torch.optim.SGD, {"lr": 0.1}, r"models\[0\] is a function"),
        ([nn.Linear(2, 2)], "SGD", {"lr": 0.1}, "optimizer_cls is 'SGD', which is not"),
        (
            [nn.Linear(2, 2)],
            torch.optim.SGD,
            {"lr": -1.0},
            r"SGD\(params of models\[0\] "
            r"\(Linear\), \*\*\{'lr': -1.0\}\) raised ValueError",
        ),
        # Its step needs a closure: it raised TypeError from inside the first backward.
        ([nn.Linear(2, 2)], torch.optim.LBFGS, {}, r"LBFGS.step needs a closure"),
    ],
)
def test_bad_construction(models, cls, kw, match):
    with pytest.raises(parsum.ParsumError, match=match):
        parsum.StepInBackward(models, cls, **kw)


def test_sum_models_refuses_mismatched_models():
    a, b, c = mlp([8]), mlp([4]), mlp([2])
    sib = parsum.StepInBackward([a, b], torch.optim.SGD, lr=0.1)
    x = torch.randn(2, IN)
    with pytest.raises(parsum.ParsumError, match=r"models\[2\] \(Sequential\) is not one of"):
        parsum.sum_models([a, b, c], x, step_in_backward=sib)
    with pytest.raises(
        parsum.ParsumError, match=r"models\[1\] \(Sequential\) is models\[0\] again"
    ):
        parsum.sum_models([a, a], x, step_in_backward=sib)
    with pytest.raises(parsum.ParsumError, match="step_in_backward is a SGD"):
        parsum.sum_models([a], x, step_in_backward=sib.optimizers[0])
    parsum.sum_models([b], x, step_in_backward=sib).sum().backward()  # a subset is fine
    assert a[0].weight.grad is None and b[0].weight.grad is None


def test_with_a_flatgrad_over_the_same_models():
    models = [mlp([8]).double(), mlp([4]).double()]
    ref = clone_models(models)
    flat = parsum.FlatGrad(models)
    batches = [torch.randn(5, IN, dtype=torch.float64) for _ in range(3)]
    flat.zero_()
    train_fused(models, batches, torch.optim.Adam, dict(lr=1e-2))
    train_plain(ref, batches, torch.optim.Adam, dict(lr=1e-2))
    for p, r in zip(trainable(models), trainable(ref)):
        torch.testing.assert_close(p, r)
    assert flat.flat.abs().sum() == 0


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_bound_methods_step_their_module(n_jobs):
    # A StepInBackward over the modules steps them when sum_models gets their bound methods.
    torch.manual_seed(0)
    owners = [TwoHeads() for _ in range(3)]
    ref = clone_models(owners)
    sib = parsum.StepInBackward(owners, torch.optim.SGD, lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(trainable(ref), lr=0.1, momentum=0.9)
    for _ in range(3):
        x = torch.randn(5, IN)
        y = parsum.sum_models([o.encode for o in owners], x, step_in_backward=sib, n_jobs=n_jobs)
        y.pow(2).mean().backward()
        assert all(p.grad is None for p in trainable(owners))
        plain_sum([o.encode for o in ref], x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for p, q in zip(trainable(owners), trainable(ref)):
        torch.testing.assert_close(p, q)


def test_each_models_gradients_clipped_in_a_step_pre_hook_as_in_plain_training():
    # What docs/gradients.md offers for clipping: a pre-hook of each model's optimizer runs in
    # the worker right before the step, with that model's gradients.
    torch.manual_seed(0)
    models = [mlp([16]) for _ in range(6)]
    ref = clone_models(models)
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)

    def clip(model):
        def hook(optimizer, args, kwargs):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)

        return hook

    for model, optimizer in zip(models, sib.optimizers):
        optimizer.register_step_pre_hook(clip(model))
    plain = [torch.optim.SGD(m.parameters(), lr=0.1) for m in ref]
    for _ in range(3):
        x = torch.randn(8, IN) * 10  # norms well above the limit
        parsum.sum_models(models, x, step_in_backward=sib, n_jobs=2).pow(2).sum().backward()
        for o in plain:
            o.zero_grad()
        plain_sum(ref, x).pow(2).sum().backward()
        for m, o in zip(ref, plain):
            assert torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5) > 0.5
            o.step()
        for m, r in zip(models, ref):
            for a, b in zip(m.parameters(), r.parameters()):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# NOTE [ Steps over tensors in one call ]: settings that change the arithmetic of each class.
LOOPED_BY_DEFAULT = [
    (torch.optim.SGD, dict(lr=0.05)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, maximize=True)),
    (torch.optim.Adam, dict(lr=1e-2)),
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.01, betas=(0.8, 0.9))),
    (torch.optim.Adam, dict(lr=1e-2, maximize=True, eps=1e-6)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    # Tensor settings: foreach refuses Adam's lr as a tensor; they keep the loop.
    (torch.optim.Adam, dict(lr=torch.tensor(1e-2))),
    (torch.optim.SGD, dict(lr=torch.tensor(0.05), momentum=0.9)),
]


@pytest.mark.parametrize(("cls", "kw"), LOOPED_BY_DEFAULT, ids=lambda v: getattr(v, "__name__", ""))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_size", [None, 3])  # 3: small models step as one
def test_steps_in_one_call_give_the_bits_of_the_loop(cls, kw, dtype, chunk_size):
    # Left to PyTorch's default, a step on the CPU runs over its tensors in one call, with
    # the bits and the state of the loop that foreach=False asks for; the optimizers' own
    # setting stays the default.
    base = [mlp([(4, 8, 6)[i % 3]]).to(dtype) for i in range(6)]
    batches = [torch.randn(5, IN, dtype=dtype) for _ in range(3)]
    runs = []
    for extra in ({}, {"foreach": False}):
        models = clone_models(base)
        sib = train_fused(models, batches, cls, {**kw, **extra}, chunk_size=chunk_size, n_jobs=2)
        runs.append((trainable(models), sib))
    (ours, sib), (looped, _) = runs
    same_bits = dict(rtol=0, atol=0, equal_nan=True)  # float16 Adam's eps underflows to nan
    for p, q in zip(ours, looped):
        torch.testing.assert_close(p, q, **same_bits)
    for o, a in zip(sib.optimizers, runs[1][1].optimizers):
        assert all(g["foreach"] is None for g in o.param_groups)
        mine, theirs = o.state_dict()["state"], a.state_dict()["state"]
        for key in mine:
            for name, value in mine[key].items():
                mine_v, theirs_v = torch.as_tensor(value), torch.as_tensor(theirs[key][name])
                torch.testing.assert_close(mine_v, theirs_v, **same_bits)


def test_a_step_left_to_the_default_runs_in_one_call():
    # Seen from the step itself (a pre-hook, which keeps the models stepping alone), and not
    # where the tensors are too many for it or the user chose.
    seen = []

    def record(opt, args, kwargs):
        seen.append(opt.param_groups[0]["foreach"])

    for kw, widths in ((dict(), [8]), (dict(foreach=False), [8]), (dict(), [1100, 1100])):
        models = [mlp(widths) for _ in range(2)]  # 1100 x 1100: above MERGED_STEP_ELEMENTS
        sib = parsum.StepInBackward(models, torch.optim.Adam, lr=1e-3, **kw)
        for o in sib.optimizers:
            o.register_step_pre_hook(record)
        x = torch.randn(3, IN)
        parsum.sum_models(models, x, step_in_backward=sib).sum().backward()
    assert seen == [True, True, False, False, None, None]


class _ParameterOut(nn.Module):
    """Returns a view of its own parameter, which its optimizer steps in the backward."""

    def __init__(self, width):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(width))

    def forward(self, x):
        return self.bias.expand(x.shape[0], -1)


@pytest.mark.parametrize("n_jobs", [None, 1, 2])
@pytest.mark.parametrize("chunk_size", [None, 1, 3])
@pytest.mark.parametrize("width", [OUT, 40_000])  # the weights' gradient at once, per model
def test_learned_weights_take_their_gradient_before_the_steps(width, chunk_size, n_jobs):
    # NOTE [ Weights' gradient before the steps ] in parsum._function: taken after the steps,
    # the weights' gradient read the outputs that view a stepped parameter, silently.
    torch.manual_seed(0)
    models = [_ParameterOut(width), nn.Linear(IN, width), _ParameterOut(width)]
    ref = copy.deepcopy(models)
    x = torch.randn(5, IN)
    logits = torch.zeros(3, requires_grad=True)
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.5)
    y = parsum.sum_models(
        models,
        x,
        weights=logits.softmax(0),
        step_in_backward=sib,
        n_jobs=n_jobs,
        chunk_size=chunk_size,
    )
    y.pow(2).sum().backward()
    ref_logits = logits.detach().clone().requires_grad_()
    w = ref_logits.softmax(0)
    sum(w[i] * m(x) for i, m in enumerate(ref)).pow(2).sum().backward()
    torch.optim.SGD(trainable(ref), lr=0.5).step()
    torch.testing.assert_close(logits.grad, ref_logits.grad)
    for p, q in zip(trainable(models), trainable(ref)):
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize("n_jobs", [None, 1, 2])
@pytest.mark.parametrize("how", ["models", "stack_"])
def test_a_loss_over_two_calls_raises_instead_of_stepping_twice(how, n_jobs):
    # NOTE [ One step a backward ] in parsum._fused: each call's backward stepped the models
    # with its own gradient, two Adam steps where plain training takes one, silently (or
    # autograd's "modified by an inplace operation" where a graph saved a stepped weight).
    torch.manual_seed(0)
    models = [mlp([4]) for _ in range(8)]
    sib = parsum.StepInBackward(models, torch.optim.Adam, lr=0.1)
    called = parsum.stack_(models) if how == "stack_" else models
    x1, x2 = torch.randn(5, IN), torch.randn(5, IN)
    before = snapshot(models)
    loss = sum(
        parsum.sum_models(called, x, step_in_backward=sib, n_jobs=n_jobs).pow(2).sum()
        for x in (x1, x2)
    )
    ran = "no step ran" if how == "stack_" else "the other call's steps may have run"
    with pytest.raises(
        parsum.ParsumError,
        match=rf"is stepped in this backward by the step_in_backward of another sum_models "
        rf"call .*; {ran}\. Call backward\(\) on each call's loss in turn",
    ):
        loss.backward()
    if how == "stack_":  # its steps run at the backward's end, which it did not reach
        assert all(
            torch.equal(p, q) for ps, qs in zip(snapshot(models), before) for p, q in zip(ps, qs)
        )
    # The next backward steps each model once, as it should, and torch.autograd.grad over
    # two calls (in their arguments) steps nothing and raises nothing.
    counts = [step_count(models, sib, k) for k in range(8)]
    parsum.sum_models(called, x1, step_in_backward=sib, n_jobs=n_jobs).pow(2).sum().backward()
    assert [step_count(models, sib, k) for k in range(8)] == [c + 1 for c in counts]
    xs = [x1.clone().requires_grad_(), x2.clone().requires_grad_()]
    loss = sum(
        parsum.sum_models(called, x, step_in_backward=sib, n_jobs=n_jobs).pow(2).sum() for x in xs
    )
    assert all(g is not None for g in torch.autograd.grad(loss, xs))
    assert [step_count(models, sib, k) for k in range(8)] == [c + 1 for c in counts]


def step_count(models, sib, k):
    state = sib.optimizers[k].state.get(next(models[k].parameters()), {})
    return int(state.get("step", 0))


@pytest.mark.parametrize("n_jobs", [None, 1, 2])
@pytest.mark.parametrize("sibs", ["one", "one a call"])
def test_a_loss_over_two_calls_of_other_models_steps_each_once(sibs, n_jobs):
    # NOTE [ One step a backward ]: calls whose models differ share a backward freely, with
    # one StepInBackward or one each (their claims are kept together, by parameter).
    torch.manual_seed(0)
    models = [mlp([8]) for _ in range(6)]
    ref = copy.deepcopy(models)
    if sibs == "one":
        both = parsum.StepInBackward(models, torch.optim.Adam, lr=0.1)
        steppers = [both, both]
    else:
        steppers = [
            parsum.StepInBackward(ms, torch.optim.Adam, lr=0.1) for ms in (models[:3], models[3:])
        ]
    opt = torch.optim.Adam(trainable(ref), lr=0.1)
    x1, x2 = torch.randn(5, IN), torch.randn(5, IN)
    for _ in range(3):
        halves = ((models[:3], x1, steppers[0]), (models[3:], x2, steppers[1]))
        sum(
            parsum.sum_models(ms, x, step_in_backward=sib, n_jobs=n_jobs).pow(2).sum()
            for ms, x, sib in halves
        ).backward()
        (plain_sum(ref[:3], x1).pow(2).sum() + plain_sum(ref[3:], x2).pow(2).sum()).backward()
        opt.step()
        opt.zero_grad()
    for p, q in zip(trainable(models), trainable(ref)):
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize("n_jobs", [None, 1, 2])
@pytest.mark.parametrize("how", ["models", "stack_", "overlapping"])
def test_two_step_in_backwards_over_the_same_models_in_one_loss_raise(how, n_jobs):
    # NOTE [ One step a backward ] in parsum._fused: two StepInBackward objects over the same
    # models, one in each call of a loss, each stepped them with its own call's gradient,
    # silently, where the same one in both calls raised.
    torch.manual_seed(0)
    models = [mlp([4]) for _ in range(8)]
    first = models if how != "overlapping" else models[:5]
    second = models if how != "overlapping" else models[3:]
    sibs = [parsum.StepInBackward(ms, torch.optim.SGD, lr=0.1) for ms in (first, second)]
    called = [parsum.stack_(ms) if how == "stack_" else ms for ms in (first, second)]
    before = snapshot(models)
    x1, x2 = torch.randn(5, IN), torch.randn(5, IN)
    loss = sum(
        parsum.sum_models(ms, x, step_in_backward=sib, n_jobs=n_jobs).pow(2).sum()
        for ms, x, sib in zip(called, (x1, x2), sibs)
    )
    with pytest.raises(
        parsum.ParsumError,
        match=r"is stepped in this backward by the step_in_backward of another sum_models call",
    ):
        loss.backward()
    changed = [
        not all(torch.equal(p, q) for p, q in zip(ps, qs))
        for ps, qs in zip(snapshot(models), before)
    ]
    if how == "overlapping":  # the call that raises steps none of its models
        assert sorted([changed[:3], changed[5:]]) == [[False] * 3, [True] * 3]
    if how == "stack_":
        assert not any(changed)  # its steps run at the backward's end, not reached
    # The next backward, through one call, steps its models once, as it should.
    before = snapshot(models)
    parsum.sum_models(called[1], x2, step_in_backward=sibs[1], n_jobs=n_jobs).sum().backward()
    changed = [
        not all(torch.equal(p, q) for p, q in zip(ps, qs))
        for ps, qs in zip(snapshot(models), before)
    ]
    assert changed == [m in second for m in models]


@pytest.mark.parametrize("how", ["models", "stack_"])
@pytest.mark.parametrize("change", ["assigned", "unfrozen"])
def test_a_parameter_its_optimizer_does_not_step_is_refused_before_anything_runs(change, how):
    # A parameter assigned or unfrozen since the StepInBackward was made got its gradient
    # captured and dropped, never stepped, silently (its optimizer holds the old tensors);
    # in stack_ storage too, which stacks the models again over the new tensors.
    torch.manual_seed(0)
    models = [mlp([4]) for _ in range(8)]
    # stack_ storage: a tensor unfrozen on one model alone would unstack them
    changed = models if how == "stack_" and change == "unfrozen" else models[1:2]
    for m in changed if change == "unfrozen" else ():
        m[0].weight.requires_grad_(False)
    called = parsum.stack_(models) if how == "stack_" else models
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
    for m in changed:
        if change == "assigned":
            m[0].weight = nn.Parameter(torch.randn_like(m[0].weight))
        else:
            m[0].weight.requires_grad_(True)
    x = torch.randn(5, IN)
    before = snapshot(models)
    with pytest.raises(
        parsum.ParsumError,
        match=rf"parameter '0\.weight' of models\[{models.index(changed[0])}\] \(Sequential\) "
        r"needs a gradient, but its optimizer in step_in_backward does not step it",
    ):
        parsum.sum_models(called, x, step_in_backward=sib)
    assert all(
        torch.equal(p, q) for ps, qs in zip(snapshot(models), before) for p, q in zip(ps, qs)
    )
    # The parameters added to their optimizers, they train as in plain training.
    ref = copy.deepcopy(models)
    for m in changed:
        sib.optimizers[models.index(m)].add_param_group({"params": [m[0].weight]})
    for _ in range(2):
        parsum.sum_models(called, x, step_in_backward=sib).pow(2).sum().backward()
        plain_sum(ref, x).pow(2).sum().backward()
        torch.optim.SGD(trainable(ref), lr=0.1).step()
        for m in ref:
            m.zero_grad()
    for p, q in zip(trainable(models), trainable(ref), strict=True):
        torch.testing.assert_close(p, q)
