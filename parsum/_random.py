"""Random numbers drawn by the models: drawn in model order, whatever the threads.

# NOTE [ Random numbers in forwards ]
# PyTorch has one global generator per device. Dropout in forwards running on several threads
# drew from it in whatever order the threads reached it: 6 MLPs with dropout, seeded alike,
# gave other outputs at n_jobs=2 than at n_jobs=1, and other ones from one run to the next.
# Forwards that draw random numbers therefore run one after the other in model order, as the
# plain loop runs them, in the calling thread on the whole budget's intra-op threads (one
# forward at a time has them all; the same for any n_jobs, hence the same bits), and draw
# exactly the plain loop's numbers. Their pullbacks stay on the threads: a mask is saved, not
# drawn again. Which forwards draw is known per walk (NOTE [ Reused plans ] in _plans):
# - a torch.nn layer that draws in training mode (dropout, RReLU) among the models' modules
#   says so from the first call;
# - otherwise a walk kept for the next calls runs its first call's forwards in model order (on
#   the chunks' intra-op threads) and compares the generators' states before and after (about
#   2 us each); a walk made for one call (models that are not all modules) runs them on the
#   threads;
# - forwards that ran on the threads are compared too: where they drew after all (a model that
#   draws only sometimes, or another thread of the program drawing meanwhile), the call warns
#   that its numbers depended on the threads' timing, and the walk's next calls run in model
#   order. A walk made again for the same models in the same modes (a module's own attribute
#   changed) keeps what the last one learned.
# Measured (16 MLPs of widths 128-512 with dropout after each hidden layer, 2 threads, in one
# process against the forwards on the threads, two runs; benchmarks/results/dropout-2cores.txt):
# 0.85-0.92x at batch 64 and 256, 0.95-0.98x and 0.99-1.00x the plain loop.
#
# NOTE [ Random numbers replayed in backward ]
# Checkpointing (``torch.utils.checkpoint``, reentrant or not) keeps the generators' state in
# forward and sets the global generator back to it while it recomputes in backward
# (``torch.random.fork_rng``). Two pullbacks recomputing at once on two threads set it under
# each other, and the masks they drew again were not the forward's: 8 checkpointed MLPs with
# dropout at n_jobs=2 got gradients other than the plain loop's in 20 trials of 20, with the
# same outputs. Where a call's forwards drew random numbers and a model's graph can recompute
# in backward (a checkpoint's node, or a saved tensor with an unpack hook: the non-reentrant
# checkpoint's), the call's pullbacks run on one thread. A kept walk looks once (about 1.3 us a
# node); a walk made for one call does not look, and its pullbacks run on one thread: looking on
# every call cost 64 tiny MLPs with dropout, passed as bound methods, 10% a step against not
# looking, and 9% against their pullbacks on one thread (2 threads).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

# torch.nn's layers that draw random numbers in training mode.
_DRAWING_LAYERS = (nn.modules.dropout._DropoutNd, nn.RReLU)


def generator_states() -> list[bytes]:
    """The state of every global generator in use: the CPU's, and each GPU's once CUDA is
    initialized."""
    states = [torch.default_generator.get_state().numpy().tobytes()]
    if torch.cuda.is_initialized():
        # Not while a CUDA graph is being captured: its draws are the graph's.
        with contextlib.suppress(RuntimeError):
            states.extend(g.get_state().numpy().tobytes() for g in torch.cuda.default_generators)
    return states


def has_drawing_layers(modules: Iterable[nn.Module]) -> bool:
    """Whether any of ``modules`` is a torch.nn layer that draws random numbers now."""
    return any(isinstance(m, _DRAWING_LAYERS) and m.training for m in modules)


def may_recompute(nodes: Sequence[Any]) -> bool:
    """Whether the autograd graph under ``nodes`` can recompute a forward in backward: a
    checkpoint's node, or a saved tensor with an unpack hook (NOTE [ Random numbers replayed
    in backward ])."""
    seen: set[int] = set()
    stack = [n for n in nodes if n is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if "Checkpoint" in type(node).__name__ or _first_saved_hooked(node):
            return True
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return False


_saved_names: dict[type, list[str]] = {}


def _first_saved_hooked(node: Any) -> bool:
    """Whether the node's first saved tensor has an unpack hook (reading the ``SavedTensor``
    unpacks nothing). Saved-tensor hooks, the non-reentrant checkpoint's among them, take every
    tensor saved in their scope: the first tells."""
    names = _saved_names.get(type(node))
    if names is None:
        names = [a for a in dir(type(node)) if a.startswith("_raw_saved_")]
        _saved_names[type(node)] = names
    for name in names:
        try:
            saved = getattr(node, name)
        except RuntimeError:  # freed
            continue
        if isinstance(saved, (list, tuple)):
            saved = saved[0] if saved else None
        if saved is not None:
            return getattr(saved, "unpack_hook", None) is not None
    return False


def warn_drawn_on_threads(where: str, kept: bool) -> None:
    then = (
        "the next calls with these models run their forwards in model order"
        if kept
        else "pass the models as nn.Modules, whose calls are remembered, or use n_jobs=1"
    )
    warnings.warn(
        f"{where}: random numbers were drawn during forwards running on several threads (by "
        "the models, or by another thread meanwhile), in an order that depends on the threads' "
        f"timing, so this call's random numbers are not reproducible; {then} (NOTE [ Random "
        "numbers in forwards ] in parsum._random)",
        RuntimeWarning,
        stacklevel=_callers_level(),
    )


# parsum's and torch's own frames, which a warning skips to name the user's line.
_INTERNAL = (os.path.dirname(__file__), os.path.dirname(torch.__file__))


def _callers_level() -> int:
    """The ``stacklevel`` of the first frame outside parsum and torch, as seen from the
    function that calls this one."""
    frame, level = sys._getframe(2), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level
