"""The pullbacks of models too small for forward workers on 1, 2, 4, ... threads: how many
workers they pay for (NOTE [ Pullbacks of small models ] in parsum/_grouping.py).

Each ``pullbacks<=N`` row is parsum's default with MAX_SMALL_PULLBACK_WORKERS set to N while
it plans its own copy of the models (``pullbacks<=1``: the calling thread alone, as before the
rule); the forwards stay in the calling thread. Medians of interleaved rounds
(``common.interleaved_rounds``, each method's timed call after one untimed in its turn), and
each row's speed against ``pullbacks<=1`` as the median of the rounds' ratios with a
bootstrap interval.

    python benchmarks/bench_pullback_workers.py [--workloads distinct-tiny,distinct-tiny:16]
        [--caps 1,2,4,8] [--rounds 30]

On 2 cores (2026-12-01, 40 rounds, two runs; results/pullback-workers-2cores.txt the second):
64 MLP classes of widths 16-47, pullbacks on 2 threads 1.19x and 1.22x the calling thread alone
at batch 32, 1.20x and 1.21x at batch 16; more than 2 were not measured (no machine with more
cores was lent that day).
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections.abc import Callable

import torch
from common import (
    interleaved_rounds,
    one_thread,
    paired_ratio,
    parsum_step,
    plain_step,
    workloads_of,
)

from parsum import _grouping


def capped(cap: int, step: Callable[[], None]) -> Callable[[], None]:
    """``step`` planned (on its first call) with at most ``cap`` small models' pullback workers."""

    def run() -> None:
        saved = _grouping.MAX_SMALL_PULLBACK_WORKERS
        _grouping.MAX_SMALL_PULLBACK_WORKERS = cap
        try:
            step()
        finally:
            _grouping.MAX_SMALL_PULLBACK_WORKERS = saved

    return run


def table(models: list[torch.nn.Module], x: torch.Tensor, caps: list[int], rounds: int) -> None:
    """Each method's median ms a step, and each cap's speed against the calling thread's."""
    methods: dict[str, Callable[[], None]] = {
        "plain": lambda: plain_step(models, x),
        "plain-1t": one_thread(lambda: plain_step(models, x)),
    }
    for cap in sorted({1, *caps}):  # each on a copy of its own: planned with its cap
        mine = copy.deepcopy(models)
        methods[f"pullbacks<={cap}"] = capped(cap, lambda mine=mine: parsum_step(mine, x))
    times = interleaved_rounds(methods, rounds, warmup=3, settle=1)
    alone = times["pullbacks<=1"]
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        line = f"{name:>14} {ms:8.3f} ms"
        if name.startswith("pullbacks") and ts is not alone:
            ratio, low, high = paired_ratio(alone, ts)
            line += f"   {ratio:5.3f}x the calling thread alone [{low:.3f}, {high:.3f}]"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="distinct-tiny,distinct-tiny:16")
    parser.add_argument("--caps", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    caps = [int(c) for c in args.caps.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads")
    for w in workloads_of(args.workloads):
        print(w.description)
        table(w.models, w.x, caps, args.rounds)


if __name__ == "__main__":
    main()
