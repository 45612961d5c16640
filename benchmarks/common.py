"""Workloads, baselines and the interleaved timer shared by the benchmarks.

Every workload is a list of models, an input batch, and the loss ``y.pow(2).mean()`` of the
models' sum. The baselines are what a user would run instead of parsum (BENCHMARKING.md). Every
step of every method starts with the gradients set to None, as ``optimizer.zero_grad()`` leaves
them in a training loop.
"""

from __future__ import annotations

import contextlib
import pathlib
import queue
import random
import statistics
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn


def mlp(
    n_in: int,
    width: int,
    depth: int,
    n_out: int,
    act: type[nn.Module] = nn.Tanh,
    dropout: float | None = None,
) -> nn.Module:
    dims = [n_in] + [width] * depth
    layers: list[nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), act()]
        if dropout is not None:
            layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers, nn.Linear(width, n_out))


class SmallCNN(nn.Module):
    """Two convolutions and a linear head for 1x28x28 images; ``channels`` sets the width."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, kernel, padding=kernel // 2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * channels * 7 * 7, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class Wrapped(nn.Module):
    """A model inside a module with a forward of its own, as users write them."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class Encoder(nn.Module):
    """A transformer encoder layer with a head on its tokens' mean."""

    def __init__(self, width: int, feed_forward: int) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            width, 4, feed_forward, dropout=0.0, batch_first=True
        )
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x).mean(1))


class Bag(nn.Module):
    """An EmbeddingBag of 1000 rows with a Linear head."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(1000, width, mode="mean")
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(x))


class TrunkHead(nn.Module):
    """A head over a trunk that other heads share: the trunk's output through two Linear
    layers, as a class of its own."""

    def __init__(self, trunk: nn.Module, width: int) -> None:
        super().__init__()
        self.trunk = trunk
        self.hidden = nn.Linear(128, width)
        self.out = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.trunk(x))))


class Recurrent(nn.Module):
    """An LSTM over 8 features a step with a Linear head on its last step."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, width, batch_first=True)
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


class Net(nn.Module):
    """An MLP as users write one: a class of its own, its hidden layers in a ModuleList and a
    forward that loops over them. parsum runs an ``nn.Sequential`` of known layers as a direct
    program (NOTE [ Direct programs ] in parsum._engines), which skips the module calls; this
    one it calls as the plain loop does."""

    def __init__(self, n_in: int, width: int, depth: int, n_out: int) -> None:
        super().__init__()
        dims = [n_in] + [width] * depth
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.out = nn.Linear(width, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.out(x)


@dataclass
class Workload:
    name: str
    description: str
    models: list[nn.Module]
    x: torch.Tensor
    identical: bool = False  # one architecture: torch.func.vmap is a baseline


def workload(name: str, batch: int | None = None) -> Workload:
    """Build a workload by name (``WORKLOADS``), seeded, with its default or a given batch."""
    torch.manual_seed(0)
    if name == "heterogeneous-medium":
        models = [mlp(64, (128, 256, 384, 512)[i % 4], 1 + i % 3, 10) for i in range(16)]
        b = batch or 256
        return Workload(name, f"16 MLPs, widths 128-512, batch {b}", models, torch.randn(b, 64))
    if name == "example-members":
        # The main example's ensemble (examples/train_ensemble.py): 12 MLPs of widths 64-512 and
        # depths 1-3, ReLU and GELU in turn, on the digits' 64 features.
        acts = (nn.ReLU, nn.GELU)
        models = [
            mlp(64, (64, 128, 256, 384, 512)[i % 5], 1 + i % 3, 10, acts[i % 2]) for i in range(12)
        ]
        b = batch or 64
        desc = f"12 MLPs of the main example, widths 64-512, batch {b}"
        return Workload(name, desc, models, torch.randn(b, 64))
    if name == "dropout-medium":
        # heterogeneous-medium with dropout after each hidden layer: forwards in model order
        # (NOTE [ Random numbers in forwards ] in parsum._random).
        models = [
            mlp(64, (128, 256, 384, 512)[i % 4], 1 + i % 3, 10, dropout=0.1) for i in range(16)
        ]
        b = batch or 256
        desc = f"16 MLPs with dropout, widths 128-512, batch {b}"
        return Workload(name, desc, models, torch.randn(b, 64))
    if name == "dropout-wrapped":
        # The same, each inside a module of the user's: no direct program, drawn in model order.
        models = [Wrapped(m) for m in workload("dropout-medium").models]
        b = batch or 256
        desc = f"16 MLPs with dropout in modules of their own, widths 128-512, batch {b}"
        return Workload(name, desc, models, torch.randn(b, 64))
    if name == "heterogeneous-tiny":
        models = [mlp(16, (16, 24, 32, 48)[i % 4], 1 + i % 3, 4) for i in range(64)]
        b = batch or 32
        return Workload(name, f"64 MLPs, widths 16-48, batch {b}", models, torch.randn(b, 16))
    if name == "distinct-tiny":
        # No two alike (auto stacks nothing), and classes of the user's own.
        models = [Net(16, 16 + i // 2, 1 + i % 3, 4) for i in range(64)]
        b = batch or 32
        desc = f"64 distinct MLP classes, widths 16-47, batch {b}"
        return Workload(name, desc, models, torch.randn(b, 16))
    if name == "distinct-medium":
        models = [Net(64, 128 + 24 * i, 1 + i % 3, 10) for i in range(16)]
        b = batch or 64
        desc = f"16 distinct MLP classes, widths 128-488, batch {b}"
        return Workload(name, desc, models, torch.randn(b, 64))
    if name == "identical-tiny":
        models = [mlp(16, 32, 2, 4) for _ in range(64)]
        b = batch or 32
        desc = f"64 identical MLPs, width 32, batch {b}"
        return Workload(name, desc, models, torch.randn(b, 16), identical=True)
    if name == "identical-classes":
        # identical-tiny written as a class of the user's own: stacked, it runs through vmap
        # (a Sequential of known layers runs as batched matmuls, NOTE [ Batched layers ]).
        models = [Net(16, 32, 2, 4) for _ in range(64)]
        b = batch or 32
        desc = f"64 identical MLP classes, width 32, batch {b}"
        return Workload(name, desc, models, torch.randn(b, 16), identical=True)
    if name == "identical-medium":
        # Where vmap loses to the plain loop: auto must not stack these.
        models = [mlp(64, 256, 2, 10) for _ in range(16)]
        b = batch or 256
        desc = f"16 identical MLPs, width 256, batch {b}"
        return Workload(name, desc, models, torch.randn(b, 64), identical=True)
    if name == "large":
        models = [mlp(256, 1024, 2, 64) for _ in range(4)]
        b = batch or 512
        desc = f"4 MLPs, width 1024, 2 hidden layers, batch {b}"
        return Workload(name, desc, models, torch.randn(b, 256))
    if name == "cnn-ensemble":
        models = [SmallCNN((8, 12, 16, 24)[i % 4], (3, 5)[i % 2]) for i in range(8)]
        b = batch or 64
        desc = f"8 small CNNs on 28x28 images, 8-24 channels, batch {b}"
        return Workload(name, desc, models, torch.randn(b, 1, 28, 28))
    if name == "shared-trunk":
        # Heads over one trunk, which every model runs (as a user's loop over the heads
        # would): its parameters' gradients are a sum over the models.
        trunk = nn.Sequential(nn.Linear(64, 128), nn.Tanh())
        models = [
            nn.Sequential(
                trunk,
                nn.Linear(128, 32 + 16 * (i % 4)),
                nn.Tanh(),
                nn.Linear(32 + 16 * (i % 4), 10),
            )
            for i in range(16)
        ]
        b = batch or 64
        desc = f"16 heads of widths 32-80 over one trunk of width 128, batch {b}"
        return Workload(name, desc, models, torch.randn(b, 64))
    if name == "trunk-classes":
        # The heads of shared-trunk as a user writes a multi-head model: a class of its own
        # that runs the trunk it holds. Not a Sequential of known layers, so never a plain
        # graph: the caller's graph pulls back each model that uses the trunk in an engine
        # call of its own (NOTE [ Parameters several models use in the caller's graph ]).
        trunk = nn.Sequential(nn.Linear(64, 128), nn.Tanh())
        models = [TrunkHead(trunk, 32 + 16 * (i % 4)) for i in range(16)]
        b = batch or 64
        desc = f"16 head classes of widths 32-80 over one trunk of width 128, batch {b}"
        return Workload(name, desc, models, torch.randn(b, 64))
    if name == "heads":
        # Heads over features that a trunk made before the sum (x standing for them: with
        # ``--step train-x`` its gradient is wanted too): small models with many repeats.
        models = [
            nn.Sequential(
                nn.Linear(128, 32 + 16 * (i % 4)), nn.Tanh(), nn.Linear(32 + 16 * (i % 4), 10)
            )
            for i in range(16)
        ]
        b = batch or 64
        desc = f"16 heads of widths 32-80 over 128 features, batch {b}"
        return Workload(name, desc, models, torch.randn(b, 128))
    if name == "mixed-sizes":
        # Many small members and a few large ones, built in that order: chunks of equal model
        # counts put the large ones together at the end.
        models = [mlp(64, (32, 64)[i % 2], 1 + i % 2, 10) for i in range(24)]
        models += [mlp(64, (512, 768)[i % 2], 2, 10) for i in range(8)]
        b = batch or 128
        desc = f"24 MLPs of widths 32-64 then 8 of widths 512-768, batch {b}"
        return Workload(name, desc, models, torch.randn(b, 64))
    if name == "transformers":
        # Sequences: every Linear works once per token (NOTE [ Tokens ] in parsum._grouping).
        models = [Encoder(64, 64 + 16 * i) for i in range(8)]
        b = batch or 16
        desc = f"8 transformer layers, width 64, feed-forward 64-176, batch {b} x 16 tokens"
        return Workload(name, desc, models, torch.randn(b, 16, 64))
    if name == "embedding-bags":
        models = [Bag(24 + 2 * i) for i in range(8)]
        b = batch or 64
        desc = f"8 EmbeddingBags of 1000 rows, widths 24-38, with a head, batch {b} x 8 ids"
        return Workload(name, desc, models, torch.randint(0, 1000, (b, 8)))
    if name == "lstms":
        models = [Recurrent(16 + 2 * i) for i in range(8)]
        b = batch or 32
        desc = f"8 LSTMs, widths 16-30, with a head, batch {b} x 10 steps"
        return Workload(name, desc, models, torch.randn(b, 10, 8))
    extra = (
        "distinct-tiny", "distinct-medium", "identical-classes", "mixed-sizes", "dropout-medium",
        "dropout-wrapped", "transformers", "embedding-bags", "lstms", "shared-trunk",
        "trunk-classes", "heads", "example-members",
    )  # fmt: skip
    raise ValueError(f"unknown workload {name!r}; expected one of {(*WORKLOADS, *extra)}")


def workload_spec(item: str) -> tuple[str, int | None]:
    """A workload's name and batch from ``name[:batch]``, as ``--workloads`` names them."""
    name, _, batch = item.partition(":")
    return name, int(batch) if batch else None


def workloads_of(spec: str) -> Iterator[Workload]:
    """The workloads of a comma-separated ``name[:batch]`` list (``--workloads``), each built
    when its turn comes."""
    for item in spec.split(","):
        yield workload(*workload_spec(item))


WORKLOADS = (
    "heterogeneous-medium",
    "heterogeneous-tiny",
    "identical-tiny",
    "identical-medium",
    "large",
    "cnn-ensemble",
)


def loss_of(y: torch.Tensor) -> torch.Tensor:
    return y.pow(2).mean()


_PARAMETERS: dict[int, tuple[nn.Module, list[torch.Tensor]]] = {}


def zero_grads(models: list[nn.Module]) -> None:
    """``.grad = None`` for every parameter, as ``optimizer.zero_grad()`` does: over each
    model's list of its parameters, made once (walking 64 models with ``m.zero_grad()`` cost
    0.45 ms a step, which a training loop does not pay and ``vmap``'s 6 stacked leaves do not
    either). Per model, not per list: ``Members`` refills its list in place, and a list's
    parameters kept by the list's id had zeroed the first draw's models on every step."""
    for m in models:
        found = _PARAMETERS.get(id(m))
        if found is None or found[0] is not m:
            found = _PARAMETERS[id(m)] = (m, list(m.parameters()))
        for p in found[1]:
            p.grad = None


class Members:
    """A step over a new random draw of ``share`` of the models each call, in model order; the
    list the step was made with is refilled in place (seeded: every method draws alike).
    ``everyone``: the models to draw from, where ``models`` is shared and drawn already."""

    def __init__(
        self,
        models: list[torch.nn.Module],
        share: float,
        everyone: list[torch.nn.Module] | None = None,
    ) -> None:
        self.all = list(models if everyone is None else everyone)  # ``models`` may be drawn
        self.drawn = models
        self.k = max(1, round(share * len(self.all)))
        self.rng = random.Random(0)

    def around(self, step: Callable[[], None]) -> Callable[[], None]:
        def drawn_step() -> None:
            self.drawn[:] = [
                self.all[i] for i in sorted(self.rng.sample(range(len(self.all)), self.k))
            ]
            step()

        return drawn_step


def plain_step(models: list[nn.Module], x: torch.Tensor) -> None:
    """The plain loop: ``sum(m(x) for m in models)``, forward and backward."""
    zero_grads(models)
    loss_of(sum(m(x) for m in models)).backward()  # type: ignore[arg-type]


def parsum_step(
    models: list[nn.Module], x: torch.Tensor, package: Any = None, **kwargs: object
) -> None:
    """``parsum.sum_models(models, x, **kwargs)``, forward and backward (``package``: another
    parsum to call, such as bench_against's other revision)."""
    zero_grads(models)
    loss_of(_parsum(package).sum_models(models, x, **kwargs)).backward()


def _parsum(package: Any) -> Any:
    """``package``, or this checkout's parsum."""
    if package is not None:
        return package
    import parsum

    return parsum


def one_thread(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` run with one intra-op thread."""
    return on_threads(fn, 1)


def on_threads(fn: Callable[[], None], threads: int) -> Callable[[], None]:
    """``fn`` run with ``threads`` intra-op threads."""

    def run() -> None:
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            fn()
        finally:
            torch.set_num_threads(saved)

    return run


def with_attribute(fn: Callable[[], None], owner: Any, name: str, value: Any) -> Callable[[], None]:
    """``fn`` run with ``owner.name`` set to ``value`` (a piece of parsum made a no-op, to
    measure what it gives), set back after."""

    def run() -> None:
        saved = getattr(owner, name)
        setattr(owner, name, value)
        try:
            fn()
        finally:
            setattr(owner, name, saved)

    return run


def thread_cpu_ns() -> dict[int, int]:
    """Every thread of this process (Python's, parsum's helpers, OpenMP's), by its native id,
    with the nanoseconds it has run on a CPU so far (Linux's ``/proc/self/task/*/schedstat``;
    empty where the system does not tell). A thread that waits on a lock or a condition runs
    none; one that spins runs all the time it spins."""
    found: dict[int, int] = {}
    tasks = pathlib.Path("/proc/self/task")
    if not tasks.is_dir():
        return found
    for task in tasks.iterdir():
        # A thread may end between the listing and the read.
        with contextlib.suppress(OSError, ValueError, IndexError):
            found[int(task.name)] = int((task / "schedstat").read_text().split()[0])
    return found


def cpu_split(before: dict[int, int], after: dict[int, int]) -> tuple[float, float]:
    """Seconds of CPU the calling thread ran between two ``thread_cpu_ns`` readings, and the
    seconds every other thread ran together (those started in between from zero; those ended
    in between are not counted: the benchmarks' threads and parsum's helpers persist)."""
    me = threading.get_native_id()
    deltas = {tid: ns - before.get(tid, 0) for tid, ns in after.items()}
    mine = deltas.pop(me, 0)
    return mine / 1e9, sum(d for d in deltas.values() if d > 0) / 1e9


def one_intra_op_thread() -> None:
    """Give this new thread 1 intra-op thread, for good.

    PyTorch sets a thread's count on its first parallel op (``torch.get_num_threads`` counts as
    one) to the last count any thread set: a count set before that is lost once another thread
    sets its own in between, as the caller restoring its threads after its share does. The
    thread then ran its share with an OpenMP team of the caller's size, and while that team
    lived, the process held more OpenMP threads than cores, which makes libgomp's waits sleep
    instead of spin in every thread: the plain loop on 2 cores took 18 ms a step instead of 8
    afterwards (16 MLPs of widths 128-512, batch 64), in 2 of 8 runs."""
    torch.get_num_threads()
    torch.set_num_threads(1)


class ShareThreads:
    """P persistent threads with 1 intra-op thread each: ``run(work)`` calls ``work(p)`` for
    every p, p = 0 in the calling thread (also with 1 intra-op thread), and returns when all
    are done. The machinery of the hand split and the two-phase ceiling."""

    def __init__(self, threads: int) -> None:
        # PyTorch gives a thread its intra-op count on its first parallel op, from the last
        # count any thread set: the helpers' 1 would become the caller's for good if it had
        # run none yet (8 CNNs' plain loop measured 100 ms a step there, against 56).
        torch.get_num_threads()
        self.tasks: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(threads - 1)]
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        for p, tasks in enumerate(self.tasks, 1):
            threading.Thread(target=self._serve, args=(p, tasks), daemon=True).start()

    def _serve(self, p: int, tasks: queue.SimpleQueue) -> None:
        one_intra_op_thread()
        while True:
            work = tasks.get()
            work(p)
            self.done.put(None)

    def run(self, work: Callable[[int], None]) -> None:
        for tasks in self.tasks:
            tasks.put(work)
        one_thread(lambda: work(0))()
        for _ in self.tasks:
            self.done.get()


def balanced_split(models: list[nn.Module], x: torch.Tensor, parts: int) -> list[list[nn.Module]]:
    """The models in ``parts`` shares of about equal estimated cost, as
    ``parsum.distributed.share`` gives them to ranks: a split by hand at its best (round robin
    gave the widest of 8 CNNs to one thread of 2, 62.7 ms a step against 50.7)."""
    from parsum.distributed import balanced_shares

    # More threads than models (8 transformer layers on 16 threads): a model a thread, and
    # threads with nothing to run, as a split by hand would leave them.
    used = min(parts, len(models))
    shares = [[models[i] for i in part] for part in balanced_shares(models, (x,), {}, used)]
    return shares + [[] for _ in range(parts - used)]


class HandSplit:
    """The ceiling: P persistent threads, each with 1 intra-op thread, running the plain loop
    on its share of the models (``balanced_split``), forward and backward, with no
    reduction."""

    def __init__(self, models: list[nn.Module], threads: int, x: torch.Tensor) -> None:
        self.shares = balanced_split(models, x, threads)
        self.threads = ShareThreads(threads)

    def _step(self, p: int, x: torch.Tensor) -> None:
        share = self.shares[p]
        zero_grads(share)
        for m in share:
            loss_of(m(x)).backward()

    def __call__(self, x: torch.Tensor) -> None:
        self.threads.run(lambda p: self._step(p, x))


class TwoPhase:
    """The ceiling of a loss of a sum on P threads: P persistent threads (1 intra-op thread
    each) run the forwards of their share of the models (``balanced_split``); the calling
    thread sums the outputs plainly and takes the loss's gradient; then each thread pulls its
    models back in one ``torch.autograd.backward``. No compensation, planning, checks or
    failure handling: what parsum on P threads would cost with nothing of its own."""

    outs: list[list[torch.Tensor]]  # each thread's outputs, until pulled back

    def __init__(self, models: list[nn.Module], threads: int, x: torch.Tensor) -> None:
        self.shares = balanced_split(models, x, threads)
        self.forget()
        self.threads = ShareThreads(threads)

    def forget(self) -> None:
        """Hold no output of the last forwards (their sum pulled back elsewhere)."""
        self.outs = [[] for _ in self.shares]

    def _forward(self, p: int, x: torch.Tensor) -> None:
        self.outs[p] = [m(x) for m in self.shares[p]]

    def _backward(self, p: int, g: torch.Tensor) -> None:
        if self.outs[p]:  # a thread with no model has nothing to pull back
            torch.autograd.backward(self.outs[p], [g] * len(self.outs[p]))
        self.outs[p] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The models' forwards on the threads; their plain sum."""
        self.threads.run(lambda p: self._forward(p, x))
        return sum(o for outs in self.outs for o in outs)  # type: ignore[return-value]

    def backward(self, y: torch.Tensor) -> None:
        """The loss's gradient at the sum, then every model pulled back on its thread."""
        leaf = y.detach().requires_grad_()
        (g,) = torch.autograd.grad(loss_of(leaf), leaf)
        self.threads.run(lambda p: self._backward(p, g))


def synchronized(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn``, then wait for the GPU: a step ends when the device is done with it."""

    def run() -> None:
        fn()
        torch.cuda.synchronize()

    return run


def vmap_step(models: list[nn.Module], adam: bool = False) -> Callable[[torch.Tensor], None]:
    """``torch.func.stack_module_state`` + ``vmap``: what users run for identical models. The
    stacked parameters are the leaves (as in torch.func's ensembling tutorial); with ``adam``,
    a ``torch.optim.Adam`` step over them follows."""
    params, buffers = torch.func.stack_module_state(models)  # type: ignore[arg-type]
    base = models[0]

    def one(p: dict, b: dict, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(base, (p, b), (x,))

    ensemble = torch.vmap(one, in_dims=(0, 0, None))

    optimizer = torch.optim.Adam(params.values(), lr=1e-3) if adam else None

    def step(x: torch.Tensor) -> None:
        for p in params.values():
            p.grad = None
        loss_of(ensemble(params, buffers, x).sum(0)).backward()
        if optimizer is not None:
            optimizer.step()

    return step


def parameters_of(models: Sequence[nn.Module]) -> list[torch.Tensor]:
    """Every model's parameters, each once (models may share some: a trunk), in model order:
    an optimizer given one twice steps it twice, and warns."""
    return list(dict.fromkeys(p for m in models for p in m.parameters()))


def plain_adam_step(models: list[nn.Module]) -> Callable[[torch.Tensor], None]:
    """The plain loop then one ``torch.optim.Adam`` step over every model's parameters (its
    ``zero_grad()`` first): a training step as users write it."""
    optimizer = torch.optim.Adam(parameters_of(models), lr=1e-3)

    def step(x: torch.Tensor) -> None:
        optimizer.zero_grad()
        loss_of(sum(m(x) for m in models)).backward()  # type: ignore[arg-type]
        optimizer.step()

    return step


def parsum_adam_step(
    models: list[nn.Module],
    parameters: list[torch.Tensor],
    shared: bool,
    n_jobs: int | None = None,
    package: Any = None,
) -> Callable[[torch.Tensor], None]:
    """``parsum.sum_models`` then one ``torch.optim.Adam`` step over ``parameters``; the
    models' own ``.grad`` are set to None first only where other methods run the same models
    (``shared``) and leave gradients of their own there: a user's loop zeroes through the
    optimizer alone. ``package``: another parsum to call (bench_against's)."""
    sum_models = _parsum(package).sum_models
    optimizer = torch.optim.Adam(parameters, lr=1e-3)

    def step(x: torch.Tensor) -> None:
        if shared:
            zero_grads(models)
        optimizer.zero_grad()
        loss_of(sum_models(models, x, n_jobs=n_jobs)).backward()
        optimizer.step()

    return step


def parsum_sib_step(
    models: Sequence[nn.Module], package: Any = None, n_jobs: int | None = None
) -> Callable[[torch.Tensor], None]:
    """``parsum.sum_models`` with a ``StepInBackward`` of one Adam per model: the step runs
    in the backward. ``package``: another parsum to call (bench_against's)."""
    parsum = _parsum(package)
    sib = parsum.StepInBackward(list(models), torch.optim.Adam, lr=1e-3)

    def step(x: torch.Tensor) -> None:
        loss_of(parsum.sum_models(models, x, n_jobs=n_jobs, step_in_backward=sib)).backward()

    return step


Key = TypeVar("Key", bound=Hashable)


def interleaved(
    methods: dict[Key, Callable[[], None]],
    rounds: int,
    warmup: int = 3,
    settle: int = 0,
    settle_seconds: float = 0.0,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[Key, float]:
    """Median seconds per call of each method (see ``interleaved_rounds``)."""
    times = interleaved_rounds(methods, rounds, warmup, settle, settle_seconds, clock)
    return {name: statistics.median(ts) for name, ts in times.items()}


def interleaved_rounds(
    methods: dict[Key, Callable[[], None]],
    rounds: int,
    warmup: int = 3,
    settle: int = 0,
    settle_seconds: float = 0.0,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[Key, list[float]]:
    """Seconds of each call of each method (by ``clock``: ``time.process_time`` counts the CPU
    time of every thread of the process instead of the time that passed), the methods run in
    turn, round by round, so that drift of the machine affects them alike. The order is shuffled
    every round (seeded): in a fixed order a method's time depended on which method ran before
    it (the same parsum call measured 0.91x and 0.75x the plain loop in two orders), and a fixed
    order charges that to the same method in every round. With ``settle``, each method's turn
    first makes that many calls untimed, so that the timed call runs as it does in a loop of its
    own: the first call after another method pays for what that one left behind (libgomp's
    threads spinning for milliseconds after the plain loop's last parallel region, taking a core
    from the next method's threads: 8 CNNs at n_jobs=2, 57.0 ms a step timed first, 55.0
    second). With ``settle_seconds``, the untimed calls go on until that long has passed in the
    turn: libgomp's threads spin for 5-9 ms (NOTE [ Spinning intra-op threads ] in parsum's
    _pool), longer than one call of 1 ms steps (64 identical tiny MLPs, parsum in stack_ with
    one settling call: 0.71x vmap in a full run, 0.94-0.95x in blocks of 30 calls)."""
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    times: dict[Key, list[float]] = {name: [] for name in methods}
    order = list(methods)
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for name in order:
            fn = methods[name]
            turn = time.perf_counter()
            for _ in range(settle):
                fn()
            while time.perf_counter() - turn < settle_seconds:
                fn()
            start = clock()
            fn()
            times[name].append(clock() - start)
    return times


def paired_ratio(
    numerator: list[float],
    denominator: list[float],
    resamples: int = 2000,
    level: float = 0.95,
) -> tuple[float, float, float]:
    """Median of the per-round ratios of two methods timed in the same rounds, with a
    bootstrap interval of that median at ``level`` (seeded): an interval that holds 1.0 means
    the two are not told apart at this precision."""
    ratios = [a / b for a, b in zip(numerator, denominator)]
    draw = random.Random(0).choices
    medians = sorted(statistics.median(draw(ratios, k=len(ratios))) for _ in range(resamples))
    tail = (1 - level) / 2
    return (
        statistics.median(ratios),
        medians[int(tail * resamples)],
        medians[int((1 - tail) * resamples) - 1],
    )


# The steps of a ProcessSplit command that each rank runs untimed before the ones it times.
PROCESS_SETTLE = 2


class ProcessSplit:
    """P processes on this host (gloo on 127.0.0.1), each with its share of the thread budget
    (``budget // P`` intra-op threads, torchrun's way), each summing its share of the models
    (``parsum.distributed.share``; identical ones in ``parsum.stack_`` storage) with
    ``parsum.distributed.sum_models``: forward, then backward of the loss.

    The processes are started once (spawn, as torchrun does) and wait for a command on a pipe:
    calling the object runs ``steps`` steps on every rank, one after the other as a training
    loop runs them, and returns when all have finished; ``step_seconds`` is then a step's time,
    timed in each rank over its steps after the first ``PROCESS_SETTLE`` (the slowest rank's).
    Waking the ranks through the pipes, and the first steps of a process that slept in the
    meantime, cost what no torchrun job pays between its steps: timed from the parent, 64
    identical tiny MLPs in 1 process read 1.67 ms a step with one step a command and 1.58 with
    10 (2 cores), and 1.08 against 0.77 in two runs of 10 (0.71x and 0.98x the threads' default).
    """

    def __init__(
        self, name: str, batch: int | None, processes: int, budget: int, steps: int = 1
    ) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        port = _free_port()
        threads = max(1, budget // processes)
        self.pipes = []
        self.procs = []
        for rank in range(processes):
            here, there = ctx.Pipe()
            args = (rank, processes, port, name, batch, threads, steps, there)
            proc = ctx.Process(target=_process_rank, args=args, daemon=True)
            proc.start()
            self.pipes.append(here)
            self.procs.append(proc)
        for pipe in self.pipes:
            if pipe.recv() != "ready":
                raise RuntimeError("a rank failed to start")
        self.step_seconds = float("nan")

    def __call__(self) -> None:
        for pipe in self.pipes:
            pipe.send("step")
        timed = []
        for pipe in self.pipes:
            reply = pipe.recv()
            if not isinstance(reply, float):
                raise RuntimeError(f"a rank failed: {reply}")
            timed.append(reply)
        self.step_seconds = max(timed)

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send("stop")
        for proc in self.procs:
            proc.join(timeout=30)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_local_gloo(rank: int, world: int, port: int, timeout_s: float) -> None:
    """Join this process to a gloo group of ``world`` ranks on 127.0.0.1:``port``."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _process_rank(
    rank: int,
    world: int,
    port: int,
    name: str,
    batch: int | None,
    threads: int,
    steps: int,
    pipe,
) -> None:
    import torch.distributed as dist

    import parsum

    torch.set_num_threads(threads)
    join_local_gloo(rank, world, port, 300)
    w = workload(name, batch)
    mine = [w.models[i] for i in parsum.distributed.share(w.models, w.x)]
    if w.identical:  # as the threads' rows run them, and as the README tells users to
        parsum.stack_(mine)
    pipe.send("ready")
    settle = min(PROCESS_SETTLE, steps - 1)
    try:
        while pipe.recv() == "step":
            try:
                start = time.perf_counter()
                for k in range(steps):
                    if k == settle:
                        start = time.perf_counter()
                    zero_grads(mine)
                    loss_of(parsum.distributed.sum_models(mine, w.x)).backward()
            except Exception as exc:  # reported to the parent, which stops the run
                pipe.send(repr(exc))
                raise
            pipe.send((time.perf_counter() - start) / (steps - settle))
    finally:
        dist.destroy_process_group()
