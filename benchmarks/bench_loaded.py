"""How the default fares on a machine that other processes keep busy.

A data loader's worker processes, another training run or a build share the cores with the
training step. This starts ``--busy`` processes that spin in a Python loop at each ``--nice``
level ("idle": none), and times, in this process, a step (forward and backward of the loss,
with ``--adam`` a ``torch.optim.Adam`` step after it) of each method on its own copy of the
models, the methods in turn (``common.interleaved``, each after ``--settle-ms`` of untimed
steps):

  plain             the plain loop on the default intra-op threads
  plain 1 thread    the plain loop, the whole step on one intra-op thread
  parsum            parsum.sum_models with n_jobs unset
  parsum on workers the same with its workers kept whatever their pace (NOTE [ Workers that
                    stop paying ] in parsum's _pace made a no-op)
  parsum n_jobs=1   parsum.sum_models(n_jobs=1)
  parsum budget 1   parsum.sum_models with n_jobs unset, the whole step on one intra-op
                    thread (torch.set_num_threads(1): parsum's budget follows it)

Each is printed in ms a step and against the faster of the two plain loops. With ``--loop N``
each method runs instead in a process of its own, a loop of N steps as a training script runs
them (the median of the last three quarters): interleaved, a method makes a few calls a turn,
and the step parsum times for a plan runs from one call to the next (NOTE [ Workers that stop
paying ]), across the other methods' turns.

    python benchmarks/bench_loaded.py [--busy 1] [--nice idle,0,10] [--adam] [--rounds 20]
        [--loop 400] [--workloads heterogeneous-medium:64,distinct-medium,distinct-tiny]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import torch
from common import (
    interleaved,
    one_thread,
    parsum_adam_step,
    parsum_step,
    plain_adam_step,
    plain_step,
    with_attribute,
    workloads_of,
)

import parsum
from parsum import _pace

SPIN = "while True: pass"


def workers_kept(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with every paced call on the workers parsum chose."""
    return with_attribute(step, _pace.Pace, "choose", lambda self: True)


@contextlib.contextmanager
def busy(count: int, nice: int | None) -> Iterator[None]:
    """``count`` processes spinning at niceness ``nice`` (none for None) while the block runs."""
    procs: list[subprocess.Popen[bytes]] = []
    if nice is not None:
        for _ in range(count):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", SPIN],
                    preexec_fn=functools.partial(os.nice, nice),
                )
            )
        time.sleep(0.5)  # scheduled before the first step
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def methods_for(
    models: list[torch.nn.Module], x: torch.Tensor, adam: bool
) -> dict[str, Callable[[], None]]:
    """Each method's step over its own copy of ``models``."""

    def plain() -> Callable[[], None]:
        own = copy.deepcopy(models)
        if adam:
            return functools.partial(plain_adam_step(own), x)
        return functools.partial(plain_step, own, x)

    def parsum_call(**kwargs: object) -> Callable[[], None]:
        own = copy.deepcopy(models)
        if adam:
            params = [p for m in own for p in m.parameters()]
            return functools.partial(parsum_adam_step(own, params, shared=False, **kwargs), x)
        return functools.partial(parsum_step, own, x, **kwargs)

    return {
        "plain": plain(),
        "plain 1 thread": one_thread(plain()),
        "parsum": parsum_call(),
        "parsum on workers": workers_kept(parsum_call()),
        "parsum n_jobs=1": parsum_call(n_jobs=1),
        "parsum budget 1": one_thread(parsum_call()),
    }


def loop_seconds(step: Callable[[], None], steps: int) -> float:
    """The median of the last three quarters of ``steps`` steps."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[steps // 4 :])


def in_own_processes(spec: str, args: argparse.Namespace) -> dict[str, float]:
    """Each method's ``loop_seconds`` in a process of its own (``--only``)."""
    seconds = {}
    for method in methods_for([], torch.empty(0), False):
        flags = ["--loop", str(args.loop), "--workloads", spec, *(["--adam"] * args.adam)]
        done = subprocess.run(
            [sys.executable, __file__, "--only", method, *flags],
            capture_output=True,
            text=True,
            check=True,
        )
        seconds[method] = float(done.stdout.split()[-1])
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loop", type=int, default=0, help="steps a loop, a process a method")
    parser.add_argument("--only", help=argparse.SUPPRESS)  # one method's loop, for --loop
    parser.add_argument("--busy", type=int, default=1, help="spinning processes")
    parser.add_argument("--nice", default="idle,0,10", help="their niceness; idle: none")
    parser.add_argument("--adam", action="store_true")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--settle-ms", type=float, default=20.0)
    parser.add_argument(
        "--workloads",
        default="heterogeneous-medium:64,distinct-medium,distinct-tiny",
        help="name[:batch], comma-separated",
    )
    args = parser.parse_args()
    if args.only is not None:
        (w,) = workloads_of(args.workloads)
        step = methods_for(w.models, w.x, args.adam)[args.only]
        print(loop_seconds(step, args.loop))
        return
    how = (
        f"loops of {args.loop} steps, each in a process of its own"
        if args.loop
        else f"medians of {args.rounds} interleaved rounds, each after {args.settle_ms:g} ms of "
        "untimed steps"
    )
    print(
        f"torch {torch.__version__}, {parsum._config.usable_cores()} usable cores, "
        f"{torch.get_num_threads()} intra-op threads; {'Adam after each step; ' * args.adam}"
        f"{how}"
    )
    for spec, w in zip(args.workloads.split(","), workloads_of(args.workloads)):
        print(f"\n{w.name}: {w.description}")
        print(f"{'load':>22} " + " ".join(f"{m:>17}" for m in methods_for([], w.x, False)))
        for level in args.nice.split(","):
            nice = None if level == "idle" else int(level)
            with busy(args.busy, nice):
                if args.loop:
                    seconds = in_own_processes(spec, args)
                else:
                    methods = methods_for(w.models, w.x, args.adam)
                    seconds = interleaved(methods, args.rounds, settle_seconds=args.settle_ms / 1e3)
            faster = min(seconds["plain"], seconds["plain 1 thread"])
            load = "idle" if nice is None else f"{args.busy} busy at nice {nice}"
            print(f"{load + ', ms':>22} " + " ".join(f"{t * 1e3:17.2f}" for t in seconds.values()))
            print(
                f"{'faster plain / this':>22} "
                + " ".join(f"{faster / t:17.2f}" for t in seconds.values())
            )


if __name__ == "__main__":
    main()
