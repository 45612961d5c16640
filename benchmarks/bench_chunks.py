"""Do chunks of equal estimated cost run faster than chunks of equal model counts?

parsum cuts the models into at most 16 chunks, consecutive in model order; the chunks alone
fix the order of additions, so they never depend on n_jobs (NOTE [ Chunks ] in
parsum/_grouping.py). By default a chunk holds about a sixteenth of the estimated cost
(parameters x batch rows, plus a per-model overhead); ``chunk_size=ceil(M/16)`` gives chunks
of equal counts instead. With P workers claiming chunks in order (costliest first where the
kernels dominate: NOTE [ Costliest chunks first ]), a chunk much costlier than the others
decides the time when P is close to the number of chunks.

    cost chunks    parsum.sum_models(models, x, n_jobs=P, engine="autograd")
    count chunks   the same with chunk_size=ceil(M/16)

For each workload the table gives the estimated cost of the costliest chunk over a sixteenth
of the total (from the cost model, not a timing: with 16 workers, how far the slowest chunk
stays from a perfect split), then medians of interleaved rounds per P.

    python benchmarks/bench_chunks.py [--jobs 1,2] [--rounds 20] [--json chunks.json]
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable

from common import interleaved, loss_of, workload

import parsum
from parsum._engines import ModelParams
from parsum._grouping import Batch, chunks_of, estimated_cost, plan_units

WORKLOADS = ("mixed-sizes", "heterogeneous-medium")


def spread(models, x, chunk_size: int | None) -> float:
    """Estimated cost of the costliest chunk over a sixteenth of the total."""
    params = [ModelParams.of(m) for m in models]
    batch = Batch.of([x])
    units = plan_units(models, params, "autograd", batch, None)
    costs = [estimated_cost(mp, batch) for mp in params]
    chunks = chunks_of(units, params, batch, chunk_size)  # as sum_models cuts them
    per_chunk = [sum(costs[i] for u in chunk for i in units[u].models) for chunk in chunks]
    return max(per_chunk) / (sum(per_chunk) / 16)


def step(models, x, n_jobs: int, chunk_size: int | None) -> Callable[[], None]:
    def run() -> None:
        y = parsum.sum_models(models, x, n_jobs=n_jobs, engine="autograd", chunk_size=chunk_size)
        loss_of(y).backward()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="1,2", help="worker counts, e.g. 1,2,4,8,16")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", help="write the medians (seconds) here")
    args = parser.parse_args()
    jobs = [int(j) for j in args.jobs.split(",")]
    results = []
    for name in args.workloads.split(","):
        w = workload(name)
        models, x = w.models, w.x
        by_count = math.ceil(len(models) / 16)

        methods = {}
        for p in jobs:
            methods[("cost", p)] = step(models, x, p, None)
            methods[("count", p)] = step(models, x, p, by_count)
        medians = interleaved(methods, args.rounds)
        cost_spread, count_spread = spread(models, x, None), spread(models, x, by_count)
        print(f"\n{name}: {w.description}")
        print(
            f"costliest chunk / (total / 16), estimated: cost chunks {cost_spread:.2f}, "
            f"count chunks {count_spread:.2f}"
        )
        print(f"{'P':>4}{'cost ms':>10}{'count ms':>10}{'count / cost':>14}")
        for p in jobs:
            cost, count = medians[("cost", p)] * 1e3, medians[("count", p)] * 1e3
            print(f"{p:>4}{cost:10.2f}{count:10.2f}{count / cost:14.2f}")
        results.append(
            {
                "workload": name,
                "description": w.description,
                "spread": {"cost": cost_spread, "count": count_spread},
                "ms": {f"{k}-{p}": v * 1e3 for (k, p), v in medians.items()},
            }
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jobs": jobs, "rounds": args.rounds, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
