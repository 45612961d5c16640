"""Where the time of one training step goes, parsum's against the plain loop's: for finding
per-call costs on a machine with little time on it (a GPU machine is lent for minutes).

1. Medians of interleaved steps: the plain loop, parsum with n_jobs=1, parsum's default, and
   parsum with n_jobs=1 whose backward captures the parameters' gradients and returns them to
   autograd instead of accumulating them in its own engine call ("captured": the path taken
   where ``.grad`` is set or under ``autograd.grad``). On a GPU the node's None for every
   parameter sends each parameter's AccumulateGrad to the engine's CPU queue (an input buffer
   with no defined tensor reports the CPU), a hand-over from the device's thread per parameter;
   captured gradients are on the device and stay on its thread.
2. cProfile of parsum's steps (n_jobs=1): the functions with the most time of their own, so
   that parsum's Python shows beside torch's.
3. torch.profiler of each, on its host thread: the operators with the most host time, and how
   many run a step (kernel launches, on a GPU).

With ``--members 0.75`` every step sums a new random draw of that share of the models (members
dropped at random, as ``bench_against.py --members`` draws them), so that the profile shows
what planning a new set costs; ``--profile`` names the method cProfile watches.

    python benchmarks/profile_step.py [--device cuda] [--workload heterogeneous-medium]
        [--batch 64] [--steps 20] [--members 0.75] [--profile "parsum default"]
        [--n-jobs 4 --profile "parsum 4"]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch
from common import Members, interleaved, parsum_step, plain_step, synchronized, workload

from parsum import _inline

PROFILED_STEPS = 20


def captured(step):
    """``step`` with the caller's-graph backward capturing gradients (NOTE [ Accumulating in
    the pullback ] in parsum._function): as if the running backward did not accumulate."""

    def run() -> None:
        runs_all = _inline.engine_runs_all
        _inline.engine_runs_all = lambda nodes: [False] * len(nodes)
        try:
            step()
        finally:
            _inline.engine_runs_all = runs_all

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workload", default="heterogeneous-medium")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--members", type=float, default=None, help="the share drawn a step")
    parser.add_argument("--profile", default="parsum 1", help="the method cProfile watches")
    parser.add_argument("--n-jobs", type=int, default=None, help="a row of parsum on N workers")
    args = parser.parse_args()
    w = workload(args.workload, args.batch)
    models, x = [m.to(args.device) for m in w.models], w.x.to(args.device)
    methods = {
        "plain": lambda: plain_step(models, x),
        "parsum 1": lambda: parsum_step(models, x, n_jobs=1),
        "parsum default": lambda: parsum_step(models, x),
        "parsum 1 captured": captured(lambda: parsum_step(models, x, n_jobs=1)),
    }
    if args.n_jobs is not None:
        methods[f"parsum {args.n_jobs}"] = lambda: parsum_step(models, x, n_jobs=args.n_jobs)
    if args.members is not None:  # every method draws its own sets, alike (seeded)
        everyone = list(models)
        methods = {
            k: Members(models, args.members, everyone).around(fn) for k, fn in methods.items()
        }
    if args.device != "cpu":
        methods = {k: synchronized(fn) for k, fn in methods.items()}
    drawn = "" if args.members is None else f", {args.members} of them drawn a step"
    print(f"{w.description}{drawn} on {args.device}, torch {torch.__version__}")
    medians = interleaved(methods, args.steps, settle=1, settle_seconds=0.02)
    for name, t in medians.items():
        print(f"{name:>18} {t * 1e3:8.3f} ms   plain / this {medians['plain'] / t:5.2f}")

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        methods[args.profile]()
    profiler.disable()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(30)
        print(f"\ncProfile, {args.profile}, {args.steps} steps, by {order}:")
        print("\n".join(text.getvalue().splitlines()[4:40]))

    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":  # with the launches (cudaLaunchKernel) among the host's rows
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    # At most PROFILED_STEPS under torch.profiler, which keeps every operator's event: 300
    # steps of 64 tiny models held 9-13 GB while key_averages ran for minutes.
    steps = min(args.steps, PROFILED_STEPS)
    for name in ("plain", "parsum 1", "parsum 1 captured"):
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                methods[name]()
        events = prof.key_averages()
        print(f"\ntorch.profiler, {name}, per step ({steps} steps):")
        rows = sorted(events, key=lambda e: -e.self_cpu_time_total)[:20]
        for e in rows:
            print(
                f"{e.key:>40} {e.count / steps:6.1f} calls "
                f"{e.self_cpu_time_total / steps / 1e3:8.3f} ms own"
            )
        total = sum(e.self_cpu_time_total for e in events) / steps / 1e3
        print(f"{'all operators':>40} {total:8.3f} ms own")


if __name__ == "__main__":
    main()
