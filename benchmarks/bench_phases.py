"""Where a step of parsum on P threads goes, forward and backward apart, against the ceiling
that the loss of a sum allows on P threads.

  hand split   the models split over P threads, each training its share with a loss per model
               (no sum: not the same computation, the machine's ceiling for the models alone)
  two-phase    the loss of the sum on P threads with nothing else: the forwards on the threads,
               their plain sum, then each thread pulling its models back (common.TwoPhase)
  parsum       parsum.sum_models(models, x, n_jobs=P), then backward of the loss

Every step starts from ``.grad`` None. The methods run in turn, round by round, shuffled;
medians of the rounds, in one process. parsum's forward includes planning, the compensated sum
and the node it returns; its backward the pullbacks and their bookkeeping.

    python benchmarks/bench_phases.py [--jobs 2] [--rounds 20] [--workloads all]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from common import HandSplit, TwoPhase, loss_of, workload, zero_grads

import parsum

CASES = [
    ("heterogeneous-medium", 256),
    ("heterogeneous-medium", 64),
    ("identical-medium", None),
    ("heterogeneous-tiny", None),
]


def phases(name: str, batch: int | None, threads: int, rounds: int) -> dict[str, list[float]]:
    """Median milliseconds (forward, backward, step) of each method."""
    w = workload(name, batch)
    models, x = w.models, w.x
    split, two = HandSplit(models, threads), TwoPhase(models, threads)

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

    def ours() -> tuple[float, float]:
        zero_grads(models)
        start = time.perf_counter()
        loss = loss_of(parsum.sum_models(models, x, n_jobs=threads))
        middle = time.perf_counter()
        loss.backward()
        return middle - start, time.perf_counter() - middle

    methods = {"hand split": hand, "two-phase": two_phase, "parsum": ours}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in methods}
    order = list(methods)
    shuffle = random.Random(0).shuffle
    for r in range(rounds + 3):
        shuffle(order)
        for key in order:
            took = methods[key]()
            if r >= 3:  # warm-up
                times[key].append(took)
    return {
        key: [
            statistics.median(f for f, _ in ts) * 1e3,
            statistics.median(b for _, b in ts) * 1e3,
            statistics.median(f + b for f, b in ts) * 1e3,
        ]
        for key, ts in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="2", help="thread counts, e.g. 4,8,16")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--workloads", default="all", help="comma-separated names, or all")
    args = parser.parse_args()
    cases = [c for c in CASES if args.workloads == "all" or c[0] in args.workloads.split(",")]
    print(
        f"torch {torch.__version__}, {parsum._config.usable_cores()} usable cores; "
        f"medians of {args.rounds} rounds, ms"
    )
    for name, batch in cases:
        print(f"\n{name}, batch {batch or 'default'}")
        print(f"{'threads':>8} {'method':>11} {'forward':>8} {'backward':>9} {'step':>7}")
        for p in (int(j) for j in args.jobs.split(",")):
            found = phases(name, batch, p, args.rounds)
            for key, (f, b, s) in found.items():
                shown = f"{'':>8} {'':>9}" if key == "hand split" else f"{f:8.2f} {b:9.2f}"
                print(f"{p:>8} {key:>11} {shown} {s:7.2f}")
            ratio = found["two-phase"][2] / found["parsum"][2]
            print(f"{'':>8} parsum at {ratio:.2f}x the two-phase ceiling's speed")


if __name__ == "__main__":
    main()
