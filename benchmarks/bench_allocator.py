"""Page faults from glibc's heap trimming: the plain loop without parsum, the plain loop and
parsum with parsum imported, with glibc's defaults and with its thresholds fixed.

On Linux with glibc, PyTorch's CPU tensors come from ``malloc``. When a training step frees its
gradients (``optimizer.zero_grad()``), the top of the heap may become free and be returned to
the system (trimmed), and the next backward faults every page of the gradients in again. Whether
that happens depends on the heap's history, so it changes from process to process. Importing
parsum takes glibc's thresholds where glibc puts them once a 31 MB block is freed (NOTE
[ glibc's heap top ]); fixing them (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``) keeps
the pages too. Each process below is fresh; the figures are medians over its steps, then over
the processes.

    python benchmarks/bench_allocator.py [--processes 3] [--steps 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

# glibc's own ceiling for its dynamic mmap threshold (32 MB on 64-bit), and a trim threshold
# twice that, as glibc sets it when it raises the mmap threshold.
TUNED = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(64 * 2**20)}
# The plain loop in a process that never imports parsum, then with parsum imported, then parsum.
METHODS = ("plain alone", "plain", "parsum")


def child(method: str, steps: int, batch: int) -> dict[str, float]:
    """One fresh process: ms per step and minor page faults per step, medians over steps."""
    import torch
    from common import loss_of, workload, zero_grads

    if method != "plain alone":
        import parsum

    w = workload("heterogeneous-medium", batch)
    models, x = w.models, w.x

    def step() -> None:
        zero_grads(models)
        y = parsum.sum_models(models, x) if method == "parsum" else sum(m(x) for m in models)
        loss_of(y).backward()  # type: ignore[arg-type]

    for _ in range(50):
        step()
    times, faults = [], []
    for _ in range(steps):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return {
        "ms": statistics.median(times) * 1e3,
        "faults": statistics.median(faults),
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--json")
    parser.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.batch)))
        return
    here = os.path.dirname(os.path.abspath(__file__))
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for setting, extra in (("glibc defaults", {}), ("thresholds fixed", TUNED)):
        env = {k: v for k, v in os.environ.items() if k not in TUNED} | extra
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
        for _ in range(args.processes):
            for method in METHODS:  # alternating, so that drift affects both alike
                command = [sys.executable, os.path.join(here, "bench_allocator.py")]
                command += ["--child", method, "--steps", str(args.steps)]
                command += ["--batch", str(args.batch)]
                out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
                runs[method].append(json.loads(out.stdout.splitlines()[-1]))
        results[setting] = runs
    threads = results["glibc defaults"]["plain"][0]["threads"]
    print(
        f"16 MLPs of widths 128-512, batch {args.batch}, {threads} intra-op threads; "
        f"{args.processes} fresh processes per row, {args.steps} steps each"
    )
    print(f"{'setting':>17} {'method':>11} {'ms/step (each process)':>30} {'faults/step':>20}")
    for setting, runs in results.items():
        for method, rs in runs.items():
            each = " ".join(f"{r['ms']:.2f}" for r in rs)
            faults = " ".join(f"{r['faults']:.0f}" for r in rs)
            print(f"{setting:>17} {method:>11} {each:>30} {faults:>20}")
        ms = {m: statistics.median(r["ms"] for r in rs) for m, rs in runs.items()}
        alone, beside = ms["plain alone"] / ms["parsum"], ms["plain"] / ms["parsum"]
        print(
            f"{setting:>17}: parsum against the plain loop alone {alone:.2f}x, against the "
            f"plain loop with parsum imported {beside:.2f}x (medians over processes)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
