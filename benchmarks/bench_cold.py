"""How much slower parsum's serial Python runs after the calling thread slept or computed, than
back to back: what decides whether a caller that coordinates the workers, spinning, instead of
running chunks itself would pay on many cores.

Inside a step on 2 cores every piece of parsum's own work in the calling thread took 4-20x its
warm time (the call's checks 85 us against 4, the plan's reuse check 180 against 35). This times
one such piece, the plan's reuse check (``_plans.known_walk`` over 16 medium MLPs: 94 modules,
94 tensors), right after each of, in blocks of --repeats, twice:

  back to back      nothing in between
  sleep             ``time.sleep`` for --ms, and for 0.5 ms (a thread waiting for a job's end)
  spin              a Python loop for --ms (a thread that never sleeps)
  matmul            one 1024 x 1024 matmul on one thread (a chunk's kernels, evicting caches)

    python benchmarks/bench_cold.py [--ms 4] [--repeats 200]

On the 2-core VM (2026-11-27): back to back 37-38 us, after 4 ms of sleep 220-225 (the same
sleeps taken in turn with the other rows, the machine busy between them: 53), after 0.5 ms of
sleep 39, after 4 ms of spinning 39-40, after a 1024 x 1024 matmul 200: a step's kernels make
the caller's next Python cold, and so does a long idle wait on this VM. A caller that only
waited for its workers (one helper running every chunk, the caller sleeping through each job)
still took 200 us for the check in a step, against 182 when it ran chunks too: only a caller
that neither computes nor sleeps would stay warm, which pure Python cannot do without holding
the GIL the workers need.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from common import loss_of, workload

import parsum
from parsum._plans import known_walk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    w = workload("heterogeneous-medium", 64)
    models = w.models
    loss_of(parsum.sum_models(models, w.x, n_jobs=2)).backward()  # a plan to check
    assert known_walk(models) is not None
    big = torch.randn(1024, 1024)
    seconds = args.ms / 1e3

    def spin() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def matmul() -> None:
        saved = torch.get_num_threads()
        torch.set_num_threads(1)
        big @ big
        torch.set_num_threads(saved)

    before: dict[str, Callable[[], None]] = {
        "back to back": lambda: None,
        f"after {args.ms:g} ms of sleep": lambda: time.sleep(seconds),
        "after 0.5 ms of sleep": lambda: time.sleep(0.0005),
        f"after {args.ms:g} ms of spinning": spin,
        "after a 1024 x 1024 matmul": matmul,
    }
    print(
        f"torch {torch.__version__}, {parsum._config.usable_cores()} usable cores; the plan's "
        f"reuse check over 16 medium MLPs, medians of {args.repeats}, in blocks"
    )
    for round_ in (1, 2):
        times: dict[str, float] = {}
        for name, first in before.items():
            ts = []
            for _ in range(args.repeats):
                first()
                start = time.perf_counter()
                known_walk(models)
                ts.append(time.perf_counter() - start)
            times[name] = statistics.median(ts)
        warm = times["back to back"]
        for name, t in times.items():
            print(f"{round_} {name:>30} {t * 1e6:8.1f} us  {t / warm:5.2f}x back to back")


if __name__ == "__main__":
    main()
