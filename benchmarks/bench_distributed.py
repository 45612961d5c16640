"""Does spreading the models over processes pay on this machine? 1 against 2 processes.

A training step (forward and backward of the loss of the sum) of a workload from
``common.workload``, timed:

    plain          the plain loop in one process, PyTorch's default threads
    parsum         parsum.sum_models in one process, default settings
    dist-1         parsum.distributed.sum_models, 1 process (gloo), default settings
    dist-P         parsum.distributed.sum_models, P processes on 127.0.0.1 (gloo), the models
                   split round robin, each process with cores // P intra-op threads and workers

Processes are started with torch.multiprocessing (spawn), as torchrun would; each times
--rounds steps after a warm-up, in step with the others (the collectives keep them so), and
rank 0 reports the median. Ratios are "plain / this", measured in this one run.

    python benchmarks/bench_distributed.py [--workloads heterogeneous-medium,large]
        [--procs 2] [--batch 64] [--rounds 30]
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import interleaved, loss_of, plain_step, workload

import parsum


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, name: str, batch: int, rounds: int, out) -> None:
    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // world))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    w = workload(name, batch)
    mine = w.models[rank::world]
    n_jobs = max(1, cores // world)

    def step() -> None:
        loss_of(parsum.distributed.sum_models(mine, w.x, n_jobs=n_jobs)).backward()

    for _ in range(3):
        step()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def distributed_time(world: int, name: str, batch: int, rounds: int) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(_rank, args=(world, free_port(), name, batch, rounds, out), nprocs=world)
    return out.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="heterogeneous-medium,large")
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    print(f"ms per training step (median of {args.rounds}); plain / this in brackets")
    print(f"{'workload':48s}{'plain':>10}{'parsum':>16}{'dist-1':>16}{f'dist-{args.procs}':>16}")
    for name in args.workloads.split(","):
        w = workload(name, args.batch)
        local = interleaved(
            {
                "plain": lambda w=w: plain_step(w.models, w.x),
                "parsum": lambda w=w: loss_of(parsum.sum_models(w.models, w.x)).backward(),
            },
            args.rounds,
        )
        one = distributed_time(1, name, args.batch or w.x.shape[0], args.rounds)
        many = distributed_time(args.procs, name, args.batch or w.x.shape[0], args.rounds)
        plain = local["plain"]
        cells = [f"{plain * 1e3:10.2f}"] + [
            f"{t * 1e3:9.2f} ({plain / t:.2f})" for t in (local["parsum"], one, many)
        ]
        print(f"{w.description:48s}{''.join(cells)}")


if __name__ == "__main__":
    main()
