"""FlatGrad: every parameter's ``.grad`` a view into one contiguous buffer per (dtype, device).

# NOTE [ Who writes a FlatGrad slot ]
# - ``sum_models``' backward writes the gradient of each parameter it owns into its slot from
#   the worker that ran the model's pullback, as soon as the pullback produced it (the
#   temporary is freed at once; autograd offers no way for a pullback to write into a given
#   buffer). It does so only where the running backward would itself accumulate into ``.grad``
#   (``backward()``, not ``torch.autograd.grad``) and the parameter carries no hook of the
#   user's; everywhere else the gradient goes back to autograd as usual.
# - Any other backward accumulates through autograd's AccumulateGrad: into the view in place
#   when ``.grad`` is set, else into a fresh tensor that a post-accumulate hook copies into the
#   slot before putting the view back.
# So a ``.grad`` set to None (``optimizer.zero_grad()``) gets its view back at the next backward.
#
# NOTE [ Buffer versions ]
# Every in-place write through any view bumps the buffer's version counter. A FlatGrad records
# the version after its own writes and after ``zero_()``: a compensation is trusted only if
# nobody wrote since parsum last did (else it is dropped: the values stay, only the refinement
# below their last bit is lost), and a buffer is known to be zero only if nothing was written
# since ``zero_()``. The latter makes a failed backward cheap to undo after ``zero_()``; in
# every other case the slots about to be accumulated into are copied first.
#
# NOTE [ Backward passes in several threads ]
# Threads training the same models (Hogwild in threads) run backward passes through one
# FlatGrad at once. Two hazards, found by 4 threads x 10-12 backward passes through 7 models:
# - A ``FlatWrites`` decides when it starts how it writes each slot (a copy where ``.grad`` was
#   None, else an add) and how it undoes them (saved values written back): two at once copied
#   over each other's gradients and one's undo over the other's (the worst parameter kept
#   2.5-48% of its gradient with a compensated FlatGrad, 90-100% without). So only the first
#   FlatWrites of a FlatGrad to start writes its slots; one that starts while another runs
#   (another thread's, or a nested call's in a helper) keeps its gradients and hands them in
#   at its commit, and the last FlatWrites to end (commit or rollback) adds in every gradient
#   handed in. A rollback of one that kept its gradients drops them: nothing of it was written.
#   The lock is held only around those few writes, never while anything else runs: no
#   deadlock, whatever nests.
# - In the caller's graph, autograd's AccumulateGrad makes a fresh ``.grad`` (under a lock of
#   its own, without the GIL) that the post-accumulate hook then moves into the slot, setting
#   ``.grad`` from Python while another thread's AccumulateGrad reads or adds to it: gradients
#   lost (1 of 40 runs) and a segmentation fault (within 100 runs; 2 of 3 processes of 100
#   runs with the first part alone). Python cannot take that lock. So from the first call
#   over its parameters in a thread other than the one that made the FlatGrad (a nested call
#   in a chunk counts as its caller's, whose backward runs it), calls take ParallelSum
#   (``ParamSlots.used_by_threads``), whose backward gives their AccumulateGrads None (which
#   touches no ``.grad``) and writes the slots through FlatWrites, under the GIL; a FlatGrad
#   made and trained in one thread keeps the caller's graph. Identical models run as one
#   group in the caller's graph (NOTE [ One group in the caller's graph ] in _stack) go the
#   same way: their ``torch.stack``'s backward feeds the same AccumulateGrads (lost gradients
#   in 7 of 8 runs, and a crash, before). Models in ``stack_`` storage keep their path: their
#   aliases' hooks write the block under the stack's lock. A fresh ``.grad`` the hook
#   meets while a FlatWrites runs (a backward of the user's own beside it) is left to that
#   FlatWrites' commit or to the last to end.
# A backward of the user's own that accumulates into the same parameters in another thread at
# the same time can still meet a FlatWrites' commit or the hook (docs/limits.md).
#
# NOTE [ Parameters trained in several threads ]
# Without a FlatGrad, a pullback accumulates into the ``.grad`` that are None (NOTE [
# Accumulating in the pullback ] in _function) and a failed backward sets them back to None
# from Python. Threads training the same models (Hogwild in threads), one of them failing now
# and then, lost the others' gradients that way (the failed one reset a ``.grad`` they had
# added to) and crashed the process (a segmentation fault or a corrupted heap in most runs of
# 15 of 4 threads x 12 backward passes, every third of one thread failing): another thread's
# AccumulateGrad writes that ``.grad`` under a lock of its own, which Python cannot take. So
# each call that builds a graph, and each backward, notes its thread as one that trains the
# call's parameters (``ParamTrainers``; a nested call in a chunk is part of its caller's, and
# autograd's device thread pulls back every thread's graphs); once a parameter is trained by a
# second thread, the calls over it neither accumulate in a pullback nor store a gradient: they
# return their gradients, which the engine accumulates under that lock, and a failed backward
# returns nothing and so changes nothing (capturing, a whole step at 2 threads in two runs:
# 0.98-1.02x the time of accumulating for 16 medium MLPs, 1.15-1.22x for 64 tiny ones, which
# also lose the join of NOTE [ Pullbacks joined later ] in _function). Threads that train
# models of their own keep accumulating. A backward that accumulates when a second thread's
# first call over its parameters comes leaves, if it fails, what it accumulated: setting it
# back could meet the other thread's engine. A parameter trained by one thread after another
# (the first gone) counts as trained by several.

# NOTE [ Frozen parameters' gradients ]
# ``zero_()`` is a FlatGrad's ``zero_grad()``: it zeroes the buffers and gives every trainable
# parameter its view again, and a parameter frozen since the FlatGrad was made (fine-tuning:
# ``requires_grad_(False)`` on a layer) keeps its slot, zeroed, but gets ``.grad`` None, as
# ``optimizer.zero_grad()`` leaves it. Given its zeroed view instead, an optimizer over it
# stepped it on every step with a zero gradient: momentum, Adam's moments and weight decay
# moved the frozen layer (2-4e-2 off the plain loop's after two steps of SGD with momentum),
# silently. Unfrozen, it gets its view back at the next ``zero_()`` or backward. The same for a
# block given as a stacked tensor's ``.grad`` (``FlatGrad(stack)``, NOTE [ One buffer for a
# stack ] in _stack): None while every parameter of the block is frozen. A trainable parameter
# that a step leaves out (a member not drawn, an expert not routed to) keeps its zeroed view:
# a FlatGrad cannot know before the backward which gradients will come, and an all-reduce of
# the buffer needs every rank's ``.grad`` to be the view the reduced values land in.
#
# NOTE [ Slots of no gradient ]
# ``optimizer.zero_grad()`` sets ``.grad`` to None and leaves the slots as they were, which the
# next backward overwrites where it writes. A slot it does not write (a frozen layer's, a
# member's not drawn, an expert's not routed to) kept the last step's gradient, and the buffer
# read whole counted it: ``flat.flat.norm()`` for a clip (the docs' own example), an
# all-reduce that handed it to every rank. Such a slot is nobody's gradient, so ``.flat`` and
# ``.buffers`` zero the slots whose parameter's ``.grad`` is None (or whose parameter is gone)
# before they give the buffers out, where no backward is writing them (its fresh slots are
# None until it ends); the slots zeroed are remembered with the buffer's version, so that a
# frozen layer's slot is zeroed once, not at every read. A reference to the buffer kept from
# an earlier read is read without that: take ``.flat`` again after the backward.
#
# NOTE [ Sparse gradients in a slot ]
# A parameter with a slot may get a row-sparse gradient (``parsum.take_rows``,
# ``nn.Embedding(sparse=True)``). ``sum_models`` adds its rows into the slot in place, at a cost
# in proportion to the rows; the ``.grad`` stays the dense view. Optimizers then see a dense
# gradient: to keep gradients sparse (``torch.optim.SparseAdam``, SGD steps that touch only
# the sampled rows), leave such a parameter out of the FlatGrad.
"""

from __future__ import annotations

import itertools
import operator
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.nn.parameter import UninitializedParameter

from ._engines import model_kind
from ._errors import ParsumError, a_kind_of
from ._locks import Lock
from ._sparse import OwnPostHook, handle_count, has_user_hooks, has_user_post_hooks
from ._summation import compensated_add_

_WHERE = "FlatGrad"

BufferKey = tuple[torch.dtype, torch.device]

# id(parameter) -> (FlatGrad, index of its slot): the last FlatGrad built over a parameter owns
# it. Held weakly: a FlatGrad lives as long as its parameters (their hooks hold it), never
# longer. An entry counts only while its FlatGrad lives and the slot holds that very tensor.
_owners: dict[int, tuple[weakref.ref[FlatGrad], int]] = {}


# A new object whenever a FlatGrad takes a parameter over: two changes at once in two threads
# give two values, where a count's ``+= 1`` could lose one and a reader miss the second.
_owners_changed = [object()]


def owners_generation() -> object:
    """A token, a new object whenever a parameter gets a new FlatGrad slot (a cache of
    ``owner_of`` answers stays good while it is unchanged and their FlatGrads live)."""
    return _owners_changed[0]


def owner_of(param: Tensor) -> tuple[FlatGrad, int] | None:
    entry = _owners.get(id(param))
    if entry is None:
        return None
    flat = entry[0]()
    if flat is None or flat._slots[entry[1]].param is not param:
        return None
    return flat, entry[1]


def _forget(ids: list[int]) -> None:
    for key in ids:
        entry = _owners.get(key)
        if entry is not None and entry[0]() is None:
            del _owners[key]
    _owners_changed[0] = object()  # a FlatGrad gone: ParamSlots find their slots again


@dataclass
class _Slot:
    """A parameter's place in a buffer. The parameter is held weakly: its hook holds the
    FlatGrad, so a strong reference back would be a cycle through C++, which the garbage
    collector cannot see (every FlatGrad and its models stayed alive for good)."""

    ref: weakref.ref[Tensor]
    key: BufferKey
    view: Tensor
    comp: Tensor | None

    @property
    def param(self) -> Tensor | None:
        return self.ref()


class FlatGrad:
    """One contiguous gradient buffer per (dtype, device); each ``.grad`` is a view into it.

    >>> import torch, parsum
    >>> models = [torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)]
    >>> flat = parsum.FlatGrad(models)
    >>> flat.flat.shape                                  # 2 * (2*3 + 2) gradient elements
    torch.Size([16])
    >>> parsum.sum_models(models, torch.ones(4, 3)).sum().backward()
    >>> models[0].bias.grad
    tensor([4., 4.])
    >>> flat.flat[6:8]                                   # the same memory
    tensor([4., 4.])

    Over a :class:`parsum.Stack` (``FlatGrad(stack)``) the slots go name by name, model after
    model, so that each name's gradients form one block shaped as the stacked tensor: the
    block is also that tensor's ``.grad``, so one buffer holds the models' gradients, the
    stack's and the FlatGrad's, and the stacked backward writes it with one kernel a name.

    >>> members = [torch.nn.Linear(3, 2) for _ in range(8)]
    >>> stack = parsum.stack_(members)
    >>> flat = parsum.FlatGrad(stack)
    >>> opt = torch.optim.SGD(stack.parameters(), lr=0.1)   # steps every model
    >>> parsum.sum_models(members, torch.ones(4, 3)).sum().backward()
    >>> stack.values["weight"].grad.data_ptr() == flat.flat.data_ptr()
    True
    >>> members[1].weight.grad.data_ptr() == stack.values["weight"].grad[1].data_ptr()
    True

    ``zero_()`` is its ``zero_grad()``: a parameter frozen since the FlatGrad was made gets
    ``.grad`` None, as ``optimizer.zero_grad()`` leaves it. After ``optimizer.zero_grad()``, a
    slot whose ``.grad`` is None reads zero in ``.flat`` and ``.buffers``.

    A parameter whose gradient comes row-sparse (:func:`parsum.take_rows`,
    ``nn.Embedding(sparse=True)``) has its rows added into its slot by ``sum_models`` (cost in
    proportion to the rows), so its ``.grad`` is dense; leave it out to keep a sparse ``.grad``
    for ``torch.optim.SparseAdam`` or row-only SGD steps.

    Args:
        params_or_modules: an ``nn.Module``, a parameter, or an iterable of them (nested
            iterables too). Every trainable parameter gets one slot, in order of first
            appearance: a parameter reached twice (tied weights) gets one slot, a frozen one
            (``requires_grad=False``) none. Parametrized modules
            (``torch.nn.utils.parametrize``) get slots for their underlying ``original``
            tensors, and layers whose weight is computed from several tensors for each of them.
            A :class:`parsum.Stack` is laid out name by name (above). A parameter's ``.grad``,
            if any, is copied into its slot.
        compensated: whether every accumulation into ``.grad`` by ``sum_models``' backward
            (repeated backward over micro-batches) is compensated (Kahan-Babuska-Neumaier): a
            second buffer per (dtype, device) keeps the part of each sum below ``.grad``'s last
            bit.

    Raises:
        ParsumError: for an item that is neither a module nor a tensor, a tensor that is not
            a leaf, a sparse parameter, or when there is no trainable parameter at all.
    """

    def __init__(
        self, params_or_modules: nn.Module | Tensor | Iterable[Any], *, compensated: bool = False
    ) -> None:
        if not isinstance(compensated, bool):
            raise ParsumError(
                f"{_WHERE}: compensated is {compensated!r} ({type(compensated).__name__}); "
                "expected True or False"
            )
        self._build(_collect_params(params_or_modules), compensated)

    def _build(self, params: list[Tensor], compensated: bool) -> None:
        """Slots for ``params`` (collected and checked), in their order; the buffers and views
        normal tensors also under ``torch.inference_mode`` (an inference tensor keeps no
        version, and autograd could not write into it)."""
        with torch.inference_mode(False):
            self._build_here(params, compensated)

    def _build_here(self, params: list[Tensor], compensated: bool) -> None:
        sizes: dict[BufferKey, int] = {}
        for p in params:
            key = (p.dtype, p.device)
            sizes[key] = sizes.get(key, 0) + p.numel()
        self.compensated = compensated
        self._buffers = {k: torch.zeros(n, dtype=k[0], device=k[1]) for k, n in sizes.items()}
        self._comps = (
            {k: torch.zeros(n, dtype=k[0], device=k[1]) for k, n in sizes.items()}
            if compensated
            else {}
        )
        offsets = dict.fromkeys(sizes, 0)
        self._slots: list[_Slot] = []
        for p in params:
            key = (p.dtype, p.device)
            start = offsets[key]
            offsets[key] += p.numel()
            comp = self._comps.get(key)
            self._slots.append(
                _Slot(
                    weakref.ref(p),
                    key,
                    _slot_view(self._buffers[key], p, start),
                    None if comp is None else _slot_view(comp, p, start),
                )
            )
        # Versions before the copies below: a buffer nothing was copied into is known zero.
        self._zero_versions = {k: b._version for k, b in self._buffers.items()}
        with torch.no_grad():
            for p, slot in zip(params, self._slots):
                if p.grad is not None:
                    slot.view.copy_(_dense(p.grad))
        self._views = [slot.view for slot in self._slots]
        self._refs = [slot.ref for slot in self._slots]
        # zero_()'s .grad wanted for each slot, and which parameters were trainable then
        self._trainable: list[bool] = []
        self._wanted: list[Tensor | None] = []
        # Where the views' and the parameters' data were and the parameters' dtypes when the
        # slots were last seen right: a cast, a move or data assigned changes one of them, and
        # only then are the slots looked at whole (NOTE [ Stale slots ]).
        self._ptrs = list(map(Tensor.data_ptr, self._views))
        self._param_ptrs = list(map(Tensor.data_ptr, params))
        self._dtypes = list(map(_dtype_of, params))
        self._checked_whole = False  # zero_()'s first call looks at every slot
        self._comp_versions: dict[BufferKey, int] = {}
        self._hooks: dict[int, Any] = {}
        self._held: set[int] = set()  # NOTE [ Slots filled after the join ]
        # Blocks given as a stacked tensor's ``.grad`` (``SlotBlock.give_to``), by the tensor's
        # id: the tensor, the block, the first slot and the number of slots.
        self._given_blocks: dict[int, tuple[weakref.ref[Tensor], Tensor, int, int]] = {}
        # NOTE [ Slots of no gradient ]: per buffer, its version after the orphaned slots were
        # zeroed, and those slots.
        self._orphans_zeroed: dict[BufferKey, tuple[int, set[int]]] = {}
        # NOTE [ Backward passes in several threads ]: FlatWrites running, the gradients
        # handed in by those that ran beside another, the slots whose fresh .grad waits.
        self._lock = Lock()  # reentrant: a FlatWrites' __del__ may end it
        self._writing = 0
        self._handed_in: list[tuple[_Slot, Tensor, Tensor]] = []
        self._unmoved: set[int] = set()
        # The thread that made it; whether sum_models was called over it from another
        self._maker = threading.get_ident()
        self._other_threads = False
        self._note_written()
        for index, p in enumerate(params):
            self._take_over(index, p)
        weakref.finalize(self, _forget, [id(p) for p in params])

    # -- public -------------------------------------------------------------------------------

    @property
    def buffers(self) -> dict[BufferKey, Tensor]:
        """The gradient buffers, keyed by ``(dtype, device)``; a slot whose parameter's
        ``.grad`` is None reads zero (NOTE [ Slots of no gradient ])."""
        self._zero_orphaned_slots()
        return dict(self._buffers)

    @property
    def flat(self) -> Tensor:
        """The gradient buffer, when all parameters share one dtype and device."""
        if len(self._buffers) != 1:
            keys = ", ".join(f"({d}, {v})" for d, v in self._buffers)
            raise ParsumError(
                f"{_WHERE}.flat: the parameters have {len(self._buffers)} (dtype, device) "
                f"pairs ({keys}), so there are as many buffers; use .buffers"
            )
        self._zero_orphaned_slots()
        return next(iter(self._buffers.values()))

    @property
    def params(self) -> list[Tensor]:
        """The parameters with a slot, in slot order (those still alive)."""
        return [p for slot in self._slots if (p := slot.param) is not None]

    def zero_(self) -> FlatGrad:
        """Zero every buffer and point every trainable parameter's ``.grad`` at its view
        again; a frozen one's ``.grad`` becomes None, as ``zero_grad()`` leaves it (NOTE
        [ Frozen parameters' gradients ])."""
        params = list(map(_deref, self._refs))
        alive = not any(map(operator.is_, params, repeat(None)))
        # Compared in C, list against list: looking at each slot took 0.4 ms of zero_()'s 0.7
        # (382 parameters, 2 cores).
        if not alive or not self._checked_whole or self._moved_any(cast(list[Tensor], params)):
            for index, p in enumerate(params):
                if p is not None:
                    self._check_slot(index, p, f"{_WHERE}.zero_")
                    self._seen_right(index, p)
            self._checked_whole = alive
        with torch.no_grad():
            for buffer in (*self._buffers.values(), *self._comps.values()):
                buffer.zero_()
        # Each .grad wanted: its view, or None where the parameter is frozen; made again only
        # where which are frozen changed (a loop over the slots costs 0.1 ms for 384)
        if alive:
            trainable = list(map(_requires_grad, params))
        else:
            trainable = [p is not None and p.requires_grad for p in params]
        if trainable != self._trainable:
            self._trainable = trainable
            self._wanted = [v if t else None for v, t in zip(self._views, trainable)]
        if not alive or not all(map(operator.is_, map(_grad_of, params), self._wanted)):
            for p, wanted in zip(params, self._wanted):
                if p is not None and p.grad is not wanted:  # assigning checks; reading is cheap
                    p.grad = wanted
        if self._given_blocks:
            self._drop_frozen_blocks()
        self._zero_versions = {k: b._version for k, b in self._buffers.items()}
        self._note_written()  # the compensations are zero and valid
        return self

    def _zero_orphaned_slots(self) -> None:
        """Zero the slots whose parameter's ``.grad`` is None (or whose parameter is gone),
        which hold gradients nobody refers to, before the buffers are read (NOTE [ Slots of
        no gradient ]); those zeroed since nothing else wrote the buffer are not zeroed again."""
        if not any(map(operator.is_, self._grads_now(), repeat(None))):
            return  # the usual case: every .grad set (passes in C: 30 us for 384)
        with self._lock:
            if self._writing:  # a backward writes the slots: its fresh ones are None until it ends
                return
            grads = self._grads_now()  # again, the lock held: a hook may have moved one in
            orphans: dict[BufferKey, list[int]] = {}
            for index in compress(range(len(grads)), map(operator.is_, grads, repeat(None))):
                orphans.setdefault(self._slots[index].key, []).append(index)
            for key, indexes in orphans.items():
                buffer = self._buffers[key]
                done = self._orphans_zeroed.get(key)
                zeroed = done[1] if done is not None and done[0] == buffer._version else set()
                todo = [i for i in indexes if i not in zeroed]
                if not todo:
                    continue
                ours = self._comp_versions.get(key) == buffer._version
                known_zero = self._zero_versions.get(key) == buffer._version
                tensors = [self._slots[i].view for i in todo]
                tensors += [c for i in todo if (c := self._slots[i].comp) is not None]
                with torch.no_grad():
                    torch._foreach_zero_(tensors)
                version = buffer._version
                if ours:  # nobody else wrote since parsum did: the compensations stay valid
                    self._comp_versions[key] = version
                if known_zero:
                    self._zero_versions[key] = version
                self._orphans_zeroed[key] = (version, zeroed | set(todo))

    def _grads_now(self) -> list[Tensor | None]:
        """Each slot's parameter's ``.grad``, None where the parameter is gone."""
        params = list(map(_deref, self._refs))
        if any(map(operator.is_, params, repeat(None))):
            return [None if p is None else p.grad for p in params]
        return list(map(_grad_of, params))

    def _drop_frozen_blocks(self) -> None:
        """``zero_()``'s part for blocks given as a stacked tensor's ``.grad``: None where every
        parameter of the block is frozen (NOTE [ Frozen parameters' gradients ])."""
        for key, (ref, block, first, count) in list(self._given_blocks.items()):
            stacked = ref()
            if stacked is None or stacked.grad is not block:
                del self._given_blocks[key]  # given no more
            elif not any(self._trainable[first : first + count]):
                stacked.grad = None
                del self._given_blocks[key]

    def __repr__(self) -> str:
        parts = ", ".join(f"{d}/{v}: {b.numel()}" for (d, v), b in self._buffers.items())
        return f"FlatGrad({len(self._slots)} parameters; {parts}; compensated={self.compensated})"

    # NOTE [ A copied FlatGrad ]
    # A slot holds its parameter weakly, and ``copy.deepcopy`` hands a weak reference over as
    # it is: a deep copy of ``(models, flat)`` pointed at the original parameters, so the copy's
    # ``zero_()`` made the originals' ``.grad`` views of the copy's buffer, while the copies'
    # gradients never reached it (its ``flat`` stayed zero: a clip by its norm clipped
    # nothing). A copy, or an unpickled FlatGrad, is one over the copies of the parameters
    # (the ones copied with it, where the models are: copy and pickle keep identities within
    # one call), holding the values of the original's slots and compensations.
    # Each parameter's ``.grad`` goes with it as the original holds it: None (after
    # ``optimizer.zero_grad()``, or frozen after ``zero_()``), or its values, in the slot or
    # outside it (set by hand). ``copy.deepcopy`` and pickling of an ``nn.Parameter`` leave its
    # ``.grad`` behind, and a copy whose every ``.grad`` was its view had added its next
    # backward to the gradients that the original's ``zero_grad()`` had dropped.
    def __getstate__(self) -> dict[str, Any]:
        live = [slot for slot in self._slots if slot.param is not None]
        grads = [cast(Tensor, slot.param).grad for slot in live]
        outside = [
            g is not None and g is not slot.view and not _is_view_of(g, slot.view)
            for slot, g in zip(live, grads)
        ]
        values: list[Tensor] = []
        comps: list[Tensor | None] = []
        for slot, g, out in zip(live, grads, outside):
            values.append((_dense(g) if out and g is not None else slot.view).detach().clone())
            comp = slot.comp
            comps.append(None if comp is None else torch.zeros_like(comp) if out else comp.clone())
        return {
            "params": [slot.param for slot in live],
            "compensated": self.compensated,
            "values": values,
            "comps": comps,
            "no_grad": [g is None for g in grads],
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        # The same slots as the original's, frozen parameters' included (a FlatGrad made
        # anew over them would leave those out, and the values would not fall in place); their
        # hooks too, which autograd registers only on a tensor that requires grad: these are
        # the copy's own new tensors, frozen again right after.
        frozen = [p for p in state["params"] if not p.requires_grad]
        for p in frozen:
            p.requires_grad_(True)
        try:
            self._build(state["params"], state["compensated"])
        finally:
            for p in frozen:
                p.requires_grad_(False)
        with torch.no_grad():
            for slot, value, comp in zip(self._slots, state["values"], state["comps"]):
                slot.view.copy_(value)
                if slot.comp is not None and comp is not None:
                    slot.comp.copy_(comp)
        for p, none in zip(state["params"], state.get("no_grad", ())):
            if none:
                p.grad = None
        self._zero_versions = {}
        self._note_written()

    # -- internal -----------------------------------------------------------------------------

    def _take_over(self, index: int, p: Tensor) -> None:
        previous = owner_of(p)
        if previous is not None:
            previous[0]._release(previous[1])
        _owners[id(p)] = (weakref.ref(self), index)
        _owners_changed[0] = object()
        p.grad = self._slots[index].view
        hook = OwnPostHook(_after_accumulate, self, index, self._slots[index].view)
        self._hooks[index] = p.register_post_accumulate_grad_hook(hook)

    def _release(self, index: int) -> None:
        handle = self._hooks.pop(index, None)
        if handle is not None:
            handle.remove()

    def _check_slot(self, index: int, p: Tensor, where: str, who: str = "a parameter") -> None:
        """Refuse a parameter cast, moved or resized since its slot was made (NOTE [ Stale
        slots ])."""
        slot = self._slots[index]
        view = slot.view  # a cast with .grad set replaces the view's own data
        if (
            slot.key != (p.dtype, p.device)
            or slot.key != (view.dtype, view.device)
            or view.shape != p.shape
            # cast there and back (.double().float()), or to channels_last: the same dtype,
            # but data of its own, which the buffer no longer sees
            or view.untyped_storage().data_ptr()
            != self._buffers[slot.key].untyped_storage().data_ptr()
        ):
            raise ParsumError(
                f"{where}: {who} of shape {tuple(p.shape)} is now {p.dtype} on {p.device}, "
                f"and its FlatGrad slot {slot.key[0]} on {slot.key[1]} of shape "
                f"{tuple(slot.view.shape)}, its .grad no longer in the FlatGrad's buffer: its "
                "module was cast, moved or resized after the FlatGrad was made (also there "
                "and back, or to another memory format); make a new FlatGrad over it (it "
                "takes the parameters over), and make FlatGrads after .to(), .double() or "
                ".half()"
            )

    def _moved_any(self, params: list[Tensor]) -> bool:
        """Whether a parameter's or a view's data moved or a dtype changed since last seen."""
        return (
            list(map(Tensor.data_ptr, params)) != self._param_ptrs
            or list(map(Tensor.data_ptr, self._views)) != self._ptrs
            or list(map(_dtype_of, params)) != self._dtypes
        )

    def _moved(self, index: int, param: Tensor) -> bool:
        """``_moved_any`` for one slot."""
        return (
            param.data_ptr() != self._param_ptrs[index]
            or self._views[index].data_ptr() != self._ptrs[index]
            or param.dtype != self._dtypes[index]
        )

    def _seen_right(self, index: int, param: Tensor) -> None:
        """Remember where slot ``index``'s data are, after ``_check_slot`` passed."""
        self._param_ptrs[index] = param.data_ptr()
        self._ptrs[index] = self._views[index].data_ptr()
        self._dtypes[index] = param.dtype

    def _reattach(self, index: int, param: Tensor) -> None:
        """After autograd accumulated into a fresh tensor, move it into the slot."""
        if index in self._held:  # NOTE [ Slots filled after the join ]
            return
        view, grad = self._slots[index].view, param.grad
        if grad is None or grad is view or _is_view_of(grad, view):
            return
        with self._lock:
            if self._writing:  # NOTE [ Backward passes in several threads ]
                self._unmoved.add(index)
            else:
                self._move_in(index, param)

    def _move_in(self, index: int, param: Tensor) -> None:
        """``_reattach``'s move, the lock held."""
        view, grad = self._slots[index].view, param.grad
        if grad is None or grad is view or _is_view_of(grad, view):
            return
        # Every optimizer's zero_grad() leaves .grad None, so this runs for every parameter of
        # every step, where whole checks cost 9 us a parameter (2 cores). A cast, a move or
        # data assigned moves the parameter's data or the view's: the slot is looked at whole
        # only then (NOTE [ Stale slots ]).
        if self._moved(index, param):
            self._check_slot(index, param, _WHERE)
            self._seen_right(index, param)
        if grad.requires_grad:  # create_graph: copied without its history
            grad = grad.detach()  # (``torch.no_grad()`` costs 3 us a call here)
        view.copy_(_dense(grad))
        param.grad = view

    def _reattach_all(self, pairs: list[tuple[int, Tensor]]) -> None:
        """``_reattach`` of each ``(index, param)``, the usual ones' copies in one foreach call
        (one by one, the 382 parameters of 64 tiny MLPs took 1.3 ms after a join)."""
        views: list[Tensor] = []
        grads: list[Tensor] = []
        params: list[Tensor] = []
        with self._lock:
            for index, param in pairs:
                view, grad = self._views[index], param.grad
                if grad is None or grad is view:
                    continue
                if self._writing:  # NOTE [ Backward passes in several threads ]
                    self._unmoved.add(index)
                elif (
                    grad.layout != torch.strided  # sparse: densified, one by one
                    or grad.requires_grad
                    or self._moved(index, param)
                    or _is_view_of(grad, view)
                ):
                    self._move_in(index, param)
                else:
                    views.append(view)
                    grads.append(grad)
                    params.append(param)
            if views:
                torch._foreach_copy_(views, grads)
                for param, view in zip(params, views):
                    param.grad = view

    def _called_from(self, thread: int) -> bool:
        """Note a call of ``sum_models`` from ``thread`` over these parameters; whether calls
        from more than one thread have used them (NOTE [ Backward passes in several threads ])."""
        if thread != self._maker:
            self._other_threads = True
        return self._other_threads

    def _start_writes(self) -> bool:
        """Count a FlatWrites in; whether it runs alone, so writes the slots itself (NOTE
        [ Backward passes in several threads ])."""
        with self._lock:
            self._writing += 1
            return self._writing == 1

    def _end_writes(self, kept: list[tuple[_Slot, Tensor, Tensor]]) -> None:
        """Count a FlatWrites out, handing in the gradients it kept; the last one out adds in
        every gradient handed in and moves in every fresh ``.grad`` that waited."""
        with self._lock:
            self._handed_in.extend(kept)
            self._writing -= 1
            if self._writing or not (self._handed_in or self._unmoved):
                return
            handed_in, self._handed_in = self._handed_in, []
            unmoved, self._unmoved = self._unmoved, set()
            for key in self._buffers:
                self._drop_stale_compensation(key)
            with torch.no_grad():
                for slot, param, grad in handed_in:
                    self._add_in(slot, param, grad)
                for index in sorted(unmoved):
                    waiting = self._slots[index].param
                    if waiting is not None and index not in self._held:
                        self._move_in(index, waiting)
            self._note_written()

    def _add_in(self, slot: _Slot, param: Tensor, grad: Tensor) -> None:
        """Add ``grad`` to ``param``'s gradient in its slot, which becomes its ``.grad``, the
        lock held."""
        view, current = slot.view, param.grad
        if current is None or not (current is view or _is_view_of(current, view)):
            _copy_to_slot(slot, grad if current is None else current.detach())
            param.grad = view
            if current is None:
                return
        _add_to_slot(slot, _dense(grad))

    def _note_written(self) -> None:
        self._comp_versions = {k: b._version for k, b in self._buffers.items()}

    def _drop_stale_compensation(self, key: BufferKey) -> None:
        """Zero buffer ``key``'s compensation if someone else wrote to the buffer since parsum
        last did (NOTE [ Buffer versions ])."""
        if self.compensated and self._comp_versions.get(key) != self._buffers[key]._version:
            self._comps[key].zero_()

    def _known_zero(self, key: BufferKey) -> bool:
        """Whether nothing was written to buffer ``key`` since ``zero_()`` (NOTE [ Buffer
        versions ]); a write through ``.grad.data`` bumps no version: the buffer is read to be
        sure."""
        buffer = self._buffers[key]
        return self._zero_versions.get(key) == buffer._version and _all_zero(buffer)


_deref = weakref.ref.__call__
_grad_of = operator.attrgetter("grad")
_requires_grad = operator.attrgetter("requires_grad")
_dtype_of = operator.attrgetter("dtype")


def _after_accumulate(flat: FlatGrad, index: int, view: Tensor, param: Tensor) -> None:
    """A FlatGrad's post-accumulate hook: autograd calls it for every parameter in every
    backward, twice in ``sum_models``' (the pullback's accumulation, then the None its node
    returns), so the usual case, ``.grad`` still the slot's view, returns at once (the call
    through the bound method cost 2 us against 1 for this, 64 tiny MLP classes, 2 cores)."""
    if param.grad is not view:
        flat._reattach(index, param)


def _copy_to_slot(slot: _Slot, grad: Tensor) -> None:
    """Copy a gradient into a slot in place, its compensation zeroed."""
    slot.view.copy_(_dense(grad))
    if slot.comp is not None:
        slot.comp.zero_()


def _add_to_slot(slot: _Slot, grad: Tensor) -> None:
    """Add a dense gradient into a slot in place, compensated where the FlatGrad is."""
    if slot.comp is None:
        slot.view.add_(grad)
    else:
        compensated_add_([slot.view], [slot.comp], [grad])


def _all_zero(buffer: Tensor) -> bool:
    """Whether every value of ``buffer`` is zero (a NaN is not), read in every backward into a
    FlatGrad after ``zero_()``. A large buffer by its least and greatest value: ``any()``
    converts every value to bool, 3x slower (2M floats, the 16 medium MLPs': 0.57 against 0.18
    ms on 2 threads, 0.90 against 0.34 on one); below ALL_ZERO_BY_RANGE elements ``any()``,
    one kernel where three would save under 0.02 ms (113k floats: 0.032 against 0.021)."""
    if buffer.numel() < ALL_ZERO_BY_RANGE or buffer.is_complex():
        return not bool(buffer.any())
    low, high = torch.aminmax(buffer)
    return bool((low == 0) & (high == 0))


ALL_ZERO_BY_RANGE = 1 << 20


@dataclass
class SlotBlock:
    """Consecutive slots of one FlatGrad buffer that hold ``params`` in order, contiguous: one
    block shaped ``(len(params), *shape)`` (NOTE [ One buffer for a stack ] in _stack)."""

    owner: weakref.ref[FlatGrad]
    key: BufferKey
    views: list[Tensor]  # the slots' views, each parameter's ``.grad`` when it holds one
    block: Tensor
    comp: Tensor | None
    first: int  # the first slot's index

    def give_to(self, stacked: Tensor) -> None:
        """Make the block ``stacked``'s ``.grad``, which the FlatGrad's ``zero_()`` sets to
        None while every parameter of the block is frozen (NOTE [ Frozen parameters'
        gradients ])."""
        stacked.grad = self.block
        flat = self.owner()
        if flat is not None:
            flat._given_blocks[id(stacked)] = (
                weakref.ref(stacked),
                self.block,
                self.first,
                len(self.views),
            )

    def zero_(self) -> None:
        """Zero the block's gradients and their compensation, in place."""
        with torch.no_grad():
            self.block.zero_()
            if self.comp is not None:
                self.comp.zero_()

    def write(self, params: Sequence[Tensor], grad: Tensor, fresh: bool, held: bool) -> None:
        """Copy (``fresh``: the slots hold no gradient) or add (compensated where the FlatGrad
        is) a stacked gradient into the block; every ``.grad`` becomes its view (``held``:
        they are already)."""
        flat = self.owner()
        assert flat is not None  # checked by the caller
        flat._drop_stale_compensation(self.key)
        if fresh:
            self.block.copy_(grad)
            if self.comp is not None:
                self.comp.zero_()
        elif self.comp is not None:
            compensated_add_([self.block], [self.comp], [grad])
        else:
            self.block.add_(grad)
        if not held:
            for p, view in zip(params, self.views):
                p.grad = view
        flat._note_written()


def slot_block(params: Sequence[Tensor]) -> SlotBlock | None:
    """The block of FlatGrad slots holding ``params`` (same shapes), if they are laid out so."""
    found = owner_of(params[0])
    if found is None:
        return None
    flat, first = found
    slots = flat._slots[first : first + len(params)]
    if len(slots) != len(params) or not all(map(operator.is_, [s.ref() for s in slots], params)):
        return None
    key, shape = slots[0].key, params[0].shape
    numel, start = params[0].numel(), slots[0].view.storage_offset()
    for k, slot in enumerate(slots):
        view = slot.view
        if (
            slot.key != key
            or view.shape != shape
            or view.storage_offset() != start + k * numel
            or not view.is_contiguous()
        ):
            return None
    size, stacked_shape = len(params) * numel, (len(params), *shape)
    block = flat._buffers[key].narrow(0, start, size).view(stacked_shape)
    comp = flat._comps.get(key)
    if comp is not None:
        comp = comp.narrow(0, start, size).view(stacked_shape)
    return SlotBlock(weakref.ref(flat), key, [s.view for s in slots], block, comp, first)


def _collect_params(items: Any) -> list[Tensor]:
    found: list[Tensor] = []
    seen: set[int] = set()

    def add(p: Tensor, where: str) -> None:
        if not p.requires_grad or id(p) in seen:
            return
        if isinstance(p, UninitializedParameter):
            raise ParsumError(
                f"{_WHERE}: {where} is a lazy parameter that is not initialized yet, so its "
                "size is unknown; call its module once first (for example on one batch under "
                "torch.no_grad())"
            )
        if not p.is_leaf:
            raise ParsumError(
                f"{_WHERE}: {where} is a tensor computed from others (grad_fn "
                f"{type(p.grad_fn).__name__}), not a leaf; pass the parameters it is computed "
                "from, or the module that holds them"
            )
        if p.layout != torch.strided:
            raise ParsumError(
                f"{_WHERE}: {where} has layout {p.layout}; only dense (strided) parameters "
                "get a slot"
            )
        seen.add(id(p))
        found.append(p)

    def visit(item: Any, where: str) -> None:
        by_name = getattr(item, "_flat_grad_order", None)
        if by_name is not None:  # a parsum.Stack: NOTE [ One buffer for a stack ]
            for label, p in by_name():
                add(p, f"{where or 'params_or_modules'}{label}")
        elif isinstance(item, nn.Module):
            for name, p in item.named_parameters():
                add(p, f"{where}.{name}" if where else name)
        elif isinstance(item, Tensor):
            add(item, where or "the tensor")
        elif isinstance(item, (str, bytes)) or not isinstance(item, Iterable):
            raise ParsumError(
                f"{_WHERE}: {where or 'params_or_modules'} is {a_kind_of(item)} "
                f"({item!r:.60}); expected an nn.Module, a parameter, or an iterable of them"
            )
        else:
            for i, sub in enumerate(item):
                visit(sub, f"{where or 'params_or_modules'}[{i}]")

    visit(items, "")
    if not found:
        raise ParsumError(
            f"{_WHERE}: params_or_modules holds no trainable parameter (all are frozen, or "
            "there are none); there is nothing to give a gradient buffer"
        )
    return found


def _slot_view(buffer: Tensor, p: Tensor, start: int) -> Tensor:
    """A view of ``buffer[start : start + p.numel()]`` with ``p``'s shape and memory layout."""
    # empty_like keeps the strides of a dense parameter (channels_last, transposed) and makes
    # any other one contiguous; the meta device allocates nothing.
    strides = torch.empty_like(p, device="meta").stride()
    return buffer.as_strided(p.shape, strides, buffer.storage_offset() + start)


def _dense(grad: Tensor) -> Tensor:
    """A sparse gradient (``nn.Embedding(sparse=True)``) densified for its dense slot."""
    return grad if grad.layout == torch.strided else grad.to_dense()


def _is_view_of(grad: Tensor, view: Tensor) -> bool:
    return (
        grad.layout == torch.strided
        and grad.data_ptr() == view.data_ptr()
        and grad.stride() == view.stride()
        and grad.shape == view.shape
    )


def engine_runs(node: Any) -> bool:
    """Whether the running backward will run ``node`` (a parameter's AccumulateGrad).

    True under ``backward()`` (with ``inputs`` listing the parameter if given); False under
    ``torch.autograd.grad``, which captures the gradient instead, or when the node is not
    reached. Must be called from the thread that runs the backward.
    """
    if node is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except (AttributeError, RuntimeError):  # autograd.grad capturing it, or no such API
        return False


def engine_runs_all(nodes: Sequence[Any]) -> list[bool]:
    """``engine_runs`` of every node, in one C loop where none raises (the usual case)."""
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if will_execute is not None and None not in nodes:
        try:
            return list(map(bool, map(will_execute, nodes)))
        except RuntimeError:  # a captured leaf: no AccumulateGrad runs (NOTE [ Asking what
            # the backward wants ])
            return [not isinstance(node, _ACCUMULATE_GRAD) and engine_runs(node) for node in nodes]
    return [engine_runs(node) for node in nodes]


_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]


def wanted_gradients(tensors: Sequence[Tensor | None]) -> list[bool]:
    """Whether the running backward wants each tensor's gradient (NOTE [ Gradients not
    wanted ] in _inline): it needs a gradient and the backward runs its node, or captures its
    gradient (a leaf that ``torch.autograd.grad`` asks for)."""
    return list(map(wanted_at, (_node_of(t) for t in tensors)))


def _node_of(t: Tensor | None) -> Any:
    return get_gradient_edge(t).node if t is not None and t.requires_grad else None


def wanted_at(node: Any) -> bool:
    """``wanted_gradients`` of the tensor whose gradient edge ends at ``node`` (None for one
    that needs no gradient; NOTE [ Asking what the backward wants ])."""
    if node is None:
        return False
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if will_execute is None:
        return True
    try:
        return bool(will_execute(node))
    except RuntimeError:  # a leaf whose gradient autograd.grad captures
        return True


def wanted_inputs(
    node: Any, first: int, count: int, groups: Sequence[Sequence[int]] | None = None
) -> list[bool]:
    """``wanted_at`` the ``count`` tensor inputs of ``node`` (a Function's ``ctx`` in its
    backward) from its ``first``; with ``groups`` (positions among those, a model's parameters
    each), a group's inputs are all wanted where one is (NOTE [ Asking what the backward
    wants ])."""
    nodes = [edge[0] for edge in node.next_functions[first : first + count]]
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if will_execute is not None and None not in nodes:
        try:  # in one C loop where none raises (none captured: all but autograd.grad's)
            return list(map(bool, map(will_execute, nodes)))
        except RuntimeError:
            pass
    if groups is None:
        return list(map(wanted_at, nodes))
    wanted = [False] * count
    for group in groups:
        if any(wanted_at(nodes[k]) for k in group):
            for k in group:
                wanted[k] = True
    return wanted


# NOTE [ Asking what the backward wants ]
# ``torch._C._will_engine_execute_node`` answers for a tensor's node in about 0.1 us, but a
# leaf that ``torch.autograd.grad`` captures makes it raise, which costs 8.5 us (a C++ error with
# its backtrace, made into a Python one); and ``get_gradient_edge`` finds a parameter's node
# through a view of it made for the purpose, 2.5 us. So the nodes are read from the node's own
# ``next_functions``, and the parameters are asked about a model at a time: its parameters are
# wanted together, so that a backward capturing every parameter raises once a model, not once
# a parameter. A model of whose parameters the backward wants some gets the others' gradients
# too, which autograd drops. In a backward that captures, no AccumulateGrad runs: once one has
# raised, every other is known not to run (``engine_runs_all``) without asking. Measured in one
# run of benchmarks/bench_against.py on 2 cores, against asking each tensor: the gradient in
# the parameters (``--step grad-params``) of 64 tiny MLP classes 12.6 -> 8.5 ms (the plain
# loop's 8.2), of 16 MLPs of widths 128-512 at batch 64 9.4 -> 8.3 (9.5); in x alone
# (``--step grad-x``) 7.6 -> 6.7 (5.3) and 6.8 -> 6.5 (6.4); a gradient penalty 24.8 -> 22.4
# (15.6) and 29.4 -> 28.8 (21.3); a training step with ``backward()``, which asks nothing,
# the same.


# NOTE [ Stale slots ]
# A slot is a view of one dtype, device and shape. A module cast or moved after its FlatGrad was
# made (``.double()``, ``.to("cuda")``) casts a ``.grad`` that is set into a tensor of its own,
# which the FlatGrad then silently no longer held (``flat.flat`` stayed zero while the
# optimizer stepped); where ``.grad`` was None, the next backward failed in the FlatGrad's hook
# with autograd's dtype error, blamed on a model. Such a parameter is refused, naming the
# change, by ``sum_models`` before anything runs (looked for when it plans anew: a cast or move
# gives the parameter a new storage; stacked storage, after restacking the models, on every call
# until the slots fit), by the hook where it would copy a gradient into the slot,
# and by ``zero_()``. A cast with ``.grad`` set keeps the view object but swaps its data (the
# view's own dtype and device tell, and its storage, which is no longer the buffer's, where the
# dtype is the same again: ``.double().float()``, ``.to(memory_format=torch.channels_last)``):
# a plain backward then adds into it until the gradients are zeroed, when ``zero_()`` or the
# next backward's hook names the parameter.


def check_slots(
    models: Sequence[Any], names: Sequence[Sequence[str]], tensors: Sequence[Sequence[Tensor]]
) -> None:
    """Refuse the models' parameters (``names`` and ``tensors``, model by model) whose FlatGrad
    slot no longer fits them (NOTE [ Stale slots ])."""
    if not _owners:
        return
    for i, (model, model_names, model_tensors) in enumerate(zip(models, names, tensors)):
        for name, p in zip(model_names, model_tensors):
            found = owner_of(p)
            if found is not None:
                who = f"parameter {name!r} of models[{i}] ({model_kind(model)})"
                found[0]._check_slot(found[1], p, "sum_models", who)


def has_flat_grads(params: Sequence[Tensor]) -> bool:
    """Whether any of ``params`` has a slot in a FlatGrad."""
    return bool(_owners) and any(owner_of(p) is not None for p in params)


def has_compensated_flat_grads(params: Sequence[Tensor]) -> bool:
    """Whether any of ``params`` has a slot in a FlatGrad with ``compensated=True``."""
    if not _owners:
        return False
    return any((o := owner_of(p)) is not None and o[0].compensated for p in params)


# NOTE [ Parameters trained in several threads ]: while one thread alone has trained, nothing
# is recorded per parameter (a walk made for every call would pay for it on every call: 0.09
# ms for 384 parameters, recorded and released; 0.6 ms in a WeakIdKeyDictionary); the
# trainers that thread noted wait in _first_noted and are recorded when a second thread
# comes. Then each parameter's trainer is recorded by id, with the count of live walks that
# recorded it: a walk holds its parameters, so no other tensor can take that id while the
# record stands, and no weak reference to a parameter is made (``torch.utils.swap_tensors``,
# which ``load_state_dict`` uses with the swap on, refuses a tensor that has one). Two threads
# training a parameter at once both hold a walk over it. Calls that plan anew every time
# (NOTE [ Reused plans ] in _plans) hold theirs for the call alone: where no walk over a
# parameter is alive, its record is gone, and the next thread to train it starts as a first
# thread (with the window told above).
_first_thread: list[int | None] = [None]  # while one thread alone has trained, that thread
_first_noted: weakref.WeakSet[ParamTrainers] = weakref.WeakSet()
_trainer_of: dict[int, list[int]] = {}  # id(p) -> [thread or _SEVERAL, walks recording it]
_released: list[list[int]] = []  # the ids recorded by walks gone, dropped at the next look
_SEVERAL = -1  # thread identifiers are not negative
_trainers_changed = [0]  # bumped whenever a parameter is found trained by a second thread
_TRAINERS_LOCK = Lock()


def trainer_of(p: Tensor) -> int | None:
    """The thread that trains ``p``, ``_SEVERAL``, or None where none is recorded."""
    found = _trainer_of.get(id(p))
    return None if found is None else found[0]


class ParamTrainers:
    """The threads that train a walk's parameters (NOTE [ Parameters trained in several
    threads ]): looked at again only when this walk is used from another thread or some
    parameter anywhere got a second trainer."""

    __slots__ = ("__weakref__", "_params", "_recorded", "_seen", "_several", "_thread")

    def __init__(self, params: Sequence[Tensor]) -> None:
        self._params = params
        self._thread: int | None = None  # the thread noted last
        self._seen = -1  # _trainers_changed when last looked
        self._several = False
        self._recorded = False  # counted in _trainer_of

    def __del__(self) -> None:
        if self._recorded:  # a list's append: no lock, which a collection here may hold
            _released.append(list(map(id, self._params)))

    def several(self, note: bool) -> bool:
        """Note the calling thread as one that trains the parameters (``note``); whether some
        parameter is trained by more than one thread."""
        if self._several:
            return True
        thread = threading.get_ident() if note else None
        if self._seen != _trainers_changed[0] or (note and thread != self._thread):
            with _TRAINERS_LOCK:
                self._look(thread)
        return self._several

    def _look(self, thread: int | None) -> None:
        while _released:
            for key in _released.pop():
                found = _trainer_of.get(key)
                if found is not None:
                    found[1] -= 1
                    if found[1] <= 0:
                        del _trainer_of[key]
        first = _first_thread[0]
        if first is not None or not _trainer_of:  # one thread alone has trained, or none
            if thread is None or first in (None, thread):
                if thread is not None:
                    _first_thread[0] = self._thread = thread
                    _first_noted.add(self)
                self._seen = _trainers_changed[0]
                return
            # A second thread: what the first trained is recorded now.
            _first_thread[0] = None
            for noted in list(_first_noted):
                noted._record(first)
            _first_noted.clear()
        self._record(thread)

    def _record(self, thread: int | None) -> None:
        several = changed = False
        counting = thread is not None and not self._recorded
        for p in self._params:
            found = _trainer_of.get(id(p))
            if found is None:
                if counting:
                    _trainer_of[id(p)] = [thread, 1]  # type: ignore[list-item]
                continue
            if counting:
                found[1] += 1
            if found[0] == _SEVERAL:
                several = True
            elif thread is not None and found[0] != thread:
                found[0] = _SEVERAL
                several = changed = True
        self._recorded = self._recorded or counting
        if changed:
            _trainers_changed[0] += 1
        if thread is not None:
            self._thread = thread
        self._seen = _trainers_changed[0]
        self._several = several


class ParamSlots:
    """Where the parameters of a kept walk (a fixed list) have FlatGrad slots, as runs of
    consecutive slots of one FlatGrad (a FlatGrad over the models in their order: one run),
    found again only where a FlatGrad took one over or one of theirs is gone
    (``owners_generation``); and whether none has a hook of the user's, looked at again only
    where a hook was registered since. Per parameter and call, ``zeroed_slot_views`` took 1.1
    ms of a 10 ms backward (64 tiny MLP classes, 382 parameters, 2 cores)."""

    def __init__(self, params: list[Tensor]) -> None:
        self.params = params
        self._generation: object = None  # no generation yet
        # (FlatGrad or None, first slot, length), covering the parameters in order
        self._runs: list[tuple[weakref.ref[FlatGrad] | None, int, int]] = []
        self._compensated = False
        self._hookless_at: tuple[int | None, object] | None = None

    def _refresh(self) -> None:
        """Find the slots again where a FlatGrad took a parameter over or one is gone."""
        if self._generation != _owners_changed[0]:
            self._find()

    def _find(self) -> None:
        self._generation = _owners_changed[0]  # read first: a change while finding shows next
        runs: list[tuple[weakref.ref[FlatGrad] | None, int, int]] = []
        compensated = False
        last: tuple[FlatGrad | None, int] = (None, -1)
        for p in self.params:
            owner = owner_of(p)
            flat, index = owner if owner is not None else (None, -1)
            compensated = compensated or (flat is not None and flat.compensated)
            if runs and last[0] is flat and (flat is None or index == last[1] + 1):
                ref, first, n = runs[-1]
                runs[-1] = (ref, first, n + 1)
            else:
                runs.append((None if flat is None else weakref.ref(flat), index, 1))
            last = (flat, index)
        self._runs = runs
        self._compensated = compensated
        self._hookless_at = None

    def any_slot(self) -> bool:
        """Whether a parameter has a slot (``views()`` without making the list)."""
        self._refresh()
        return any(ref is not None for ref, _, _ in self._runs)

    def views(self) -> list[Tensor | None] | None:
        """Each parameter's slot view (None where it has none); None where none has one."""
        self._refresh()
        if all(ref is None for ref, _, _ in self._runs):
            return None
        views: list[Tensor | None] = []
        for ref, first, n in self._runs:
            if ref is None:
                views.extend(repeat(None, n))
                continue
            flat = ref()
            if flat is None:  # gone after the generation was read: looked up again
                self._generation = None
                return self.views()
            views.extend(flat._views[first : first + n])
        return views

    def hold_unset(self) -> list[tuple[FlatGrad, int, Tensor]]:
        """The slots of the parameters whose ``.grad`` is None, their hooks held until
        ``release_slots`` (NOTE [ Slots filled after the join ])."""
        self._refresh()
        held: list[tuple[FlatGrad, int, Tensor]] = []
        at = 0
        for ref, first, n in self._runs:
            flat = None if ref is None else ref()
            if flat is not None:
                grads = map(_grad_of, self.params[at : at + n])
                for index, p, grad in zip(itertools.count(first), self.params[at : at + n], grads):
                    if grad is None:
                        flat._held.add(index)
                        held.append((flat, index, p))
            at += n
        return held

    def unhooked_owners(self) -> list[tuple[FlatGrad, int] | None] | None:
        """Each parameter's FlatGrad and slot index (None where it has no slot), read from the
        runs, where no parameter has a hook of the user's (``_hookless``); else None, and
        ``owner_of`` and the hooks are looked at parameter by parameter (FlatWrites)."""
        views = self.views()
        if views is None or not self._hookless(views):
            return None
        owners: list[tuple[FlatGrad, int] | None] = []
        for ref, first, n in self._runs:
            flat = None if ref is None else ref()
            if flat is None:
                if ref is not None:  # gone after the generation was read
                    return None
                owners.extend(repeat(None, n))
            else:
                owners.extend(zip(repeat(flat, n), range(first, first + n)))
        return owners

    def used_by_threads(self, for_a_caller: bool) -> bool:
        """Note the calling thread in each FlatGrad of the parameters, unless it runs a task
        ``for_a_caller`` (a nested call in a chunk, part of its caller's call); whether calls
        from more than one thread have used any (NOTE [ Backward passes in several threads ])."""
        self._refresh()
        thread, used = threading.get_ident(), False
        for ref, _, _ in self._runs:
            flat = None if ref is None else ref()
            if flat is not None:
                used = (flat._other_threads if for_a_caller else flat._called_from(thread)) or used
        return used

    def compensated(self) -> bool:
        """Whether a parameter has a slot in a compensated FlatGrad."""
        self._refresh()
        return self._compensated

    def _hookless(self, views: list[Tensor | None]) -> bool:
        """Whether no parameter with a slot has a hook of the user's and none without one has
        a post-accumulate hook (``zeroed_slot_views``' condition)."""
        seen = (handle_count(), self._generation)
        if seen[0] is not None and seen == self._hookless_at:
            return True
        for p, view in zip(self.params, views):
            if view is None:
                if p._post_accumulate_grad_hooks is not None:
                    return False
            elif _hooked_by_user(p):
                return False
        self._hookless_at = seen
        return True

    def zeroed_views(self) -> list[Tensor] | None:
        """``zeroed_slot_views(self.params)``, the same answer in fewer steps where the
        ``.grad`` are the slots' views or None."""
        views = self.views()
        if views is None or not self._hookless(views):
            return zeroed_slot_views(self.params)
        grads = list(map(_grad_of, self.params))
        every = all(map(operator.is_, grads, views))
        if not every:
            # Allowed besides: None where a slot is; anything else is looked at one by one.
            for grad, view in zip(grads, views):
                if grad is not view and (grad is not None or view is None):
                    return zeroed_slot_views(self.params)
        # The buffers written into must be known zero: every one of the slots' where every
        # .grad is a view, else those of the slots whose .grad is set; each buffer read once
        # (a FlatGrad over the models in another order: a run a model).
        looked: set[tuple[int, BufferKey]] = set()
        at = 0
        for ref, first, n in self._runs:
            flat = None if ref is None else ref()
            if flat is not None:
                slots = flat._slots[first : first + n]
                if not every:
                    slots = list(
                        compress(slots, map(operator.is_not, grads[at : at + n], repeat(None)))
                    )
                for key in {slot.key for slot in slots}:
                    if (id(flat), key) not in looked:
                        looked.add((id(flat), key))
                        if not flat._known_zero(key):
                            return None
            at += n
        return list(compress(grads, map(operator.is_not, grads, repeat(None))))


def zeroed_slot_views(params: Sequence[Tensor]) -> list[Tensor] | None:
    """Where every ``.grad`` of ``params`` is None or its FlatGrad slot's view in a buffer
    nothing was written to since ``zero_()`` (NOTE [ Buffer versions ]), and no parameter
    has a hook of the user's: those views, which a failed backward that accumulated into them
    zeroes again. Else None: accumulating in place could not be undone."""
    views: list[Tensor] = []
    known_zero: dict[tuple[int, BufferKey], bool] = {}
    for p in params:
        owner = owner_of(p)
        if owner is None:
            if p.grad is not None or p._post_accumulate_grad_hooks is not None:
                return None
            continue
        if _hooked_by_user(p):
            return None
        if p.grad is None:
            continue
        flat, index = owner
        slot = flat._slots[index]
        if p.grad is not slot.view:
            return None
        key = (id(flat), slot.key)
        if key not in known_zero:
            known_zero[key] = flat._known_zero(slot.key)
        if not known_zero[key]:
            return None
        views.append(slot.view)
    return views


# NOTE [ Slots filled after the join ]
# Where a backward hands its pullbacks to helpers and joins them later (NOTE [ Pullbacks joined
# later ] in _function), the calling thread's engine runs the parameters' AccumulateGrads
# meanwhile: with None from the node, and with a gradient where a term of the loss outside the
# sum (an L2 penalty) reads the parameter. AccumulateGrad writes ``.grad`` under a lock of its
# own but runs the post-accumulate hooks after it, so a FlatGrad's hook moving a fresh gradient
# into its slot (``param.grad = view``, where ``.grad`` was None: ``optimizer.zero_grad()``)
# wrote ``.grad`` while the other thread's AccumulateGrad wrote it too: gradients lost, and a
# segmentation fault or "free(): corrupted unsorted chunks" (32 MLPs at n_jobs=2 with an L2
# term, the example of docs/gradients.md; found by tests/test_differential.py). So those
# slots are held: their hook does nothing until the join, where the calling thread, the
# AccumulateGrads done, moves each gradient in (``release_slots``). A failed backward sets
# their ``.grad`` back to None and leaves the slots as they were. A graph freed without its join
# (a hook on an AccumulateGrad node that raised) releases them when it goes.
def release_slots(held: list[tuple[FlatGrad, int, Tensor]], fill: bool) -> None:
    """Let the hooks of slots held by ``ParamSlots.hold_unset`` act again; with ``fill``, move each
    fresh ``.grad`` into its slot first, as they would have."""
    for flat, index, _ in held:
        flat._held.discard(index)
    if not fill:
        return
    by_flat: dict[int, tuple[FlatGrad, list[tuple[int, Tensor]]]] = {}
    for flat, index, p in held:
        by_flat.setdefault(id(flat), (flat, []))[1].append((index, p))
    for flat, pairs in by_flat.values():
        flat._reattach_all(pairs)


def _hooked_by_user(param: Tensor) -> bool:
    """Whether a parameter that a FlatGrad owns has hooks besides parsum's own (the FlatGrad's,
    a StepInBackward's, and take_rows', which only coalesces)."""
    return has_user_hooks(param) or has_user_post_hooks(param)


def _unhooked_owner(param: Tensor) -> tuple[FlatGrad, int] | None:
    """``owner_of(param)``, None where it has a hook of the user's too."""
    owner = owner_of(param)
    return None if owner is None or _hooked_by_user(param) else owner


@dataclass
class _Write:
    param: Tensor  # held for the backward's duration
    slot: _Slot
    owner: FlatGrad
    fresh: bool  # .grad was None or is known zero: the write copies
    undo: str = "nothing"  # after a failure: "nothing", "zero" the slot, or copy "saved" back
    keep: bool = False  # another FlatWrites of its FlatGrad runs: kept, handed in at commit
    taken: Tensor | None = None  # the .grad of another tensor whose value the slot took over
    written: bool = False


class FlatWrites:
    """The FlatGrad slots one backward of ``sum_models`` writes; built in the backward's thread.

    ``write(k, g)`` may run in any worker, at most once per parameter; ``commit()`` after every
    write succeeded, ``rollback()`` instead after a failure (NOTE [ Buffer versions ]), which
    ``undoable=False`` gives up: nothing is saved to restore. One of the two must end every
    FlatWrites (else its FlatGrads keep what others hand in until it is collected: NOTE
    [ Backward passes in several threads ]).
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        accumulates: Sequence[bool],
        undoable: bool = True,
        slots: ParamSlots | None = None,
    ) -> None:
        self._writes: dict[int, _Write] = {}
        self._saved: list[tuple[Tensor, Tensor]] = []
        self._kept: list[tuple[_Write, Tensor]] = []
        # The slots of a kept plan's parameters (``slots``, over ``params``) are known without
        # a look at each parameter: 382 of them took 1.2 of the 2.0 ms this took a backward
        # (64 tiny MLP classes, compensated, one thread).
        found = None if slots is None or slots.params is not params else slots.unhooked_owners()
        if found is None:
            found = [_unhooked_owner(p) if acc else None for p, acc in zip(params, accumulates)]
        taken = [
            (k, owner)
            for k, (owner, acc) in enumerate(zip(found, accumulates))
            if acc and owner is not None
        ]
        owners = {id(flat): flat for _, (flat, _) in taken}
        # NOTE [ Backward passes in several threads ]: where another runs, keep the gradients.
        # Read .grad only now: the last FlatWrites to end may have set it before this started.
        self._owners = list(owners.values())
        self._alone = {id(flat): flat._start_writes() for flat in self._owners}
        self._ended = False
        # Decide from the versions before anything below writes.
        known_zero: dict[tuple[int, BufferKey], bool] = {}
        for flat in self._owners:
            if self._alone[id(flat)]:
                for key in flat._buffers:
                    known_zero[id(flat), key] = flat._known_zero(key)
                    flat._drop_stale_compensation(key)
        for k, (flat, index) in taken:
            p = params[k]
            slot, grad = flat._slots[index], p.grad
            keep = not self._alone[id(flat)]
            write = self._writes[k] = _Write(p, slot, flat, fresh=grad is None, keep=keep)
            if grad is None or keep:
                continue
            if grad is not slot.view and not _is_view_of(grad, slot.view):
                # .grad was replaced by another tensor: take its value over; until commit()
                # points .grad at the slot, the slot is nobody's .grad, so nothing to undo.
                write.taken = grad
                _copy_to_slot(slot, grad)
            elif known_zero[id(write.owner), slot.key]:
                write.fresh = True  # adding to zero is a copy: skip the compensated add
                write.undo = "zero"
            elif undoable:
                write.undo = "saved"
                self._saved.append((slot.view, slot.view.clone()))
                if slot.comp is not None:
                    self._saved.append((slot.comp, slot.comp.clone()))

    def __contains__(self, k: int) -> bool:
        return k in self._writes

    def write(self, pairs: Sequence[tuple[int, Tensor]]) -> None:
        """Write the gradients ``(k, grad)`` of parameters ``k``, a few kernels for all."""
        copies: tuple[list[Tensor], list[Tensor]] = ([], [])
        adds: tuple[list[Tensor], list[Tensor]] = ([], [])
        compensated: tuple[list[Tensor], list[Tensor], list[Tensor]] = ([], [], [])
        zeroed: list[Tensor] = []
        for k, grad in pairs:
            slot = self._writes[k].slot
            if self._writes[k].keep:  # NOTE [ Backward passes in several threads ]
                self._kept.append((self._writes[k], grad))
                continue
            self._writes[k].written = True
            if grad.layout == torch.sparse_coo and grad.sparse_dim() == 1:
                self._write_rows(self._writes[k], grad)
                continue
            grad = _dense(grad)
            if self._writes[k].fresh:
                copies[0].append(slot.view)
                copies[1].append(grad)
                if slot.comp is not None and self._writes[k].undo != "zero":
                    zeroed.append(slot.comp)  # known-zero slots have zero compensations
            elif slot.comp is not None:
                compensated[0].append(slot.view)
                compensated[1].append(slot.comp)
                compensated[2].append(grad)
            else:
                adds[0].append(slot.view)
                adds[1].append(grad)
        if copies[0]:
            torch._foreach_copy_(*copies)
        if zeroed:
            torch._foreach_zero_(zeroed)
        if adds[0]:
            torch._foreach_add_(*adds)
        if compensated[0]:
            compensated_add_(*compensated)

    def _write_rows(self, write: _Write, grad: Tensor) -> None:
        """Add a row-sparse gradient into its slot, touching only its rows (NOTE [ Sparse
        gradients in a slot ])."""
        grad = grad if grad.is_coalesced() else grad.coalesce()
        rows, values = grad._indices()[0], grad._values()
        view, comp = write.slot.view, write.slot.comp
        if write.fresh:
            if write.undo != "zero":  # .grad was None: the slot holds stale values
                view.zero_()
                if comp is not None:
                    comp.zero_()
            view.index_copy_(0, rows, values)
        elif comp is None:
            view.index_add_(0, rows, values)
        else:
            totals, comps = [view.index_select(0, rows)], [comp.index_select(0, rows)]
            compensated_add_(totals, comps, [values])
            view.index_copy_(0, rows, totals[0])
            comp.index_copy_(0, rows, comps[0])

    def commit(self) -> None:
        kept: dict[int, list[tuple[_Slot, Tensor, Tensor]]] = {}
        for write, grad in self._kept:
            kept.setdefault(id(write.owner), []).append((write.slot, write.param, grad))
        for write in self._writes.values():
            if write.keep:
                continue
            view, current = write.slot.view, write.param.grad
            if write.fresh and write.undo != "zero" and not write.written:
                # .grad was None and no gradient came: the slot holds stale values (after
                # ``zero_grad()``, the last step's), which were .grad (stepped again) until
                # 2026-12-03; None stays, as in plain PyTorch
                if current is not None and current is not view:  # made meanwhile: moved in
                    _copy_to_slot(write.slot, current.detach())
                    write.param.grad = view
                continue
            if not (
                current is None
                or current is view
                or current is write.taken
                or _is_view_of(current, view)
            ):
                # a fresh .grad that autograd made while this ran (NOTE [ Backward passes in
                # several threads ]), added in
                _add_to_slot(write.slot, _dense(current.detach()))
            write.param.grad = view
        for flat in self._owners:
            if self._alone[id(flat)]:
                flat._note_written()
        self._end(kept)

    def rollback(self) -> None:
        for write in self._writes.values():
            if write.undo == "zero":
                write.slot.view.zero_()
                if write.slot.comp is not None:
                    write.slot.comp.zero_()
        for view, value in self._saved:
            view.copy_(value)
        self._end({})  # the kept gradients dropped: nothing of them was written

    def _end(self, kept: dict[int, list[tuple[_Slot, Tensor, Tensor]]]) -> None:
        if self._ended:
            return
        self._ended = True
        self._kept = []
        for flat in self._owners:
            flat._end_writes(kept.get(id(flat), []))

    def __del__(self) -> None:
        # Never ended (an error on no path's watch): counted out, its kept gradients dropped;
        # the slots are left as they are, since restoring values saved so long ago could
        # write over what others have written since.
        if not getattr(self, "_ended", True):
            with torch.no_grad():
                self._end({})
