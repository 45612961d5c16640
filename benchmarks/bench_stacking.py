"""When does running identical models as one batched model pay, by thread budget and batch?

For groups of identical MLPs (16 of widths 128-1024 at batches 16-1024, 32 of width 64, 64 tiny
ones), at each intra-op thread count: the plain loop, vmap over
``torch.func.stack_module_state`` (its stacked copies are the leaves), parsum's default,
parsum with ``engine="stacked"`` (stacked on every call), and the same two over models in
``parsum.stack_`` storage. ``engine="auto"`` batches identical models up to a size in
parameter-rows (parameters times batch rows, printed for each case), a lower one for groups it
stacks on every call (NOTE [ Stacked groups ]) than for models in stack_ storage (NOTE
[ Stacked storage sizes ]): where ``default`` differs from ``stacked`` (or ``stack_ default``
from ``stack_ stacked``), auto ran the models one by one, and the faster of the two says
whether that was right.

    python benchmarks/bench_stacking.py [--threads 1,2] [--rounds 8] [--device cpu] [--quick]
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable

import torch
from common import interleaved, loss_of, mlp, parsum_step, plain_step, synchronized, vmap_step

import parsum

# (models, width, depth, batch); inputs of 64 features, 10 outputs.
CASES = [
    (16, 256, 2, 64),
    (16, 256, 2, 256),
    (16, 256, 2, 1024),
    (16, 128, 2, 256),
    (16, 128, 2, 1024),
    (16, 512, 1, 256),
    (16, 512, 1, 1024),
    (32, 64, 2, 1024),
    (8, 1024, 1, 256),
    (8, 1024, 1, 1024),
]
QUICK = [(16, 256, 2, 64), (16, 256, 2, 256), (16, 512, 1, 1024)]
TINY = (64, 32, 2, 32)  # identical-tiny, 16 inputs and 4 outputs


def methods_for(models: list[torch.nn.Module], x: torch.Tensor) -> dict[str, Callable[[], None]]:
    batched = vmap_step(models)
    stored = copy.deepcopy(models)
    stack_params = list(parsum.stack_(stored).parameters())

    def in_storage(**kwargs: object) -> Callable[[], None]:
        def step() -> None:
            for p in stack_params:  # as optimizer.zero_grad() over the stack does
                p.grad = None
            loss_of(parsum.sum_models(stored, x, **kwargs)).backward()

        return step

    return {
        "plain": lambda: plain_step(models, x),
        "vmap": lambda: batched(x),
        "default": lambda: parsum_step(models, x),
        "stacked": lambda: parsum_step(models, x, engine="stacked"),
        "stack_ default": in_storage(),
        "stack_ stacked": in_storage(engine="stacked"),
    }


def case(n: int, width: int, depth: int, batch: int, device: str):
    torch.manual_seed(0)
    n_in, n_out = (16, 4) if (n, width, depth, batch) == TINY else (64, 10)
    models = [mlp(n_in, width, depth, n_out).to(device) for _ in range(n)]
    x = torch.randn(batch, n_in, device=device)
    rows = sum(p.numel() for p in models[0].parameters()) * batch
    return (
        f"{n}x width {width} depth {depth} batch {batch} ({rows / 1e6:.2f}M param-rows)",
        models,
        x,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="intra-op thread counts")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="three cases only")
    args = parser.parse_args()
    print(f"torch {torch.__version__}; medians of {args.rounds} interleaved rounds, ms a step")
    for spec in [*(QUICK if args.quick else CASES), TINY]:
        label, models, x = case(*spec, args.device)
        synced = methods_for(models, x)
        if args.device != "cpu":
            synced = {k: synchronized(fn) for k, fn in synced.items()}
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            found = interleaved(synced, args.rounds)
            row = " ".join(f"{k} {v * 1e3:.2f}" for k, v in found.items())
            best = min(found, key=found.__getitem__)
            print(f"{label}, {threads} threads: {row} | fastest: {best}", flush=True)


if __name__ == "__main__":
    main()
