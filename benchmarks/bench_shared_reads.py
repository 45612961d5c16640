"""Whether models that share a parameter could be pulled back in one engine call, each reading
the parameter through a view of its own made by a ``TorchFunctionMode`` instead of a shadow of
its module: a prototype outside the package, on heads written as classes over one shared trunk.

  plain        the plain loop
  parsum 1     parsum.sum_models(models, x, n_jobs=1): the caller's graph, each model that uses
               the trunk pulled back in an engine call of its own (NOTE [ Parameters several
               models use in the caller's graph ] in parsum/_inline.py)
  views        the prototype: a view of each trunk parameter for each model, read in its forward
               through a mode that puts the view wherever the parameter is an argument of a
               torch function; the outputs and each parameter's views' gradients summed in
               float64 in model order, the models pulled back by the caller's backward, in one
               engine call (none of parsum's checks, failures or chunks)
  forward      the models' forwards alone, plain and under the mode

One intra-op thread (thread CPU time counts the calling thread's alone). Every step starts from
``.grad`` None; minimum thread CPU time of the rounds, a block of ``--steps`` steps each. The
prototype's gradients are checked against the plain loop's, and the script says whether a
custom ``autograd.Function`` handed the parameter escapes the mode (its read would then reach
the parameter, not the view, and be missing from the views' gradients).

    python benchmarks/bench_shared_reads.py [--rounds 10] [--steps 30]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from common import loss_of, parameters_of, parsum_step, plain_step, workload, zero_grads
from torch.overrides import TorchFunctionMode


class ReadThrough(TorchFunctionMode):
    """Torch functions called with a tensor of ``table`` (by id) get its replacement instead
    (top-level arguments and lists or tuples of them)."""

    def __init__(self, table: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.table = table

    def _swap(self, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return type(value)(self._swap(v) for v in value)
        return self.table.get(id(value), value)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = {k: self._swap(v) for k, v in (kwargs or {}).items()}
        return func(*(self._swap(a) for a in args), **kwargs)


class Views(torch.autograd.Function):
    """``n`` views of ``param``, whose gradients are added in float64 in their order."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        return tuple(param.view_as(param) for _ in range(n))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        given = [g for g in grads if g is not None]
        if not given:
            return None, None
        total = torch.zeros_like(given[0], dtype=torch.float64)
        for g in given:
            total += g
        return total.to(given[0].dtype), None


def views_step(models: list[Any], x: torch.Tensor, shared: list[torch.Tensor]) -> None:
    """The prototype's step, forward and backward, from ``.grad`` None."""
    zero_grads(models)
    views = [Views.apply(p, len(models)) for p in shared]
    outs = []
    for i, model in enumerate(models):
        with ReadThrough({id(p): v[i] for p, v in zip(shared, views)}):
            outs.append(model(x))
    loss_of(torch.stack(outs).double().sum(0).float()).backward()


def escapes_mode() -> bool:
    """Whether a custom autograd.Function's apply, handed a tensor, bypasses the mode."""

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
            return a * 2

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g * 2

    p = torch.nn.Parameter(torch.ones(2))
    view = p.view_as(p)
    with ReadThrough({id(p): view}):
        out = Double.apply(p)
    (reached,) = torch.autograd.grad(out.sum(), [view], allow_unused=True)
    return reached is None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    w = workload("trunk-classes")
    models, x = w.models, w.x
    shared = list(models[0].trunk.parameters())
    params = parameters_of(models)

    def grads_of(step: Callable[[], None]) -> list[torch.Tensor]:
        step()
        return [p.grad.clone() for p in params]  # type: ignore[union-attr]

    plain = grads_of(lambda: plain_step(models, x))
    views = grads_of(lambda: views_step(models, x, shared))
    diff = max((a - b).abs().max().item() for a, b in zip(plain, views))
    print(f"{w.description}, torch {torch.__version__}, one intra-op thread")
    print(f"views' gradients against the plain loop's: max difference {diff:.3g}")
    print(f"a custom autograd.Function's read escapes the mode: {escapes_mode()}")

    def forward_under_mode() -> None:
        table = {id(p): p.view_as(p) for p in shared}
        for m in models:
            with ReadThrough(table):
                m(x)

    methods: dict[str, Callable[[], Any]] = {
        "plain": lambda: plain_step(models, x),
        "parsum 1": lambda: parsum_step(models, x, n_jobs=1),
        "views": lambda: views_step(models, x, shared),
        "forward plain": lambda: [m(x) for m in models],
        "forward mode": forward_under_mode,
    }
    best = dict.fromkeys(methods, float("inf"))
    for _ in range(opts.rounds):
        for name, step in methods.items():
            start = time.thread_time_ns()
            for _ in range(opts.steps):
                step()
            best[name] = min(best[name], (time.thread_time_ns() - start) / opts.steps / 1e6)
    for name, ms in best.items():
        ratio = f"   plain / this {best['plain'] / ms:.2f}" if "forward" not in name else ""
        print(f"{name:>14} {ms:7.3f} ms{ratio}")


if __name__ == "__main__":
    main()
