"""Where a step of parsum on P threads goes, forward and backward apart, against the ceiling
that the loss of a sum allows on P threads.

  hand split   the models split over P threads, each training its share with a loss per model
               (no sum: not the same computation, the machine's ceiling for the models alone)
  two-phase    the loss of the sum on P threads with nothing else: the forwards on the threads,
               their plain sum, then each thread pulling its models back (common.TwoPhase)
  parsum       parsum.sum_models(models, x, n_jobs=P), then backward of the loss

Every step starts from ``.grad`` None. The methods run in turn, round by round, shuffled
(``common.interleaved_rounds``);
medians of the rounds, in one process. parsum's forward includes planning, the compensated sum
and the node it returns; its backward the pullbacks and their bookkeeping.

    python benchmarks/bench_phases.py [--jobs 2] [--rounds 20] [--workloads all|transformers,...]
        [--chunk-sizes default,1,4]

``caller cpu`` and ``others cpu``: the CPU time of a step in the calling thread, and in every
other thread together (parsum's helpers or the methods' threads, and any OpenMP threads;
``common.thread_cpu_ns``, Linux only, else 0), about 0.02 ms of the readings included. Time
that a step's wall time has beyond the caller's CPU time is the caller waiting (for a job's
last chunk, for the GIL); where parsum's caller runs longer than the two-phase's while the
others run as long, the gap is work of the calling thread alone.

``--chunk-sizes`` adds a parsum row per chunk size (models per chunk; ``default`` is parsum's
own choice): under the GIL every chunk costs Python on every thread, so fewer, larger chunks
may pay on many threads (2 cores, 2 threads, 64 tiny MLPs: 6.7 ms forward in chunks of 4,
5.5 in chunks of 32).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
from common import (
    HandSplit,
    TwoPhase,
    cpu_split,
    interleaved_rounds,
    loss_of,
    thread_cpu_ns,
    workload,
    workload_spec,
    zero_grads,
)

import parsum

CASES = [
    ("heterogeneous-medium", 256),
    ("heterogeneous-medium", 64),
    ("identical-medium", None),
    ("heterogeneous-tiny", None),
]


def phases(
    name: str, batch: int | None, threads: int, rounds: int, chunk_sizes: list[int | None]
) -> dict[str, list[float]]:
    """Median milliseconds of each method: forward, backward, step, and the CPU time of a
    step in the calling thread and in every other thread together."""
    w = workload(name, batch)
    models, x = w.models, w.x
    split, two = HandSplit(models, threads, x), TwoPhase(models, threads, x)

    def hand() -> tuple[float, float]:
        zero_grads(models)
        start = time.perf_counter()
        split(x)
        return 0.0, time.perf_counter() - start

    def two_phase() -> tuple[float, float]:
        zero_grads(models)
        start = time.perf_counter()
        y = two.forward(x)
        middle = time.perf_counter()
        two.backward(y)
        return middle - start, time.perf_counter() - middle

    def ours(chunk_size: int | None) -> tuple[float, float]:
        zero_grads(models)
        start = time.perf_counter()
        y = parsum.sum_models(models, x, n_jobs=threads, chunk_size=chunk_size)
        loss = loss_of(y)
        middle = time.perf_counter()
        loss.backward()
        return middle - start, time.perf_counter() - middle

    methods: dict[str, Callable[[], tuple[float, float]]] = {
        "hand split": hand,
        "two-phase": two_phase,
    }
    for size in chunk_sizes:
        key = "parsum" if size is None else f"parsum cs{size}"
        methods[key] = functools.partial(ours, size)
    # Each method times its own phases; interleaved_rounds only schedules the calls.
    times: dict[str, list[tuple[float, float, float, float]]] = {k: [] for k in methods}
    recorded = {k: functools.partial(_record, times[k], fn) for k, fn in methods.items()}
    interleaved_rounds(recorded, rounds, warmup=WARMUP)
    return {
        key: [
            statistics.median(t[0] for t in ts[WARMUP:]) * 1e3,
            statistics.median(t[1] for t in ts[WARMUP:]) * 1e3,
            statistics.median(t[0] + t[1] for t in ts[WARMUP:]) * 1e3,
            statistics.median(t[2] for t in ts[WARMUP:]) * 1e3,
            statistics.median(t[3] for t in ts[WARMUP:]) * 1e3,
        ]
        for key, ts in times.items()
    }


WARMUP = 3


def _case(item: str) -> tuple[str, int | None]:
    """A workload named on the command line, ``name[:batch]`` (an unknown name raises)."""
    name, batch = workload_spec(item)
    workload(name, None)  # raises for an unknown name, before any timing
    return name, batch


def _record(
    into: list[tuple[float, float, float, float]], fn: Callable[[], tuple[float, float]]
) -> None:
    """A step's forward and backward seconds, and the CPU seconds of the calling thread and of
    all others around it (``cpu_split``; both 0 where the system does not tell)."""
    before = thread_cpu_ns()
    forward, backward = fn()
    caller, others = cpu_split(before, thread_cpu_ns())
    into.append((forward, backward, caller, others))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="2", help="thread counts, e.g. 4,8,16")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--workloads", default="all", help="all, or comma-separated names, each with :BATCH"
    )
    parser.add_argument("--chunk-sizes", default="default", help="e.g. default,1,4")
    args = parser.parse_args()
    sizes = [None if c == "default" else int(c) for c in args.chunk_sizes.split(",")]
    cases = CASES if args.workloads == "all" else list(map(_case, args.workloads.split(",")))
    print(
        f"torch {torch.__version__}, {parsum._config.usable_cores()} usable cores; "
        f"medians of {args.rounds} rounds, ms"
    )
    for name, batch in cases:
        print(f"\n{name}, batch {batch or 'default'}")
        print(
            f"{'threads':>8} {'method':>14} {'forward':>8} {'backward':>9} {'step':>7} "
            f"{'caller cpu':>10} {'others cpu':>10}"
        )
        for p in (int(j) for j in args.jobs.split(",")):
            found = phases(name, batch, p, args.rounds, sizes)
            for key, (f, b, s, caller, others) in found.items():
                shown = f"{'':>8} {'':>9}" if key == "hand split" else f"{f:8.2f} {b:9.2f}"
                print(f"{p:>8} {key:>14} {shown} {s:7.2f} {caller:10.2f} {others:10.2f}")
            # The bound any design that differentiates the loss of the sum has on these
            # threads: the forwards must all end before the first pullback can start.
            bound = found["hand split"][2] / found["two-phase"][2]
            print(f"{'':>8} two-phase at {bound:.2f}x the hand split's speed")
            for key in (k for k in found if k.startswith("parsum")):
                ratio = found["two-phase"][2] / found[key][2]
                hand = found["hand split"][2] / found[key][2]
                print(
                    f"{'':>8} {key} at {ratio:.2f}x the two-phase ceiling's speed, "
                    f"{hand:.2f}x the hand split's"
                )


if __name__ == "__main__":
    main()
