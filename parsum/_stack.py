"""Stacked storage: identical models whose parameters live in one tensor per name.

# NOTE [ Stacked storage ]
# ``stack_(models)`` gives each parameter (and buffer) name of a group of identical models one
# tensor of shape ``(M, *shape)`` and makes every model's tensor of that name its slice
# (``p.data = values[k]``: the parameter stays the same object, a leaf, now viewing the
# storage), as FSDP's flat parameter and DDP's gradient buckets do. A call of ``sum_models`` on
# exactly those models then runs them as one batched forward (NOTE [ Batched layers ]) that
# reads the stacked tensors directly, through aliases ``values.detach().requires_grad_()``
# (NOTE [ Lasting aliases ]): no ``torch.stack`` in forward, no ``unbind`` and no
# per-parameter gradient edge in backward, and no ``ParallelSum`` node with a parameter input
# per model (64 tiny MLPs: 384 inputs cost 0.84 ms a step, the whole vmap step 0.81). The
# graph is plain autograd; each alias's post-accumulate hook hands its stacked gradient to the
# models' own ``.grad`` (``Stack._settle``).
#
# The models stay ordinary modules, and everything that can break the storage or the
# identity of the group is checked on every call, cheaply: the same model objects, every
# parameter, buffer and submodule still in its place, every tensor still at its address
# (``.data`` swapped, ``m.to(dtype)``, ``load_state_dict(assign=True)``) and of its slice's
# elements and strides (``p.data = p.data[:16]`` keeps the address), every module of its
# class (``module.__class__`` assigned), requires_grad, training flags and plain attributes
# as recorded (a Linear's in a model of other code too: its forward may read ``self.lin.scale``,
# where the batched forward reads the first model's), no module or gradient hooks. These cost
# 64 tiny models 121 -> 218 us a call as Sequentials, 124 -> 254 as classes (2026-12-06,
# sizes, strides, classes and Linear attributes added; a step 1.8 and 2.8 ms). A failed check
# runs the full comparison again: models still identical are re-stacked (new storage, the
# values they hold now); otherwise the call goes the general way (``ParallelSum``, correct for
# any models) with a warning, once per stack and reason.
#
# NOTE [ Lasting aliases ]
# An alias and its post-accumulate hook cost 6 us a name to make, so they are kept from call to
# call (64 tiny MLPs: 1.07 -> 0.99 ms a step), but lent to one graph at a time: a call takes
# the stack's alias, and its hook gives it back once the backward that freed its graph has
# delivered the gradient. Shared by graphs of several threads, an alias's ``.grad`` was set to
# None by one thread's hook while another's AccumulateGrad added to it (autograd raised
# "Expected a proper Tensor but got None"). A call that finds the alias lent (a graph alive, a
# graph retained, never pulled back, or run on another thread) makes one of its own, as does a
# call with ``step_in_backward``, whose hooks step.
#
# NOTE [ Gradient buffers ]
# After ``zero_grad()`` (``.grad = None``), the models' gradients of one name are views of one
# buffer, reused from step to step: making 64 fresh views costs 0.15 ms a step, reattaching
# cached ones 0.04. Reuse is safe only where nobody else can see the old values: a buffer is
# reused when no view of it is referenced outside the stack (Python references to the views,
# and tensors sharing its storage, are counted); otherwise the new gradient becomes the new
# buffer, as autograd would allocate it. Where the models' ``.grad`` are already the buffer's
# views, the gradient is added to the buffer in place, as autograd accumulates; any other
# state (a ``.grad`` assigned by hand) is accumulated model by model.
#
# NOTE [ Gradients across a restack ]
# Casting or moving the models (``m.double()``, ``m.to(device)``) gives each parameter a tensor
# of its own, and the next call stacks them again, into the same stacked objects (an optimizer
# over ``stack.parameters()`` keeps stepping them). A cast keeps each ``.grad`` object but
# replaces its data, so the models' gradients are no longer the buffer's views in memory,
# though they are in identity: taken for gradients set by hand, they had been added to model by
# model, the stale values of a step that an optimizer over the stack had zeroed included, and
# the stacked tensors got no gradient (the optimizer then stepped nothing, silently). Before the
# models are stacked again, their gradients that are the buffer's views are stacked into a new
# buffer (their views again, and the stacked tensor's ``.grad``), or set to None where the
# stacked ``.grad`` is None (zeroed by that optimizer). A name frozen on every model
# (``requires_grad_(False)``, fine-tuning) keeps its gradients of before as the buffer's views
# and the stacked ``.grad``, which that optimizer steps or zeroes as a plain optimizer does a
# frozen parameter's (the models' set to None with it, at the next call): kept as gradients of
# the models' own, they had made the name, once unfrozen, a name whose ``.grad`` were set by
# hand, whose stacked ``.grad`` stayed None, and which the optimizer never stepped again,
# silently. Gradients of the models' own (set by hand) are taken in as a new buffer's views
# after the backward adds to them, where such an optimizer is there to step them (``_adopt``).
# With a FlatGrad over the stack, the block stays each name's stacked ``.grad`` across a
# restack, or None where that optimizer zeroed it: the next backward then overwrites the block.
# A frozen name's block is zeroed in place when that optimizer zeroes its stacked ``.grad``, so
# that a norm or a clip over the models' gradients does not count a stale step; the FlatGrad's
# ``zero_()`` sets that stacked ``.grad`` to None itself (NOTE [ Frozen parameters' gradients ]
# in _grads).
#
# NOTE [ Models that differ, trained over the stack ]
# A change that leaves the models different (a hook, a setting or ``eval()`` on one model,
# pruning one) makes them run one by one. Their parameters are still the stack's slices, so an
# optimizer over ``stack.parameters()`` still gets their gradients: each model's ``.grad`` is
# made a view of the stack's zeroed buffer as the backward starts (``attach_at_backward``), as
# for models too large to batch. Until 2026-12-07 the stacked ``.grad`` was dropped instead,
# and that optimizer stepped no model from then on, with one warning, where the plain loop
# trains on (a forward hook on one of 10 models, SGD with momentum: every parameter 0.14 off
# the plain loop four steps later). A layer frozen or unfrozen on every model, or new
# ``.data``, while they differ: the models, which still fit the stacked tensors (names,
# shapes, kinds, ``requires_grad``), are stacked again as they are (``_hold_differing``), as
# a stack that gave up, running one by one until ``stack_`` stacks them again, their
# gradients across it as across a restack (NOTE [ Gradients across a restack ]). Not where
# they no longer fit (one model's parameter frozen alone, cast or narrowed): one stacked
# tensor has one gradient, so a slice frozen alone would be moved by momentum or weight decay
# with a zero gradient, which the plain loop never does; there the stack gets no gradient,
# and says so, until ``stack_`` stacks the models again. A copy (or an unpickled stack) of
# models that differ, with an optimizer over ``parameters()``, stacks the copied models into
# the copied tensors the same way; it had left them their own storage, and the copied
# optimizer stepped nothing.
#
# NOTE [ One group in the caller's graph ]
# A call whose models ``auto`` (or engine "stacked") puts in one stacked group runs, without
# stacked storage, in the caller's own graph: ``torch.stack`` of each parameter name
# (differentiable: its backward hands each model its slice, into its own ``.grad``, through
# autograd's own accumulation, hooks included), one batched forward (the batched matmuls of a
# Sequential of Linear layers and activations on one tensor, NOTE [ Batched layers ] in
# _engines, else vmap, which autograd differentiates through), and the sum over the models in
# the wide dtype. No ParallelSum node with a parameter input per model, no nested engine call:
# 64 identical tiny MLPs 3.84 -> 2.78 ms a step (interleaved; ``vmap`` 1.07, ``stack_``
# storage 1.24, plain loop 6.0); 32 identical two-layer residual blocks, through vmap, 1.85 ->
# 1.31 ms (plain loop 2.18). As in ``stack_`` storage the graph is plain autograd; a forward
# that fails goes the general way, which names the model.
#
# NOTE [ One buffer for a stack ]
# ``FlatGrad(stack)`` lays its slots out name by name, model after model, so that each name's
# slots form one block shaped as its stacked tensor (``SlotBlock``). The block is then the
# models' ``.grad`` (each model's slot a view of it), the stacked tensor's ``.grad`` (for an
# optimizer over ``stack.parameters()``) and the FlatGrad's buffer (for a norm, a clip, an
# all-reduce) at once, and the stacked backward writes a name's gradient with one kernel (64
# tiny MLPs, forward and backward from ``flat.zero_()``: 1.32 ms, against 2.73 with the slots
# model after model, which take the models' slices one by one, and 1.17 without a FlatGrad;
# benchmarks/bench_flatgrad.py times whole steps). Before a backward, rows whose ``.grad`` is
# None become zero views, and a ``.grad`` set by hand is copied into its view, so that the
# block always holds every model's gradient; an optimizer over ``stack.parameters()`` that set
# the stacked ``.grad`` to None zeroed them all.
"""

from __future__ import annotations

import functools
import itertools
import operator
import sys
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ._config import check_model_sequence
from ._engines import (
    ELEMENTWISE,
    HOOK_DICTS,
    MODULE_INTERNALS,
    CallArgs,
    GroupReads,
    ModelParams,
    Step,
    _requires_grad,
    batched_forward,
    batched_in_graph,
    model_kind,
    module_of,
    program_of,
    runs_as_program,
    unpack_saved,
)
from ._errors import ParsumError, a_kind_of, message_of, model_failed
from ._function import _engine_keeps_graph, argument_versions
from ._fused import StepInBackward, not_stepped, step_stacked, stepped_twice
from ._grads import (
    FlatWrites,
    SlotBlock,
    check_slots,
    has_flat_grads,
    owners_generation,
    slot_block,
)
from ._grouping import (
    Batch,
    first_difference,
    module_calls_watched,
    structure_key,
    unstackable,
)
from ._locks import Lock
from ._pool import autocast_states
from ._sparse import handle_count, has_user_post_hooks, post_accumulate_hooks
from ._summation import sum_dtype, weigh_models, wide_sum_over_models

_WHERE = "stack_"

# model -> the Stack it was last stacked into (held weakly both ways).
_stack_of: weakref.WeakKeyDictionary[nn.Module, Stack] = weakref.WeakKeyDictionary()
# The stacks whose parameters() were asked for (an optimizer over their tensors).
_wanted: weakref.WeakSet[Stack] = weakref.WeakSet()

_data_ptr = Tensor.data_ptr
_numel = Tensor.numel
_stride = Tensor.stride
# A weak reference called: its object, or None once collected (Python 3.10 has no operator.call).
_deref = getattr(operator, "call", weakref.ref.__call__)
_tensor_hooks = operator.attrgetter("_backward_hooks")
_grad_of = operator.attrgetter("grad")
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def stack_(models: Sequence[nn.Module]) -> Stack:
    """Move the parameters and buffers of identical models into stacked storage, in place.

    Every name gets one tensor of shape ``(len(models), *shape)`` and each model's parameter
    of that name becomes its slice (the same ``nn.Parameter`` object, now viewing the stack).
    ``sum_models`` over exactly these models, in this order, then runs them as one batched
    forward over the stacked tensors (batched matmuls for a Sequential of Linear layers and
    activations, ``torch.vmap`` otherwise), and backward fills every model's own ``.grad``:
    the speed of ``torch.func.stack_module_state`` + ``vmap`` for such Sequentials (about 0.6x
    for 64 tiny models of a class of the user's own, whose checks around ``vmap`` cost about
    1 ms a call), with models that stay ordinary modules for optimizers, ``state_dict``, hooks
    and checkpoints.

    >>> import torch, parsum
    >>> models = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
    ...           torch.nn.Linear(8, 1)) for _ in range(16)]
    >>> stack = parsum.stack_(models)
    >>> stack.values["0.weight"].shape
    torch.Size([16, 8, 4])
    >>> parsum.sum_models(models, torch.randn(32, 4)).pow(2).mean().backward()
    >>> member = models[3]
    >>> member[0].weight.grad.shape
    torch.Size([8, 4])

    Anything that changes a model after this (a parameter replaced, ``m.to(dtype)``,
    ``requires_grad_(False)`` on one model, ``m.train()`` on one, a hook) is noticed on the
    next call: models still identical are stacked again, others run one by one, with a
    warning. ``stack_`` over the same models again returns their stack, stacked again into
    the same tensors (an optimizer over ``stack.parameters()`` keeps stepping the models);
    over some of a stack's models it raises. ``stack.unstack_()`` gives every model its own
    storage back.

    Args:
        models: at least two ``nn.Module``s of one architecture: the same module types in the
            same tree, the same parameter and buffer names, shapes, dtypes and devices, the
            same settings and training flags, no module hooks, no parameter shared with
            another model.

    Returns:
        The :class:`parsum.Stack` (a sequence of the models).

    Raises:
        ParsumError: for models that differ, share a parameter, or cannot be stacked, naming
            the first one and why.
    """
    found = check_model_sequence(models, _WHERE, (nn.ModuleList,))
    # NOTE [ Stacking stacked models ]
    again = stack_for(found)
    if again is not None:
        again._stack_again()
        return again
    for i, model in enumerate(found):
        other = _stack_of.get(model) if isinstance(model, nn.Module) else None  # else refused
        if other is not None and other._broken is None:
            raise ParsumError(
                f"{_WHERE}: models[{i}] ({type(model).__name__}) is in a stack of "
                f"{len(other)} models already, which would lose it (an optimizer over its "
                "parameters() would no longer step it): call that stack's unstack_() first, "
                "or stack_ exactly its models"
            )
    return Stack(found)


# NOTE [ Stacking stacked models ]
# ``stack_`` over models already stacked had made a new stack, with new stacked tensors: an
# optimizer made over the first stack's ``parameters()`` then stepped tensors no model viewed
# any more, and the models stopped training, silently (the first stack was no longer any
# model's, so nothing found it to warn). The warning of a stack that gives up says to call
# ``stack_`` again, which then broke the user's optimizer the same way. So ``stack_`` over
# exactly a stack's models, in its order, is that stack, stacked again into the same tensors
# where it gave up or its models changed (raising where they are no longer identical), and
# ``stack_`` over some of another stack's models (or in another order) raises, unless that
# stack gave up running as one (it warned then that its optimizer gets nothing).


class _Kept(NamedTuple):
    """A frozen name's gradients kept across a restack: the models' tensors, their
    ``.grad`` (views of ``buffer``) and the buffer, the stacked tensor's ``.grad``."""

    tensors: list[Tensor]
    views: tuple[Tensor, ...]
    buffer: Tensor


class Stack(Sequence[nn.Module]):
    """Identical models whose parameters and buffers are slices of stacked tensors.

    Made by :func:`parsum.stack_`; a sequence of its models, so ``sum_models(stack, x)`` works.

    Attributes:
        values: per parameter and buffer name, the stacked tensor whose ``[k]`` is
            ``models[k]``'s tensor of that name.
    """

    def __init__(self, models: list[nn.Module], values: dict[str, Tensor] | None = None) -> None:
        if len(models) < 2:
            raise ParsumError(
                f"{_WHERE}: models has {len(models)} model; stacking needs at least two"
            )
        infos = _check_identical(models)
        self._start(models, values)
        self._place(infos)
        self._own(models)

    def _own(self, models: Sequence[nn.Module]) -> None:
        """Be the stack of ``models``, whose ``state_dict`` then holds copies of their slices."""
        for model in models:
            _stack_of[model] = self
            if not any(h is _own_storage for h in model._state_dict_hooks.values()):
                model.register_state_dict_post_hook(_own_storage)

    def _start(self, models: Sequence[nn.Module], values: dict[str, Tensor] | None) -> None:
        """The state of a stack over ``models`` that holds nothing yet: ``values``, stacked
        tensor objects to stack into (a copy's: NOTE [ A copied stack ])."""
        # Held weakly: the models keep their stack alive (``_stack_of``), not the other way
        # round, so that models the user drops are freed with their stack.
        self._refs = tuple(weakref.ref(m) for m in models)
        self.values: dict[str, Tensor] = dict(values or {})
        self._lock = Lock()
        self._warned: set[Any] = set()  # reasons said, with whether gathered; "flat"
        self._broken: str | None = None
        self._grad_buffers: dict[str, Tensor] = {}
        self._grad_views: dict[str, tuple[Tensor, ...]] = {}
        # Per trainable name, a leaf for the next batched forward to read, lent to one graph
        # at a time (NOTE [ Lasting aliases ]).
        self._aliases: dict[str, Tensor] = {}
        # Whether parameters() was called: only then do models run one by one gather their
        # gradients into the stacked ``.grad`` (``attach_at_backward``).
        self._stacked_grads_wanted = False
        # NOTE [ One buffer for a stack ]: per name, the FlatGrad block that holds the models'
        # gradients (or None) as of an owners generation; the names whose stacked .grad was
        # set to their block.
        self._flat_blocks: dict[str, tuple[object, SlotBlock | None]] = {}
        self._given: set[str] = set()
        self._slots_checked = True  # whether FlatGrad slots fit the models (_check_slots)
        self._trainable: list[str] = []
        # Per name frozen since the models were stacked again, with the gradients it had: the
        # models' tensors and their gradients, views of the stacked tensor's ``.grad``, until
        # an optimizer over ``parameters()`` zeroes it (NOTE [ Gradients across a restack ]).
        self._frozen_grads: dict[str, _Kept] = {}
        # The same where a FlatGrad's block holds them (the names): the block, found when that
        # optimizer zeroes the stacked .grad, is zeroed in place (a FlatGrad's .grad is never
        # None); found then, it is the FlatGrad's of that time (a copy's, made after the stack).
        self._frozen_given: set[str] = set()
        self._params: dict[str, list[Tensor]] = {}
        self._tensors: list[Tensor] = []

    # NOTE [ A copied stack ]
    # ``copy.deepcopy`` of a stack with its models (and an optimizer over its parameters: a
    # trainer's state) raised on the stack's lock, and the copies' parameters, which copying
    # gives storage of their own, would no longer be slices of anything. A copy, or an
    # unpickled stack, stacks the copied models again, into the copied stacked tensors, so
    # that a copied optimizer over ``parameters()`` steps the copied models. Gradients are
    # not copied, as a copied parameter's are not. A stack that no longer runs as one
    # (``unstack_``, models no longer identical) copies as one that gave up, with its reason:
    # its copied models run one by one in their own storage, or in the copied tensors where
    # they only differ in what leaves their tensors alike (NOTE [ Models that differ, trained
    # over the stack ]).
    def __getstate__(self) -> dict[str, Any]:
        return {
            "models": list(self.models),
            "values": self.values,
            "wanted": self._stacked_grads_wanted,
            "broken": self._broken,
            "given": set(self._given),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        models, values = state["models"], state["values"]
        # A FlatGrad block given as a name's stacked .grad (copied with it, as the FlatGrad's
        # values are) stays given, or zeroed where it was None: the copied FlatGrad's block
        # then takes its place at the next backward, as across a restack.
        blocks = {name: values[name].grad for name in state.get("given", ()) if name in values}
        for t in values.values():
            t.grad = None
        reason = state["broken"]
        placed = False  # models that differ, stacked all the same
        if reason is None:
            try:
                self.__init__(models, values)  # type: ignore[misc]
            except ParsumError as exc:
                reason = str(exc).removeprefix(f"{_WHERE}: ")
        if reason is not None and state["wanted"]:
            # NOTE [ Models that differ, trained over the stack ]: also a copy's copy
            placed = self._hold_differing(models, values, reason)
        if reason is not None and not placed:
            self._start(models, None)
            self._broken = reason
        else:
            for name, block in blocks.items():
                stacked = self.values.get(name)
                if stacked is not None and (block is None or block.shape == stacked.shape):
                    stacked.grad = block
                    self._given.add(name)
            self._frozen_given = self._given - set(self._trainable)
        if state["wanted"]:
            self.parameters()

    def _hold_differing(
        self, models: list[nn.Module], values: dict[str, Tensor], reason: str, keep: bool = False
    ) -> bool:
        """Stack models that differ into ``values`` all the same (a copy's, or with ``keep``
        this stack's own, its gradients kept as across a restack), where each holds tensors
        of its own of the same names, shapes, kinds and ``requires_grad`` as the first's, to
        run one by one with their gradients gathered there (NOTE [ Models that differ,
        trained over the stack ]); False, with nothing changed, where they do not fit."""
        infos = [ModelParams.of(m) for m in models]
        first = infos[0]

        def kinds(info: ModelParams) -> list[Any]:
            return [(t.shape, t.dtype, t.device) for t in (*info.tensors, *info.state)]

        held = [id(t) for info in infos for t in (*info.tensors, *info.state)]
        names = [*first.names, *first.state_names]
        like_first = (first.names, first.state_names, kinds(first))
        if not (
            len(models) >= 2
            and first.names
            and len(set(held)) == len(held)  # no tensor two models share
            and sorted(names) == sorted(values)
            and all((info.names, info.state_names, kinds(info)) == like_first for info in infos)
        ):
            return False
        if not keep:
            self._start(models, values)
        self._place(infos)
        self._broken = reason  # they run one by one until stack_ stacks them again
        self._own(models)
        return True

    # -- a sequence of models ------------------------------------------------------------
    @property
    def models(self) -> tuple[nn.Module, ...]:
        """The models, in order."""
        found = tuple(ref() for ref in self._refs)
        return found if None not in found else ()  # type: ignore[return-value]

    @property
    def program(self) -> list[Step] | None:
        """The models' batched matmuls where they are a Sequential of Linear layers and
        activations (NOTE [ Batched layers ] in _engines); None: they run through vmap."""
        return self._program

    def __len__(self) -> int:
        return len(self._held_models())

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._held_models())

    def __getitem__(self, k: Any) -> Any:
        return self._held_models()[k]

    def _held_models(self) -> tuple[nn.Module, ...]:
        """The models, for the sequence they make; a stack whose models are gone raises: seen
        as empty, an EMA copy made with ``copy.deepcopy(stack)`` alone (whose copied models
        nothing holds) had a length of its models and no model to loop over."""
        found = self.models
        if not found:
            raise ParsumError(
                "Stack: its models are gone (a stack holds its models weakly, and nothing "
                "else held them: copy.deepcopy of a stack alone copies models that nothing "
                "holds); copy the models with it, copy.deepcopy((models, stack)), or stack_ "
                "the copied models"
            )
        return found

    def __repr__(self) -> str:
        found = self.models
        if not found:
            return f"Stack(models gone, {len(self.values)} stacked tensors)"
        return (
            f"Stack({len(found)} x {type(found[0]).__name__}, {len(self.values)} stacked tensors)"
        )

    # -- storage -------------------------------------------------------------------------
    def _place(self, infos: list[ModelParams]) -> None:
        """Copy the models' tensors (``infos``, one per model) into fresh stacked storage and
        make them its slices: normal tensors also under ``torch.inference_mode`` (parameters
        made inference tensors there could no longer be trained)."""
        with torch.inference_mode(False):
            self._place_here(infos)

    def _place_here(self, infos: list[ModelParams]) -> None:
        first = infos[0]
        held, frozen = self._held_gradients(infos)
        values: dict[str, Tensor] = {}
        with torch.no_grad():
            for t, name in enumerate(first.names):
                values[name] = torch.stack([info.tensors[t].detach() for info in infos])
            for t, name in enumerate(first.state_names):
                values[name] = torch.stack([info.state[t].detach() for info in infos])
        given: set[str] = set()
        for name, new in values.items():
            old = self.values.get(name)
            if old is not None:  # the same object: an optimizer over parameters() holds it
                # A FlatGrad's block as its .grad, or None where an optimizer over the stack
                # zeroed it, stays: the block holds the models' gradients across the restack,
                # and only the zeroing says that they are stale (NOTE [ One buffer for a
                # stack ]); forgotten, the next backward had added to the zeroed step's.
                block = old.grad if name in self._given else None
                if block is not None and (block.shape, block.dtype, block.device) != (
                    new.shape,
                    new.dtype,
                    new.device,
                ):
                    block = None
                elif name in self._given:
                    given.add(name)
                old.data, old.grad, values[name] = new, None, old
                old.grad = block
        for k, info in enumerate(infos):
            for name, p in zip(first.names, info.tensors):
                p.data = values[name][k]
            for name, s in zip(first.state_names, info.state):
                s.data = values[name][k]
        self.values = values
        self._trainable = list(first.names)
        self._params = {
            name: [info.tensors[t] for info in infos] for t, name in enumerate(first.names)
        }
        self._grad_buffers.clear()
        self._grad_views.clear()
        self._aliases.clear()
        self._flat_blocks.clear()
        self._given = given
        for name, buffer in held.items():
            self._give(name, buffer)
        for name, kept in frozen.items():
            self.values[name].grad = kept.buffer.view_as(kept.buffer)
        self._frozen_grads = frozen
        self._frozen_given = given - set(first.names)
        self._record(infos)

    def _held_gradients(
        self, infos: list[ModelParams]
    ) -> tuple[dict[str, Tensor], dict[str, _Kept]]:
        """Before the models are stacked again (NOTE [ Gradients across a restack ]): each
        name's gradients that the models hold as this stack's views, stacked anew (those of a
        name frozen now: kept as they are, with the models' tensors), and those an optimizer
        over ``stack.parameters()`` zeroed set to None."""
        held: dict[str, Tensor] = {}
        kept: dict[str, _Kept] = {}
        first = infos[0]
        trainable = {name: t for t, name in enumerate(first.names)}
        frozen = {name: t for t, name in enumerate(first.state_names)}
        for name in [*self._trainable, *self._frozen_grads]:  # some frozen now, or again
            views, stacked = self._grad_views.get(name), self.values.get(name)
            buffer = self._grad_buffers.get(name)
            if name in self._frozen_grads:
                views, buffer = self._frozen_grads[name].views, self._frozen_grads[name].buffer
            if name in trainable:
                tensors = [info.tensors[trainable[name]] for info in infos]
            elif name in frozen:
                tensors = [info.state[frozen[name]] for info in infos]
            else:
                continue
            grads = [p.grad for p in tensors]
            if views is None or stacked is None or len(views) != len(grads):
                continue
            if not all(map(operator.is_, grads, views)):
                continue  # set by hand, or None: the models' own
            if stacked.grad is None:  # zeroed by an optimizer over stack.parameters()
                for p in tensors:
                    p.grad = None
            elif name in trainable:
                with torch.no_grad():
                    held[name] = torch.stack([g.detach() for g in views])  # the grads
            elif buffer is not None:
                # Frozen now, with the gradients of before: the models keep them, as a frozen
                # parameter keeps its .grad, and the stacked .grad stays their buffer, which an
                # optimizer over the stack steps or zeroes as the plain loop's optimizer does
                # the models' (``_drop_zeroed_frozen``).
                kept[name] = _Kept(tensors, tuple(views), buffer)
        return held, kept

    def _drop_zeroed_frozen(self) -> None:
        """The gradients of frozen names whose stacked ``.grad`` an optimizer over the stack
        zeroed (set to None): the models' too, as ``zero_grad()`` does a frozen parameter's (a
        FlatGrad's block: zeroed in place)."""
        if not (self._frozen_grads or self._frozen_given):
            return
        for name, kept in list(self._frozen_grads.items()):
            stacked = self.values.get(name)
            if stacked is None or stacked.grad is None:
                for p, v in zip(kept.tensors, kept.views):
                    if p.grad is v:
                        p.grad = None
                del self._frozen_grads[name]
        for name in list(self._frozen_given):
            stacked = self.values.get(name)
            if stacked is None or stacked.grad is None:
                block = slot_block([m.get_parameter(name) for m in self.models])
                if block is not None:
                    block.zero_()
                self._frozen_given.discard(name)
            elif all(m.get_parameter(name).grad is None for m in self.models):
                # The models' gradients are gone (the FlatGrad's zero_() gives a frozen
                # parameter None): the stacked one with them. Where zero_() could not (a copy,
                # whose stacked .grad is a copy of the block, not the copied FlatGrad's block),
                # an optimizer over the stack had stepped the frozen layer with the gradients
                # of before on every step.
                stacked.grad = None
                self._frozen_given.discard(name)

    def _record(self, infos: list[ModelParams]) -> None:
        """What ``_check`` compares on every call (NOTE [ Stacked storage ])."""
        entries: list[tuple[dict, str, Any]] = []
        sized: list[dict] = []
        hooks: list[dict] = []
        owns: list[dict] = []  # each module's attributes
        self._program = program_of(infos[0].modules[0]) if infos[0].modules else None
        for info in infos:
            for module in info.modules:
                attributes = vars(module)
                hooks.extend(attributes[key] for key in HOOK_DICTS)
                owns.append(attributes)
                kind = type(module)
                if kind is nn.Linear:  # its forward reads its weight and bias, nothing else
                    inner = attributes["_parameters"]
                    entries.extend((inner, k, inner.get(k)) for k in ("weight", "bias"))
                    if self._program is not None:
                        continue
                    # A model of other code may read more of it (``self.lin.scale``), which
                    # the batched forward took from the first model's, silently.
                    sized.extend((attributes, inner))
                for key in attributes.keys() - MODULE_INTERNALS:
                    entries.append((attributes, key, attributes[key]))
                if kind is nn.Linear or (kind in ELEMENTWISE and kind is not nn.Dropout):
                    continue  # its forward reads its settings alone, not its training flag
                entries.append((attributes, "training", attributes["training"]))
                for key in ("_parameters", "_buffers", "_modules"):
                    inner = attributes[key]
                    sized.append(inner)
                    entries.extend((inner, k, v) for k, v in inner.items())
        self._entry_dicts = [e[0] for e in entries]
        self._entry_keys = [e[1] for e in entries]
        self._entry_values = [e[2] for e in entries]
        self._sized = sized
        self._sizes = list(map(len, sized))
        self._hook_dicts = hooks
        # A forward assigned to a module since (NOTE [ Forwards of their own and stacked
        # groups ] in _grouping); not any attribute: compiling in place after stacking adds
        # one, and the stack goes on (the batched forward computes what the compiled call does)
        self._attribute_dicts = owns
        # Each module's class: ``module.__class__ = nn.Sigmoid`` (as a lazy module becomes
        # its ``cls_to_become``) changes no attribute, and the stacked forward ran the old
        # class's program. Held weakly: the stack, which the models keep, must not keep them.
        modules = [module for info in infos for module in info.modules]
        self._module_refs = list(map(weakref.ref, modules))
        self._types = list(map(type, modules))
        self._handles_seen: int | None = None
        self._own_post_hooks = 0  # post-accumulate hooks on the parameters, all parsum's
        self._stepped_by: weakref.ref[StepInBackward] | None = None  # (_check_stepped)
        self._tensors = [t for info in infos for t in (*info.tensors, *info.state)]
        self._ptrs = list(map(_data_ptr, self._tensors))
        self._numels = list(map(_numel, self._tensors))
        self._strides = list(map(_stride, self._tensors))
        self._requires = list(map(_requires_grad, self._tensors))
        self._trainable_tensors = [t for info in infos for t in info.tensors]
        # trainable, then frozen, by name: what a backward watches (NOTE [ Weights written
        # before a group's backward ] in _engines)
        self._watched_names, self._tensors_by_model = GroupReads.with_frozen(
            self._trainable, [info.tensors for info in infos], infos
        )
        # What a stacked call's backward watches (GroupReads.watched), by whether the
        # argument needs a gradient
        self._watching: dict[bool, tuple[list[str], list[Tensor]]] = {}
        self._numel = sum(t.numel() for t in infos[0].tensors)

    def parameters(self) -> Iterator[Tensor]:
        """The stacked tensors of the trainable parameters, for one optimizer that steps every
        model at once: after each backward their ``.grad`` holds the models' gradients
        (each model's ``.grad`` is a view of it), and stepping them steps the models.

        >>> import torch, parsum
        >>> models = [torch.nn.Linear(3, 1) for _ in range(8)]
        >>> stack = parsum.stack_(models)
        >>> opt = torch.optim.Adam(stack.parameters(), lr=0.01)   # 2 tensors, not 16
        >>> opt.zero_grad()
        >>> parsum.sum_models(models, torch.ones(4, 3)).sum().backward()
        >>> opt.step()
        """
        self._stacked_grads_wanted = True
        _wanted.add(self)
        return iter([self.values[name] for name in self._trainable])

    def _flat_grad_order(self) -> list[tuple[str, Tensor]]:
        """The models' parameters for ``FlatGrad(stack)``, labelled: name by name, model after
        model (NOTE [ One buffer for a stack ]), then any a model holds beyond the first's."""
        named = [dict(m.named_parameters()) for m in self.models]
        order: list[tuple[str, Tensor]] = []
        for name in list(named[0]) if named else []:
            for k, params in enumerate(named):
                p = params.pop(name, None)
                if p is not None:
                    order.append((f"[{k}].{name}", p))
        for k, params in enumerate(named):
            order.extend((f"[{k}].{name}", p) for name, p in params.items())
        return order

    def unstack_(self) -> None:
        """Give every model its own storage again (a copy of its slice) and forget the stack;
        an optimizer over ``parameters()`` no longer reaches the models."""
        with self._lock, torch.no_grad():
            for t in self._tensors:
                t.data = t.data.clone()
            for model in self.models:
                if _stack_of.get(model) is self:
                    del _stack_of[model]
            self.values = {}
            self._aliases.clear()
            self._broken = "they were unstacked"

    # -- the per-call check --------------------------------------------------------------
    def _check(self) -> str | None:
        """Why this stack cannot run as one now, or None (NOTE [ Stacked storage ])."""
        if self._broken is not None:
            if self.values:
                self._drop_zeroed_frozen()  # models that differ, held all the same
            return self._broken
        same = map(
            operator.is_, map(dict.get, self._entry_dicts, self._entry_keys), self._entry_values
        )
        if (
            not all(same)
            or list(map(type, map(_deref, self._module_refs))) != self._types
            or list(map(_data_ptr, self._tensors)) != self._ptrs
            or not self._still_slices(self._tensors)
            or list(map(_requires_grad, self._tensors)) != self._requires
            or list(map(len, self._sized)) != self._sizes
        ):
            reason = self._restack()
            if reason is not None:
                return reason
        if not self._slots_checked:
            self._check_slots()
        self._drop_zeroed_frozen()
        if any(map(operator.contains, self._attribute_dicts, _FORWARD)):
            return "a module was given a forward of its own"
        if self._handles_seen is None or handle_count() != self._handles_seen:
            # a hook was registered somewhere since the last call: look for one here
            if any(map(len, self._hook_dicts)):
                return "a module hook was registered"
            tensors = self._trainable_tensors
            if any(map(_tensor_hooks, tensors)):
                return "a parameter has a gradient hook"
            # Post-accumulate hooks: parsum's own (a FlatGrad's, a StepInBackward's) are never
            # removed but to be put back, so while their number stands no user's was added;
            # counting them is a C loop, telling them apart a Python call a parameter.
            posts = sum(map(len, filter(None, map(post_accumulate_hooks, tensors))))
            if posts != self._own_post_hooks:
                if any(map(has_user_post_hooks, tensors)):
                    return "a parameter has a gradient hook"
                self._own_post_hooks = posts
        return None

    def _check_stepped(self, sib: StepInBackward) -> None:
        """Refuse a model's trainable tensor that its optimizer in ``sib`` does not step (one
        assigned or unfrozen since ``sib`` was made, which the stack now holds): looked at
        once a stacking."""
        if self._stepped_by is not None and self._stepped_by() is sib:
            return
        names = self._trainable
        for k, model in enumerate(self.models):
            j = sib.index(model)
            assert j is not None  # sum_models found every model in it
            missed = sib.first_not_stepped(j, [self._params[name][k] for name in names])
            if missed is not None:
                raise not_stepped("sum_models", k, model, names[missed])
        self._stepped_by = weakref.ref(sib)

    def _still_slices(self, tensors: list[Tensor]) -> bool:
        """Whether ``tensors``, at the addresses of the stack's slices, still have the slices'
        sizes and strides: ``p.data = p.data[:16]`` (a narrower layer) keeps the address, and
        the stacked forward then read the whole slice (NOTE [ Stacked storage ]). Elements and
        strides tell every view the models' own layers can read from a slice's shape (its
        strides give every size but the first, the elements that one), at two C calls a tensor
        (sizes are a third)."""
        return (
            list(map(_numel, tensors)) == self._numels
            and list(map(_stride, tensors)) == self._strides
        )

    def _restack(self) -> str | None:
        """After a change: stack the models again if they are still identical."""
        if any(_stack_of.get(m) is not self for m in self.models):
            return "a model was stacked again elsewhere"
        try:
            infos = _check_identical(list(self.models))
        except ParsumError as exc:
            return str(exc).removeprefix(f"{_WHERE}: ")
        tensors = [t for info in infos for t in (*info.tensors, *info.state)]
        if (
            list(map(_data_ptr, tensors)) == self._ptrs
            and self._still_slices(tensors)
            and all(map(operator.is_, tensors, self._tensors))
            # The same names trainable: a model's last trainable tensor frozen on every model
            # keeps the tensors' order, and the stack had gone on training it, silently.
            and infos[0].names == self._trainable
        ):
            self._record(infos)  # the storage holds: a flag or a setting changed on every model
        else:
            self._place(infos)
            self._slots_checked = False  # looked at by _check, until they fit
        return None

    def _stack_again(self) -> None:
        """``stack_`` over this stack's models (NOTE [ Stacking stacked models ]): their storage
        checked, and where the stack gave up or they changed, stacked again into the same
        tensors; ParsumError where they are no longer identical, leaving the stack as it was."""
        with self._lock:
            if self._broken is None and self._check() is None:
                return
            infos = _check_identical(list(self.models))
            self._broken = None
            self._warned.clear()
            self._place(infos)
            self._slots_checked = False

    def _check_slots(self) -> None:
        """Refuse a FlatGrad made before the models were cast or moved, whose slots no longer
        fit them (NOTE [ Stale slots ] in _grads): after every restack, until they fit."""
        for name, params in self._params.items():
            check_slots(self.models, [[name]] * len(params), [[p] for p in params])
        self._slots_checked = True

    def give_up(self, reason: str) -> None:
        """Run these models one by one from now on, saying why once."""
        with self._lock:
            self._broken = reason
            self._forget_gradients()
        self._warn(reason)

    def _gathers(self, reason: str) -> bool:
        """Whether the models' gradients still reach the stacked tensors while the models run
        one by one because they differ (``reason``; NOTE [ Models that differ, trained over
        the stack ]): an optimizer over ``parameters()`` wants them, and every tensor is
        still its slice, as trainable as when stacked, or the models still fit the stacked
        tensors (a layer frozen on every model, new ``.data``): then stacked again as they
        are, to run one by one until ``stack_``."""
        if not (self._stacked_grads_wanted and self.values):
            return False
        if (
            list(map(_data_ptr, self._tensors)) == self._ptrs
            and self._still_slices(self._tensors)
            and list(map(_requires_grad, self._tensors)) == self._requires
        ):
            return True
        if not self._hold_differing(list(self.models), self.values, reason, keep=True):
            return False
        self._drop_zeroed_frozen()  # as _check does after a restack
        return True

    def _one_by_one(self, reason: str) -> bool:
        """Run the models one by one because of ``reason``: whether their gradients still
        reach the stacked tensors (``_gathers``); where not, the stacked ``.grad`` dropped."""
        if self._gathers(reason):
            return True
        self._forget_gradients()
        return False

    def _warn(self, reason: str, gathered: bool = False) -> None:
        if (reason, gathered) not in self._warned:
            self._warned.add((reason, gathered))
            then = (
                "their gradients still reach stack.parameters(), and parsum.stack_ stacks "
                "them again once they are identical"
                if gathered
                else "an optimizer over stack.parameters() gets no gradient until "
                "parsum.stack_ is called again on identical models"
            )
            warnings.warn(
                f"parsum: the stacked models run one by one (slower) because {reason}; {then}",
                # At the caller of sum_models: past this, the stack's caller, sum_models and
                # torch.compiler.disable's wrapper.
                stacklevel=5,
            )

    # -- gradients -----------------------------------------------------------------------
    def _settle(self, name: str, grad: Tensor | None) -> None:
        """Hand a stacked gradient to the models' ``.grad``, and to the stacked tensor's
        ``.grad`` while it holds them all (NOTE [ Gradient buffers ]). ``grad=None``: a zero
        gradient, before the models' own gradients accumulate in place (``attach_at_backward``);
        a ``.grad`` set by hand is then left as it is."""
        params, stacked = self._params[name], self.values[name]
        block = self._flat_block(name)
        if block is not None and (grad is None or not grad.requires_grad):
            self._settle_block(name, grad, block)
            return
        self._given.discard(name)
        if has_flat_grads(params):
            stacked.grad = None  # the models' .grad are a FlatGrad's views, not the stack's
            if self._stacked_grads_wanted and "flat" not in self._warned:
                self._warned.add("flat")
                warnings.warn(
                    "parsum: the stacked models' gradients go to the FlatGrad that holds their "
                    "parameters, so the stack's tensors get none and an optimizer over "
                    "stack.parameters() would not step them: build the FlatGrad over the "
                    "stack, parsum.FlatGrad(stack), whose buffer is then the stack's gradient "
                    "too, or the optimizer over the models' own parameters",
                    stacklevel=2,
                )
            if grad is not None:
                _write_flat(params, grad)
            return
        current = list(map(_grad_of, params))
        views = self._grad_views.get(name)
        buffer = self._grad_buffers.get(name)
        if grad is not None and grad.requires_grad:  # create_graph: differentiable, fresh views
            for p, g, v in zip(params, current, grad.unbind(0)):
                p.grad = v if g is None else g + v
            stacked.grad = None
        elif all(map(operator.is_, current, _nones(len(params)))):
            stacked.grad = None
            if buffer is not None and views is not None and _unobserved(buffer, views):
                _overwrite(buffer, grad)
            else:
                buffer = torch.zeros_like(stacked) if grad is None else grad
                views = buffer.unbind(0)
                self._grad_buffers[name], self._grad_views[name] = buffer, views
            for p, v in zip(params, views):
                p.grad = v
            stacked.grad = buffer.view_as(buffer)  # a view: seen by the storage count
        elif buffer is not None and views is not None and all(map(operator.is_, current, views)):
            if stacked.grad is None:  # zeroed by an optimizer over stack.parameters()
                _overwrite(buffer, grad)
                stacked.grad = buffer.view_as(buffer)
            elif grad is not None:
                buffer.add_(grad)
        else:  # a .grad set by hand: model by model
            stacked.grad = None
            if grad is not None:
                for p, g, v in zip(params, current, grad.unbind(0)):
                    if g is None:
                        p.grad = v.clone()
                    else:
                        g.add_(v)
            if self._stacked_grads_wanted:
                self._adopt(name)

    def _adopt(self, name: str) -> None:
        """Make the models' gradients of ``name`` a buffer's views again, and that buffer the
        stacked tensor's ``.grad``, for an optimizer over ``stack.parameters()``: gradients of
        their own (set by hand, or kept while the name was frozen) had left the stacked
        ``.grad`` None for good, and that optimizer stepped nothing of ``name`` from then on,
        silently (NOTE [ Gradients across a restack ])."""
        params = self._params[name]
        grads = list(map(_grad_of, params))
        if any(map(operator.is_, grads, _nones(len(params)))) or any(
            g.layout != torch.strided or g.shape != p.shape or g.dtype != p.dtype
            for p, g in zip(params, grads)
        ):
            return  # a model with no gradient, or one of another kind: each keeps its own
        with torch.no_grad():
            self._give(name, torch.stack([g.detach() for g in grads]))

    def _give(self, name: str, buffer: Tensor) -> None:
        """Make ``buffer`` (the models' gradients of ``name``, stacked) their ``.grad`` as its
        views, and the stacked tensor's ``.grad`` (NOTE [ Gradient buffers ])."""
        views = buffer.unbind(0)
        for p, v in zip(self._params[name], views):
            p.grad = v
        self._grad_buffers[name], self._grad_views[name] = buffer, views
        self.values[name].grad = buffer.view_as(buffer)  # a view: seen by the storage count

    def _flat_block(self, name: str) -> SlotBlock | None:
        """The FlatGrad block holding the gradients of ``name``, if one is laid out so (NOTE
        [ One buffer for a stack ]); looked up again when a parameter changed FlatGrads."""
        generation = owners_generation()
        known = self._flat_blocks.get(name)
        if known is not None and known[0] == generation:
            block = known[1]
            if block is None or block.owner() is not None:
                return block
        block = slot_block(self._params[name])
        self._flat_blocks[name] = (generation, block)
        return block

    def _settle_block(self, name: str, grad: Tensor | None, block: SlotBlock) -> None:
        """``_settle`` where a FlatGrad block holds the models' gradients (NOTE [ One buffer
        for a stack ])."""
        params, stacked, views = self._params[name], self.values[name], block.views
        current = list(map(_grad_of, params))
        held = all(map(operator.is_, current, views))
        # An optimizer over stack.parameters() set the block's tensor's .grad to None: it
        # zeroed every model's gradient, which the views still hold.
        zeroed = held and stacked.grad is None and name in self._given
        fresh = zeroed or all(map(operator.is_, current, _nones(len(params))))
        if fresh and grad is None:
            block.zero_()
        elif not fresh and not held:  # some .grad None, some set by hand: row by row
            with torch.no_grad():
                for k, (p, g, view) in enumerate(zip(params, current, views)):
                    if g is view:
                        continue
                    if g is None:
                        view.zero_()
                    else:
                        view.copy_(g)
                    if block.comp is not None:
                        block.comp[k].zero_()
                    p.grad = view
            held = True
        if grad is not None:
            block.write(params, grad, fresh, held)
        elif not held:  # the models accumulate into their views next
            for p, view in zip(params, views):
                p.grad = view
        block.give_to(stacked)
        self._given.add(name)

    def attach_at_backward(self, out: Any) -> None:
        """For models that ran one by one although the stack holds: when backward reaches
        ``out``, first make every model's ``.grad`` a view of the stack's buffer where the
        stacked gradient would have been (zeroed), so that the models' gradients accumulate
        there in place and an optimizer over ``parameters()`` sees them. Without such an
        optimizer (``parameters()`` never called), the models keep autograd's own gradients
        and the stacked tensors none: zeroing the buffer and adding into it cost 1 ms a step
        for 16 MLPs of width 256 at batch 256 (11.5 against 10.5 ms, 2 threads)."""
        node = next((t.grad_fn for t in pytree.tree_leaves(out) if t.grad_fn is not None), None)
        if node is None:
            return
        me = weakref.ref(self)
        if hasattr(node, "before_backward"):
            # parsum's own node calls it first thing in its backward: a hook registered on
            # every call would make every next call plan anew (NOTE [ Reused plans ]).
            before = node.before_backward  # another stack's models in the same call

            def attach() -> Callable[[], None]:
                undo_before = before() if before is not None else None
                undo = _attach(me)

                def undo_both() -> None:
                    undo()
                    if undo_before is not None:
                        undo_before()

                return undo_both

            node.before_backward = attach
        else:
            node.register_prehook(functools.partial(_attach_first, me))

    def _release(self, name: str) -> None:
        """Before models that ran one by one are pulled back with no optimizer over
        ``parameters()``: their gradients go where autograd puts them; the stacked ``.grad``
        stays only while it is their ``.grad`` (the buffer's views, accumulated in place)."""
        stacked = self.values[name]
        views = self._grad_views.get(name)
        if stacked.grad is not None and (
            views is None or not all(map(operator.is_, map(_grad_of, self._params[name]), views))
        ):
            stacked.grad = None
            self._given.discard(name)

    def _forget_gradients(self) -> None:
        """No stacked ``.grad`` while the models run one by one: an optimizer over
        ``parameters()`` must not step them with a gradient of an earlier call. A FlatGrad
        block given as a name's stacked ``.grad`` that such an optimizer set to None is
        zeroed first: the models' ``.grad``, its views, still held the zeroed step's
        gradients, which the next backward added to (NOTE [ One buffer for a stack ])."""
        for name in self._trainable:
            stacked = self.values.get(name)
            if stacked is None:
                continue
            if stacked.grad is None and name in self._given:
                block = self._flat_block(name)
                params = self._params[name]
                if block is not None and all(map(operator.is_, map(_grad_of, params), block.views)):
                    block.zero_()
            stacked.grad = None
        self._given.clear()


def _write_flat(params: list[Tensor], grad: Tensor) -> None:
    """Each model's slice of a stacked gradient into its parameter's FlatGrad slot (compensated
    where the FlatGrad is), as sum_models' backward writes slots (NOTE [ Who writes a FlatGrad
    slot ] in _grads); a parameter without a slot accumulates its slice itself."""
    # Written from an autograd hook, as autograd accumulates: nothing to undo.
    writes = FlatWrites(params, [True] * len(params), undoable=False)
    slices = grad.unbind(0)
    writes.write([(k, g) for k, g in enumerate(slices) if k in writes])
    writes.commit()
    for k, (p, g) in enumerate(zip(params, slices)):
        if k not in writes:
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.add_(g)


def _overwrite(buffer: Tensor, grad: Tensor | None) -> None:
    if grad is None:
        buffer.zero_()
    else:
        buffer.copy_(grad)


def _unobserved(buffer: Tensor, views: tuple[Tensor, ...]) -> bool:
    """Whether nothing outside the stack refers to ``buffer`` or its views: the views are
    referenced from the stack's tuple only, and no other tensor shares the buffer's storage."""
    if _storage_use_count is None:
        return False
    if max(map(sys.getrefcount, views)) > 2:  # the tuple, and getrefcount's argument
        return False
    storage = buffer.untyped_storage()
    return _storage_use_count(storage._cdata) <= len(views) + 2  # + buffer, storage


@functools.cache
def _nones(n: int) -> list[None]:
    return [None] * n


def _check_identical(models: list[nn.Module]) -> list[ModelParams]:
    """What one walk finds in each model; raise unless they can be stacked: identical,
    unshared, plain modules."""
    seen: dict[int, int] = {}
    keys: list[Any] = []
    infos: list[ModelParams] = []
    for i, model in enumerate(models):
        if not isinstance(model, nn.Module):
            raise ParsumError(f"{_WHERE}: models[{i}] is {a_kind_of(model)}; expected an nn.Module")
        info = ModelParams.of(model)
        for t in (*info.modules, *info.tensors, *info.state):
            if isinstance(t, nn.Module) and not (t._parameters or t._buffers):
                continue  # a module without tensors (an activation) may be shared
            other = seen.setdefault(id(t), i)
            if other != i:
                raise ParsumError(
                    f"{_WHERE}: models[{i}] ({type(model).__name__}) shares a module or "
                    f"tensor with models[{other}]; stacked models each hold their own"
                )
        if not info.tensors:
            raise ParsumError(
                f"{_WHERE}: models[{i}] ({type(model).__name__}) has no trainable parameter"
            )
        key = structure_key(info)
        if key is None:
            raise ParsumError(
                f"{_WHERE}: models[{i}] ({type(model).__name__}) cannot run as a stacked "
                f"model: {unstackable(model, info)}"
            )
        if keys and key != keys[0]:
            raise ParsumError(
                f"{_WHERE}: models[{i}] ({type(model).__name__}) differs from models[0] "
                f"({type(models[0]).__name__}) {first_difference(models[0], infos[0], model, info)}"
                "; stacked models must be identical"
            )
        keys.append(key)
        infos.append(info)
    return infos


def wanted_stacks_among(models: Sequence[Any]) -> list[Stack]:
    """The stacks with an optimizer over their tensors (``parameters()`` asked for) that hold
    some of ``models``, once each, their storage checked (NOTE [ Stacked storage ]): a call on
    some of a stack's models, or on them in another order, runs them one by one, and their
    gradients must reach the stack's tensors all the same."""
    if not _wanted:
        return []
    found: dict[int, Stack] = {}
    owners: dict[int, Stack] | None = None  # a wanted stack's models' parameters, by id
    for model in models:
        module = module_of(model)  # a bound method's or a partial's module
        if module is None:
            continue
        stack = _stack_of.get(module)
        if stack is not None:
            if stack._stacked_grads_wanted:
                found[id(stack)] = stack
            continue
        # A module that reaches a stacked model's parameters otherwise (torch.compile's
        # wrapper, a module that holds the model, a torch.fx trace of it) trains the stack's
        # tensors all the same: found by its parameters.
        if owners is None:
            owners = {
                id(p): s
                for s in list(_wanted)
                if s._stacked_grads_wanted
                for ps in s._params.values()
                for p in ps
            }
        for p in module.parameters():
            stack = owners.get(id(p))
            if stack is not None:
                found[id(stack)] = stack
    held = []
    for stack in found.values():
        with stack._lock:
            reason = stack._check()
            # NOTE [ Models that differ, trained over the stack ]
            gathers = reason is None or stack._one_by_one(reason)
        if gathers:
            held.append(stack)
        if reason is not None:
            stack._warn(reason, gathers)
    return held


def stack_for(models: Sequence[Any]) -> Stack | None:
    """The stack whose models are exactly ``models``, in order, if there is one."""
    first = models[0]
    if not isinstance(first, nn.Module):
        return None
    stack = _stack_of.get(first)
    if stack is None or len(stack._refs) != len(models):
        return None
    if not all(map(operator.is_, [ref() for ref in stack._refs], models)):
        return None
    return stack


_FORWARD = itertools.repeat("forward")


# What ``stacked_sum`` returns where the models run one by one this call, into the stack's
# gradient buffers (``Stack.attach_at_backward``): ``auto`` finds them too large for one batched
# forward, or a global module hook is registered or a torch function or dispatch mode is on
# (NOTE [ Global module hooks and stacked groups ] in _grouping).
ONE_BY_ONE = object()


# Raised inside ``stacked_sum`` where the models' batched forward failed; the caller runs
# them one by one, which names the model and tells a bad call from what vmap cannot run.
class StackedForwardFailed(Exception):
    pass


def stacked_sum(
    stack: Stack,
    call: CallArgs,
    weights: list[float] | None,
    weight_tensor: Tensor | None,
    max_param_rows: int | None,
    step_in_backward: StepInBackward | None = None,
) -> Any:
    """The weighted sum of a stack's models' outputs, the models run as one batched forward;
    None when the stack cannot run as one now, ONE_BY_ONE when ``auto`` finds the models too
    large to pay (``max_param_rows``, parameters times batch rows; None: any size), or a
    global module hook or a mode is on.

    Raises:
        StackedForwardFailed: the batched forward raised (chained).
    """
    if autocast_states() and not runs_as_program(stack._program, *call.build()):
        return None  # NOTE [ Autocast under vmap ] in _engines: the general path, this call
    if module_calls_watched():  # NOTE [ Global module hooks and stacked groups ] in _grouping
        return ONE_BY_ONE
    handles = handle_count()  # before the check: a hook registered after it is seen next time
    with stack._lock:
        reason = stack._check()
        if reason is not None:
            # NOTE [ Models that differ, trained over the stack ]
            gathered = stack._one_by_one(reason)
            stack._warn(reason, gathered)
            return ONE_BY_ONE if gathered else None
        if step_in_backward is not None and torch.is_grad_enabled():
            stack._check_stepped(step_in_backward)
        if max_param_rows is not None and stack._numel * _batch(call).rows > max_param_rows:
            return ONE_BY_ONE
        values, program = stack.values, stack._program
        trainable = stack._trainable
        build_graph = torch.is_grad_enabled()
        tensors = dict(values)
        hooked = 0  # hooks registered by this call
        if build_graph:
            me = weakref.ref(stack)
            if step_in_backward is None:
                for name in trainable:
                    alias = stack._aliases.pop(name, None)  # lent to this graph
                    if alias is None:  # each is lent to another graph: one of its own
                        alias = values[name].detach().requires_grad_()
                        alias.register_post_accumulate_grad_hook(_Deliver(me, name))
                        hooked += 1
                    tensors[name] = alias
            else:  # this call's own aliases: its hooks step the optimizer
                stepping = _Stepping(me, step_in_backward)
                for name in trainable:
                    alias = tensors[name] = values[name].detach().requires_grad_()
                    alias.register_post_accumulate_grad_hook(functools.partial(stepping, name))
                    hooked += 1
        watching = stack._watching
    names = set(trainable)
    try:
        args, kwargs = call.build()
        # NOTE [ Weights written before a group's backward ] in _engines: what is watched,
        # kept from call to call
        needs_grad = GroupReads.argument_needs_grad(args)
        watched = watching.get(needs_grad)
        if watched is None:
            by_model = stack._tensors_by_model
            watched = GroupReads.watched(stack._watched_names, by_model, program, needs_grad)
            watching[needs_grad] = watched
        reads = GroupReads.reading(tensors, *watched)
        leaves, spec = batched_forward(
            stack[0],
            program,
            {n: t for n, t in tensors.items() if n in names},
            {n: t for n, t in tensors.items() if n not in names},
            args,
            kwargs,
        )
    except Exception as exc:
        raise StackedForwardFailed() from exc
    if handles is not None and handle_count() == handles + hooked:
        stack._handles_seen = handles + hooked  # no hook but ours since the check
    model_error = functools.partial(_stacked_model_error, weakref.ref(stack))
    check = _GroupCheck.of(reads, call, model_error)
    return pytree.tree_unflatten(_sum_over_models(leaves, weights, weight_tensor, check), spec)


def _stacked_model_error(stack: weakref.ref[Stack], k: int, exc: Exception) -> ParsumError:
    """The error of a stack's model ``k`` in backward, as sum_models names a model."""
    model = stack()
    kind = "?" if model is None else model_kind(model[k])
    return model_failed("sum_models", k, kind, "backward", exc)


class _GroupCheck(NamedTuple):
    """What a group's backward checks before it writes any gradient (NOTE [ Weights written
    before a group's backward ] in _engines): its reads, the call's tensor arguments with
    their versions at the forward, and the error naming its model."""

    reads: GroupReads
    call: CallArgs
    versions: list[int]  # ``argument_versions(call)`` at the forward
    model_error: Any  # (the model's place in the group, autograd's error) -> ParsumError

    @staticmethod
    def of(reads: GroupReads, call: CallArgs, model_error: Any) -> _GroupCheck:
        return _GroupCheck(reads, call, argument_versions(call), model_error)


def _sum_over_models(
    leaves: list[Tensor],
    weights: list[float] | None,
    weight_tensor: Tensor | None,
    check: _GroupCheck,
) -> list[Tensor]:
    """Each output leaf, the models' along dim 0, weighted and summed in the wide dtype (NOTE
    [ Compensated summation ] in _summation); where it needs a gradient, ``check`` runs on
    the wide sum's gradient, before the group's graph is reached."""
    summed = []
    w = weight_tensor if weight_tensor is not None else weights
    for leaf in leaves:
        ends = [leaf.grad_fn]  # below the hook: no cycle through the node that holds it
        if w is not None:
            leaf = weigh_models(leaf, w)
        # Booleans counted, as the plain sum counts them.
        wide = wide_sum_over_models(leaf)
        if wide.requires_grad:
            # Set as register_hook sets it, without a handle (``own_rows_in_backward``)
            wide._backward_hooks = OrderedDict(check=functools.partial(_checked, check, ends))
            node = wide.grad_fn
            assert node is not None
            node._register_hook_dict(wide)
        summed.append(wide.to(sum_dtype(leaf.dtype)))
    return summed


def _checked(check: _GroupCheck, ends: list[Any], grad: Tensor) -> None:
    """Raise where a model's tensor that the group's graph behind ``ends`` saved was written
    in place since the forward; a hook on the wide sum's gradient."""
    check.reads.check(ends, check.model_error)
    # An argument written in place: autograd raises, named here with the first model, as the
    # general path names it (every model of the group read it).
    if argument_versions(check.call) != check.versions:
        try:
            unpack_saved(ends)
        except Exception as exc:
            raise check.model_error(0, exc) from exc


def group_in_callers_graph(
    models: Sequence[nn.Module],
    model_params: Sequence[ModelParams],
    call: CallArgs,
    weights: list[float] | None,
    weight_tensor: Tensor | None,
    model_error: Any,
) -> Any:
    """The weighted sum of identical models run as one batched forward in the caller's own
    graph (NOTE [ One group in the caller's graph ]); ``model_error``: (the model's index,
    autograd's error) -> the error that names it."""
    args, kwargs = call.build()
    trainable, state, leaves, spec = batched_in_graph(models[0], model_params, args, kwargs)
    # NOTE [ Weights written before a group's backward ] in _engines
    program = program_of(models[0])
    tensors = [mp.tensors for mp in model_params]
    reads = GroupReads.of(trainable, tensors, program, args, state, model_params)
    check = _GroupCheck.of(reads, call, model_error)
    summed = _sum_over_models(leaves, weights, weight_tensor, check)
    return pytree.tree_unflatten(summed, spec)


def _own_storage(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """A stacked model's state_dict holds copies of its slices: ``torch.save`` writes a view's
    whole storage, so one model's checkpoint would otherwise hold every model's tensors."""
    for key, value in state_dict.items():
        if isinstance(value, Tensor) and value.untyped_storage().nbytes() > value.nbytes:
            state_dict[key] = value.clone()


def _attach(stack: weakref.ref[Stack]) -> Callable[[], None]:
    """``Stack.attach_at_backward``'s work as the backward starts; what sets the ``.grad`` it
    changed back as they were (for a backward that fails: a failed call changes nothing)."""
    found = stack()
    if found is None:
        return _nothing
    with found._lock:
        tensors = [
            t for name in found._trainable for t in (found.values[name], *found._params[name])
        ]
        kept = list(map(_grad_of, tensors))
        for name in found._trainable:
            if found._stacked_grads_wanted:
                found._settle(name, None)
            else:
                found._release(name)

    def undo() -> None:
        for t, grad in zip(tensors, kept):
            t.grad = grad

    return undo


def _nothing() -> None:
    pass


def _attach_first(stack: weakref.ref[Stack], grad_outputs: Any) -> None:
    """``_attach`` as a node's pre-hook (which must return None: nothing to undo there)."""
    _attach(stack)


class _Deliver:
    """An alias's post-accumulate hook: its gradient goes to the models' ``.grad``."""

    __slots__ = ("name", "stack")

    def __init__(self, stack: weakref.ref[Stack], name: str) -> None:
        self.stack, self.name = stack, name

    def __call__(self, alias: Tensor) -> None:
        grad, alias.grad = alias.grad, None
        stack = self.stack()
        if stack is None or grad is None:
            return
        with stack._lock:
            stack._settle(self.name, grad)
            # Its graph is freed as this backward ends: the alias can serve the next call,
            # unless the stack has other storage since (the alias keeps its own alive, so no
            # new storage can start where it does: NOTE [ Lasting aliases ]).
            values = stack.values.get(self.name)
            if (
                not _engine_keeps_graph()
                and values is not None
                and values.data_ptr() == alias.data_ptr()
            ):
                stack._aliases.setdefault(self.name, alias)


class _Stepping:
    """The aliases' post-accumulate hooks of a call with ``step_in_backward`` (NOTE [ Fused
    steps ] in _fused): the stacked gradients are kept, and when the backward ends each
    model's optimizer steps with its slices, which are then dropped (``.grad`` stays None)."""

    def __init__(self, stack: weakref.ref[Stack], sib: StepInBackward) -> None:
        self.stack, self.sib = stack, sib
        self.grads: dict[str, Tensor] = {}
        found = stack()
        assert found is not None  # the call that makes this holds it
        # Each stacked model's index in ``sib``, where sum_models found every one of them.
        self.order = [j for j in map(sib.index, found.models) if j is not None]
        assert len(self.order) == len(found.models)

    def __call__(self, name: str, alias: Tensor) -> None:
        grad, alias.grad = alias.grad, None
        if grad is None:
            return
        if not self.grads:  # the first: step when this backward is done with every alias
            stack = self.stack()
            if stack is not None:  # NOTE [ One step a backward ] in _fused
                again = self.sib.claim_steps(self.order, False)
                if again is not None:
                    k = self.order.index(again[0])
                    raise stepped_twice(
                        "sum_models", f"stacked model {k}", stack.models[k], again[1]
                    )
            torch.autograd.Variable._execution_engine.queue_callback(self.step)
        self.grads[name] = grad

    def step(self) -> None:
        stack, grads = self.stack(), self.grads
        self.grads = {}
        if stack is None:
            return
        names = stack._trainable
        stepped: list[int] = []
        order = self.order
        try:
            try:
                done_as_one = self.sib.holding(
                    order,
                    lambda: step_stacked(
                        self.sib,
                        id(stack),
                        order,
                        [stack._params[name] for name in names],
                        [stack.values[name] for name in names],
                        [grads.get(name) for name in names],
                    ),
                )
            except Exception as exc:
                raise ParsumError(
                    f"sum_models: the optimizer step of the {len(order)} stacked models, as one "
                    f"(NOTE [ One step over stacked models ]), raised {type(exc).__name__}: "
                    f"{message_of(exc)}"
                ) from exc
            if done_as_one:
                return
            for k, (model, j) in enumerate(zip(stack.models, order)):
                params = [stack._params[name][k] for name in names]
                slices = [grads[name][k] if name in grads else None for name in names]
                try:
                    self.sib.step(j, params, slices)
                except Exception as exc:
                    done = f"; the optimizer step already ran for models {stepped}"
                    raise ParsumError(
                        f"sum_models: model {k} ({type(model).__name__}) raised "
                        f"{type(exc).__name__} in its optimizer step: {message_of(exc)}"
                        f"{done if stepped else ''}"
                    ) from exc
                stepped.append(k)
        finally:
            # The backward is over: no gradient can reach a stepped parameter after its step
            # (NOTE [ Gradients from outside the sum ] in _fused); one from outside the sum
            # came before, and was added in.
            self.sib._stepped.clear()


def _batch(call: CallArgs) -> Batch:
    return Batch.of([call.leaves[j] for j in call.tensor_positions])
