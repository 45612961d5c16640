"""Where a step of parsum on P workers goes, timed in place: the calling thread's serial work
outside the jobs, each job's wall time, and its chunks in the job against the same chunks run
one at a time. It tells apart the three ways a step on P threads falls short of 1/P of one
thread's:

  serial      the calling thread alone, outside every job: the call's checks and plan, the
              final sum and the node, the engine outside the node (the loss's nodes, the
              parameters' AccumulateGrads), the job hand-ins
  slowdown    the job's chunks, summed, against the same chunks run one after the other in the
              calling thread (the helpers given nothing): what P threads at once cost each chunk
              (the GIL, memory bandwidth, cores shared with other threads)
  idle        the job's wall time times P, less its chunks' time: threads waiting for a chunk,
              for the GIL between chunks, or for the last chunk at the end

Per worker count, medians over --steps steps (forward and backward of ``loss(sum)``, ``.grad``
None first) after warm-up, with n_jobs=P (the default's choice of workers aside). Wrappers
around parsum's pool record the times (about a microsecond each, a few dozen a step).

    python benchmarks/bench_places.py [--jobs 2,4,8,16] [--steps 100]
        [--workloads heterogeneous-medium:64,heterogeneous-tiny:32]

On the 2-core VM (2026-11-27, 16 MLPs of widths 128-512 at batch 64, n_jobs=2): about 0.8 ms of
a 7.1 ms step serial; the jobs' chunks 1.0x and 1.05x their time alone (forward, backward),
the jobs near their ideal (the chunks alone took 5.2 and 7.0 ms; the jobs 2.6 and 3.5).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from common import parsum_step, workloads_of

from parsum import _pool


class Recorder:
    """Wraps parsum's pool: the chunks each job ran (thread, chunk, seconds), when each job was
    made and when the caller's part of it ended; with ``alone``, helpers get no job."""

    def __init__(self) -> None:
        self.jobs: list[dict[str, Any]] = []
        self.alone = False
        self._saved: tuple[Any, Any, Any] | None = None

    def __enter__(self) -> Recorder:
        init, work_and_wait, submit = _pool._Job.__init__, _pool._work_and_wait, _pool._pool.submit
        self._saved = (init, work_and_wait, submit)
        recorder = self

        def job_init(job: Any, task: Callable[[int], Any], n_tasks: int, *a: Any, **k: Any) -> None:
            record: dict[str, Any] = {"made": time.perf_counter(), "chunks": []}
            recorder.jobs.append(record)

            def timed(chunk: int) -> Any:
                start = time.perf_counter()
                try:
                    return task(chunk)
                finally:
                    thread = threading.current_thread() is threading.main_thread()
                    record["chunks"].append((thread, chunk, time.perf_counter() - start))

            init(job, timed, n_tasks, *a, **k)

        def caller_part(job: Any) -> None:
            try:
                work_and_wait(job)
            finally:
                recorder.jobs[-1]["ended"] = time.perf_counter()

        def submit_unless_alone(job: Any, helpers: int) -> None:
            if not recorder.alone:
                submit(job, helpers)

        _pool._Job.__init__ = job_init  # type: ignore[method-assign]
        _pool._work_and_wait = caller_part
        _pool._pool.submit = submit_unless_alone  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._saved is not None
        _pool._Job.__init__, _pool._work_and_wait, _pool._pool.submit = self._saved  # type: ignore[method-assign]


def measure(models: Any, x: Any, n_jobs: int, steps: int) -> dict[str, float]:
    """Medians over ``steps`` steps of what the module docstring lists, in ms (and ratios)."""
    rows: dict[str, list[float]] = {}
    with Recorder() as recorder:
        for alone in (True, False):
            recorder.alone = alone
            for _ in range(10):
                parsum_step(models, x, n_jobs=n_jobs)
            for _ in range(steps):
                recorder.jobs.clear()
                start = time.perf_counter()
                parsum_step(models, x, n_jobs=n_jobs)
                end = time.perf_counter()
                if len(recorder.jobs) != 2:  # a forward's job and a backward's, or another path
                    raise SystemExit(f"{len(recorder.jobs)} jobs a step at n_jobs={n_jobs}")
                fwd, bwd = recorder.jobs
                busy = [sum(c[2] for c in job["chunks"]) for job in (fwd, bwd)]
                walls = [job["ended"] - job["made"] for job in (fwd, bwd)]
                prefix = "alone " if alone else ""
                for name, value in (
                    ("step", end - start),
                    ("before", fwd["made"] - start),
                    ("between", bwd["made"] - fwd["ended"]),
                    ("after", end - bwd["ended"]),
                    ("forward job", walls[0]),
                    ("backward job", walls[1]),
                    ("forward chunks", busy[0]),
                    ("backward chunks", busy[1]),
                ):
                    rows.setdefault(prefix + name, []).append(value * 1e3)
    out = {name: statistics.median(values) for name, values in rows.items()}
    out["serial"] = out["before"] + out["between"] + out["after"]
    for phase in ("forward", "backward"):
        chunks, alone = out[f"{phase} chunks"], out[f"alone {phase} chunks"]
        out[f"{phase} slowdown"] = chunks / alone
        out[f"{phase} idle"] = out[f"{phase} job"] * n_jobs - chunks
        out[f"{phase} ideal"] = alone / n_jobs
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="2", help="worker counts, e.g. 2,4,8,16")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument(
        "--workloads",
        default="heterogeneous-medium:64,heterogeneous-tiny:32",
        help="name:batch,...",
    )
    args = parser.parse_args()
    for w in workloads_of(args.workloads):
        print(f"\n{w.description}; medians of {args.steps} steps, ms")
        print(
            f"{'P':>3} {'step':>6} {'serial':>6} {'before':>6} {'between':>7} {'after':>6}"
            f" | {'fwd job':>7} {'ideal':>6} {'slow':>5} {'idle':>6}"
            f" | {'bwd job':>7} {'ideal':>6} {'slow':>5} {'idle':>6}"
        )
        for n_jobs in (int(j) for j in args.jobs.split(",")):
            r = measure(w.models, w.x, n_jobs, args.steps)
            print(
                f"{n_jobs:>3} {r['step']:6.2f} {r['serial']:6.2f} {r['before']:6.2f}"
                f" {r['between']:7.2f} {r['after']:6.2f}"
                f" | {r['forward job']:7.2f} {r['forward ideal']:6.2f}"
                f" {r['forward slowdown']:5.2f} {r['forward idle']:6.2f}"
                f" | {r['backward job']:7.2f} {r['backward ideal']:6.2f}"
                f" {r['backward slowdown']:5.2f} {r['backward idle']:6.2f}"
            )
    print(
        "\nserial: the caller alone outside the jobs (before the forward's, between the two, after"
        "\nthe backward's); job: its wall time, from its making to the caller's end of it; ideal:"
        "\nthe same chunks run one at a time in the caller, over P; slow: the job's chunks summed"
        "\nover the same alone; idle: the job's wall time times P less its chunks' time"
    )


if __name__ == "__main__":
    main()
