"""Workers that stop paying (NOTE [ Workers that stop paying ] in parsum._pace): a plan whose
workers parsum chose looks at the calling thread alone now and then, goes that way where its
steps run faster there, comes back when the workers pay again, and changes no bit."""

import pytest
import torch
from torch import nn

import parsum
from parsum import _api, _pace, _pool
from parsum._pace import FIRST_LOOK, LOOK_CALLS, MAX_GAP, MAX_GAP_ALONE, Pace


@pytest.fixture
def clock(monkeypatch):
    """A clock that the steps below advance, read by parsum's paces."""
    now = [0.0]
    monkeypatch.setattr(_pace, "clock", lambda: now[0])
    return now


def drive(pace: Pace, clock: list[float], calls: int, workers_s: float, alone_s: float):
    """``calls`` calls, each a step of the time of the way it went; the ways."""
    ways = []
    for _ in range(calls):
        on_workers = pace.choose()
        clock[0] += workers_s if on_workers else alone_s
        ways.append(on_workers)
    return ways


def test_the_calling_thread_alone_is_taken_where_it_is_faster(clock):
    pace = Pace()
    ways = drive(pace, clock, FIRST_LOOK + LOOK_CALLS + 1, workers_s=10.0, alone_s=5.0)
    assert ways[:FIRST_LOOK] == [True] * FIRST_LOOK
    assert ways[FIRST_LOOK : FIRST_LOOK + LOOK_CALLS] == [False] * LOOK_CALLS
    n = FIRST_LOOK - 1  # the calls alone before their first look at the workers
    assert drive(pace, clock, n, workers_s=10.0, alone_s=5.0) == [False] * n
    assert not pace.on_workers


def test_workers_that_pay_stay_and_are_looked_past_ever_more_rarely(clock):
    pace = Pace()
    ways = drive(pace, clock, 4000, workers_s=5.0, alone_s=8.0)
    assert pace.on_workers
    # A look after FIRST_LOOK calls, then after twice as many each time, at most MAX_GAP.
    firsts = [k for k in range(1, len(ways)) if not ways[k] and ways[k - 1]]
    assert firsts[0] == FIRST_LOOK
    gaps = [b - a - LOOK_CALLS for a, b in zip(firsts, firsts[1:])]
    assert gaps == [min(FIRST_LOOK << k, MAX_GAP) for k in range(1, len(firsts))]
    assert ways.count(False) == LOOK_CALLS * len(firsts) < 0.01 * len(ways)


def test_a_gain_below_the_switch_share_switches_nothing(clock):
    pace = Pace()
    drive(pace, clock, 500, workers_s=5.0, alone_s=5.0 * 0.95)  # 5% faster alone: noise
    assert pace.on_workers


def test_the_workers_come_back_once_they_pay_again(clock):
    pace = Pace()
    drive(pace, clock, 1000, workers_s=10.0, alone_s=5.0)  # a busy machine, looked at rarely
    assert not pace.on_workers
    ways = drive(pace, clock, 200, workers_s=3.0, alone_s=5.0)  # idle again
    assert pace.on_workers
    assert ways.index(True) <= MAX_GAP_ALONE + 1
    assert ways[-50:].count(True) >= 50 - LOOK_CALLS


def test_a_machine_that_changes_is_looked_at_again_soon(clock):
    pace = Pace()
    drive(pace, clock, 3000, workers_s=5.0, alone_s=8.0)  # looks every 1024 calls by now
    assert pace.on_workers
    # Another process starts: the workers' steps take twice as long.
    ways = drive(pace, clock, 3 * FIRST_LOOK, workers_s=10.0, alone_s=4.0)
    assert not pace.on_workers
    assert ways.index(False) < 2 * FIRST_LOOK


def test_a_pause_between_steps_is_not_taken_for_a_step(clock):
    """An evaluation or a checkpoint between two calls: neither a look nor the way's time."""
    pace = Pace()
    drive(pace, clock, 3000, workers_s=5.0, alone_s=8.0)
    recent = pace._recent
    for _ in range(3):
        pace.choose()
        clock[0] += 1000.0
    assert pace.on_workers and pace._recent == recent


@pytest.mark.parametrize("period", [2, 3, 5])
def test_steps_of_a_loop_that_calls_twice_are_not_mistaken(clock, period):
    """A loop that calls the plan more than once a step (two forwards, a turn among other
    work): the times from call to call repeat a pattern (a short one, then a long one); a look
    of LOOK_CALLS calls, which sees the pattern in another phase, must not switch where each
    call takes longer alone."""
    pace = Pace()
    for k in range(4000):
        on_workers = pace.choose()
        long = k % period == period - 1
        clock[0] += (40.0 if long else 10.0) + (0.0 if on_workers else 3.0)
    assert pace.on_workers


def test_steady_steps_still_switch_through_noise(clock):
    """A busy machine whose steps jitter by 10% either way goes to the calling thread alone
    where that is a third faster."""
    import random

    rng = random.Random(0)
    pace = Pace()
    for _ in range(400):
        on_workers = pace.choose()
        clock[0] += (24.0 if on_workers else 17.0) * rng.uniform(0.9, 1.1)
    assert not pace.on_workers


def drive_in_turns(pace: Pace, clock, turns: int, workers_s: float, alone_s: float, calls=5):
    """``turns`` runs of ``calls`` calls each, with a pause between them (other work: an
    interleaved benchmark's other methods, an evaluation every few steps); the ways."""
    ways = []
    for _ in range(turns):
        clock[0] += 100 * workers_s
        ways += drive(pace, clock, calls, workers_s, alone_s)
    return ways


def test_a_look_across_a_pause_is_judged(clock):
    """A look whose step spans a pause takes another call in its place: a look that was never
    judged kept the next one FIRST_LOOK calls away, and with 5 calls between pauses 3 of every
    35 calls ran alone, 1.5 times as slow on 16 cores (a 16-core slowdown of the medium models
    seen only in interleaved benchmarks)."""
    pace = Pace()
    ways = drive_in_turns(pace, clock, 800, workers_s=5.0, alone_s=8.0)
    assert pace.on_workers
    assert ways.count(False) < 0.01 * len(ways)
    # And a look across pauses still switches where alone is faster.
    pace = Pace()
    drive_in_turns(pace, clock, 40, workers_s=10.0, alone_s=5.0)
    assert not pace.on_workers


def test_a_way_pause_times_as_slow_is_looked_at_ever_more_rarely(clock):
    """Calls alone PAUSE times as slow as on the workers (many cores): a look's steps are
    taken for pauses, and after LOOK_CALLS more calls the look changes nothing, as a judged
    one: the gaps still double."""
    pace = Pace()
    ways = drive(pace, clock, 4000, workers_s=1.0, alone_s=2 * _pace.PAUSE)
    assert pace.on_workers
    assert ways.count(False) <= 2 * LOOK_CALLS * 8


def test_a_lone_slow_step_is_not_a_machine_that_changed(clock):
    """A step three times as long now and then (a garbage collection, the scheduler) leaves
    the looks as rare as in steady steps: taken for a machine that changed, each one brought
    the next look within FIRST_LOOK calls."""
    pace = Pace()
    ways = []
    for k in range(4000):
        on_workers = pace.choose()
        clock[0] += (5.0 if on_workers else 8.0) * (3 if k % 50 == 49 else 1)
        ways.append(on_workers)
    assert pace.on_workers
    assert ways.count(False) < 0.01 * len(ways)


def test_a_look_two_callers_judge_at_once_is_judged_once(clock):
    # Calls of one plan from several threads take no lock: two that both saw the look's last
    # step in could both judge it, and the second found it emptied (statistics.median of
    # nothing raised in the user's call).
    pace = Pace()
    drive(pace, clock, FIRST_LOOK + LOOK_CALLS + 1, workers_s=10.0, alone_s=5.0)
    assert not pace.on_workers  # the first judgement switched
    pace._look = [1.0] * LOOK_CALLS
    pace._judge()
    pace._judge()  # the second caller's, on the emptied look
    assert not pace._look


def helpers_ran(monkeypatch):
    """The jobs handed to helpers from now on (forwards and pullbacks alike), each by its
    helper count: a job handed over is on the workers, whether or not a helper woke in time to
    claim a chunk of it."""
    handed: list[int] = []
    submit = _pool._Pool.submit

    def spy(self, job, helpers):
        handed.append(helpers)
        return submit(self, job, helpers)

    monkeypatch.setattr(_pool._Pool, "submit", spy)
    return handed


def make_models():
    torch.manual_seed(0)
    return [
        nn.Sequential(nn.Linear(16, 64 + 8 * i), nn.Tanh(), nn.Linear(64 + 8 * i, 4))
        for i in range(8)
    ]


def paced_plan(models, differentiated=True):
    """The pace of the models' plan, for calls a backward follows or for forwards alone (with
    grad disabled, a plan of its own: NOTE [ Small groups in a forward alone ] in _grouping)."""
    walk = _api.known_walk(models)
    paces = {key[-2]: d.pace for key, d in walk.derived.items() if d.pace is not None}
    assert len(paces) >= 1
    if differentiated:
        return paces[False][0]
    return paces[True][1] if True in paces else paces[False][1]


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
    monkeypatch.setattr(_api, "plain_graph_pays", lambda *a: False)


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


def test_a_plan_times_steps_with_a_backward_apart_from_forwards_alone(workers_chosen):
    models = make_models()
    x = torch.randn(32, 16)
    for _ in range(2):
        step(models, x)
    with_backward = paced_plan(models)._recent
    assert with_backward is not None and with_backward > 0
    assert paced_plan(models, differentiated=False)._recent is None
    with torch.no_grad():
        for _ in range(2):
            parsum.sum_models(models, x)
    assert paced_plan(models)._recent == with_backward
    assert paced_plan(models, differentiated=False)._recent is not None


def test_an_explicit_n_jobs_is_never_paced(workers_chosen):
    models = make_models()
    x = torch.randn(32, 16)
    parsum.sum_models(models, x, n_jobs=2).sum().backward()
    assert all(d.pace is None for d in _api.known_walk(models).derived.values())


def test_a_busy_machine_moves_the_calls_to_the_calling_thread(workers_chosen, monkeypatch, clock):
    """With steps on the workers timed slower than steps alone (a clock that says so), the
    plan goes to the calling thread after its first look, and its helpers run nothing after."""
    models = make_models()
    helped = helpers_ran(monkeypatch)
    x = torch.randn(32, 16)
    ways: list[bool] = []
    choose = Pace.choose

    def spy(self):
        ways.append(choose(self))
        return ways[-1]

    monkeypatch.setattr(Pace, "choose", spy)

    def timed(module, inputs):  # the call's forward: 2 s on the workers, 1 s alone
        clock[0] += 2.0 if ways[-1] else 1.0

    models[0].register_forward_pre_hook(timed)
    for _ in range(FIRST_LOOK + LOOK_CALLS + 2):
        parsum.sum_models(models, x).sum().backward()
    assert ways[-2:] == [False, False]
    assert not paced_plan(models).on_workers
    assert helped  # the calls before the look
    helped.clear()
    step(models, x)
    assert not helped
