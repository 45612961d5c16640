"""Does a step on a few sampled rows of a large table cost in proportion to the rows touched?

A sampled layer (SLIDE's output layer in small): a batch of 16 vectors of 512 features picks 64
rows of a table of R x 512 by hashing its own values (signs of a random projection), scores
them (x @ rows.T) and takes a squared loss. One step is forward, backward and an SGD update of
the table, for R = 2^8 ... 2^16, at one intra-op thread:

    dense        rows = W[idx]: autograd's dense gradient of the whole table, W -= lr * W.grad
    embedding    nn.Embedding(sparse=True), then grad.coalesce() and W.index_add_(rows, -lr * g)
    take_rows    rows = parsum.take_rows(W, idx), then W -= lr * W.grad (dense += row-sparse)
    sgd          take_rows with torch.optim.SGD(lr) doing the update
    ens/model    an ensemble of --models such sampled models, each hashing with its own
                 projection, sharing one table, summed by parsum.sum_models (n_jobs=1), its
                 step time divided by the number of models
    ens-default  the same with n_jobs left to parsum (all cores)
    loop/model   the same ensemble as the plain loop sum(m(x) for m in models), per model

Every method runs once per round, for every table size, interleaved, after a warm-up (the dense
steps in a round robin of their own, with a tenth of the rounds); medians over the rounds,
ratios measured in this one process. Against embedding, each round's take_rows (or ens/model)
time is divided by the same round's embedding time; the table shows the median of those ratios
and a 95% bootstrap interval of it, so that noise is not read as a difference. "No slower at any
size" is one claim over every size, so its verdict uses intervals at 1 - 0.05 / sizes
(Bonferroni): with 95% intervals alone, one size in twenty would lie off 1.0 by chance at exact
parity. Targets (issue):
take_rows and ens/model grow by less than 1.5x from the smallest to the largest table, and are
no slower than embedding at any size.

    python benchmarks/bench_sparse.py [--rounds 600] [--models 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
from common import interleaved, interleaved_rounds, paired_ratio
from torch import nn

import parsum

COLS, SAMPLED, BATCH, BITS = 512, 64, 16, 16


class SampledLayer(nn.Module):
    """Scores the 64 rows of ``table`` that the hash of the batch picks."""

    def __init__(self, table: nn.Parameter, seed: int, how: str = "take_rows") -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.table = table
        self.register_buffer("projection", torch.randn(COLS, BITS, generator=generator))
        self.register_buffer("powers", 2 ** torch.arange(BITS))
        self.register_buffer("stride", torch.arange(SAMPLED) * 40_503)
        self.how = how

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        code = ((x @ self.projection > 0).long() * self.powers).sum(1)  # SimHash per sample
        return (code[0] * 2_654_435_761 + self.stride) % self.table.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = self.rows(x.detach())
        rows = parsum.take_rows(self.table, idx) if self.how == "take_rows" else self.table[idx]
        return x @ rows.T


def loss_of(y: torch.Tensor) -> torch.Tensor:
    return y.square().mean()


def methods_for(n_rows: int, n_models: int, lr: float = 1e-3) -> dict[str, Callable[[], None]]:
    torch.manual_seed(0)
    x = torch.randn(BATCH, COLS)
    init = torch.randn(n_rows, COLS) * 0.01

    dense = SampledLayer(nn.Parameter(init.clone()), 0, how="index")

    def dense_step() -> None:
        loss_of(dense(x)).backward()
        with torch.no_grad():
            dense.table.add_(dense.table.grad, alpha=-lr)
        dense.table.grad = None

    emb = nn.Embedding(n_rows, COLS, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(init)
    hasher = SampledLayer(emb.weight, 0)

    def embedding_step() -> None:
        loss_of(x @ emb(hasher.rows(x)).T).backward()
        g = emb.weight.grad.coalesce()
        with torch.no_grad():
            emb.weight.index_add_(0, g.indices()[0], g.values(), alpha=-lr)
        emb.weight.grad = None

    sampled = SampledLayer(nn.Parameter(init.clone()), 0)

    def take_rows_step() -> None:
        loss_of(sampled(x)).backward()
        with torch.no_grad():
            sampled.table.add_(sampled.table.grad, alpha=-lr)
        sampled.table.grad = None

    with_sgd = SampledLayer(nn.Parameter(init.clone()), 0)
    sgd = torch.optim.SGD([with_sgd.table], lr=lr)

    def sgd_step() -> None:
        loss_of(with_sgd(x)).backward()
        sgd.step()
        sgd.zero_grad()

    def ensemble_step(use_parsum: bool, n_jobs: int | None = 1) -> Callable[[], None]:
        table = nn.Parameter(init.clone())
        models = [SampledLayer(table, seed) for seed in range(n_models)]

        def step() -> None:
            if use_parsum:
                y = parsum.sum_models(models, x, n_jobs=n_jobs)
            else:
                y = sum(m(x) for m in models)
            loss_of(y).backward()
            with torch.no_grad():
                table.add_(table.grad, alpha=-lr)
            table.grad = None

        return step

    return {
        "dense": dense_step,
        "embedding": embedding_step,
        "take_rows": take_rows_step,
        "sgd": sgd_step,
        "ens": ensemble_step(True),
        "ens-default": ensemble_step(True, n_jobs=None),
        "loop": ensemble_step(False),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=600)
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--min-log2", type=int, default=8)
    parser.add_argument("--max-log2", type=int, default=16)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    per_model = {"ens", "ens-default", "loop"}
    names = ["dense", "embedding", "take_rows", "sgd", "ens", "ens-default", "loop"]
    print(
        f"step time in ms (1 thread; batch {BATCH}, {SAMPLED} rows of {COLS} sampled; "
        f"ensembles of {args.models} models, per model)"
    )
    header = "".join(f"{n + ('/m' if n in per_model else ''):>14}" for n in names)
    print(f"{'rows':>7}{header}{'take/emb [95%]':>22}{'ens/emb [95%]':>22}")
    # Every size's methods in one round robin, so that drift of the machine over the run
    # cannot pass for growth with the table's size. The dense steps get a round robin of their
    # own: each writes a gradient of the whole table, which would flush the caches of the
    # methods run after it and time those cold.
    sizes = [2**log2 for log2 in range(args.min_log2, args.max_log2 + 1)]
    methods = {
        (n_rows, name): fn
        for n_rows in sizes
        for name, fn in methods_for(n_rows, args.models).items()
    }
    dense = {key: fn for key, fn in methods.items() if key[1] == "dense"}
    rounds = interleaved_rounds(
        {k: f for k, f in methods.items() if k not in dense}, args.rounds, 10
    )
    times = {key: statistics.median(ts) for key, ts in rounds.items()}
    times.update(interleaved(dense, max(args.rounds // 10, 5), 2))
    # "At every size" is one claim over all sizes: with a 95% interval per size, one size in
    # twenty lies off 1.0 by chance at exact parity. The verdict takes intervals at the level
    # that keeps the claim at 95% (Bonferroni over the sizes); the table shows 95% ones.
    family = 1 - 0.05 / len(sizes)
    results = []
    for n_rows in sizes:
        ms = {n: times[n_rows, n] * 1e3 / (args.models if n in per_model else 1) for n in names}
        # Ratios of the two steps timed in the same round, with the interval of their median.
        emb = rounds[n_rows, "embedding"]
        steps = {
            "take_rows": rounds[n_rows, "take_rows"],
            "ens": [t / args.models for t in rounds[n_rows, "ens"]],
        }
        ratios = {n: paired_ratio(ts, emb) for n, ts in steps.items()}
        for n, ts in steps.items():
            ratios[f"{n}_family"] = paired_ratio(ts, emb, 10_000, family)[1:]
        results.append({"rows": n_rows, **ms, "against_embedding": ratios})
        cells = "".join(f"{ms[n]:14.3f}" for n in names)
        shown = "".join(f"{r:10.3f} [{lo:.3f}, {hi:.3f}]" for r, lo, hi in map(ratios.get, steps))
        print(f"{n_rows:>7}{cells}{shown}")
    first, last = results[0], results[-1]
    print(f"growth from {first['rows']} to {last['rows']} rows (target < 1.5x for take_rows, ens):")
    print("  " + "  ".join(f"{n} {last[n] / first[n]:.2f}x" for n in names))
    print(
        "against embedding, per-round ratios (target <= 1.0 at every size; verdict with "
        f"{family:.1%} intervals, 95% for all {len(sizes)} sizes together):"
    )
    for n in ("take_rows", "ens"):
        per_size = [(r["rows"], r["against_embedding"]) for r in results]
        rows, highest = max(per_size, key=lambda t: t[1][n][0])
        ratio, lo, hi = highest[n]
        wlo, whi = highest[f"{n}_family"]
        slower = [size for size, r in per_size if r[f"{n}_family"][0] > 1.0]
        verdict = (
            f"slower at {slower} rows (interval above 1.0)"
            if slower
            else "not slower at any size (no interval above 1.0)"
        )
        print(
            f"  {n}: highest {ratio:.3f}x at {rows} rows, 95% [{lo:.3f}, {hi:.3f}], "
            f"{family:.1%} [{wlo:.3f}, {whi:.3f}]; {verdict}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"models": args.models, "rounds": args.rounds, "results": results}, f, indent=1
            )


if __name__ == "__main__":
    main()
