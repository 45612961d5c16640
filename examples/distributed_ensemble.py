"""Train an ensemble spread over processes with parsum.distributed.sum_models.

    torchrun --nproc-per-node 2 examples/distributed_ensemble.py [--members 12] [--epochs 3]

Every rank builds the same members from the same seed and keeps its share,
``parsum.distributed.share(members, x)`` (parts of about equal cost); every rank sees the same
batches. The ensemble's prediction, the
average of all members' logits, is ``parsum.distributed.sum_models(mine, x, weights=...)``: the
same bits on every rank. Every rank computes the loss from it and calls backward, which gives
each rank's members their gradients; each rank steps only its own members. Rank 0 prints the
test accuracy and the time per epoch. On several hosts, run torchrun on each with ``--nnodes``,
``--node-rank`` and ``--rdzv-endpoint`` (see the README).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from train_ensemble import load_data, make_member

import parsum


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x_tr, y_tr, x_te, y_te = load_data(args.seed)
    torch.manual_seed(args.seed)
    members = [make_member(i, x_tr.shape[1], 10) for i in range(args.members)]
    mine = [members[i] for i in parsum.distributed.share(members, x_tr[: args.batch_size])]
    weights = [1.0 / len(members)] * len(mine)
    opt = torch.optim.Adam([p for m in mine for p in m.parameters()], lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed)  # the same batches on every rank
    epoch_times = []
    for _ in range(args.epochs):
        start = time.perf_counter()
        for batch in torch.randperm(len(x_tr), generator=generator).split(args.batch_size):
            logits = parsum.distributed.sum_models(mine, x_tr[batch], weights=weights)
            torch.nn.functional.cross_entropy(logits, y_tr[batch]).backward()
            opt.step()
            opt.zero_grad()
        epoch_times.append(time.perf_counter() - start)
    with torch.no_grad():
        logits = parsum.distributed.sum_models(mine, x_te, weights=weights)
    accuracy = (logits.argmax(1) == y_te).float().mean().item()
    if rank == 0:
        print(
            f"{world} processes, {len(members)} members ({len(mine)} on rank 0): test accuracy "
            f"{accuracy:.4f}, {statistics.median(epoch_times):.3f} s per epoch (median)"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
