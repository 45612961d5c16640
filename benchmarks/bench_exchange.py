"""What one exchange between processes on this host costs inside a training loop: torch and gloo
alone, and parsum.distributed's shared-memory exchange, so that the processes' rows of
bench_speedup.py can be read against it.

P processes (spawned, gloo on 127.0.0.1, budget / P intra-op threads each, as torchrun runs
them) each loop: about --compute-ms of matmuls on their threads (the share of a step's work),
then one ``all_gather`` of --bytes (parsum.distributed's one exchange a forward: a status and
the rank's sum; 64 rows of 10 float32 outputs are 2.6 KB). Rows:

  compute only   the loop without the exchange: what P processes would take with no exchange
  gloo           with the exchange, each rank waiting in ``all_gather``
  gloo pinned    the same, each rank (and gloo's threads, which it starts) bound to cores of
                 its own, budget / P of them (``os.sched_setaffinity`` before the group exists)
  shared memory  parsum.distributed's exchange on one host (parsum._host_exchange): each rank
                 writes its bytes and then the call's number into its slot of a file in
                 /dev/shm that every rank maps, and waits until every slot holds that number
                 (where this host can take that way: x86-64 Linux)

For each, in ms: a step (compute and exchange, the slowest rank's mean over its loop), the
exchange's mean, median and 90th percentile over every rank's, and the share of exchanges that
took over --stall-ms (on 2 cores, 2 processes: about 4 ms, a scheduler tick).

    python benchmarks/bench_exchange.py [--procs 2] [--compute-ms 3] [--steps 300]
        [--bytes 2624] [--stall-ms 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import _free_port, join_local_gloo

from parsum import _host_exchange


def _matmuls_for(ms: float) -> int:
    """How many 128 x 128 matmuls take about ``ms`` on this thread's intra-op threads."""
    a = torch.randn(128, 128)
    for _ in range(20):
        a @ a
    n = 200
    start = time.perf_counter()
    for _ in range(n):
        a @ a
    each = (time.perf_counter() - start) / n
    return max(1, round(ms / 1e3 / each))


def _rank(rank: int, args: argparse.Namespace, world: int, mode: str, port: int, out) -> None:
    threads = max(1, args.budget // world)
    if mode == "gloo pinned":  # before the group: gloo's threads inherit the binding
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cores[rank * threads : (rank + 1) * threads] or cores[-1:])
    torch.set_num_threads(threads)
    join_local_gloo(rank, world, port, 120)
    try:
        a = torch.randn(128, 128)
        n = _matmuls_for(args.compute_ms)
        mine = torch.zeros(args.bytes, dtype=torch.uint8)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        shared = None
        if mode == "shared memory":  # parsum.distributed's slots (NOTE [ Exchanges on one host ])
            shared = _host_exchange.make_slots(None, rank, world, args.bytes)
            assert shared is not None, "this host cannot take the shared-memory way"
        dist.barrier()
        rows = []
        for _ in range(args.steps):
            start = time.perf_counter()
            for _ in range(n):
                a @ a
            computed = time.perf_counter()
            if shared is not None:
                shared.all_gather(mine)
            elif mode != "compute only":
                dist.all_gather(gathered, mine)
            rows.append((computed - start, time.perf_counter() - computed))
        out.put((rank, rows[args.steps // 10 :]))  # the first tenth: warm-up
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, world: int, mode: str) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, args, world, mode, port, out)) for r in range(world)
    ]
    for p in procs:
        p.start()
    per_rank = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    waits = [w for rows in per_rank.values() for _, w in rows]
    return {
        # a rank's whole loop over its steps: the slowest rank's
        "step mean": max(sum(map(sum, rows)) / len(rows) for rows in per_rank.values()) * 1e3,
        "exchange mean": statistics.fmean(waits) * 1e3,
        "exchange median": statistics.median(waits) * 1e3,
        "exchange p90": sorted(waits)[int(0.9 * len(waits))] * 1e3,
        "stalled": sum(w * 1e3 > args.stall_ms for w in waits) / len(waits),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", default="2", help="process counts, e.g. 2,4,8,16")
    parser.add_argument("--budget", type=int, default=torch.get_num_threads())
    parser.add_argument("--compute-ms", type=float, default=3.0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--bytes", type=int, default=2624)
    parser.add_argument("--stall-ms", type=float, default=2.0)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {len(os.sched_getaffinity(0))} usable cores, budget "
        f"{args.budget} threads; {args.steps} steps of about {args.compute_ms:g} ms of matmuls "
        f"a rank, then an all_gather of {args.bytes} bytes; ms, step = the slowest rank's"
    )
    print(
        f"{'procs':>5} {'mode':>13} {'step':>7} {'exchange':>9} {'median':>7} {'p90':>6} "
        f"{'stalled':>8}"
    )
    for world in (int(p) for p in args.procs.split(",")):
        modes = ["compute only", "gloo", "gloo pinned"]
        if _host_exchange.supported():
            modes.append("shared memory")
        for mode in modes:
            r = run(args, world, mode)
            print(
                f"{world:>5} {mode:>13} {r['step mean']:7.2f} {r['exchange mean']:9.2f} "
                f"{r['exchange median']:7.2f} {r['exchange p90']:6.2f} {r['stalled']:8.0%}"
            )


if __name__ == "__main__":
    main()
