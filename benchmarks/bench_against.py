"""This checkout's parsum against the parsum of another git revision, in one process.

On a VM whose speed drifts from process to process (the plain loop's step here moved from 7.3
to 9.7 ms between runs of one afternoon), comparing two versions in alternating processes
needs many runs; in one process both see the same machine. The other revision's package is
copied out of git (``git archive``) and imported as ``parsum_base``, its own pool, plans and
threads beside this checkout's; each method steps its own copy of the models, the methods in
turn (``common.interleaved``), each after ``--settle-ms`` of untimed steps. A step is
forward, backward and, with ``--adam``, one ``torch.optim.Adam`` step on the caller's threads,
or with ``--sib`` a ``StepInBackward`` of Adam. ``--step grad-x`` times the forward and the
loss's gradient in the argument alone (``torch.autograd.grad(loss, x)``: adversarial examples,
saliency), ``--step eval`` the forward alone under ``torch.no_grad()`` (an ensemble's
evaluation or inference), ``--step train-x`` a training step whose argument needs a gradient
too (heads over features that a trunk before the sum made: ``backward()`` fills the
parameters' and x's),
``--step penalty`` a gradient-penalty step (the gradient in x with
``create_graph=True``, then the backward of the loss plus a penalty on it), ``--step grad-params``
the loss's gradient in the parameters by ``torch.autograd.grad`` (functional training loops,
optimizers that take gradients as values: nothing written to ``.grad``), ``--step accumulate``
a micro-batch's forward and backward into gradients that earlier micro-batches set (gradient
accumulation: every ``.grad`` set, never zeroed), ``--step flat`` docs/gradients.md's loop with
an L2 term: a ``FlatGrad`` over the models (none for the plain loop), the loss plus the
parameters' squares, ``.grad`` set to None after each backward (``zero_grad()``), ``--step
flat-zero`` the same FlatGrad zeroed in place after each backward (``FlatGrad.zero_()``; the
plain loop's ``.grad`` set to None), without the L2 term, ``--step flat-both`` the same with the
plain loop over a FlatGrad of its own too (this checkout's), zeroed the same way: what parsum
costs a user who keeps gradients in a flat buffer either way; ``--step flat-compensated`` is
flat-zero with a compensated FlatGrad (its backward through ``ParallelSum``). ``--members 0.75``
sums a new random draw of that share of the models every step (members dropped at random,
experts picked per batch: a set of models not seen before, most steps), the same draws for
every method. ``--first 16`` sums the first 16 models of each workload alone (fewer models of
the same kinds, where parsum's cost a call weighs more). ``--cpu-time`` times the CPU time of
every thread of the process instead (``time.process_time``): a step slower in time but not in
CPU time waits longer for the same work; one slower in both does more work.

    python benchmarks/bench_against.py --rev HEAD~3|FOLDER[,REV2,...] [--adam] [--sib] [--n-jobs 2]
        [--step train|eval|train-x|grad-x|grad-params|accumulate|penalty|flat|flat-zero|flat-both|
            flat-compensated]
        [--members 0.75] [--first 16] [--cpu-time] [--engine autograd] [--hooked]
        [--workloads heterogeneous-medium:64,heterogeneous-medium:256] [--rounds 20]
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import io
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from common import (
    Members,
    interleaved,
    loss_of,
    parameters_of,
    parsum_adam_step,
    parsum_sib_step,
    parsum_step,
    plain_adam_step,
    plain_step,
    workloads_of,
    zero_grads,
)

import parsum

ROOT = pathlib.Path(__file__).resolve().parent.parent


def import_revision(rev: str, into: pathlib.Path, name: str = "parsum_base") -> Any:
    """The ``parsum`` package of git revision ``rev``, or in folder ``rev`` (a lent machine's
    copy of the tree has no git history: ``git archive REV parsum | tar -x -C FOLDER`` there
    first), imported as ``name`` from a folder of its own under ``into``."""
    into = into / name
    into.mkdir()
    folder = pathlib.Path(rev) / "parsum"
    if folder.is_dir():
        shutil.copytree(folder, into / "parsum")
    else:
        archive = subprocess.run(
            ["git", "archive", rev, "parsum"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            extract_all(tar, into)
    (into / "parsum").rename(into / name)  # its imports are relative: it runs there
    sys.path.insert(0, str(into))
    return importlib.import_module(name)


def extract_all(tar: tarfile.TarFile, into: pathlib.Path) -> None:
    """Every member of ``tar`` into ``into``, through the data filter where Python has it."""
    if hasattr(tarfile, "data_filter"):  # Python 3.11.4 and later
        tar.extractall(into, filter="data")
    else:
        tar.extractall(into)


class Weighted:
    """A parsum package whose ``sum_models`` passes weights of a kind (``weights_of``)."""

    def __init__(self, package: Any, kind: str) -> None:
        self._package = package
        self._kind = kind
        self._logits: torch.Tensor | None = None  # "learned": a leaf of its own a package

    def __getattr__(self, name: str) -> Any:
        return getattr(self._package, name)

    def sum_models(self, models: list[torch.nn.Module], *args: Any, **kwargs: Any) -> Any:
        weights: Any = weights_of(self._kind, len(models))
        if self._kind == "tensor":
            weights = torch.tensor(weights)
        elif self._kind == "learned":
            if self._logits is None or len(self._logits) != len(models):
                self._logits = torch.tensor(weights).log().requires_grad_()
            self._logits.grad = None
            weights = torch.softmax(self._logits, 0)  # its gradient comes with the backward
        return self._package.sum_models(models, *args, weights=weights, **kwargs)


def masked(models: list[torch.nn.Module]) -> None:
    """``--hooked``: a tensor hook on each model's weights that masks every other element of
    their gradients (pruning's way), for every method alike."""
    for m in models:
        for name, p in m.named_parameters():
            if name.endswith("weight"):
                mask = (torch.arange(p.numel()).reshape(p.shape) % 2).to(p.dtype)
                p.register_hook(lambda g, mask=mask: g * mask)


class WithEngine:
    """A parsum package whose ``sum_models`` passes ``engine``."""

    def __init__(self, package: Any, engine: str) -> None:
        self._package = package
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._package, name)

    def sum_models(self, models: list[torch.nn.Module], *args: Any, **kwargs: Any) -> Any:
        return self._package.sum_models(models, *args, engine=self._engine, **kwargs)


def weights_of(kind: str, n_models: int) -> list[float]:
    """``--weights``: 1/M each, or M distinct ones (of one sign and about 1/M each), as floats
    (a tensor of them for "tensor", a softmax of their logits for "learned")."""
    if kind == "mean":
        return [1.0 / n_models] * n_models
    return [(1.0 + k / n_models) / n_models for k in range(n_models)]


def step_of(
    package: Any, models: list[torch.nn.Module], x: torch.Tensor, args: argparse.Namespace
) -> Callable[[], None]:
    """One training step with ``package.sum_models`` (the plain loop where it is None)."""
    if args.step in ("flat-zero", "flat-both", "flat-compensated"):
        flat = None
        if package is not None:
            flat = package.FlatGrad(models, compensated=args.step == "flat-compensated")
        elif args.step == "flat-both":
            flat = parsum.FlatGrad(models)
        return functools.partial(_zeroed_in_place, package, flat, models, x, args.n_jobs)
    if args.step == "flat" and package is not None:
        package.FlatGrad(models)
    if args.step != "train":
        total = _plain_total if package is None else package.sum_models
        step = {
            "eval": _evaluation,
            "train-x": _training_with_x,
            "grad-x": _gradient_in_x,
            "grad-params": _gradient_in_params,
            "accumulate": _micro_batch,
            "flat": _with_l2_term,
        }.get(args.step, _penalty_step)
        return functools.partial(step, total, models, x, args.n_jobs)
    if package is None:
        if args.adam or args.sib:
            return functools.partial(plain_adam_step(models), x)
        return functools.partial(plain_step, models, x)
    if args.sib:
        return functools.partial(parsum_sib_step(models, package, args.n_jobs), x)
    if args.adam:
        params = parameters_of(models)
        return functools.partial(parsum_adam_step(models, params, False, args.n_jobs, package), x)
    return functools.partial(parsum_step, models, x, package, n_jobs=args.n_jobs)


def synchronized(step: Callable[[], None]) -> Callable[[], None]:
    """``step``, then a wait for the GPU's work: timed as done, not as queued."""

    def run() -> None:
        step()
        torch.cuda.synchronize()

    return run


def _plain_total(models: list[torch.nn.Module], x: torch.Tensor, **_: Any) -> torch.Tensor:
    return sum(m(x) for m in models)  # type: ignore[return-value]


def _evaluation(total: Callable[..., Any], models: list, x: torch.Tensor, n_jobs: Any) -> None:
    with torch.no_grad():
        total(models, x, n_jobs=n_jobs)


def _training_with_x(total: Callable[..., Any], models: list, x: torch.Tensor, n_jobs: Any) -> None:
    zero_grads(models)
    x = x.detach().requires_grad_()
    loss_of(total(models, x, n_jobs=n_jobs)).backward()


def _gradient_in_x(total: Callable[..., Any], models: list, x: torch.Tensor, n_jobs: Any) -> None:
    x = x.detach().requires_grad_()
    torch.autograd.grad(loss_of(total(models, x, n_jobs=n_jobs)), x)


def _gradient_in_params(
    total: Callable[..., Any], models: list, x: torch.Tensor, n_jobs: Any
) -> None:
    params = parameters_of(models)
    torch.autograd.grad(loss_of(total(models, x, n_jobs=n_jobs)), params)


def _micro_batch(total: Callable[..., Any], models: list, x: torch.Tensor, n_jobs: Any) -> None:
    loss_of(total(models, x, n_jobs=n_jobs)).backward()  # .grad set by the steps before


def _with_l2_term(total: Callable[..., Any], models: list, x: torch.Tensor, n_jobs: Any) -> None:
    params = parameters_of(models)
    loss = loss_of(total(models, x, n_jobs=n_jobs)) + 1e-4 * sum(p.pow(2).sum() for p in params)
    loss.backward()
    zero_grads(models)  # .grad None: a FlatGrad's views come back at the next backward


def _zeroed_in_place(package: Any, flat: Any, models: list, x: torch.Tensor, n_jobs: Any) -> None:
    if package is None and flat is not None:
        loss_of(sum(m(x) for m in models)).backward()  # type: ignore[arg-type]
        flat.zero_()
    elif package is None:
        plain_step(models, x)
    else:
        loss_of(package.sum_models(models, x, n_jobs=n_jobs)).backward()
        flat.zero_()  # every .grad its view, zeroed


def _penalty_step(total: Callable[..., Any], models: list, x: torch.Tensor, n_jobs: Any) -> None:
    zero_grads(models)
    x = x.detach().requires_grad_()
    y = total(models, x, n_jobs=n_jobs)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    (loss_of(y) + (g.norm(dim=1) - 1).pow(2).mean()).backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rev",
        required=True,
        help="the git revision to compare against, or a folder holding its parsum package; "
        "several, comma-separated, each against this checkout in the same rounds (a bisection "
        "in one process); none: this checkout against the plain loop alone",
    )
    parser.add_argument("--adam", action="store_true", help="an Adam step after each call")
    parser.add_argument("--sib", action="store_true", help="Adam in a StepInBackward")
    parser.add_argument("--n-jobs", type=int, default=None)
    parser.add_argument(
        "--engine", choices=["auto", "autograd", "vjp", "stacked"], help="passed to sum_models"
    )
    parser.add_argument(
        "--hooked",
        action="store_true",
        help="a tensor hook masking half of each weight's gradient, on every method's models",
    )
    parser.add_argument(
        "--step",
        choices=[
            "train",
            "eval",
            "train-x",
            "grad-x",
            "grad-params",
            "accumulate",
            "penalty",
            "flat",
            "flat-zero",
            "flat-both",
            "flat-compensated",
        ],
        default="train",
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--settle-ms", type=float, default=20.0)
    parser.add_argument(
        "--members", type=float, default=None, help="the share of the models drawn each step"
    )
    parser.add_argument(
        "--workloads", default="heterogeneous-medium:64", help="name[:batch], comma-separated"
    )
    parser.add_argument("--first", type=int, default=None, help="the first N models alone")
    parser.add_argument(
        "--weights",
        choices=["none", "mean", "distinct", "tensor", "learned"],
        default="none",
        help="weights passed to sum_models: none, 1/M each (an ensemble's average), M "
        "distinct floats, those in a tensor, or a softmax of logits that need a gradient "
        "(learned weights); the plain loop stays unweighted",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the models and the argument are (cuda: every step synchronized before it "
        "is timed as done)",
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time the CPU time of all threads instead of the time that passed: more work a "
        "step, or the same work waiting longer",
    )
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    revs = [] if args.rev == "none" else args.rev.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        bases = [
            (rev, import_revision(rev, pathlib.Path(tmp), f"parsum_base{i}"))
            for i, rev in enumerate(revs)
        ]
        plain = "plain+adam" if args.adam or args.sib else "plain"
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
            f"{args.device}; this "
            f"checkout against {args.rev}; medians of {args.rounds} interleaved rounds"
            + ("; CPU time of all threads" if args.cpu_time else "")
            + ("" if args.members is None else f"; {args.members} of the models drawn a step")
        )
        for w in workloads_of(args.workloads):
            methods = {}
            packages = [(plain, None), ("this", parsum), *bases]
            chosen = w.models[: args.first]
            x = w.x.to(args.device)
            for label, pkg in packages:
                models = [m.to(args.device) for m in copy.deepcopy(chosen)]
                if args.hooked:
                    masked(models)
                if pkg is not None and args.weights != "none":
                    pkg = Weighted(pkg, args.weights)
                if pkg is not None and args.engine is not None:
                    pkg = WithEngine(pkg, args.engine)
                step = step_of(pkg, models, x, args)
                if args.members is not None:
                    step = Members(models, args.members).around(step)
                if torch.device(args.device).type == "cuda":
                    step = synchronized(step)
                methods[label] = step
            settle = args.settle_ms / 1e3
            seconds = interleaved(methods, args.rounds, settle_seconds=settle, clock=clock)
            shown = ", ".join(
                f"{label} {t * 1e3:.2f} ms ({seconds[plain] / t:.3f}x {plain})"
                for label, t in seconds.items()
            )
            against = "".join(
                f"; this / {rev} {seconds[rev] / seconds['this']:.3f}x" for rev in revs
            )
            which = "" if args.first is None else f" (the first {len(chosen)})"
            print(f"{w.description}{which}: {shown}{against}")


if __name__ == "__main__":
    main()
