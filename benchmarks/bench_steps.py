"""Where a step with StepInBackward goes, against the same step taken after the call.

On 16 cores (2026-11-30) ``StepInBackward`` with Adam ran at 0.50-0.52x the plain loop with
Adam on 16 medium MLPs, where ``sum_models`` then an Adam step ran at 0.99-1.12x; on 2 cores
both were at 0.96-1.05x. A call with ``step_in_backward`` runs through ``ParallelSum`` (the
other calls in the caller's graph) and steps in the workers: this script times each part
apart, in one interleaved run (``common.interleaved``), each method on its own copy of the
models:

- ``plain+adam``: the plain loop, then one Adam over every parameter;
- ``parsum+adam``: ``sum_models`` (the caller's graph), then that Adam;
- ``ParallelSum+adam``: the same with an identity tensor hook on one parameter of the first
  model, which sends the call through ``ParallelSum``;
- ``sib``: a ``StepInBackward`` of Adam (its steps over the tensors in one call);
- ``sib loop``: the same with ``foreach=False`` (each step loops over its tensors from Python).

    python benchmarks/bench_steps.py [--workloads heterogeneous-medium:64,distinct-medium:64]
        [--rounds 10] [--n-jobs N]
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable

import torch
from common import interleaved, loss_of, plain_adam_step, workloads_of

import parsum


def methods_for(models: list[torch.nn.Module], x: torch.Tensor, n_jobs: int | None) -> dict:
    """Each method's step, over a copy of ``models`` of its own."""

    def after_the_call(ms: list[torch.nn.Module]) -> Callable[[], None]:
        adam = torch.optim.Adam([p for m in ms for p in m.parameters()], lr=1e-3)

        def step() -> None:
            adam.zero_grad()
            loss_of(parsum.sum_models(ms, x, n_jobs=n_jobs)).backward()
            adam.step()

        return step

    def in_the_backward(ms: list[torch.nn.Module], **kwargs: object) -> Callable[[], None]:
        sib = parsum.StepInBackward(ms, torch.optim.Adam, lr=1e-3, **kwargs)

        def step() -> None:
            loss_of(parsum.sum_models(ms, x, step_in_backward=sib, n_jobs=n_jobs)).backward()

        return step

    hooked = copy.deepcopy(models)
    next(hooked[0].parameters()).register_hook(lambda g: g)
    plain = plain_adam_step(copy.deepcopy(models))
    return {
        "plain+adam": lambda: plain(x),
        "parsum+adam": after_the_call(copy.deepcopy(models)),
        "ParallelSum+adam": after_the_call(hooked),
        "sib": in_the_backward(copy.deepcopy(models)),
        "sib loop": in_the_backward(copy.deepcopy(models), foreach=False),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="heterogeneous-medium:64,distinct-medium:64")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--n-jobs", type=int, default=None)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {parsum._config.usable_cores()} usable cores, "
        f"{torch.get_num_threads()} intra-op threads, n_jobs {args.n_jobs}; medians of "
        f"{args.rounds} interleaved rounds"
    )
    for w in workloads_of(args.workloads):
        medians = interleaved(methods_for(w.models, w.x, args.n_jobs), args.rounds, settle=1)
        base = medians["plain+adam"]
        print(f"\n{w.name}: {w.description}")
        for name, t in medians.items():
            print(f"{name:>18} {t * 1e3:8.2f} ms   plain+adam / this {base / t:5.2f}")


if __name__ == "__main__":
    main()
