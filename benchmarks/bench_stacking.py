"""When does running identical models as one batched model pay, by thread budget and batch?

For 16 identical MLPs of width 256 (batch 64, 256, 1024) and 64 identical tiny MLPs, at each
intra-op thread count: the plain loop, vmap over ``torch.func.stack_module_state`` (its stacked
copies are the leaves), parsum's default, parsum with ``engine="stacked"`` (stacked on every
call, no ``stack_`` storage) and with ``engine="autograd"`` (one by one). ``engine="auto"``
batches identical models up to a size limit in parameter-rows (NOTE [ Stacked groups ]); this
is the measurement that limit should follow.

    python benchmarks/bench_stacking.py [--threads 1,2] [--rounds 8] [--device cpu]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from common import interleaved, parsum_step, plain_step, synchronized, vmap_step, workload

CASES = [
    ("identical-medium", 64),
    ("identical-medium", 256),
    ("identical-medium", 1024),
    ("identical-tiny", None),
]


def methods_for(models: list[torch.nn.Module], x: torch.Tensor) -> dict[str, Callable[[], None]]:
    batched = vmap_step(models)
    return {
        "plain": lambda: plain_step(models, x),
        "vmap": lambda: batched(x),
        "default": lambda: parsum_step(models, x),
        "stacked": lambda: parsum_step(models, x, engine="stacked"),
        "autograd": lambda: parsum_step(models, x, engine="autograd"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="intra-op thread counts")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print(f"torch {torch.__version__}; medians of {args.rounds} interleaved rounds, ms a step")
    for name, batch in CASES:
        w = workload(name, batch)
        models, x = [m.to(args.device) for m in w.models], w.x.to(args.device)
        synced = methods_for(models, x)
        if args.device != "cpu":
            synced = {k: synchronized(fn) for k, fn in synced.items()}
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            found = interleaved(synced, args.rounds)
            row = " ".join(f"{k} {v * 1e3:.2f}" for k, v in found.items())
            print(f"{name} batch {batch or 'default'}, {threads} threads: {row}", flush=True)


if __name__ == "__main__":
    main()
