"""Train a heterogeneous ensemble of MLPs on scikit-learn's digits with parsum.

The ensemble's prediction is the average of its members' logits,
``parsum.sum_models(models, x, weights=[1/M] * M)``. The same ensemble, from the same initial
weights and on the same batches, is also trained with the plain PyTorch loop
``sum(w * m(x) for ...)``. The two train in lockstep, one step of each in turn (which goes first
alternates), each step timed on its own: a machine whose speed drifts slows both alike. The
script prints the test accuracy of each, the time per epoch and parsum's speedup, and where
the plain loop beats every split, says so.

A third copy runs the machine's ceiling in the same lockstep: the members split by hand over as
many threads as the thread budget (``torch.get_num_threads()``), each thread running the plain
loop on its share with one intra-op thread and its own optimizer, with no sum: each member is
trained on its own loss, so its accuracy is not the ensemble's, but its step does the same
forward, backward and optimizer work. parsum's time is printed against it too.

    python examples/train_ensemble.py [--members 12] [--epochs 6] [--batch-size 64]
"""

from __future__ import annotations

import argparse
import copy
import queue
import statistics
import threading
import time

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from tqdm import tqdm

import parsum


def make_member(i: int, n_in: int, n_out: int) -> nn.Module:
    """Member i: widths from 64 to 512 and depths from 1 to 3 hidden layers, two activations."""
    width = (64, 128, 256, 384, 512)[i % 5]
    depth = 1 + i % 3
    act = (nn.ReLU, nn.GELU)[i % 2]
    layers: list[nn.Module] = []
    dims = [n_in] + [width] * depth
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), act()]
    return nn.Sequential(*layers, nn.Linear(width, n_out))


def load_data(seed: int) -> tuple[torch.Tensor, ...]:
    x, y = load_digits(return_X_y=True)
    x = x / 16.0  # pixel values are 0..16
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.long)  # noqa: E731
    return as_x(x_tr), as_y(y_tr), as_x(x_te), as_y(y_te)


def plain_ensemble(models, x, weights):
    return sum(w * m(x) for w, m in zip(weights, models))


def parsum_ensemble(models, x, weights):
    return parsum.sum_models(models, x, weights=weights)


class Trainer:
    """One copy of the ensemble, its optimizer, and the time its steps took."""

    def __init__(self, forward, models, lr: float) -> None:
        self.forward = forward
        self.models = models
        self.weights = [1.0 / len(models)] * len(models)
        self.opt = torch.optim.Adam([p for m in models for p in m.parameters()], lr=lr)
        self.loss_fn = nn.CrossEntropyLoss()
        self.seconds = 0.0
        self.loss = 0.0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        start = time.perf_counter()
        self.opt.zero_grad()
        loss = self.loss_fn(self.forward(self.models, x, self.weights), y)
        loss.backward()
        self.opt.step()
        self.seconds += time.perf_counter() - start
        self.loss = loss.detach().item()

    def accuracy(self, x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.no_grad():
            return (self.forward(self.models, x, self.weights).argmax(1) == y).float().mean().item()


class HandSplitTrainer:
    """The ceiling: the members split over threads, each thread training its share with the
    plain loop (one intra-op thread, its own optimizer), each member on its own loss."""

    def __init__(self, models, lr: float, threads: int) -> None:
        self.models = models
        self.shares = [models[p::threads] for p in range(threads)]
        self.opts = [
            torch.optim.Adam([p for m in share for p in m.parameters()], lr=lr)
            for share in self.shares
        ]
        self.loss_fn = nn.CrossEntropyLoss()
        self.seconds = 0.0
        self.loss = 0.0
        self.tasks: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in self.shares[1:]]
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        for p, tasks in enumerate(self.tasks, start=1):
            threading.Thread(target=self._serve, args=(p, tasks), daemon=True).start()

    def _train_share(self, p: int, x: torch.Tensor, y: torch.Tensor) -> float:
        self.opts[p].zero_grad()
        loss = sum(self.loss_fn(m(x), y) for m in self.shares[p])
        loss.backward()  # type: ignore[union-attr]
        self.opts[p].step()
        return float(loss.detach())

    def _serve(self, p: int, tasks: queue.SimpleQueue) -> None:
        # A new thread takes its intra-op count at its first parallel op (get_num_threads counts
        # as one) from whichever thread set one last: asked for first, the 1 set here stays.
        # Else the caller's restoring its count could give this thread an OpenMP team of its
        # own, and a process with more OpenMP threads than cores slows every thread's ops.
        torch.get_num_threads()
        torch.set_num_threads(1)
        while True:
            x, y = tasks.get()
            self._train_share(p, x, y)
            self.done.put(None)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        start = time.perf_counter()
        for tasks in self.tasks:
            tasks.put((x, y))
        saved = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self.loss = self._train_share(0, x, y) / len(self.shares[0])
        finally:
            torch.set_num_threads(saved)
        for _ in self.tasks:
            self.done.get()
        self.seconds += time.perf_counter() - start


def train(trainers: dict[str, Trainer], data, args) -> dict[str, list[float]]:
    """Train every trainer on the same batches, one step of each in turn; seconds per epoch."""
    x_tr, y_tr, _, _ = data
    order = torch.Generator().manual_seed(args.seed)
    epoch_times: dict[str, list[float]] = {name: [] for name in trainers}
    turns = list(trainers.values())
    for epoch in range(args.epochs):
        perm = torch.randperm(len(x_tr), generator=order)
        for t in turns:
            t.seconds = 0.0
        bar = tqdm(  # in a terminal; a log or pipe gets no progress lines (disable=None)
            perm.split(args.batch_size),
            desc=f"epoch {epoch + 1}/{args.epochs}",
            leave=False,
            disable=None,
        )
        for k, idx in enumerate(bar):
            for t in turns if k % 2 == 0 else turns[::-1]:
                t.step(x_tr[idx], y_tr[idx])
            bar.set_postfix({f"{name} loss": f"{t.loss:.3f}" for name, t in trainers.items()})
        for name, t in trainers.items():
            epoch_times[name].append(t.seconds)
    return epoch_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    data = load_data(args.seed)
    torch.manual_seed(args.seed)
    n_in, n_out = data[0].shape[1], int(data[1].max()) + 1
    models = [make_member(i, n_in, n_out) for i in range(args.members)]
    n_params = sum(p.numel() for m in models for p in m.parameters())
    print(
        f"digits: {len(data[0])} train / {len(data[2])} test images; ensemble of "
        f"{args.members} MLPs ({n_params:,} parameters); batch {args.batch_size}; "
        f"{torch.get_num_threads()} intra-op threads, {parsum._config.usable_cores()} cores"
    )

    # Same initial weights, same batches: only the way the sum is computed differs.
    # No more threads than members: a thread with no share would have nothing to train.
    threads = min(parsum._config.thread_budget(), args.members)
    split = f"hand split, {threads} threads"
    trainers = {
        "plain": Trainer(plain_ensemble, copy.deepcopy(models), args.lr),
        "parsum": Trainer(parsum_ensemble, copy.deepcopy(models), args.lr),
        split: HandSplitTrainer(copy.deepcopy(models), args.lr, threads),
    }
    epoch_times = train(trainers, data, args)  # type: ignore[arg-type]

    width = max(len(name) for name in trainers) + 2
    print(f"{'':{width}}{'test accuracy':>15}{'s / epoch (median)':>21}")
    for name, t in trainers.items():
        shown = f"{t.accuracy(data[2], data[3]):.4f}" if isinstance(t, Trainer) else "(members)"
        print(f"{name:{width}}{shown:>15}{statistics.median(epoch_times[name]):>21.3f}")
    # The first epoch includes warm-up (thread start, allocator): medians skip its effect.
    median = {name: statistics.median(times) for name, times in epoch_times.items()}
    speedup = median["plain"] / median["parsum"]
    print(
        f"parsum against the {split} (the ceiling, no sum): {median[split] / median['parsum']:.2f}x"
    )
    print(f"parsum speedup over the plain PyTorch loop: {speedup:.2f}x")
    if median[split] > median["plain"] and speedup < 1:
        # What the ceiling says then: no split of these members over threads beats the plain
        # loop's own intra-op threads, so the plain loop is the ceiling (docs/benchmarks.md).
        print(
            f"(the plain loop on {torch.get_num_threads()} intra-op threads beat the {split} by "
            f"{median[split] / median['plain']:.2f}x: no split of these members over threads "
            "pays here, so the plain loop is the ceiling, and parsum's gap to it is its "
            "per-call cost)"
        )


if __name__ == "__main__":
    main()
