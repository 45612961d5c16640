"""Pullbacks joined later against joined in the node (NOTE [ Pullbacks joined later ] in
parsum's _function), in one process.

A backward that accumulates every gradient into ``.grad`` hands its pullbacks to the helpers and
returns, so that the engine's visits to the parameters' AccumulateGrads (with the None the node
returns) overlap the helpers' work; the caller joins them in a node the engine runs right after.
Each row steps the same models (``.grad`` None, forward, backward of the loss), with the join
node made (``joined later``) or not (``in the node``: the code before), the two in turn,
shuffled, round by round (``common.interleaved_rounds``); medians of the rounds.

    python benchmarks/bench_join.py [--jobs 2,4,8,16] [--rounds 60]
        [--workloads heterogeneous-medium:64,heterogeneous-tiny:32]

parsum joins later only from JOIN_LATER_PARAMS parameters (128); ``--any-size`` measures below
it too (the medium MLPs' 94). On 2 cores, 64 tiny MLPs at n_jobs=2 (ParallelSum's node, 382
parameters): steps 1.10x faster; 16 medium MLPs at batch 64: 0.95-0.98x (three runs). On many
threads nearly all of the visits overlap the helpers' work, not half: what this measures there.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable

import torch
from common import interleaved_rounds, parsum_step, workloads_of

import parsum
from parsum import _api, _function, _inline


def joining(on: bool, step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with the join node made where a call allows it (``on``), or never."""

    def run() -> None:
        saved = _api.may_join_later, _inline.may_join_later
        if not on:
            _api.may_join_later = _inline.may_join_later = lambda plan, differentiable: False
        try:
            step()
        finally:
            _api.may_join_later, _inline.may_join_later = saved

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="2", help="n_jobs values, e.g. 2,4,8,16")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--any-size", action="store_true", help="also below JOIN_LATER_PARAMS")
    parser.add_argument(
        "--workloads",
        default="heterogeneous-medium:64,heterogeneous-tiny:32",
        help="name:batch,...",
    )
    args = parser.parse_args()
    if args.any_size:
        _function.JOIN_LATER_PARAMS = 0
    print(
        f"torch {torch.__version__}, {parsum._config.usable_cores()} usable cores, "
        f"{torch.get_num_threads()} intra-op threads; medians of {args.rounds} rounds"
    )
    for w in workloads_of(args.workloads):
        n_params = sum(1 for m in w.models for _ in m.parameters())
        below = n_params < _function.JOIN_LATER_PARAMS
        print(
            f"\n{w.description}, {n_params} parameters"
            + (
                " (below JOIN_LATER_PARAMS: never joined later; --any-size to measure it)"
                if below
                else ""
            )
        )
        print(f"{'n_jobs':>7} {'joined later':>13} {'in the node':>12} {'speedup':>8}")
        for n_jobs in (int(j) for j in args.jobs.split(",")):
            step = functools.partial(parsum_step, w.models, w.x, n_jobs=n_jobs)
            methods = {on: joining(on, step) for on in (True, False)}
            times = interleaved_rounds(methods, args.rounds, settle=2)
            later, node = (statistics.median(times[on]) * 1e3 for on in (True, False))
            print(f"{n_jobs:>7} {later:>10.2f} ms {node:>9.2f} ms {node / later:>7.3f}x")


if __name__ == "__main__":
    main()
