"""Find the commit that made a step slower: many revisions' parsum in one process, in two passes.

A regression seen only on a lent machine (16 cores) needs its bisection there, in few calls, and
that machine's copy of the tree has no git history. ``prepare`` (here, with git) writes the
parsum package of every commit in a range that touched it, in order, into one compressed
archive to carry; ``run`` (there) unpacks it, times every ``--coarse``-th revision and the last
in one process (bench_against.py's interleaved rounds, each revision's package imported under a
name of its own with its own pool), then every revision between the two neighbours where the
step changed (the split with the largest rise of the mean log time after it over before it),
with those two again. Times are medians of single steps, each after
``--settle-ms`` of untimed ones; each line gives a revision's step against the first one's.
``decisions`` (anywhere, no timing) prints what each revision decides a step with ``--cores``
faked (joblib's count and the intra-op threads): the jobs its pool runs, their chunks, workers,
order and intra-op threads, each time they differ from the revision before; a slowdown on many
cores where every revision decides alike is in how the jobs run, not in what they are.

    python benchmarks/bisect_revs.py prepare 6c6f94c..HEAD build/revs.tar.xz
    python benchmarks/bisect_revs.py prepare 6c6f94c,ebce91c,HEAD build/few.tar.xz
    python benchmarks/bisect_revs.py run build/revs.tar.xz [--coarse 10] [--rounds 60]
        [--workloads heterogeneous-medium:64] [--n-jobs N]
    python benchmarks/bisect_revs.py decisions build/revs.tar.xz [--cores 16] [--steps 6]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import math
import pathlib
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from typing import Any

import joblib
import torch
from bench_against import ROOT, extract_all, import_revision
from common import interleaved, parsum_step, workloads_of


def prepare(revisions: str, archive: pathlib.Path) -> None:
    """The parsum package of the range's first commit and of each later one that changed it,
    as ``NNN-SHA/parsum`` folders in ``archive``; or of each commit of a comma-separated list,
    in its order (a check of a few revisions, each with ``run --coarse 1``)."""
    if "," in revisions:
        shas = [_short(rev) for rev in revisions.split(",")]
    else:
        first = revisions.split("..")[0]
        later = subprocess.run(
            ["git", "log", "--reverse", "--format=%h", revisions, "--", "parsum"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        shas = [first, *later]
    with tarfile.open(archive, "w:xz") as out:
        for i, sha in enumerate(shas):
            tree = subprocess.run(
                ["git", "archive", sha, "parsum"], cwd=ROOT, capture_output=True, check=True
            ).stdout
            with tarfile.open(fileobj=io.BytesIO(tree)) as tar:
                for member in tar.getmembers():
                    member.name = f"{i:03d}-{sha}/{member.name}"
                    data = tar.extractfile(member) if member.isfile() else None
                    out.addfile(member, data)
    print(f"{len(shas)} revisions of parsum in {archive}")


def _short(rev: str) -> str:
    """``rev``'s abbreviated commit (``HEAD``, ``abc123^`` are no folder names)."""
    return subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def measure(
    folders: list[pathlib.Path], into: pathlib.Path, args: argparse.Namespace, imported: dict
) -> dict[str, dict[str, float]]:
    """Each workload's median step of each revision in ``folders``, in one set of rounds."""
    for folder in folders:
        if folder.name not in imported:
            imported[folder.name] = imported_revision(folder, into)
    times = {}
    for w in workloads_of(args.workloads):
        methods = {}
        for folder in folders:
            models = copy.deepcopy(w.models)
            package = imported[folder.name]
            methods[folder.name] = functools.partial(
                parsum_step, models, w.x, package, n_jobs=args.n_jobs
            )
        seconds = interleaved(methods, args.rounds, settle_seconds=args.settle_ms / 1e3)
        first = seconds[folders[0].name]
        print(w.description)
        for label, t in seconds.items():
            print(f"  {label}: {t * 1e3:.2f} ms, {t / first:.3f}x the first's time")
        times[w.description] = seconds
    return times


def change_point(folders: list[pathlib.Path], times: dict[str, dict[str, float]]) -> int:
    """The k that splits ``folders`` where the mean log step time after it exceeds the mean
    before it the most, averaged over the workloads: a step change stands out of single-step
    noise of a few percent that picking the largest jump between neighbours would follow.
    Printed with that rise, to hold against the noise between neighbours."""
    logs = [[math.log(seconds[f.name]) for f in folders] for seconds in times.values()]

    def rise(k: int) -> float:
        return statistics.fmean(statistics.fmean(t[k:]) - statistics.fmean(t[:k]) for t in logs)

    k = max(range(1, len(folders)), key=rise)
    print(
        f"change point: {folders[k - 1].name} | {folders[k].name}, the steps after it "
        f"{math.exp(rise(k)):.3f}x as long as before it"
    )
    return k


@contextlib.contextmanager
def unpacked(archive: pathlib.Path) -> Iterator[tuple[pathlib.Path, list[pathlib.Path]]]:
    """A temporary folder, and the revisions' folders in order, unpacked under it."""
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        with tarfile.open(archive) as tar:
            extract_all(tar, root / "revs")
        yield root, sorted((root / "revs").iterdir())


def imported_revision(folder: pathlib.Path, root: pathlib.Path) -> Any:
    """The parsum package in ``folder``, imported under a name of its own."""
    return import_revision(str(folder), root, "parsum_r" + folder.name.replace("-", "_"))


def run(args: argparse.Namespace) -> None:
    with unpacked(args.archive) as (root, every):
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads; "
            f"{len(every)} revisions, medians of {args.rounds} interleaved rounds"
        )
        imported: dict[str, Any] = {}
        coarse = every[:: args.coarse]
        if coarse[-1] != every[-1]:
            coarse.append(every[-1])
        print(f"coarse pass: {len(coarse)} revisions")
        times = measure(coarse, root, args, imported)
        k = change_point(coarse, times)
        start, stop = every.index(coarse[k - 1]), every.index(coarse[k])
        fine = every[start : stop + 1]
        print(f"fine pass: {coarse[k - 1].name} to {coarse[k].name}, {len(fine)} revisions")
        times = measure(fine, root, args, imported)
        change_point(fine, times)


# The pool's functions whose arguments and results are a step's decisions (its job-making helper
# was renamed on the way, and decides nothing these do not show).
DECIDING = ("run_ordered", "start_ordered", "run_last_first", "threads_for", "intra_op_threads")


def _shown(value: Any) -> str | None:
    """``value`` as a decision prints it; None for what is not one (a task, a consumer)."""
    return repr(value) if isinstance(value, (bool, int, tuple, type(None))) else None


def _recorded(function: Any, name: str, calls: list[str]) -> Any:
    """``function``, each call noted in ``calls`` with the decisions among its arguments."""

    def call(*args: Any, **kwargs: Any) -> Any:
        result = function(*args, **kwargs)
        shown = [s for s in map(_shown, [*args, *kwargs.values()]) if s is not None]
        calls.append(f"{name}({', '.join(shown)}) -> {_shown(result) or type(result).__name__}")
        return result

    return call


def decisions(args: argparse.Namespace) -> None:
    """Each revision's jobs of a step, with ``args.cores`` faked, printed where they differ
    from the revision before's."""
    joblib.cpu_count = lambda *_, **__: args.cores  # before any revision asks (it keeps it)
    torch.set_num_threads(args.cores)
    workloads = list(workloads_of(args.workloads))
    with unpacked(args.archive) as (root, every):
        print(
            f"{len(every)} revisions, {args.cores} cores faked; the jobs of step {args.steps} "
            "where they differ from the revision before"
        )
        before: dict[str, str] = {}
        for folder in every:
            package = imported_revision(folder, root)
            pool = sys.modules[f"{package.__name__}._pool"]
            calls: list[str] = []
            for name in DECIDING:
                if hasattr(pool, name):
                    setattr(pool, name, _recorded(getattr(pool, name), name, calls))
            for w in workloads:
                models = copy.deepcopy(w.models)
                for _ in range(args.steps):
                    calls.clear()
                    parsum_step(models, w.x, package)
                step = "\n".join(f"    {c}" for c in calls)
                if before.get(w.description) != step:
                    print(f"{folder.name}, {w.description}:\n{step}")
                    before[w.description] = step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="archive the revisions (needs git)")
    p.add_argument("revisions", help="a git range, FIRST..LAST, or commits A,B,C")
    p.add_argument("archive", type=pathlib.Path)
    r = commands.add_parser("run", help="time them, in two passes")
    r.add_argument("archive", type=pathlib.Path)
    r.add_argument("--coarse", type=int, default=10, help="every Nth revision first")
    r.add_argument("--rounds", type=int, default=60)
    r.add_argument("--settle-ms", type=float, default=20.0)
    r.add_argument("--n-jobs", type=int, default=None)
    r.add_argument(
        "--workloads", default="heterogeneous-medium:64", help="name[:batch], comma-separated"
    )
    d = commands.add_parser("decisions", help="what each decides, with cores faked")
    d.add_argument("archive", type=pathlib.Path)
    d.add_argument("--cores", type=int, default=16)
    d.add_argument(
        "--steps",
        type=int,
        default=6,
        help="the step shown (a plan's looks at one thread alone start at its 33rd call)",
    )
    d.add_argument(
        "--workloads",
        default="heterogeneous-medium:64,distinct-medium:64",
        help="name[:batch], comma-separated",
    )
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.revisions, args.archive)
    elif args.command == "decisions":
        decisions(args)
    else:
        run(args)


if __name__ == "__main__":
    sys.exit(main())
