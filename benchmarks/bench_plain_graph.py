"""Sequentials of known layers as one plain graph on the budget's intra-op threads, against
parsum's default (workers where they pay), budget by budget.

On a budget of 2, ``auto`` runs such models in one chunk, as a plain graph, where their kernels
weigh less than twice their Python (NOTE [ Known layers on one thread ] in
``parsum/_plain_graph.py``); larger budgets keep the workers, unmeasured. This times, at each
budget, the plain loop, parsum's default and parsum with one chunk (``chunk_size`` = the
models: the plain graph), a backward alone and with an Adam step after it, interleaved. With
``--x-grad`` the argument needs a gradient too, as a trunk's features under heads do (NOTE [ An
argument that needs a gradient in a plain graph ]).

    python benchmarks/bench_plain_graph.py [--budgets 2,4,8,16] [--rounds 20] [--x-grad]
        [--workloads heterogeneous-tiny,heads,heads:256,heterogeneous-medium:16,...]
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections.abc import Callable

import torch
from common import interleaved_rounds, workload, workload_spec

import parsum

WORKLOADS = (
    "heterogeneous-tiny,heads,heads:256,heads:1024,heterogeneous-medium:16,"
    "heterogeneous-medium:32,heterogeneous-medium:64,example-members:64"
)


def step_of(models: list[torch.nn.Module], x: torch.Tensor, chunk: int | None, adam: bool,
            plain: bool = False) -> Callable[[], None]:  # fmt: skip
    """A step over copies of ``models``: the loss of their sum, its backward, Adam after it
    (a leaf ``x`` that needs a gradient gets its own, reset every step)."""
    models = copy.deepcopy(models)
    params = [p for m in models for p in m.parameters()]
    opt = torch.optim.Adam(params, lr=1e-3) if adam else None
    x = x.detach().requires_grad_(x.requires_grad)

    def step() -> None:
        for p in params:
            p.grad = None
        x.grad = None
        y = sum(m(x) for m in models) if plain else parsum.sum_models(models, x, chunk_size=chunk)
        y.pow(2).mean().backward()
        if opt is not None:
            opt.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="2,4,8,16")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--workloads", default=WORKLOADS)
    parser.add_argument("--x-grad", action="store_true", help="the argument needs a gradient")
    args = parser.parse_args()
    saved = torch.get_num_threads()
    wanted = ", x needing a gradient" if args.x_grad else ""
    print(f"torch {torch.__version__}, medians of {args.rounds} interleaved rounds{wanted}")
    for budget in (int(b) for b in args.budgets.split(",")):
        torch.set_num_threads(budget)
        for spec in args.workloads.split(","):
            w = workload(*workload_spec(spec))
            w.x.requires_grad_(args.x_grad)
            for adam in (False, True):
                methods = {
                    "plain": step_of(w.models, w.x, None, adam, plain=True),
                    "default": step_of(w.models, w.x, None, adam),
                    "one chunk": step_of(w.models, w.x, len(w.models), adam),
                }
                times = interleaved_rounds(methods, args.rounds, settle_seconds=0.02)
                ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
                print(
                    f"budget {budget}, {w.description}{', Adam' if adam else ''}: "
                    + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
                    + f"; default {ms['plain'] / ms['default']:.2f}x plain, one chunk "
                    f"{ms['plain'] / ms['one chunk']:.2f}x plain, one chunk / default "
                    f"{ms['default'] / ms['one chunk']:.2f}x",
                    flush=True,
                )
    torch.set_num_threads(saved)


if __name__ == "__main__":
    main()
