"""Whether ending the caller's OpenMP team before a job on workers pays (NOTE [ The caller's
OpenMP team ] in parsum's _pool), with the optimizer step users run after each call.

A training step is ``sum_models``, the backward of the loss, and one ``torch.optim.Adam`` step
on the caller's intra-op threads, whose OpenMP team then spins on the cores the next call's
workers take. Each row runs the same step on its own copy of the models, the rows in turn
(``common.interleaved``, each after at least ``--settle-ms`` of untimed steps), in one process:

  plain+adam          the plain loop and the Adam step
  parsum+adam Nw      parsum.sum_models(n_jobs=N; "default": unset), the team ended
  parsum+adam Nw kept the same with the team left as it is (parsum's release made a no-op)

    python benchmarks/bench_team.py [--jobs default,2] [--rounds 20]
        [--workloads heterogeneous-medium:64,heterogeneous-medium:256,cnn-ensemble]

On 2 cores, 16 medium MLPs at batch 64 (alternating processes, before this benchmark): 2
workers 0.80-0.82x the plain loop with Adam with the team kept, 0.94-0.97x ended. On 16 cores
the caller's next parallel op starts up to 15 threads again after each call: whether it pays
there is what ``run_16cores.sh team`` measures.
"""

from __future__ import annotations

import argparse
import copy
import functools
from collections.abc import Callable

import torch
from common import (
    interleaved,
    parsum_adam_step,
    plain_adam_step,
    with_attribute,
    workloads_of,
)

import parsum
from parsum import _pool


def team_kept(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with the caller's team left as it is (parsum's release a no-op meanwhile)."""
    return with_attribute(step, _pool, "release_callers_team", lambda: None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="default,2", help="n_jobs values; default: unset")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--settle-ms", type=float, default=20.0)
    parser.add_argument(
        "--workloads",
        default="heterogeneous-medium:64,heterogeneous-medium:256,cnn-ensemble",
        help="name[:batch], comma-separated",
    )
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {parsum._config.usable_cores()} usable cores, "
        f"{torch.get_num_threads()} intra-op threads; the caller's team can be ended: "
        f"{_pool.releases_callers_team()}; medians of {args.rounds} interleaved rounds, each "
        f"after {args.settle_ms:g} ms of untimed steps"
    )
    jobs = [None if j == "default" else int(j) for j in args.jobs.split(",")]
    for w in workloads_of(args.workloads):
        plain = plain_adam_step(copy.deepcopy(w.models))
        methods: dict[str, Callable[[], None]] = {"plain+adam": functools.partial(plain, w.x)}
        for n in jobs:
            label = f"parsum+adam {'default' if n is None else f'{n}w'}"
            for kept in (False, True):
                models = copy.deepcopy(w.models)
                params = [p for m in models for p in m.parameters()]
                step = parsum_adam_step(models, params, shared=False, n_jobs=n)
                run = functools.partial(step, w.x)
                methods[f"{label} kept" if kept else label] = team_kept(run) if kept else run
        seconds = interleaved(methods, args.rounds, settle_seconds=args.settle_ms / 1e3)
        baseline = seconds["plain+adam"]
        print(f"\n{w.name}: {w.description}")
        print(f"{'method':>28} {'ms/step':>9} {'plain+adam / this':>18}")
        for label, t in seconds.items():
            print(f"{label:>28} {t * 1e3:9.2f} {baseline / t:18.2f}")
        for n in jobs:
            label = f"parsum+adam {'default' if n is None else f'{n}w'}"
            gain = seconds[f"{label} kept"] / seconds[label]
            print(f"  {label}: team ended / kept {gain:.2f}x")


if __name__ == "__main__":
    main()
