"""What do flat gradient buffers save?

1. Accumulating the gradients of 64 models with many small parameters into running totals
   (what every micro-batch, every gradient-accumulation step does):
     per-parameter   for each parameter: total.add_(grad)
     foreach         torch._foreach_add_(totals, grads)
     flat            one add over one contiguous buffer
     flat-kbn        one compensated add (parsum's compensated_add_) over the buffer
2. A whole training step (forward, backward, SGD step, zero_grad) with parsum.sum_models, of
   the same 64 models and of 16 medium MLPs: gradients in fresh tensors (zero_grad sets them
   to None), in a FlatGrad (FlatGrad.zero_), and in a compensated FlatGrad.
3. The same step for 64 identical tiny MLPs in stacked storage (parsum.stack_): SGD over
   stack.parameters() with the gradients in the stack's own buffers, or in FlatGrad(stack)
   (one buffer: NOTE [ One buffer for a stack ]); and with a FlatGrad over the models as a
   list, whose stacked tensors then get no gradient, SGD over the models' own parameters.

Every method runs once per round, interleaved, after a warm-up; medians over the rounds, ratios
measured in this one process.

    python benchmarks/bench_flatgrad.py [--models 64] [--rounds 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
from common import interleaved, mlp
from torch import nn

import parsum
from parsum._summation import compensated_add_


def small_models(n_models: int, width: int = 16, depth: int = 8) -> list[nn.Module]:
    """MLPs of ``depth`` Linear layers of width ``width``: many small parameters each."""
    torch.manual_seed(0)
    models = []
    for _ in range(n_models):
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.Tanh()]
        models.append(nn.Sequential(*layers[:-1]))
    return models


def accumulation(n_models: int, rounds: int) -> dict[str, float]:
    params = [p for m in small_models(n_models) for p in m.parameters()]
    grads = [torch.randn_like(p) for p in params]
    totals = [torch.zeros_like(p) for p in params]
    flat_grads = torch.cat([g.flatten() for g in grads])
    flat_total = torch.zeros_like(flat_grads)
    flat_comp = torch.zeros_like(flat_grads)

    def per_parameter() -> None:
        for total, g in zip(totals, grads):
            total.add_(g)

    def foreach() -> None:
        torch._foreach_add_(totals, grads)

    def flat() -> None:
        flat_total.add_(flat_grads)

    def flat_kbn() -> None:
        compensated_add_([flat_total], [flat_comp], [flat_grads])

    # One call is microseconds: time 20 calls per sample.
    def repeat(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(20):
                fn()

        return run

    methods = {
        "per-parameter": per_parameter,
        "foreach": foreach,
        "flat": flat,
        "flat-kbn": flat_kbn,
    }
    medians = interleaved({k: repeat(v) for k, v in methods.items()}, rounds)
    print(f"\n1. accumulate {len(params)} gradient tensors ({flat_grads.numel()} floats)")
    print(f"   of {n_models} models into running totals; median of {rounds} rounds")
    print(f"   {'method':<15}{'us / accumulation':>19}{'per-parameter / this':>23}")
    base = medians["per-parameter"]
    for name, t in medians.items():
        print(f"   {name:<15}{t / 20 * 1e6:>19.1f}{base / t:>23.2f}")
    return {k: v / 20 for k, v in medians.items()}


def medium_models(n_models: int = 16) -> list[nn.Module]:
    """MLPs of widths 128 to 512, 1 to 3 hidden layers (bench_speedup's medium workload)."""
    torch.manual_seed(0)
    return [mlp(16, (128, 256, 384, 512)[i % 4], 1 + i % 3, 16) for i in range(n_models)]


def training_step(
    build: Callable[[], list[nn.Module]], title: str, rounds: int, batch: int
) -> dict[str, float]:
    x = torch.randn(batch, 16)
    setups = {}
    for name in ("fresh tensors", "FlatGrad", "FlatGrad compensated"):
        models = build()
        params = [p for m in models for p in m.parameters()]
        opt = torch.optim.SGD(params, lr=1e-3)
        flat = None
        if name != "fresh tensors":
            flat = parsum.FlatGrad(models, compensated=name.endswith("compensated"))

        def step(models=models, opt=opt, flat=flat) -> None:
            parsum.sum_models(models, x).pow(2).mean().backward()
            opt.step()
            if flat is None:
                opt.zero_grad()
            else:
                flat.zero_()

        setups[name] = step
    medians = interleaved(setups, rounds)
    heading = f"\n2. training step (SGD) with parsum.sum_models: {title}, batch {batch}"
    print_steps(heading, medians, "fresh tensors", "fresh / this")
    return medians


def print_steps(heading: str, medians: dict[str, float], base: str, ratio: str) -> None:
    """A table of ms per step, and each method's speed against ``base``'s."""
    print(heading)
    width = len(ratio) + 3
    print(f"   {'gradients held in':<24}{'ms / step':>11}{ratio:>{width}}")
    for name, t in medians.items():
        print(f"   {name:<24}{t * 1e3:>11.2f}{medians[base] / t:>{width}.2f}")


def stacked_step(n_models: int, rounds: int, batch: int) -> dict[str, float]:
    x = torch.randn(batch, 16)
    setups = {}
    for name in ("stack's buffers", "FlatGrad(stack)", "FlatGrad(models)"):
        torch.manual_seed(0)
        models = [mlp(16, 32, 2, 4) for _ in range(n_models)]
        stack = parsum.stack_(models)
        flat = None
        if name == "FlatGrad(models)":
            flat = parsum.FlatGrad(models)
            opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=1e-3)
        else:
            opt = torch.optim.SGD(stack.parameters(), lr=1e-3)
            if name == "FlatGrad(stack)":
                flat = parsum.FlatGrad(stack)

        # Over the stack, its optimizer's zero_grad() sets the stacked .grad to None.
        zero = opt.zero_grad if flat is None or name == "FlatGrad(stack)" else flat.zero_

        def step(models=models, opt=opt, zero=zero) -> None:
            parsum.sum_models(models, x).pow(2).mean().backward()
            opt.step()
            zero()

        setups[name] = step
    medians = interleaved(setups, rounds)
    heading = (
        f"\n3. training step (SGD), {n_models} identical MLPs of width 32 in stacked storage,"
        f"\n   batch {batch}"
    )
    print_steps(heading, medians, "stack's buffers", "buffers / this")
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--json", help="write the medians (seconds) to this file")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads")
    results = {
        "accumulate": accumulation(args.models, args.rounds),
        "step-small": training_step(
            lambda: small_models(args.models),
            f"the {args.models} models above",
            max(5, args.rounds // 4),
            args.batch,
        ),
        "step-medium": training_step(
            medium_models, "16 MLPs of widths 128-512", max(5, args.rounds // 4), 64
        ),
        "step-stacked": stacked_step(args.models, args.rounds, args.batch),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
