"""What parsum costs on one thread, and what its compensated reduction costs.

1. Per-call overhead: one training step (forward + backward) of parsum.sum_models with
   n_jobs=1, per engine, against the plain loop sum(m(x) for m in models) with 1 intra-op
   thread (parsum with n_jobs=1 also runs its models with 1 intra-op thread). A reference row,
   "pullbacks only", is the autograd engine's design with nothing else: each model's graph
   pulled back on its own (torch.autograd.backward(out_i, g, inputs=params_i)) after a plain
   sum of the detached outputs; no planning, no compensated sums, no checks. A second one,
   "function floor", is the least that any design which returns every parameter's gradient from
   one ``torch.autograd.Function`` (as ``ParallelSum`` does) can cost: the models' forwards
   inside the Function, a naive sum, and in its backward one gradient capture per model
   (accumulate_grad=False), returned for autograd to accumulate into ``.grad``. A third,
   "graph floor", is the design parsum takes at one thread (NOTE [ The caller's graph ]) with
   nothing else: the models run in the caller's graph, their outputs summed with one float64
   reduction, returned by one ``torch.autograd.Function`` with an edge to every parameter, whose
   backward pulls every model back in one engine call into ``.grad`` and returns None for the
   parameters. What parsum costs beyond that row is its per-call bookkeeping: checks, the plan's
   reuse check, the failure handling. A fourth, "graph floor, no edges", is the same with the
   node's edge to every parameter left out (an edge to the argument alone): what the engine's
   visits to those edges cost, each receiving None, which ``autograd.grad`` with respect to the
   parameters and ``backward(inputs=...)`` need and no design that pulls the models back inside
   a node (to name a failing model and undo its gradients) can leave out.
2. Reduction: summing 16 tensors with parsum's accumulator against a naive add chain, and the
   time the reductions of a medium step take against the whole step.
3. Large buffers: 8 small models that each hold a 1024 x 1024 constant buffer (a mask), in
   training and in eval mode, against the plain loop: a cost that grows with the buffers
   would show here (a copy of every buffer per call to undo a failed one, or stacking them)
   as a difference from the same models holding a 64 x 64 buffer (the part they read).

Every method runs once per round, interleaved, after a warm-up; medians over the rounds and
ratios measured in this one process. Gradients accumulate into ``.grad`` from step to step;
with ``--zero-grad`` every method first sets them to None, as ``optimizer.zero_grad()`` does,
so autograd stores each gradient instead of adding it to the last one.

    python benchmarks/bench_overhead.py [--rounds 40] [--zero-grad] [--json out.json]
        [--only overhead|reduction|buffers] [--workloads distinct-medium:64,distinct-tiny]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
from common import (
    Workload,
    interleaved,
    loss_of,
    one_thread,
    parsum_step,
    plain_step,
    workload,
    workloads_of,
)
from torch.autograd.graph import get_gradient_edge

import parsum
from parsum._engines import pull_back
from parsum._summation import CompensatedAccumulator

ENGINES = ("autograd", "vjp", "stacked", "auto")


def overhead(w: Workload, rounds: int, zero_grad: bool) -> dict[str, float]:
    models, x = w.models, w.x

    def zeroed(step: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            for m in models:
                m.zero_grad(set_to_none=True)
            step()

        return run if zero_grad else step

    def step_of(engine: str):
        return zeroed(
            lambda: loss_of(parsum.sum_models(models, x, n_jobs=1, engine=engine)).backward()
        )

    def plain() -> None:  # plain_step sets .grad to None first, which this run may not want
        loss_of(sum(m(x) for m in models)).backward()  # type: ignore[arg-type]

    methods = {
        "plain-1t": one_thread(zeroed(plain)),
        "pullbacks only": one_thread(zeroed(lambda: pullbacks_only(models, x))),
        "function floor": one_thread(zeroed(function_floor(models, x))),
        "graph floor": one_thread(zeroed(graph_floor(models, x))),
        "graph floor, no edges": one_thread(zeroed(graph_floor(models, x, edges=False))),
    }
    for engine in ENGINES:
        if engine == "stacked" and not w.identical:
            continue
        methods[f"parsum {engine}"] = step_of(engine)
    medians = interleaved(methods, rounds)
    base = medians["plain-1t"]
    print(f"\n{w.name}: {w.description}")
    print(f"{'method':>22} {'ms/step':>9} {'plain-1t / this':>16} {'extra us/model':>15}")
    for method, t in medians.items():
        extra = (t - base) / len(models) * 1e6
        print(f"{method:>22} {t * 1e3:9.2f} {base / t:16.2f} {extra:15.1f}")
    return medians


def pullbacks_only(models: list[torch.nn.Module], x: torch.Tensor) -> None:
    """One engine run per model, gradients stored by autograd; the sum and loss as usual."""
    outs = [m(x) for m in models]
    y = sum(o.detach() for o in outs).requires_grad_()  # type: ignore[union-attr]
    loss_of(y).backward()
    for m, out in zip(models, outs):
        torch.autograd.backward(out, y.grad, inputs=list(m.parameters()))


def function_floor(models: list[torch.nn.Module], x: torch.Tensor) -> Callable[[], None]:
    """A step through the simplest autograd.Function that fans out per-model pullbacks."""
    params = [tuple(m.parameters()) for m in models]
    everything = [p for ps in params for p in ps]

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor, *_params: torch.Tensor) -> torch.Tensor:
            with torch.enable_grad():
                ctx.outs = [m(x) for m in models]
            return naive_sum([o.detach() for o in ctx.outs])

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            grads: list[torch.Tensor | None] = []
            for out, wrt in zip(ctx.outs, params):  # autograd.grad, minus its Python checks
                grads += pull_back([get_gradient_edge(out)], wrt, [grad], False)
            ctx.outs = None
            return (None, *grads)

    return lambda: loss_of(Floor.apply(x, *everything)).backward()


def graph_floor(
    models: list[torch.nn.Module], x: torch.Tensor, edges: bool = True
) -> Callable[[], None]:
    """A step through the caller's-graph design with nothing else: the models run in the
    caller's graph, a node with an edge to every parameter returns their wide sum, and its
    backward pulls them all back in one engine call, accumulating into ``.grad``. Without
    ``edges`` the node's one edge is to a leaf of its own."""
    everything = [p for m in models for p in m.parameters()]
    if not edges:
        everything = [torch.empty(0, requires_grad=True)]

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, held: dict, *_params: torch.Tensor) -> torch.Tensor:
            ctx.held = held
            return held.pop("sum")

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            outs = ctx.held.pop("outs")
            torch.autograd.backward(outs, [grad] * len(outs))
            return (None,) * (1 + len(everything))

    def step() -> None:
        outs = [m(x) for m in models]
        total = torch.stack([o.detach() for o in outs]).sum(0, dtype=torch.float64)
        held = {"sum": total.to(outs[0].dtype), "outs": outs}
        loss_of(Floor.apply(held, *everything)).backward()

    return step


def naive_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total


def accumulated(xs: list[torch.Tensor]) -> torch.Tensor:
    acc = CompensatedAccumulator()
    for x in xs:
        acc.add(x)
    return acc.result()


def _repeat(fn: Callable[[list[torch.Tensor]], torch.Tensor], xs: list, times: int = 20) -> None:
    for _ in range(times):
        fn(xs)


def reduction(rounds: int) -> dict[str, float]:
    print("\nreduction of 16 tensors of 256x64, 1 intra-op thread (20 sums per sample)")
    print(f"{'dtype':>9} {'naive us':>9} {'parsum us':>10} {'parsum / naive':>15}")
    results = {}
    for dtype in (torch.float32, torch.float64):
        xs = [torch.randn(256, 64, dtype=dtype) for _ in range(16)]
        medians = interleaved(
            {
                "naive": one_thread(lambda xs=xs: _repeat(naive_sum, xs)),
                "parsum": one_thread(lambda xs=xs: _repeat(accumulated, xs)),
            },
            rounds,
        )
        naive_us, ours_us = medians["naive"] / 20 * 1e6, medians["parsum"] / 20 * 1e6
        print(f"{str(dtype)[6:]:>9} {naive_us:9.1f} {ours_us:10.1f} {ours_us / naive_us:15.2f}")
        results[f"{dtype}"] = ours_us / naive_us

    # The reductions of a medium step with an input that needs its gradient: the 16 outputs in
    # forward, the 16 input gradients in backward, against the whole step.
    w = workload("heterogeneous-medium", 64)
    x = w.x.requires_grad_()
    outs = [torch.randn(64, 10) for _ in w.models]
    in_grads = [torch.randn_like(x) for _ in w.models]
    medians = interleaved(
        {
            "step": lambda: loss_of(parsum.sum_models(w.models, x)).backward(),
            "reductions": lambda: (
                _repeat(accumulated, outs, 1) or _repeat(accumulated, in_grads, 1)
            ),
        },
        rounds,
    )
    share = medians["reductions"] / medians["step"]
    print(
        f"medium step ({w.description}, input gradient too): step "
        f"{medians['step'] * 1e3:.2f} ms, its reductions {medians['reductions'] * 1e3:.3f} ms "
        f"= {share:.1%} of the step"
    )
    results["share_of_medium_step"] = share
    return results


class Masked(torch.nn.Module):
    """A small MLP whose output is scaled by a slice of a constant buffer (1024 x 1024, or
    just the 64 x 64 that is read)."""

    def __init__(self, size: int = 1024) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64)
        )
        self.register_buffer("mask", torch.tril(torch.ones(size, size)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.mask[: x.shape[0], :64]


def large_buffers(rounds: int) -> dict[str, float]:
    torch.manual_seed(0)
    sets = {"1024 x 1024": [Masked() for _ in range(8)], "64 x 64": [Masked(64) for _ in range(8)]}
    x = torch.randn(64, 64)

    def in_mode(models: list, training: bool, step: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            for m in models:
                m.train(training)
            step()

        return run

    methods = {}
    for size, models in sets.items():
        for mode, training in (("train", True), ("eval", False)):
            plain = one_thread(lambda models=models: plain_step(models, x))
            methods[f"plain-1t {mode} {size}"] = in_mode(models, training, plain)
            # Both set .grad to None first (plain_step does), as optimizer.zero_grad() would.
            ours = lambda models=models: parsum_step(models, x, n_jobs=1)  # noqa: E731
            methods[f"parsum {mode} {size}"] = in_mode(models, training, ours)
    medians = interleaved(methods, rounds)
    print("\nlarge buffers: 8 MLPs of width 64, batch 64, each with a buffer of which 64 x 64 is")
    print("read; the same models with a buffer of just that size show the cost of the call alone")
    header = ("mode", "buffer", "plain-1t ms", "parsum ms", "plain-1t / parsum")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (6, 12, 12, 10, 18))))
    for size in sets:
        for mode in ("train", "eval"):
            base, ours = medians[f"plain-1t {mode} {size}"], medians[f"parsum {mode} {size}"]
            print(f"{mode:>6} {size:>12} {base * 1e3:12.2f} {ours * 1e3:10.2f} {base / ours:18.2f}")
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--zero-grad", action="store_true", help="set .grad to None each step")
    parser.add_argument("--json", help="write the medians (seconds) and ratios to this file")
    parser.add_argument("--only", choices=("overhead", "reduction", "buffers"))
    parser.add_argument(
        "--workloads",
        default="heterogeneous-tiny,identical-tiny,heterogeneous-medium:64",
        help="name[:batch], comma-separated, for the per-call overhead",
    )
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}; medians of {args.rounds} interleaved rounds; "
        + ("grads set to None before each step" if args.zero_grad else "grads accumulate")
    )
    results: dict[str, dict[str, float]] = {}
    if args.only in (None, "overhead"):
        for w in workloads_of(args.workloads):
            key = w.name if w.name not in results else f"{w.name}:{len(w.x)}"
            results[key] = overhead(w, args.rounds, args.zero_grad)
    if args.only in (None, "reduction"):
        results["reduction"] = reduction(args.rounds)
    if args.only in (None, "buffers"):
        results["large_buffers"] = large_buffers(args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
