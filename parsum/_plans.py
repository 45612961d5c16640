"""What planning a call learns from its models, reused by the next call while nothing changed.

# NOTE [ Reused plans ]
# Planning a call walks every module of every model (``ModelParams.of``) and derives from what it
# finds the parameters each model trains, the units and the chunks: 0.65 ms a call for 64 tiny
# MLPs, whose plain forward and backward take 5.3 ms at one thread. A training loop calls
# ``sum_models`` on the same models step after step, so a call on the same model objects (in the
# same order) reuses the last walk while a check of everything the walk read finds nothing
# changed: every module (held weakly) alive, of the same class and training flag; its
# ``_parameters``, ``_buffers`` and ``_modules`` holding the same objects under the same names;
# a module of a class outside torch.nn (whose tensor attributes the walk collects) holding the
# same attributes; every tensor's ``requires_grad``, storage (``m.to(dtype or device)`` and
# ``p.data = ...`` give it a new one) and number of elements (``p.data = p.data[:16]``, a
# narrower layer, keeps the storage: the plan held, and engine="stacked" stacked such models
# with the others, which raised); the same module hooks (which decide which models may be
# stacked): looked for only when a hook was registered anywhere since, which one counter of
# hook handles tells (a model that registers a tensor hook in its forward made every call plan
# anew, 0.65 ms for 64 tiny MLPs; the look at their 382 modules costs 0.12 ms). The units and
# chunks derived for an engine, a batch shape, a ``chunk_size`` and a chunk limit are kept
# beside the walk; where they stack models, the walk also checks every attribute of those
# models' modules from then on (a group depends on its modules' settings), and a group vmap
# was found unable to run makes the units anew (64 identical tiny MLPs that auto stacks,
# planned on every call before: forward 3.3 -> 1.8 ms, plain loop 2.1).
# A bound method of a module (``m.encode``) is a new object on every call: it is known by its
# module and its function, which the walk holds (the module weakly). Planned on every call, 64
# tiny MLP classes called through ``m.forward`` ran at 0.85x the modules' speed and 16
# Sequentials at batch 64 at 0.89x (2 threads); reused, at 0.92-1.03x and 0.92-0.98x in three
# runs (benchmarks/bench_methods.py, results/methods-2cores.txt).
# Not reused: calls where a model is another callable (a ``functools.partial``: its arguments
# may be anything), a lazy module is not initialized, a tensor is a subclass, or ``take_rows``
# has read one of the models' tensors (the chunks count the rows such a table gathers).
# Not seen (the walk would have seen them): a tensor's shape changed in place with the same
# storage and number of elements (``p.data = p.data.view(...)``: its sizes would be a third
# look at every tensor), and a torch.nn layer's settings changed (a convolution's stride,
# which the cost estimate reads).
# Lifetime: at most MAX_PLANS walks are kept, each holding its modules (and the attributes of
# modules of classes outside torch.nn, where they can be held weakly: a method of the module
# kept as an attribute would keep it alive) weakly and its tensors strongly, and dropped as
# soon as one of its models is collected: a walk keeps no model alive (tested), only the
# tensors of models that are alive.
"""

from __future__ import annotations

import inspect
import operator
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from itertools import chain, repeat
from typing import Any, NamedTuple, cast

from torch import Tensor, nn
from torch.nn.parameter import Parameter

from ._engines import (
    CONTAINERS,
    MODULE_INTERNALS,
    Candidate,
    DirectProgram,
    ModelParams,
    Unit,
    _may_hold_loose_tensors,
    _requires_grad,
    direct_program,
    entry_candidates,
    holds_tensors,
    method_module,
    module_hooks,
    module_of,
    own_calls,
    shared_state,
)
from ._grads import ParamSlots, ParamTrainers
from ._grouping import structure_key
from ._locks import Lock
from ._pace import Pace
from ._sparse import (
    any_sampled,
    handle_count,
    has_user_hooks,
    post_accumulate_hooks,
    sampled_elements,
)
from ._stack import _data_ptr, _numel, _tensor_hooks
from ._torch_calls import torch_nn_untouched

MAX_PLANS = 8
MAX_QUIET = 4096  # models marked quiet (NOTE [ Models seen not to draw ] in _random)
MAX_MODEL_WALKS = 4096  # walks kept one per model (NOTE [ Models planned one by one ])
MAX_DERIVED = 4  # units and chunks kept per walk (batch shapes, engines, chunk limits)

_PLAIN_TENSORS = (Tensor, Parameter)
_is = operator.is_
_training = operator.attrgetter("training")
_dicts_of = operator.attrgetter("_parameters", "_buffers", "_modules")


class Derived(NamedTuple):
    """What a call plans from a walk, its engine, batch shape, chunk size and chunk limit."""

    units: list[Unit]
    chunks: list[range]
    workers: int  # the workers that pay, where parsum chooses them
    forward_workers: int  # of those, the forwards' (NOTE [ Forwards on fewer workers ])
    order: tuple[int, ...] | None  # the order threads claim the chunks in (costliest_first)
    callers_last: bool  # whether the last chunk claimed is the caller's (small_last_chunk)
    # Where the models are too small for forward workers, each chunk's estimated cost: their
    # pullbacks on several threads go in runs of chunks cut by it (NOTE [ Pullbacks in runs of
    # chunks ] in _inline); None otherwise.
    run_costs: tuple[int, ...] | None
    # Where parsum chose more than one worker, whether they still pay, for calls a backward
    # follows and for forwards alone (NOTE [ Workers that stop paying ] in _pace).
    pace: tuple[Pace, Pace] | None = None


class _Watched(NamedTuple):
    """Modules whose every attribute a walk checks: their positions among its modules, their
    attribute counts, and (their index here, name, value) of each attribute."""

    at: list[int]
    sizes: list[int]
    attributes: list[tuple[int, str, _Held]]


class Walk:
    """One walk over a call's models (``ModelParams.of`` each, modules left out: they are held
    weakly here), what ``sum_models`` derives from it, and what says it still holds."""

    def __init__(
        self,
        model_params: list[ModelParams],
        params: list[Tensor],
        slots: list[list[int]],
        shared: list[bool],
        forward_in_order: bool,
    ) -> None:
        self.model_params = model_params
        self.params = params
        self.slots = slots
        self.shared = shared
        self.forward_in_order = forward_in_order
        # Whether the models' forwards draw random numbers (None: not known yet), and whether
        # their graphs can recompute them in backward (NOTE [ Random numbers in forwards ] in
        # _random).
        self.draws_random: bool | None = None
        self.recomputes: bool | None = None
        # Whether a call saw an argument modified in place while the forwards ran on several
        # threads (NOTE [ Arguments modified in place ] in _function).
        self.modifies_args = False
        # What modules of several models share, by position among the walk's modules and
        # attribute (None: the module), and whether a forward was seen to write into it (NOTE
        # [ State the models share ] in _engines): set when the walk is kept.
        self.shared_state: list[tuple[int, str | None]] = []
        self.shared_reached: list[Any] = []  # what hooks and forwards reach otherwise
        self.writes_shared: bool | None = None
        # Whether a pullback (a backward hook) was seen to write into it: NOTE [ Pullbacks
        # that write shared state ] in _function.
        self.pullbacks_write_shared: bool | None = None
        self.kept = False  # by keep_walk, for the next calls
        # Whether a call looked through the models' graphs (NOTE [ Tensors a module does not
        # own ] in _engines).
        self.leaves_checked = False
        # Whether the models' draws can be made beforehand, and the shapes of what they draw
        # by noise_key (NOTE [ Dropout drawn beforehand ] in _random).
        self.predraws = False
        self.noise_shapes: dict[Hashable, list[list[Any]]] = {}
        # (engine, batch, chunk_size, max_chunks, workers chosen) -> what is derived for them
        self.derived: dict[Hashable, Derived] = {}
        self._module_refs: list[weakref.ref[nn.Module]] = []
        self._types: list[type] = []
        self._training: list[bool] = []
        self._entry_dicts: list[dict] = []
        self._entry_keys: list[str] = []
        self._entry_values: list[Any] = []
        self._sized: list[dict] = []
        self._sizes: list[int] = []
        # Attributes of modules of classes outside torch.nn, and of the modules of models it
        # stacks (_watch_settings), read through the modules: their values are held weakly
        # where they can be (a bound method of the module would keep it alive).
        self._custom: _Watched = _Watched([], [], [])
        self._tensors: list[Tensor] = []
        self._ptrs: list[int] = []
        self._numels: list[int] = []
        self._requires: list[bool] = []
        self._handles: int | None = None
        self._hook_ids: list[tuple[int, ...]] = []
        self._model_refs: list[weakref.ref[Any]] = []
        # Each model's function where it is a bound method (its module in _model_refs), else
        # None; None for a walk over modules alone.
        self._model_funcs: list[Any] | None = None
        # Whether every parameter is a leaf: a model run inside another sum's pullback with
        # hooked parameters reads aliases of them (NOTE [ Hooks run once ] in _engines), whose
        # gradients must be returned, never accumulated (NOTE [ Accumulating in the pullback ]).
        self.params_are_leaves = all(p.is_leaf for p in params)
        self.slots_in_flat_grads = ParamSlots(params)  # where they have FlatGrad slots
        self.trainers = ParamTrainers(params)  # the threads that train them
        # Each model's direct program (NOTE [ Direct programs ] in _engines), made when the
        # walk is kept: [] for a walk made for one call.
        self.programs: list[DirectProgram | None] = []
        # Whether every program is of known layers (NOTE [ Known layers in a plain graph ] in
        # _plain_graph): found on the first call that asks.
        self.known_layers: bool | None = None
        # Their Linear layers' weights, which the plain graph's backward watches (NOTE
        # [ Tensors written before the backward ] in _plain_graph): found with known_layers.
        self.linear_weights: list[Tensor] = []
        self._hookless_at: int | None = None  # the handle count of the last hookless_params
        # The handle count and the slots of ``hooked_slots``'s last answer.
        self._hooked: tuple[int | None, list[int]] = (None, [])
        self._calls: list[bool] = []
        self._torch_nn: bool | None = True  # torch.nn's calls untouched when recorded
        # Each model's modules' training flags, made when the walk is kept (NOTE [ Models
        # seen not to draw ] in _random).
        self.model_modes: list[tuple[bool, ...]] = []
        # Each model's count of modules, for a record joined from models' own walks (NOTE
        # [ Models planned one by one ]).
        self.module_counts: list[int] = []
        # A walk planned from its models' own walks: those walks, one a model, and whether
        # each watched its model's settings when they were joined (NOTE [ Structure keys
        # kept by models' own walks ]).
        self.parts: list[Walk] = []
        self.settings_watched: list[bool] = []
        # A model's own walk: its model's structure key (_grouping.structure_key) once asked,
        # and what its modules hold or reach that a forward may write into once a set joined
        # from it is kept (NOTE [ Shared state of models planned one by one ]).
        self.structure: Hashable | None = _UNASKED
        self.candidates: list[Candidate] | None = None

    def hookless_params(self) -> bool:
        """Whether no parameter has a gradient hook or a post-accumulate-grad hook. Looked for
        again only where a hook was registered somewhere since (a handle made): a call's
        checks read two attributes of every parameter otherwise (NOTE [ Reused plans ])."""
        handles = handle_count()  # read first: a hook registered while looking shows next time
        if handles is not None and handles == self._hookless_at:
            return True
        # A set joined from models' own walks (NOTE [ Models planned one by one ]): its
        # parameters are theirs, looked at by the last set that had them at this count.
        if (
            self.parts
            and handles is not None
            and all(map(_hookless_at, self.parts, repeat(handles)))
        ):
            self._hookless_at = handles
            return True
        if any(map(_tensor_hooks, self.params)) or any(map(post_accumulate_hooks, self.params)):
            return False
        self._hookless_at = handles
        for part in self.parts:
            part._hookless_at = handles
        return True

    def hooked_slots(self) -> list[int]:
        """The slots of the parameters with a tensor hook of the user's (NOTE [ Tensor hooks
        in the caller's graph ] in _inline), looked for again only where a hook was registered
        somewhere since (a hook removed since may still be listed: its parameter is then read
        through a view, which gives the same gradient)."""
        handles = handle_count()
        if handles is None or handles != self._hooked[0]:
            found = [s for s, p in enumerate(self.params) if has_user_hooks(p)]
            self._hooked = (handles, found)
        return self._hooked[1]

    def over(self, models: Sequence[Callable[..., Any]]) -> bool:
        """Whether this walk was made over these very models (their ids alone may be reused):
        the same modules, and bound methods of the same modules with the same functions."""
        if self._model_funcs is None:
            return all(map(_is, [ref() for ref in self._model_refs], models))
        if len(models) != len(self._model_refs):
            return False
        for ref, func, model in zip(self._model_refs, self._model_funcs, models):
            if func is None:
                if ref() is not model:
                    return False
            elif not (
                inspect.ismethod(model) and model.__func__ is func and ref() is model.__self__
            ):
                return False
        return True

    def no_user_tensor_hooks(self) -> bool:
        """Whether no parameter has a tensor hook of the user's (parsum's own, a FlatGrad's or
        a StepInBackward's, aside): its model then runs through module calls (NOTE [ Hooks
        run once ] in _engines)."""
        return self.hookless_params() or all(
            p._backward_hooks is None or not has_user_hooks(p) for p in self.params
        )

    def shares_state(self) -> bool:
        """Whether its models share state a forward may write into (NOTE [ State the models
        share ] in _engines)."""
        return bool(self.shared_state or self.shared_reached)

    def saw_no_draw(self, models: Sequence[Callable[..., Any]]) -> None:
        """A forward of ``models`` drew nothing: where the walk did not know yet, it learns
        that they do not draw and marks them quiet (NOTE [ Models seen not to draw ] in
        _random)."""
        if self.draws_random is None:
            self.draws_random = False
            self.mark_quiet(models)

    def mark_quiet(self, models: Sequence[Callable[..., Any]]) -> None:
        """Mark this kept walk's models quiet, by their keys, held weakly as the walk holds
        them, in their modules' training flags (NOTE [ Models seen not to draw ] in _random)."""
        if not self.kept:
            return
        if len(_quiet) + len(models) > MAX_QUIET:
            _quiet.clear()
        for model, ref, modes in zip(models, self._model_refs, self.model_modes):
            _quiet[_model_key(model)] = (ref, modes)

    def all_quiet(self, models: Sequence[Callable[..., Any]]) -> bool:
        """Whether every model of this kept walk is marked quiet in the training flags its
        modules have now (NOTE [ Models seen not to draw ] in _random)."""
        if not _quiet or not self.kept:
            return False
        for model, ref, modes in zip(models, self._model_refs, self.model_modes):
            marked = _quiet.get(_model_key(model))
            if marked is None or marked[0]() is not ref() or marked[1] != modes:
                return False
        return True

    @staticmethod
    def unmark_quiet(models: Sequence[Callable[..., Any]]) -> None:
        """Forget that these models were quiet: one of them drew."""
        for model in models:
            _quiet.pop(_model_key(model), None)

    def shared_objects(self) -> list[Any]:
        """What its models share (``shared_state``, found through its modules, and
        ``shared_reached``); none where a module is gone."""
        modules = [ref() for ref in self._module_refs]
        if None in modules:
            return []
        named = [
            modules[k] if key is None else vars(modules[k]).get(key) for k, key in self.shared_state
        ]
        return [*named, *self.shared_reached]

    def grew(self) -> bool:
        """Whether a module's parameter, buffer or submodule dict changed in size since the
        walk: a forward that made parameters (NOTE [ Parameters made in forward ] in
        _function). False for a walk made for one call, which recorded none."""
        return list(map(len, self._sized)) != self._sizes

    def holds(self) -> bool:
        """Whether a walk now would find what this one found (NOTE [ Reused plans ])."""
        if self._handles is None:
            return False
        handles = handle_count()
        modules = [ref() for ref in self._module_refs]
        if None in modules:
            return False
        if (
            list(map(type, modules)) != self._types
            or list(map(_training, modules)) != self._training
            or own_calls(modules) != self._calls
            or torch_nn_untouched() != self._torch_nn
            or list(map(len, self._sized)) != self._sizes
            or not all(
                map(_is, map(dict.get, self._entry_dicts, self._entry_keys), self._entry_values)
            )
            or list(map(_requires_grad, self._tensors)) != self._requires
            or list(map(_data_ptr, self._tensors)) != self._ptrs
            # ``p.data = p.data[:16]`` keeps the address: its shape is found from it anew
            or list(map(_numel, self._tensors)) != self._numels
        ):
            return False
        watched = self._custom  # one read: _watch_settings replaces it whole
        if watched.at:
            custom = [vars(modules[k]) for k in watched.at]
            if list(map(len, custom)) != watched.sizes:
                return False
            for owner, key, held in watched.attributes:
                if custom[owner].get(key, _MISSING) is not held.get():
                    return False
        if handles != self._handles:
            # A hook was registered somewhere since (a model's forward may register tensor
            # hooks on every call): the walk holds while its modules have the hooks it saw.
            if _hook_ids(modules) != self._hook_ids:  # type: ignore[arg-type]
                return False
            self._handles = handles
        return True

    def own_structure_key(self, model_params: ModelParams) -> Hashable | None:
        """This model's own walk's ``structure_key`` of its model (``model_params``, modules
        included), kept; settings watched from then on where it can be stacked (NOTE
        [ Structure keys kept by models' own walks ])."""
        key = self.structure
        if key is _UNASKED:
            key = structure_key(model_params)
            # The watch first: a join that sees the key sees the watch (``_join``).
            if key is not None and not self._watch_settings(list(model_params.modules)):
                return key
            self.structure = key
        return key

    def own_candidates(
        self, modules: Sequence[nn.Module], reach_of: dict[int, list[Any]]
    ) -> list[Candidate]:
        """This model's own walk's ``entry_candidates`` of its ``modules``, kept (NOTE [ Shared
        state of models planned one by one ])."""
        found = self.candidates
        if found is None:
            found = self.candidates = entry_candidates(modules, reach_of)
        return found

    def _watch_settings(self, modules: list[nn.Module]) -> bool:
        """Check from now on every attribute of ``modules`` as those of classes outside
        torch.nn are checked: a stacked group depends on its modules' settings (a
        ``negative_slope`` changed on one model splits it). False where a module is not one
        this walk holds."""
        position = {id(ref()): k for k, ref in enumerate(self._module_refs)}
        with _lock:  # two first calls in two threads may each add modules: both stay
            custom_at, sizes = list(self._custom.at), list(self._custom.sizes)
            held = list(self._custom.attributes)
            watched = set(custom_at)
            for module in modules:
                k = position.get(id(module))
                if k is None:
                    return False
                if k in watched:
                    continue
                watched.add(k)
                attributes = vars(module)
                owner = len(custom_at)
                custom_at.append(k)
                sizes.append(len(attributes))
                held.extend(
                    (owner, key, _Held(attributes[key]))
                    for key in attributes.keys() - MODULE_INTERNALS
                )
            # Replaced whole: a call in another thread checks the old lists or the new ones.
            self._custom = _Watched(custom_at, sizes, held)
        return True

    def _record(self, modules: list[nn.Module]) -> bool:
        """What ``holds`` compares; False, recording nothing, if these modules are not planned
        twice: a tensor subclass among their tensors, tensors in a list, tuple or dict held by
        a module, or a TorchScript module, whose dicts are views of C++ state (``holds`` reads
        plain dicts only)."""
        # Built by C-level iteration: a set of models not seen before (members drawn at
        # random each step) records on every call.
        sized = list(chain.from_iterable(map(_dicts_of, modules)))  # three dicts a module
        if not set(map(type, sized)) <= {dict}:
            return False
        values = list(chain.from_iterable(map(dict.values, sized)))
        tensors = [v for v in values if isinstance(v, Tensor)]
        custom = _Watched([], [], [])
        for position, module in enumerate(modules):
            if _may_hold_loose_tensors(type(module)):  # type: ignore[arg-type]
                attributes = vars(module)
                owner = len(custom.at)
                custom.at.append(position)
                custom.sizes.append(len(attributes))
                for key in attributes.keys() - MODULE_INTERNALS:
                    value = attributes[key]
                    custom.attributes.append((owner, key, _Held(value)))
                    if isinstance(value, Tensor):
                        tensors.append(value)
                    elif isinstance(value, CONTAINERS) and holds_tensors(value):
                        # Held by identity, a list would hide the tensors put in it since
                        # (or set to require grad): such models are planned on every call.
                        return False
        if any(type(t) not in _PLAIN_TENSORS for t in tensors):
            return False
        self._handles = handle_count()
        self._hook_ids = _hook_ids(modules)
        self._module_refs = list(map(weakref.ref, modules))
        self._custom = custom
        self._sized = sized
        self._types = list(map(type, modules))
        self._training = list(map(_training, modules))
        self._calls = own_calls(modules)
        self._torch_nn = torch_nn_untouched()  # NOTE [ torch.nn's calls replaced ]
        self._sizes = list(map(len, sized))
        self._entry_dicts = list(chain.from_iterable(map(repeat, sized, self._sizes)))
        self._entry_keys = list(chain.from_iterable(sized))
        self._entry_values = values
        self._tensors = tensors
        self._requires = list(map(_requires_grad, tensors))
        self._ptrs = list(map(_data_ptr, tensors))
        self._numels = list(map(_numel, tensors))
        return True

    def _record_models(
        self,
        models: Sequence[Callable[..., Any]],
        model_params: list[ModelParams],
        modules: list[nn.Module],
    ) -> bool:
        """``_record`` of ``modules``, then each model's direct program and training flags,
        what a kept walk holds besides; False, recording nothing, where ``_record`` is."""
        if not self._record(modules):
            return False
        self.programs = [direct_program(m, mp) for m, mp in zip(models, model_params)]
        self.model_modes = [tuple(map(_training, mp.modules)) for mp in model_params]
        return True

    def _take_record(self, other: Walk) -> None:
        """Take ``other``'s record (what ``holds`` compares) as this walk's own."""
        for name in _RECORD_FIELDS:
            setattr(self, name, getattr(other, name))


# What ``Walk._record`` sets and ``holds`` compares.
_RECORD_FIELDS = (
    "_handles", "_hook_ids", "_module_refs", "_custom", "_sized", "_types", "_training",
    "_calls", "_torch_nn", "_sizes", "_entry_dicts", "_entry_keys", "_entry_values", "_tensors",
    "_requires", "_ptrs", "_numels",
)  # fmt: skip
# The record's lists with an entry per module, or per entry of a module's dicts, or per tensor:
# a walk over several models' modules records them one model after the other.
_CONCATENATED = (
    "_hook_ids", "_module_refs", "_sized", "_types", "_training", "_calls", "_sizes",
    "_entry_dicts", "_entry_keys", "_entry_values", "_tensors", "_requires", "_ptrs", "_numels",
)  # fmt: skip


def _hook_ids(modules: Sequence[nn.Module]) -> list[tuple[int, ...]]:
    """Each module's hook handle ids (unique: a hook replaced by another shows), its forward,
    forward pre-, backward and backward pre-hooks', in that order."""
    return list(map(tuple, map(chain.from_iterable, map(module_hooks, modules))))


_MISSING = object()  # no such attribute
_UNASKED = object()  # a structure key not asked for yet
_GONE = object()  # a value held weakly and collected: no attribute holds it


class _Held:
    """An attribute's value, weakly where it can be."""

    __slots__ = ("_ref", "_value")

    def __init__(self, value: Any) -> None:
        try:
            self._ref: weakref.ref[Any] | None = weakref.ref(value)
            self._value = None
        except TypeError:  # ints, floats, strings, tuples, lists: held as they are
            self._ref, self._value = None, value

    def get(self) -> Any:
        """The value, or a marker no attribute holds if it was collected."""
        if self._ref is None:
            return self._value
        found = self._ref()
        return _GONE if found is None else found


_plans: OrderedDict[tuple[Hashable, ...], Walk] = OrderedDict()
# Models whose forwards a kept walk saw drawing nothing, by ``_model_key``: a weak reference to
# the model (or the method's module) and its modules' training flags.
_quiet: dict[Hashable, tuple[weakref.ref[Any], tuple[bool, ...]]] = {}
# Reentrant: a model collected while a thread holds it (the collector runs on any allocation)
# calls _Forget, which takes it again in the same thread.
_lock = Lock()


def known_walk(models: Sequence[Callable[..., Any]]) -> Walk | None:
    """The last walk over these very models, if it still holds (NOTE [ Reused plans ])."""
    if not _plans:
        return None
    walk = _plans.get(tuple(map(id, models)))
    if walk is None and not all(isinstance(m, nn.Module) for m in models):
        key = _walk_key(models)  # bound methods among them
        walk = _plans.get(key) if key is not None else None
    if walk is None or not walk.over(models) or _reads_tables(walk.params):
        return None
    return walk if walk.holds() else None


def _model_key(model: Any) -> Hashable | None:
    """A model's part of a walk's key: a module by its id, a bound method of one by its
    module's and its function's; None for another callable."""
    if isinstance(model, nn.Module):
        return id(model)
    if method_module(model) is not None:
        return (id(model.__self__), id(model.__func__))
    return None


def _walk_key(models: Sequence[Callable[..., Any]]) -> tuple[Hashable, ...] | None:
    """The key a walk over these models is kept under (each model's ``_model_key``); None where
    another callable is among them (no walk is kept for it)."""
    if all(map(isinstance, models, repeat(nn.Module))):
        return tuple(map(id, models))
    key = []
    for m in models:
        k = _model_key(m)
        if k is None:
            return None
        key.append(k)
    return tuple(key)


def _reads_tables(params: Sequence[Tensor]) -> bool:
    """Whether ``take_rows`` has read one of ``params`` (NOTE [ Reused plans ]): a table of
    these models' own; one of other models' alive beside them changes nothing here (it had
    made every call plan anew, and a call's path, and bits, depended on whether the garbage
    collector had taken some other models' table yet: found by tests/test_differential.py)."""
    return any_sampled() and any(sampled_elements(p) is not None for p in params)


def keep_walk(
    models: Sequence[Callable[..., Any]],
    model_params: list[ModelParams],
    walk: Walk,
    joined: Walk | None = None,
) -> bool:
    """Keep ``walk`` (just made from ``model_params``, modules included) for the next call;
    whether it was kept. ``joined``: the record joined from the models' own walks, where
    ``models_found`` found them holding (NOTE [ Models planned one by one ])."""
    key = _walk_key(models)
    if key is None or _reads_tables(walk.params):
        return False
    if any(mp.uninitialized is not None for mp in model_params):
        return False
    if joined is None and _seen_in_kept_walks(models):
        joined = _walked_one_by_one(models, model_params)
    candidates = None  # each model's, where its own walk keeps them
    if joined is not None:
        walk._take_record(joined)
        walk.programs, walk.model_modes = joined.programs, joined.model_modes
        walk.parts, walk.settings_watched = joined.parts, joined.settings_watched
        # Each model looked through in a set before is clean in any (NOTE [ Tensors a module
        # does not own ] in _engines)
        walk.leaves_checked = all(part.leaves_checked for part in joined.parts)
        reach_of: dict[int, list[Any]] = {}  # NOTE [ Shared state of models planned one by one ]
        candidates = [
            part.own_candidates(mp.modules, reach_of)
            for part, mp in zip(joined.parts, model_params)
        ]
    else:
        seen: set[int] = set()
        modules = []
        for mp in model_params:
            for module in mp.modules:
                if id(module) not in seen:
                    seen.add(id(module))
                    modules.append(module)
        if not walk._record_models(models, model_params, modules):
            return False
    shared = shared_state(model_params, candidates)
    if shared.named:  # most sets share nothing
        # by position among the record's modules, alive in this call
        position = {id(ref()): k for k, ref in enumerate(walk._module_refs)}
        walk.shared_state = [(position[id(m)], key) for m, key in shared.named]
    walk.shared_reached = shared.reached
    last = _plans.get(key)
    if last is not None and last.over(models) and last._training == walk._training:
        # The same models in the same modes, changed otherwise (a module's own attribute, a
        # parameter replaced): what their forwards were seen to draw still tells how to run
        # them (NOTE [ Random numbers in forwards ] in _random); a forward on the threads that
        # draws after all is still seen. Whether they recompute is looked for again: an
        # attribute may have turned checkpointing on.
        walk.draws_random = last.draws_random
        walk.modifies_args = last.modifies_args
        walk.writes_shared = last.writes_shared
        walk.pullbacks_write_shared = last.pullbacks_write_shared
    # Dropped when any model goes: its id could then name another model.
    forget = _Forget(_plans, key, walk)
    if all(isinstance(m, nn.Module) for m in models):
        walk._model_refs = [weakref.ref(m, forget) for m in models]
    else:  # a method by its module, weakly, and its function
        owners = [module_of(m) for m in models]  # the module itself, or the method's
        walk._model_refs = [weakref.ref(cast(nn.Module, m), forget) for m in owners]
        walk._model_funcs = [
            None if isinstance(m, nn.Module) else cast(Any, m).__func__ for m in models
        ]
    with _lock:
        _plans[key] = walk
        _plans.move_to_end(key)
        while len(_plans) > MAX_PLANS:
            _plans.popitem(last=False)
    walk.kept = True
    return True


def stripped(model_params: list[ModelParams]) -> list[ModelParams]:
    """The walk's findings without the modules, which a kept walk holds weakly."""
    return [mp.with_modules([]) for mp in model_params]


# NOTE [ Models planned one by one ]
# A set of models not seen together before (members drawn at random each step) was planned
# from nothing on every call: ``ModelParams.of`` of every model, the record the reuse check
# reads, each model's direct program. Each of these is the model's own, and holds while the
# record of the model's modules does. So a kept walk's models also keep a walk each
# (``_model_walks``, by the model's id, the model held weakly as a kept walk holds it, at most
# MAX_MODEL_WALKS), and a new set of modules whose walks all exist, share no module and hold
# is planned from them: their findings reused, its record the concatenation of theirs (the
# very lists a walk over the set's modules records, in that order: ``_CONCATENATED``),
# checked once for all of them by ``holds``. Anything else is walked as before, and its
# models' walks made anew where one of them is in a kept walk: a set of models seen before,
# never models new on every call (their own walks made a call 1.1-1.3x slower for 64 tiny
# classes made anew each step, in two runs, one thread, and their objects made the garbage
# collector run more often). What a set learns (shared state, random draws, stacked groups)
# is still learned per set.
# Planning such a set still costs what its models' number does: 48 of 64 tiny MLP classes drawn
# each call took 0.61 ms more of the forward than a set seen before (one thread timing each
# piece, 2 cores, 2026-12-01), the join and the check of the joined record 0.2 and 0.1, keeping
# the set's walk 0.07, choosing chunks and workers 0.2. Where the answer is the models' own,
# it is read once a call or from their walks: the parameters of a set that shares none
# collected without an index, the cost estimates read once for every choice, the rows that
# decide intra-op threads kept by each model's findings, whether the parameters have hooks
# taken from the last set that looked at them at the same hook count, and whether the set's
# models share anything counted in sets before going through them. 0.61 -> 0.54 ms; against
# the code before, members drawn each step (bench_against.py --members 0.75, 40 rounds): the
# tiny classes 1.027x, the other workloads 1.003-1.012x.

_model_walks: dict[int, Walk] = {}

# NOTE [ Structure keys kept by models' own walks ]
# Identical models drawn at random were grouped for stacking anew for every set: each model's
# ``structure_key`` (its modules' types, settings and hooks, its tensors' shapes) cost 17% of
# a step of 48 of 64 tiny MLPs, and the watch of the stacked modules' settings that a set's
# plan then starts (``_watch_settings``: a ``negative_slope`` changed on one model must split
# its group) 8%, for every set. The key is the model's own, and holds while its record does
# and its settings are what they were: a model's own walk keeps it, and watches its modules'
# settings from then on (``Walk.own_structure_key``), so a set joined from such walks groups
# its models from their keys, and its record, the concatenation of theirs, already watches
# their settings: its plan watches only the modules of stacked models whose walks did not
# when it was joined (``settings_watched``). A key of None (hooks, a compiled or TorchScript
# module) depends on nothing the record does not hold, and watches nothing. Only the call that
# joined the walks (and so checked their records, settings included) reads their keys: a kept
# set that stacks none of its models watches none of their settings, so planned again later
# (another batch shape or engine) it keys them anew.
#
# NOTE [ Shared state of models planned one by one ]
# What a set's models share (NOTE [ State the models share ] in _engines) was found anew for
# every set, going through every module's attributes and hooks: 0.25 ms of a step of 48 of 64
# tiny MLP classes drawn at random, 3% of it. What one model's modules hold or reach
# (``entry_candidates``: modules and their attributes by position and name, never held, and
# what hooks and forwards reach) is the model's own, and a model's own walk keeps it, so that a
# set joined from such walks only counts which of those objects two of its models have
# (``shared_state`` over the kept lists). Its record, the concatenation of theirs, checked
# once a call, holds the same modules, attributes and hooks. What a function reaches (a
# global, a closure's cell) is found once per walk, as a kept set's ``shared_reached`` always
# was: a global assigned another list later is not seen. Likewise a set whose models were all
# looked through before, in any set, is not looked through again (NOTE [ Tensors a module does
# not own ] in _engines), which had cost each model a call of the check and its graph's output
# edges. With the per-model estimates planning reads several times (``_grouping``: costs,
# kernel shares, layouts) read from the findings at once: 48 of the 64 tiny classes drawn each
# step 1.05-1.08x, 12 of the 16 medium classes 0.99-1.03x (2 cores, bench_against.py --members
# 0.75, three runs of 40-80 rounds); fixed sets, which plan once, unchanged.


def models_found(
    models: Sequence[Callable[..., Any]],
) -> tuple[list[ModelParams], Walk | None]:
    """Each model's ``ModelParams``, modules included, and the record joined from the models'
    own walks where they hold (NOTE [ Models planned one by one ]); else each model walked
    anew, and None."""
    held = _joined_walks(models)
    if held is None:
        return [ModelParams.of(m) for m in models], None
    joined, modules = held
    found = []
    start = 0
    for mp, count in zip(joined.model_params, joined.module_counts):
        found.append(mp.with_modules(modules[start : start + count]))
        start += count
    return found, joined


def _joined_walks(
    models: Sequence[Callable[..., Any]],
) -> tuple[Walk, list[nn.Module]] | None:
    """The models' own walks joined, and the modules they record, where each model has one
    and together they hold."""
    if not _model_walks:
        return None
    walks = list(map(_model_walks.get, map(id, models)))
    if None in walks:
        return None
    found = cast(list[Walk], walks)
    if not all(map(_is, [w._model_refs[0]() for w in found], models)):
        return None
    joined = _join(found)
    refs = [ref() for ref in joined._module_refs]
    if None in refs:
        return None
    modules = cast(list[nn.Module], refs)
    if not _distinct(modules):
        return None  # a module in two models, or one model twice: walked as a set
    return (joined, modules) if joined.holds() else None


def _distinct(modules: list[nn.Module]) -> bool:
    """Whether no module is in the list twice (NOTE [ Models planned one by one ])."""
    return len(set(map(id, modules))) == len(modules)


def _seen_in_kept_walks(models: Sequence[Callable[..., Any]]) -> bool:
    """Whether a model is in a kept walk (alive then: a walk goes with any of its models).
    Models new on every call (copies made each step) are never planned one by one: their own
    walks would only cost, and make objects the garbage collector sees (NOTE [ Models planned
    one by one ])."""
    with _lock:
        keys = list(_plans)
    return not set(map(id, models)).isdisjoint(chain.from_iterable(keys))


def _walked_one_by_one(
    models: Sequence[Callable[..., Any]], model_params: list[ModelParams]
) -> Walk | None:
    """A new walk for each model, kept, and their records joined; None where a model is not a
    module, a module is in two models, or a model's modules cannot be recorded."""
    if not all(isinstance(m, nn.Module) for m in models):
        return None
    if not _distinct([module for mp in model_params for module in mp.modules]):
        return None
    walks = []
    for model, mp in zip(models, model_params):
        own = Walk([mp.with_modules([])], [], [], [], False)
        if not own._record_models([model], [mp], mp.modules):
            return None
        walks.append(own)
    with _lock:
        if len(_model_walks) + len(walks) > MAX_MODEL_WALKS:
            _model_walks.clear()
        for model, own in zip(models, walks):
            own._model_refs = [weakref.ref(model, _Forget(_model_walks, id(model), own))]
            _model_walks[id(model)] = own
    return _join(walks)


def _hookless_at(walk: Walk, handles: int) -> bool:
    """Whether ``walk``'s parameters were last seen without hooks at this handle count."""
    return walk._hookless_at == handles


def _join(walks: list[Walk]) -> Walk:
    """One walk whose record and per-model findings are those of ``walks``, one after the
    other (NOTE [ Models planned one by one ])."""
    joined = Walk([w.model_params[0] for w in walks], [], [], [], False)
    # Read before the records: a key is kept after its watch is (``own_structure_key``).
    joined.settings_watched = [w.structure is not _UNASKED for w in walks]
    joined.parts = walks
    for name in _CONCATENATED:
        setattr(joined, name, list(chain.from_iterable(map(operator.attrgetter(name), walks))))
    counts = [len(w._module_refs) for w in walks]
    custom = _Watched([], [], [])
    offset = 0
    for w, count in zip(walks, counts):
        own = w._custom
        if own.at:
            owners = len(custom.at)
            custom.at.extend(k + offset for k in own.at)
            custom.sizes.extend(own.sizes)
            custom.attributes.extend((owners + k, key, held) for k, key, held in own.attributes)
        offset += count
    joined._custom = custom
    handles = {w._handles for w in walks}
    # Recorded at different counts: ``holds`` then compares the hook ids themselves.
    joined._handles = handles.pop() if len(handles) == 1 else -1
    # Recorded on both sides of a replacement: None, which no check equals (it never holds)
    flags = {w._torch_nn for w in walks}
    joined._torch_nn = flags.pop() if len(flags) == 1 else None
    joined.programs = [w.programs[0] for w in walks]
    joined.model_modes = [w.model_modes[0] for w in walks]
    joined.module_counts = counts
    return joined


class _Forget:
    """Drops ``walk`` from ``registry`` when a model it holds is collected."""

    __slots__ = ("key", "registry", "walk")

    def __init__(self, registry: dict[Any, Walk], key: Hashable, walk: Walk) -> None:
        self.registry = registry
        self.key = key
        self.walk = weakref.ref(walk)

    def __call__(self, _: object) -> None:
        walk = self.walk()
        with _lock:
            if walk is not None and self.registry.get(self.key) is walk:
                del self.registry[self.key]


def remember_derived(
    walk: Walk, key: Hashable, derived: Derived, model_params: Sequence[ModelParams]
) -> None:
    """Keep what was planned for ``key``; where it stacks models, the walk checks from now on
    the settings of their modules too (``model_params``: this call's walk, modules included)."""
    stacked = [i for unit in derived.units if len(unit.models) > 1 for i in unit.models]
    # Those whose own walks watched them when this walk's record was joined are watched here
    # already (NOTE [ Structure keys kept by models' own walks ]).
    watched = walk.settings_watched
    unwatched = [i for i in stacked if not (watched and watched[i])]
    if unwatched and not walk._watch_settings(
        [m for i in unwatched for m in model_params[i].modules]
    ):
        return
    if len(walk.derived) >= MAX_DERIVED:
        walk.derived.clear()
    walk.derived[key] = derived
