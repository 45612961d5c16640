"""Per-model pullback makers: run one model, return its output and a function for its VJP.

# NOTE [ Engines ]
# "autograd": the model's own autograd graph, built in the worker under ``enable_grad`` on
#   detached inputs, pulled back with ``torch.autograd.grad`` (PyTorch supports concurrent
#   backward calls from different CPU threads). Works for any callable and any module, also
#   modules that update buffers in forward (BatchNorm). The fastest per call.
# "vjp": ``torch.func.vjp`` over ``torch.func.functional_call``. Pure functions only: a model
#   that mutates a buffer in forward fails under functorch, and parsum says so.
# "stacked": structurally identical models (``_grouping``) run as one ``torch.vmap`` over
#   ``functional_call`` of the first of them, with every model's parameters stacked by
#   ``torch.stack`` inside the graph, so gradients reach the original parameters through the
#   stack's backward. One call for the whole group: worth it for small models, whose time goes
#   to per-call overhead. The argument gradients come out summed over the group.
# "vjp" and "stacked" run a shadow of the user's module, never the module itself: NOTE [ Shadow
#   modules ].
# All pull back with respect to the same things: the tensor arguments that need a gradient and
# the models' trainable parameters, in ``ModelParams.tensors`` order. A model's parameters are
# those of its module (``module_of``: the model, or the module of a bound method or partial);
# a plain callable has none, so under "autograd" its graph is checked to reach no other tensor
# that requires grad, whose gradient would otherwise be lost.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import inspect
import itertools
import operator
import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.nn.modules import module as module_globals
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.utils.spectral_norm import SpectralNorm as SpectralNormHook
from torch.overrides import has_torch_function
from torch.utils import _pytree as pytree

from ._errors import ParsumError, a_kind_of
from ._pool import autocast_states
from ._random import draws_now, may_recompute
from ._sparse import GradSum, add_grad, has_user_hooks, has_user_post_hooks
from ._torch_calls import torch_nn_untouched

# Models whose stacked group vmap could not run; engine="auto" no longer stacks them, instead of
# failing again on every call (a model vmap cannot run once rarely runs later).
VMAP_FAILED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_vmap_failures = [0]


def vmap_failure_count() -> int:
    """How many groups were found so far that vmap cannot run (``VMAP_FAILED`` grew)."""
    return _vmap_failures[0]


# NOTE [ Shadow modules ]
# ``torch.func.functional_call`` runs a module with other tensors by swapping them into the
# module's parameter and buffer dicts and swapping them back afterwards. On the user's own
# modules that is a race with anything else that runs them at the same time: two user threads
# summing the same models interleave their swaps and each restores what the other put in
# (measured: 10 identical MLPs, 2 threads x 30 calls; "vjp" left plain tensors in place of the
# parameters, which the optimizer then never updated, and "auto" raised vmap errors and broke
# the models), and a thread running a model plainly meanwhile computes with the other call's
# batched tensors. So functional_call gets a shadow: a copy of every module object of the tree
# with its own parameter, buffer and submodule dicts, sharing everything else (the tensors,
# hooks, settings, the training flag). The swaps happen in the shadow's dicts only; the user's
# modules are never written to. Made on every call (about 1 us a module), so it is never stale.
# What a forward assigns on a shadow (``self.calls += 1``, a buffer reassigned) is written back
# to the module where the shadow ran a model's own forward (parameters read through aliases,
# NOTE [ Hooks run once ]); under functorch ("vjp", "stacked") such values are transformed
# tensors that must not escape, so there they are dropped: those engines take models whose
# forward assigns nothing (in-place updates of a buffer's values do reach the buffer).


# NOTE [ Compiled modules ]
# ``torch.compile(module)`` returns an ``OptimizedModule`` that holds the module as ``_orig_mod``
# (its parameters are named ``_orig_mod.*``) and whose ``forward``, an attribute of its own, is
# the compiled code bound to that original module; its ``training`` flag is a property that
# reads the original's. ``module.compile()`` sets the module's ``_compiled_call_impl`` to the
# compiled ``_call_impl`` of the module itself. parsum calls such a model as it is wherever the
# model runs as itself (its compiled code runs). A shadow (above) would still run the original
# module through that bound code, never the shadow's tensors: parameters with a hook got no
# gradient (their hooks met None), and engine="vjp" returned wrong gradients. So a compiled
# module's shadow runs the shadow of the original module, uncompiled (the same computation;
# compiling a shadow made anew on every call would recompile on every call), and what the
# shadow runs instead is never written back. "auto" and "stacked" never stack a compiled
# module (the stacked program would replace the compiled code the user asked for), and
# ``stack_`` refuses one.
COMPILED_MODULES: tuple[type, ...] = ()
try:
    from torch._dynamo.eval_frame import OptimizedModule

    COMPILED_MODULES = (OptimizedModule,)
except ImportError:  # a torch without dynamo: nothing is compiled
    pass


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` runs compiled code: torch.compile's wrapper, or compiled in place."""
    return (
        isinstance(module, COMPILED_MODULES) or vars(module).get("_compiled_call_impl") is not None
    )


def shadow_module(
    module: nn.Module,
    replace: dict[int, Tensor] | None = None,
    memo: dict[int, tuple[nn.Module, nn.Module]] | None = None,
    watched: list[Watched] | None = None,
) -> nn.Module:
    """A copy of ``module``'s tree whose parameter, buffer and submodule dicts are its own
    (NOTE [ Shadow modules ]); a submodule reached twice is shadowed once. ``replace`` maps
    ``id(parameter)`` to the tensor the shadow holds instead, wherever the parameter is (in a
    list, tuple or dict attribute too: the shadow then holds a copy of the container, which is
    added to ``replace`` so that ``write_back`` leaves it). ``memo`` collects (module, shadow)
    pairs by id. With ``watched``, the shadows of modules of classes outside torch.nn hold
    copies of their mutable attributes, each listed there (NOTE [ Attributes assigned in
    forward ])."""
    if isinstance(module, torch.jit.ScriptModule):  # functional_call refuses it, with a message
        return module
    memo = {} if memo is None else memo
    found = memo.get(id(module))
    if found is not None:
        return found[1]
    # Not the class's own __new__: torch.fx's GraphModule makes a class for every instance
    # there, which lacks the instance's generated forward (the shadow of a traced or exported
    # model raised "missing the required forward function").
    shadow = object.__new__(module.__class__)
    memo[id(module)] = (module, shadow)
    state = dict(vars(module))
    own = state["_parameters"]
    state["_parameters"] = (
        {k: replace.get(id(p), p) for k, p in own.items()} if replace else dict(own)
    )
    if replace:  # a plain tensor attribute too, or one in a list (``ModelParams.loose``)
        for name, value in state.items():
            if isinstance(value, Tensor) and id(value) in replace:
                state[name] = replace[id(value)]
            elif isinstance(value, CONTAINERS) and name not in MODULE_INTERNALS:
                rebuilt = _replaced(value, replace)
                if rebuilt is not value:  # the shadow's own: write_back leaves it
                    state[name] = replace[id(rebuilt)] = rebuilt
    if watched is not None and _may_hold_loose_tensors(type(module)):  # type: ignore[arg-type]
        for name in state.keys() - MODULE_INTERNALS:
            kept = _kept_for_shadow(state[name])
            if kept is not None:
                watched.append(Watched(f"{type(module).__name__}.{name}", state[name], kept))
                state[name] = kept
    state["_buffers"] = dict(state["_buffers"])
    state["_modules"] = {
        name: None if child is None else shadow_module(child, replace, memo, watched)
        for name, child in state["_modules"].items()
    }
    if isinstance(module, COMPILED_MODULES):  # NOTE [ Compiled modules ]
        state["forward"] = state["_modules"]["_orig_mod"].__call__
        state.pop("_forward", None)
    if state.get("_compiled_call_impl") is not None:  # compiled in place: the same
        state["_compiled_call_impl"] = None
    object.__setattr__(shadow, "__dict__", state)
    return shadow


class Watched(NamedTuple):
    """A module's mutable attribute, ``value``, and the copy of it its shadow holds, ``kept``,
    which a batched forward must leave as it was."""

    name: str  # Class.attribute
    value: Any
    kept: Any


# Copied as they are: their subclasses too (OrderedDict, defaultdict, a deque's maxlen).
_MUTABLE_CONTAINERS = (list, dict, set, collections.deque)


def _kept_for_shadow(value: Any) -> Any:
    """The copy a shadow holds of a module's attribute, to see a batched forward change it: a
    shallow copy of a list, dict, set or deque, or of an instance of a plain Python class (its
    ``__dict__``), a clone of a tensor that needs no gradient (one that does is the model's
    own, ``ModelParams.loose``); None for anything else (values, modules, functions)."""
    if isinstance(value, Tensor):
        if value.requires_grad:
            return None
        with _versioned_tensors():
            return value.clone()
    try:
        if isinstance(value, _MUTABLE_CONTAINERS):
            return copy.copy(value)
        if _plain_class(type(value)):  # type: ignore[arg-type]
            kept = object.__new__(type(value))
            vars(kept).update(vars(value))
            return kept
    except Exception:  # a container subclass that cannot be copied: shared, unwatched
        return None
    return None


@contextlib.contextmanager
def _versioned_tensors() -> Iterator[None]:
    """Tensors made here are not inference tensors, which keep no version for a check of
    in-place changes (NOTE [ Attributes assigned in forward ]): under inference_mode, made
    outside it, without a graph."""
    if not torch.is_inference_mode_enabled():
        yield
        return
    with torch.inference_mode(False), torch.no_grad():
        yield


@functools.cache
def _plain_class(cls: type) -> bool:
    """Whether instances of ``cls`` are plain Python objects, their state all in their
    ``__dict__``: a class written in Python, made by ``object.__new__``, without slots."""
    return (
        cls.__new__ is object.__new__
        and cls.__module__ != "builtins"
        and cls.__dictoffset__ != 0
        and not any("__slots__" in vars(k) for k in cls.__mro__)
        and not issubclass(cls, (nn.Module, BaseException))
    )


def _changed(watched: Watched) -> bool:
    """Whether a forward changed the shadow's copy in ``watched``: it no longer holds what the
    original does (the same objects, by identity), or, a tensor, it was written in place."""
    value, kept = watched.value, watched.kept
    if isinstance(value, Tensor):
        return kept._version != 0
    return not _same_contents(_contents(kept), _contents(value))


def _contents(value: Any) -> Any:
    """What a container or an object holds, read as the builtin it derives from (no method of
    a subclass of the user's runs): a list of a list's or deque's items, a set's, a dict's, or
    an object's attributes as a dict."""
    if isinstance(value, list):
        return list.copy(value)
    if isinstance(value, dict):
        return dict.copy(value)
    if isinstance(value, set):
        return set.copy(value)
    if isinstance(value, collections.deque):
        return [*_deque_items(value)]
    return dict(vars(value))


def _same_contents(a: Any, b: Any) -> bool:
    """Whether two ``_contents`` hold the same objects (by identity; a set's by equality)."""
    if isinstance(a, set):
        return a == b
    if isinstance(a, list):
        return len(a) == len(b) and all(map(operator.is_, a, b))
    return len(a) == len(b) and all(b.get(k, _MISSING) is v for k, v in a.items())


_deque_items = collections.deque.__iter__


def _replaced(value: Any, replace: dict[int, Any], seen: frozenset[int] = frozenset()) -> Any:
    """``value`` with the tensors ``replace`` maps replaced, in copies of the lists, tuples
    and dicts that hold them; ``value`` itself where none is (or where it holds itself)."""
    if isinstance(value, Tensor):
        return replace.get(id(value), value)
    if not isinstance(value, CONTAINERS) or id(value) in seen:
        return value
    seen = seen | {id(value)}
    if isinstance(value, dict):
        items = {k: _replaced(v, replace, seen) for k, v in value.items()}
        same = all(items[k] is v for k, v in value.items())
        return value if same else type(value)(items)
    parts = [_replaced(v, replace, seen) for v in value]
    if all(a is b for a, b in zip(parts, value)):
        return value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*parts)
    return type(value)(parts)


def write_back(pairs: Iterable[tuple[nn.Module, nn.Module]], placed: Iterable[Tensor]) -> None:
    """What a forward assigned on shadows (``self.calls += 1``, ``self.stats = ...`` for a
    buffer), written to the modules they shadow, as the plain loop's forward would have left
    it; the tensors ``placed`` in the shadows instead of parameters are not written back."""
    ours = {id(t) for t in placed}
    for module, shadow in pairs:
        mine = vars(module)
        buffers = mine["_buffers"]
        for key, b in vars(shadow)["_buffers"].items():
            if buffers.get(key, _MISSING) is not b:
                buffers[key] = b
        for name, value in assignments(module, shadow):
            if id(value) not in ours:
                mine[name] = value


def assignments(module: nn.Module, shadow: nn.Module) -> list[tuple[str, Any]]:
    """The attributes other than its parameter, buffer and submodule dicts whose values a
    forward left on ``shadow`` other than ``module``'s, by name."""
    mine = vars(module)
    compiled = isinstance(module, COMPILED_MODULES)
    return [
        (name, value)
        for name, value in vars(shadow).items()
        if name not in _SHADOWS_OWN
        and not (compiled and name in ("forward", "_forward"))  # NOTE [ Compiled modules ]
        and mine.get(name, _MISSING) is not value
    ]


_SHADOWS_OWN = frozenset(("_parameters", "_buffers", "_modules", "_compiled_call_impl"))
_MISSING = object()


def rebind(model: Callable[..., Any], shadow: nn.Module) -> Callable[..., Any]:
    """``model`` calling ``shadow`` instead of its module (``module_of``)."""
    if isinstance(model, functools.partial):
        return functools.partial(rebind(model.func, shadow), *model.args, **model.keywords)
    if isinstance(model, nn.Module):
        return shadow
    return types.MethodType(model.__func__, shadow)  # type: ignore[attr-defined]


# The engine call under torch.autograd.grad (private; autograd.grad itself where it is gone).
_run_engine: Callable[..., tuple[Tensor | None, ...]] | None = getattr(
    torch.autograd.graph, "_engine_run_backward", None
)

# A pullback takes the output leaves' cotangents and whether to keep its graph for another
# call, and gives (argument grads, parameter grads).
Pullback = Callable[[Sequence[Tensor], bool], tuple[list[Tensor | None], list[Tensor | None]]]


# Argument types that are pytree leaves: a call made of these alone needs no pytree walk.
_PLAIN_LEAVES = (Tensor, int, float, bool, str, type(None))


@dataclass
class CallArgs:
    """The positional and keyword arguments of a call, flattened to leaves.

    ``spec`` is None for a flat call (every argument a tensor or a scalar), the usual case:
    ``leaves`` are then the positional arguments followed by the keyword values, and building
    the arguments for each model needs no pytree walk.
    """

    leaves: list[Any]
    spec: pytree.TreeSpec | None
    tensor_positions: list[int]
    grad_positions: list[int] = field(default_factory=list)
    n_args: int = 0
    keywords: tuple[str, ...] = ()

    @classmethod
    def flatten(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallArgs:
        leaves: list[Any] = [*args, *kwargs.values()]
        if all(isinstance(leaf, _PLAIN_LEAVES) for leaf in leaves):
            positions = [j for j, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
            return cls(leaves, None, positions, n_args=len(args), keywords=tuple(kwargs))
        leaves, spec = pytree.tree_flatten((args, kwargs))
        positions = [j for j, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        return cls(leaves, spec, positions)

    def with_tensors(self, tensors: Sequence[Tensor], grad_mask: Sequence[bool]) -> CallArgs:
        """The same call with new tensor leaves; ``grad_mask`` marks those that get gradients."""
        leaves = list(self.leaves)
        for j, t in zip(self.tensor_positions, tensors):
            leaves[j] = t
        grads = [j for j, need in zip(self.tensor_positions, grad_mask) if need]
        return CallArgs(leaves, self.spec, self.tensor_positions, grads, self.n_args, self.keywords)

    def build(self, replaced: dict[int, Tensor] | None = None) -> tuple[tuple[Any, ...], dict]:
        leaves = self.leaves
        if replaced:
            leaves = list(leaves)
            for j, t in replaced.items():
                leaves[j] = t
        if self.spec is None:
            n = self.n_args
            return tuple(leaves[:n]), dict(zip(self.keywords, leaves[n:]))
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return tuple(args), kwargs


@dataclass
class ModelParams:
    """What one walk over a model's modules finds (``nn.Module.named_parameters`` order).

    Attributes:
        names: the trainable parameters' names, for ``functional_call``.
        tensors: the trainable parameters, each once: what the pullback differentiates.
        buffers: every buffer, each once.
        restored_buffers: the buffers that torch.nn's modules update in forward in training
            mode (normalization layers' running statistics, spectral normalization's
            vectors), which a failed call restores (NOTE [ Failed calls change
            nothing ] in ``_function``).
        modules: every submodule, each once, the model included.
        state_names, state: the frozen parameters and the buffers, with their names (what
            ``functional_call`` must also be given to run another model's state).
        uninitialized: where lazy parameters are not initialized yet (a ``LazyLinear``
            before its first call), as "submodule 'name' (type)", or None.
        loose: the names of plain tensor attributes that require grad and are leaves
            (``self.temperature = torch.ones(1, requires_grad=True)``): not parameters, but
            the plain loop gives them a ``.grad``, so they are among ``tensors`` too.
        estimated: what the planning estimated for the model (its cost by batch shape, ...),
            once computed (``_grouping.estimate``).
    """

    names: list[str]
    tensors: list[Tensor]
    buffers: list[Tensor] = field(default_factory=list)
    restored_buffers: list[Tensor] = field(default_factory=list)
    modules: list[nn.Module] = field(default_factory=list)
    state_names: list[str] = field(default_factory=list)
    state: list[Tensor] = field(default_factory=list)
    uninitialized: str | None = None
    loose: list[str] = field(default_factory=list)
    # What the planning estimated (``estimate`` in _grouping): a call's planning reads the
    # cost several times, and a set planned from its models' own walks reuses their findings.
    estimated: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def with_modules(self, modules: list[nn.Module]) -> ModelParams:
        """The same findings with ``modules`` (a kept walk holds them weakly), ``estimated``
        shared: a shallow copy, without dataclasses.replace's checks (a set of models new
        every call copies each model's)."""
        copy = object.__new__(ModelParams)
        copy.__dict__.update(self.__dict__)
        copy.modules = modules
        return copy

    @classmethod
    def of(cls, model: Callable[..., Any]) -> ModelParams:
        # One walk over ``_modules``, ``_parameters`` and ``_buffers`` instead of the generator
        # stacks of named_parameters, buffers and modules: this runs on every call, so it
        # skips empty dicts and binds the lists it appends to (7.3 -> 4.8 us a tiny MLP here).
        info = cls([], [])
        if not isinstance(model, nn.Module):
            found = module_of(model)
            if found is None:
                return info
            model = found
        names, tensors, state_names, state = info.names, info.tensors, info.state_names, info.state
        buffers, restored_buffers, modules = info.buffers, info.restored_buffers, info.modules
        seen_modules: set[int] = set()
        seen_tensors: set[int] = set()
        stack: list[tuple[str, nn.Module]] = [("", model)]
        while stack:
            prefix, module = stack.pop()
            key = id(module)
            if key in seen_modules:
                continue
            seen_modules.add(key)
            modules.append(module)
            if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
                where = f"submodule {prefix[:-1]!r}" if prefix else "the model itself"
                info.uninitialized = info.uninitialized or f"{where} ({type(module).__name__})"
            own = module._parameters
            if own:
                for name, p in own.items():
                    if p is None or id(p) in seen_tensors:
                        continue
                    seen_tensors.add(id(p))
                    if p.requires_grad:
                        names.append(prefix + name)
                        tensors.append(p)
                    else:
                        state_names.append(prefix + name)
                        state.append(p)
            if _may_hold_loose_tensors(type(module)):  # type: ignore[arg-type]
                for name, t in _loose_tensors(module):
                    if id(t) not in seen_tensors:
                        seen_tensors.add(id(t))
                        names.append(prefix + name)
                        tensors.append(t)
                        info.loose.append(prefix + name)
            own_buffers = module._buffers
            if own_buffers:
                restored = module.training and _updates_buffers_in_forward(module)
                for name, b in own_buffers.items():
                    if b is None or id(b) in seen_tensors:
                        continue
                    seen_tensors.add(id(b))
                    if b.requires_grad and b.is_leaf:  # trained as a tensor attribute is
                        names.append(prefix + name)
                        tensors.append(b)
                        info.loose.append(prefix + name)
                        continue
                    buffers.append(b)
                    state_names.append(prefix + name)
                    state.append(b)
                    if restored:
                        restored_buffers.append(b)
            children = module._modules
            if children:
                stack.extend(
                    [(f"{prefix}{n}.", c) for n, c in reversed(children.items()) if c is not None]
                )
        return info


# torch.nn modules that update their buffers in forward in training mode: normalization layers'
# running statistics, and spectral normalization's power-iteration vectors (the
# parametrization, and the older hook whose buffers sit on the module it normalizes).
_SPECTRAL_NORM = getattr(torch.nn.utils.parametrizations, "_SpectralNorm", None)
_BUFFER_UPDATING: tuple[type, ...] = (
    (_NormBase, _SPECTRAL_NORM) if isinstance(_SPECTRAL_NORM, type) else (_NormBase,)
)


def _updates_buffers_in_forward(module: nn.Module) -> bool:
    if isinstance(module, _BUFFER_UPDATING):
        return True
    hooks = module._forward_pre_hooks
    return bool(hooks) and any(isinstance(h, SpectralNormHook) for h in hooks.values())


# The attributes every nn.Module has (vars of a new one).
MODULE_INTERNALS = frozenset(vars(nn.Module()))


@functools.cache
def _may_hold_loose_tensors(cls: type) -> bool:
    """Whether ``ModelParams.of`` looks for tensor attributes in modules of ``cls``: not in
    torch.nn's own classes, which keep their tensors as parameters and buffers. Scanning
    every module's attributes on every call cost 6 us of the 11 a tiny MLP's walk took; a
    tensor attribute set by hand on a torch.nn layer is therefore not seen."""
    return not cls.__module__.startswith("torch.nn.")


def _loose_tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    """A module's plain tensor attributes that require grad and are leaves, by name, also
    those held in lists, tuples and dicts (``self.scales = [torch.ones(3, requires_grad=True)]``
    as ``scales[0]``), which the plain loop's backward reaches as well."""
    attributes = vars(module)
    # The attributes every nn.Module has are skipped in C; what is left are its own.
    return [
        (path, t)
        for name in sorted(attributes.keys() - MODULE_INTERNALS)
        for path, t in tensors_held(name, attributes[name], trainable=True)
        if t.is_leaf
    ]


CONTAINERS = (list, tuple, dict)


def tensors_held(name: str, value: Any, trainable: bool = False) -> list[tuple[str, Tensor]]:
    """The tensors an attribute holds, itself or inside nested lists, tuples and dicts, each
    with its path (``name``, ``name[0]``, ``name['key']``); with ``trainable``, only those
    that require grad.

    A module holding tensors in a container is planned on every call (``Walk._record``), so
    this runs on every call for it: a container of tensors alone is filtered in C, and paths
    are made for the tensors returned only (a module with a list and a dict of 10,000 tensors
    each that require no grad, 4 of them in a call: 159 ms a call, 9.7 since, the plain loop
    0.3)."""
    if isinstance(value, Tensor):
        return [(name, value)] if value.requires_grad or not trainable else []
    if not isinstance(value, CONTAINERS):
        return []
    found: list[tuple[str, Tensor]] = []
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [(name, value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, Tensor):
            if item.requires_grad or not trainable:
                found.append((path, item))
        elif isinstance(item, CONTAINERS) and id(item) not in seen:
            seen.add(id(item))  # a container holding itself is read once
            values = list(item.values()) if isinstance(item, dict) else item
            kinds = set(map(type, values))
            # A long list of numbers or strings (a vocabulary) is passed over by its types.
            if not any(issubclass(kind, _HOLDING) for kind in kinds):
                continue
            keys = list(item.keys()) if isinstance(item, dict) else range(len(values))
            if all(issubclass(kind, Tensor) for kind in kinds):  # tensors alone: in C
                pairs: Iterable[tuple[Any, Tensor]] = zip(keys, values)
                if trainable:
                    pairs = itertools.compress(pairs, map(_requires_grad, values))
                found.extend((f"{path}[{k!r}]", t) for k, t in pairs)
                continue
            stack.extend(reversed([(f"{path}[{k!r}]", v) for k, v in zip(keys, values)]))
    return found


_HOLDING = (Tensor, *CONTAINERS)
_requires_grad = operator.attrgetter("requires_grad")


def holds_tensors(value: Any) -> bool:
    """Whether a list, tuple or dict holds a tensor, itself or inside nested ones."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if not isinstance(item, CONTAINERS) or id(item) in seen:
            continue
        seen.add(id(item))
        values = list(item.values()) if isinstance(item, dict) else item
        kinds = set(map(type, values))
        if any(issubclass(kind, Tensor) for kind in kinds):
            return True
        if any(issubclass(kind, CONTAINERS) for kind in kinds):
            stack.extend(v for v in values if isinstance(v, CONTAINERS))
    return False


def module_of(model: Callable[..., Any]) -> nn.Module | None:
    """The module whose parameters a model uses: the model itself, the module of a bound
    method (``m.encode``), or that of a ``functools.partial`` of either; None for any other
    callable, whose parameters parsum cannot see."""
    while isinstance(model, functools.partial):
        model = model.func
    if isinstance(model, nn.Module):
        return model
    return method_module(model)


def method_module(model: Any) -> nn.Module | None:
    """The module ``model`` is a bound method of (``m.encode``), or None."""
    owner = getattr(model, "__self__", None)
    return owner if isinstance(owner, nn.Module) and inspect.ismethod(model) else None


def model_kind(model: Any) -> str:
    """How an error names a model beside its index: its class; for a bound method of a module,
    the class and the method (``Net.encode``); for a ``functools.partial``, what it wraps; for
    a function, ``function`` and its name."""
    if isinstance(model, functools.partial):
        return f"partial of {model_kind(model.func)}"
    if isinstance(model, nn.Module):
        return type(model).__name__
    if inspect.ismethod(model):
        return f"{type(model.__self__).__name__}.{model.__func__.__name__}"
    if inspect.isfunction(model):
        return f"function {model.__name__}"
    return type(model).__name__


def pull_back(
    outputs: Sequence[GradientEdge],
    inputs: Sequence[Tensor | GradientEdge],
    cotangents: Sequence[Tensor],
    retain_graph: bool,
    accumulate: bool = False,
    create_graph: bool = False,
) -> tuple[Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True)`` (with
    ``create_graph``), or with ``accumulate`` ``torch.autograd.backward(outputs, cotangents,
    inputs=inputs)``.

    The cotangents are the sum's own gradients, whose shapes and dtypes match the outputs, so
    the checks and conversions of ``autograd.grad``'s Python wrapper (about 10 us a call here,
    a tenth of a tiny model's pullback) are skipped where the engine can be called directly.
    """
    try:
        return _pull_back(outputs, inputs, cotangents, retain_graph, accumulate, create_graph)
    except BaseException:
        _drop_tasks_left()
        raise


def _pull_back(
    outputs: Sequence[GradientEdge],
    inputs: Sequence[Tensor | GradientEdge],
    cotangents: Sequence[Tensor],
    retain_graph: bool,
    accumulate: bool,
    create_graph: bool,
) -> tuple[Tensor | None, ...]:
    if len(outputs) == 1:  # NOTE [ One root edge ]
        outputs, cotangents = _with_a_root_pad(outputs, cotangents)
    if _run_engine is None or has_torch_function([*cotangents, *inputs]):
        # Tensors and edges mixed, which the engine takes (torch's annotations name either
        # alone)
        wrt = cast(Sequence[Tensor], inputs)
        if accumulate:
            torch.autograd.backward(  # no inputs: every leaf, as the engine call does
                outputs, cotangents, retain_graph=retain_graph, inputs=list(wrt) or None
            )
            return ()
        return torch.autograd.grad(
            outputs,
            wrt,
            cotangents,
            retain_graph=retain_graph,
            create_graph=create_graph,
            allow_unused=True,
        )
    return _run_engine(
        tuple(outputs),
        tuple(cotangents),
        retain_graph,
        create_graph,
        tuple(inputs),
        True,
        accumulate_grad=accumulate,
    )


# NOTE [ Tasks a failed engine call leaves ]
# A failed engine call leaves the tasks it had queued (the other models' roots, ready from the
# start) in the thread's ready queue, each holding its node and the graph behind it, until the
# thread's next engine call pops them: a helper's held a failed call's graphs until its next
# job, and a process whose last backward that was aborted at exit ("terminate called without
# an active exception"; a model summing models inside, failing last of 5 at n_jobs=2). The
# queue pops the task of highest sequence number first (at one reentrant depth), and each
# thread numbers its nodes from 0 in creation order, so a call through a node numbered 0 (made
# once, in a thread of its own) runs after every task left: those of a call that is gone are
# dropped as they are popped.
@functools.cache
def _numbered_first() -> tuple[Tensor, Tensor]:
    """A leaf and a node through it numbered 0, made once, when first needed."""
    made: list[Tensor] = []

    def make() -> None:
        leaf = torch.zeros((), requires_grad=True)
        made.extend((leaf, leaf * 1))

    thread = threading.Thread(target=make, name="parsum-drain-node")
    thread.start()
    thread.join()
    return made[0], made[1]


def _drop_tasks_left() -> None:
    """Pop what a failed engine call left in this thread's ready queue (NOTE [ Tasks a failed
    engine call leaves ])."""
    with contextlib.suppress(Exception):
        leaf, root = _numbered_first()
        torch.autograd.grad(root, leaf, retain_graph=True)


# NOTE [ One root edge ]
# An engine call with one root edge makes that edge's node the graph task's root, which the
# engine then leaves out of the nodes it counts in the graph: ``_will_engine_execute_node``
# answers False for it while the call runs. ``torch.autograd.graph.register_multi_grad_hook``
# (mode "all") counts with it the tensors whose gradients will come, and so called its hook
# twice in one backward where a model's output was among its tensors and the model was pulled
# back alone (once for each tensor), where the plain loop, whose root is the loss, calls it
# once. Such a call gets a second root: an edge to an empty leaf of parsum's own, with an empty
# gradient, so that the engine roots it in a GraphRoot, as the plain loop's backward is. Where
# the call accumulates into every leaf, that leaf's AccumulateGrad runs (adding nothing); else
# the engine skips it.
_ROOT_PADS: dict[torch.device, tuple[GradientEdge, Tensor]] = {}


def _with_a_root_pad(
    outputs: Sequence[GradientEdge], cotangents: Sequence[Tensor]
) -> tuple[Sequence[GradientEdge], Sequence[Tensor]]:
    device = cotangents[0].device
    pad = _ROOT_PADS.get(device)
    if pad is None:
        leaf = torch.empty(0, device=device, requires_grad=True)
        INTERNAL_LEAVES.append(leaf)
        pad = _ROOT_PADS.setdefault(
            device, (get_gradient_edge(leaf), torch.empty(0, device=device))
        )
    return (*outputs, pad[0]), (*cotangents, pad[1])


def plain_forward(
    model: Callable[..., Any], call: CallArgs, program: DirectProgram | None = None
) -> Any:
    """Run the model with no graph (no grad, inference mode, or nothing to differentiate), its
    layers called directly where ``program`` is given (NOTE [ Direct programs ])."""
    args, kwargs = call.build()
    return model(*args, **kwargs) if program is None else run_direct(program, args[0])


def autograd_forward(
    model: Callable[..., Any],
    call: CallArgs,
    params: ModelParams,
    program: DirectProgram | None = None,
    check_leaves: bool = False,
) -> tuple[Any, Pullback]:
    """Run the model on detached inputs under enable_grad (its layers called directly where
    ``program`` is given: NOTE [ Direct programs ]); pull back with autograd.grad. With
    ``check_leaves``, a module's graph is looked through for tensors it does not own (NOTE
    [ Tensors a module does not own ])."""
    # NOTE [ Hooks run once ]: differentiating with respect to a parameter would run its
    # tensor hooks (register_hook) in the pullback, and autograd runs them again on the whole
    # gradient that ParallelSum returns. Such a parameter is read through an alias, a view of
    # it in a shadow of the module (NOTE [ Shadow modules ]), and the pullback takes the alias'
    # gradient: the hooks run once, on the whole gradient, as in the plain loop, and the
    # user's tensors are never written to (taking the hooks off the parameter for a while
    # raced with other threads' backward passes and crashed the interpreter).
    wrt_params: Sequence[Tensor | GradientEdge] = params.tensors
    # This runs for every model on every call: no context manager object, and the hook check
    # reads one attribute a parameter unless a parameter has hooks at all.
    hooked = [p for p in params.tensors if p._backward_hooks is not None and has_user_hooks(p)]
    was_enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(True)
    try:
        views = {id(p): p.view_as(p) for p in hooked} if hooked else None
        if views is not None:
            # Each view's edge as the graph holds it: a parameter written in place before the
            # backward gives its view a new grad_fn, which the graph does not reach (NOTE
            # [ Tensor hooks in the caller's graph ] in _inline)
            wrt_params = [_edge(views[id(p)]) if id(p) in views else p for p in params.tensors]
        inputs = {j: call.leaves[j].detach().requires_grad_() for j in call.grad_positions}
        read = model_arguments(inputs)
        args, kwargs = call.build(read)
        if views is not None:
            out = run_through_views(model, views, args, kwargs, program)
        elif program is not None:  # NOTE [ Direct programs ]
            out = run_direct(program, args[0])
        else:
            out = model(*args, **kwargs)
        if read:
            check_argument_hooks(read.values())
    finally:
        torch._C._set_grad_enabled(was_enabled)
    # The pullback keeps the outputs' gradient edges, not the outputs: plain PyTorch frees a
    # model's output once it is summed, so holding M of them until backward would be memory
    # that grows with M.
    roots = output_edges(out)
    if not params.tensors and module_of(model) is None:
        # Every tensor argument is its own, also one it marked to require grad itself.
        arguments = [t for t in call.leaves if isinstance(t, Tensor)]
        _check_no_captured_leaves(roots, [*inputs.values(), *arguments])
    elif check_leaves and (program is None or hooked):
        check_own_leaves(model, roots, params.tensors, inputs.values(), call)
    aliased = wrt_params is not params.tensors
    return out, GraphPullback(roots, [*inputs.values(), *wrt_params], len(inputs), aliased)


def run_through_views(
    model: Callable[..., Any],
    views: dict[int, Tensor],
    args: tuple[Any, ...],
    kwargs: dict,
    program: DirectProgram | None = None,
) -> Any:
    """``model(*args, **kwargs)`` on a shadow of its module that holds ``views`` (by the id of
    the parameter each stands for) instead of those parameters (NOTE [ Hooks run once ]); what
    the forward assigns is written back to the module. Where every such parameter is a
    Linear's of its direct ``program``, the program runs with the views instead: a shadow
    costs about 70 us a model of 8 modules."""
    if program is not None:
        steps = program.steps
        linear = {id(t) for step in steps if isinstance(step, tuple) for t in step}
        if linear.issuperset(views):
            return run_direct(program_reading(program, views), args[0])
    shadowed: dict[int, tuple[nn.Module, nn.Module]] = {}
    module = module_of(model)
    assert module is not None
    out = rebind(model, shadow_module(module, views, shadowed))(*args, **kwargs)
    write_back(shadowed.values(), views.values())
    return out


def output_edges(out: Any) -> list[GradientEdge | None]:
    """The gradient edge of each of a model's output leaves, None for one that needs no
    gradient."""
    leaves = [out] if isinstance(out, Tensor) else pytree.tree_leaves(out)
    return [_edge(o) if isinstance(o, Tensor) and o.requires_grad else None for o in leaves]


# Nodes of Python autograd.Functions, whose edges need the ownership token that
# get_gradient_edge makes (the Python object alone does not keep their graph alive).
_PYTHON_NODE: tuple[type, ...] = tuple(
    t for t in [getattr(torch._C, "_FunctionBase", None)] if isinstance(t, type)
)


def _edge(t: Tensor) -> GradientEdge:
    """``get_gradient_edge(t)``, without its checks and ownership token where a C++ node (the
    usual case) needs neither."""
    node = t.grad_fn
    if node is None or not _PYTHON_NODE or isinstance(node, _PYTHON_NODE):
        return get_gradient_edge(t)
    return GradientEdge(node, t.output_nr)


class GraphPullback:
    """The pullback of one model's own autograd graph (engine "autograd"): its output edges and
    what it is differentiated with respect to (its argument aliases, then its parameters, or
    aliases of those with hooks: ``aliased``). Several of them can be pulled back in one engine
    call: ``pull_back_together``."""

    __slots__ = ("aliased", "n_args", "roots", "wrt")

    def __init__(
        self,
        roots: list[GradientEdge | None],
        wrt: list[Tensor | GradientEdge],
        n_args: int,
        aliased: bool,
    ) -> None:
        self.roots = roots
        self.wrt = wrt
        self.n_args = n_args
        self.aliased = aliased

    def __call__(
        self, cotangents: Sequence[Tensor], retain_graph: bool
    ) -> tuple[list[Tensor | None], list[Tensor | None]]:
        (grads,) = pull_back_together([(self, cotangents)], retain_graph)
        return grads


def pull_back_together(
    items: Sequence[tuple[GraphPullback, Sequence[Tensor]]],
    retain_graph: bool,
    accumulate: bool = False,
) -> list[tuple[list[Tensor | None], list[Tensor | None]]]:
    """Each model's (argument grads, parameter grads), from one engine call for all.

    With ``accumulate``, the parameters' gradients go into their ``.grad`` instead (NOTE
    [ Accumulating in the pullback ] in ``_function``) and come back as None; the argument
    aliases are leaves of their own, whose ``.grad`` is read and cleared.

    # NOTE [ One engine call per chunk ]
    # Every call into the autograd engine has a fixed cost (about 25 us here), which a
    # pullback per model pays once per model: 64 tiny MLPs pulled back one by one measured
    # 0.79x the plain 1-thread loop, 4 and 16 to a call 0.91x and 0.95x. The models' graphs are
    # disjoint and each is differentiated with respect to tensors of its own (its own input
    # aliases; parameters that another model also uses are left out by the caller), so one
    # call gives every model the gradients a call of its own would, bit for bit, each
    # captured apart: the compensated, ordered sums after it are unchanged.
    """
    outs: list[GradientEdge] = []
    cots: list[Tensor] = []
    wrt: list[Tensor | GradientEdge] = []
    for pb, cotangents in items:
        for o, c in zip(pb.roots, cotangents):
            if o is not None:
                outs.append(o)
                cots.append(c)
        wrt.extend(pb.wrt)
    if accumulate:
        if outs and wrt:
            pull_back(outs, wrt, cots, retain_graph, accumulate=True)
        results: list[tuple[list[Tensor | None], list[Tensor | None]]] = []
        for pb, _ in items:
            arg_grads: list[Tensor | None] = []
            for alias in cast(list[Tensor], pb.wrt[: pb.n_args]):  # the arguments': tensors
                arg_grads.append(alias.grad)
                alias.grad = None
            results.append((arg_grads, [None] * (len(pb.wrt) - pb.n_args)))
        return results
    grads: Sequence[Tensor | None] = (
        pull_back(outs, wrt, cots, retain_graph) if outs and wrt else [None] * len(wrt)
    )
    results = []
    start = 0
    for pb, _ in items:
        mine = list(grads[start : start + len(pb.wrt)])
        start += len(pb.wrt)
        results.append((mine[: pb.n_args], mine[pb.n_args :]))
    return results


def foreign_leaves(roots: Iterable[GradientEdge | None], own: Sequence[Tensor]) -> list[Tensor]:
    """The tensors that require grad which a graph reaches from ``roots`` besides ``own``
    (leaves: an AccumulateGrad node holds its tensor), each once. The graph behind an own
    tensor that is not a leaf (a parameter swapped in by ``functional_call``, computed from
    others: MAML's fast weights) is not looked through: its gradient goes on from there."""
    own_ids = {id(t) for t in own}
    # Own tensors computed from others, by the edge that reaches them; the nodes kept alive,
    # so that their ids stay theirs.
    own_edges: dict[tuple[int, int], Any] = {
        (id(t.grad_fn), t.output_nr): t.grad_fn for t in own if t.grad_fn is not None
    }
    found: dict[int, Tensor] = {}
    for node in graph_nodes(roots, own_edges):
        leaf = leaf_of(node)
        if leaf is not None and id(leaf) not in own_ids:
            found.setdefault(id(leaf), leaf)
    return list(found.values())


def graph_nodes(
    roots: Iterable[GradientEdge | None],
    skip: Container[tuple[int, int]] = (),
    newer_than: int | None = None,
) -> Iterator[Any]:
    """Every node of the graph behind ``roots``, once, not through an edge in ``skip`` (by its
    node's id and input number), nor, with ``newer_than``, through a node other than a leaf's
    numbered at or below it (made earlier on the thread that numbered it)."""
    seen: dict[int, Any] = {}  # keeps the nodes alive, so that their ids stay theirs
    stack: list[Any] = [
        edge.node
        for edge in roots
        if edge is not None and (id(edge.node), edge.output_nr) not in skip
    ]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        if newer_than is not None and node._sequence_nr() <= newer_than and leaf_of(node) is None:
            continue
        yield node
        stack.extend(
            next_node for next_node, nr in node.next_functions if (id(next_node), nr) not in skip
        )


def leaf_of(node: Any) -> Tensor | None:
    """The tensor of an AccumulateGrad node (numbered above every other node), else None."""
    leaf = getattr(node, "variable", None)
    return leaf if isinstance(leaf, Tensor) else None


def _check_no_captured_leaves(roots: Sequence[GradientEdge | None], own: list[Tensor]) -> None:
    """Raise if a plain callable's graph reaches a tensor that requires grad besides its own
    arguments (``lambda x: m(x)``): parsum differentiates with respect to what it knows, so
    that tensor's gradient would be lost without a word."""
    found = foreign_leaves(roots, own)
    if found:
        raise ParsumError(
            f"its autograd graph reaches a tensor of shape {tuple(found[0].shape)} that "
            "requires grad and is not one of its arguments (a parameter or tensor it "
            "captures, as in lambda x: m(x)); parsum would give it no gradient: pass "
            "the module or its bound method (m, m.encode) as the model, wrap the "
            "function in an nn.Module (nn.Sequential(m, nn.Softmax(-1))), or pass the "
            "tensor as an argument"
        )


# Leaves of parsum's own (its nodes' anchors), which a model calling sum_models reaches.
INTERNAL_LEAVES: list[Tensor] = []
# Modules whose graph reached only their own tensors, with their parameters' ids then: a
# module in model sets that change every call (random subsets of an ensemble) is looked
# through once, not on every call.
_found_own: weakref.WeakKeyDictionary[nn.Module, dict[Any, tuple[int, ...]]] = (
    weakref.WeakKeyDictionary()
)


# NOTE [ Tensors a module does not own ]
# parsum differentiates a module with respect to what its walk finds: its parameters, its
# tensor attributes and the tensors in its lists and dicts. A forward may read a tensor that
# requires grad from elsewhere: a global, a plain object's attribute, a module kept in a Python
# list instead of an nn.ModuleList (whose parameters model.parameters() does not list either).
# The plain loop's backward reaches it; parsum's pullbacks did not (ParallelSum, a capturing
# backward), and where they did (accumulating on several threads) in an order that depended on
# the threads: its gradient was lost or not reproducible, silently. The first call of a plan
# looks through each module's graph for such tensors (a plan made for one call, every call;
# layers of torch.nn run as a direct program read only their own; under engine="vjp" the graph
# that the transform leaves outside, recorded for that call) and raises, naming the model and
# the tensors' shapes: 1.3 ms for 64 tiny MLP classes, about what planning them costs. A module
# (or a bound method of one) found clean is not looked through again while it has the same
# parameters, whatever set it is called in: random subsets of an ensemble, a new plan every
# call, took 0.87x the steps of the code before when each call looked (64 tiny classes, 3 of 4
# drawn), 0.97-0.98x since; a set whose models' own walks all looked is not looked through at
# all (NOTE [ Shared state of models planned one by one ] in _plans). A forward that starts
# reading such a tensor later is not seen.
# Identical models stacked into one vmap group are looked through together (the stacked
# tensors and the models' own are theirs), also where vmap cannot run them and they run one by
# one: beside other models, through ParallelSum, such a tensor lost its gradient, silently. A
# call whose models all run as one group in the caller's graph (NOTE [ One group in the
# caller's graph ] in _stack) gives it the plain loop's gradient and is not looked through.
# A parameter that is not a leaf (``functional_call`` with fast weights, ``p - lr * g`` in a MAML
# step) is the module's own, and the graph behind it is not looked through: its gradient is
# returned for it and goes on from there to the tensors it was computed from. The first version
# of this check looked through it and refused every such call (a regression, found by trying a
# MAML step, which had worked).
#
# NOTE [ Leaves made from the arguments ]
# A model may differentiate with respect to a leaf its forward makes from an argument's data:
# an energy model trained on its forces, ``x = x.detach().requires_grad_()`` and then
# ``-autograd.grad(energy(x).sum(), x, create_graph=True)``, as force fields do with positions.
# Its output's graph reaches that leaf, which the check refused, where the plain loop trains
# such models (found by trying one). A leaf that shares an argument's storage was made in the
# call from that argument: it is the model's own. Nothing outside the call holds it (a model
# that keeps it makes it an attribute, its own anyway); its gradient, which nothing reads, is
# the plain loop's in the caller's graph and not computed through ParallelSum. Not so a
# parameter (``detach()`` makes a plain tensor) or the tensor an argument is a view of: a
# global whose slice is passed as the argument, which the model also reads, stays refused. A
# leaf made from new data (``x.clone().requires_grad_()``) cannot be told from a global one,
# and is refused; nor can a global plain tensor whose detached slice is the argument, which
# passes (as a global read by a model always did before the check).


class ForeignLeaves(ParsumError):
    """A module's graph reaches tensors it does not own (NOTE [ Tensors a module does not
    own ])."""


def check_own_leaves(
    model: Callable[..., Any],
    roots: Iterable[GradientEdge | None],
    params: Sequence[Tensor],
    aliases: Iterable[Tensor],
    call: CallArgs,
) -> None:
    """Raise if a module's graph reaches tensors that require grad which it does not own (NOTE
    [ Tensors a module does not own ]): its ``params`` and the ``aliases`` of its arguments; a
    tensor argument is its own too."""
    key = tuple(map(id, params))
    # A module by itself, a bound method by its module and function (another function of the
    # same module may read other tensors); a partial is looked through every time.
    module: nn.Module | None = model if isinstance(model, nn.Module) else None
    func: Any = None
    if module is None and (owner := method_module(model)) is not None:
        module, func = owner, cast(Any, model).__func__
    known = _found_own.get(module) if module is not None else None
    if known is not None and known.get(func) == key:
        return
    found = foreign_leaves(roots, [*params, *aliases])
    if not found:
        if module is not None:
            _found_own.setdefault(module, {})[func] = key
        return
    # The tensor arguments, the anchors of the nodes of a sum_models call inside the model,
    # and parameters the forward made (NOTE [ Parameters made in forward ] in _function).
    made = ModelParams.of(model).tensors
    arguments = {id(t) for t in [*call.leaves, *INTERNAL_LEAVES, *made] if isinstance(t, Tensor)}
    # NOTE [ Leaves made from the arguments ]: not a parameter, nor what an argument views
    given = [t for t in call.leaves if isinstance(t, Tensor)]
    data, bases = _storages(given), {id(t._base) for t in given if t._base is not None}
    found = [
        t
        for t in found
        if id(t) not in arguments
        and (isinstance(t, nn.Parameter) or id(t) in bases or not _storages([t]) & data)
    ]
    if found:
        shapes = ", ".join(str(tuple(t.shape)) for t in found[:4])
        more = f" and {len(found) - 4} more" if len(found) > 4 else ""
        raise ForeignLeaves(
            f"its autograd graph reaches {len(found)} tensor(s) that require grad and are not "
            f"its parameters, attributes or arguments (shapes {shapes}{more}): read from a "
            "global or a plain object, the parameters of a module kept in a Python list "
            "instead of an nn.ModuleList, or a tensor set as a plain attribute of a torch.nn "
            "layer (whose attributes parsum does not scan); parsum would give them no "
            "gradient: register them "
            "in the module (nn.Parameter, nn.ModuleList, nn.ParameterList) or pass them as "
            "arguments (a leaf the forward makes to differentiate with respect to is its own "
            "where it shares an argument's data: x.detach().requires_grad_())"
        )


def check_no_graph_needed(
    model: Callable[..., Any], out: Any, params: ModelParams, call: CallArgs
) -> None:
    """In a call that builds no graph with grad enabled (neither a parameter nor an argument
    needs a gradient), raise where the model's output needs one anyway: its graph reaches a
    tensor it does not own, which the detached sum would leave without its gradient, silently
    (``lambda x: m(x)`` on data that needs none), as a call that builds a graph raises."""
    roots = output_edges(out)
    if not any(roots):
        return
    if not params.tensors and module_of(model) is None:
        _check_no_captured_leaves(roots, [t for t in call.leaves if isinstance(t, Tensor)])
    else:
        check_own_leaves(model, roots, params.tensors, (), call)


def _storages(tensors: Sequence[Tensor]) -> set[int]:
    """Where the tensors' data lie (their storages' addresses; none for tensors without
    data): a leaf the forward made from an argument's data shares it (NOTE [ Leaves made from
    the arguments ])."""
    found = set()
    for t in tensors:
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # no storage: sparse, nested, a wrapper
            continue
        if ptr:
            found.add(ptr)
    return found


def vjp_forward(
    model: Callable[..., Any], call: CallArgs, params: ModelParams, check_leaves: bool = False
) -> tuple[Any, Pullback]:
    """Run the model through torch.func.vjp over torch.func.functional_call; with
    ``check_leaves``, looking through the graph it leaves outside the transform (NOTE
    [ Tensors a module does not own ])."""
    positions = call.grad_positions
    primal_args = [call.leaves[j].detach() for j in positions]
    primal_params = {n: p.detach() for n, p in zip(params.names, params.tensors)}

    def function(arg_tensors: list[Tensor], param_tensors: dict[str, Tensor]) -> Any:
        args, kwargs = call.build(model_arguments(dict(zip(positions, arg_tensors))))
        if isinstance(model, nn.Module):
            shadowed: dict[int, tuple[nn.Module, nn.Module]] = {}
            watched: list[Watched] = []
            shadow = shadow_module(model, None, shadowed, watched)  # NOTE [ Shadow modules ]
            out = torch.func.functional_call(shadow, param_tensors, args, kwargs)
            assigned = _changed_in_forward(shadowed.values(), watched)
            if assigned:  # NOTE [ Attributes assigned in forward ]
                raise RuntimeError(
                    f"the model assigns or changes {', '.join(assigned)} in forward; "
                    "engine='vjp' runs pure models only (the change would go to a copy): "
                    "use engine='autograd' or 'auto'"
                )
            return out
        return model(*args, **kwargs)

    # Checking, a graph outside the transform is recorded (of the ops on tensors that require
    # grad out there alone): what it reaches is not the model's.
    with torch.enable_grad() if check_leaves else contextlib.nullcontext():
        out, vjp_fn = torch.func.vjp(function, primal_args, primal_params)  # type: ignore[misc]
    out_spec = pytree.tree_structure(out)
    if check_leaves:
        check_own_leaves(model, output_edges(out), params.tensors, (), call)

    def pullback(
        cotangents: Sequence[Tensor], retain_graph: bool
    ) -> tuple[list[Tensor | None], list[Tensor | None]]:
        # functorch keeps the graph for as long as vjp_fn lives; the caller drops it.
        arg_grads, param_grads = vjp_fn(pytree.tree_unflatten(list(cotangents), out_spec))
        return list(arg_grads), _apart_from(cotangents, [param_grads[n] for n in params.names])

    return out, pullback


def _apart_from(cotangents: Sequence[Tensor], grads: list[Tensor | None]) -> list[Tensor | None]:
    """``grads``, each copied where it is memory of a cotangent: functorch hands a cotangent
    back as the gradient of a parameter that a model returns as it is, and without weights
    every model's cotangent is the sum's one gradient, so their parameters' ``.grad`` had
    been one memory, which a second backward's accumulation added to once per model."""
    held = {c.untyped_storage().data_ptr() for c in cotangents if c.layout == torch.strided}
    return [
        g.clone()
        if g is not None and g.layout == torch.strided and g.untyped_storage().data_ptr() in held
        else g
        for g in grads
    ]


Weight = float | Tensor | None

# A unit's pullback takes the cotangents of the sum's output leaves, the weight of each of its
# models and whether to keep the graph; it gives the argument gradients (summed over the
# unit's models) and the parameter gradients of each of its models.
UnitPullback = Callable[
    [Sequence[Tensor], Sequence[Weight], bool],
    tuple[list[Tensor | None], list[list[Tensor | None]]],
]


class UnitRun(NamedTuple):
    """What running a unit gives: each model's output, in ``Unit.models`` order; the unit's
    pullback (None without a graph); for a stacked group, its output leaves, each with the
    models along dim 0 (None otherwise)."""

    outs: list[Any]
    pullback: UnitPullback | None
    stacked: list[Tensor] | None = None
    # A stacked group's reads (NOTE [ Weights written before a group's backward ]).
    reads: GroupReads | None = None


@dataclass(frozen=True)
class Unit:
    """Models that run as one: a single model, or a stacked group of identical ones.

    Attributes:
        models: the models' indices, ascending.
        engine: "autograd", "vjp" or "stacked".
    """

    models: tuple[int, ...]
    engine: str


def unit_forward(
    unit: Unit,
    models: Sequence[Callable[..., Any]],
    call: CallArgs,
    model_params: Sequence[ModelParams],
    build_graph: bool,
    fall_back: bool = False,
    program: DirectProgram | None = None,
    check_leaves: bool = False,
) -> UnitRun:
    """Run a unit's models.

    With ``fall_back``, a stacked unit that vmap cannot run runs its models one by one. A
    one-model unit runs ``program`` where it is given, with no graph or by engine "autograd"
    (NOTE [ Direct programs ]).
    """
    if unit.engine == "stacked":
        group = [models[i] for i in unit.models]
        group_params = [model_params[i] for i in unit.models]
        try:
            return stacked_forward(group, call, group_params, build_graph, check_leaves)
        except AutocastUnderVmap:  # this call only, whatever the engine asked
            return _one_by_one(unit, models, call, model_params, build_graph, check_leaves)
        except ForeignLeaves:  # refused, not a forward vmap cannot run
            raise
        except Exception:
            if not fall_back:
                raise
            # vmap cannot run every forward (data-dependent control flow, .item()): run the
            # models one by one instead, which also names the model when one of them fails.
            # Only a group that runs that way is marked as one vmap cannot run; a call that
            # fails anyway (a bad batch) says nothing about vmap.
            run = _one_by_one(unit, models, call, model_params, build_graph, check_leaves)
            VMAP_FAILED.update(group)  # type: ignore[arg-type]
            _vmap_failures[0] += 1  # plans that stack this group are made again
            return run
    (i,) = unit.models
    if not build_graph:
        return UnitRun([plain_forward(models[i], call, program)], None)
    if unit.engine == "autograd":
        out, pullback = autograd_forward(models[i], call, model_params[i], program, check_leaves)
    else:
        out, pullback = vjp_forward(models[i], call, model_params[i], check_leaves)
    return UnitRun([out], SinglePullback(pullback))


# NOTE [ Complex weights ]
# For complex outputs, the plain sum's gradients follow PyTorch's convention for a product
# ``w * o``: the cotangent of ``o`` is ``g * conj(w)`` and ``w``'s gradient ``sum(g * conj(o))``,
# its real part where ``w`` is real. Without the conjugates a complex weight tensor gave wrong
# gradients to the arguments and the parameters, and a real one a wrong gradient of its own
# (both silently). A complex weight on real outputs makes the plain sum complex, and each
# model's cotangent would be the real part of ``g * conj(w)``: refused instead, with a
# ParsumError, on every path (``check_weight_tensor``).


def weighted_cotangent(g: Tensor, w: float | Tensor) -> Tensor:
    """A model's cotangent from the sum's gradient and the model's weight (NOTE [ Complex
    weights ])."""
    if isinstance(w, Tensor) and w.is_complex():
        return g * w.conj()
    return g * w


# NOTE [ Weighted cotangents shared ]
# With weights, each model's cotangent is the sum's gradient times the model's weight: a kernel
# a model and output. Models of one weight (an ensemble's average) share its cotangents, as
# models without weights share the sum's gradient: 64 tiny MLP classes with weights 1/64, 0.18
# ms less a backward (1.015x and 1.019x a step at n_jobs=1 and by default, 2 cores, in one
# process). A stacked group of one weight expands its one product over the group, as it expands
# the sum's gradient without weights; one of distinct float weights multiplies the gradient by
# their column in one kernel (each row as ``g * w`` has it: NOTE [ Weights in the reduction ] in
# _summation) instead of a kernel a model and a stack. Models of distinct weights that are not
# stacked get a kernel each: the rows of one such kernel, views of one tensor, measured no
# faster as cotangents (0.993x and 1.000x).


def _weight_key(w: Weight) -> Any:
    """What tells weights apart: a float by its value, -0.0 apart from 0.0, and an int apart
    from the float of its value; a tensor by itself."""
    if type(w) is float:
        return w if w else w.hex()
    if type(w) is int:
        return (w,)
    return w if w is None else id(w)


class WeightedCotangents:
    """``SinglePullback.cotangents(grad_outputs, w)``, once for each distinct float or int
    weight (NOTE [ Weighted cotangents shared ]); a weight tensor's each time. Threads may
    share one: two that meet a weight at once both compute it, the same bits."""

    __slots__ = ("_found", "_grad_outputs")

    def __init__(self, grad_outputs: Sequence[Tensor]) -> None:
        self._grad_outputs = grad_outputs
        self._found: dict[Any, Sequence[Tensor]] = {}

    def of(self, w: Weight) -> Sequence[Tensor]:
        if isinstance(w, Tensor):  # made for the call: its id may be another's later
            return SinglePullback.cotangents(self._grad_outputs, w)
        key = _weight_key(w)
        found = self._found.get(key)
        if found is None:
            found = self._found[key] = SinglePullback.cotangents(self._grad_outputs, w)
        return found


def _float_on_cpu(t: Tensor) -> bool:
    """Whether ``t`` is a float32 or float64 tensor on the CPU, strided."""
    return t.dtype in (torch.float32, torch.float64) and t.layout == torch.strided and t.is_cpu


def check_weight_tensor(
    where: str, weight_tensor: Tensor | None, leaves: Sequence[Tensor], i: int, model: Any
) -> None:
    """Refuse a weight tensor that the outputs ``leaves`` of model ``i``, ``model``, are not
    multiplied by in the plain loop: a complex one for real outputs (NOTE [ Complex
    weights ]), one on another device than theirs but the CPU (``w[i]``, 0-dim, goes with
    outputs on any device from the CPU alone). Refused here, before any product: the product
    raised PyTorch's own device error after the models ran."""
    if weight_tensor is None:
        return
    for leaf in leaves:
        if weight_tensor.is_complex() and not leaf.is_complex():
            raise ParsumError(
                f"{where}: weights is a complex tensor ({weight_tensor.dtype}) and the models "
                f"return real outputs ({leaf.dtype}); a complex weight is summed with complex "
                "outputs only: pass weights.real, or make the models' outputs complex"
            )
        if weight_tensor.device.type != "cpu" and weight_tensor.device != leaf.device:
            raise ParsumError(
                f"{where}: weights is a tensor on {weight_tensor.device} and model {i} "
                f"({model_kind(model)}) returns an output on {leaf.device}; a weight tensor "
                "goes on the outputs' device or on "
                f"the CPU: pass weights.to({str(leaf.device)!r})"
            )


def version_of(t: Tensor) -> int:
    """``t``'s version counter; -1 for an inference tensor, which keeps none."""
    try:
        return t._version
    except RuntimeError:
        return -1


def written_after_return(where: str, i: int, model: Any) -> ParsumError:
    """The error for model ``i``'s output written in place before it was summed (NOTE
    [ Outputs written before they are summed ] in _function)."""
    return ParsumError(
        f"{where}: model {i} ({model_kind(model)}) returned a tensor that a forward run after "
        "it wrote in place before parsum summed it (its argument, or its module's buffer or "
        "state, or a view of one): the plain loop adds each output as its model returns it, "
        "parsum once the forwards have run. Return a copy (out.clone())"
    )


class SinglePullback:
    """A one-model unit's pullback (a ``UnitPullback``); ``inner`` is the model's own."""

    __slots__ = ("inner",)

    def __init__(self, inner: Pullback) -> None:
        self.inner = inner

    @staticmethod
    def cotangents(grad_outputs: Sequence[Tensor], w: Weight) -> Sequence[Tensor]:
        return grad_outputs if w is None else [weighted_cotangent(g, w) for g in grad_outputs]

    def __call__(
        self, grad_outputs: Sequence[Tensor], weights: Sequence[Weight], retain_graph: bool
    ) -> tuple[list[Tensor | None], list[list[Tensor | None]]]:
        arg_grads, param_grads = self.inner(self.cotangents(grad_outputs, weights[0]), retain_graph)
        return arg_grads, [param_grads]


def _one_by_one(
    unit: Unit,
    models: Sequence[Callable[..., Any]],
    call: CallArgs,
    model_params: Sequence[ModelParams],
    build_graph: bool,
    check_leaves: bool,
) -> UnitRun:
    runs = [
        unit_forward(
            Unit((i,), "autograd"),
            models,
            call,
            model_params,
            build_graph,
            check_leaves=check_leaves,
        )
        for i in unit.models
    ]
    outs = [run.outs[0] for run in runs]
    if not build_graph:
        return UnitRun(outs, None)
    pullbacks = [run.pullback for run in runs]

    def pullback(
        grad_outputs: Sequence[Tensor], weights: Sequence[Weight], retain_graph: bool
    ) -> tuple[list[Tensor | None], list[list[Tensor | None]]]:
        totals: dict[int, GradSum] = {}
        per_model: list[list[Tensor | None]] = []
        n_args = 0
        for one, w in zip(pullbacks, weights):
            assert one is not None
            arg_grads, (grads,) = one(grad_outputs, [w], retain_graph)
            per_model.append(grads)
            n_args = len(arg_grads)
            for j, g in enumerate(arg_grads):
                if g is not None:
                    add_grad(totals, j, g)
        return [totals[j].result() if j in totals else None for j in range(n_args)], per_model

    return UnitRun(outs, pullback)


# NOTE [ Batched layers ]
# vmap runs any model, at a price: 64 tiny MLPs took 0.81 ms a step under vmap and 0.39 as
# the same batched matmuls written out, the rest being vmap's and functional_call's per-call
# Python work. A stack of the commonest ensemble member, an nn.Sequential of nn.Linear layers
# and elementwise activations (exactly these types: a subclass may override forward), therefore
# runs as those batched matmuls directly; any other model runs through vmap. So do such models
# in ``stack_`` storage and the groups that ``auto`` stacks on every call (64 identical tiny
# MLPs without ``stack_``: 4.21 -> 3.86 ms a step).
ELEMENTWISE = (
    nn.Identity, nn.Tanh, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.CELU, nn.SELU, nn.GELU,
    nn.SiLU, nn.Mish, nn.Sigmoid, nn.LogSigmoid, nn.Softplus, nn.Softsign, nn.Tanhshrink,
    nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Dropout,
)  # fmt: skip

# NOTE [ Batched slices ]
# A batched layer's output holds every model's: 16 models of width 512 at batch 1024 make 32 MB
# tensors, which glibc's malloc serves from fresh mmaps on every call (its threshold grows only to
# 32 MB), so each step faults in every page again: tanh over (16, 1024, 512) took 8.7 ms fresh,
# 1.5 ms into a tensor reused, and 16 MLPs of width 512 stacked took 54 ms a step against 26 ms
# for the plain loop. Smaller tensors fare no better once the freed ones are trimmed from the
# heap's top between steps: at batch 256 (8 MB a layer) the same models took 12.5 ms a step
# against 7.4 for the plain loop, and 6.3-6.8 in slices of 1-4 MB (interleaved, 2 cores). So
# the program runs the models in slices whose layers stay under SLICE_BYTES (parameters split
# once a name, so backward joins each name's gradient with one cat); slices of 1, 2 and 4 MB
# measured alike on six other shapes, within the noise of this machine. Only on the CPU: CUDA's
# caching allocator reuses its blocks, and there slices would only add kernel launches. Models
# of other code run through vmap in chunks of as many models (its ``chunk_size``), their layers
# estimated from the input's rows and the parameters' largest dimension: 16 two-layer residual
# blocks of width 256 at batch 1024 in stack_ storage, 23.6 -> 17.9 ms a step (one by one 18.1),
# of width 512 at batch 512 22.5 -> 18.0 (one by one 20.9).
SLICE_BYTES = 4 << 20

# NOTE [ Features first ]
# The program keeps each layer's output as (models, features, rows), W @ h, rather than
# (models, rows, features), h @ W^T: a weight's gradient then comes out of the matmul in the
# weight's own layout, which autograd keeps as it is, where the transposed one was copied into
# that layout first (64 tiny MLPs: a (64, 32, 32) copy took 20 us against 4 in order). The
# first layer, whose input every model shares, is one matmul of all models' weight rows with
# that input, (models x out, in) @ (in, rows), with no batch of expanded inputs.

# A step of a batched program: a Linear's weight and bias names, or an elementwise module.
Step = tuple[str, str | None] | nn.Module


def program_of(model: nn.Module, prefix: str = "") -> list[Step] | None:
    """The batched program of a Sequential of Linear and elementwise layers, else None."""
    kind = type(model)
    if kind is nn.Linear:
        has_bias = model._parameters.get("bias") is not None
        return [(prefix + "weight", prefix + "bias" if has_bias else None)]
    if kind in ELEMENTWISE:
        return [model]
    if kind is nn.Sequential:
        steps: list[Step] = []
        for name, child in model._modules.items():
            found = None if child is None else program_of(child, f"{prefix}{name}.")
            if found is None:
                return None
            steps += found
        return steps if any(isinstance(s, tuple) for s in steps) else None
    return None


def run_program(program: list[Step], values: dict[str, Tensor], x: Tensor) -> Tensor:
    """Every model's output along dim 0 (NOTE [ Batched layers ]), the models in slices small
    enough that no layer's output exceeds SLICE_BYTES (NOTE [ Batched slices ])."""
    if x.device.type != "cpu":  # a caching allocator: slices would only add kernel launches
        return _run_slice(program, values, x)
    n_models = values[_first_weight(program)].shape[0]
    per_model = x.numel() // x.shape[-1] * x.element_size() * _widest(program, values)
    size = _models_per_slice(per_model, n_models)
    if size is None:
        return _run_slice(program, values, x)
    names = [name for step in program if isinstance(step, tuple) for name in step if name]
    pieces = {name: values[name].split(size) for name in names}  # one backward node a name
    outs = [
        _run_slice(program, {name: split[k] for name, split in pieces.items()}, x)
        for k in range(len(pieces[names[0]]))
    ]
    return torch.cat(outs)


def _models_per_slice(per_model: int, n_models: int) -> int | None:
    """Models a slice holds when each makes layers of ``per_model`` bytes (NOTE [ Batched
    slices ]); None: all of them at once."""
    size = max(1, SLICE_BYTES // max(1, per_model))
    return None if size >= n_models else size


def runs_as_program(program: list[Step] | None, args: tuple[Any, ...], kwargs: dict) -> bool:
    """Whether a batched forward runs ``program`` (one tensor argument, no keyword) rather
    than vmap (NOTE [ Batched layers ])."""
    return (
        program is not None
        and not kwargs
        and len(args) == 1
        and isinstance(args[0], Tensor)
        and torch_nn_untouched()  # NOTE [ torch.nn's calls replaced ] in _torch_calls
    )


# NOTE [ Direct programs ]
# A model that is an nn.Sequential (nested ones included) of layers of torch.nn, or one such
# layer, runs in the caller's graph (NOTE [ The caller's graph ] in _inline), in ParallelSum and
# with no graph as those layers called directly, ``F.linear`` for an nn.Linear and each other
# layer's own ``forward``, instead of through ``nn.Module.__call__`` a layer: the same kernels
# in the same order, so the same bits and the same autograd graph, without each layer's call
# machinery (hooks looked for, ``forward`` looked up, Sequential's iteration). The
# plain loop against the same layers called directly, one thread: 16 MLPs of widths 128-512 at
# batch 64 13.00 -> 12.73 ms a step, 64 tiny MLPs 5.15 -> 4.33. Only where a module call would
# do nothing more: when the walk was made, no module of the model had a hook, a ``forward`` of
# its own or a compiled call (``Module.compile``), and the walk's check notices any of them
# added since (NOTE [ Reused plans ] in _plans: the next call plans anew); on the call, no global
# module hook, no JIT tracer, one tensor argument and no keyword, torch.nn's calls its own
# (``direct_calls_allowed``; NOTE [ torch.nn's calls replaced ] in _torch_calls).
# Layers of classes outside torch.nn are called as modules: such a class may define its own
# ``__call__``. The program holds its modules weakly: a walk keeps no model alive. Looking for a
# forward of its own and a compiled call in every module on every call, in the program, cost
# more than in the walk's check, which reads the same attribute dictionaries already.


class DirectProgram(NamedTuple):
    """A model's layers to call directly (NOTE [ Direct programs ]): a Linear's weight and
    bias, or another layer (weakly). For one call (NOTE [ Dropout drawn beforehand ] in
    _random): ``noise``, each ``nn.Dropout`` step's noise drawn beforehand (None: the layer's
    own call), and ``misses``, the list to which a step that draws although its input does not
    match its noise appends the layer; or ``record``, the list to which each ``nn.Dropout`` step
    appends its input's shape, dtype, device and contiguity."""

    steps: list[tuple[Tensor, Tensor | None] | weakref.ref[nn.Module]]
    noise: list[Tensor | None] | None = None
    misses: list[nn.Module] | None = None
    record: list[tuple[torch.Size, torch.dtype, torch.device, bool]] | None = None


def program_reading(program: DirectProgram, reads: dict[int, Tensor]) -> DirectProgram:
    """``program`` with each Linear tensor in ``reads`` (by its id) read as the tensor there:
    a view of a hooked parameter, an alias of a shared one."""
    get = reads.get
    steps = [
        (get(id(s[0]), s[0]), s[1] if s[1] is None else get(id(s[1]), s[1]))
        if isinstance(s, tuple)
        else s
        for s in program.steps
    ]
    return program._replace(steps=steps)


def direct_program(model: Any, params: ModelParams) -> DirectProgram | None:
    """The model's direct program, where it has one and calling its modules would do no more
    than their classes' forward: no hooks, no forward of its own, not compiled in place."""
    modules = params.modules
    if (
        not isinstance(model, nn.Module)
        or any(map(any, map(module_hooks, modules)))
        or any(own_calls(modules))
    ):
        return None
    steps = _direct_steps(model)
    return None if steps is None else DirectProgram(steps)


def own_calls(modules: Sequence[Any]) -> list[bool]:
    """Whether calling each module runs more than its class's forward, hooks aside: a
    ``forward`` of its own or a compiled call (``Module.compile``). The walk's check compares
    them call by call (NOTE [ Direct programs ])."""
    attributes = list(map(_attributes_of, modules))
    forwards = map(operator.contains, attributes, itertools.repeat("forward"))
    calls = map(dict.get, attributes, itertools.repeat("_compiled_call_impl"))
    compiled = map(operator.is_not, calls, itertools.repeat(None))
    return list(map(operator.or_, forwards, compiled))


_attributes_of = operator.attrgetter("__dict__")


def _direct_steps(
    module: nn.Module, inside: frozenset[int] = frozenset()
) -> list[tuple[Tensor, Tensor | None] | weakref.ref] | None:
    """An nn.Sequential's layers, nested ones flattened, as what Sequential.forward would call:
    a Linear's weight and bias, or another layer of torch.nn (whose forward is what calling it
    runs), held weakly; None for anything else (a class of the user's may call differently, a
    Sequential inside itself recurses forever, which its module calls report)."""
    kind = type(module)
    if kind is nn.Sequential:
        if id(module) in inside:
            return None
        inside = inside | {id(module)}
        steps: list[tuple[Tensor, Tensor | None] | weakref.ref] = []
        for child in module._modules.values():
            found = None if child is None else _direct_steps(child, inside)
            if found is None:
                return None
            steps += found
        return steps
    if kind is nn.Linear:
        weight = module._parameters.get("weight")
        return None if weight is None else [(weight, module._parameters.get("bias"))]
    if kind.__module__.startswith("torch.nn.") and kind.__call__ is nn.Module.__call__:
        return [weakref.ref(module)]
    return None


# A module's hooks that a call runs, and every module's (NOTE [ Direct programs ]; stacking).
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _global_hooks(*names: str) -> tuple[dict[int, Any], ...]:
    """torch's dicts of global module hooks of these names (those this torch has)."""
    return tuple(getattr(module_globals, name) for name in names if hasattr(module_globals, name))


# Global module hooks (``register_module_forward_hook`` and the like), which run for every model.
GLOBAL_FORWARD_HOOKS = _global_hooks("_global_forward_hooks", "_global_forward_pre_hooks")
GLOBAL_BACKWARD_HOOKS = _global_hooks("_global_backward_hooks", "_global_backward_pre_hooks")
GLOBAL_HOOKS = (*GLOBAL_FORWARD_HOOKS, *GLOBAL_BACKWARD_HOOKS)
module_hooks = operator.attrgetter(*HOOK_DICTS)


def direct_calls_allowed(call: CallArgs) -> bool:
    """Whether this call may run direct programs: one tensor argument, no keyword, no global
    module hook, no JIT tracing, torch.nn's calls its own (NOTE [ Direct programs ])."""
    return (
        call.spec is None
        and call.n_args == 1
        and not call.keywords
        and isinstance(call.leaves[0], Tensor)
        and not any(GLOBAL_HOOKS)
        and torch._C._get_tracing_state() is None
        and torch_nn_untouched()
    )


# NOTE [ Aliases behind a view ]
# A model reads each argument that needs a gradient through an alias of its own, a leaf
# (``x.detach().requires_grad_()``). A global module hook may hook a module's inputs:
# ``torch.utils.module_tracker.ModuleTracker`` (which ``FlopCounterMode`` and other debugging
# modes use) puts ``register_multi_grad_hook`` on them, which asks the engine whether it will
# run each input's node, and PyTorch refuses that question for a leaf inside
# ``torch.autograd.grad``, which a pullback that captures gradients is ("A leaf node was passed
# to _will_engine_execute_node"): the plain loop's ``backward()`` of the same models ran. Where
# such a hook is registered, a model reads a view of its alias instead, a node of the graph;
# the alias, behind it, still gets the gradient, the same values.


# NOTE [ Hooks on an argument ]
# Each model reads an argument that needs a gradient through an alias of its own, so that its
# gradients are summed in a fixed order. A hook that a model's forward registers on its argument
# (``x.register_hook(...)``) then sees that model's share of the argument's gradient, where the
# plain loop's hooks on ``x`` each see the whole (and a hook that changes the gradient, a
# clip, changes the share): 4 models logging the gradient's norm logged 1.25-2.29 where the plain
# loop logged 3.76 four times, silently. Such a forward fails, naming the model; a hook
# registered on the argument before the call sees the whole, as in the plain loop. (An argument
# that needs no gradient takes no hook.) Not looked for under a global module hook, which may
# hook every module's inputs itself (``ModuleTracker``, ``FlopCounterMode``).


class ArgumentHooked(RuntimeError):
    """A forward registered a hook on its argument (NOTE [ Hooks on an argument ])."""


def check_argument_hooks(read: Iterable[Tensor]) -> None:
    """Refuse a forward that registered a hook of the user's on the argument aliases it
    ``read`` (NOTE [ Hooks on an argument ]): not take_rows' own on a table, nor those of a
    global module hook (a ModuleTracker's on every module's inputs)."""
    if any(GLOBAL_HOOKS):
        return
    if any(has_user_hooks(t) or has_user_post_hooks(t) for t in read):
        raise ArgumentHooked(
            "it registers a hook on its argument in forward, which parsum gives each model as "
            "an alias of its own: the hook would see this model's share of the argument's "
            "gradient, not the whole that the plain loop's hooks see; register it on the "
            "argument before the call"
        )


def model_arguments(aliases: dict[int, Tensor]) -> dict[int, Tensor]:
    """What a model reads for its argument aliases (NOTE [ Aliases behind a view ])."""
    if not any(GLOBAL_HOOKS):
        return aliases
    return {j: a.view_as(a) for j, a in aliases.items()}


def run_direct(program: DirectProgram, x: Tensor) -> Tensor:
    """The model's output from its layers called directly."""
    h = x
    noise = iter(program.noise) if program.noise is not None else None
    misses, record = program.misses, program.record
    for step in program.steps:
        if isinstance(step, tuple):  # a Linear: nn.Linear.forward's own call
            h = torch._C._nn.linear(h, step[0], step[1])
            continue
        module = step()
        assert module is not None  # the walk that holds the program found it alive
        if type(module) is nn.Dropout:  # NOTE [ Dropout drawn beforehand ] in _random
            if noise is not None:
                drawn = next(noise, None)
                if drawn is not None and drawn.shape == h.shape and drawn.dtype == h.dtype:
                    h = h * drawn  # F.dropout on the CPU: the input times its noise
                    continue
                if misses is not None and draws_now(module):
                    misses.append(module)  # it draws now, out of turn
            elif record is not None:
                record.append((h.shape, h.dtype, h.device, h.is_contiguous()))
        h = module.forward(h)
    return h


def _own_rows(grad: Tensor) -> Tensor:
    """A stacked gradient whose models' rows are memory of their own. Without weights the
    cotangent is the sum's gradient expanded over the models (stride 0), and where a
    parameter's gradient is a view of it (a bias at one batch row: ``sum_to_size`` gives a
    view; a parameter given out as an output, or a view of one, at any batch size), every
    model's ``.grad`` was the same memory: a second backward's in-place
    accumulation, or an in-place clip or weight decay, then counted once per model."""
    if grad.dim() > 0 and grad.shape[0] > 1 and grad.stride(0) == 0:
        return grad.contiguous()
    return grad


def own_rows_in_backward(stacked: Tensor) -> None:
    """Hand ``stacked``'s gradient to its stack's backward (which cuts it into each model's
    ``.grad``) through ``_own_rows``, where nothing captures it first (the captured path
    applies ``_own_rows`` itself). In the caller's graph a batched bias's gradient at one
    batch row, or a parameter's given out as an output at any batch size, was the sum's
    gradient expanded over the models: every model's ``.grad`` was one memory, and a second
    backward over the retained graph added into it once per model (found by
    tests/test_differential.py, complex seed 214681). Hence on every call, not only at one
    row. Set as ``register_hook``
    does, without its handle: a handle made on every call would tell the plans' checks that
    a hook was registered somewhere (``handle_count``)."""
    node = stacked.grad_fn
    assert node is not None
    stacked._backward_hooks = OrderedDict(own_rows=_own_rows)
    node._register_hook_dict(stacked)


def _first_weight(program: list[Step]) -> str:
    return next(step[0] for step in program if isinstance(step, tuple))


def _widest(program: list[Step], values: dict[str, Tensor]) -> int:
    """The most features any layer of the program gives one model a row."""
    return max(values[step[0]].shape[1] for step in program if isinstance(step, tuple))


def _run_slice(program: list[Step], values: dict[str, Tensor], x: Tensor) -> Tensor:
    """The program over one slice of the models, features first (NOTE [ Features first ])."""
    rows = x.shape[:-1]
    h, batched = x.reshape(-1, x.shape[-1]).t(), False  # (features, rows): shared input
    for step in program:
        if isinstance(step, nn.Module):
            h = step.forward(h)
            continue
        weight = values[step[0]]
        bias = values[step[1]] if step[1] is not None else None
        if batched:
            if bias is None:
                h = torch.bmm(weight, h)
            else:
                h = torch.baddbmm(bias.unsqueeze(2), weight, h)
        else:  # every model's rows of weights times the one input: one matmul
            flat = weight.reshape(-1, weight.shape[-1])
            h = flat.mm(h) if bias is None else torch.addmm(bias.reshape(-1, 1), flat, h)
            h = h.view(weight.shape[0], weight.shape[1], -1)
        batched = True
    return h.transpose(1, 2).view(h.shape[0], *rows, h.shape[1])


def stacked_tensors(
    params: Sequence[ModelParams], read: Sequence[Sequence[Tensor]] | None = None
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Identical models' tensors stacked along dim 0, by name: the trainable ones (recorded
    in the graph where grad mode is on; each model's as ``read`` gives them, where given) and
    the others (never)."""
    first = params[0]
    tensors = [mp.tensors for mp in params] if read is None else read
    with _versioned_tensors():  # for ``forward_on_copies`` to check
        trainable = {
            name: torch.stack([mine[t] for mine in tensors]) for t, name in enumerate(first.names)
        }
        with torch.no_grad():
            state = {
                name: torch.stack([mp.state[t] for mp in params])
                for t, name in enumerate(first.state_names)
            }
    return trainable, state


# NOTE [ Weights written before a group's backward ]
# A stacked group's graph saves the stacked tensors (``torch.stack`` of each name's tensors, or
# stack_ storage's aliases), not the models' own: a model's weight written in place between the
# forward and the backward (an optimizer stepped early, a weight clipped by hand) changed
# nothing that graph reads, and its backward ran on silently, with the forward's weights (with
# stack_ storage, whose aliases share the memory, with the new ones), where the plain loop
# raises autograd's "modified by an inplace operation" for a weight its graph saved (a later
# layer's, never a bias) and models run one by one raise it naming the model. So a group keeps
# its models' tensors' versions from the forward (``GroupReads``; a Sequential of Linear and
# elementwise layers only its weights', which alone its graph can save, the first only where
# the argument needs a gradient), and its backward
# compares them before any gradient is written: where one changed, the stacked tensor of that
# name is marked written too (``increment_version``, as a write into a view marks its base) and
# the group's saved tensors are read as its backward would read them. A name its graph saved
# raises autograd's own error, named with the model whose tensor was written; a name it did
# not save (a bias, the first layer's weight where the argument needs no gradient) raises
# nothing, as in the plain loop. The stacked tensors' own versions are kept too: stack_
# storage's aliases share the storage's, which an optimizer over ``stack.parameters()``
# stepped before the backward writes (every model's slice, none of the models' own version
# counters, which ``p.data = values[k]`` kept apart), where autograd raised naming no model:
# the group's first model is named. Frozen parameters are watched as trainable ones are (a
# frozen last layer's weight is saved all the same, and the group reads a stacked copy of it,
# or stack_ storage's tensor: a write was missed until the sixty-ninth session's lifecycles
# found it). Where the group's graph has no node of parsum's own before
# it (one group holds every model, stack_ storage), the check is a hook on the wide sum's
# gradient (set as ``own_rows_in_backward`` sets its own: a custom Function there cost 35 us
# more a step). Its cost, toggled in one process (300 interleaved steps, 2 cores): 64
# identical tiny Sequentials 0.4-1.9% of a step (the versions read twice, their list made
# every call), in stack_ storage, which keeps that list from call to call, 1.2-1.6%, as classes
# through vmap (every tensor watched) 2.5%. The reads hold the stacked copies until the
# backward that frees the graph (the caller's graph) or, elsewhere, while the sum's output is
# alive: one copy of the group's watched tensors (stack_ storage: none, its aliases view the
# storage).
class GroupReads(NamedTuple):
    """A stacked group's tensors as its graph read them (stacked, by name), and the models' own
    (model by model, name by name) with their versions at the forward."""

    stacked: list[Tensor]
    tensors: list[Tensor]
    versions: list[int]
    stacked_versions: list[int]  # the stacked tensors' own (stack_ storage's aliases)

    @staticmethod
    def of(
        trainable: dict[str, Tensor],
        tensors: Sequence[Sequence[Tensor]],
        program: list[Step] | None,
        args: tuple[Any, ...],
        state: dict[str, Tensor],
        params: Sequence[ModelParams],
    ) -> GroupReads:
        """``tensors``: each model's trainable tensors, in the order of ``trainable``;
        ``state``: the stacked frozen parameters and buffers, ``params`` each model's (its
        frozen parameters are watched too); ``program``: the models' batched program (NOTE
        [ Batched layers ]), whose weights alone are watched, the first only where the
        argument ``args`` give needs a gradient (else the first layer's product saves the
        argument, not the weight)."""
        needs_grad = GroupReads.argument_needs_grad(args)
        names, own = GroupReads.with_frozen(list(trainable), tensors, params)
        stacked = trainable
        if len(names) > len(trainable):
            stacked = {**trainable, **{n: state[n] for n in names[len(trainable) :]}}
        names, watched = GroupReads.watched(names, own, program, needs_grad)
        return GroupReads.reading(stacked, names, watched)

    @staticmethod
    def with_frozen(
        names: list[str], tensors: Sequence[Sequence[Tensor]], params: Sequence[ModelParams]
    ) -> tuple[list[str], Sequence[Sequence[Tensor]]]:
        """The trainable ``names`` and each model's ``tensors`` of them, followed by the frozen
        parameters' (``params``: each model's), which a group's graph saves all the same."""
        frozen = [n for n, t in zip(params[0].state_names, params[0].state) if _frozen(t)]
        if not frozen:
            return names, tensors
        own = [[*mine, *filter(_frozen, mp.state)] for mine, mp in zip(tensors, params)]
        return [*names, *frozen], own

    @staticmethod
    def argument_needs_grad(args: tuple[Any, ...]) -> bool:
        """Whether an argument the group's first layer reads needs a gradient (then its
        product saves that layer's weight, which ``watched`` watches)."""
        return any(isinstance(a, Tensor) and a.requires_grad for a in args)

    @staticmethod
    def watched(
        names: list[str],
        tensors: Sequence[Sequence[Tensor]],
        program: list[Step] | None,
        needs_grad: bool,
    ) -> tuple[list[str], list[Tensor]]:
        """What ``of`` watches: the names, and the models' tensors of those names (model by
        model), as a stack keeps them from call to call."""
        if program is None:
            return names, [t for mine in tensors for t in mine]
        weights = [step[0] for step in program if isinstance(step, tuple)]
        if not needs_grad:
            weights = weights[1:]
        places = [j for j, name in enumerate(names) if name in weights]
        return [names[j] for j in places], [mine[j] for mine in tensors for j in places]

    @staticmethod
    def reading(trainable: dict[str, Tensor], names: list[str], own: list[Tensor]) -> GroupReads:
        """The reads of ``own`` (``watched``'s) now, with the stacked tensors of ``names``."""
        stacked = [trainable[n] for n in names]
        return GroupReads(
            stacked, own, list(map(_version_of, own)), list(map(_version_of, stacked))
        )

    def written(self) -> bool:
        """Whether a model's tensor, or a stacked tensor itself, was written in place since
        the forward."""
        return (
            list(map(_version_of, self.tensors)) != self.versions
            or list(map(_version_of, self.stacked)) != self.stacked_versions
        )

    def check(self, roots: Iterable[Any], error: Callable[[int, Exception], BaseException]) -> None:
        """Raise ``error(k, autograd's error)`` where model ``k``'s tensor written since the
        forward was saved by the group's graph behind ``roots``; nothing where none was."""
        if self.written():
            found = self.first_saved_write(roots)
            if found is not None:
                k, exc = found
                raise error(k, exc) from exc

    def first_saved_write(self, roots: Iterable[Any]) -> tuple[int, Exception] | None:
        """The first model (its place in the group) whose tensor written since the forward
        the group's graph behind ``roots`` saved, with autograd's error; None where none."""
        names = len(self.stacked)
        nodes = list(roots)
        # A stacked tensor written itself (stack_ storage's, by an optimizer over the stack's
        # parameters() stepped before the backward) is every model's slice written: autograd
        # raises for it, named with the group's first model.
        marked = {
            name
            for name, (tensor, was) in enumerate(zip(self.stacked, self.stacked_versions))
            if tensor._version != was
        }
        if marked:
            try:
                unpack_saved(nodes)
            except Exception as exc:
                return 0, exc
        for i, (tensor, was) in enumerate(zip(self.tensors, self.versions)):
            k, name = divmod(i, names)
            if tensor._version == was or name in marked:
                continue
            marked.add(name)
            torch.autograd.graph.increment_version(self.stacked[name])
            try:
                unpack_saved(nodes)
            except Exception as exc:
                return k, exc
        return None


_version_of = operator.attrgetter("_version")


def _frozen(t: Tensor) -> bool:
    """Whether a tensor of a model's state (frozen parameters and buffers) is a parameter."""
    return isinstance(t, nn.Parameter)


def unpack_saved(roots: Iterable[Any]) -> None:
    """Read every tensor saved by the nodes of the graphs behind ``roots`` (down to their
    leaves), as their backward would: one written in place since raises autograd's error."""
    seen: set[Any] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                getattr(node, name)
        stack.extend(next_node for next_node, _ in node.next_functions)


# A single tensor's spec (any leaf's: they are equal).
LEAF_SPEC = pytree.tree_structure(0)


def flatten_output(tree: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """``pytree.tree_flatten``, a tensor (the usual output) without it: its recursive helper is a
    reference cycle left to the garbage collector on every call (torch 2.13: 7 objects)."""
    if isinstance(tree, Tensor):
        return [tree], LEAF_SPEC
    return pytree.tree_flatten(tree)


def batched_forward(
    model: nn.Module,
    program: list[Step] | None,
    trainable: dict[str, Tensor],
    state: dict[str, Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[list[Tensor], pytree.TreeSpec]:
    """Identical models run as one, their tensors stacked by name: ``program`` where it applies
    to the call, one tensor (NOTE [ Batched layers ]), else vmap over ``functional_call`` of a
    shadow of ``model`` (NOTE [ Shadow modules ]). The output's leaves, each the models' along
    dim 0, and its structure."""
    if runs_as_program(program, args, kwargs):
        assert program is not None
        out = run_program(program, {**trainable, **state}, args[0])
    else:
        if autocast_states():  # NOTE [ Autocast under vmap ]
            raise AutocastUnderVmap(
                "autocast does not reach every operation under vmap (a Linear with its bias "
                "ran in float32): the models run one by one"
            )
        shadowed: dict[int, tuple[nn.Module, nn.Module]] = {}
        watched: list[Watched] = []
        base = shadow_module(model, None, shadowed, watched)
        args, kwargs, clones = _arguments_of_its_own(args, kwargs)

        def one(p: dict[str, Tensor], s: dict[str, Tensor]) -> Any:
            return torch.func.functional_call(base, (p, s), args, kwargs)

        chunk = _models_per_chunk(trainable, args, kwargs)
        out = torch.vmap(one, randomness="different", chunk_size=chunk)(trainable, state)
        assigned = _changed_in_forward(shadowed.values(), watched)
        if assigned:  # NOTE [ Attributes assigned in forward ]
            raise RuntimeError(
                f"the models assign or change {', '.join(assigned)} in forward, which one "
                "batched forward cannot do for each model"
            )
        check_argument_hooks(clones)  # NOTE [ Hooks on an argument ]
        if any(c._version for c in clones):
            raise RuntimeError(
                "the models modify an argument in place in forward, which one batched forward "
                "does once for all of them"
            )
    leaves, spec = flatten_output(out)
    for leaf in leaves:
        if not isinstance(leaf, Tensor):
            raise TypeError(f"the stacked models returned {a_kind_of(leaf)} leaf")
    if torch.is_grad_enabled() and model not in _NO_RECOMPUTE:
        # NOTE [ Checkpoints under vmap ]
        nodes = [leaf.grad_fn for leaf in leaves]
        if may_recompute(nodes):
            raise RuntimeError(
                "the models recompute their forward in backward (torch.utils.checkpoint or "
                "other saved-tensor hooks), which vmap's batched graph cannot replay"
            )
        _NO_RECOMPUTE.add(model)
    return leaves, spec


# NOTE [ Attributes assigned in forward ]
# A forward that assigns an attribute (``self.state = out.detach()``, a hidden state carried to
# the next call; ``self.calls += 1``) assigns it on the shadow a batched forward runs (NOTE
# [ Shadow modules ]), once for all the models and, under vmap, as a batched tensor that is dead
# once vmap returns: the modules kept their old values, and 8 identical models carrying a state
# summed to other outputs than the plain loop's from the second call on, silently. Buffers are
# stacked state, given back model by model; any other attribute whose value is no longer the
# module's after the batched forward makes it fail, so that the models run one by one (and
# auto stacks them no more), assigning as in the plain loop. Engine "vjp", which runs a shadow
# too, raises. An object the models write into in forward is the same for all of them where
# they are stacked (a module's other objects differ by identity, ``structure_key``): a log
# they share (``self.log.append(out.detach())``) got one dead batched tensor a call instead of
# one tensor per model, a shared counter (``self.tally.calls += 1``, ``self.stats["n"] += 1``,
# a plain tensor ``add_``) went up once. So the shadow of a module of a class outside torch.nn
# holds shallow copies of its lists, dicts, sets, deques and plain Python objects and clones
# of its tensors that need no gradient (``_kept_for_shadow``), and a batched forward that
# changed a copy (the same objects by identity no longer in it, a clone written) fails as an
# assignment does: the user's objects never see the batched forward. About 4 us a call for a
# module with two such attributes. One level deep: ``self.tally.log.append(...)`` is not seen.
# A forward that changes a parameter in place (a max-norm constraint, ``weight.div_(norm)``
# under no_grad) changed the stacked copies alike, and the models' own parameters never: a
# stacked tensor whose version moved fails the same way. So does a buffer changed in place in
# forward (a count, ``self.n += 1``, in eval mode, where buffers are stacked too: the copies
# counted, the models' buffers stayed 0), also under inference_mode, whose tensors keep no
# version: the copies are made outside it (``stacked_tensors``). (``stack_`` storage is the
# models' own: there the change reaches them.) And a forward that modifies its argument in place
# (``x.mul_(2)``): the plain loop's models each read what those before them left, the batched
# forward modified it once, silently (the same outputs for every model, and another ``x`` after
# the call); vmap's forward reads clones of the arguments (``_arguments_of_its_own``), and a
# clone modified makes it fail, leaving the caller's as it was (NOTE [ Arguments modified in
# place ] in _function then runs the models in order).


# NOTE [ State the models share ]
# Models whose forwards write into an object they share (a log, ``self.log.append(h)``; a
# counter, ``self.tally.calls += 1``; running statistics in a plain tensor, ``self.stats.add_``;
# a module that two entries share assigning its own attributes; features a forward hook
# collects, ``features.append(out)``) write in model order in the plain loop, and on the
# threads in the threads' order: 8 MLPs appending to a shared log at n_jobs=2 logged in
# another order than the plain loop's from the second call on, 6 models' hook-collected
# features came reversed (the costliest claimed first), and statistics took other bits (two
# threads adding into one tensor at once could lose an update). A kept walk lists what its
# models share (``shared_state``): a list, dict, set, deque, plain Python object or tensor that
# needs no gradient held by modules of classes outside torch.nn of two or more entries, a
# module two entries hold, and what the forward hooks and pre-hooks of two entries' modules
# or the forwards of their classes reach besides their arguments (``_reached``: a closure's
# cells, defaults, a partial's arguments, a bound method's object and what it holds, the
# globals the code names). Attributes are named by module, never held, and what is reached
# otherwise is kept only where it holds no module: such an object may hold the models, and a
# walk lives as long as they do. The walk runs its first call's forwards in model order and
# looks after them for a write into any of these (``wrote_shared``: the same objects by
# identity no longer in it, a tensor's version moved, or an inference tensor's values, which
# keep no version, by a copy of up to ``_INFERENCE_VALUES``; a container of more than ``_LONG``
# items by its length; and the same for its first ``_INNER`` items that can be written into,
# a log two levels deep, ``self.tally.log.append``, but not a module's own dicts, which a
# plan's check sees); where one was written, the walk's calls run their forwards in model
# order, as models sharing a buffer do. Calls whose forwards run on the threads look too: a
# write that starts later (a log every tenth call) makes that call warn that its writes came
# in the threads' order, and the next calls run in model order. A walk made again for the
# same models keeps what the last one learned. A walk made for one call (not kept: NOTE
# [ Reused plans ] in _plans) learns nothing, so each of its calls is a first: models that
# share state run their forwards in model order and their pullbacks last first (looking for
# what they share costs 0.18 ms a call for 64 tiny MLPs planned on every call; on threads,
# two counts written at once without the GIL lost one). Global forward hooks
# (``register_module_forward_hook``: features collected for every model, ModuleTracker's
# parents) run for every model:
# while one that reaches such state is registered, the forwards run in model order, without
# learning (``global_hooks_reach_state``): a profiler used for a few steps must not keep a
# plan in model order after it is gone. What the modules' backward hooks and pre-hooks reach
# counts too: a write in the pullbacks is learned by the first backward (NOTE [ Pullbacks that
# write shared state ] in _function). Not seen: a write three levels deep, into an item
# beyond the first ``_INNER``, through functions a forward or hook calls (docs/limits.md).


class SharedState(NamedTuple):
    """What modules of two or more entries hold or reach in common that a forward may write
    into (NOTE [ State the models share ]), each object once."""

    # A module (with None) or a module's attribute (with its name): named, never held, since
    # such an object may hold the models and a walk lives as long as they do.
    named: list[tuple[nn.Module, str | None]]
    # What their forward hooks and forwards reach otherwise (a closure's list, a global dict),
    # none that holds a module.
    reached: list[Any]


def shared_state(
    model_params: Sequence[ModelParams], candidates: Sequence[list[Candidate]] | None = None
) -> SharedState:
    """What modules of two or more entries hold or reach in common that a forward or a
    backward hook may write into (NOTE [ State the models share ]); ``candidates``: each
    entry's ``entry_candidates``, where kept already (NOTE [ Shared state of models planned one
    by one ] in _plans)."""
    if candidates is None:
        reach_of: dict[int, list[Any]] = {}  # by function: many models run one class's forward
        candidates = [entry_candidates(mp.modules, reach_of) for mp in model_params]
    keys = [set(map(_candidate_key, found)) for found in candidates]
    if len(set().union(*keys)) == sum(map(len, keys)):
        return SharedState([], [])  # no object in two entries: most sets
    owner: dict[int, int] = {}
    named: dict[int, tuple[nn.Module, str | None]] = {}
    reached: dict[int, Any] = {}
    for i, (mp, found) in enumerate(zip(model_params, candidates)):
        for key, position, name, value in found:
            if owner.setdefault(key, i) == i:
                continue
            if position is None:  # reached
                if key not in named:
                    reached[key] = value
            else:  # a module (name None) or a module's attribute
                named.setdefault(key, (mp.modules[position], name))
    return SharedState(list(named.values()), list(reached.values()))


class Candidate(NamedTuple):
    """What one entry's module holds or reaches that a forward may write into: the object's
    id, and the module's position among the entry's modules with the attribute's name (None
    for the module itself), or, for what is reached otherwise, no position and the value."""

    key: int
    position: int | None
    name: str | None
    value: Any


_candidate_key = operator.itemgetter(0)


def entry_candidates(
    modules: Sequence[nn.Module], reach_of: dict[int, list[Any]]
) -> list[Candidate]:
    """What an entry's ``modules`` hold or reach that a forward may write into, in the order
    ``shared_state`` meets them; modules and their attributes by position and name, never
    held (NOTE [ State the models share ]). ``reach_of``: ``_reached`` by function, filled."""
    found: list[Candidate] = []
    for position, module in enumerate(modules):
        found.append(Candidate(id(module), position, None, None))
        hooks = module_hooks(module)  # NOTE [ Pullbacks that write shared state ]
        own_class = _may_hold_loose_tensors(type(module))  # type: ignore[arg-type]
        if not own_class and not any(hooks):
            continue  # a torch.nn layer without hooks reaches nothing more
        functions = [fn for hooks_of_a_kind in hooks for fn in hooks_of_a_kind.values()]
        if own_class:
            for key, value in vars(module).items():
                if key not in MODULE_INTERNALS and _writable(value):
                    found.append(Candidate(id(value), position, key, None))
            if not isinstance(module, torch.jit.ScriptModule):  # TorchScript reaches no global
                functions.append(type(module).forward)
        for fn in functions:
            reached = reach_of.get(id(fn))
            if reached is None:
                reached = reach_of[id(fn)] = _reached(fn)
            found.extend(Candidate(id(value), None, None, value) for value in reached)
    return found


def global_hooks_reach_state(hooks: tuple[dict[int, Any], ...] = GLOBAL_FORWARD_HOOKS) -> bool:
    """Whether one of these global hooks (the forward ones by default) reaches something it
    may write into (NOTE [ State the models share ]): state every model shares."""
    if not any(hooks):
        return False
    return any(
        _reached(hook) for hooks_of_a_kind in hooks for hook in list(hooks_of_a_kind.values())
    )


def _reached(fn: Any) -> list[Any]:
    """What a hook or a forward reaches besides its arguments and module, one level deep, that
    it may write into: a partial's arguments, a bound method's object, a function's closure,
    defaults and the globals its code names (``feats.append(out)`` in a forward hook), and
    what such an object of the user's holds; not what holds a module."""
    found: list[Any] = []
    if isinstance(fn, functools.partial):
        found += [*fn.args, *fn.keywords.values()]
        fn = fn.func
    if inspect.ismethod(fn):
        found.append(fn.__self__)
        fn = fn.__func__
    if isinstance(fn, types.FunctionType):
        for cell in fn.__closure__ or ():
            with contextlib.suppress(ValueError):  # a cell not filled yet
                found.append(cell.cell_contents)
        found += [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
        names = fn.__globals__
        found += [names[name] for name in fn.__code__.co_names if name in names]
    else:
        found.append(fn)  # a callable object of the user's
    # An object of the user's, and what it holds (a collector's ``self.features``)
    found += [v for obj in found if _plain_object(obj) for v in list(vars(obj).values())]
    return [v for v in found if _writable(v) and not _holds_modules(v)]


def _plain_object(value: Any) -> bool:
    return not isinstance(value, _MUTABLE_CONTAINERS) and _plain_class(type(value))  # type: ignore[arg-type]


def _holds_modules(value: Any) -> bool:
    """Whether ``value`` (``_writable``) holds a module, looked at one level deep."""
    if isinstance(value, Tensor):
        return False
    held = _contents(value)
    items = list(held.values() if isinstance(held, dict) else held)
    return any(isinstance(v, nn.Module) for v in items[:_LONG])


def _length(container: Any) -> int:
    """A container's length, as the builtin it derives from."""
    for base in _MUTABLE_CONTAINERS:
        if isinstance(container, base):
            return base.__len__(container)  # type: ignore[arg-type]
    return len(container)


def shared_snapshot(objects: Sequence[Any]) -> list[Any]:
    """What ``objects`` (``shared_state``) hold now: a tensor's version, a shallow copy of a
    container (as the builtin it derives from: no method of a subclass of the user's runs) or
    of an object's attributes, with the same of their first items (``_INNER``)."""
    return list(map(_held_now, objects))


def _writable(value: Any) -> bool:
    """Whether a forward may write into ``value`` in place (NOTE [ State the models share ])."""
    if isinstance(value, Tensor):
        return not value.requires_grad
    return isinstance(value, _MUTABLE_CONTAINERS) or _plain_class(type(value))  # type: ignore[arg-type]


# Containers longer than this are looked at by their length alone (a vocabulary a forward
# reads): copying them on every call on the threads would cost more than the forwards.
_LONG = 1000


class _Length(NamedTuple):
    n: int


# The items of a shared container or object looked at one level further (``self.tally.log``,
# ``self.stats["seen"]``): the first ones that can be written into, each container among them
# by its contents up to this length, by its length beyond.
_INNER = 64


class _Contents(NamedTuple):
    """What a container or object holds, and what its first items that can be written into
    hold (each with its ``_held_now``)."""

    contents: Any
    inner: list[tuple[Any, Any]]


class _Values(NamedTuple):
    """What an inference tensor held (``torch.inference_mode``), which keeps no version: a copy
    of its values where it has at most ``_INFERENCE_VALUES`` (a counter a forward adds to), else
    None: a large one (a table made under inference_mode) is taken as unchanged."""

    values: Tensor | None


_INFERENCE_VALUES = 1024


def _held_now(value: Any, long: int = _LONG, inner: bool = True) -> Any:
    if isinstance(value, Tensor):
        if value.is_inference():
            return _Values(value.clone() if value.numel() <= _INFERENCE_VALUES else None)
        return value._version
    if isinstance(value, _MUTABLE_CONTAINERS) and _length(value) > long:
        return _Length(_length(value))
    contents = _contents(value)
    if not inner or isinstance(value, nn.Module):  # its dicts: what a plan's check sees
        return contents
    items = contents.values() if isinstance(contents, dict) else contents
    held = [
        (item, _held_now(item, _INNER, False))
        for item in itertools.islice(items, _INNER)
        if _writable(item)
    ]
    return _Contents(contents, held) if held else contents


def _written_since(value: Any, kept: Any) -> bool:
    if isinstance(value, Tensor):
        if isinstance(kept, _Values):
            return kept.values is not None and not (
                kept.values.shape == value.shape and torch.equal(kept.values, value)
            )
        return bool(value._version != kept)
    if isinstance(kept, _Length):
        return _length(value) != kept.n
    if isinstance(kept, _Contents):
        return not _same_contents(kept.contents, _contents(value)) or any(
            _written_since(item, held) for item, held in kept.inner
        )
    return not _same_contents(kept, _contents(value))


def wrote_shared(objects: Sequence[Any], snapshot: Sequence[Any]) -> bool:
    """Whether a forward or pullback wrote into one of ``objects`` since ``snapshot``, or into
    one of their first items."""
    return any(map(_written_since, objects, snapshot))


def _arguments_of_its_own(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], list[Tensor]]:
    """The call's arguments with clones of their tensors (autograd's, where they need a
    gradient), and the clones, for a batched forward that must not modify the caller's in
    place (NOTE [ Attributes assigned in forward ]); not inference tensors, which keep no
    version to check."""
    clones: list[Tensor] = []

    def own(value: Any) -> Any:
        if not isinstance(value, Tensor):
            return value
        with _versioned_tensors():
            clone = value.clone()
        clones.append(clone)
        return clone

    args, kwargs = pytree.tree_map(own, (args, kwargs))
    return args, kwargs, clones


def _changed_in_forward(
    pairs: Iterable[tuple[nn.Module, nn.Module]], watched: Sequence[Watched]
) -> list[str]:
    """The attributes a forward assigned on shadows or changed in place (``watched``), as
    ``Class.name``."""
    copies = {id(w.kept) for w in watched}
    assigned = [
        f"{type(module).__name__}.{name}"
        for module, shadow in pairs
        for name, value in assignments(module, shadow)
        if id(value) not in copies
    ]
    return assigned + [w.name for w in watched if _changed(w)]


def forward_on_copies(
    model: nn.Module,
    trainable: dict[str, Tensor],
    state: dict[str, Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[list[Tensor], pytree.TreeSpec]:
    """``batched_forward`` over ``stacked_tensors``' copies, which it must not change in place:
    the models' own tensors would not change (NOTE [ Attributes assigned in forward ])."""
    copies = {**trainable, **state}
    versions = [t._version for t in copies.values()]
    leaves, spec = batched_forward(model, program_of(model), trainable, state, args, kwargs)
    changed = [n for (n, t), v in zip(copies.items(), versions) if t._version != v]
    if changed:
        raise RuntimeError(
            f"the models change {', '.join(changed)} in place in forward, which one batched "
            "forward does to stacked copies, not to each model's own"
        )
    return leaves, spec


class AutocastUnderVmap(RuntimeError):
    """A batched forward that vmap would run under autocast (NOTE [ Autocast under vmap ])."""


# NOTE [ Autocast under vmap ]
# Under autocast, ``vmap`` over ``functional_call`` of a Linear gave float32 where the Linear
# alone gives bfloat16 (CPU autocast, torch 2.13: the batched linear with a bias is not cast),
# and a convolution too: a stacked group of such models returned float32 beside bfloat16 from the
# models run one by one, and sum_models raised for the mismatch, or, where the group held every
# model, returned float32 where the plain loop gives bfloat16 (found by tests/test_differential.py).
# The batched layers (NOTE [ Batched layers ]) are cast as the layers alone are. So under
# autocast a group that vmap would run runs its models one by one, for this call only
# (``unit_forward``; ``stacked_sum`` leaves stack_ storage to the general path): neither marked
# as one vmap cannot run nor given up.

# NOTE [ Checkpoints under vmap ]
# A model that checkpoints (torch.utils.checkpoint without reentrance: saved-tensor hooks) runs
# under vmap, but its backward recomputes the forward outside vmap, and torch's check of the
# recomputed tensors raised CheckpointError from the engine (10 identical checkpointed MLPs,
# stacked by auto: every backward failed, found by tests/test_differential.py). The first
# batched forward of a model looks for a graph that can recompute (``may_recompute``, the one
# that NOTE [ Random numbers replayed in backward ] in _random uses): there the batched forward
# fails, so that auto runs the models one by one from then on (VMAP_FAILED), stack_ storage gives
# up, and engine="stacked" raises naming the model. Looked for once per model: a model that
# starts checkpointing later (an attribute set) fails in backward as before.
_NO_RECOMPUTE: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _models_per_chunk(
    trainable: dict[str, Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> int | None:
    """vmap's ``chunk_size`` on the CPU (NOTE [ Batched slices ]): the layers of a model of
    unknown code are estimated at the call's first tensor's rows times the largest dimension
    of any parameter. None: all the models at once."""
    first = next(
        (t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor) and t.dim() > 0),
        None,
    )
    weights = [t for t in trainable.values() if t.dim() > 1]
    if first is None or not weights or first.device.type != "cpu":
        return None
    widest = max(max(t.shape[1:]) for t in weights)
    per_model = first.numel() // max(1, first.shape[-1]) * widest * weights[0].element_size()
    return _models_per_slice(per_model, weights[0].shape[0])


def stacked_forward(
    models: Sequence[Callable[..., Any]],
    call: CallArgs,
    params: Sequence[ModelParams],
    build_graph: bool,
    check_leaves: bool = False,
) -> UnitRun:
    """Run identical models as one batched forward over their stacked parameters; see NOTE
    [ Engines ]. With ``check_leaves``, raise where the forward reads a tensor that requires
    grad which the models do not own (NOTE [ Tensors a module does not own ])."""
    model = models[0]
    assert isinstance(model, nn.Module)
    n = len(models)
    grad_mode = torch.enable_grad() if build_graph else contextlib.nullcontext()
    with grad_mode:
        positions = call.grad_positions if build_graph else []
        inputs = {j: call.leaves[j].detach().requires_grad_() for j in positions}
        args, kwargs = call.build(inputs)
        trainable, state = stacked_tensors(params)
        leaves, spec = forward_on_copies(model, trainable, state, args, kwargs)
    outs = models_outputs(leaves, spec, n)
    if not build_graph:
        return UnitRun(outs, None, leaves)
    roots = [get_gradient_edge(o) if o.requires_grad else None for o in leaves]
    # NOTE [ Weights written before a group's backward ]
    reads = GroupReads.of(
        trainable, [mp.tensors for mp in params], program_of(model), args, state, params
    )
    # The stacked parameters, not the originals: one gradient per name, which ``unbind`` cuts
    # into each model's, instead of n_models x names captured gradients.
    wrt = [*inputs.values(), *trainable.values()]
    if check_leaves:  # the models' own: the stacked tensors and what they were stacked from
        own = [*trainable.values(), *(t for mp in params for t in mp.tensors)]
        check_own_leaves(models[0], roots, own, inputs.values(), call)
    n_args = len(inputs)

    def pullback(
        grad_outputs: Sequence[Tensor], weights: Sequence[Weight], retain_graph: bool
    ) -> tuple[list[Tensor | None], list[list[Tensor | None]]]:
        if all(w is None for w in weights):
            cotangents = [g.expand(n, *g.shape) for g in grad_outputs]
        elif len(set(map(_weight_key, weights))) == 1:  # one weight: one product, expanded
            one = SinglePullback.cotangents(grad_outputs, weights[0])
            cotangents = [c.expand(n, *c.shape) for c in one]
        elif all(type(w) is float for w in weights) and all(map(_float_on_cpu, grad_outputs)):
            # Inline, not weigh_models: through it a backward of the 64 tiny Sequentials (12
            # groups) measured 0.975-0.984x in five runs; the dtype here is settled already.
            cotangents = [
                g.unsqueeze(0) * torch.tensor(weights, dtype=g.dtype).view(-1, *([1] * g.dim()))
                for g in grad_outputs
            ]
        else:
            cotangents = [
                torch.stack([g if w is None else weighted_cotangent(g, w) for w in weights])
                for g in grad_outputs
            ]
        pairs = [(o, c) for o, c in zip(roots, cotangents) if o is not None]
        if not pairs or not wrt:
            return [None] * n_args, [[None] * len(mp.tensors) for mp in params]
        outs, cots = zip(*pairs)
        reads.check([edge.node for edge in outs], GroupWritten)
        grads = pull_back(outs, wrt, cots, retain_graph)
        by_name: list[Sequence[Tensor | None]] = [
            [None] * n if g is None else _own_rows(g).unbind(0) for g in grads[n_args:]
        ]
        per_model = [[grads_k[k] for grads_k in by_name] for k in range(n)]
        return list(grads[:n_args]), per_model

    return UnitRun(outs, pullback, leaves, reads)


class GroupWritten(Exception):
    """A stacked group's model ``member`` (its place in the group) whose tensor written in
    place since the forward its graph saved, with autograd's ``error`` (NOTE [ Weights
    written before a group's backward ])."""

    def __init__(self, member: int, error: Exception) -> None:
        super().__init__(member, error)
        self.member, self.error = member, error


def stacked_in_graph(
    models: Sequence[Callable[..., Any]],
    params: Sequence[ModelParams],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    one_by_one: Callable[[], list[Any]],
    fall_back: bool,
    check_leaves: tuple[Iterable[Tensor], CallArgs] | None = None,
    read: Sequence[Sequence[Tensor]] | None = None,
) -> UnitRun:
    """Identical models run as one batched forward in the caller's graph (NOTE [ Stacked groups
    in the caller's graph ] in _inline): each parameter name's tensors stacked with their
    graph, whose backward hands each model its slice. Each model's output (views of the
    batched leaves, with their graph), no pullback, the batched leaves. Under autocast, and
    with ``fall_back`` where vmap cannot run the models, the outputs ``one_by_one`` gives
    instead (where vmap cannot, later plans no longer stack them: ``unit_forward``'s fallback).
    ``check_leaves``: the aliases the models read and the call, to refuse tensors the models
    do not own (NOTE [ Tensors a module does not own ]). ``read``: each model's parameters as
    the group reads them (views of hooked ones: NOTE [ Tensor hooks in the caller's graph ] in
    _inline)."""
    model = models[0]
    assert isinstance(model, nn.Module)
    try:
        trainable, state, leaves, spec = batched_in_graph(model, params, args, kwargs, read)
    except AutocastUnderVmap:  # this call only, whatever the engine asked
        return UnitRun(one_by_one(), None)
    except Exception:
        if not fall_back:
            raise
        run = UnitRun(one_by_one(), None)  # marked only where they run so (a bad batch fails)
        VMAP_FAILED.update(models)  # type: ignore[arg-type]
        _vmap_failures[0] += 1  # plans that stack this group are made again
        return run
    if check_leaves is not None:
        aliases, call = check_leaves
        own = [*trainable.values(), *(t for mp in params for t in mp.tensors)]
        roots = [get_gradient_edge(o) if o.requires_grad else None for o in leaves]
        check_own_leaves(model, roots, own, aliases, call)
    tensors = [mp.tensors for mp in params] if read is None else read
    reads = GroupReads.of(trainable, tensors, program_of(model), args, state, params)
    return UnitRun(models_outputs(leaves, spec, len(models)), None, leaves, reads)


def batched_in_graph(
    model: nn.Module,
    params: Sequence[ModelParams],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    read: Sequence[Sequence[Tensor]] | None = None,
) -> tuple[dict[str, Tensor], dict[str, Tensor], list[Tensor], pytree.TreeSpec]:
    """Identical models' batched forward in the caller's graph: their trainable tensors (as
    ``read`` gives them, where given) stacked by name with their graph (each stacked gradient
    handed on through ``_own_rows``), the others stacked, and the output's leaves (the models
    along dim 0) and structure."""
    trainable, state = stacked_tensors(params, read)
    for stacked in trainable.values():
        if stacked.grad_fn is not None:
            own_rows_in_backward(stacked)
    leaves, spec = forward_on_copies(model, trainable, state, args, kwargs)
    return trainable, state, leaves, spec


def models_outputs(leaves: list[Tensor], spec: pytree.TreeSpec, n: int) -> list[Any]:
    """Each of ``n`` models' output from the batched output's ``leaves``, views of them."""
    if spec == LEAF_SPEC:  # the usual case: one unbind for every model's view
        return list(leaves[0].unbind(0))
    return [pytree.tree_unflatten([leaf[k] for leaf in leaves], spec) for k in range(n)]
