"""NOTE [ Pullbacks joined later ] in parsum._function: a node whose gradients all go into
``.grad`` hands its pullbacks to the helpers, and the caller joins them in the node right after
the parameters' AccumulateGrads: the bits of one thread, failures undone and named."""

import copy
import threading

import pytest
import torch
from torch import nn

import parsum
from parsum import _engines, _function, _pool
from tests.test_callers_graph import _ARMED, _FlakyHead, _FlakyInside
from tests.test_differential import _RaiseInBackward
from tests.test_errors import BoomBackward
from tests.zoo import IN, OUT, mlp, param_grads

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def any_size(monkeypatch):
    """Small models hand their pullbacks over too (JOIN_LATER_PARAMS is 128 parameters)."""
    monkeypatch.setattr(_function, "JOIN_LATER_PARAMS", 0)


@pytest.fixture
def handed_over(monkeypatch):
    """The jobs started for the caller to join later, and how many were joined."""
    seen = {"started": 0, "joined": 0}
    start_ordered, join = _pool.start_ordered, _pool.join

    def spy_start(*args):
        job = start_ordered(*args)
        seen["started"] += job is not None
        return job

    def spy_join(job):
        seen["joined"] += 1
        join(job)

    monkeypatch.setattr(_pool, "start_ordered", spy_start)
    monkeypatch.setattr(_pool, "join", spy_join)
    return seen


def heterogeneous():
    return [mlp([4 + i, 3 + i]) for i in range(6)]  # different: none stacked


def with_stacked():
    # Four identical MLPs make a stacked group, beside other models, on any budget (three
    # Linear layers: NOTE [ Small groups of few layers ] in parsum._grouping).
    return [*(mlp([5, 5]) for _ in range(4)), mlp([7, 3]), mlp([9])]


@pytest.fixture(autouse=True)
def through_parallel_sum(request, monkeypatch):
    """The "stacked, ParallelSum" path: stacked groups beside other models through ParallelSum,
    as calls that the caller's graph cannot take run them (a process group's failure
    announcements, a parameter used by two models)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("path") == "stacked, ParallelSum":
        monkeypatch.setattr(parsum._api, "fits_callers_graph", lambda plan: False)


PATHS = {
    "caller's graph": (heterogeneous, {}, "CallerGraphSumBackward"),
    "stacked": (with_stacked, {}, "CallerGraphSumBackward"),
    "stacked, ParallelSum": (with_stacked, {}, "ParallelSumBackward"),
    "vjp": (heterogeneous, {"engine": "vjp"}, "ParallelSumBackward"),
}


def two_copies(path, seed=0):
    """The path's models, a copy of them, an input and the call's keyword arguments."""
    make, kwargs, _ = PATHS[path]
    torch.manual_seed(seed)
    models = make()
    return models, copy.deepcopy(models), torch.randn(16, IN), kwargs


def clear_grads(models):
    for p in (p for m in models for p in m.parameters()):
        p.grad = None


def grads_after(models, x, n_jobs, times=1, **kwargs):
    """The parameters' gradients after ``times`` backwards of the sum's mean square."""
    clear_grads(models)
    for _ in range(times):
        y = parsum.sum_models(models, x, n_jobs=n_jobs, **kwargs)
        y.pow(2).mean().backward()
    return [g.clone() for g in param_grads(models)], y


@pytest.mark.parametrize("path", PATHS)
def test_handed_over_and_joined_with_the_bits_of_one_thread(path, handed_over, cores):
    cores(2)
    models, alone, x, kwargs = two_copies(path)
    # The second call adds to gradients already there: not handed over (captured).
    got, y = grads_after(models, x, 2, times=2, **kwargs)
    assert type(y.grad_fn).__name__ == PATHS[path][2]
    assert handed_over == {"started": 1, "joined": 1}
    want, _ = grads_after(alone, x, 1, times=2, **kwargs)
    assert handed_over["started"] == 1  # one thread: nothing handed over
    assert len(got) == len(want) == sum(1 for m in models for _ in m.parameters())
    for g, w in zip(got, want):
        assert torch.equal(g, w) and g.stride() == w.stride()
    # And the plain loop's gradients, within rounding.
    plain = copy.deepcopy(alone)
    clear_grads(plain)
    for _ in range(2):
        sum(m(x) for m in plain).pow(2).mean().backward()
    for g, w in zip(got, param_grads(plain)):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("made", ["before", "after"])
@pytest.mark.parametrize("path", PATHS)
def test_gradients_from_outside_the_sum_add_to_its_own(path, made, handed_over, cores):
    # Two more gradients for every parameter. From nodes made before the sum, the engine adds
    # them together, then to the sum's in .grad, on several threads as on one (returned by the
    # node, the sum's would have been added to them in the engine's buffer: other bits). From
    # nodes made after it, the engine accumulates them right after the node, while the helpers
    # pull back: the gradients the node stores itself (stacked, vjp), written by a helper, had
    # raced the engine's (found by tests/test_differential.py); the caller stores them, at the
    # join.
    cores(2)
    models, alone, x, kwargs = two_copies(path, seed=1)

    def outside(params):
        return 0.3 * sum(p.pow(2).sum() for p in params) + 0.7 * sum(p.sin().sum() for p in params)

    def step(models, n_jobs):
        clear_grads(models)
        params = [p for m in models for p in m.parameters()]
        before = outside(params) if made == "before" else 0
        y = parsum.sum_models(models, x, n_jobs=n_jobs, **kwargs)
        after = outside(params[::2]) if made == "after" else 0
        (y.pow(2).mean() + before + after).backward()
        return [p.grad for p in params]

    for _ in range(3):
        got, want = step(models, 2), step(alone, 1)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert handed_over["started"] == handed_over["joined"] == 3


def flat_grad_step(models, flat, x, n_jobs, penalty="after"):
    """One step of docs/gradients.md's loop, with an L2 term of the loss outside the sum made
    before or after it (``penalty``): gradients into unset ``.grad`` of FlatGrad slots
    (``zero_grad()`` left None)."""
    params = [p for m in models for p in m.parameters()]

    def l2():
        return 1e-3 * sum(p.pow(2).sum() for p in params)

    before = l2() if penalty == "before" else 0
    y = parsum.sum_models(models, x, n_jobs=n_jobs)
    loss = y.pow(2).mean() + before
    if penalty == "after":
        loss = loss + l2()
    loss.backward()
    grads = [p.grad.clone() for p in params]
    assert all(p.grad is v for p, v in zip(params, flat_views(flat)))  # in the slots
    for p in params:
        p.grad = None
    return grads


def flat_views(flat):
    return [slot.view for slot in flat._slots]


@pytest.mark.parametrize("penalty", ["after", "before"])
def test_flat_grad_slots_filled_at_the_join_beside_a_term_outside_the_sum(
    penalty, handed_over, cores
):
    # NOTE [ Slots filled after the join ] in parsum._grads: the FlatGrad's hook moving a fresh
    # gradient into its slot wrote .grad while the engine in the calling thread accumulated the
    # L2 term's gradient into it: gradients lost, or a segmentation fault (found by
    # tests/test_differential.py; each of 6 runs of this loop failed before, 2 by a crash).
    cores(2)
    torch.manual_seed(3)
    models = [mlp([8 + i % 5, 4 + i % 3]) for i in range(12)]
    alone = copy.deepcopy(models)
    flat, flat_alone = parsum.FlatGrad(models), parsum.FlatGrad(alone)
    for p in (p for m in [*models, *alone] for p in m.parameters()):
        p.grad = None  # as optimizer.zero_grad() leaves them
    x = torch.randn(16, IN)
    for _ in range(100):
        got = flat_grad_step(models, flat, x, 2, penalty)
        want = flat_grad_step(alone, flat_alone, x, 1, penalty)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert handed_over["started"] == handed_over["joined"] == 100
    assert not flat._held


class SparseRows(nn.Module):
    """Rows of a table with sparse gradients (``nn.Embedding(sparse=True)``), scaled by x."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(10, OUT, sparse=True)
        self.rows = torch.tensor([1, 3, 3, 7])

    def forward(self, x):
        return x[:, :1] * self.table(self.rows).sum(0)


def test_flat_grad_slots_filled_at_the_join_with_a_sparse_gradient(handed_over, cores):
    # The slots filled after the join are copied in one foreach call; a sparse gradient
    # (nn.Embedding(sparse=True)) beside them is densified into its slot on its own.
    cores(2)
    torch.manual_seed(5)
    models = [*(mlp([8 + i % 5, 4 + i % 3]) for i in range(6)), SparseRows()]
    alone = copy.deepcopy(models)
    flat, flat_alone = parsum.FlatGrad(models), parsum.FlatGrad(alone)
    x = torch.randn(16, IN)
    for _ in range(3):
        for p in (p for m in [*models, *alone] for p in m.parameters()):
            p.grad = None
        got = flat_grad_step(models, flat, x, 2, "after")
        want = flat_grad_step(alone, flat_alone, x, 1, "after")
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert models[-1].table.weight.grad is None  # flat_grad_step set it back
    assert handed_over["started"] == handed_over["joined"] == 3
    assert not flat._held


def test_a_failure_with_flat_grad_slots_held_sets_them_back(handed_over, cores):
    cores(2)
    torch.manual_seed(4)
    models = heterogeneous()
    flat = parsum.FlatGrad(models)
    x = torch.randn(16, IN)
    flat_grad_step(models, flat, x, 2)  # the slots hold a gradient; every .grad None
    before = flat.flat.clone()
    models.insert(4, BoomBackward())
    y = parsum.sum_models(models, x, n_jobs=2)
    loss = y.pow(2).mean() + sum(p.pow(2).sum() for p in flat.params)
    with pytest.raises(parsum.ParsumError, match=r"model 4 \(BoomBackward\)"):
        loss.backward()
    assert handed_over == {"started": 2, "joined": 2}
    assert all(p.grad is None for p in flat.params) and torch.equal(flat.flat, before)
    assert not flat._held
    del models[4]
    flat_grad_step(models, flat, x, 2)  # the hooks act again


def test_slots_held_for_a_join_that_never_runs_are_let_go_with_the_graph(cores, monkeypatch):
    # A hook on an AccumulateGrad node that raises ends the backward before the join
    # (docs/limits.md): the slots are let go when the graph goes, not held for good.
    import gc

    cores(2)
    jobs = []
    start_ordered = _pool.start_ordered
    monkeypatch.setattr(
        _pool, "start_ordered", lambda *a: jobs.append(start_ordered(*a)) or jobs[-1]
    )
    models = heterogeneous()
    flat = parsum.FlatGrad(models)
    for p in flat.params:
        p.grad = None
    x = torch.randn(16, IN)
    y = parsum.sum_models(models, x, n_jobs=2)
    loss = y.pow(2).mean()
    first = flat.params[0]
    node = first.view_as(first).grad_fn.next_functions[0][0]  # its AccumulateGrad

    caller = threading.current_thread()

    def boom(grad_inputs, grad_outputs):
        # In the engine's visit with None only, not in a pullback's (the helpers' or, left
        # behind, the one this test joins).
        if threading.current_thread() is caller and not jobs_joined:
            raise RuntimeError("boom")

    jobs_joined = []

    node.register_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        loss.backward()
    assert len(jobs) == 1 and jobs[0] is not None
    jobs_joined.append(True)
    _pool.join(jobs.pop())  # the helpers done with the pullbacks left behind
    assert flat._held  # the graph still here
    del y, loss, node
    # The tasks the failed backward left queued hold its graph until this thread's next
    # engine call (NOTE [ Tasks a failed engine call leaves ] in parsum._engines).
    _engines._drop_tasks_left()
    gc.collect()
    assert not flat._held
    for p in flat.params:
        p.grad = None
    flat_grad_step(models, flat, x, 2, penalty=None)


@pytest.mark.parametrize("then", ["a new call", "the retained graph's backward"])
@pytest.mark.parametrize("path", PATHS)
def test_an_interrupt_before_the_join_is_undone_by_the_next_call(
    path, then, handed_over, cores, monkeypatch
):
    # NOTE [ Interrupted callers ] in parsum._pool: a Ctrl-C between the node and its join
    # (in torch's Python that applies the join node) ended the backward with the helpers still
    # pulling back, and their gradients landed in the next step's. The thread's next call, or
    # the next backward of a graph kept, cancels them, waits, and sets back what they wrote:
    # the .grad None it was.
    cores(2)
    models, alone, x, kwargs = two_copies(path)
    grads_after(models, x, 2, **kwargs)  # planned
    clear_grads(models)
    y = parsum.sum_models(models, x, n_jobs=2, **kwargs)
    loss = y.pow(2).mean()
    join_backward = _function.JoinPullbacks.backward

    def interrupted(ctx, grad):
        raise KeyboardInterrupt

    monkeypatch.setattr(_function.JoinPullbacks, "backward", staticmethod(interrupted))
    with pytest.raises(KeyboardInterrupt):
        loss.backward(retain_graph=True)
    monkeypatch.setattr(_function.JoinPullbacks, "backward", staticmethod(join_backward))
    assert handed_over == {"started": 2, "joined": 1} and len(_pool._local.unjoined) == 1
    if then == "a new call":
        loss = parsum.sum_models(models, x, n_jobs=2, **kwargs).pow(2).mean()
        assert not _pool._local.unjoined
        assert all(p.grad is None for m in models for p in m.parameters())
    loss.backward()
    assert not _pool._local.unjoined
    assert handed_over == {"started": 3, "joined": 2}
    want, _ = grads_after(alone, x, 1, **kwargs)
    for g, w in zip(param_grads(models), want):
        assert torch.equal(g, w)


def test_not_where_the_weights_need_a_gradient(handed_over, cores):
    # The node returns the weights' gradient, which the engine would accumulate before a
    # failing pullback is joined: a failed call changed weights.grad (found by
    # tests/test_differential.py).
    cores(2)
    models = heterogeneous()
    models.insert(2, BoomBackward())
    weights = torch.rand(len(models), requires_grad=True)
    y = parsum.sum_models(models, torch.randn(16, IN), weights=weights, n_jobs=2)
    with pytest.raises(parsum.ParsumError, match=r"model 2 \(BoomBackward\)"):
        y.pow(2).mean().backward()
    assert weights.grad is None and all(g is None for g in param_grads(models))
    assert handed_over["started"] == 0


class _BoomUnderTransforms(nn.Module):
    """A backward that raises, in the form torch.func transforms (engine "vjp") accept."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(IN, OUT)

    def forward(self, x):
        return _RaiseInBackward.apply(self.lin(x))


def learned_step(models, x, logits, n_jobs, **kwargs):
    """A step with learned weights, a softmax of ``logits``, and a term of the loss in them
    made after the sum; the gradients of the parameters and of the logits."""
    clear_grads(models)
    logits.grad = None
    weights = torch.softmax(logits, 0)
    y = parsum.sum_models(models, x, weights=weights, n_jobs=n_jobs, **kwargs)
    assert type(y.grad_fn).__name__ in ("CallerGraphSumBackward", "ParallelSumBackward")
    (y.pow(2).mean() + 0.1 * weights.log().mul(weights).sum()).backward()
    return [g.clone() for g in param_grads(models)], logits.grad.clone()


@pytest.mark.parametrize("path", PATHS)
def test_weights_made_by_a_node_before_the_join(path, handed_over, cores):
    # NOTE [ Weights' gradients held back by the join ] in parsum._inline: handed over, with
    # the bits of one thread, the logits' gradient too (a stacked group's outputs, laid out
    # column-major, reduced at once: NOTE [ Weight gradients at once ] in parsum._function).
    cores(2)
    models, alone, x, kwargs = two_copies(path)
    logits = torch.linspace(-1, 1, len(models)).requires_grad_()
    got, got_logits = learned_step(models, x, logits, 2, **kwargs)
    assert handed_over == {"started": 1, "joined": 1}
    want, want_logits = learned_step(alone, x, logits, 1, **kwargs)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert torch.equal(got_logits, want_logits)


@pytest.mark.parametrize("path", PATHS)
def test_a_failure_with_weights_made_by_a_node_changes_no_grad(path, handed_over, cores):
    cores(2)
    make, kwargs, _ = PATHS[path]
    models = make()
    logits = torch.zeros(len(models), requires_grad=True)
    x = torch.randn(16, IN)
    models.insert(4, BoomBackward() if path != "vjp" else _BoomUnderTransforms())
    logits = torch.zeros(len(models), requires_grad=True)
    with pytest.raises(
        parsum.ParsumError, match=r"model 4 \((BoomBackward|_BoomUnderTransforms)\)"
    ):
        learned_step(models, x, logits, 2, **kwargs)
    assert handed_over == {"started": 1, "joined": 1}
    assert logits.grad is None and all(g is None for g in param_grads(models))


def test_not_where_the_weights_were_made_later_in_another_thread(handed_over, cores):
    # Sequence numbers are counted per thread: weights made in this thread, whose count is
    # high, and a call in a new thread, whose count starts again, join in the node.
    cores(2)
    models, alone, x, _ = two_copies("caller's graph")
    logits = torch.linspace(-1, 1, len(models)).requires_grad_()
    for _ in range(100):  # nodes: this thread's count is past the new thread's
        logits.mul(2)
    weights = torch.softmax(logits, 0)
    got = {}

    def call():
        y = parsum.sum_models(models, x, weights=weights, n_jobs=2)
        y.pow(2).mean().backward()
        got["grads"] = [g.clone() for g in param_grads(models)]

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert handed_over["started"] == 0
    got_logits, logits.grad = logits.grad, None
    y = parsum.sum_models(alone, x, weights=torch.softmax(logits, 0), n_jobs=1)
    y.pow(2).mean().backward()
    assert all(torch.equal(g, w) for g, w in zip(got["grads"], param_grads(alone)))
    assert torch.equal(got_logits, logits.grad)


def test_two_sums_in_one_loss_and_a_retained_graph(handed_over, cores):
    cores(2)
    torch.manual_seed(2)
    first, second = heterogeneous(), with_stacked()
    alone = copy.deepcopy([first, second])
    x = torch.randn(16, IN)

    def step(first, second, n_jobs):
        clear_grads([*first, *second])
        y = parsum.sum_models(first, x, n_jobs=n_jobs) * parsum.sum_models(second, x, n_jobs=n_jobs)
        loss = y.pow(2).mean()
        loss.backward(retain_graph=True)
        loss.backward()
        return param_grads([*first, *second])

    got = step(first, second, 2)
    assert handed_over == {"started": 2, "joined": 2}  # the second adds to them: captured
    want = step(*alone, 1)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize(
    "path", ["caller's graph", "stacked", "stacked, ParallelSum"]
)  # vjp: pure models only
def test_a_failure_in_pullbacks_handed_over_changes_no_grad(path, handed_over, cores):
    cores(2)
    make, kwargs, _ = PATHS[path]
    models = make()
    models.insert(4, BoomBackward())
    y = parsum.sum_models(models, torch.randn(16, IN), n_jobs=2, **kwargs)
    with pytest.raises(parsum.ParsumError, match=r"model 4 \(BoomBackward\) raised ValueError"):
        y.pow(2).mean().backward()
    assert handed_over == {"started": 1, "joined": 1}
    assert all(g is None for g in param_grads(models))
    del models[4]
    parsum.sum_models(models, torch.randn(16, IN), n_jobs=2).sum().backward()  # usable after
    assert all(g is not None for g in param_grads(models))


@pytest.mark.parametrize("position", [0, 3, 6])
@pytest.mark.parametrize("flaky", [_FlakyHead, _FlakyInside])
@pytest.mark.parametrize("path", ["caller's graph", "stacked", "stacked, ParallelSum"])
def test_a_failure_that_does_not_repeat_in_pullbacks_handed_over_is_named(
    path, flaky, position, handed_over, cores
):
    # NOTE [ A failure that does not repeat ] in parsum._inline, on the helpers' threads: the
    # model the failed engine call was running is named, every .grad as it was.
    cores(2)
    make, kwargs, _ = PATHS[path]
    torch.manual_seed(0)
    models = make()
    models.insert(position, flaky())
    y = parsum.sum_models(models, torch.randn(16, IN), n_jobs=2, **kwargs)
    _ARMED[0] = True
    with pytest.raises(parsum.ParsumError, match=rf"model {position} \({flaky.__name__}\)"):
        y.pow(2).mean().backward()
    assert not _ARMED[0]
    assert handed_over == {"started": 1, "joined": 1}
    assert all(g is None for g in param_grads(models))


def test_not_where_the_engine_does_not_accumulate_or_arguments_need_gradients(handed_over, cores):
    cores(2)
    models = heterogeneous()
    x = torch.randn(16, IN)
    params = [p for m in models for p in m.parameters()]
    y = parsum.sum_models(models, x, n_jobs=2)
    grads = torch.autograd.grad(y.pow(2).mean(), params)  # captured, returned by the node
    assert all(g is not None for g in grads) and all(p.grad is None for p in params)
    x.requires_grad_()
    parsum.sum_models(models, x, n_jobs=2).pow(2).mean().backward()
    assert x.grad is not None and all(p.grad is not None for p in params)
    assert handed_over["started"] == 0


def test_under_a_process_group_only_parsum_distributed_hands_over(handed_over, cores, monkeypatch):
    # DistributedDataParallel's hooks on the parameters' AccumulateGrads must see the
    # pullbacks' gradients first (tests/test_module.py runs it).
    cores(2)

    class Initialized:
        @staticmethod
        def is_initialized():
            return True

    monkeypatch.setattr(_function, "_dist", Initialized)
    models = heterogeneous()
    x = torch.randn(16, IN)
    parsum.sum_models(models, x, n_jobs=2).sum().backward()
    assert handed_over["started"] == 0
    clear_grads(models)
    with _function.distributed_call():
        y = parsum.sum_models(models, x, n_jobs=2)
    y.sum().backward()
    assert handed_over == {"started": 1, "joined": 1}


def test_repeated_calls_leave_no_job_or_graph_behind(cores):
    import gc
    import weakref

    cores(2)
    models = heterogeneous()
    x = torch.randn(16, IN)
    y = parsum.sum_models(models, x, n_jobs=2)
    node = weakref.ref(y.grad_fn)
    y.sum().backward()
    del y
    gc.collect()
    assert node() is None
    helpers = _pool.pool_size()
    for _ in range(50):
        parsum.sum_models(models, x, n_jobs=2).sum().backward()
    assert _pool.pool_size() == helpers


class _Linear(nn.Module):
    """A layer of another class: its model is no direct program."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, IN).t().contiguous().t())  # column-major

    def forward(self, x):
        return x @ self.weight.t()


def test_a_gradient_stored_from_a_returned_one_keeps_the_parameters_strides(handed_over, cores):
    # What the engine's AccumulateGrad would store: in the parameter's strides.
    cores(2)
    models = [_Linear() for _ in range(4)]
    alone = copy.deepcopy(models)
    x = torch.randn(16, IN)
    for ms, n_jobs in ((models, 2), (alone, 1)):
        parsum.sum_models(ms, x, n_jobs=n_jobs, chunk_size=1, engine="vjp").sum().backward()
    assert handed_over["started"] == 1
    for m, a in zip(models, alone):
        assert m.weight.grad.stride() == a.weight.grad.stride() == m.weight.stride()
        assert torch.equal(m.weight.grad, a.weight.grad)


def test_not_below_the_parameters_where_it_pays(handed_over, cores, monkeypatch):
    cores(2)
    monkeypatch.setattr(_function, "JOIN_LATER_PARAMS", 128)
    small, large = heterogeneous(), [mlp([4 + i, 3]) for i in range(22)]  # 36 and 132
    x = torch.randn(16, IN)
    parsum.sum_models(small, x, n_jobs=2).sum().backward()
    assert handed_over["started"] == 0
    parsum.sum_models(large, x, n_jobs=2).sum().backward()
    assert handed_over == {"started": 1, "joined": 1}


def test_concurrent_callers_each_join_their_own(handed_over, cores):
    from tests.test_concurrency import _together

    cores(2)
    n_threads, rounds = 3, 6
    sets = []
    for seed in range(n_threads):
        torch.manual_seed(seed)
        sets.append(PATHS["caller's graph"][0]() if seed % 2 else PATHS["stacked"][0]())
    alone = copy.deepcopy(sets)
    x = torch.randn(16, IN)
    want = [grads_after(models, x, 1)[0] for models in alone]

    def caller(t):
        return [grads_after(sets[t], x, 2)[0] for _ in range(rounds)]

    results = _together(caller, n_threads)
    assert handed_over["started"] == handed_over["joined"] == n_threads * rounds
    for t in range(n_threads):
        for got in results[t]:
            assert all(torch.equal(g, w) for g, w in zip(got, want[t]))


class _Nested(nn.Module):
    """A model that sums models of its own with parsum (run in its task, on one thread)."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.inner = nn.ModuleList(mlp([3 + k]) for k in range(3))

    def forward(self, x):
        return parsum.sum_models(list(self.inner), x)


def test_nested_calls_inside_pullbacks_handed_over(handed_over, cores):
    cores(2)
    models = [_Nested(seed) for seed in range(4)]
    alone = copy.deepcopy(models)
    x = torch.randn(16, IN)
    got, _ = grads_after(models, x, 2)
    assert handed_over == {"started": 1, "joined": 1}  # the outer call's; the inner ones in tasks
    want, _ = grads_after(alone, x, 1)
    assert len(got) == 48 and all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_sum(handed_over, cores, reentrant):
    from torch.utils.checkpoint import checkpoint

    cores(2)
    models = heterogeneous()
    alone = copy.deepcopy(models)
    x = torch.randn(16, IN, requires_grad=reentrant)  # reentrant: an input that needs a grad

    def grads(models, n_jobs):
        clear_grads(models)
        y = checkpoint(
            lambda t: parsum.sum_models(models, t, n_jobs=n_jobs), x, use_reentrant=reentrant
        )
        y.pow(2).mean().backward()
        return param_grads(models)

    got, want = grads(models, 2), grads(alone, 1)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    # Recomputed in backward under saved-tensor hooks (on one thread), or with the argument
    # that needs a gradient: nothing handed over either way.
    assert handed_over["started"] == 0
