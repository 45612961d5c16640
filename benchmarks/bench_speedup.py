"""How fast is one training step of a sum of models with parsum, against what a user would
otherwise run, and against the machine's parallel ceiling, for 1, 2, ... workers?

Methods, all forward + backward of the loss of sum(m(x) for m in models):
  plain          the plain loop, PyTorch's default intra-op threads
  plain-1t       the plain loop with 1 intra-op thread
  vmap           torch.func.stack_module_state + vmap (identical models only; its stacked
                 parameters are the leaves, so the models' own .grad stay empty). For identical
                 models parsum's methods run them in stacked storage (parsum.stack_), and three
                 training steps with Adam are timed too: vmap+adam (Adam over vmap's stacked
                 leaves), parsum+adam (Adam over stack.parameters() of twins of the models,
                 their own storage), parsum+adam own (Adam over every model's parameters,
                 one by one) and parsum+adam sib (one Adam per model in a StepInBackward,
                 stepped as one over the stack); parsum no stack_ runs twins of the models
                 left in their own storage, which auto batches anew on every call
  plain+adam     for models of several architectures, training steps with Adam on twins of
                 the models: the plain loop then one Adam over every parameter, parsum+adam
                 parsum's default then the same, parsum+adam sib one Adam per model in a
                 StepInBackward (the step in the backward's workers)
  hand-split P   the ceiling: the models split by hand over P threads in shares of about
                 equal estimated cost (common.balanced_split), each running the plain loop on
                 its share with 1 intra-op thread, no reduction
  parsum P       parsum.sum_models(models, x, n_jobs=P), engine="auto"
  parsum default parsum.sum_models(models, x): n_jobs left to parsum (NOTE [ Threads that
                 pay ]: the budget spent on intra-op threads, or on workers)
  procs P        parsum.distributed.sum_models over P processes on this host (gloo on
                 127.0.0.1), each with budget / P threads and its share of the models, as
                 torchrun --nproc-per-node P would run them (only with --procs); timed after
                 the other methods, with only its own P processes alive, 10 steps a command
                 of this process, each rank timing its last 8 (a step: the slowest rank's
                 time over 8; the median of the rounds)

Every method takes its turn once per round, interleaved, after a warm-up, and in its turn
makes --settle untimed calls (default 1), and more until --settle-ms (default 20) have passed,
before the timed one, so that the time is that of a loop of its own rather than of a first call
after another method, whose OpenMP threads may still spin (common.interleaved_rounds);
the tables give medians over the rounds and ratios measured in this one process (absolute
times drift on shared machines). A JSON file and a PNG (speedup over plain-1t against workers,
one line per method) are written.

    python benchmarks/bench_speedup.py [--jobs 1,2] [--procs 1,2] [--workloads all]
        [--rounds 20] [--settle 1] [--settle-ms 20] [--json speedup.json] [--png speedup.png]
        [--device cuda]

With ``--device cuda`` the models and the batch live on the GPU, every method synchronizes
the device after its step, the medium workload also runs at batch 4096, and the hand split
(a CPU ceiling) is left out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
from collections.abc import Callable

import torch
from common import (
    WORKLOADS,
    HandSplit,
    ProcessSplit,
    interleaved,
    one_thread,
    parameters_of,
    parsum_adam_step,
    parsum_sib_step,
    parsum_step,
    plain_adam_step,
    plain_step,
    synchronized,
    vmap_step,
    workload,
    workload_spec,
)

import parsum

# The small-batch case of the medium workload, where threads pay most (BENCHMARKING.md), and
# MLPs written as classes of their own, no two alike (common.Net): what a call costs models that
# run neither as direct programs nor stacked.
CASES = [(name, None) for name in WORKLOADS] + [
    ("heterogeneous-medium", 64),
    ("distinct-medium", 64),
    ("distinct-tiny", None),
]
# Run only when named in --workloads: models with dropout (NOTE [ Random numbers in forwards ]),
# and models of other layers than MLPs and CNNs: sequences (NOTE [ Tokens ] in parsum._grouping),
# embeddings and recurrent layers, beyond direct programs (NOTE [ Direct programs ]).
NAMED_ONLY = [
    ("dropout-medium", 64),
    ("dropout-wrapped", 64),
    ("transformers", None),
    ("embedding-bags", None),
    ("lstms", None),
    # identical-tiny as a class of the user's own: stacked through vmap, not batched layers
    ("identical-classes", None),
    # heads over one trunk that every model runs, as Sequentials and as classes of their own
    # (no StepInBackward row: it refuses parameters that models share)
    ("shared-trunk", None),
    ("trunk-classes", None),
]
# Steps the ranks run per command of the parent (ProcessSplit): as a torchrun job runs them.
PROCESS_STEPS = 10


def methods_for(
    name: str,
    batch: int | None,
    jobs: list[int],
    device: str = "cpu",
) -> tuple[str, dict]:
    w = workload(name, batch)
    models, x = [m.to(device) for m in w.models], w.x.to(device)
    methods: dict[str, Callable[[], None]] = {
        "plain": lambda: plain_step(models, x),
        "plain-1t": one_thread(lambda: plain_step(models, x)),
    }
    if w.identical:
        step = vmap_step(models)
        methods["vmap"] = lambda: step(x)
        # parsum keeps identical models in stacked storage (parsum.stack_); a training step
        # with Adam: vmap's over its stacked leaves, parsum's over the stack's tensors (which
        # are the models' own parameters) and over every model's parameters one by one. The
        # optimizer over the stack's tensors gets twins of the models (the same weights): a
        # stack with such an optimizer gathers the gradients of models run one by one into
        # its tensors, which the other rows, like most users, do not ask for.
        parsum.stack_(models)
        twins = [m.to(device) for m in workload(name, batch).models]
        twin_stack = parsum.stack_(twins)
        sib_twins = [m.to(device) for m in workload(name, batch).models]
        adam_steps = {
            "vmap+adam": vmap_step(models, adam=True),
            "parsum+adam": parsum_adam_step(twins, list(twin_stack.parameters()), shared=False),
            "parsum+adam sib": parsum_sib_step(parsum.stack_(sib_twins)),
            "parsum+adam own": parsum_adam_step(models, parameters_of(models), shared=True),
        }
        for key, fn in adam_steps.items():
            methods[key] = lambda fn=fn: fn(x)
        # Without stack_: auto batches the group on every call (NOTE [ Stacked groups ]).
        loose = [m.to(device) for m in workload(name, batch).models]
        methods["parsum no stack_"] = lambda: parsum_step(loose, x)
    else:
        # Training steps with Adam, on twins of the models (the same weights): the optimizer's
        # parallel ops on the caller's threads come before the next call, as in a user's loop.
        twins = [[m.to(device) for m in workload(name, batch).models] for _ in range(3)]
        adam_steps = {
            "plain+adam": plain_adam_step(twins[0]),
            "parsum+adam": parsum_adam_step(twins[1], parameters_of(twins[1]), shared=False),
        }
        with contextlib.suppress(parsum.ParsumError):  # refused where models share parameters
            adam_steps["parsum+adam sib"] = parsum_sib_step(twins[2])
        for key, fn in adam_steps.items():
            methods[key] = lambda fn=fn: fn(x)
    methods["parsum default"] = lambda: parsum_step(models, x)
    for p in jobs:
        if p > 1 and device == "cpu":
            split = HandSplit(models, p, x)
            methods[f"hand-split {p}"] = lambda split=split: split(x)
        methods[f"parsum {p}"] = lambda p=p: parsum_step(models, x, n_jobs=p)
    if device != "cpu":  # a step ends when the device is done with it
        methods = {k: synchronized(fn) for k, fn in methods.items()}
    return w.description, methods


def time_processes(
    name: str, batch: int | None, procs: tuple[int, ...], rounds: int
) -> dict[str, float]:
    """Median seconds a step of each ``procs P`` row, each timed with only its own P processes
    alive, after the threads' rows: an idle rank's OpenMP threads spin for a while after each
    step, which slowed the rows timed beside them (on 16 cores, 16 identical MLPs: parsum
    35.4 ms with ranks alive against 14.2 without; vmap 9.5 against 6.4)."""
    models = workload(name, batch).models
    budget = torch.get_num_threads()
    medians: dict[str, float] = {}
    # Every rank needs a model of its own: no more processes than models.
    for p in [p for p in procs if p <= len(models)]:
        split = ProcessSplit(name, batch, p, budget, PROCESS_STEPS)
        try:
            steps = []
            for k in range(3 + rounds):  # the first three: warm-up
                split()
                if k >= 3:
                    steps.append(split.step_seconds)
            medians[f"procs {p}"] = statistics.median(steps)
        finally:
            split.close()
    return medians


def report(name: str, description: str, medians: dict[str, float], jobs: list[int]) -> dict:
    plain, one = medians["plain"], medians["plain-1t"]
    print(f"\n{name}: {description}")
    print(f"{'method':>14} {'ms/step':>9} {'plain / this':>13} {'plain-1t / this':>16}")
    for method, t in medians.items():
        print(f"{method:>14} {t * 1e3:9.2f} {plain / t:13.2f} {one / t:16.2f}")
    ours = medians["parsum default"]
    faster_plain = min(plain, one)
    splits = {k: t for k, t in medians.items() if k.startswith("hand-split")}
    line = f"  parsum default against: faster plain {faster_plain / ours:.2f}x"
    if splits:
        best = min(splits, key=splits.__getitem__)
        line += f", best hand split ({best}) {splits[best] / ours:.2f}x"
    runs = {k: t for k, t in medians.items() if k.startswith("procs")}
    if runs:
        best_procs = min(runs, key=runs.__getitem__)
        line += f"; best processes ({best_procs}) against plain-1t {one / runs[best_procs]:.2f}x"
        line += f", against parsum default {ours / runs[best_procs]:.2f}x"
    if "parsum 1" in medians:
        line += f"; parsum 1 against plain-1t {one / medians['parsum 1']:.2f}x"
    if "vmap" in medians:
        line += f"; vmap {medians['vmap'] / ours:.2f}x"
        if "parsum no stack_" in medians:
            line += f" (without stack_ {medians['vmap'] / medians['parsum no stack_']:.2f}x)"
    print(line)
    if "vmap+adam" in medians:
        vmap_adam = medians["vmap+adam"]
        stacked, own = medians["parsum+adam"], medians["parsum+adam own"]
        fused = medians["parsum+adam sib"]
        print(
            f"  with an Adam step, against vmap+adam: parsum+adam {vmap_adam / stacked:.2f}x, "
            f"parsum+adam own {vmap_adam / own:.2f}x, parsum+adam sib {vmap_adam / fused:.2f}x"
        )
    if "plain+adam" in medians:
        plain_adam = medians["plain+adam"]
        line = "  with an Adam step, against plain+adam: parsum+adam "
        line += f"{plain_adam / medians['parsum+adam']:.2f}x"
        if "parsum+adam sib" in medians:
            line += f", parsum+adam sib {plain_adam / medians['parsum+adam sib']:.2f}x"
        print(line)
    return {"workload": name, "description": description, "seconds": medians}


def plot(results: list[dict], jobs: list[int], path: str, cores: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(
        1, len(results), figsize=(3.2 * len(results), 3.2), sharey=True, squeeze=False
    )
    axes = grid[0]
    for ax, r in zip(axes, results):
        s = r["seconds"]
        base = s["plain-1t"]
        ax.plot(jobs, [base / s[f"parsum {p}"] for p in jobs], "o-", label="parsum, n_jobs")
        ax.axhline(base / s["parsum default"], color="C0", ls="--", lw=0.8, label="parsum default")
        ceiling = [base / s.get(f"hand-split {p}", s["plain-1t"]) for p in jobs]
        ax.plot(jobs, ceiling, "s--", label="hand-split (ceiling)")
        ax.axhline(base / s["plain"], color="gray", ls=":", label="plain, default threads")
        if "vmap" in s:
            ax.axhline(base / s["vmap"], color="green", ls="-.", label="vmap")
        procs = sorted(int(k.split()[1]) for k in s if k.startswith("procs"))
        if procs:
            ax.plot(procs, [base / s[f"procs {p}"] for p in procs], "^-.", label="processes")
        ax.set_title(r["description"], fontsize=7)
        ax.set_xlabel("workers or processes")
        ax.set_xticks(sorted({*jobs, *procs}))
    axes[0].set_ylabel("speedup over plain loop, 1 thread")
    # One legend for the figure, with every method any panel drew (vmap only where it ran).
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), fontsize=7, loc="lower center", ncol=len(handles))
    fig.suptitle(
        f"parsum, forward + backward, {cores} cores, torch {torch.__version__}", fontsize=9
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)


def named_cases(spec: str, all_cases: list[tuple[str, int | None]]) -> list:
    """The cases of ``--workloads``: a name alone runs its batches in ``all_cases`` (or its
    default batch), ``name:batch`` that batch only."""
    known = {name for name, _ in all_cases + NAMED_ONLY}
    cases: list[tuple[str, int | None]] = []
    for item in spec.split(","):
        name, batch = workload_spec(item)
        if name not in known:
            raise SystemExit(f"unknown workload {name!r}; expected one of {sorted(known)}")
        if batch is not None:
            cases.append((name, batch))
        else:
            cases += [c for c in all_cases + NAMED_ONLY if c[0] == name]
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="1,2", help="worker counts, e.g. 1,2,4,8,16")
    parser.add_argument("--procs", default="", help="process counts, e.g. 1,2,4,8,16")
    parser.add_argument(
        "--workloads",
        default="all",
        help="all, or comma-separated names, each with :BATCH for that batch only",
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--settle",
        type=int,
        default=1,
        help="untimed calls in each method's turn before its timed one (common.interleaved_rounds)",
    )
    parser.add_argument(
        "--settle-ms",
        type=float,
        default=20.0,
        help="and untimed calls until this long has passed in the turn (common.interleaved_rounds)",
    )
    parser.add_argument("--json", default="speedup.json")
    parser.add_argument("--png", default="speedup.png")
    parser.add_argument(
        "--replot", metavar="JSON", help="only print the tables and draw --png from saved results"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        seconds = saved["results"][0]["seconds"]
        jobs = sorted(
            int(k.split()[1]) for k in seconds if k.split()[-1].isdigit() and "parsum" in k
        )
        print(f"torch {saved['torch']}, {saved['cores']} usable cores (from {args.replot})")
        for r in saved["results"]:
            report(r["workload"], r["description"], r["seconds"], jobs)
        try:
            plot(saved["results"], jobs, args.png, saved["cores"])
        except ImportError:  # the tables stand without the plot
            print("\nno plot: matplotlib is missing (pip install -e '.[examples]')")
            return
        print(f"wrote {args.png}")
        return
    jobs = [int(j) for j in args.jobs.split(",")]
    all_cases = CASES + ([("heterogeneous-medium", 4096)] if args.device != "cpu" else [])
    cases = all_cases if args.workloads == "all" else named_cases(args.workloads, all_cases)
    cores = parsum._config.usable_cores()
    print(
        f"torch {torch.__version__}, {cores} usable cores ({os.cpu_count()} in the machine), "
        f"{torch.get_num_threads()} intra-op threads by default; medians of {args.rounds} "
        f"interleaved rounds, each method's timed call after {args.settle} untimed in its turn "
        f"and at least {args.settle_ms:g} ms of them"
    )
    procs = tuple(int(p) for p in args.procs.split(",") if p)
    results = []
    for name, batch in cases:
        description, methods = methods_for(name, batch, jobs, args.device)
        medians = interleaved(
            methods, args.rounds, settle=args.settle, settle_seconds=args.settle_ms / 1e3
        )
        if procs and args.device == "cpu":
            medians.update(time_processes(name, batch, procs, args.rounds))
        results.append(report(name, description, medians, jobs))
    with open(args.json, "w") as f:
        json.dump({"cores": cores, "torch": torch.__version__, "results": results}, f, indent=1)
    try:
        plot(results, jobs, args.png, cores)
    except ImportError:  # the tables and the JSON stand without the plot
        print(f"\nwrote {args.json}; no plot: matplotlib is missing (pip install -e '.[examples]')")
        return
    print(f"\nwrote {args.json} and {args.png}")


if __name__ == "__main__":
    main()
