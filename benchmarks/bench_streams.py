"""Whether CUDA streams would pay for a sum of models on a GPU: the ceilings, outside parsum.

Issue #19 asks to try the forwards of different models on separate CUDA streams, launched from
the helper threads (kernel launches overlap, small kernels run side by side), and to keep it
only if it measures faster. Before parsum does any of it, this times what the idea can give at
best, each method a training step (forward, the sum, the loss, backward) synchronized with the
device at its end, against the plain loop:

  plain          the plain loop, one stream
  streams S      the calling thread launches the models' forwards on S side streams (the
                 models in S shares of about equal cost); autograd runs each backward op on
                 its forward op's stream, so the pullbacks overlap on the device too
  threads T      T threads (1 intra-op thread each) each run the forwards of its share and pull
                 them back (TwoPhase of common.py: the ceiling of parsum's workers), one stream
  threads+streams T   the same, each thread's forwards on a side stream of its own
  forwards T     the forwards on T threads as in "threads T", the backward of their plain sum
                 in one call from the calling thread: all a backward can be where every CUDA
                 node runs on the device's one thread (what parsum's pullbacks do there)
  parsum default, parsum 1, parsum T   for reference

A method that launches from several threads pays the GIL between launches; autograd runs every
CUDA backward node on its one device thread whatever thread started the backward.

    python benchmarks/bench_streams.py [--device cuda] [--streams 2,4,8] [--threads 2,4]
        [--workloads heterogeneous-medium:64,cnn-ensemble,heterogeneous-tiny] [--rounds 20]

``--streams ""`` leaves the stream methods out (the threads' ceilings and parsum's rows alone).

On ``--device cpu`` (no GPU) the side streams are left out, and the threads run as on the
GPU: a check of the script itself, nothing to read about streams.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

import torch
from common import (
    TwoPhase,
    balanced_split,
    interleaved,
    loss_of,
    parsum_step,
    plain_step,
    synchronized,
    workloads_of,
    zero_grads,
)


def launched_on(streams: list[Any], launch: Callable[[], list[torch.Tensor]]) -> list:
    """``launch()``'s outputs, launched on ``streams`` after the current stream's work (``x``
    included); the current stream waits for all of them, each output marked as used by it
    (freed after its use, not the side stream's). Every side stream waits before any launch,
    and the current one only after all: a wait in between would chain the streams one after
    the other."""
    caller = torch.cuda.current_stream()
    for stream in streams:
        stream.wait_stream(caller)
    outs = launch()
    for stream in streams:
        caller.wait_stream(stream)
    for o in outs:
        o.record_stream(caller)
    return outs


def streams_step(
    models: list[torch.nn.Module], x: torch.Tensor, n_streams: int
) -> Callable[[], None]:
    """A step whose forwards the calling thread launches on ``n_streams`` side streams."""
    shares = [s for s in balanced_split(models, x, n_streams) if s]
    streams = [torch.cuda.Stream() for _ in shares]

    def launch() -> list[torch.Tensor]:
        outs = []
        for stream, share in zip(streams, shares):
            with torch.cuda.stream(stream):
                outs += [m(x) for m in share]
        return outs

    def step() -> None:
        zero_grads(models)
        loss_of(sum(launched_on(streams, launch))).backward()  # type: ignore[arg-type]

    return step


class StreamedTwoPhase(TwoPhase):
    """TwoPhase whose threads each launch their forwards on a side stream of their own (on a
    GPU), waited for as ``launched_on`` waits."""

    def __init__(self, models: list[torch.nn.Module], threads: int, x: torch.Tensor) -> None:
        super().__init__(models, threads, x)
        self.streams = [torch.cuda.Stream() for _ in self.shares]

    def _forward(self, p: int, x: torch.Tensor) -> None:
        with torch.cuda.stream(self.streams[p]):
            super()._forward(p, x)

    def _launch(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.threads.run(lambda p: self._forward(p, x))
        return [o for outs in self.outs for o in outs]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = launched_on(self.streams, lambda: self._launch(x))
        return sum(outs)  # type: ignore[return-value]


def two_phase_step(split: TwoPhase, models: list[torch.nn.Module], x: torch.Tensor) -> None:
    zero_grads(models)
    split.backward(split.forward(x))


def threaded_forwards_step(split: TwoPhase, models: list[torch.nn.Module], x: torch.Tensor) -> None:
    """``split``'s forwards on its threads, then one backward of their sum, here."""
    zero_grads(models)
    y = split.forward(x)
    split.forget()
    loss_of(y).backward()


def methods_for(
    models: list[torch.nn.Module], x: torch.Tensor, args: argparse.Namespace
) -> dict[str, Callable[[], None]]:
    """Every method's step on these models, synchronized on a GPU."""
    on_gpu = x.is_cuda
    methods: dict[str, Callable[[], None]] = {
        "plain": functools.partial(plain_step, models, x),
        "parsum default": functools.partial(parsum_step, models, x),
        "parsum 1": functools.partial(parsum_step, models, x, n_jobs=1),
    }
    if on_gpu and args.streams:
        for s in map(int, args.streams.split(",")):
            methods[f"streams {s}"] = streams_step(models, x, s)
    for t in map(int, args.threads.split(",")):
        split = TwoPhase(models, t, x)  # one set of threads for both: the methods run in turn
        methods[f"threads {t}"] = functools.partial(two_phase_step, split, models, x)
        methods[f"forwards {t}"] = functools.partial(threaded_forwards_step, split, models, x)
        methods[f"parsum {t}"] = functools.partial(parsum_step, models, x, n_jobs=t)
        if on_gpu and args.streams:
            streamed = StreamedTwoPhase(models, t, x)
            methods[f"threads+streams {t}"] = functools.partial(two_phase_step, streamed, models, x)
    if on_gpu:
        methods = {k: synchronized(fn) for k, fn in methods.items()}
    return methods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--streams", default="2,4,8", help="side streams; '' for none")
    parser.add_argument("--threads", default="2,4")
    parser.add_argument(
        "--workloads", default="heterogeneous-medium:64,cnn-ensemble,heterogeneous-tiny"
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--settle-ms", type=float, default=20.0)
    args = parser.parse_args()
    print(f"torch {torch.__version__} on {args.device}; medians of {args.rounds} rounds")
    for w in workloads_of(args.workloads):
        methods = methods_for([m.to(args.device) for m in w.models], w.x.to(args.device), args)
        medians = interleaved(methods, args.rounds, settle_seconds=args.settle_ms / 1e3)
        print(w.description)
        for name, t in medians.items():
            print(f"  {name:>20} {t * 1e3:8.3f} ms   plain / this {medians['plain'] / t:5.2f}")
        best = min(medians, key=medians.__getitem__)
        print(f"  fastest: {best}, {medians['plain'] / medians[best]:.2f}x the plain loop")


if __name__ == "__main__":
    main()
