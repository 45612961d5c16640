"""Default chunks: about equal estimated cost, from shapes alone, never from n_jobs."""

import copy
import math
import random
import threading
import time

import pytest
import torch

import parsum
from parsum import _grouping, _pool
from parsum._engines import ModelParams, Unit
from parsum._grouping import MAX_CHUNKS, Batch, cost_chunks, estimated_cost
from tests.zoo import IN, OUT, learned, mlp, param_grads, tiny_mlps, without_plain_graphs


def units_of(n):
    return [Unit((i,), "autograd") for i in range(n)]


def chunk_costs(chunks, costs):
    return [sum(costs[u] for u in chunk) for chunk in chunks]


@pytest.mark.parametrize("seed", range(20))
def test_chunks_cover_the_units_in_order_and_are_balanced(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 80)
    costs = [rng.choice([1, 10, 1000]) * rng.randint(1, 9) for _ in range(n)]
    chunks = cost_chunks(units_of(n), costs)
    assert [u for chunk in chunks for u in chunk] == list(range(n))
    assert all(len(chunk) > 0 for chunk in chunks)
    assert len(chunks) == min(MAX_CHUNKS, n)  # as many as allowed: workers balance better
    # A chunk holds the units whose midpoints fall in its share: at most a share and a unit.
    share = sum(costs) / min(MAX_CHUNKS, n)
    assert max(chunk_costs(chunks, costs)) <= share + max(costs)


def test_a_costly_model_gets_a_chunk_of_its_own_and_cheap_ones_share():
    costs = [1] * 24 + [10] * 8  # 32 models: by count, 16 chunks of 2 would hold up to 20
    chunks = cost_chunks(units_of(32), costs)
    assert max(chunk_costs(chunks, costs)) == 10
    assert all(len(chunk) == 1 for chunk in chunks if chunk.start >= 24)
    assert len(chunks) == MAX_CHUNKS


def test_no_more_models_than_chunks_gives_each_a_chunk():
    assert cost_chunks(units_of(5), [1, 100, 1, 1, 50]) == [range(i, i + 1) for i in range(5)]


def test_a_stacked_group_counts_its_models_costs(monkeypatch):
    monkeypatch.setattr(_grouping, "MAX_CHUNKS", 2)
    units = [Unit((0, 1, 2, 3), "stacked"), *(Unit((i,), "autograd") for i in (4, 5, 6))]
    chunks = cost_chunks(units, [5] * 7)  # the group costs 20 of 35: a chunk alone
    assert chunks == [range(0, 1), range(1, 4)]


def test_cost_is_parameters_times_rows_plus_overhead_and_ignores_sampling():
    model = mlp([8])
    n_elements = sum(p.numel() for p in model.parameters())
    assert estimated_cost(ModelParams.of(model), Batch(5)) == (
        _grouping.MODEL_OVERHEAD_PARAM_ROWS + 5 * n_elements
    )
    # A take_rows table counts one row per batch row, whatever its last call gathered, so the
    # chunks never depend on the data.
    table = torch.nn.Parameter(torch.randn(1000, 4))
    holder = torch.nn.Module()
    holder.table = table
    costs = []
    for n_rows in (3, 300):
        parsum.take_rows(table, torch.arange(n_rows))
        costs.append(estimated_cost(ModelParams.of(holder), Batch(7)))
    assert costs[0] == costs[1] == _grouping.MODEL_OVERHEAD_PARAM_ROWS + 7 * 4


def test_one_chunk_or_several_ignores_the_rows_a_table_gave(monkeypatch):
    # Whether a budget of 2 runs one chunk on both intra-op threads or the chunks (on workers,
    # or on one thread: NOTE [ Kernels too small for intra-op threads ]) decides the bits: a
    # take_rows table counts one row per batch row there, whatever its last call gathered, so
    # the bits do not depend on the rows an earlier call drew.
    monkeypatch.setattr(_pool, "releases_callers_team", lambda: True)
    holders = []
    for _ in range(2):
        holder = torch.nn.Module()
        holder.table = torch.nn.Parameter(torch.randn(50_000, 64))
        holders.append(holder)
    units = [Unit((0,), "autograd"), Unit((1,), "autograd")]
    chunks, batch = [range(0, 1), range(1, 2)], Batch(8)
    choices = []
    for n_rows in (1, 50_000):  # 64 elements gathered a table, then 3.2M
        for holder in holders:
            parsum.take_rows(holder.table, torch.arange(n_rows))
        mps = [ModelParams.of(h) for h in holders]
        choices.append(
            (
                # stepping: the workers' kernel share alone decides (intra_op_pays below)
                _grouping.intra_op_only(mps, batch, 2, units, chunks, (0, 1), True),
                _grouping.intra_op_pays(units, mps, batch),
            )
        )
    assert choices[0] == choices[1] == (True, False)


@pytest.mark.parametrize("kind", [torch.nn.Embedding, torch.nn.EmbeddingBag])
def test_an_embedding_table_counts_the_rows_it_reads(kind):
    # NOTE [ Embedding tables ]: a row per batch row, not the whole table.
    model = torch.nn.Sequential(kind(1000, 8), torch.nn.Linear(8, 2))
    head = 8 * 2 + 2
    assert estimated_cost(ModelParams.of(model), Batch(5)) == (
        _grouping.MODEL_OVERHEAD_PARAM_ROWS + 5 * (8 + head)
    )


def test_sum_models_uses_cost_chunks_by_default_and_chunk_size_when_given(cores, monkeypatch):
    seen = []

    def spy(units, model_costs, max_chunks=None):
        chunks = cost_chunks(units, model_costs, max_chunks)
        seen.append(chunks)
        return chunks

    monkeypatch.setattr(_grouping, "cost_chunks", spy)
    monkeypatch.setattr(_grouping, "MODEL_OVERHEAD_PARAM_ROWS", 0)
    cores(16)  # MAX_CHUNKS chunks (fewer threads cut fewer: NOTE [ Chunks a thread ])
    models = [mlp([4]) for _ in range(20)] + [mlp([400, 400]) for _ in range(2)]
    x = torch.randn(3, IN)
    parsum.sum_models(models, x, engine="autograd", n_jobs=1)
    assert seen[-1][-2:] == [range(20, 21), range(21, 22)]  # the large ones alone
    assert len(seen[-1]) == MAX_CHUNKS  # the small ones share the other 14
    parsum.sum_models(models, x, engine="autograd", n_jobs=1, chunk_size=2)
    assert len(seen) == 1


@pytest.fixture
def jobs_run(monkeypatch):
    """(chunks, workers) of every job the pool runs, in order."""
    seen = []
    run_ordered = _pool.run_ordered

    def spy(task, n_tasks, n_workers, consume, *rest):
        seen.append((n_tasks, n_workers))
        run_ordered(task, n_tasks, n_workers, consume, *rest)

    monkeypatch.setattr(_pool, "run_ordered", spy)
    return seen


@pytest.mark.parametrize("n_cores", [1, 2, 4, 16])
def test_the_default_spends_a_small_budget_on_intra_op_threads(
    cores, n_cores, jobs_run, monkeypatch
):
    # NOTE [ Threads that pay ]: up to 2 threads, engine "auto" with n_jobs unset runs one
    # chunk with the whole budget as intra-op threads; a larger budget goes to workers.
    without_plain_graphs(monkeypatch)
    cores(n_cores)
    x = torch.randn(16, IN)  # a kernel share below WORKERS_MIN_KERNEL_SHARE
    models = learned([mlp([256 + i, 256]) for i in range(8)], x)  # of their own: none stacked
    parsum.sum_models(models, x)
    chunks, workers = jobs_run[-1]
    on_budget = chunks_on_budget(models, x)  # NOTE [ Chunks a thread ]
    if n_cores == 1:  # one thread, the chunks of an explicit n_jobs (and its bits)
        assert (chunks, workers) == (on_budget, 1)
    elif n_cores == 2:
        assert (chunks, workers) == (1, min(n_cores, useful_workers_of(models, x)))
    else:
        assert chunks == on_budget and 1 < workers <= n_cores
    parsum.sum_models(models, x, n_jobs=2)  # an explicit n_jobs: chunks as always
    assert jobs_run[-1] == (on_budget, 2)


@pytest.mark.parametrize("shared", [False, True])
def test_the_final_sums_run_under_the_tasks_intra_op_threads(cores, monkeypatch, shared):
    # NOTE [ Spinning intra-op threads ]: a sum on the caller's 2 threads between jobs left
    # OpenMP's threads spinning on the core the next job's helper needed.
    cores(2)
    threads_seen = []
    result = parsum._summation.CompensatedAccumulator.result

    def spy(self):
        threads_seen.append(torch.get_num_threads())
        return result(self)

    monkeypatch.setattr(parsum._summation.CompensatedAccumulator, "result", spy)
    models = [mlp([256 + i, 256]) for i in range(8)]
    if shared:  # a module twice, whose gradients the call sums itself
        models.append(models[0])
    x = torch.randn(64, IN, requires_grad=True)
    parsum.sum_models(models, x, n_jobs=2).pow(2).sum().backward()
    # the outputs, the argument's gradient, and the shared parameters' gradients
    assert len(threads_seen) >= (2 + 2 * shared)
    assert threads_seen == [1] * len(threads_seen)
    assert torch.get_num_threads() == 2  # the caller's, restored


def stepping(models):
    """A StepInBackward that changes nothing (a learning rate of 0)."""
    return parsum.StepInBackward(models, torch.optim.SGD, lr=0.0)


@pytest.mark.parametrize("releases", [False, True])
@pytest.mark.parametrize("batch, workers", [(16, False), (32, True), (512, True)])
def test_a_budget_of_2_goes_to_workers_from_a_kernel_share(
    cores, monkeypatch, releases, batch, workers, jobs_run
):
    # NOTE [ Threads that pay ]: kernels large enough to overlap the other thread's Python, and
    # no OpenMP team of the caller's spinning on the helper's core: ended before the job
    # (NOTE [ The caller's OpenMP team ]), or none made, the optimizer stepping in the backward.
    without_plain_graphs(monkeypatch)
    cores(2)
    monkeypatch.setattr(_pool, "releases_callers_team", lambda: releases)
    x = torch.randn(batch, IN)
    models = learned([mlp([256 + i, 256]) for i in range(8)], x)  # of their own: none stacked
    share = _grouping._kernel_share([ModelParams.of(m) for m in models], Batch.of([x]))
    assert (share >= _grouping.WORKERS_MIN_KERNEL_SHARE) == workers
    parsum.sum_models(models, x, step_in_backward=stepping(models))
    # NOTE [ Chunks of models that step ]: at most STEPPING_CHUNKS_PER_THREAD a thread
    fewer = _grouping.STEPPING_CHUNKS_PER_THREAD * 2
    assert jobs_run[-1] == ((fewer, 2) if workers else (1, 2))
    parsum.sum_models(models, x)  # with an ordinary optimizer's step between calls
    assert jobs_run[-1] == ((chunks_on_budget(models, x), 2) if workers and releases else (1, 2))


@pytest.mark.parametrize(
    "widths, workers", [((512, 512, 512, 512), True), ((512, 512, 256), False)]
)
def test_a_budget_of_2_goes_to_workers_only_where_the_chunks_split_evenly(
    cores, widths, workers, jobs_run
):
    # NOTE [ Threads that pay ]: two large models and a small one leave one worker idle for
    # half the step; four alike keep both busy.
    cores(2)
    x = torch.randn(256, IN)
    models = learned([mlp([w, w]) for w in widths], x)
    mps = [ModelParams.of(m) for m in models]
    assert _grouping._kernel_share(mps, Batch.of([x])) >= _grouping.WORKERS_MIN_KERNEL_SHARE
    parsum.sum_models(models, x, step_in_backward=stepping(models))
    assert jobs_run[-1] == ((len(models), 2) if workers else (1, 2))


@pytest.mark.parametrize(
    "costs, order, even",
    [
        ([10, 10, 10, 10], None, True),
        ([10, 10, 1], None, True),  # 11 against 10: within MAX_IMBALANCE of even
        ([10, 10, 3], None, False),  # one worker idles while the other runs the third
        ([10, 1, 1, 10], None, False),  # in chunk order the last large one comes late: 12, 10
        ([10, 1, 1, 10], (0, 3, 1, 2), True),  # costliest first: 11 and 11
        ([5] * 16, None, True),
    ],
)
def test_split_evenly_simulates_workers_claiming_in_order(monkeypatch, costs, order, even):
    # NOTE [ Threads that pay ]: each chunk goes to whichever of 2 workers is free first.
    monkeypatch.setattr(_grouping, "estimated_cost", lambda mp, batch: mp)
    units = units_of(len(costs))
    chunks = [range(u, u + 1) for u in range(len(costs))]
    in_order = range(len(costs)) if order is None else order  # None: chunk order
    assert _grouping._split_evenly(units, chunks, in_order, costs, None, 2) == even


def small_cnn(channels):
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, channels, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(channels, 2 * channels, 3, padding=1),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(2 * channels * 8 * 8, OUT),
    )


def wide_mlp():
    return torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(256, 8192), torch.nn.Linear(8192, OUT)
    )


@pytest.mark.parametrize("n_cores", [1, 2])
@pytest.mark.parametrize("mlps", [0, 4])
def test_a_budget_of_2_goes_to_workers_where_convolutions_do_most_of_the_work(
    cores, monkeypatch, n_cores, mlps, jobs_run
):
    # NOTE [ Threads that pay ]: their kernels split worse over intra-op threads; whatever
    # their kernel share (no share is enough here).
    monkeypatch.setattr(_grouping, "WORKERS_MIN_KERNEL_SHARE", math.inf)
    cores(n_cores)
    models = [small_cnn(c) for c in (12, 16, 16, 12)]  # split evenly in chunk order
    models += [wide_mlp() for _ in range(mlps)]
    x = torch.randn(2, 1, 16, 16)
    learned(models, x)
    mps = [ModelParams.of(m) for m in models]
    conv_work = sum(_grouping._param_rows(mp, Batch.of([x])) for mp in mps[:4])
    all_work = sum(_grouping._param_rows(mp, Batch.of([x])) for mp in mps)
    assert (2 * conv_work > all_work) == (mlps == 0)
    y = parsum.sum_models(models, x)  # with any optimizer
    if n_cores == 2 and mlps == 0:
        assert jobs_run[-1] == (len(models), 2)
    elif n_cores == 2:
        assert jobs_run[-1][0] == 1  # one chunk, on the intra-op threads
    else:
        assert jobs_run[-1] == (chunks_on_budget(models, x), 1)  # one thread
    y.sum().backward()
    expected = torch.stack([m(x) for m in models]).double().sum(0)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)


class _Recurrent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(16, 48, batch_first=True)
        self.head = torch.nn.Linear(48, OUT)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


@pytest.mark.parametrize("n_cores", [1, 2])
def test_a_budget_of_2_goes_to_workers_where_recurrent_layers_do_most_of_the_work(
    cores, monkeypatch, n_cores, jobs_run
):
    # NOTE [ Threads that pay ]: an LSTM runs all its steps in one operation, without the GIL;
    # whatever its kernel share (no share is enough here).
    monkeypatch.setattr(_grouping, "WORKERS_MIN_KERNEL_SHARE", math.inf)
    cores(n_cores)
    torch.manual_seed(0)
    x = torch.randn(32, 10, 16)
    models = learned([_Recurrent() for _ in range(4)], x)
    mps = [ModelParams.of(m) for m in models]
    share = _grouping._kernel_share(mps, Batch.of([x]))
    assert share >= _grouping.MIN_KERNEL_SHARE
    y = parsum.sum_models(models, x)
    assert jobs_run[-1] == (chunks_on_budget(models, x), n_cores)
    y.sum().backward()
    expected = torch.stack([m(x) for m in models]).double().sum(0)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)


def useful_workers_of(models, x):
    from parsum._engines import ModelParams

    return _grouping.useful_workers(
        [ModelParams.of(m) for m in models], Batch.of([x]), torch.get_num_threads()
    )


def chunks_on_budget(models, x):
    """How many chunks the default cuts for models of their own (none stacked) on this
    thread's budget (NOTE [ Chunks a thread ])."""
    from parsum._engines import ModelParams

    mps, batch = [ModelParams.of(m) for m in models], Batch.of([x])
    units = _grouping.plan_units(models, mps, "autograd", batch, None)
    costs = _grouping.estimated_costs(mps, batch)
    return len(_grouping.thread_chunks(units, mps, batch, costs, torch.get_num_threads()))


@pytest.mark.parametrize("engine", ["autograd", "auto"])
def test_uneven_chunks_are_bitwise_identical_for_any_n_jobs(monkeypatch, engine):
    monkeypatch.setattr(_grouping, "MODEL_OVERHEAD_PARAM_ROWS", 0)
    results = []
    for n_jobs in (1, 2, 3):
        torch.manual_seed(1)
        models = [mlp([3 + i % 5]) for i in range(20)] + [mlp([64, 64]) for _ in range(3)]
        x = torch.randn(6, IN, requires_grad=True)
        y = parsum.sum_models(models, x, engine=engine, n_jobs=n_jobs)
        (y.sin() * 1e3).sum().backward()
        results.append([y, x.grad, *param_grads(models)])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_sequence_models_give_the_plain_sum_with_the_same_bits_at_any_n_jobs(cores):
    # Chunks by per-token costs (NOTE [ Tokens ]), on workers where the default puts them.
    from torch import nn

    cores(3)
    results = []
    for n_jobs in (1, 2, 3, None):
        torch.manual_seed(2)
        models = [
            nn.TransformerEncoderLayer(8, 2, 8 + 4 * i, dropout=0.0, batch_first=True)
            for i in range(5)
        ] + [nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)) for _ in range(3)]
        models = [m.double() for m in models]
        ref = copy.deepcopy(models)
        x = torch.randn(4, 6, 8, dtype=torch.float64, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        y = parsum.sum_models(models, x, n_jobs=n_jobs)
        y.pow(2).sum().backward()
        y_ref = sum(m(x_ref) for m in ref)
        y_ref.pow(2).sum().backward()
        torch.testing.assert_close(y, y_ref)
        torch.testing.assert_close(x.grad, x_ref.grad)
        for a, b in zip(param_grads(models), param_grads(ref)):
            torch.testing.assert_close(a, b)
        results.append([y, x.grad, *param_grads(models)])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_convolutions_count_once_per_position_of_their_input():
    from torch import nn

    from parsum._grouping import useful_workers

    def cnn(stride=1):
        return nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1, stride=stride),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, 10),
        )

    x = torch.randn(8, 1, 28, 28)
    batch = Batch.of([x])
    assert batch == Batch(8, 28 * 28)
    assert Batch.of([torch.randn(8, 5)]) == Batch(8, 1)
    model = cnn()
    params = [ModelParams.of(model)]
    conv = sum(p.numel() for p in [*model[0].parameters(), *model[2].parameters()])
    head = sum(p.numel() for p in model[5].parameters())
    assert estimated_cost(params[0], batch) == (
        _grouping.MODEL_OVERHEAD_PARAM_ROWS + 8 * (conv * 28 * 28 + head)
    )
    # 1.4K weights: counted once per row the models look tiny, counted per position they are
    # 7.9M parameter-rows each, and threads pay (8 such CNNs ran 1.5x faster on 2 threads).
    assert useful_workers(params, Batch(8), 16) == 1
    assert useful_workers(params, batch, 16) > 1
    strided = ModelParams.of(cnn(stride=2))
    assert estimated_cost(strided, batch) < estimated_cost(params[0], batch)


def test_layers_over_a_sequence_count_once_per_token():
    # NOTE [ Tokens ]: (rows, tokens, width) read by a Linear, an attention or a recurrent
    # layer of that width: its parameters work once per token; a model that flattens the
    # sequence first, or a Conv1d over (rows, channels, length), counts as before.
    from torch import nn

    x = torch.randn(8, 12, 16)
    batch = Batch.of([x])
    assert (batch.rows, batch.tokens, batch.width) == (8, 12, 16)
    per_token = [
        nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 2)),
        nn.TransformerEncoderLayer(16, 2, 32, batch_first=True),
        nn.GRU(16, 8, batch_first=True),
    ]
    for model in per_token:
        mp = ModelParams.of(model)
        elements = sum(p.numel() for p in model.parameters())
        assert _grouping._param_rows(mp, batch) == elements * 8 * 12, type(model).__name__
    flattening = nn.Sequential(nn.Flatten(), nn.Linear(12 * 16, 2))
    assert _grouping._param_rows(ModelParams.of(flattening), batch) == (12 * 16 * 2 + 2) * 8
    conv = nn.Sequential(nn.Conv1d(12, 4, 3), nn.Flatten(), nn.Linear(4 * 14, 2))
    conv_batch = Batch.of([x])  # read as (rows, channels, length) by the convolution
    conv_elements = 12 * 4 * 3 + 4
    assert _grouping._param_rows(ModelParams.of(conv), conv_batch) == 8 * (
        conv_elements * 16 + 4 * 14 * 2 + 2
    )
    assert Batch.of([torch.randn(8, 5)]) == Batch(8)


def test_the_default_runs_device_models_in_the_calling_thread(cores, jobs_run):
    # On a GPU a model's CPU time is kernel launches: auto with n_jobs unset keeps one chunk in
    # the calling thread, whatever the budget. The meta device stands in for one here.
    cores(16)
    models = [mlp([256, 256]).to("meta") for _ in range(8)]
    with torch.no_grad():
        y = parsum.sum_models(models, torch.empty(64, IN, device="meta"))
    assert y.device.type == "meta"
    assert jobs_run[-1] == (1, 1)


# NOTE [ Costliest chunks first ]


def test_threads_claim_the_costliest_chunks_first(cores, monkeypatch):
    cores(16)  # a chunk a model (fewer threads cut fewer: NOTE [ Chunks a thread ])
    orders = []
    run_ordered, start_ordered = _pool.run_ordered, _pool.start_ordered

    def spy(task, n_tasks, n_workers, consume, order=None, *rest):
        orders.append(order)
        run_ordered(task, n_tasks, n_workers, consume, order, *rest)

    def spy_start(task, n_tasks, n_workers, consume, order=None, *rest):
        orders.append(order)  # NOTE [ Pullbacks joined later ]: the backward's
        return start_ordered(task, n_tasks, n_workers, consume, order, *rest)

    monkeypatch.setattr(_pool, "run_ordered", spy)
    monkeypatch.setattr(_pool, "start_ordered", spy_start)
    widths = [8, 300, 64, 300, 16]  # one chunk each; the two widest tie
    models = [mlp([w, w]) for w in widths]
    x = torch.randn(32, IN)
    for _ in range(2):  # the first call's forwards run in model order, learning the models
        orders.clear()
        y = parsum.sum_models(models, x, engine="autograd", n_jobs=2)
        y.sum().backward()
    assert orders == [(1, 3, 2, 4, 0)] * 2  # forward, then backward
    mps = [ModelParams.of(m) for m in models]
    costs = [estimated_cost(mp, Batch.of([x])) for mp in mps]
    assert costs[1] == costs[3] > costs[2] > costs[4] > costs[0]


@pytest.mark.parametrize("batch", [8, 2048])
def test_chunks_are_claimed_costliest_first_at_any_batch(batch):
    # Python overhead or kernels: the costliest chunk last kept a thread waiting for it alone.
    models = [mlp([w, w]) for w in (64, 512, 128, 64)]
    mps = [ModelParams.of(m) for m in models]
    b = Batch.of([torch.randn(batch, IN)])
    units = units_of(4)
    chunks = [range(u, u + 1) for u in range(4)]
    assert _grouping.costliest_first(units, chunks, mps, b) == (1, 2, 0, 3)  # ties in order


# NOTE [ The caller's last chunk ]


def test_a_helper_leaves_the_last_chunk_claimed_to_the_caller():
    ran, consumed = [], []
    order = (5, 3, 1, 0, 2, 4)
    job = _pool._Job(ran.append, 6, lambda k, r: consumed.append(k), None, 1, order, True)
    job.work()  # as a helper
    assert ran == [5, 3, 1, 0, 2] and not job.done.is_set()
    job.work(caller=True)
    assert ran == [5, 3, 1, 0, 2, 4] and job.done.is_set()
    assert consumed == list(range(6)) and job.close() is None


@pytest.mark.parametrize("n_tasks", [4, 5, 8])
def test_only_threads_with_more_than_two_chunks_leave_the_last_to_the_caller(
    cores, monkeypatch, n_tasks
):
    cores(2)
    runs = {}
    jobs = []
    work_and_wait = _pool._work_and_wait
    monkeypatch.setattr(_pool, "_work_and_wait", lambda job: jobs.append(job) or work_and_wait(job))

    def task(k):
        runs[k] = threading.current_thread()
        time.sleep(0.002)  # the helper takes chunks too
        return k

    order = tuple(reversed(range(n_tasks)))
    consumed: list[int] = []
    helped = False
    for _ in range(10):  # whatever the timing
        runs.clear()
        consumed.clear()
        _pool.run_ordered(task, n_tasks, 2, lambda k, r: consumed.append(r), order, True)
        assert consumed == list(range(n_tasks))
        if jobs[-1].callers_last:
            assert runs[0] is threading.current_thread()  # the last in the order
        helped |= any(t is not threading.current_thread() for t in runs.values())
    assert [job.callers_last for job in jobs] == [n_tasks > 4] * 10
    assert helped


def test_chunks_claimed_in_chunk_order_leave_no_chunk_to_the_caller(cores, monkeypatch):
    # Without an order (step_in_backward, argument gradients) the last chunk may be the largest.
    cores(2)
    jobs = []
    work_and_wait = _pool._work_and_wait
    monkeypatch.setattr(_pool, "_work_and_wait", lambda job: jobs.append(job) or work_and_wait(job))
    consumed: list[int] = []
    _pool.run_ordered(lambda k: k, 8, 2, lambda k, r: consumed.append(r), None, True)
    assert consumed == list(range(8))
    assert [job.callers_last for job in jobs] == [False]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("failing", [0, 3, 7])
def test_a_failure_with_the_last_chunk_left_to_the_caller_is_the_first_in_chunk_order(
    cores, failing
):
    # The chunk left to the caller is chunk 0 here (claimed last). Chunk 7, claimed first,
    # fails too: the chunks before the smallest failure still run, it is the one raised, and
    # results are consumed in chunk order only up to the first failure.
    cores(2)
    ran: set[int] = set()
    consumed: list[int] = []

    def task(k):
        ran.add(k)
        time.sleep(0.001)
        if k in (failing, 7):
            raise RuntimeError(f"chunk {k}")
        return k

    for _ in range(5):
        ran.clear()
        consumed.clear()
        with pytest.raises(RuntimeError, match=f"chunk {failing}"):
            _pool.run_ordered(
                task, 8, 2, lambda k, r: consumed.append(k), tuple(range(7, -1, -1)), True
            )
        assert set(range(failing + 1)) <= ran
        assert consumed == list(range(len(consumed))) and len(consumed) <= failing


def test_small_last_chunks_are_left_to_the_caller():
    x = torch.randn(64, IN)
    b = Batch.of([x])
    models = [mlp([512, 512]), mlp([256]), mlp([16])]
    mps = [ModelParams.of(m) for m in models]
    chunks = [range(u, u + 1) for u in range(3)]
    order = _grouping.costliest_first(units_of(3), chunks, mps, b)
    assert order == (0, 1, 2)
    assert _grouping.small_last_chunk(units_of(3), chunks, mps, b, order)
    cnns = [ModelParams.of(small_cnn(c)) for c in (12, 16)]
    big = Batch.of([torch.randn(64, 1, 16, 16)])
    cnn_chunks = [range(0, 1), range(1, 2)]
    cnn_order = _grouping.costliest_first(units_of(2), cnn_chunks, cnns, big)
    assert not _grouping.small_last_chunk(units_of(2), cnn_chunks, cnns, big, cnn_order)


def run_job(n_tasks, order, failing=()):
    """A job's chunks run by one thread: the chunks it ran, those consumed, its failure."""
    ran, consumed = [], []

    def task(k):
        ran.append(k)
        if k in failing:
            raise RuntimeError(f"chunk {k}")
        return k

    job = _pool._Job(task, n_tasks, lambda k, r: consumed.append((k, r)), None, 1, order)
    job.work()
    assert job.done.is_set()
    return ran, consumed, job.close()


def test_a_job_claims_in_its_order_and_consumes_in_chunk_order():
    ran, consumed, failure = run_job(5, (3, 0, 4, 1, 2))
    assert ran == [3, 0, 4, 1, 2]
    assert consumed == [(k, k) for k in range(5)]
    assert failure is None


@pytest.mark.parametrize(
    "order, failing, ran",
    [
        ((0, 1, 2, 3), {1, 3}, [0, 1]),  # in order: nothing starts after a failure
        ((3, 2, 1, 0), {1, 3}, [3, 2, 1, 0]),  # the chunks before a failure still run
        ((3, 1, 2, 0), {1, 3}, [3, 1, 0]),  # ... and only those: 2 comes after chunk 1
    ],
)
def test_after_a_failure_only_the_chunks_before_it_start(order, failing, ran):
    # The smallest failing chunk is raised: the one a run in chunk order meets first.
    got, consumed, failure = run_job(4, order, failing)
    assert got == ran
    assert str(failure) == "chunk 1"
    assert all(k < 1 for k, _ in consumed)


def test_useful_workers_grow_with_the_kernels_up_to_a_cap():
    # NOTE [ Threads that pay ]: 1 + C / G workers, G a third of a model's overhead, at most
    # MAX_USEFUL_WORKERS (on 16 cores 16 workers were slower than 8 for every MLP ensemble).
    from parsum._engines import ModelParams
    from parsum._grouping import MAX_USEFUL_WORKERS, useful_workers

    def workers(widths, rows, budget=16):
        models = [mlp([w, w]) for w in widths]
        return useful_workers([ModelParams.of(m) for m in models], Batch(rows), budget)

    medium = [128 + 32 * i for i in range(16)]
    # tiny models: the pullbacks alone, on workers once there are enough of them (NOTE
    # [ Pullbacks of small models ])
    assert workers([16] * 4, 32) == 1
    assert workers([16] * 64, 32) == _grouping.MAX_SMALL_PULLBACK_WORKERS
    counts = [workers(medium, rows) for rows in (64, 256, 4096)]
    assert counts == sorted(counts) and counts[0] > 1
    assert counts[-1] == MAX_USEFUL_WORKERS
    assert workers(medium, 4096, budget=64) == 32  # half a larger budget


@pytest.fixture
def workers_by_job(monkeypatch):
    """The workers of every job, forwards' and pullbacks' (run now or joined later), by the
    name of its task."""
    seen = []

    def spying(start):
        def spy(task, n_tasks, n_workers, *rest, **kwargs):
            seen.append((task.__name__, n_workers))
            return start(task, n_tasks, n_workers, *rest, **kwargs)

        return spy

    monkeypatch.setattr(_pool, "run_ordered", spying(_pool.run_ordered))
    monkeypatch.setattr(_pool, "start_ordered", spying(_pool.start_ordered))
    return seen


def medium_ensemble(batch):
    """16 MLPs of widths 128-488, each of its own class (none stacked), and an input."""
    x = torch.randn(batch, IN)
    return learned([mlp([128 + 24 * i, 128 + 24 * i]) for i in range(16)], x), x


@pytest.mark.parametrize("batch", [64, 1024])
def test_the_forwards_take_fewer_workers_than_the_pullbacks_where_kernels_are_light(
    cores, workers_by_job, batch, gil
):
    # NOTE [ Forwards on fewer workers ]: 1 + C / O workers for the forwards, 1 + C / G for
    # the pullbacks, where parsum chooses them; the kernels of a large batch pay for all.
    cores(16)
    models, x = medium_ensemble(batch)
    mps = [ModelParams.of(m) for m in models]
    share = _grouping._kernel_share(mps, Batch.of([x]))
    workers = _grouping.useful_workers(mps, Batch.of([x]), 16)
    workers_by_job.clear()  # the first call's, which learned the models
    parsum.sum_models(models, x).pow(2).mean().backward()
    (forward,) = [n for name, n in workers_by_job if name == "forward_chunk"]
    (backward,) = [n for name, n in workers_by_job if name == "pull_back_one"]
    assert backward == workers
    assert forward == min(workers, math.ceil(1 + share))
    assert (forward < backward) == (batch == 64)
    workers_by_job.clear()
    parsum.sum_models(models, x, n_jobs=5).pow(2).mean().backward()  # an explicit n_jobs
    assert sorted(workers_by_job) == [("forward_chunk", 5), ("pull_back_one", 5)]


def test_forwards_on_fewer_workers_give_the_bits_of_any_n_jobs(cores, workers_by_job, gil):
    # NOTE [ Forwards on fewer workers ]: the chunks and their order are those of any
    # worker count, so are the bits (the forwards ran on fewer workers: checked).
    cores(16)
    models, x = medium_ensemble(64)
    workers_by_job.clear()
    bits = _step_bits(models, x)
    forward, backward = (n for _, n in sorted(workers_by_job))
    assert 1 < forward < backward
    for n_jobs in (1, 3, 16):
        for got, want in zip(_step_bits(models, x, n_jobs=n_jobs), bits, strict=True):
            assert torch.equal(got, want)


@pytest.mark.parametrize("seed", range(8))
def test_random_sets_under_any_budget_give_the_bits_of_any_n_jobs(cores, seed):
    # NOTE [ Forwards on fewer workers ]: whatever the budget and the workers the forwards and
    # the pullbacks take, the default's bits are those of n_jobs 1 and of the budget.
    rng = random.Random(seed)
    torch.manual_seed(seed)
    budget = rng.choice([3, 4, 8, 16])
    cores(budget)
    models = []
    for _ in range(rng.randint(2, 20)):
        w = rng.choice([16, 64, 128, 256, 384])
        act = rng.choice([torch.nn.Tanh, torch.nn.ReLU, torch.nn.GELU])
        layers = [torch.nn.Linear(IN, w), act(), torch.nn.Linear(w, OUT)]
        model = torch.nn.Sequential(*layers)
        models.append(torch.nn.Sequential(model) if rng.random() < 0.5 else model)
    x = torch.randn(rng.choice([1, 16, 64, 256]), IN)
    bits = _step_bits(models, x)
    for kwargs in ({"n_jobs": 1}, {"n_jobs": budget}, {}):
        for got, want in zip(_step_bits(models, x, **kwargs), bits, strict=True):
            assert torch.equal(got, want)


def test_useful_forward_workers_are_one_more_than_the_kernel_share_up_to_the_workers(gil):
    from parsum._grouping import useful_forward_workers

    def forward_workers(widths, rows, workers):
        mps = [ModelParams.of(mlp([w, w])) for w in widths]
        share = _grouping._kernel_share(mps, Batch(rows))
        return share, useful_forward_workers(mps, Batch(rows), workers)

    medium = [128 + 32 * i for i in range(16)]
    share, n = forward_workers(medium, 64, 8)
    assert 1 < share < 5 and n == math.ceil(1 + share) < 8
    assert forward_workers(medium, 4096, 8)[1] == 8  # at most the workers chosen
    assert forward_workers(medium, 64, 2)[1] == 2
    assert forward_workers([16] * 64, 32, 1)[1] == 1


# NOTE [ Pullbacks of small models ]


def tiny_ensemble(n, batch=32):
    """``n`` tiny MLPs of different widths (none stacked), and an input."""
    x = torch.randn(batch, IN)
    return learned(tiny_mlps(n), x), x


def test_small_pullback_workers_grow_with_the_models_up_to_a_cap():
    def workers(n, rows=32):
        models, _ = tiny_ensemble(n, rows)
        mps = [ModelParams.of(m) for m in models]
        assert _grouping._kernel_share(mps, Batch(rows)) < _grouping.MIN_KERNEL_SHARE
        return _grouping.small_pullback_workers(mps, Batch(rows))

    per_model = _grouping.MODEL_OVERHEAD_PARAM_ROWS
    few = _grouping.PULLBACK_WORKER_PARAM_ROWS // per_model  # a worker's share of models
    assert workers(few) == 1 and workers(2 * few - 1) == 1
    assert workers(2 * few) == 2
    assert workers(64) == workers(256) == _grouping.MAX_SMALL_PULLBACK_WORKERS


@pytest.mark.parametrize("n_models", [4, 32])
def test_small_models_pull_back_on_workers_their_forwards_in_the_caller(
    cores, workers_by_job, n_models, gil, monkeypatch
):
    without_plain_graphs(monkeypatch)
    # NOTE [ Pullbacks of small models ]: the forwards of models too small for workers stay in
    # the calling thread; their pullbacks, GIL-free in the engine, take workers where there is
    # work enough for them.
    cores(2)
    models, x = tiny_ensemble(n_models)
    parsum.sum_models(models, x).pow(2).mean().backward()  # learns the models, in model order
    workers_by_job.clear()
    parsum.sum_models(models, x).pow(2).mean().backward()
    forward = [n for name, n in workers_by_job if name == "forward_chunk"]
    backward = [n for name, n in workers_by_job if name == "pull_back_one"]
    assert forward == [1]
    assert backward == ([2] if n_models == 32 else [])  # one thread: no job for the pullbacks


@pytest.mark.parametrize("argument", [False, True])
def test_small_models_pulled_back_on_workers_give_the_bits_of_any_n_jobs(
    cores, workers_by_job, argument, gil, monkeypatch
):
    without_plain_graphs(monkeypatch)
    cores(2)
    models, x = tiny_ensemble(32)
    bits = _step_bits(models, x, argument)
    assert ("pull_back_one", 2) in workers_by_job and ("forward_chunk", 1) in workers_by_job
    for n_jobs in (1, 2, 3):
        for got, want in zip(_step_bits(models, x, argument, n_jobs=n_jobs), bits, strict=True):
            assert torch.equal(got, want)


def test_without_the_gil_small_models_run_their_forwards_on_the_workers_too(
    cores, workers_by_job, gil, monkeypatch
):
    # NOTE [ Threads without the GIL ]: a free-threaded interpreter runs the models' Python
    # side by side, so the forwards take the pullbacks' workers; the chunks, hence the bits,
    # stay. The GIL's state is looked at on every call: an import may enable it.
    cores(2)
    without_plain_graphs(monkeypatch)
    models, x = tiny_ensemble(32)
    with_gil = _step_bits(models, x)
    assert ("forward_chunk", 1) in workers_by_job and ("pull_back_one", 2) in workers_by_job
    for enabled in (False, True, False):
        gil(enabled)
        workers_by_job.clear()
        got = _step_bits(models, x)
        forward = [n for name, n in workers_by_job if name == "forward_chunk"]
        assert forward == ([1] if enabled else [2])
        assert ("pull_back_one", 2) in workers_by_job
        for a, b in zip(got, with_gil, strict=True):
            assert torch.equal(a, b)


def test_the_gil_is_read_from_the_interpreter():
    import sys

    check = getattr(sys, "_is_gil_enabled", None)
    assert parsum._config.gil_enabled() is (True if check is None else check())


def _step_bits(models, x, argument=True, **kwargs):
    """The output, x's gradient (where ``argument``) and every parameter's gradient of one
    step, cloned."""
    for m in models:
        m.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(argument)
    y = parsum.sum_models(models, x, **kwargs)
    y.pow(2).mean().backward()
    grads = [x.grad.clone()] if argument else []
    return [y.detach().clone(), *grads, *(g.clone() for g in param_grads(models))]


def test_a_budget_of_1_gives_the_bits_of_an_explicit_n_jobs(cores, jobs_run, monkeypatch):
    # NOTE [ Threads that pay ]: one thread either way, so the default keeps the chunks that an
    # explicit n_jobs has, and its bits, x's gradient's included (summed chunk by chunk).
    cores(1)
    without_plain_graphs(monkeypatch)
    x = torch.randn(5, IN)
    models = learned([mlp([4 + i % 5, 3 + i % 3]) for i in range(20)], x)
    default = _step_bits(models, x)
    assert jobs_run[-1][0] > 1  # its chunks, run in the calling thread
    for n_jobs in (1, 2):
        explicit = _step_bits(models, x, n_jobs=n_jobs)
        assert all(torch.equal(a, b) for a, b in zip(default, explicit))


class _ThreadsSeen(torch.nn.Module):
    """A one-hidden-layer MLP that records the intra-op threads its forwards run on."""

    def __init__(self, width, seen):
        super().__init__()
        self.hidden, self.out = torch.nn.Linear(IN, width), torch.nn.Linear(width, OUT)
        self.seen = seen

    def forward(self, x):
        self.seen.add(torch.get_num_threads())
        return self.out(torch.tanh(self.hidden(x)))


@pytest.mark.parametrize("kind", ["tiny", "one medium", "one wide", "stacked", "stacked large"])
def test_a_budget_of_2_keeps_tiny_kernels_on_one_intra_op_thread(
    cores, jobs_run, kind, gil, monkeypatch
):
    # NOTE [ Kernels too small for intra-op threads ] in parsum._grouping: where no model's
    # kernels are large enough for a second intra-op thread, the default runs the chunks of an
    # explicit n_jobs in the calling thread, one intra-op thread each, with its bits; a model
    # large enough keeps one chunk on both threads, and so does a stacked group, unless the
    # pullbacks of the small models go to workers (NOTE [ Pullbacks of small models ]) and no
    # model reaches SMALL_INTRA_OP_MIN_PARAM_ROWS, no group STACKED_INTRA_OP_MIN_PARAM_ROWS.
    cores(2)
    without_plain_graphs(monkeypatch)
    seen: set[int] = set()
    x = torch.randn(32, IN)
    if kind.startswith("stacked"):  # two architectures, 8 alike each: auto stacks them in two
        models = [mlp([24]) for _ in range(8)] + [mlp([16]) for _ in range(8)]
        if kind == "stacked large":  # a batch that makes a group's kernels large
            rows = _grouping._param_rows(ModelParams.of(models[0]), Batch(1))
            x = torch.randn(_grouping.STACKED_INTRA_OP_MIN_PARAM_ROWS // (8 * rows) + 1, IN)
    else:  # of their own: none stacked
        models = [_ThreadsSeen(8 + i, seen) for i in range(12)]
    if kind == "one medium":  # above INTRA_OP_MIN_PARAM_ROWS, below the small models' limit
        models.append(_ThreadsSeen(1200, seen))
    if kind == "one wide":
        models.append(_ThreadsSeen(12000, seen))
    mps = [ModelParams.of(m) for m in models]
    rows = [_grouping._param_rows(mp, Batch.of([x])) for mp in mps]
    assert (max(rows) >= _grouping.INTRA_OP_MIN_PARAM_ROWS) == (kind not in ("tiny", "stacked"))
    assert (max(rows) >= _grouping.SMALL_INTRA_OP_MIN_PARAM_ROWS) == (kind == "one wide")
    assert _grouping.too_small_for_workers(mps, Batch.of([x]))
    assert _grouping.small_pullback_workers(mps, Batch.of([x])) == 2
    learned(models, x)
    seen.clear()
    jobs_run.clear()
    default = _step_bits(models, x)
    chunks, workers = jobs_run[0]  # the forward's
    if kind in ("tiny", "one medium", "stacked"):
        assert chunks > 1 and workers == 1 and (kind == "stacked" or seen == {1})
        if kind == "stacked":  # their pullbacks on workers (the tiny ones share `seen`: in order)
            assert jobs_run[1] == (chunks, 2)
        for n_jobs in (1, 2):
            explicit = _step_bits(models, x, n_jobs=n_jobs)
            assert all(torch.equal(a, b) for a, b in zip(default, explicit))
    else:
        assert chunks == 1
        assert kind == "stacked large" or seen == {2}
    assert torch.get_num_threads() == 2  # the caller's, restored


def test_a_budget_of_2_keeps_tiny_models_that_step_in_the_backward_on_one_chunk(cores, jobs_run):
    # NOTE [ Kernels too small for intra-op threads ]: their steps run as one a chunk.
    cores(2)
    x = torch.randn(32, IN)
    models = learned([_ThreadsSeen(8 + i, set()) for i in range(12)], x)
    parsum.sum_models(models, x, step_in_backward=stepping(models)).pow(2).sum().backward()
    assert jobs_run[-1][0] == 1
    parsum.sum_models(models, x).pow(2).sum().backward()
    assert jobs_run[-1][0] > 1


class _Head(torch.nn.Module):
    """A linear model of any output width."""

    def __init__(self, n_out):
        super().__init__()
        self.lin = torch.nn.Linear(IN, n_out)

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("n_out", [3, 70_000])  # summed at once, and chunk by chunk
def test_the_sum_does_not_depend_on_n_jobs_and_is_compensated(n_out):
    # NOTE [ One reduction for small outputs ] in parsum._summation: small outputs, all of
    # them summed at once whatever the chunks; large ones chunk by chunk, in chunk order.
    from parsum._summation import sums_at_once

    x = torch.randn(2, IN)
    models = [_Head(n_out) for _ in range(12)]
    with torch.no_grad():  # outputs 1e8, ten times 0.3, -1e8: a float32 running sum loses 3
        for i, m in enumerate(models):
            m.lin.weight.zero_()
            m.lin.bias.fill_(1e8 if i == 0 else -1e8 if i == 11 else 0.3)
    outs = [m(x).detach() for m in models]
    assert sums_at_once(len(models), outs[0]) == (n_out == 3)
    runs = {
        (n_jobs, chunk_size): parsum.sum_models(
            models, x, n_jobs=n_jobs, chunk_size=chunk_size
        ).detach()
        for n_jobs in (1, 2, 3)
        for chunk_size in (None, 5)
    }
    for (_, chunk_size), run in runs.items():
        assert torch.equal(run, runs[1, chunk_size])  # any n_jobs
        if n_out == 3:
            assert torch.equal(run, runs[1, None])  # and any chunks
    exact = torch.stack(outs).double().sum(0)
    assert torch.equal(runs[1, None], exact.float())  # 3.0000001, where sum(outs) gives 0
    assert not torch.equal(sum(outs), exact.float())


@pytest.mark.parametrize(("n_out", "sums"), [(3, 1), (70_000, 4)])
def test_chunks_in_one_thread_are_summed_in_one_pass_where_their_outputs_go_at_once(
    monkeypatch, n_out, sums
):
    # NOTE [ Chunks in one pass ] in parsum._function: small outputs are all terms of the call's
    # one reduction, so 4 chunks at one thread set up one sum; large ones still one a chunk.
    from parsum import _function

    made = []

    class Counted(_function.CompensatedAccumulator):
        def __init__(self):
            made.append(self)
            super().__init__()

    monkeypatch.setattr(_function, "CompensatedAccumulator", Counted)
    x = torch.randn(2, IN)
    models = [_Head(n_out) for _ in range(12)]
    y = parsum.sum_models(models, x, n_jobs=1, chunk_size=3)
    assert len(made) == sums
    torch.testing.assert_close(y, sum(m(x) for m in models))
    monkeypatch.undo()
    assert torch.equal(y, parsum.sum_models(models, x, n_jobs=2, chunk_size=3))


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("bad", [3, 4, 11])  # a chunk's first model, one inside, the last
def test_a_mismatch_in_a_later_chunk_is_named_at_any_n_jobs_and_changes_no_buffer(n_jobs, bad):
    class Normed(torch.nn.Module):
        def __init__(self, i):
            super().__init__()
            self.lin, self.norm, self.i = torch.nn.Linear(IN, 3), torch.nn.BatchNorm1d(3), i

        def forward(self, x):
            y = self.norm(self.lin(x))
            return y[:, :2] if self.i == bad else y

    models = [Normed(i) for i in range(12)]
    before = [m.norm.running_mean.clone() for m in models]
    with pytest.raises(
        parsum.ParsumError, match=f"model {bad} \\(Normed\\) returned output leaf 0"
    ):
        parsum.sum_models(models, torch.randn(4, IN), n_jobs=n_jobs, chunk_size=4)
    assert all(torch.equal(b, m.norm.running_mean) for b, m in zip(before, models))


# NOTE [ Chunks a thread ]


def test_fewer_threads_cut_fewer_chunks_unless_they_would_balance_worse():
    units = [Unit((i,), "autograd") for i in range(32)]

    def cut(units, costs, budget):  # the models' costs given: no model to estimate
        return _grouping.thread_chunks(units, [], Batch(1), costs, budget)

    even = [10_000_000] * 32
    assert len(cut(units, even, 2)) == _grouping.chunk_limit(2) == 4
    assert len(cut(units, even, 4)) == 8
    assert len(cut(units, even, 16)) == MAX_CHUNKS  # 2 a thread is more
    assert len(cut(units[:3], even, 2)) == 3  # never more than units
    # 24 small models then 8 wide ones: in 4 chunks of about equal cost one thread gets the
    # costlier part; more chunks balance it, and their overhead costs less than that.
    uneven = [5_000_000] * 24 + [100_000_000] * 8
    chunks = cut(units, uneven, 2)
    assert [k for chunk in chunks for k in chunk] == list(range(32))

    def span(cut):
        loads = [0, 0]
        for c in sorted((sum(uneven[k] for k in chunk) for chunk in cut), reverse=True):
            loads[loads.index(min(loads))] += c
        return max(loads)

    four = cost_chunks(units, uneven, 4)
    assert len(chunks) > 4 and span(chunks) < span(four)


@pytest.mark.parametrize("n_cores", [2, 16])
def test_the_chunks_of_a_budget_give_every_n_jobs_the_same_bits(cores, n_cores, jobs_run):
    cores(n_cores)
    torch.manual_seed(0)
    x = torch.randn(64, IN)
    models = learned([mlp([128 + 24 * i] * (1 + i % 3)) for i in range(16)], x)
    want = 4 if n_cores == 2 else 16  # 2 a thread of the budget; MAX_CHUNKS on 16
    assert chunks_on_budget(models, x) == want
    results = []
    for n_jobs in (1, 2, 4):
        for m in models:
            m.zero_grad(set_to_none=True)
        y = parsum.sum_models(models, x, n_jobs=n_jobs)
        assert jobs_run[-1][0] == want
        y.pow(2).sum().backward()
        results.append((y.detach(), param_grads(models)))
    for y, grads in results[1:]:
        assert torch.equal(y, results[0][0])
        assert all(torch.equal(a, b) for a, b in zip(grads, results[0][1]))
    expected = torch.stack([m(x) for m in models]).double().sum(0)
    torch.testing.assert_close(results[0][0].double(), expected, rtol=1e-5, atol=1e-5)
