"""Models called through bound methods (``m.forward``, ``m.encode``) against the same models
passed as modules, and the plain loop.

A bound method is a new object on every call; parsum knows it by its module and its function
and reuses the call's plan as it does for modules (NOTE [ Reused plans ] in parsum._plans).
Each method steps its own copy of the models (forward and backward, ``.grad`` set to None
first), in turn, after one untimed step in its turn; medians and ratios from this one process.

    python benchmarks/bench_methods.py [--workloads distinct-tiny,heterogeneous-medium:64]
        [--rounds 25]
"""

from __future__ import annotations

import argparse

import torch
from common import (
    Workload,
    interleaved,
    loss_of,
    plain_step,
    workload,
    workloads_of,
    zero_grads,
)

import parsum


def measure(w: Workload, rounds: int) -> dict[str, float]:
    """Median seconds a step of the plain loop, the modules and their bound methods."""
    batch = w.x.shape[0]
    plain, modules, bound = (workload(w.name, batch).models for _ in range(3))
    x = w.x

    def as_modules() -> None:
        zero_grads(modules)
        loss_of(parsum.sum_models(modules, x)).backward()

    def as_methods() -> None:
        zero_grads(bound)
        loss_of(parsum.sum_models([m.forward for m in bound], x)).backward()

    methods = {
        "plain": lambda: plain_step(plain, x),
        "modules": as_modules,
        "bound methods": as_methods,
    }
    return interleaved(methods, rounds, settle=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="distinct-tiny,heterogeneous-medium:64")
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads; medians of "
        f"{args.rounds} interleaved rounds"
    )
    for w in workloads_of(args.workloads):
        medians = measure(w, args.rounds)
        print(f"\n{w.name}: {w.description}")
        for name, t in medians.items():
            print(f"{name:>14} {t * 1e3:8.2f} ms  plain / this {medians['plain'] / t:5.2f}")
        ratio = medians["modules"] / medians["bound methods"]
        print(f"  bound methods at {ratio:.2f}x the speed of the modules")


if __name__ == "__main__":
    main()
