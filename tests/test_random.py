"""Random numbers in the models: the plain loop's numbers for any n_jobs, and checkpointed
models' recomputed masks equal to the forward's (NOTE [ Random numbers in forwards ] and
NOTE [ Random numbers replayed in backward ] in parsum._random)."""

import copy
import functools
import gc
import random
import threading
import time
import warnings
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import parsum
from parsum import _plans, _random

pytestmark = pytest.mark.timeout(120)


def dropout_mlps(n=6, width=16):
    torch.manual_seed(0)
    return [
        nn.Sequential(nn.Linear(8, width + i), nn.ReLU(), nn.Dropout(0.5), nn.Linear(width + i, 4))
        for i in range(n)
    ]


def grads(models):
    return [p.grad.clone() for m in models for p in m.parameters()]


def step(models, x, seed, calls=None, **kw):
    """One seeded forward and backward (through ``calls``, the models' bound methods, if
    given); the output and the gradients."""
    for m in models:
        m.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    y = parsum.sum_models(calls or models, x, **kw)
    y.pow(2).sum().backward()
    return y.detach(), grads(models)


def plain_step(models, x, seed):
    for m in models:
        m.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    y = sum(m(x) for m in models)
    y.pow(2).sum().backward()
    return y.detach(), grads(models)


def assert_close(a, b):
    (ya, ga), (yb, gb) = a, b
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-5)
    for u, v in zip(ga, gb):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5)


def assert_equal(a, b):
    (ya, ga), (yb, gb) = a, b
    assert torch.equal(ya, yb)
    assert all(torch.equal(u, v) for u, v in zip(ga, gb))


@pytest.mark.parametrize("n_jobs", [1, 2, 4, None])
def test_dropout_draws_the_plain_loops_numbers_for_any_n_jobs(n_jobs):
    models = dropout_mlps()
    plain = copy.deepcopy(models)
    x = torch.randn(32, 8)
    for seed in range(3):  # the first call learns, the next ones reuse the plan
        kw = {} if n_jobs is None else {"n_jobs": n_jobs, "chunk_size": 1}
        assert_close(step(models, x, seed, **kw), plain_step(plain, x, seed))


def test_dropout_bits_do_not_depend_on_n_jobs():
    models = dropout_mlps()
    x = torch.randn(32, 8)
    runs = [step(models, x, seed, n_jobs=n, chunk_size=1) for seed in (0, 1) for n in (1, 2, 3)]
    for seed in (0, 1):
        first = runs[3 * seed]
        for other in runs[3 * seed + 1 : 3 * seed + 3]:
            assert_equal(first, other)


def test_bound_methods_with_dropout_draw_in_model_order():
    """Models that are not modules get no kept plan: their dropout layers are seen instead."""
    models = dropout_mlps()
    plain = copy.deepcopy(models)
    x = torch.randn(32, 8)
    for seed in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning: they ran in model order
            got = step(models, x, seed, [m.forward for m in models], n_jobs=2, chunk_size=1)
        assert_close(got, plain_step(plain, x, seed))


class FunctionalDropout(nn.Module):
    """Draws through torch.nn.functional, not a dropout layer: found by the first call."""

    def __init__(self, width):
        super().__init__()
        self.a, self.b = nn.Linear(8, width), nn.Linear(width, 4)

    def forward(self, x):
        return self.b(F.dropout(self.a(x).relu(), 0.5, self.training))


def test_functional_dropout_is_found_by_the_first_call():
    torch.manual_seed(0)
    models = [FunctionalDropout(12 + i) for i in range(5)]
    plain = copy.deepcopy(models)
    x = torch.randn(16, 8)
    for seed in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = step(models, x, seed, n_jobs=2, chunk_size=1)
        assert_close(got, plain_step(plain, x, seed))


class Slow(nn.Module):
    """Sleeps (the GIL released) so that each of two threads takes chunks, and records which
    threads ran it; draws random numbers from its ``draw_from``-th call on."""

    def __init__(self, seen, draw_from=None):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        # A function, not the set itself: a set the models write into would be state they
        # share, which keeps their forwards in model order (NOTE [ State the models share ]).
        self.record, self.draw_from, self.calls = seen.add, draw_from, 0

    def forward(self, x):
        self.record(threading.get_ident())
        self.calls += 1
        time.sleep(0.005)
        y = self.lin(x)
        if self.draw_from is not None and self.calls >= self.draw_from:
            y = y + torch.rand_like(y)
        return y


def test_models_that_draw_nothing_keep_their_forwards_on_the_threads():
    seen: set[int] = set()
    models = [Slow(seen) for _ in range(6)]
    x = torch.randn(4, 8)
    parsum.sum_models(models, x, n_jobs=2, chunk_size=1)  # learns: in model order
    assert seen == {threading.get_ident()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parsum.sum_models(models, x, n_jobs=2, chunk_size=1).sum().backward()
    assert len(seen) == 2


def test_a_model_that_starts_drawing_on_the_threads_warns_then_runs_in_model_order():
    seen: set[int] = set()
    models = [Slow(seen, draw_from=3) for _ in range(6)]
    x = torch.randn(4, 8)
    parsum.sum_models(models, x, n_jobs=2, chunk_size=1)
    parsum.sum_models(models, x, n_jobs=2, chunk_size=1)
    with pytest.warns(RuntimeWarning, match="not reproducible") as warned:
        parsum.sum_models(models, x, n_jobs=2, chunk_size=1).sum().backward()
    assert warned[0].filename == __file__  # the caller's line, not parsum's
    outs = []
    for n_jobs in (2, 1):
        torch.manual_seed(7)
        seen.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            outs.append(parsum.sum_models(models, x, n_jobs=n_jobs, chunk_size=1))
        assert seen == {threading.get_ident()}
    assert torch.equal(*outs)


# NOTE [ Models seen not to draw ]: members drawn at random each step make a new walk every call.


@pytest.mark.parametrize("as_methods", [False, True])
def test_a_new_set_of_models_seen_not_to_draw_runs_its_forwards_on_the_threads(as_methods):
    seen: set[int] = set()
    models = [Slow(seen) for _ in range(8)]
    calls = [m.forward for m in models] if as_methods else models
    x = torch.randn(4, 8)
    parsum.sum_models(calls, x, n_jobs=2, chunk_size=1)  # learns, in model order
    assert seen == {threading.get_ident()}
    seen.clear()
    members = calls[1:7]  # a set not seen before, of models seen not to draw
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = parsum.sum_models(members, x, n_jobs=2, chunk_size=1)
        y.sum().backward()
    assert len(seen) == 2
    torch.testing.assert_close(y, sum(m(x) for m in members))
    assert torch.equal(y, parsum.sum_models(members, x, n_jobs=1, chunk_size=1))


def test_a_new_set_with_a_model_not_seen_before_learns_in_model_order():
    seen: set[int] = set()
    models = [Slow(seen) for _ in range(8)]
    x = torch.randn(4, 8)
    parsum.sum_models(models[:6], x, n_jobs=2, chunk_size=1)
    seen.clear()
    parsum.sum_models(models[2:], x, n_jobs=2, chunk_size=1)  # models 6 and 7 are new
    assert seen == {threading.get_ident()}


def test_models_seen_not_to_draw_in_training_learn_again_in_eval_mode():
    seen: set[int] = set()
    models = [Slow(seen) for _ in range(6)]
    x = torch.randn(4, 8)
    parsum.sum_models(models, x, n_jobs=2, chunk_size=1)
    for m in models:
        m.eval()
    seen.clear()
    parsum.sum_models(models[:5], x, n_jobs=2, chunk_size=1)
    assert seen == {threading.get_ident()}


def test_a_model_seen_not_to_draw_that_draws_in_a_new_set_warns_and_learns_again():
    seen: set[int] = set()
    models = [Slow(seen, draw_from=2) for _ in range(6)]
    x = torch.randn(4, 8)
    parsum.sum_models(models, x, n_jobs=2, chunk_size=1)  # their first calls draw nothing
    with pytest.warns(RuntimeWarning, match="not reproducible") as warned:
        parsum.sum_models(models[:5], x, n_jobs=2, chunk_size=1)  # on the threads; they draw
    assert warned[0].filename == __file__
    # No longer marked: another new set learns in model order, and draws the numbers of
    # n_jobs=1, without a warning.
    seen.clear()
    outs = []
    for n_jobs in (2, 1):
        torch.manual_seed(3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            outs.append(parsum.sum_models(models[1:], x, n_jobs=n_jobs, chunk_size=1))
    assert seen == {threading.get_ident()}
    assert torch.equal(*outs)


class LoggedNoise(nn.Module):
    """Logs into a list the models share (which runs the forwards in model order) and adds
    noise in a checkpointed block once ``noisy`` is set."""

    def __init__(self, log, width):
        super().__init__()
        self.log, self.noisy = log, False
        self.lin, self.out = nn.Linear(8, width), nn.Linear(width, 4)

    def block(self, x):
        h = torch.tanh(self.lin(x))
        return F.dropout(h, 0.5, training=True) if self.noisy else h

    def forward(self, x):
        self.log.append(len(self.log))
        return self.out(checkpoint(self.block, x, use_reentrant=False))


def test_checkpointed_models_that_start_drawing_in_model_order_recompute_the_masks():
    """Forwards in model order (they write a shared log) were not watched for draws once a walk
    had seen none: models that then draw, and recompute in backward, were pulled back on the
    threads, each recomputation setting the global generator under the other's."""
    models = [LoggedNoise([], 16 + i) for i in range(8)]
    log = models[0].log
    for m in models:
        m.log = log
    twins = copy.deepcopy(models)
    x = torch.randn(32, 8)
    step(models, x, 0, n_jobs=2, chunk_size=1)  # learns: no draws, writes the log
    for m in (*models, *twins):
        m.noisy = True  # a new walk over the same models, which starts from what they did
    for seed in range(3):
        assert_close(step(models, x, seed, n_jobs=2, chunk_size=1), plain_step(twins, x, seed))


def test_a_first_draw_in_model_order_is_learned_without_a_warning():
    """Forwards in model order (a log the models share) whose pullbacks run on the threads are
    watched: models seen not to draw that start drawing are learned there, without a warning,
    with the numbers of n_jobs=1."""
    models = [LoggedNoise([], 16 + i) for i in range(6)]
    for m in models:
        m.log = models[0].log
    x = torch.randn(8, 8)
    parsum.sum_models(models, x, n_jobs=2, chunk_size=1)  # no draws; writes the log
    for m in models:
        m.noisy = True
    outs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n_jobs in (2, 2, 1):
            torch.manual_seed(5)
            outs.append(parsum.sum_models(models, x, n_jobs=n_jobs, chunk_size=1))
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[2])


def kept_walk(models):
    """The walk a call on ``models`` keeps; the call marks them quiet (they draw nothing)."""
    parsum.sum_models(models, torch.randn(2, 2), n_jobs=1)
    return _plans.known_walk(models)


def test_quiet_marks_hold_no_model_and_stay_bounded(monkeypatch):
    monkeypatch.setattr(_plans, "MAX_QUIET", 4)
    monkeypatch.setattr(_plans, "_quiet", {})
    models = [nn.Linear(2, 2) for _ in range(3)]
    walk = kept_walk(models)
    assert walk.all_quiet(models)
    modes, walk.model_modes = walk.model_modes, [(False,)] * 3
    assert not walk.all_quiet(models)  # training flags other than those marked
    walk.model_modes = modes
    kept_walk([nn.Linear(2, 2) for _ in range(3)])  # 6 > 4: cleared first
    assert len(_plans._quiet) == 3 and not walk.all_quiet(models)
    gone = nn.Linear(2, 2)
    ref = weakref.ref(gone)
    kept_walk([gone])
    del gone
    gc.collect()
    assert ref() is None  # the mark did not keep it alive
    # A walk for one call (a callable that is not a module or a module's method): never quiet
    assert not _plans.Walk([], [], [], [], False).all_quiet([print])


class Checkpointed(nn.Module):
    def __init__(self, width, reentrant):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(16, width), nn.ReLU(), nn.Dropout(0.5), nn.Linear(width, 4)
        )
        self.reentrant = reentrant

    def forward(self, x):
        return checkpoint(self.body, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("route", ["callers graph", "ParallelSum"])
def test_checkpointed_dropout_recomputes_the_forwards_masks(reentrant, route, monkeypatch):
    """Recomputations on two threads at once set the global generator under each other: the
    masks drawn again were not the forward's, and the gradients wrong."""
    torch.manual_seed(0)
    models = [Checkpointed(128 + 16 * i, reentrant) for i in range(8)]
    plain = copy.deepcopy(models)
    if route == "ParallelSum":
        monkeypatch.setattr(parsum._api, "fits_callers_graph", lambda *a: False)
    if reentrant and route == "ParallelSum":
        pytest.skip("reentrant checkpointing refuses torch.autograd.grad, which ParallelSum uses")
    x = torch.randn(256, 16, requires_grad=reentrant)  # reentrant: an input that needs a grad
    for seed in range(3):
        assert_close(step(models, x, seed, n_jobs=2, chunk_size=1), plain_step(plain, x, seed))
        x.grad = None


def test_may_recompute_sees_checkpoints_only():
    body = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    x = torch.randn(3, 4, requires_grad=True)
    assert not _random.may_recompute([body(x).grad_fn])
    assert _random.may_recompute([checkpoint(body, x, use_reentrant=False).grad_fn])
    assert _random.may_recompute([checkpoint(body, x, use_reentrant=True).grad_fn])
    assert not _random.may_recompute([None])


def test_eval_mode_runs_the_forwards_on_the_threads_again():
    """A walk holds for one set of training flags: in eval mode dropout draws nothing."""
    seen: set[int] = set()

    class SlowDropout(Slow):
        def __init__(self):
            super().__init__(seen)
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(super().forward(x))

    models = [SlowDropout() for _ in range(6)]
    x = torch.randn(4, 8)
    for _ in range(2):
        parsum.sum_models(models, x, n_jobs=2, chunk_size=1)
    assert seen == {threading.get_ident()}
    for m in models:
        m.eval()
    parsum.sum_models(models, x, n_jobs=2, chunk_size=1)
    parsum.sum_models(models, x, n_jobs=2, chunk_size=1)
    assert len(seen) == 2


def test_calls_planned_anew_that_draw_are_pulled_back_on_one_thread(monkeypatch):
    """A plan made for one call (models given as partials) does not look for checkpoints in the
    graph: where the forwards drew, the pullbacks run on one thread, checkpointed or not. Bound
    methods, like modules, have a kept plan, which looked (NOTE [ Reused plans ])."""
    from parsum import _pool

    workers = []
    run_ordered = _pool.run_ordered

    def spy(task, n_tasks, n_workers, consume, *rest):
        workers.append(n_workers)
        return run_ordered(task, n_tasks, n_workers, consume, *rest)

    monkeypatch.setattr(_pool, "run_ordered", spy)
    models = dropout_mlps()
    x = torch.randn(32, 8)
    for _ in range(2):
        step(models, x, 0, [functools.partial(m) for m in models], n_jobs=2, chunk_size=1)
    assert workers == []  # forwards in model order, pullbacks on one thread: no job
    for calls in ([m.forward for m in models], None):  # kept plans, which looked: none
        step(models, x, 0, calls, n_jobs=2, chunk_size=1)
        assert workers[-1] == 2
        del workers[:]


def test_checkpointing_turned_on_by_an_attribute_is_seen():
    """A module's own attribute renews the plan, which looks for checkpoints again."""

    class Switchable(Checkpointed):
        def __init__(self, width):
            super().__init__(width, reentrant=False)
            self.use_checkpoint = False

        def forward(self, x):
            return super().forward(x) if self.use_checkpoint else self.body(x)

    torch.manual_seed(0)
    models = [Switchable(128 + 16 * i) for i in range(8)]
    plain = copy.deepcopy(models)
    x = torch.randn(256, 16)
    assert_close(step(models, x, 0, n_jobs=2, chunk_size=1), plain_step(plain, x, 0))
    for m in (*models, *plain):
        m.use_checkpoint = True
    for seed in (1, 2):
        assert_close(step(models, x, seed, n_jobs=2, chunk_size=1), plain_step(plain, x, seed))


def forward_workers_of(monkeypatch):
    """The n_workers of every forward job run_forward starts, in order."""
    from parsum import _pool

    seen = []
    run_ordered = _pool.run_ordered

    def spy(task, n_tasks, n_workers, consume, *rest):
        if task.__name__ == "forward_chunk":
            seen.append(n_workers)
        return run_ordered(task, n_tasks, n_workers, consume, *rest)

    monkeypatch.setattr(_pool, "run_ordered", spy)
    return seen


@pytest.mark.parametrize("threads", [1, 2])
def test_noise_drawn_beforehand_is_f_dropouts(threads):
    """NOTE [ Dropout drawn beforehand ]: torch's CPU dropout is the input times noise that
    bernoulli_ draws; the same draws at any intra-op thread count."""
    from parsum._engines import DirectProgram

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layer = nn.Dropout(0.3)
        x = torch.randn(64, 700)
        program = DirectProgram([lambda: layer])
        torch.manual_seed(5)
        want = F.dropout(x, 0.3, True)
        torch.manual_seed(5)
        (noise,) = _random.draw_noise(program, [(x.shape, x.dtype, x.device, True)])
        assert torch.equal(x * noise, want)
    finally:
        torch.set_num_threads(saved)


def test_dropout_forwards_run_on_the_threads_once_their_shapes_are_known(monkeypatch):
    workers = forward_workers_of(monkeypatch)
    models = dropout_mlps()
    plain = copy.deepcopy(models)
    x = torch.randn(32, 8)
    for seed in range(3):
        assert_close(step(models, x, seed, n_jobs=2, chunk_size=1), plain_step(plain, x, seed))
    assert workers == [1, 2, 2]  # the first call records the noise's shapes, in model order
    x16 = torch.randn(16, 8)  # another input shape: recorded first
    for seed in range(2):
        assert_close(step(models, x16, seed, n_jobs=2, chunk_size=1), plain_step(plain, x16, seed))
    assert workers[3:] == [1, 2]
    assert_close(step(models, x, 9, n_jobs=2, chunk_size=1), plain_step(plain, x, 9))
    assert workers[5:] == [2]


def _dropout_of_p_0_7(self, x):  # Monte Carlo dropout's: drops in eval mode too
    return torch.nn.functional.dropout(x, 0.7, training=True)


_ORIGINAL_DROPOUT = torch.nn.functional.dropout


def _halved_dropout(x, p=0.5, training=True, inplace=False):
    return _ORIGINAL_DROPOUT(x, p, training, inplace) / 2


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("replaced", ["nn.Dropout.forward", "F.dropout"])
@pytest.mark.parametrize("n_jobs", [1, 2, None])
def test_dropout_replaced_on_the_class_or_in_functional_is_run(
    replaced, n_jobs, training, monkeypatch
):
    # NOTE [ torch.nn's calls replaced ] in parsum._torch_calls: noise drawn beforehand stood in
    # for nn.Dropout's forward (4 MLPs whose dropout's forward was replaced by one of p 0.7: off
    # by 2.9, silently).
    models = dropout_mlps()
    for m in models:
        m.train(training)
    plain = copy.deepcopy(models)
    x = torch.randn(32, 8)
    for seed in range(2):  # a plan that draws beforehand
        step(models, x, seed, n_jobs=n_jobs)
    if replaced == "nn.Dropout.forward":
        monkeypatch.setattr(nn.Dropout, "forward", _dropout_of_p_0_7)
    else:
        monkeypatch.setattr(torch.nn.functional, "dropout", _halved_dropout)
    for seed in range(2, 4):
        assert_close(step(models, x, seed, n_jobs=n_jobs), plain_step(plain, x, seed))


def test_dropout_whose_p_changes_draws_the_plain_loops_numbers():
    """p is read when the noise is drawn; at 0 (or 1) F.dropout draws nothing."""
    models = dropout_mlps()
    plain = copy.deepcopy(models)
    x = torch.randn(32, 8)
    for seed, p in enumerate([0.5, 0.2, 0.0, 1.0, 0.7]):
        for m in (*models, *plain):
            m[2].p = p if m is not models[1] and m is not plain[1] else 0.5
        assert_close(step(models, x, seed, n_jobs=2, chunk_size=1), plain_step(plain, x, seed))


def test_in_place_dropout_runs_in_model_order(monkeypatch):
    workers = forward_workers_of(monkeypatch)
    torch.manual_seed(0)
    models = [  # after a Linear, which does not save its output for backward
        nn.Sequential(nn.Linear(8, 16 + i), nn.Dropout(0.5, inplace=True), nn.Linear(16 + i, 4))
        for i in range(6)
    ]
    plain = copy.deepcopy(models)
    x = torch.randn(32, 8)
    for seed in range(3):
        assert_close(step(models, x, seed, n_jobs=2, chunk_size=1), plain_step(plain, x, seed))
    assert workers == []  # every call in model order, on the budget's threads: no job


def test_noise_that_does_not_fit_warns_and_runs_in_model_order_after(monkeypatch):
    from parsum import _plans

    workers = forward_workers_of(monkeypatch)
    models = dropout_mlps()
    plain = copy.deepcopy(models)
    x = torch.randn(32, 8)
    step(models, x, 0, n_jobs=2, chunk_size=1)
    walk = _plans.known_walk(models)
    for shapes in walk.noise_shapes.values():  # as if the layers' inputs had changed dtype
        shapes[3] = [(s, torch.float64, d, c) for s, _, d, c in shapes[3]]
    with pytest.warns(RuntimeWarning, match="not reproducible"):
        step(models, x, 1, n_jobs=2, chunk_size=1)
    assert workers == [1, 2]
    for seed in (2, 3):
        assert_close(step(models, x, seed, n_jobs=2, chunk_size=1), plain_step(plain, x, seed))
    assert workers[2:] == []  # in model order from then on, on the budget's threads


class Wrapped(nn.Module):
    """An MLP with dropout inside a module of the user's: no direct program. Records the
    intra-op threads its forwards run on."""

    def __init__(self, width, threads_seen):
        super().__init__()
        self.inner = nn.Sequential(
            nn.Linear(8, width),
            nn.Tanh(),
            nn.Dropout(0.5),
            nn.Linear(width, 256),
            nn.Tanh(),
            nn.Linear(256, 4),
        )
        # A function: a list the models held would be state they write into (NOTE [ State
        # the models share ] in parsum._engines), which their first call learns in order.
        self.record = threads_seen.append

    def forward(self, x):
        self.record(torch.get_num_threads())
        return self.inner(x)


@pytest.mark.parametrize("n_jobs", [None, 2])
def test_other_models_that_draw_run_forwards_in_order_on_the_budget_and_pullbacks_on_workers(
    monkeypatch, cores, n_jobs
):
    """Their forwards one at a time on the whole budget's intra-op threads (the same for any
    n_jobs), their pullbacks on the workers."""
    from parsum import _grouping, _pool

    cores(2)
    # A chunk a model (2 a thread would cut 4: NOTE [ Chunks a thread ])
    monkeypatch.setattr(_grouping, "CHUNKS_PER_THREAD", _grouping.MAX_CHUNKS)
    jobs = []
    run_ordered, start_ordered = _pool.run_ordered, _pool.start_ordered

    def spy(task, n_tasks, n_workers, consume, *rest):
        jobs.append((task.__name__, n_tasks, n_workers))
        return run_ordered(task, n_tasks, n_workers, consume, *rest)

    def spy_start(task, n_tasks, n_workers, consume, *rest):  # joined later
        jobs.append((task.__name__, n_tasks, n_workers))
        return start_ordered(task, n_tasks, n_workers, consume, *rest)

    monkeypatch.setattr(_pool, "run_ordered", spy)
    monkeypatch.setattr(_pool, "start_ordered", spy_start)
    threads: list[int] = []
    torch.manual_seed(0)
    models = [Wrapped(256 + i, threads) for i in range(8)]  # without dropout: on 2 workers
    plain = copy.deepcopy(models)
    for m in plain:
        m.record = [].append  # deepcopy keeps a builtin method as it is
    x = torch.randn(128, 8)
    for seed in range(2):
        threads.clear()
        assert_close(step(models, x, seed, n_jobs=n_jobs), plain_step(plain, x, seed))
        assert threads == [2] * len(models)
    assert not any(name == "forward_chunk" for name, _, _ in jobs)
    assert [(n, w) for name, n, w in jobs if name != "forward_chunk"] == [(8, 2), (8, 2)]


def test_turns_come_in_chunk_order_and_a_broken_wait_ends_the_later_ones():
    turns = _random.Turns()
    order = []

    def chunk(k):
        turns.wait(k)
        order.append(k)
        turns.done(k)

    threads = [threading.Thread(target=chunk, args=(k,)) for k in (3, 1, 2, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert order == [0, 1, 2, 3]

    broken = _random.Turns()
    errors = []

    def later():
        try:
            broken.wait(2)
        except RuntimeError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=later)
    waiter.start()
    deadline = time.monotonic() + 10
    while 2 not in broken._turns and time.monotonic() < deadline:  # it waits for turn 2
        time.sleep(0.001)

    class Interrupted:  # chunk 1 is interrupted while it waits for chunk 0
        def wait(self):
            raise KeyboardInterrupt

    turn = broken._turn
    broken._turn = lambda k: Interrupted() if k == 1 else turn(k)
    with pytest.raises(KeyboardInterrupt):
        broken.wait(1)
    waiter.join(timeout=10)
    assert not waiter.is_alive() and "never came" in str(errors[0])


def test_concurrent_callers_with_dropout_finish():
    """Each call has its own turns: callers on the same models at once neither deadlock nor
    fail (their draws interleave, as two threads' plain loops would)."""
    models, others = dropout_mlps(), dropout_mlps()
    x = torch.randn(32, 8)
    errors = []

    def caller(ms):
        try:
            for _ in range(10):
                parsum.sum_models(ms, x, n_jobs=2, chunk_size=1).pow(2).sum().backward()
        except Exception as exc:  # the test asserts on it
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(m,)) for m in (models, models, others)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)


def test_dropout_with_step_in_backward_draws_beforehand(monkeypatch):
    """StepInBackward's own hooks leave the models direct programs: their noise is drawn
    beforehand, and the steps equal the plain loop's."""
    workers = forward_workers_of(monkeypatch)
    models = dropout_mlps()
    plain = copy.deepcopy(models)
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.01)
    opt = torch.optim.SGD([p for m in plain for p in m.parameters()], lr=0.01)
    x = torch.randn(32, 8)
    for seed in range(3):
        torch.manual_seed(seed)
        parsum.sum_models(models, x, n_jobs=2, chunk_size=1, step_in_backward=sib).pow(
            2
        ).mean().backward()
        torch.manual_seed(seed)
        sum(m(x) for m in plain).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for a, b in zip(models, plain):
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert workers == [1, 2, 2]


def test_dropout_of_p_0_draws_nothing_until_its_p_changes(monkeypatch):
    """An nn.Dropout(0.0) (many models' default) keeps the forwards on the threads; a p raised
    later makes a new plan, which draws in model order, with no warning."""
    workers = forward_workers_of(monkeypatch)
    torch.manual_seed(0)
    models = [
        Wrapped(64 + i, [])
        for i in range(6)  # modules of their own: no noise drawn beforehand
    ]
    for m in models:
        m.inner[2].p = 0.0
    plain = copy.deepcopy(models)
    x = torch.randn(32, 8)
    for seed in range(3):
        assert_close(step(models, x, seed, n_jobs=2, chunk_size=1), plain_step(plain, x, seed))
    assert workers == [1, 2, 2]  # the first call learns that they draw nothing
    for m in (*models, *plain):
        m.inner[2].p = 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in range(3, 5):
            assert_close(step(models, x, seed, n_jobs=2, chunk_size=1), plain_step(plain, x, seed))
    assert workers[3:] == []  # in model order on the budget's threads: no forward job


class OwnNoise(nn.Module):
    """Adds noise drawn from a ``torch.Generator`` it holds (seeded for reproducibility, as
    users write): one shared by the ensemble, or each model's own. Sleeps (the GIL released)
    so that two threads run forwards at once."""

    def __init__(self, width, generator, sleep=0.002):
        super().__init__()
        self.lin = nn.Linear(8, width)
        self.out = nn.Linear(width, 4)
        self.generator, self.sleep = generator, sleep

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        time.sleep(self.sleep)
        return self.out(h + 0.1 * torch.randn(h.shape, generator=self.generator))


def own_noise_models(shared, identical=False):
    torch.manual_seed(0)
    one = torch.Generator().manual_seed(5)
    gens = [one if shared else torch.Generator().manual_seed(5 + i) for i in range(6)]
    return [OwnNoise(16 if identical else 16 + i, g) for i, g in enumerate(gens)]


def generator_steps(models, x, n_jobs, calls=3):
    """Three calls' outputs and gradients, and the generators' states after them."""
    runs = []
    for _ in range(calls):
        for m in models:
            m.zero_grad(set_to_none=True)
        if n_jobs == "plain":
            y = sum(m(x) for m in models)
        else:
            y = parsum.sum_models(models, x, **({} if n_jobs is None else {"n_jobs": n_jobs}))
        y.pow(2).sum().backward()
        runs.append((y.detach(), grads(models)))
    states = [m.generator.get_state() for m in models]
    return runs, states


@pytest.mark.parametrize("identical", [False, True], ids=["distinct", "identical"])
@pytest.mark.parametrize("n_jobs", [1, 2, 3, None])
def test_a_generator_the_models_share_is_drawn_from_in_model_order(n_jobs, identical):
    """Models that draw from one ``torch.Generator`` of their own (not the global one, whose
    state the first call compares) take its numbers in the plain loop's order on every call:
    on the threads, they took them in the threads' order from the second call on, silently."""
    x = torch.randn(16, 8)
    want, want_states = generator_steps(own_noise_models(True, identical), x, "plain")
    got, states = generator_steps(own_noise_models(True, identical), x, n_jobs)
    for a, b in zip(got, want):
        assert_close(a, b)
    assert all(torch.equal(s, t) for s, t in zip(states, want_states))


def test_models_with_generators_of_their_own_keep_their_forwards_on_the_threads(monkeypatch):
    workers = forward_workers_of(monkeypatch)
    x = torch.randn(16, 8)
    want, want_states = generator_steps(own_noise_models(False), x, "plain")
    got, states = generator_steps(own_noise_models(False), x, 2)
    for a, b in zip(got, want):
        assert_close(a, b)
    assert all(torch.equal(s, t) for s, t in zip(states, want_states))
    assert workers == [1, 2, 2]  # the first call learns that the global generator is unused


class OtherNoise(OwnNoise):
    """Adds noise drawn from a Python or NumPy generator it holds (augmentation in forward)."""

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        time.sleep(self.sleep)
        g = self.generator
        if isinstance(g, random.Random):
            noise = [g.gauss(0.0, 1.0) for _ in range(h.shape[1])]
        elif isinstance(g, np.random.Generator):
            noise = g.normal(size=h.shape[1]).tolist()
        else:
            noise = g.normal(size=h.shape[1]).tolist()  # a RandomState
        return self.out(h + 0.1 * torch.tensor(noise))


@pytest.mark.parametrize("kind", ["random.Random", "numpy.Generator", "numpy.RandomState"])
@pytest.mark.parametrize("n_jobs", [1, 2])
def test_a_python_or_numpy_generator_the_models_share_is_drawn_from_in_model_order(n_jobs, kind):
    def make():
        one = {
            "random.Random": lambda: random.Random(5),
            "numpy.Generator": lambda: np.random.default_rng(5),
            "numpy.RandomState": lambda: np.random.RandomState(5),
        }[kind]()
        torch.manual_seed(0)
        return [OtherNoise(16 + i, one) for i in range(6)]

    x = torch.randn(16, 8)
    models, plain = make(), make()
    for _ in range(3):
        got = parsum.sum_models(models, x, n_jobs=n_jobs)
        torch.testing.assert_close(got, sum(m(x) for m in plain), rtol=1e-5, atol=1e-5)


class NoiseFrom(OwnNoise):
    """Draws from the generator the call passes."""

    def forward(self, x, generator):
        h = torch.tanh(self.lin(x))
        time.sleep(self.sleep)
        return self.out(h + 0.1 * torch.randn(h.shape, generator=generator))


@pytest.mark.parametrize("n_jobs", [1, 2, None])
def test_a_generator_passed_to_every_model_is_drawn_from_in_model_order(n_jobs):
    torch.manual_seed(0)
    models = [NoiseFrom(16 + i, None) for i in range(6)]
    plain = copy.deepcopy(models)
    x = torch.randn(16, 8)
    gens = [torch.Generator().manual_seed(3) for _ in range(2)]
    kw = {} if n_jobs is None else {"n_jobs": n_jobs}
    for _ in range(3):
        got = parsum.sum_models(models, x, generator=gens[0], **kw)
        want = sum(m(x, generator=gens[1]) for m in plain)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(gens[0].get_state(), gens[1].get_state())


class _MyDropout(nn.Dropout):
    """A user's dropout class: it draws as its base does."""


@pytest.mark.parametrize("training", [True, False])
def test_a_new_sets_dropout_questions_read_the_layers_that_may_draw_alone(training):
    # A new set asks its modules three questions about dropout; they are asked of the modules
    # whose classes may draw alone (layers_that_may_draw), and must answer as over every module.
    cases = [
        [nn.Linear(3, 3), nn.Tanh()],
        [nn.Linear(3, 3), nn.Dropout(0.2), nn.ReLU()],
        [nn.Dropout(0.0), nn.Linear(3, 3)],
        [_MyDropout(0.3), nn.Linear(3, 3)],
        [nn.RReLU(), nn.Dropout(0.5, inplace=True)],
        [nn.Dropout1d(0.1), nn.AlphaDropout(0.0), nn.Sequential(nn.Linear(2, 2))],
    ]
    for modules in cases:
        for m in modules:
            m.train(training)
        kept = _random.layers_that_may_draw(modules)
        assert all(m in modules for m in kept)
        assert _random.has_drawing_layers(kept) == _random.has_drawing_layers(modules)
        assert _random.draws_only_dropout(kept) == _random.draws_only_dropout(modules)
        assert _random.idle_dropout(kept) == _random.idle_dropout(modules)
    assert _random.layers_that_may_draw([nn.Linear(3, 3), nn.Tanh()]) == []
    mine = _MyDropout(0.3)
    assert _random.layers_that_may_draw([nn.Linear(3, 3), mine]) == [mine]


def test_a_new_set_of_a_users_dropout_class_is_seen_drawing():
    # Through sum_models: a set planned anew whose models hold a subclass of nn.Dropout runs
    # its forwards as the plain loop draws them, for any n_jobs.
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), _MyDropout(0.5), nn.Linear(8, 2)) for _ in range(6)]
    x = torch.randn(5, 4)
    for n_jobs in (1, 2):
        for members in ([0, 2, 4], [1, 3, 5], [0, 1, 5]):
            drawn = [models[i] for i in members]
            torch.manual_seed(7)
            got = parsum.sum_models(drawn, x, n_jobs=n_jobs)
            torch.manual_seed(7)
            want = sum(m(x) for m in drawn)
            assert torch.allclose(got, want, atol=1e-6)
