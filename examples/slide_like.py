"""A SLIDE-style classifier: each sample activates a few neurons of a wide layer, chosen by hashing.

scikit-learn's digits (shipped inside the package: 1797 images of 8x8 pixels, 10 classes). The
network has one wide hidden layer of H neurons (``--hidden``, 262144 by default). As in SLIDE, a
sample does not run all of them: a SimHash of the sample (signs of a random projection) picks
the ``--active`` neurons whose weight vectors hash nearest to it, and only those rows of the
hidden and output weight tables take part, through ``parsum.take_rows``. The gradients of the
tables are row-sparse, so a step costs in proportion to the active rows, not to H.

SLIDE looks neurons up in several hash tables; here each table is one model, and the ensemble
``parsum.sum_models(tables, x, weights=[1/L] * L)`` averages their logits. The L models share
the weight tables: their row-sparse gradients are summed by parsum without densifying. The
neuron hash codes are rebuilt from the current weights at the start of every epoch.

Compared, from the same initial weights and on the same batches, each timed in this one run:
    sampled (parsum)   L hash-table models summed by parsum.sum_models, SparseAdam
    sampled (W[idx])   the same models in the plain loop, indexing W[idx] (dense gradients), Adam
    dense              the full network, all H neurons for every sample, Adam

    python examples/slide_like.py [--hidden 262144] [--active 64] [--tables 4] [--epochs 5]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import parsum

BITS = 16


class Network(nn.Module):
    """The weights: H hidden neurons (their input weights and biases as rows of tables) and the
    output layer, stored with one row per hidden neuron so that sampled neurons are rows."""

    def __init__(self, n_in: int, hidden: int, n_out: int, active: int) -> None:
        super().__init__()
        self.scale = active / hidden  # all neurons add up to about what the active ones do
        self.w_in = nn.Parameter(torch.randn(hidden, n_in) / n_in**0.5)
        self.b_in = nn.Parameter(torch.zeros(hidden, 1))
        self.w_out = nn.Parameter(torch.randn(hidden, n_out) / active**0.5)
        self.b_out = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The dense network: every neuron for every sample."""
        h = torch.relu(x @ self.w_in.T + self.b_in.T)
        return h @ self.w_out * self.scale + self.b_out


class HashTable(nn.Module):
    """One SimHash table over the network's neurons; forward runs the neurons it picks."""

    def __init__(self, net: Network, active: int, seed: int, dense_grads: bool = False) -> None:
        super().__init__()
        self.net = net
        self.active = active
        self.dense_grads = dense_grads
        generator = torch.Generator().manual_seed(seed)
        self.register_buffer(
            "projection", torch.randn(net.w_in.shape[1], BITS, generator=generator)
        )
        self.register_buffer("powers", 2 ** torch.arange(BITS))
        self.register_buffer("window", torch.arange(active) - active // 2)
        self.rebuild()

    def codes(self, v: torch.Tensor) -> torch.Tensor:
        return ((v @ self.projection > 0).long() * self.powers).sum(-1)

    @torch.no_grad()
    def rebuild(self) -> None:
        """Sort the neurons by the hash of their current input weights."""
        self.sorted_codes, self.order = torch.sort(self.codes(self.net.w_in))

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """Per sample, the ``active`` neurons whose codes sort nearest to the sample's code."""
        at = torch.searchsorted(self.sorted_codes, self.codes(x))
        return self.order[(at.unsqueeze(1) + self.window) % self.order.numel()]

    def take(self, table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return table[idx] if self.dense_grads else parsum.take_rows(table, idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = self.rows(x)  # (batch, active), from the values of x
        w_in, b_in = self.take(self.net.w_in, idx), self.take(self.net.b_in, idx)
        h = torch.relu(torch.einsum("bi,bsi->bs", x, w_in) + b_in.squeeze(2))
        return torch.einsum("bs,bsc->bc", h, self.take(self.net.w_out, idx)) + self.net.b_out


def load_data(seed: int) -> tuple[torch.Tensor, ...]:
    x, y = load_digits(return_X_y=True)
    x = x / 16.0 - 0.5  # centred pixels: the hash of a sample depends on its pattern
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.long)  # noqa: E731
    return as_x(x_tr), as_y(y_tr), as_x(x_te), as_y(y_te)


def run(
    name: str,
    forward: Callable[[torch.Tensor], torch.Tensor],
    optimizers: list[torch.optim.Optimizer],
    epoch_start: Callable[[], None],
    data: tuple[torch.Tensor, ...],
    args: argparse.Namespace,
) -> tuple[float, float]:
    """Train; return the median seconds per epoch and the final test accuracy."""
    x_tr, y_tr, x_te, y_te = data
    generator = torch.Generator().manual_seed(args.seed)
    epoch_times = []
    for _ in range(args.epochs):
        start = time.perf_counter()
        epoch_start()
        for batch in torch.randperm(len(x_tr), generator=generator).split(args.batch_size):
            loss = nn.functional.cross_entropy(forward(x_tr[batch]), y_tr[batch])
            loss.backward()
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
        epoch_times.append(time.perf_counter() - start)
    with torch.no_grad():
        accuracy = (forward(x_te).argmax(1) == y_te).float().mean().item()
    seconds = statistics.median(epoch_times)
    print(f"{name:18s} test accuracy {accuracy:.4f}   {seconds * 1e3:8.1f} ms per epoch")
    return seconds, accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=262144)
    parser.add_argument("--active", type=int, default=64)
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    data = load_data(args.seed)
    torch.manual_seed(args.seed)
    net = Network(data[0].shape[1], args.hidden, 10, args.active)
    print(
        f"digits: {len(data[0])} train / {len(data[2])} test; {args.hidden} hidden neurons, "
        f"{args.active} active per sample in each of {args.tables} hash tables"
    )

    def sampled(dense_grads: bool) -> tuple[float, float]:
        own = copy.deepcopy(net)
        tables = [
            HashTable(own, args.active, seed, dense_grads=dense_grads)
            for seed in range(args.tables)
        ]
        weights = [1.0 / len(tables)] * len(tables)
        tables_params = [own.w_in, own.b_in, own.w_out]
        if dense_grads:
            forward = lambda x: sum(w * t(x) for w, t in zip(weights, tables))  # noqa: E731
            optimizers = [torch.optim.Adam(own.parameters(), lr=args.lr)]
            name = "sampled (W[idx])"
        else:
            forward = lambda x: parsum.sum_models(tables, x, weights=weights)  # noqa: E731
            optimizers = [
                torch.optim.SparseAdam(tables_params, lr=args.lr),
                torch.optim.Adam([own.b_out], lr=args.lr),
            ]
            name = "sampled (parsum)"

        def epoch_start() -> None:
            for t in tables:
                t.rebuild()

        return run(name, forward, optimizers, epoch_start, data, args)

    fast, fast_acc = sampled(dense_grads=False)
    slow, _ = sampled(dense_grads=True)
    full = copy.deepcopy(net)
    dense, dense_acc = run(
        "dense", full, [torch.optim.Adam(full.parameters(), lr=args.lr)], lambda: None, data, args
    )
    print(
        f"sampled with parsum: {slow / fast:.1f}x faster per epoch than the same sampling with "
        f"dense gradients, {dense / fast:.1f}x faster than the dense network "
        f"(accuracy {fast_acc:.4f} against {dense_acc:.4f})"
    )


if __name__ == "__main__":
    main()
