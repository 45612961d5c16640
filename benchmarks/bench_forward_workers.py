"""The default with its forwards capped at fewer workers than its pullbacks, against the hand
split: how many threads the forwards pay for (NOTE [ Forwards on fewer workers ] in
parsum/_grouping.py).

Each ``fwd<=N`` row is parsum's default whose forward job runs on at most N threads (a wrapper
around parsum's pool); its pullbacks keep the workers parsum chose. Medians of interleaved
rounds (``common.interleaved``), each method's timed call after one untimed in its turn.

    python benchmarks/bench_forward_workers.py [--workloads heterogeneous-medium:64]
        [--caps 2,3,4,6] [--rounds 25]

On the 16-core lent machine (2026-11-30, the code before the rule, 25 rounds): 16 MLPs of
widths 128-512 at batch 64, default 6.48 ms, fwd<=2..6 7.08, 6.41, 6.25, 6.28; at batch 256
10.67 against 14.53, 11.68, 11.26, 10.88 (12 rounds).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from common import HandSplit, interleaved, one_thread, parsum_step, plain_step, workloads_of

from parsum import _pool

_cap: list[int | None] = [None]
_run_ordered = _pool.run_ordered


def _capped_run_ordered(task, n_tasks, n_workers, *rest, **kwargs):  # type: ignore[no-untyped-def]
    if _cap[0] is not None and getattr(task, "__name__", "") == "forward_chunk":
        n_workers = min(n_workers, _cap[0])
    return _run_ordered(task, n_tasks, n_workers, *rest, **kwargs)


def capped(cap: int, step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with parsum's forward jobs on at most ``cap`` threads."""

    def run() -> None:
        _cap[0] = cap
        try:
            step()
        finally:
            _cap[0] = None

    return run


def table(models: list[torch.nn.Module], x: torch.Tensor, args: argparse.Namespace) -> None:
    """Each method's median ms a step, and the best hand split's time over it."""
    methods: dict[str, Callable[[], None]] = {
        "plain": lambda: plain_step(models, x),
        "plain-1t": one_thread(lambda: plain_step(models, x)),
        "parsum default": lambda: parsum_step(models, x),
    }
    for cap in map(int, args.caps.split(",")):
        methods[f"default fwd<={cap}"] = capped(cap, lambda: parsum_step(models, x))
    for p in map(int, args.hand.split(",")):
        split = HandSplit(models, p, x)
        methods[f"hand-split {p}"] = lambda split=split: split(x)
    medians = interleaved(methods, args.rounds, settle=1, settle_seconds=0.02)
    hand = min(t for name, t in medians.items() if name.startswith("hand"))
    for name, t in medians.items():
        print(f"{name:>18} {t * 1e3:8.3f} ms   best hand split / this {hand / t:5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="heterogeneous-medium:64,distinct-medium:64")
    parser.add_argument("--caps", default="2,3,4,6")
    parser.add_argument("--hand", default="4,8", help="hand split thread counts")
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args()
    _pool.run_ordered = _capped_run_ordered
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads")
    for w in workloads_of(args.workloads):
        print(w.description)
        table(w.models, w.x, args)


if __name__ == "__main__":
    main()
