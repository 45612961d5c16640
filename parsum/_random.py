"""Random numbers drawn by the models: drawn in model order, whatever the threads.

# NOTE [ Random numbers in forwards ]
# PyTorch has one global generator per device. Dropout in forwards running on several threads
# drew from it in whatever order the threads reached it: 6 MLPs with dropout, seeded alike,
# gave other outputs at n_jobs=2 than at n_jobs=1, and other ones from one run to the next.
# Forwards that draw random numbers therefore draw them in model order, as the plain loop does,
# and draw exactly its numbers. Where their draws can be made beforehand (NOTE [ Dropout drawn
# beforehand ]) the forwards still run on the threads, each under its chunk's intra-op threads
# (also in the calls that run them in model order: the same bits on every path). Otherwise
# they run one after the other in the calling thread on the whole budget's intra-op threads
# (one forward at a time; the same for any n_jobs). The wrapped MLPs below, against the
# forwards on the threads: 0.85x at batch 64 and 256 so, 0.73x and 0.70x each forward under its
# chunk's threads, 0.82x and 0.84x as one chunk (1.085x and 1.055x between the last two in one
# run). Their pullbacks stay on the threads: a mask is saved, not drawn again.
# Which forwards draw is known per walk (NOTE [ Reused plans ] in _plans):
# - a torch.nn layer that draws in training mode (dropout, RReLU) among the models' modules
#   says so from the first call; dropout with p of 0 or 1 draws nothing (many models keep an
#   nn.Dropout(0.0) as their default), and the walk watches its attributes, so that a p raised
#   later makes a new walk, which sees it draw;
# - otherwise a walk kept for the next calls runs its first call's forwards in model order and
#   compares the generators' states before and after (about 2 us each); a walk made for one
#   call (models that are not all modules) runs them on the threads;
# - later forwards are compared too, unless the walk saw them draw and runs them in model
#   order, or they and their pullbacks run on one thread (nothing then depends on a thread):
#   where they drew after all (a model that draws only sometimes, one whose attribute turned its
#   noise on, or another thread of the program drawing meanwhile), the walk's next calls run in
#   model order, the call's pullbacks on one thread where a graph may recompute, and a call
#   whose forwards ran on the threads warns that its numbers depended on the threads' timing.
#   A walk made again for the same models in the same modes (a module's own attribute changed)
#   keeps what the last one learned. (Forwards in model order for another reason, state the
#   models share, were not compared once a walk had seen no draw: checkpointed models that
#   then drew were pulled back on the threads, with other masks than their forwards'.)
# Measured on 2 threads in one process against the forwards on the threads (which drew other
# numbers at each n_jobs), 16 MLPs of widths 128-512 with dropout after each hidden layer:
# as nn.Sequential (drawn beforehand) 0.97x and 0.98x at batch 64 and 256, 1.09x and 1.14x the
# plain loop; each inside a module of the user's (in model order) 0.85x and 0.85x, 0.95x and
# 0.98x the plain loop (benchmarks/results/dropout-2cores.txt).
#
# NOTE [ Generators the models hold ]
# A model may draw from a ``torch.Generator`` of its own (noise seeded for reproducibility,
# ``torch.randn(shape, generator=self.generator)``), which the global generators' states do not
# show; or from a ``random.Random`` or a NumPy ``Generator`` or ``RandomState`` (augmentation in
# a forward). One held by two models is drawn from in the order their forwards run: on the threads,
# in the threads' order (6 MLPs adding noise from one generator, at n_jobs=2: outputs 0.35 off
# the plain loop's from the second call on, silently). Models that hold one generator between
# them, as an attribute of one of their modules, run their forwards in model order
# (``_forward_in_order`` in _api), as models sharing a buffer do, and so do models passed one
# as an argument; a generator of each model's own is drawn from in its model's order on any
# thread. One the models reach otherwise (a global, a closure) is not seen (docs/limits.md).
#
# NOTE [ Models seen not to draw ]
# A set of models not seen before (members drawn at random each step, experts picked per
# batch) makes a new walk, and a new kept walk ran its first call's forwards in model order to
# learn whether they draw (NOTE [ Random numbers in forwards ]): such a sum ran its
# forwards in model order on every call, on any number of cores. A kept walk's call whose
# forwards drew nothing therefore marks each of its models quiet, with its modules' training
# flags; a new walk over models all marked quiet, in the flags they have now, starts as not
# drawing, as a walk made again for the same models starts from what the last one learned: its
# forwards run on the threads and stay watched, and a draw there warns, orders the walk's next
# calls and unmarks its models. A model is marked by its part of a walk's key and held weakly,
# as the walk holds it (a dead one matches nothing); at most MAX_QUIET are kept
# (``Walk.mark_quiet`` in _plans).
#
# NOTE [ Dropout drawn beforehand ]
# On the CPU, F.dropout(x, p) in training mode is ``x * noise``, ``noise`` being
# ``torch.empty_like(x).bernoulli_(1 - p).div_(1 - p)`` (torch's composite dropout; the fused
# kernel is for GPUs), and bernoulli_'s draws take the same numbers from the generator whatever
# the intra-op threads (checked bit for bit in the tests against F.dropout at 1 and 2 threads).
# Where every model is a direct program (NOTE [ Direct programs ] in _engines) and every layer
# of them that draws is an out-of-place ``nn.Dropout``, each chunk draws its models' noise, layer
# by layer, in its turn (``Turns``: chunk k once chunks 0 to k - 1 drew theirs; the threads
# claim chunks in chunk order; an interrupted wait fails the later chunks' waits instead of
# leaving them waiting), then runs its forwards, each layer multiplying by its noise:
# the plain loop's draws in its order, and its bits, with the forwards' other work in parallel.
# Drawing all of it in the calling thread before the job instead left the helper idle for the
# draws (bernoulli_ does not split over intra-op threads: 2.9 ms for 16 medium MLPs at batch 64,
# at 1 and 2 threads): 0.88x and 0.86x the forwards on the threads, against 0.96x and 0.98x.
# The noise's shapes are those the layers' inputs had in the walk's last call at this input
# shape, dtype and autocast state, which ran its forwards in model order and recorded them;
# each layer's ``p`` and mode are read when its noise is drawn. A layer whose input does not
# match its noise calls itself, out of turn: the call warns, and the walk's next calls run in
# model order.
#
# NOTE [ Generators' states read in one thread at a time ]
# torch reads a generator's state (``Generator.get_state``) holding the generator's mutex and the
# GIL, and wraps the state in a tensor before it lets the mutex go: that allocation may run the
# garbage collector, whose callbacks run Python, which hands the GIL to another thread. Where
# that thread reads the same generator's state, it waits for the mutex holding the GIL, and the
# first waits for the GIL holding the mutex: both forever (seen in the suite, 2026-12-07: four
# threads training the same models at once, ``test_concurrency.py``, hung in two of them, the
# collector inside one's read calling ``_Forget`` of _plans). So parsum reads the
# generators' states under a lock of its own, which a thread waits for with the GIL given back.
# Threads of yours that read or seed torch's generators (``torch.get_rng_state``,
# ``torch.manual_seed``) while parsum reads them can still meet torch's own wait.
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
import random
import sys
import warnings
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from ._locks import Latch, Lock
from ._torch_calls import dropout_untouched

if TYPE_CHECKING:
    from ._engines import DirectProgram

# torch.nn's layers that draw random numbers in training mode.
_DRAWING_LAYERS = (nn.modules.dropout._DropoutNd, nn.RReLU)


_STATES_READ = Lock()  # NOTE [ Generators' states read in one thread at a time ]


def generator_states() -> list[bytes]:
    """The state of every global generator in use: the CPU's, and each GPU's once CUDA is
    initialized."""
    with _STATES_READ:
        states = [torch.default_generator.get_state().numpy().tobytes()]
        if torch.cuda.is_initialized():
            # Not while a CUDA graph is being captured: its draws are the graph's.
            with contextlib.suppress(RuntimeError):
                states.extend(
                    g.get_state().numpy().tobytes() for g in torch.cuda.default_generators
                )
    return states


# Generators a model may hold: torch's, Python's and NumPy's (NOTE [ Generators the models
# hold ]).
GENERATORS = (torch.Generator, random.Random, np.random.Generator, np.random.RandomState)


# The types seen that are not GENERATORS: ``isinstance(v, torch.Generator)`` runs a metaclass's
# Python ``__instancecheck__`` since torch 2.13 (about 1 µs a value), and a module's attributes
# are mostly the same few types (dicts, bools, sets), which a C-level set test skips.
_OTHER_TYPES: set[type] = set()


def is_generator(value: Any) -> bool:
    """Whether ``value`` is one of GENERATORS (NOTE [ Generators the models hold ])."""
    cls = type(value)
    if cls in _OTHER_TYPES:
        return False
    if issubclass(cls, GENERATORS):
        return True
    if len(_OTHER_TYPES) > 4096:  # classes made on the fly: keep it bounded
        _OTHER_TYPES.clear()
    _OTHER_TYPES.add(cls)
    return False


def held_generators(module: nn.Module) -> list[Any]:
    """The generators ``module`` holds as attributes: ``torch.Generator``, ``random.Random``,
    NumPy's ``Generator`` and ``RandomState`` (NOTE [ Generators the models hold ])."""
    values = vars(module).values()
    if _OTHER_TYPES.issuperset(map(type, values)):
        return []
    return [v for v in values if is_generator(v)]


def draws_now(module: nn.Module) -> bool:
    """Whether ``module`` is a torch.nn layer that draws random numbers now: dropout with p of
    0 or 1 draws nothing (many models keep an ``nn.Dropout(0.0)`` as their default)."""
    if isinstance(module, nn.RReLU):
        return module.training
    if not isinstance(module, nn.modules.dropout._DropoutNd):
        return False
    if type(module) is nn.Dropout and not dropout_untouched():
        return True  # it may draw, in eval mode too (NOTE [ torch.nn's calls replaced ])
    if not module.training:
        return False
    p: float = module.p
    return 0 < p < 1


def layers_that_may_draw(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """Those of ``modules`` whose class may draw random numbers (``_DRAWING_LAYERS``), told by
    their classes at once: a set planned anew on every call (members drawn at random) asks
    ``has_drawing_layers``, ``draws_only_dropout`` and ``idle_dropout`` of its modules, each
    a Python call a module (0.10-0.16 ms for 48 tiny MLPs), where most models hold none."""
    kinds = [k for k in set(map(type, modules)) if issubclass(k, _DRAWING_LAYERS)]
    if not kinds:
        return []
    return [m for m in modules if type(m) in kinds]


def has_drawing_layers(modules: Iterable[nn.Module]) -> bool:
    """Whether any of ``modules`` is a torch.nn layer that draws random numbers now."""
    return any(map(draws_now, modules))


def idle_dropout(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """The dropout layers of ``modules`` that would draw if their p changed: a walk watches
    their attributes, so that a p changed from 0 makes a new walk, which sees them draw."""
    return [
        m
        for m in modules
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and not draws_now(m)
    ]


def draws_only_dropout(modules: Iterable[nn.Module]) -> bool:
    """Whether every layer of ``modules`` that draws now is an out-of-place ``nn.Dropout``
    (NOTE [ Dropout drawn beforehand ]), and one does."""
    drawing = [m for m in modules if draws_now(m)]
    return bool(drawing) and all(type(m) is nn.Dropout and not m.inplace for m in drawing)


def noise_key(x: Tensor) -> Hashable:
    """What the noise's shapes and dtypes depend on besides the models."""
    return (
        tuple(x.shape),
        x.dtype,
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
    )


def draw_noise(
    program: DirectProgram, shapes: Sequence[tuple[torch.Size, torch.dtype, torch.device, bool]]
) -> list[Tensor | None]:
    """Each ``nn.Dropout`` step's noise as F.dropout draws it on the CPU, where its call would
    draw (NOTE [ Dropout drawn beforehand ]); None where it would not."""
    layers = [step() for step in program.steps if not isinstance(step, tuple)]
    noise: list[Tensor | None] = []
    for layer, (shape, dtype, device, contiguous) in zip(
        (m for m in layers if type(m) is nn.Dropout), shapes
    ):
        assert isinstance(layer, nn.Dropout)
        keep = 1 - layer.p
        if draws_now(layer) and not layer.inplace and contiguous and all(shape):
            drawn = torch.empty(shape, dtype=dtype, device=device).bernoulli_(keep).div_(keep)
            noise.append(drawn)
        else:
            noise.append(None)
    return noise


class Turns:
    """Chunk k's turn to draw comes once chunks 0 to k - 1 had theirs (NOTE [ Dropout drawn
    beforehand ]); threads claim chunks in chunk order, so each waits on chunks running. A
    wait that ends in an exception (an interrupt) ends every later chunk's wait with an error:
    its turn would never come. Latches, not a Condition, whose Python code an interrupt could
    leave holding its lock (NOTE [ Locks and interrupts ] in _locks)."""

    def __init__(self) -> None:
        self._lock = Lock()
        self._next = 0
        self._broken = False
        self._turns: dict[int, Latch] = {}

    def _turn(self, k: int) -> Latch:
        with self._lock:
            turn = self._turns.get(k)
            if turn is None:
                turn = self._turns[k] = Latch()
                if self._next >= k or self._broken:
                    turn.set()
            return turn

    def wait(self, k: int) -> None:
        try:
            self._turn(k).wait()
        except BaseException:
            with self._lock:
                self._broken = True
                for turn in self._turns.values():
                    turn.set()
            raise
        if self._next < k:
            raise RuntimeError(f"chunk {k}'s turn to draw never came: an earlier one failed")

    def done(self, k: int) -> None:
        with self._lock:
            self._next = k + 1
            turn = self._turns.get(k + 1)
            if turn is not None:
                turn.set()


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
    warn_thread_timing(
        where,
        "random numbers were drawn during forwards running on several threads (by the models, "
        "or by another thread meanwhile), in an order that depends on the threads' timing, so "
        "this call's random numbers are not reproducible",
        "Random numbers in forwards",
        "_random",
        kept,
    )


def warn_thread_timing(
    where: str, what: str, note: str, module: str, kept: bool, then: str | None = None
) -> None:
    """Warn, at the caller's line, that ``what`` happened while a call's forwards (or
    pullbacks) ran on several threads, and what the next calls do about it (``kept``: the walk
    is remembered; ``then``: what they do, where not their forwards in model order); ``note``
    names the NOTE in parsum's ``module`` that says more."""
    if not kept:
        then = "pass the models as nn.Modules, whose calls are remembered, or use n_jobs=1"
    elif then is None:
        then = "the next calls with these models run their forwards in model order"
    warnings.warn(
        f"{where}: {what}; {then} (NOTE [ {note} ] in parsum.{module})",
        RuntimeWarning,
        stacklevel=callers_level(),
    )


# parsum's and torch's own frames, which a warning skips to name the user's line.
_INTERNAL = (os.path.dirname(__file__), os.path.dirname(torch.__file__))


def callers_level() -> int:
    """The ``stacklevel`` of the first frame outside parsum and torch, as seen from the
    function that calls this one."""
    frame, level = sys._getframe(2), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level
