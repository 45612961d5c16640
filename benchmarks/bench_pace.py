"""How often a plan's calls run in the calling thread alone, by the pace's rule, under patterns
of steps: a simulation with a clock of its own (no model runs, nothing is timed).

NOTE [ Workers that stop paying ] in parsum._pace: where parsum chose the workers, a plan now
and then looks at the calling thread alone. Every call of a look costs what the calling thread
alone is slower, on 16 cores about 1.5 times a step (the default's 6.2 ms against 9.1 at
``n_jobs=1`` for the medium MLPs, forty-sixth session), so looks must stay rare where the
workers pay, and still come where they stop paying. Each pattern gives a step's time on the
workers and alone, with noise, slow steps now and then, or other work between runs of calls
(an interleaved benchmark's other methods); the table gives the share of calls alone, for this
checkout's pace and, with ``--rev``, another revision's.

    python benchmarks/bench_pace.py [--rev HEAD~1] [--calls 20000]
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable
from types import ModuleType

from bench_against import ROOT

from parsum import _pace

WORKERS_MS, ALONE_MS = 6.2, 9.1  # 16 cores, the medium MLPs at batch 64

Pattern = Callable[[int, bool, random.Random], float]


def _noisy(sigma: float) -> Pattern:
    return lambda k, w, r: (WORKERS_MS if w else ALONE_MS) * r.lognormvariate(0, sigma)


PATTERNS: dict[str, Pattern] = {
    "steady, 10% noise": _noisy(0.1),
    "20% noise": _noisy(0.2),
    "a step 3x as long every 50th": lambda k, w, r: (
        _noisy(0.1)(k, w, r) * (3 if k % 50 == 49 else 1)
    ),
    "runs of 5 calls, 10 steps' work between": (
        lambda k, w, r: _noisy(0.1)(k, w, r) + (10 * WORKERS_MS if k % 5 == 4 else 0)
    ),
    "runs of 3 calls, 3.5 steps' work between": (
        lambda k, w, r: _noisy(0.1)(k, w, r) + (3.5 * WORKERS_MS if k % 3 == 2 else 0)
    ),
    "alone 5x as slow (many cores)": (
        lambda k, w, r: (WORKERS_MS if w else 5 * WORKERS_MS) * r.lognormvariate(0, 0.1)
    ),
    "a busy machine: alone 0.7x": (
        lambda k, w, r: (WORKERS_MS if w else 0.7 * WORKERS_MS) * r.lognormvariate(0, 0.1)
    ),
}


def share_alone(pace_module: ModuleType, pattern: Pattern, calls: int, seed: int = 0) -> float:
    """The share of ``calls`` calls that ``pace_module``'s Pace sends to the calling thread."""
    rng, now = random.Random(seed), [0.0]
    saved = pace_module.clock
    pace_module.clock = lambda: now[0]
    try:
        pace, alone = pace_module.Pace(), 0
        for k in range(calls):
            on_workers = pace.choose()
            alone += not on_workers
            now[0] += pattern(k, on_workers, rng) / 1e3
    finally:
        pace_module.clock = saved
    return alone / calls


def pace_of(rev: str, into: pathlib.Path) -> ModuleType:
    """parsum/_pace.py of git revision ``rev``, imported on its own (it imports no parsum)."""
    source = subprocess.run(
        ["git", "show", f"{rev}:parsum/_pace.py"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    path = into / "pace_of_rev.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("pace_of_rev", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="also the pace of this git revision")
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paces = {"this": _pace}
        if args.rev:
            paces = {args.rev: pace_of(args.rev, pathlib.Path(tmp)), **paces}
        print(
            f"share of {args.calls} calls alone; a step {WORKERS_MS} ms on the workers, "
            f"{ALONE_MS} ms alone unless said"
        )
        print(f"{'steps':>42}" + "".join(f"{name:>10}" for name in paces))
        for label, pattern in PATTERNS.items():
            shares = [share_alone(p, pattern, args.calls) for p in paces.values()]
            print(f"{label:>42}" + "".join(f"{100 * s:9.2f}%" for s in shares))


if __name__ == "__main__":
    sys.exit(main())
