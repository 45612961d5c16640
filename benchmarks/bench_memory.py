"""Peak memory of sum_models' backward and of a training step, in fresh subprocesses.

1. forward + backward of M models (M = 8 to 128), plain loop against parsum: the extra memory
   parsum needs must not grow with M (it never holds all M per-model input gradients).
2. two training steps (forward, backward, Adam step, zero_grad) of M larger models: plain
   loop, parsum, and parsum with StepInBackward, which never stores the gradients of the whole
   set, at the default and at n_jobs=1. Target: the peak falls by at least 80% of the total
   gradient bytes.
3. two backward passes of the same models adding into a compensated FlatGrad (micro-batches),
   at the default and at n_jobs=1: the growth over the buffer and its compensations, which
   exist before, as a multiple of the gradient bytes.
4. forward + backward of 16 and 32 heads over one wide trunk (a parameter every model uses),
   with and without a gradient for x, the plain loop against parsum at the default and at
   n_jobs=1: the extra memory, as a multiple of the trunk's gradient bytes, must not grow with
   the heads (their gradients of the trunk are not all held at once: NOTE [ Shared gradients
   at once ]; with x's gradient, 16 and 32 heads grew the peak by 264 and 520 MiB until
   2026-12-07, where the plain loop's grew by 12).

Every figure is the growth of the peak resident set (VmHWM, reset through
/proc/self/clear_refs) during the measured work, in a new Python process, after one warm-up
run of the same work (so the thread pool and Adam's moments exist before), with glibc's mmap
threshold fixed at 64 KiB so that freed tensors leave the resident set at once.

    python benchmarks/bench_memory.py [--models 8,16,32,64,128] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys

MIB = 2**20


def peak_reset() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(mode: str, n_models: int, width: int, batch: int) -> dict[str, float]:
    import torch
    from torch import nn

    import parsum

    torch.manual_seed(0)
    if mode.startswith("trunk"):  # heads over one trunk every model runs
        trunk = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        models = [nn.Sequential(trunk, nn.Linear(width, 4)) for _ in range(n_models)]
    else:
        models = [
            nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width))
            for _ in range(n_models)
        ]
    params = list({id(p): p for m in models for p in m.parameters()}.values())
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    x = torch.randn(batch, width, requires_grad=mode in ("plain", "parsum") or mode.endswith("-x"))

    def plain_sum() -> torch.Tensor:
        return sum(m(x) for m in models)  # type: ignore[return-value]

    opt = None
    sib = None
    flat = None
    if mode.startswith("flat-compensated"):
        flat = parsum.FlatGrad(models, compensated=True)
    if mode.startswith("sib-train"):
        sib = parsum.StepInBackward(models, torch.optim.Adam, lr=1e-3)
    elif mode.endswith("-train"):
        opt = torch.optim.Adam(params, lr=1e-3)
    n_jobs = 1 if mode.endswith("-1") else None

    def work() -> None:
        if mode == "plain":
            plain_sum().pow(2).mean().backward()
        elif mode == "parsum":
            parsum.sum_models(models, x).pow(2).mean().backward()
        elif mode == "plain-train":
            for _ in range(2):
                plain_sum().pow(2).mean().backward()
                opt.step()  # type: ignore[union-attr]
                opt.zero_grad()  # type: ignore[union-attr]
        elif mode == "parsum-train":
            for _ in range(2):
                parsum.sum_models(models, x).pow(2).mean().backward()
                opt.step()  # type: ignore[union-attr]
                opt.zero_grad()  # type: ignore[union-attr]
        elif mode.startswith("sib-train"):
            for _ in range(2):
                y = parsum.sum_models(models, x, step_in_backward=sib, n_jobs=n_jobs)
                y.pow(2).mean().backward()
        elif mode.startswith("flat-compensated"):
            assert flat is not None
            flat.zero_()
            for _ in range(2):
                parsum.sum_models(models, x, n_jobs=n_jobs).pow(2).mean().backward()
        elif mode.startswith("trunk-plain"):
            plain_sum().pow(2).mean().backward()
        elif mode.startswith("trunk-parsum"):
            jobs = 1 if mode.startswith("trunk-parsum-1") else None
            parsum.sum_models(models, x, n_jobs=jobs).pow(2).mean().backward()
        if mode.startswith("trunk"):  # every backward starts from None, as after zero_grad()
            for p in params:
                p.grad = None
            x.grad = None

    work()  # warm-up: lazily built state (thread pool, Adam's moments) is not the peak's
    gc.collect()
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak_reset()
    work()
    return {
        "peak_growth": peak_bytes() - resident,
        "grad_bytes": grad_bytes,
        "model_grad_bytes": grad_bytes / n_models,
        "input_grad_bytes": x.numel() * x.element_size(),
    }


def measure(mode: str, n_models: int, width: int, batch: int) -> dict[str, float]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(n_models), str(width), str(batch)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="8,16,32,64,128")
    parser.add_argument("--train-models", type=int, default=32)
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, n, width, batch = args.child
        print(json.dumps(child(mode, int(n), int(width), int(batch))))
        return

    results: dict[str, list] = {"backward": [], "train": []}
    width, batch = 128, 512
    print("1. forward + backward of M MLPs (128 -> 256 -> 128), batch 512, x requires grad")
    print(
        f"   {'M':>5}{'plain MiB':>11}{'parsum MiB':>12}{'extra MiB':>11}"
        f"{'extra / one model grad':>24}{'extra / x grad':>16}"
    )
    for n in [int(v) for v in args.models.split(",")]:
        plain = measure("plain", n, width, batch)
        ours = measure("parsum", n, width, batch)
        extra = ours["peak_growth"] - plain["peak_growth"]
        results["backward"].append({"models": n, "plain": plain, "parsum": ours})
        print(
            f"   {n:>5}{plain['peak_growth'] / MIB:>11.1f}{ours['peak_growth'] / MIB:>12.1f}"
            f"{extra / MIB:>11.1f}{extra / ours['model_grad_bytes']:>24.1f}"
            f"{extra / ours['input_grad_bytes']:>16.1f}"
        )

    n, width, batch = args.train_models, 512, 64
    print(f"\n2. two training steps (Adam) of {n} MLPs (512 -> 1024 -> 512), batch 64")
    rows = {
        mode: measure(mode, n, width, batch)
        for mode in ("plain-train", "parsum-train", "sib-train", "sib-train-1")
    }
    grads = rows["sib-train"]["grad_bytes"]
    print(f"   gradients of the whole set: {grads / MIB:.1f} MiB")
    print(f"   {'method':<34}{'peak growth MiB':>17}")
    labels = {
        "plain-train": "plain loop, backward + step",
        "parsum-train": "parsum, backward + step",
        "sib-train": "parsum with StepInBackward",
        "sib-train-1": "the same, n_jobs=1",
    }
    for mode, label in labels.items():
        print(f"   {label:<34}{rows[mode]['peak_growth'] / MIB:>17.1f}")
    fall = rows["parsum-train"]["peak_growth"] - rows["sib-train"]["peak_growth"]
    fall_plain = rows["plain-train"]["peak_growth"] - rows["sib-train"]["peak_growth"]
    print(
        f"   StepInBackward lowers the peak by {fall / MIB:.1f} MiB against parsum = "
        f"{fall / grads:.0%} of the gradient bytes (target >= 80%)"
    )
    print(
        f"   and by {fall_plain / MIB:.1f} MiB against the plain loop = "
        f"{fall_plain / grads:.0%} of the gradient bytes"
    )
    fall_one = rows["parsum-train"]["peak_growth"] - rows["sib-train-1"]["peak_growth"]
    print(
        f"   at n_jobs=1 by {fall_one / MIB:.1f} MiB = {fall_one / grads:.0%} of the gradient bytes"
    )
    results["train"].append(rows)

    print("\n3. two backward passes of the same models adding into a compensated FlatGrad")
    flat_rows = {
        mode: measure(mode, n, width, batch) for mode in ("flat-compensated", "flat-compensated-1")
    }
    for mode, label in (("flat-compensated", "default"), ("flat-compensated-1", "n_jobs=1")):
        growth = flat_rows[mode]["peak_growth"]
        print(f"   {label:<34}{growth / MIB:>10.1f} MiB = {growth / grads:.2f}x the gradient bytes")
    results["flat_compensated"] = [flat_rows]

    width, batch = 1024, 8  # x's gradients fit one reduction, the trunk's do not
    print(f"\n4. forward + backward of M heads over one trunk ({width} -> {width}), batch {batch}")
    print(f"   {'method':<38}{'M':>4}{'peak growth MiB':>17}{'extra / trunk grad':>20}")
    trunk_bytes = width * (width + 1) * 4
    trunk_rows: dict[str, dict[str, float]] = {}
    for x_grad in ("", "-x"):
        for heads in (16, 32):
            plain = measure("trunk-plain" + x_grad, heads, width, batch)
            for mode, label in (("trunk-plain", "plain loop"), ("trunk-parsum", "parsum"),
                                ("trunk-parsum-1", "parsum, n_jobs=1")):  # fmt: skip
                row = (
                    plain if mode == "trunk-plain" else measure(mode + x_grad, heads, width, batch)
                )
                trunk_rows[f"{mode}{x_grad}-{heads}"] = row
                extra = row["peak_growth"] - plain["peak_growth"]
                what = f"{label}{', x needs a gradient' if x_grad else ''}"
                print(
                    f"   {what:<38}{heads:>4}{row['peak_growth'] / MIB:>17.1f}"
                    f"{extra / trunk_bytes:>20.2f}"
                )
    results["shared_trunk"] = [trunk_rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
