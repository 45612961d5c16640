"""Whether a budget of 2 should keep small models on one intra-op thread (NOTE [ Kernels too
small for intra-op threads ] in parsum's _grouping).

With ``n_jobs`` unset, a budget of 2 runs the models as one chunk on both intra-op threads,
unless no model reaches ``INTRA_OP_MIN_PARAM_ROWS`` parameter-rows and none is stacked: then
the chunks of an explicit ``n_jobs`` run in the calling thread on one intra-op thread each.
Each row runs forward and backward on its own copy of the models, the rows in turn
(``common.interleaved``, each after at least 20 ms of untimed steps), in one process:

  plain           the plain loop, PyTorch's default intra-op threads
  plain-1t        the plain loop with 1 intra-op thread
  one chunk       parsum's default as it runs with the threshold at 0: one chunk, both threads
  default         parsum's default with the threshold as it is

With ``--adam``, a training step instead: each row's call, its backward, then one
``torch.optim.Adam`` step over its copy's parameters on the caller's intra-op threads.

    python benchmarks/bench_intra_op.py [--rounds 30] [--adam]
        [--workloads distinct-tiny,distinct-tiny:16,embedding-bags,heterogeneous-tiny:8]

The ratios: default against one chunk (above 1: the default is faster), and each against the
faster plain loop. Run it with a budget of 2 (``taskset -c 0,1`` on a larger machine).
"""

from __future__ import annotations

import argparse
import copy
import functools
from collections.abc import Callable

import torch
from common import (
    Workload,
    interleaved,
    one_thread,
    parsum_adam_step,
    parsum_step,
    plain_adam_step,
    plain_step,
    workloads_of,
)

from parsum import _grouping


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workloads", default="distinct-tiny,distinct-tiny:16,embedding-bags,heterogeneous-tiny:8"
    )
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--adam", action="store_true", help="time training steps with Adam")
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, a budget of {torch.get_num_threads()} threads; medians of "
        f"{args.rounds} interleaved rounds; threshold {_grouping.INTRA_OP_MIN_PARAM_ROWS:,} "
        f"parameter-rows{'; steps with Adam' if args.adam else ''}"
    )
    for w in workloads_of(args.workloads):
        report(w, args.rounds, args.adam)


def one_step(
    models: list[torch.nn.Module], x: torch.Tensor, adam: bool, plain: bool = False
) -> Callable[[], None]:
    """A step of ``models`` on ``x``: the plain loop's or parsum's default, forward and backward,
    then with ``adam`` one Adam step over the models' parameters."""
    if plain:
        step = plain_adam_step(models) if adam else functools.partial(plain_step, models)
    else:
        params = [p for m in models for p in m.parameters()]
        step = (
            parsum_adam_step(models, params, False)
            if adam
            else functools.partial(parsum_step, models)
        )
    return functools.partial(step, x)


def report(w: Workload, rounds: int, adam: bool) -> None:
    """Time the rows on workload ``w`` and print them with their ratios."""
    x = w.x
    plain = one_step(copy.deepcopy(w.models), x, adam, plain=True)
    steps = {
        "plain": plain,
        "plain-1t": one_thread(plain),
        "one chunk": one_step(copy.deepcopy(w.models), x, adam),
        "default": one_step(copy.deepcopy(w.models), x, adam),
    }
    threshold = _grouping.INTRA_OP_MIN_PARAM_ROWS
    _grouping.INTRA_OP_MIN_PARAM_ROWS = 0  # each copy's plan is derived on its first call
    try:
        steps["one chunk"]()
    finally:
        _grouping.INTRA_OP_MIN_PARAM_ROWS = threshold
    steps["default"]()
    t = interleaved(steps, rounds, settle=1, settle_seconds=0.02)
    best = min(t["plain"], t["plain-1t"])
    print(f"\n{w.name}: {w.description}")
    for name, seconds in t.items():
        print(f"  {name:>10} {seconds * 1e3:8.2f} ms")
    print(
        f"  default against one chunk {t['one chunk'] / t['default']:.3f}x; against the "
        f"faster plain loop: one chunk {best / t['one chunk']:.2f}x, default "
        f"{best / t['default']:.2f}x"
    )


if __name__ == "__main__":
    main()
