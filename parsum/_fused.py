"""StepInBackward: each model's optimizer step runs in the worker right after its pullback.

# NOTE [ Fused steps ]
# In plain training every gradient of the whole set is held at once between backward and
# step. Here the worker that pulled a model back hands that model's gradients to the model's
# own optimizer, steps it and drops them, so at any moment only the gradients of the models
# being pulled back exist (and those of small models waiting to step with their chunk's, at
# most MERGED_STEP_ELEMENTS elements a chunk: NOTE [ One step over a chunk's small models ]):
# the peak falls by about the gradients of all the other models. One
# optimizer per model gives the same result as one optimizer over all parameters for every
# optimizer whose update is per parameter (SGD, Adam, AdamW, ...); each model's state (momenta,
# step counts) is its own. A parameter held by two models would need the sum of both pullbacks
# before its step, so it is refused up front.
#
# NOTE [ Gradients from outside the sum ]
# A loss with a term on a model's parameter outside the sum (an L2 penalty written in the loss)
# sends that parameter a second gradient, which autograd accumulates after every input of the
# parameter's node is ready, so after sum_models' backward already stepped it without that
# gradient; the gradient would then linger in ``.grad`` into the next step (measured: 3 SGD steps
# off by 5.6e-3 from plain training). Each parameter therefore carries a post-accumulate hook
# that raises when a gradient reaches it after its fused step in the same backward (the marks
# are cleared when that backward ends, and at the next sum_models call).
# The hook holds the StepInBackward weakly: a strong reference would be a cycle through C++
# (parameter, hook, optimizer, parameter) that the garbage collector cannot see.
#
# NOTE [ One step a backward ]
# A loss over two sum_models calls with one StepInBackward (micro-batches summed, then one
# backward) stepped each model once in each call's backward, with that call's gradient alone:
# two Adam steps where plain training takes one with both (0.18 off after one step), silently,
# or, where a model's graph saved a weight the first step wrote, autograd's "modified by an
# inplace operation" from the second call's pullback, naming nothing of the cause. Each
# backward of ParallelSum (and a stack_ storage call's first gradient) notes the models it
# steps under autograd's graph task, and one that would step a model another call's backward
# stepped in the same task raises, before its own pullbacks: the other call's steps ran there
# (or run on the helpers, where its pullbacks are joined later), or, where its models are in
# stack_ storage, would have run at the backward's end, which a failed backward does not
# reach. A second
# backward through a retained graph is another task: it steps again, as a plain optimizer
# stepped between the two would. The notes go as the backward ends (autograd's final
# callback; a failed backward leaves its few, and the oldest go past 64). They are kept for
# every StepInBackward together, by the parameters each model's optimizer steps: two
# StepInBackward objects over the same models, one in each call (an optimizer each, say two
# learning rates tried in turn), had each stepped them with its own call's gradient, silently,
# as one in both calls had before the check (found on 2026-12-07).
#
# NOTE [ Steps of one model in several threads ]
# Threads training the same models with one StepInBackward step each model in their own
# backward passes. Steps of one model at once (its ``.grad`` set, stepped and dropped by two
# threads; one merged optimizer stepped by both) crashed a process in 3 of 13 probe runs (4
# threads x 15 calls over 6 MLPs with SGD; a segmentation fault in SGD's step): each model's
# steps take its lock (a merged step or a stacked one, those of its models in their order), so
# steps of one model follow each other and those of different models still run at once. So does
# the check for a gradient after a step (NOTE [ Gradients from outside the sum ]), which another
# thread's backward runs: without the GIL it dropped the .grad a step had just set, whose
# optimizer then met None (3 in about 100 runs of tests/test_concurrency.py's four threads).
# (Such threads mostly fail anyway: a step changes the parameters other threads' graphs saved.)
# The lock is the model's, whichever StepInBackward steps it: with locks of each
# StepInBackward's own, four threads training the same models, each with a StepInBackward of
# its own, stepped one model at once again: a segmentation fault in 3 of 3 runs of
# tests/test_concurrency.py's case of it, and in probe runs (4 threads x 15 calls over 6 MLPs
# with SGD) a check after a step that dropped the .grad another's step had just set and raised
# that a gradient came from outside the sum (5 of 12 runs, 10 of 12 in another batch).
#
# NOTE [ One step over a chunk's small models ]
# An optimizer's step costs about 40 us of Python before its first parameter (its hooks, the
# profiler's record, the group's scan), which a tiny model's update does not repay: 64 MLPs of
# widths 16-48 with one Adam each spent 8.6 ms a step in their 64 steps, where one Adam over all
# of their parameters took 6.1. A chunk's models therefore wait with their gradients, up to
# MERGED_STEP_ELEMENTS parameter elements in all (a larger model steps alone), and step
# together once the chunk's last pullback is done or that many wait, by one optimizer of
# their class over their parameters whose state entries are the models' own (the same dicts:
# the step updates them in place, and each model's optimizer reads, saves and loads them as
# before), where that gives what each step would: SGD, Adam or AdamW (updates and states per
# parameter, the same kernels on each tensor, so the same bits), one group each over exactly
# the parameters stepped, equal hyperparameters (an LR scheduler that moves one optimizer alone
# ends it), no step hook, here or global, and no ``step`` of the optimizer's own but an LR
# scheduler's counting wrapper, whose count is kept. Otherwise each model steps alone, as one
# that does not wait steps right after its pullback. The steps of a chunk that fails in its
# pullbacks do not run. Measured on 2 cores with Adam, in one process against the commit before
# (bench_against.py --sib): those 64 tiny MLPs (one chunk at a budget of 2) 1.11-1.14x, from
# 0.90x to 1.03x the plain loop with one Adam; 16 medium MLPs (chunks of one model) unchanged.
#
# NOTE [ Steps over tensors in one call ]
# On the CPU, PyTorch's default (foreach=None) steps SGD, Adam and AdamW one tensor at a time
# from Python: about ten kernel calls an Adam tensor, each giving the GIL up and taking it back
# in a worker whose neighbours' pullbacks want it too. Their foreach implementation makes the
# same kernel calls on each tensor from C++, with the same bits in float32 and float64 (tested
# against the loop on every optimizer setting that changes the arithmetic; float16 and
# bfloat16 steps differ there, and keep the loop), so a step left to that default runs
# with foreach=True, for that step alone (the optimizer's settings are set back after it),
# where its tensors hold at most MERGED_STEP_ELEMENTS elements: foreach makes its temporaries
# for all the tensors at once, and a fused step's memory is kept to about a model's gradients.
# Measured with Adam on 2 cores against the commit before (bench_against.py --sib, two runs of
# 30 rounds, benchmarks/results/sib-one-call-2cores.txt): 16 MLPs of widths 128-512 1.02-1.08x,
# 16 MLP classes 1.06-1.10x, 64 tiny MLPs 1.21-1.22x, 64 tiny classes 1.14x.
"""

from __future__ import annotations

import collections
import importlib
import inspect
import itertools
import operator
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.nn.parameter import UninitializedParameter

from ._config import check_model_sequence
from ._errors import ParsumError, a_kind_of, message_of
from ._locks import Lock, T, run_holding
from ._sparse import OwnPostHook

_WHERE = "StepInBackward"
MERGED_STEP_ELEMENTS = 2**20  # NOTE [ One step over a chunk's small models ]
# NOTE [ One step a backward ]: per running backward (autograd's graph task id), the
# parameters some StepInBackward steps in it, by id, each with whether its step runs inside
# the backward (not at its end).
_claims: dict[int, dict[int, bool]] = {}
_registry_lock = Lock()  # guards _claims and _step_locks
# NOTE [ Steps of one model in several threads ]: each model's step lock, held weakly.
_step_locks: weakref.WeakKeyDictionary[nn.Module, Lock] = weakref.WeakKeyDictionary()


def _step_lock_of(model: nn.Module) -> Lock:
    """The lock of ``model``'s steps, for every StepInBackward over it."""
    with _registry_lock:
        lock = _step_locks.get(model)
        if lock is None:
            lock = _step_locks[model] = Lock()
        return lock


class StepInBackward:
    """Per-model optimizers whose steps ``sum_models`` runs inside its parallel backward.

    Pass it as ``sum_models(models, x, step_in_backward=sib)``; then ``loss.backward()``
    updates every model: in the worker that ran a model's pullback, right after it, that
    model's optimizer steps and its gradients are dropped (``.grad`` stays None); small
    models step after their chunk's last pullback, as one where their optimizers agree. The result
    equals plain training (``backward()``, ``step()``, ``zero_grad()``) with one optimizer of
    ``optimizer_cls`` over all the parameters, for optimizers whose update is per parameter.
    Copied together with its models (``copy.deepcopy((models, sib))``, ``torch.save`` of a
    ``SumOfModels`` that holds it), it steps the copies.

    >>> import torch, parsum
    >>> models = [torch.nn.Linear(3, 1) for _ in range(4)]
    >>> sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
    >>> before = models[0].weight.detach().clone()
    >>> parsum.sum_models(models, torch.ones(2, 3), step_in_backward=sib).sum().backward()
    >>> models[0].weight.grad is None, torch.equal(models[0].weight, before)
    (True, False)
    >>> schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=10) for o in sib.optimizers]

    Args:
        models: the models, as they will be passed to ``sum_models`` (any order; a subset may
            be passed). No parameter may belong to two of them.
        optimizer_cls: a ``torch.optim.Optimizer`` subclass (or a callable building one from
            an iterable of parameters).
        **optimizer_kwargs: passed to every optimizer (``lr``, ``momentum``, ...).

    Attributes:
        models: the models.
        optimizers: one optimizer per model, in the order of ``models`` (None for a model with
            no trainable parameter). Give each an LR scheduler, read or load their state.

    Raises:
        ParsumError: for a bad ``models``, a parameter shared by two models, a lazy parameter
            not initialized yet, or an optimizer that cannot be built from the keyword
            arguments.
    """

    def __init__(
        self,
        models: Sequence[nn.Module],
        optimizer_cls: Callable[..., torch.optim.Optimizer],
        **optimizer_kwargs: Any,
    ) -> None:
        models = check_model_sequence(models, _WHERE, (nn.ModuleList,))
        if not callable(optimizer_cls):
            raise ParsumError(
                f"{_WHERE}: optimizer_cls is {optimizer_cls!r:.60}, which is not callable; "
                "expected a torch.optim.Optimizer subclass such as torch.optim.Adam"
            )
        self._index: dict[int, int] = {}
        holder: dict[int, tuple[int, str]] = {}
        for i, model in enumerate(models):
            if not isinstance(model, nn.Module):
                raise ParsumError(
                    f"{_WHERE}: models[{i}] is {a_kind_of(model)}; expected an nn.Module "
                    "(its parameters are what its optimizer steps)"
                )
            if id(model) in self._index:
                raise ParsumError(
                    f"{_WHERE}: models[{i}] ({type(model).__name__}) is models"
                    f"[{self._index[id(model)]}] again; list each model once"
                )
            self._index[id(model)] = i
            for name, p in model.named_parameters():
                if not p.requires_grad:
                    continue
                if isinstance(p, UninitializedParameter):
                    raise ParsumError(
                        f"{_WHERE}: parameter {name!r} of models[{i}] ({type(model).__name__}) "
                        "is a lazy parameter that is not initialized yet, whose gradient "
                        "cannot be watched; call the model once first (for example on one "
                        "batch under torch.no_grad()), then make the StepInBackward"
                    )
                other = holder.setdefault(id(p), (i, name))
                if other[0] != i:
                    raise ParsumError(
                        f"{_WHERE}: parameter {name!r} of models[{i}] "
                        f"({type(model).__name__}) is parameter {other[1]!r} of models"
                        f"[{other[0]}] ({type(models[other[0]]).__name__}); a step right "
                        "after one model's pullback cannot see the other's gradient, so tied "
                        "parameters across models are not supported: step them with a "
                        "regular optimizer"
                    )
        self.models = models
        # ids of the parameters stepped in the running backward (NOTE [ Gradients from
        # outside the sum ]).
        self._stepped: set[int] = set()
        # NOTE [ One step over stacked models ]: per stack, the optimizer over its tensors and
        # the per-model state entries it installed; ids of the step counts they share.
        self._stacked: dict[int, _StackedStep] = {}
        self._shared_counts: set[int] = set()
        # NOTE [ One step over a chunk's small models ]: per tuple of models, the optimizer
        # that steps them as one.
        self._merged: dict[tuple[int, ...], torch.optim.Optimizer] = {}
        # NOTE [ Steps of one model in several threads ]: each model's lock, the one every
        # StepInBackward over it takes.
        self._step_locks = list(map(_step_lock_of, models))
        self._watch_gradients()
        self.optimizers: list[torch.optim.Optimizer | None] = []
        for i, model in enumerate(models):
            params = [p for p in model.parameters() if p.requires_grad]
            if not params:
                self.optimizers.append(None)
                continue
            try:
                optimizer = optimizer_cls(params, **optimizer_kwargs)
            except Exception as exc:
                name = getattr(optimizer_cls, "__name__", type(optimizer_cls).__name__)
                raise ParsumError(
                    f"{_WHERE}: optimizer_cls {name}(params of models[{i}] "
                    f"({type(model).__name__}), **{optimizer_kwargs!r}) raised "
                    f"{type(exc).__name__}: {message_of(exc)}"
                ) from exc
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise ParsumError(
                    f"{_WHERE}: optimizer_cls returned {a_kind_of(optimizer)}; expected "
                    "a torch.optim.Optimizer"
                )
            if _needs_closure(optimizer):
                raise ParsumError(
                    f"{_WHERE}: {type(optimizer).__name__}.step needs a closure that runs the "
                    "forward and backward again (torch.optim.LBFGS), which a step inside the "
                    "backward cannot give: step it after the backward, with a closure"
                )
            self.optimizers.append(optimizer)
        self._note_stepped_params()

    def _note_stepped_params(self) -> None:
        """Each model's parameters that its optimizer steps, by id: for the claims of the
        running backward passes (NOTE [ One step a backward ]) and ``first_not_stepped``."""
        self._stepped_params = [
            frozenset(() if o is None else (id(p) for g in o.param_groups for p in g["params"]))
            for o in self.optimizers
        ]

    def first_not_stepped(self, j: int, params: Sequence[Tensor]) -> int | None:
        """The position in ``params`` of the first that model ``j``'s optimizer does not step,
        or None (looked for again in its parameter groups where one is not found:
        ``add_param_group`` since)."""
        stepped = self._stepped_params[j]
        if all(map(stepped.__contains__, map(id, params))):
            return None
        self._note_stepped_params()
        stepped = self._stepped_params[j]
        return next((k for k, p in enumerate(params) if id(p) not in stepped), None)

    def _watch_gradients(self) -> None:
        """Hook every trainable parameter: a gradient after its step raises (NOTE
        [ Gradients from outside the sum ])."""
        me = weakref.ref(self)
        for i, model in enumerate(self.models):
            for name, p in model.named_parameters():
                if p.requires_grad:
                    check = OwnPostHook(_no_gradient_after_step, me, i, name)
                    p.register_post_accumulate_grad_hook(check)

    # NOTE [ A copied StepInBackward ]
    # ``copy.deepcopy`` and pickling (``torch.save`` of a SumOfModels that holds one) copy the
    # models and the optimizers with their states, but what is keyed by identity names the
    # originals: the copy refused its own models ("not one of step_in_backward's models"). A
    # copy finds its models again by theirs, forgets the caches of stacked and merged steps
    # (made again at the next step from the models' states), takes as shared the step counts
    # that several of its states hold (NOTE [ One step over stacked models ]: copied once, they
    # stay shared in the copy), and hooks its parameters, whose copies have no hooks.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_step_locks"]  # a lock is neither copied nor pickled: made anew
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._step_locks = list(map(_step_lock_of, self.models))
        self._index = {id(model): i for i, model in enumerate(self.models)}
        self._stepped = set()
        self._note_stepped_params()
        self._stacked = {}
        self._merged = {}
        seen: set[int] = set()
        self._shared_counts = set()
        for optimizer in self.optimizers:
            for entry in optimizer.state.values() if optimizer is not None else ():
                for value in entry.values():
                    if isinstance(value, Tensor):
                        if id(value) in seen:
                            self._shared_counts.add(id(value))
                        seen.add(id(value))
        self._watch_gradients()

    def index(self, model: Any) -> int | None:
        """The position of ``model`` in ``models`` (by identity), or None."""
        return self._index.get(id(model))

    def state_dict(self) -> dict[str, Any]:
        """Every optimizer's state, for checkpoints."""
        return {"optimizers": [None if o is None else o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("optimizers") if isinstance(state, dict) else None
        if not isinstance(saved, list) or len(saved) != len(self.optimizers):
            raise ParsumError(
                f"{_WHERE}.load_state_dict: state holds {saved!r:.40}; expected a state_dict() "
                f"of a StepInBackward over {len(self.optimizers)} models"
            )
        for optimizer, entry in zip(self.optimizers, saved):
            if optimizer is not None:
                optimizer.load_state_dict(entry)

    def __repr__(self) -> str:
        kinds = {type(o).__name__ for o in self.optimizers if o is not None}
        return f"StepInBackward({len(self.models)} models, {', '.join(sorted(kinds))})"

    def claim_steps(self, js: Sequence[int], inside: bool) -> tuple[int, bool] | None:
        """Note that the running backward steps models ``js``, inside it or at its end; the
        first of them whose parameters another call's backward in it steps already (with this
        StepInBackward or another), with whether that step runs inside (nothing noted then),
        or None (NOTE [ One step a backward ])."""
        task = torch._C._current_graph_task_id()
        mine = self._stepped_params
        with _registry_lock:
            claimed = _claims.get(task)
            if claimed is None:
                if len(_claims) >= 64:  # left by failed backward passes: the oldest go
                    for old in sorted(_claims)[:32]:
                        _claims.pop(old, None)
                claimed = _claims[task] = {}

                def forget() -> None:
                    with _registry_lock:
                        _claims.pop(task, None)

                torch.autograd.Variable._execution_engine.queue_callback(forget)
            elif claimed:
                for j in js:
                    for other in map(claimed.get, mine[j]):
                        if other is not None:
                            return j, other
            for j in js:
                claimed.update(dict.fromkeys(mine[j], inside))
        return None

    def step(self, j: int, params: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
        """Step model ``j`` with this backward's gradients (added to any ``.grad``), drop them.

        Runs in a worker; the parameters are that model's alone, and another thread's backward
        steps them only once this step is done (NOTE [ Steps of one model in several threads ]).
        """
        optimizer = self.optimizers[j]
        if optimizer is None:
            return
        with self._step_locks[j]:
            self._step(optimizer, params, grads)

    def _step(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[Tensor],
        grads: Sequence[Tensor | None],
    ) -> None:
        if self._shared_counts:  # a step count shared with other models: its own from now on
            for p in params:
                state: dict[str, Any] = optimizer.state.get(p) or {}
                count = state.get("step")
                if count is not None and id(count) in self._shared_counts:
                    state["step"] = count.clone()
            self._stacked.clear()
        for p, g in zip(params, grads):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        looped = _loops_over_tensors(optimizer, params)
        try:
            optimizer.step()
        finally:
            for p in params:
                p.grad = None
            _loop_again(looped)
        self._stepped.update(id(p) for p in params)

    def step_as_one(
        self, entries: Sequence[tuple[int, Sequence[Tensor], Sequence[Tensor | None]]]
    ) -> bool:
        """Step models ``j`` with their ``params`` and this backward's ``grads`` (``entries``)
        as one, drop the gradients; False, nothing changed, where their optimizers cannot
        (NOTE [ One step over a chunk's small models ])."""
        if self._shared_counts:  # a stacked model's step count: its own step separates it
            return False
        return self.holding((j for j, _, _ in entries), lambda: self._step_as_one(entries))

    def holding(self, js: Iterable[int], run: Callable[[], T]) -> T:
        """``run()`` holding the step locks of models ``js`` (NOTE [ Steps of one model in
        several threads ]), taken in one order for every StepInBackward (by the locks' ids,
        which are the same while they live): no two threads wait on each other."""
        locks = {id(lock): lock for lock in map(self._step_locks.__getitem__, js)}
        return run_holding([locks[k] for k in sorted(locks)], run)

    def _step_as_one(
        self, entries: Sequence[tuple[int, Sequence[Tensor], Sequence[Tensor | None]]]
    ) -> bool:
        optimizers: list[Any] = [self.optimizers[j] for j, _, _ in entries]
        hyper = _agreeing(optimizers, [ps for _, ps, _ in entries])
        if hyper is None:
            return False
        every_grad = itertools.chain.from_iterable(gs for _, _, gs in entries)
        if any(map(operator.is_, every_grad, itertools.repeat(None))):
            return False
        every_param = itertools.chain.from_iterable(ps for _, ps, _ in entries)
        if any(map(operator.is_not, map(_grad_of, every_param), itertools.repeat(None))):
            return False  # a .grad to add to: each model's own step adds it
        first = optimizers[0]
        key = tuple(j for j, _, _ in entries)
        merged = self._merged.get(key)
        params = [p for _, ps, _ in entries for p in ps]
        if merged is None or not _are(merged.param_groups[0]["params"], params):
            if len(self._merged) >= 64:  # chunks of other shapes or orders: keep few
                self._merged.clear()
            merged = self._merged[key] = _optimizer_over(first, params)
        merged.param_groups[0].update(hyper)
        merged.state = _SharedState(optimizers, [ps for _, ps, _ in entries])
        for p, g in zip(params, (g for _, _, gs in entries for g in gs)):
            p.grad = g
        looped = _loops_over_tensors(merged, params)
        try:
            merged.step()
        finally:
            for p in params:
                p.grad = None
            _loop_again(looped)
            # Between steps it holds no model's state, in a plain dict (copied and pickled
            # with the StepInBackward).
            merged.state = collections.defaultdict(dict)
        _count_steps(optimizers)
        self._stepped.update(map(id, params))
        return True


def not_stepped(where: str, i: int, model: Any, name: str) -> ParsumError:
    """The error for parameter ``name`` of ``models[i]`` that needs a gradient where the
    model's optimizer does not step it: its gradient would be dropped."""
    return ParsumError(
        f"{where}: parameter {name!r} of models[{i}] ({type(model).__name__}) needs a "
        "gradient, but its optimizer in step_in_backward does not step it (a parameter "
        "assigned or unfrozen since the StepInBackward was made), so step_in_backward would "
        "drop its gradient: make the StepInBackward again, or add the parameter to the "
        "optimizer (add_param_group)"
    )


def stepped_twice(where: str, which: str, model: Any, ran: bool) -> ParsumError:
    """The error for a model that a second call's backward would step in the same backward
    (NOTE [ One step a backward ]); ``ran``: whether the other call steps inside its backward."""
    return ParsumError(
        f"{where}: {which} ({type(model).__name__}) is stepped in this backward by the "
        "step_in_backward of another sum_models call that the loss holds too (micro-batches "
        "summed before one backward), each with its own call's gradient alone, where plain "
        "training steps once a backward"
        + ("; the other call's steps may have run" if ran else "; no step ran")
        + ". Call backward() on each call's loss in turn, or leave step_in_backward out and "
        "step an optimizer after the backward"
    )


class _SharedState(collections.defaultdict):
    """A merged optimizer's state: each parameter's entry is its own optimizer's, made there
    when missing (NOTE [ One step over a chunk's small models ])."""

    def __init__(self, optimizers: Sequence[Any], params: Sequence[Sequence[Tensor]]) -> None:
        super().__init__(dict)
        self._owner = {id(p): opt for opt, ps in zip(optimizers, params) for p in ps}

    def __missing__(self, p: Tensor) -> dict:
        entry = self._owner[id(p)].state[p]
        self[p] = entry
        return entry


def _agreeing(
    optimizers: Sequence[torch.optim.Optimizer | None], params: Sequence[Sequence[Tensor]]
) -> dict[str, Any] | None:
    """The settings shared by ``optimizers`` (each over ``params[k]`` alone, in one group) where
    one optimizer over all their parameters steps them as each would (NOTE [ One step over a
    chunk's small models ]); None where it would not. Read with few Python steps a model, for
    the steps as one and the stacked steps alike (64 tiny models' optimizers: 0.23 ms in
    place, of a 12 ms step)."""
    first = optimizers[0]
    kind = type(first)
    if first is None or kind not in _STACKABLE or _global_step_hooks():
        return None
    if not all(map(operator.is_, map(type, optimizers), itertools.repeat(kind))):
        return None
    opts = cast(list[torch.optim.Optimizer], list(optimizers))  # no None: of one class
    groups = list(map(_param_groups, opts))
    if not all(map(operator.eq, map(len, groups), itertools.repeat(1))):
        return None
    groups = list(map(operator.itemgetter(0), groups))
    hyper = {k: v for k, v in groups[0].items() if k != "params"}
    if not all(map(operator.eq, map(len, groups), itertools.repeat(len(hyper) + 1))):
        return None
    owned = list(map(operator.itemgetter("params"), groups))
    if list(map(len, owned)) != list(map(len, params)):
        return None
    if not all(
        map(
            operator.is_,
            itertools.chain.from_iterable(owned),
            itertools.chain.from_iterable(params),
        )
    ):
        return None
    try:
        settings = list(map(operator.itemgetter(*hyper), groups)) if hyper else []
    except KeyError:
        return None
    if len(hyper) == 1:  # itemgetter of one key gives the value, not a tuple
        settings = [(v,) for v in settings]
    for column, ref in zip(zip(*settings), hyper.values()):
        # The same objects (the optimizers were built from the same arguments), else equal
        # values (an LR scheduler's new float each step).
        same = map(operator.is_, column, itertools.repeat(ref))
        if not all(same) and not all(map(_same, column, itertools.repeat(ref))):
            return None
    if any(map(_pre_hooks, opts)) or any(map(_post_hooks, opts)):
        return None
    own_steps = any(map(operator.contains, map(vars, opts), itertools.repeat("step")))
    if own_steps and not all(map(_counts_only, opts)):
        return None
    return hyper


_param_groups = operator.attrgetter("param_groups")
_grad_of = operator.attrgetter("grad")
_pre_hooks = operator.attrgetter("_optimizer_step_pre_hooks")
_post_hooks = operator.attrgetter("_optimizer_step_post_hooks")


def _needs_closure(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step`` takes a closure without a default (LBFGS re-evaluates the loss)."""
    try:
        closure = inspect.signature(opt.step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read: let its step say so
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


# Whose foreach step gives the bits of its loop over the tensors (NOTE [ Steps over tensors in
# one call ]); a subclass may step otherwise.
_SAME_BITS_IN_ONE_CALL = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
_SAME_BITS_DTYPES = (torch.float32, torch.float64)  # float16 and bfloat16 steps differ


def _loops_over_tensors(opt: torch.optim.Optimizer, params: Sequence[Tensor]) -> list[dict]:
    """The groups of ``opt`` set to step their tensors in one call for its next step, where
    PyTorch's default would loop over them from Python (NOTE [ Steps over tensors in one
    call ]); ``_loop_again`` sets them back."""
    if type(opt) not in _SAME_BITS_IN_ONE_CALL:
        return []
    groups = opt.param_groups
    for group in groups:
        if (
            group.get("foreach", False) is not None
            or group.get("fused")
            or group.get("differentiable")
        ):
            return []
        # A tensor setting (lr=torch.tensor(0.01)) takes other kernels or is refused there.
        for key, value in group.items():
            if key != "params" and _holds_a_tensor(value):
                return []
    elements = 0
    for p in params:
        grad = p.grad
        if (
            p.device.type != "cpu"
            or p.dtype not in _SAME_BITS_DTYPES
            or (grad is not None and grad.is_sparse)
        ):
            return []
        elements += p.numel()
    if elements > MERGED_STEP_ELEMENTS:
        return []
    for group in groups:
        group["foreach"] = True
    return groups


def _holds_a_tensor(value: Any) -> bool:
    """Whether a setting is a tensor or a tuple holding one (``betas``)."""
    if isinstance(value, tuple):
        return any(map(_holds_a_tensor, value))
    return isinstance(value, Tensor)


def _loop_again(groups: list[dict]) -> None:
    """``groups`` back to PyTorch's default after a step in one call."""
    for group in groups:
        group["foreach"] = None


def _counts_only(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step`` is its class's, or an LR scheduler's wrapper of it, which only
    records the call (``_count_steps`` does that instead)."""
    own = vars(opt).get("step")
    return own is None or getattr(own, "_wrapped_by_lr_sched", False)


def _count_steps(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """What an LR scheduler's wrapper of ``step`` records, for optimizers stepped through
    another: its scheduler otherwise warns that it stepped before its optimizer."""
    for opt in optimizers:
        if "step" in vars(opt):
            opt._opt_called = True  # type: ignore[attr-defined]


def _are(tensors: Sequence[Tensor], others: Sequence[Tensor]) -> bool:
    """Whether two lists hold the same tensors (identity), in the same order."""
    return len(tensors) == len(others) and all(map(operator.is_, tensors, others))


def _same(a: Any, b: Any) -> bool:
    """Whether two settings are equal, comparing tensors (and all but plain values) by
    identity: ``==`` on tensors answers with a tensor."""
    if a is b:
        return True
    if type(a) is tuple and type(b) is tuple:
        return len(a) == len(b) and all(map(_same, a, b))
    return type(a) in _PLAIN_SETTINGS and type(a) is type(b) and a == b


_PLAIN_SETTINGS = (int, float, bool, str, type(None))
# Where torch.optim keeps the step hooks registered for every optimizer (``torch.optim`` does
# not keep the module as an attribute).
_OPTIMIZER_MODULE = importlib.import_module("torch.optim.optimizer")


def _global_step_hooks() -> bool:
    """Whether a step hook is registered for every optimizer (or whether this torch keeps
    them where parsum does not look)."""
    module = _OPTIMIZER_MODULE
    pre = getattr(module, "_global_optimizer_pre_hooks", None)
    post = getattr(module, "_global_optimizer_post_hooks", None)
    return pre is None or post is None or bool(pre) or bool(post)


# NOTE [ One step over stacked models ]
# Over stacked models (``parsum.stack_``), the models' optimizers are stepped as one where that
# gives what each would: the same class (SGD, Adam or AdamW, whose update is per element), one
# parameter group each over its model's parameters in the stack's order, equal hyperparameters
# (an LR scheduler that moves one optimizer alone ends it), states of one kind, and no step
# hook nor ``step`` of an optimizer's own but an LR scheduler's counting wrapper, whose count is
# kept (NOTE [ One step over a chunk's small models ]). One optimizer
# of that class over the stacked tensors steps them, its state the models' states stacked; each
# model's optimizer then holds views of those (a step count, a 0-dim tensor, is shared by the
# models until one of them steps alone: ``step`` gives it its own). A model's state replaced
# (``load_state_dict``) is gathered again. 64 tiny MLPs with Adam: 64 steps of 6 tensors each
# cost most of a step.
_STACKABLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


class _StackedStep:
    """The optimizer over one stack's tensors, and the state entries it gave the models."""

    def __init__(self, optimizer: torch.optim.Optimizer, installed: list[list[dict]]) -> None:
        self.optimizer = optimizer
        self.installed = installed  # [model][name]: the models' state dicts, as installed


def step_stacked(
    sib: StepInBackward,
    stack_key: int,
    order: Sequence[int],
    params: Sequence[Sequence[Tensor]],
    values: Sequence[Tensor],
    grads: Sequence[Tensor | None],
) -> bool:
    """Step models ``order[k]`` (whose parameters are ``params[n][k]``, slices of ``values[n]``)
    with the stacked gradients ``grads`` as one (NOTE [ One step over stacked models ]); False,
    nothing changed, where their optimizers cannot step as one."""
    optimizers: list[Any] = [sib.optimizers[j] for j in order]
    hyper = _agreeing(optimizers, list(zip(*params)))  # each model's parameters
    if hyper is None:
        return False
    first = optimizers[0]
    stacked = sib._stacked.get(stack_key)
    installed = stacked is not None and _still_installed(stacked, optimizers, params)
    if stacked is None or not installed:
        state = _gathered(optimizers, params, values)
        if state is None:
            return False
        stacked = sib._stacked[stack_key] = _StackedStep(_optimizer_over(first, values), [])
        stacked.optimizer.state.clear()
        for v, entry in zip(values, state):
            if entry:
                stacked.optimizer.state[v] = entry
    optimizer = stacked.optimizer
    optimizer.param_groups[0].update(hyper)
    # The models' views stay good while the step updates the stacked state in place.
    before = [list(map(id, optimizer.state.get(v, {}).values())) for v in values]
    held = [v.grad for v in values]  # an optimizer over stack.parameters() may hold them
    for v, g in zip(values, grads):
        v.grad = g
    try:
        optimizer.step()
    finally:
        for v, g in zip(values, held):
            v.grad = g
    _count_steps(optimizers)
    if installed and before == [list(map(id, optimizer.state.get(v, {}).values())) for v in values]:
        return True
    # Each model's state: views of the stacked state (installed once, checked after).
    views: list[list[dict]] = []
    for k, opt in enumerate(optimizers):
        per_name = []
        for n, v in enumerate(values):
            found: dict[str, Any] = optimizer.state.get(v) or {}
            if not found:
                per_name.append(opt.state.get(params[n][k], _NO_STATE))
                continue
            mine = {}
            for key, value in found.items():
                if isinstance(value, Tensor) and value.dim() == v.dim():
                    mine[key] = value[k]
                else:
                    mine[key] = value
                    if isinstance(value, Tensor):
                        sib._shared_counts.add(id(value))
            opt.state[params[n][k]] = mine
            per_name.append(mine)
        views.append(per_name)
    stacked.installed = views
    return True


def _optimizer_over(like: torch.optim.Optimizer, values: Sequence[Tensor]) -> torch.optim.Optimizer:
    """An optimizer of ``like``'s class and settings (``foreach``, ``fused``, ...) over the
    stacked tensors; the group's values are set again at each step from the models'."""
    cls: Any = type(like)
    group = like.param_groups[0]
    accepted = inspect.signature(cls.__init__).parameters  # defaults may hold more
    return cls(list(values), **{k: group[k] for k in accepted if k in group and k != "params"})


def _still_installed(
    stacked: _StackedStep, optimizers: Sequence[torch.optim.Optimizer], params: Sequence
) -> bool:
    """Whether every model's state is still the one the last stacked step gave it (or none
    still, where it gave none: read as changed, an optimizer without state, SGD without
    momentum, was made and its state gathered anew on every step, 0.2 ms of 64 tiny models'
    1.2 ms step). Read with few Python steps a model (49 us in place, 61 one entry at a
    time)."""
    installed = stacked.installed
    if len(installed) != len(optimizers):
        return False
    names = len(params)
    states = map(_state_of, optimizers)
    each_entry = itertools.chain.from_iterable(
        map(itertools.repeat, states, itertools.repeat(names))
    )
    mine = itertools.chain.from_iterable(zip(*params))  # model by model, name by name
    found = map(dict.get, each_entry, mine, itertools.repeat(_NO_STATE))
    return all(map(operator.is_, found, itertools.chain.from_iterable(installed)))


# The entry a stacked step records where a model has no state yet (compared by identity,
# never written).
_NO_STATE: dict = {}
_state_of = operator.attrgetter("state")


def _gathered(
    optimizers: Sequence[torch.optim.Optimizer],
    params: Sequence[Sequence[Tensor]],
    values: Sequence[Tensor],
) -> list[dict[str, Any]] | None:
    """The models' states stacked, name by name (empty where none has one yet); None where
    they differ in kind or in step count."""
    state: list[dict[str, Any]] = []
    for n in range(len(values)):
        entries = [opt.state.get(params[n][k], {}) for k, opt in enumerate(optimizers)]
        keys = set(entries[0])
        if any(set(e) != keys for e in entries):
            return None
        stacked: dict[str, Any] = {}
        for key in keys:
            found = [e[key] for e in entries]
            if isinstance(found[0], Tensor) and found[0].shape == params[n][0].shape:
                stacked[key] = torch.stack([t.detach() for t in found])
            elif isinstance(found[0], Tensor):
                if any(not torch.equal(t, found[0]) for t in found):
                    return None
                stacked[key] = found[0].clone()
            elif any(f != found[0] for f in found):
                return None
            else:
                stacked[key] = found[0]
        state.append(stacked)
    return state


def _no_gradient_after_step(
    sib_ref: weakref.ref[StepInBackward], i: int, name: str, param: Tensor
) -> None:
    """Raise when a gradient reaches a parameter after its fused step in the same backward
    (NOTE [ Gradients from outside the sum ])."""
    if param.grad is None:  # the usual case, first: called for every parameter, every backward
        return
    sib = sib_ref()
    if sib is None or id(param) not in sib._stepped:
        return
    # NOTE [ Steps of one model in several threads ]: not while another thread's step of this
    # model holds the .grad it set (taken away, its optimizer met None)
    with sib._step_locks[i]:
        if param.grad is None:
            return
        param.grad = None
    model = sib.models[i]
    raise ParsumError(
        f"{_WHERE}: parameter {name!r} of models[{i}] ({type(model).__name__}) got a gradient "
        "from outside sum_models in the same backward (a term of the loss on the parameter "
        "itself, such as an L2 penalty) after its optimizer step had run without it; the "
        "steps of this backward already ran. Put the term into the model's output, use the "
        "optimizer's weight_decay for an L2 penalty, or train this model without "
        "step_in_backward"
    )
