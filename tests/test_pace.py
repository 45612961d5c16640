"""Workers that stop paying (NOTE [ Workers that stop paying ] in parsum._pace): a plan whose
workers parsum chose looks at the calling thread alone now and then, goes that way where its
calls run faster there, comes back when the workers pay again, and changes no bit."""

import pytest
import torch
from torch import nn

import parsum
from parsum import _api, _pace, _pool
from parsum._pace import FIRST_LOOK, LOOK_CALLS, MAX_GAP, MAX_GAP_ALONE, Pace


def drive(pace: Pace, calls: int, workers_s: float, alone_s: float) -> list[bool]:
    """``calls`` calls, each recorded with the time of the way it went; the ways."""
    ways = []
    for _ in range(calls):
        on_workers = pace.choose()
        pace.record(on_workers, workers_s if on_workers else alone_s)
        ways.append(on_workers)
    return ways


def test_the_calling_thread_alone_is_taken_where_it_is_faster():
    pace = Pace()
    ways = drive(pace, FIRST_LOOK + LOOK_CALLS, workers_s=10.0, alone_s=5.0)
    assert ways[:FIRST_LOOK] == [True] * FIRST_LOOK
    assert ways[FIRST_LOOK:] == [False] * LOOK_CALLS
    assert not pace.on_workers
    assert drive(pace, FIRST_LOOK, workers_s=10.0, alone_s=5.0) == [False] * FIRST_LOOK


def test_workers_that_pay_stay_and_are_looked_past_ever_more_rarely():
    pace = Pace()
    ways = drive(pace, 4000, workers_s=5.0, alone_s=8.0)
    assert pace.on_workers
    # A look after FIRST_LOOK calls, then after twice as many each time, at most MAX_GAP.
    firsts = [k for k in range(1, len(ways)) if not ways[k] and ways[k - 1]]
    assert firsts[0] == FIRST_LOOK
    gaps = [b - a - LOOK_CALLS for a, b in zip(firsts, firsts[1:])]
    assert gaps == [min(FIRST_LOOK << k, MAX_GAP) for k in range(1, len(firsts))]
    assert ways.count(False) == LOOK_CALLS * len(firsts) < 0.01 * len(ways)


def test_a_gain_below_the_switch_share_switches_nothing():
    pace = Pace()
    drive(pace, 500, workers_s=5.0, alone_s=5.0 * 0.95)  # 5% faster alone: noise, not load
    assert pace.on_workers


def test_the_workers_come_back_once_they_pay_again():
    pace = Pace()
    drive(pace, 100, workers_s=10.0, alone_s=5.0)  # a busy machine
    assert not pace.on_workers
    drive(pace, 1000, workers_s=10.0, alone_s=5.0)  # looked at less often by now
    ways = drive(pace, 200, workers_s=3.0, alone_s=5.0)  # idle again
    assert pace.on_workers
    assert ways.index(True) <= MAX_GAP_ALONE + 1
    assert ways[-50:].count(True) >= 50 - LOOK_CALLS


def test_a_machine_that_changes_is_looked_at_again_soon():
    pace = Pace()
    drive(pace, 3000, workers_s=5.0, alone_s=8.0)  # looks every 1024 calls by now
    assert pace.on_workers
    # Another process starts: the workers' calls take twice as long.
    ways = drive(pace, 3 * FIRST_LOOK, workers_s=10.0, alone_s=8.0 * 0.5)
    assert not pace.on_workers
    assert ways.index(False) < 2 * FIRST_LOOK


def test_a_look_whose_calls_record_nothing_does_not_stay():
    """Calls of a look that no backward followed (their time comes with it) leave the way as
    it was: the next calls go it again."""
    pace = Pace()
    for _ in range(FIRST_LOOK):
        pace.record(pace.choose(), 5.0)
    assert [pace.choose() for _ in range(LOOK_CALLS)] == [False] * LOOK_CALLS
    assert [pace.choose() for _ in range(FIRST_LOOK)] == [True] * FIRST_LOOK


def helpers_ran(monkeypatch):
    """The chunks that helpers claim from now on (forwards and pullbacks alike)."""
    claimed: list[int] = []
    claim = _pool._Job._claim

    def spy(self, caller):
        k = claim(self, caller)
        if k is not None and not caller:
            claimed.append(k)
        return k

    monkeypatch.setattr(_pool._Job, "_claim", spy)
    return claimed


def make_models():
    torch.manual_seed(0)
    return [
        nn.Sequential(nn.Linear(16, 64 + 8 * i), nn.Tanh(), nn.Linear(64 + 8 * i, 4))
        for i in range(8)
    ]


def paced_plan(models, differentiated=True):
    """The pace of the models' plan, for calls a backward follows or for forwards alone."""
    walk = _api.known_walk(models)
    paces = [d.pace for d in walk.derived.values() if d.pace is not None]
    assert len(paces) == 1
    return paces[0][0 if differentiated else 1]


def step(models, x):
    y = parsum.sum_models(models, x)
    y.pow(2).mean().backward()
    grads = [p.grad.clone() for m in models for p in m.parameters()]
    for m in models:
        m.zero_grad(set_to_none=True)
    return y.detach(), grads


@pytest.fixture
def workers_chosen(cores, monkeypatch):
    """A budget of 2 whose default puts these models on 2 workers."""
    cores(2)
    monkeypatch.setattr(_api, "useful_workers", lambda *a: 2)
    monkeypatch.setattr(_api, "useful_forward_workers", lambda found, batch, workers: workers)
    monkeypatch.setattr(_api, "intra_op_only", lambda *a: False)


def test_a_call_on_the_calling_thread_alone_gives_the_bits_of_one_on_the_workers(
    workers_chosen, monkeypatch
):
    models = make_models()
    helped = helpers_ran(monkeypatch)
    x = torch.randn(32, 16)
    on_workers = step(models, x)
    assert helped
    pace = paced_plan(models)
    pace.on_workers = False  # as after a look that found the workers not paying
    helped.clear()
    alone = step(models, x)
    assert not helped
    assert torch.equal(alone[0], on_workers[0])
    assert all(map(torch.equal, alone[1], on_workers[1]))
    assert torch.equal(parsum.sum_models(models, x, n_jobs=1), on_workers[0])


def test_a_plan_times_calls_with_a_backward_apart_from_forwards_alone(workers_chosen):
    models = make_models()
    x = torch.randn(32, 16)
    step(models, x)
    with_backward = paced_plan(models)._recent
    assert with_backward is not None and with_backward > 0
    assert paced_plan(models, differentiated=False)._recent is None
    with torch.no_grad():
        parsum.sum_models(models, x)
    assert paced_plan(models)._recent == with_backward
    assert paced_plan(models, differentiated=False)._recent is not None


def test_an_explicit_n_jobs_is_never_paced(workers_chosen):
    models = make_models()
    x = torch.randn(32, 16)
    parsum.sum_models(models, x, n_jobs=2).sum().backward()
    assert all(d.pace is None for d in _api.known_walk(models).derived.values())


def test_a_busy_machine_moves_the_calls_to_the_calling_thread(workers_chosen, monkeypatch):
    """With calls on the workers timed slower than calls alone (a clock that says so), the
    plan goes to the calling thread after its first look, and its helpers run nothing after."""
    models = make_models()
    helped = helpers_ran(monkeypatch)
    x = torch.randn(32, 16)
    clock = [0.0]
    monkeypatch.setattr(_pace, "clock", lambda: clock[0])
    calls: list[_pace.PacedCall] = []

    class Recorded(_pace.PacedCall):
        __slots__ = ()

        def __init__(self, pace: Pace) -> None:
            super().__init__(pace)
            calls.append(self)

    monkeypatch.setattr(_api, "PacedCall", Recorded)

    def timed(module, inputs):  # the call's forward: 2 s on the workers, 1 s alone
        clock[0] += 2.0 if calls[-1].on_workers else 1.0

    models[0].register_forward_pre_hook(timed)
    for _ in range(FIRST_LOOK + LOOK_CALLS + 1):
        parsum.sum_models(models, x).sum().backward()
    assert [c.on_workers for c in calls[-LOOK_CALLS - 1 :]] == [False] * (LOOK_CALLS + 1)
    assert not paced_plan(models).on_workers
    assert helped  # the calls before the look
    helped.clear()
    step(models, x)
    assert not helped
