"""How fast is one training step of a heterogeneous ensemble with parsum, against what a user
would otherwise run, and against the machine's parallel ceiling?

Methods, all forward + backward of sum(m(x) for m in models) with a squared loss:
  plain        the plain loop, PyTorch's default intra-op threads
  plain-1t     the plain loop with 1 intra-op thread
  hand-split   the ceiling: models split by hand over P persistent threads, each running plain
               forward + backward on its share with 1 intra-op thread, no reduction
  parsum       parsum.sum_models with n_jobs=P and default settings

Every method runs once per round, interleaved, after a warm-up; the table gives medians over the
rounds and ratios measured in this one process (absolute times drift on shared machines).

    python benchmarks/bench_speedup.py [--jobs 1,2] [--batch 64,256] [--rounds 30] [--json out]
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import threading
import time
from collections.abc import Callable

import torch
from torch import nn

import parsum


def heterogeneous_medium(n_models: int = 16, n_in: int = 64, n_out: int = 10) -> list[nn.Module]:
    """MLPs of widths 128 to 512 and 1 to 3 hidden layers."""
    torch.manual_seed(0)
    models = []
    for i in range(n_models):
        width, depth = (128, 256, 384, 512)[i % 4], 1 + i % 3
        dims = [n_in] + [width] * depth
        layers: list[nn.Module] = []
        for a, b in zip(dims[:-1], dims[1:]):
            layers += [nn.Linear(a, b), nn.Tanh()]
        models.append(nn.Sequential(*layers, nn.Linear(width, n_out)))
    return models


class HandSplit:
    """P persistent threads, each with 1 intra-op thread, running plain steps on its share."""

    def __init__(self, models: list[nn.Module], threads: int) -> None:
        self.shares = [models[p::threads] for p in range(threads)]
        self.tasks: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in self.shares[1:]]
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        for share, tasks in zip(self.shares[1:], self.tasks):
            threading.Thread(target=self._serve, args=(share, tasks), daemon=True).start()

    @staticmethod
    def _step(share: list[nn.Module], x: torch.Tensor) -> None:
        for m in share:
            m(x).pow(2).sum().backward()

    def _serve(self, share: list[nn.Module], tasks: queue.SimpleQueue) -> None:
        torch.set_num_threads(1)
        while True:
            x = tasks.get()
            self._step(share, x)
            self.done.put(None)

    def __call__(self, x: torch.Tensor) -> None:
        for tasks in self.tasks:
            tasks.put(x)
        saved = torch.get_num_threads()
        torch.set_num_threads(1)
        self._step(self.shares[0], x)
        torch.set_num_threads(saved)
        for _ in self.tasks:
            self.done.get()


def plain_step(models: list[nn.Module], x: torch.Tensor) -> None:
    sum(m(x) for m in models).pow(2).sum().backward()


def one_thread(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        saved = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            fn()
        finally:
            torch.set_num_threads(saved)

    return run


def methods_for(models: list[nn.Module], x: torch.Tensor, jobs: list[int]) -> dict:
    def plain() -> None:
        plain_step(models, x)

    def parsum_step(p: int) -> Callable[[], None]:
        return lambda: parsum.sum_models(models, x, n_jobs=p).pow(2).sum().backward()

    def hand_split(p: int) -> Callable[[], None]:
        split = HandSplit(models, p)
        return lambda: split(x)

    methods: dict[str, Callable[[], None]] = {"plain": plain, "plain-1t": one_thread(plain)}
    for p in jobs:
        if p > 1:
            methods[f"hand-split P={p}"] = hand_split(p)
        methods[f"parsum n_jobs={p}"] = parsum_step(p)
    return methods


def measure(methods: dict[str, Callable[[], None]], rounds: int, warmup: int = 5) -> dict:
    times: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(warmup + rounds):
        for name, fn in methods.items():
            start = time.perf_counter()
            fn()
            if r >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="1,2")
    parser.add_argument("--batch", default="64,256")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args()
    jobs = [int(j) for j in args.jobs.split(",")]
    cores = parsum._config.usable_cores()
    print(
        f"torch {torch.__version__}, {cores} usable cores, {torch.get_num_threads()} "
        f"intra-op threads by default; medians of {args.rounds} interleaved rounds"
    )
    results = []
    for batch in [int(b) for b in args.batch.split(",")]:
        methods = methods_for(heterogeneous_medium(), torch.randn(batch, 64), jobs)
        medians = measure(methods, args.rounds)
        base = medians["plain"]
        print(f"\nheterogeneous-medium: 16 MLPs (widths 128-512), batch {batch}")
        print(f"{'method':>20} {'ms/step':>9} {'plain / this':>13}")
        for name, t in medians.items():
            print(f"{name:>20} {t * 1e3:9.2f} {base / t:13.2f}")
            results.append(
                {
                    "workload": "heterogeneous-medium",
                    "batch": batch,
                    "method": name,
                    "seconds": t,
                    "speedup_vs_plain": base / t,
                }
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cores": cores, "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
