"""What worker processes inside one call could give: the loss of a sum on P processes,
orchestrated from the calling process as ``sum_models`` would orchestrate them, against
parsum's threads, the hand split and P processes launched as torchrun launches them.

  plain            the plain loop, PyTorch's default intra-op threads
  plain 1          the plain loop on one intra-op thread
  parsum           parsum.sum_models(models, x), its default
  hand split       the models over P threads, each model its own loss (common.HandSplit)
  two-phase        the loss of the sum on P threads with nothing else (common.TwoPhase)
  procs            P processes, each summing its share with parsum.distributed (common.
                   ProcessSplit; a step timed in the ranks, as a torchrun job's loop runs)
  process engine   ``ProcessEngine``: the caller's process runs its share of the models in
                   its own graph; P-1 worker processes, started once, hold the other shares,
                   their parameters in shared memory (``Module.share_memory()``, in place: an
                   optimizer's steps in the caller are what the workers read); a forward
                   writes the argument to shared memory and wakes them, they write each
                   model's output into shared memory, the caller sums every output in model
                   order under one autograd node; its backward writes the outputs' gradients
                   to shared memory and wakes them, the caller pulls its share back, and at the
                   backward's end it waits for them and takes their parameters' gradients
                   (copied out of shared memory into ``.grad``)

The process engine has none of parsum's checks, compensation or failure handling: it is the
ceiling of such an engine, and what it costs to cross processes twice a step, measured where a
user would call it (from the calling process, its time taken there). Its gradients are checked
against the plain loop's before anything is timed.

Every step starts from ``.grad`` None. The methods run in turn, round by round, shuffled; a
turn is PROCESS_STEPS steps in a row, timed after the first PROCESS_SETTLE (as the ranks time
theirs); medians of the rounds.

    python benchmarks/bench_process_engine.py [--procs 2,4] [--rounds 20] [--caller-share 0.55]
        [--workloads distinct-tiny,heterogeneous-tiny,heterogeneous-medium:64,distinct-medium:64]

``--caller-share`` adds an engine whose calling process takes that share of the models'
estimated cost, the workers the rest in equal parts: on 2 cores the caller's share of equal
cost finished first (the workers also copy outputs and gradients through shared memory), and
0.55-0.6 ran 4-7% faster than 0.5; 0.3-0.45 slower.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from common import (
    PROCESS_SETTLE,
    HandSplit,
    ProcessSplit,
    TwoPhase,
    loss_of,
    on_threads,
    one_thread,
    parsum_step,
    plain_step,
    workload,
    workload_spec,
    zero_grads,
)
from torch import nn

import parsum
from parsum._engines import ModelParams
from parsum._grouping import Batch, estimated_cost
from parsum.distributed import balanced_shares

WORKLOADS = "distinct-tiny,heterogeneous-tiny,heterogeneous-medium:64,distinct-medium:64"
PROCESS_STEPS = 10  # steps a ProcessSplit command runs in its ranks (2 of them untimed)


def _serve(
    models: list[nn.Module],
    x: torch.Tensor,
    outs: torch.Tensor,
    grad_outs: torch.Tensor,
    flat: torch.Tensor,
    threads: int,
    conn: Any,
) -> None:
    """A worker process: on ``f`` the forwards of its models on the shared ``x``, each output
    written into its row of ``outs``; on ``b`` their pullback by the rows of ``grad_outs``,
    accumulated into views of the shared ``flat``, zeroed first (one kernel, not one a
    parameter)."""
    torch.set_num_threads(threads)
    params = [p for m in models for p in m.parameters()]
    views = _views(flat, params)
    kept: list[torch.Tensor] = []
    conn.send_bytes(b"ready")
    while (command := conn.recv_bytes()) != b"stop":
        try:
            if command == b"f":
                kept = [m(x) for m in models]
                for row, out in zip(outs, kept):
                    row.copy_(out.detach())
            else:
                flat.zero_()
                for p, v in zip(params, views):
                    p.grad = v
                torch.autograd.backward(kept, list(grad_outs))
                kept = []
            conn.send_bytes(b"")
        except Exception as exc:  # told to the caller, which raises it
            kept = []
            conn.send_bytes(repr(exc).encode())


def _views(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each parameter's slot in ``flat``, shaped like it."""
    views, at = [], 0
    for p in params:
        views.append(flat[at : at + p.numel()].view_as(p))
        at += p.numel()
    return views


class _Worker:
    def __init__(self, ctx: Any, models: list[nn.Module], x: torch.Tensor, threads: int) -> None:
        for m in models:
            m.share_memory()  # in place: the caller's parameters are the worker's
        with torch.no_grad():
            shape = models[0](x).shape
        self.params = [p for m in models for p in m.parameters()]
        self.flat = torch.zeros(sum(p.numel() for p in self.params)).share_memory_()
        self.outs = torch.zeros(len(models), *shape).share_memory_()
        self.grad_outs = torch.zeros_like(self.outs).share_memory_()
        self.conn, there = ctx.Pipe()
        args = (models, x, self.outs, self.grad_outs, self.flat, threads, there)
        self.proc = ctx.Process(target=_serve, args=args, daemon=True)
        self.proc.start()
        there.close()  # a worker that dies is then an EOF here, not a wait forever
        self.wait()

    def wait(self) -> None:
        reply = self.conn.recv_bytes()
        if reply not in (b"", b"ready"):
            raise RuntimeError(f"a worker process failed: {reply.decode()}")


class _RemoteOutputs(torch.autograd.Function):
    """The workers' outputs as one tensor of rows in the caller's graph; its backward hands
    the rows' gradients to the workers and joins them at the backward's end."""

    @staticmethod
    def forward(ctx: Any, engine: ProcessEngine, anchor: torch.Tensor) -> torch.Tensor:
        ctx.engine = engine
        return torch.cat([w.outs for w in engine.workers])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        ctx.engine.pull_back(grad)
        return None, None


class ProcessEngine:
    """The two-phase ceiling on ``processes`` processes, the caller's among them (above)."""

    def __init__(
        self,
        models: list[nn.Module],
        processes: int,
        x: torch.Tensor,
        caller_share: float | None = None,
    ) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.threads = threads = max(1, torch.get_num_threads() // processes)
        if caller_share is None:
            parts = balanced_shares(models, (x,), {}, processes)
        else:
            parts = _shares(
                models, x, [caller_share] + [(1 - caller_share) / (processes - 1)] * (processes - 1)
            )
        self.models = models
        self.local = [models[i] for i in parts[0]]
        self.x = x.clone().share_memory_()
        self.workers = [
            _Worker(ctx, [models[i] for i in part], self.x, threads) for part in parts[1:]
        ]
        # Each model's place among the sum's terms: ("local", j) or ("remote", row).
        self.places: list[tuple[str, int]] = [("local", 0)] * len(models)
        for j, i in enumerate(parts[0]):
            self.places[i] = ("local", j)
        for row, i in enumerate(i for part in parts[1:] for i in part):
            self.places[i] = ("remote", row)
        self.anchor = torch.zeros((), requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every model's output summed in model order."""
        self.x.copy_(x)
        for w in self.workers:
            w.conn.send_bytes(b"f")
        local = [m(x) for m in self.local]
        for w in self.workers:
            w.wait()
        remote = _RemoteOutputs.apply(self, self.anchor).unbind(0)
        terms = [local[j] if where == "local" else remote[j] for where, j in self.places]
        y = terms[0]
        for t in terms[1:]:
            y = y + t
        return y

    def pull_back(self, grad: torch.Tensor) -> None:
        """Wake the workers with their rows' gradients; join them when the backward ends
        (after the caller's own share, which the engine pulls back meanwhile)."""
        at = 0
        for w in self.workers:
            w.grad_outs.copy_(grad[at : at + len(w.outs)])
            at += len(w.outs)
            w.conn.send_bytes(b"b")
        torch.autograd.Variable._execution_engine.queue_callback(self._join)

    def _join(self) -> None:
        for w in self.workers:
            w.wait()
            # One copy out of shared memory (the workers write it again next step).
            for p, g in zip(w.params, _views(w.flat.clone(), w.params)):
                p.grad = g if p.grad is None else p.grad + g

    def close(self) -> None:
        for w in self.workers:
            w.conn.send_bytes(b"stop")
        for w in self.workers:
            w.proc.join(timeout=30)


def _shares(models: list[nn.Module], x: torch.Tensor, fractions: list[float]) -> list[list[int]]:
    """The models in parts of about ``fractions`` of their estimated cost, costliest first,
    each to the part furthest below its own share."""
    batch = Batch.of([x])
    costs = [estimated_cost(ModelParams.of(m), batch) for m in models]
    loads = [0.0] * len(fractions)
    parts: list[list[int]] = [[] for _ in fractions]
    for i in sorted(range(len(models)), key=lambda i: -costs[i]):
        r = min(range(len(fractions)), key=lambda r: (loads[r] + costs[i]) / fractions[r])
        loads[r] += costs[i]
        parts[r].append(i)
    return [sorted(part) for part in parts]


def engine_step(engine: ProcessEngine, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        zero_grads(engine.models)
        loss_of(engine.forward(x)).backward()

    return on_threads(step, engine.threads)  # the caller's share on its share of the budget


def check_gradients(engine: ProcessEngine, x: torch.Tensor) -> float:
    """The largest difference of a parameter's gradient from the plain loop's, relative to
    the largest gradient."""
    models = engine.models
    plain_step(models, x)
    want = [p.grad.clone() for m in models for p in m.parameters()]  # type: ignore[union-attr]
    engine_step(engine, x)()
    got = [p.grad for m in models for p in m.parameters()]
    scale = max(float(w.abs().max()) for w in want)
    return max(float((g - w).abs().max()) for g, w in zip(got, want)) / scale  # type: ignore[operator]


def run(name: str, batch: int | None, procs: int, rounds: int, caller_share: float | None) -> None:
    w = workload(name, batch)
    models, x = w.models, w.x
    engines = {"process engine": ProcessEngine(models, procs, x)}
    if caller_share is not None:
        engines[f"caller {caller_share:g}"] = ProcessEngine(models, procs, x, caller_share)
    split = ProcessSplit(name, batch, procs, torch.get_num_threads(), steps=PROCESS_STEPS)
    try:
        diff = max(check_gradients(engine, x) for engine in engines.values())
        hand, two = HandSplit(models, procs, x), TwoPhase(models, procs, x)

        def two_step() -> None:
            zero_grads(models)
            two.backward(two.forward(x))

        timed: dict[str, Callable[[], None]] = {
            "plain": lambda: plain_step(models, x),
            "plain 1": one_thread(lambda: plain_step(models, x)),
            "parsum": lambda: parsum_step(models, x),
            "hand split": lambda: hand(x),
            "two-phase": two_step,
            **{k: engine_step(engine, x) for k, engine in engines.items()},
        }
        times = _rounds(timed, split, rounds)
    finally:
        for engine in engines.values():
            engine.close()
        split.close()
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"\n{w.description}; P = {procs}; gradients against the plain loop's: {diff:.1e}")
    print(f"{'method':>16} {'step, ms':>9}")
    for k, v in ms.items():
        print(f"{k:>16} {v:9.2f}")
    best_plain = min(ms["plain"], ms["plain 1"])
    for k in engines:
        print(
            f"  {k}: {best_plain / ms[k]:.2f}x the faster plain loop, "
            f"{ms['parsum'] / ms[k]:.2f}x parsum's speed, "
            f"{ms['procs'] / ms[k]:.2f}x the torchrun-like processes', "
            f"{ms['hand split'] / ms[k]:.2f}x the hand split's"
        )


def _rounds(
    timed: dict[str, Callable[[], None]], split: ProcessSplit, rounds: int
) -> dict[str, list[float]]:
    """Each method's turn a round, shuffled (seeded): PROCESS_STEPS steps in a row, timed
    after the first PROCESS_SETTLE, as ProcessSplit's ranks time theirs (one step timed alone
    after another method's pays for cold caches: a training loop's steps follow each other)."""
    methods: dict[str, Callable[[], None]] = {**timed, "procs": split}
    for fn in methods.values():
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {k: [] for k in methods}
    order = list(methods)
    for _ in range(rounds):
        random.Random(len(times["plain"])).shuffle(order)
        for k in order:
            if k == "procs":
                split()
                times[k].append(split.step_seconds)
                continue
            for _ in range(PROCESS_SETTLE):
                methods[k]()
            start = time.perf_counter()
            for _ in range(PROCESS_STEPS - PROCESS_SETTLE):
                methods[k]()
            times[k].append((time.perf_counter() - start) / (PROCESS_STEPS - PROCESS_SETTLE))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", default="2", help="comma-separated process counts")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--workloads", default=WORKLOADS)
    parser.add_argument(
        "--caller-share",
        type=float,
        default=None,
        help="also an engine whose caller runs this share of the estimated cost (it has "
        "the least to do besides: the workers copy outputs and gradients in and out)",
    )
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, parsum {parsum.__version__}, "
        f"{torch.get_num_threads()} intra-op threads; medians of {args.rounds} rounds"
    )
    for item in args.workloads.split(","):
        for procs in map(int, args.procs.split(",")):
            run(*workload_spec(item), procs, args.rounds, args.caller_share)


if __name__ == "__main__":
    main()
