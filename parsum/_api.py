"""sum_models: checks the arguments, collects the parameters, picks the engine."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import numbers
from collections.abc import Callable, Hashable, Sequence
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor, nn
from torch.autograd import forward_ad
from torch.utils import _pytree as pytree

from . import _config, _pool
from ._engines import (
    COMPILED_MODULES,
    GLOBAL_BACKWARD_HOOKS,
    CallArgs,
    ModelParams,
    Unit,
    direct_calls_allowed,
    global_hooks_reach_state,
    model_kind,
    module_of,
    runs_as_program,
    shared_state,
    vmap_failure_count,
)
from ._errors import ParsumError, a_kind_of
from ._function import (
    ParallelSum,
    PendingJoin,
    SumPlan,
    direct_apply,
    join_input,
    may_join_later,
    reports_failures,
    run_forward,
    weight_held_back,
)
from ._fused import StepInBackward, not_stepped
from ._grads import check_slots, has_compensated_flat_grads
from ._grouping import (
    Batch,
    auto_min_group,
    chunk_costs,
    chunk_limit,
    chunks_of,
    costliest_first,
    estimate,
    estimated_costs,
    intra_op_only,
    module_calls_watched,
    plan_units,
    small_last_chunk,
    stepping_chunks,
    storage_stack_limit,
    thread_chunks,
    too_small_for_workers,
    useful_forward_workers,
    useful_workers,
)
from ._inline import fits_callers_graph, sum_in_callers_graph
from ._pace import Pace
from ._plain_graph import plain_graph_pays, sum_in_plain_graph
from ._plans import (
    Derived,
    Walk,
    keep_walk,
    known_walk,
    models_found,
    remember_derived,
    stripped,
)
from ._random import (
    draws_only_dropout,
    has_drawing_layers,
    held_generators,
    idle_dropout,
    is_generator,
    layers_that_may_draw,
    noise_key,
)
from ._sparse import has_user_hooks
from ._stack import (
    ONE_BY_ONE,
    StackedForwardFailed,
    group_in_callers_graph,
    stack_for,
    stacked_sum,
    wanted_stacks_among,
)
from ._transformed import sum_in_transform

_WHERE = "sum_models"


# torch.compile around code that calls sum_models leaves the call eager (a graph break): its
# pool, threads and custom Function are nothing dynamo can trace, and tracing into them took
# 16 s for two linear models, with warnings, for no gain. The decorator imports torch._dynamo
# (0.8 s here, once), which building any torch.optim optimizer imports anyway.
@torch.compiler.disable
def sum_models(
    models: Sequence[Callable[..., Any]],
    *args: Any,
    weights: Sequence[float] | Tensor | None = None,
    n_jobs: int | None = None,
    engine: str = "auto",
    chunk_size: int | None = None,
    step_in_backward: StepInBackward | None = None,
    **kwargs: Any,
) -> Any:
    """``sum(w_i * models[i](*args, **kwargs))``, its forward and backward run in parallel.

    The per-model forwards run on parsum's thread pool, and so do the per-model pullbacks when
    the result is differentiated. Outputs, input gradients and gradients of parameters shared
    by several models are reduced with a compensated sum (a float64 accumulator for float32
    and narrower, Kahan-Babuska-Neumaier for float64) in a fixed order: more accurate than the
    plain sum, and bitwise identical for any ``n_jobs``. Inside a ``torch.func`` transform
    (``grad``, ``vmap``, ``jacrev``, ...) or with forward-mode tangents, the models run in the
    calling thread and their sum, compensated alike, in operations the transform sees.

    >>> import torch, parsum
    >>> models = [torch.nn.Linear(4, 2), torch.nn.Sequential(torch.nn.Linear(4, 8),
    ...           torch.nn.Tanh(), torch.nn.Linear(8, 2))]
    >>> x = torch.randn(16, 4, requires_grad=True)
    >>> y = parsum.sum_models(models, x, weights=[0.5, 0.5])   # the ensemble's average
    >>> y.shape
    torch.Size([16, 2])
    >>> y.pow(2).mean().backward()       # gradients reach x and every model's parameters
    >>> x.grad.shape, models[0].weight.grad.shape
    (torch.Size([16, 4]), torch.Size([2, 4]))

    Args:
        models: non-empty sequence of callables, normally ``nn.Module``s whose architectures
            may differ. A module may appear more than once (it then counts more than once).
            A bound method of a module (``m.encode``) or a ``functools.partial`` trains that
            module's parameters and the tensors it holds; another callable is differentiated
            with respect to its arguments only. A model whose graph reaches a tensor that needs
            a gradient and that it neither holds nor was passed raises (a leaf it makes from an
            argument's data, ``x.detach().requires_grad_()``, is its own).
        *args: passed to every model. Tensors among them, also nested in tuples, lists and
            dicts, get gradients.
        weights: optional sequence of floats (a 1-D numpy array too) or of 0-dim tensors, or
            a 1-D tensor, of length ``len(models)``; a tensor that requires grad gets
            ``dL/dw_i = <dL/dy, models[i](x)>`` (for complex outputs, PyTorch's convention
            for ``w_i * models[i](x)``; a complex tensor needs complex outputs).
        n_jobs: threads, joblib's convention: ``None`` takes ``parsum.config``, then
            ``joblib.parallel_config``, else the thread budget (``torch.get_num_threads()``
            capped by the usable cores: under torchrun, each process's share); -1 the whole
            budget, -2 all of it but one; 1 runs in the calling thread with no pool. Never
            more threads than usable cores. Left unset, parsum spends the budget on workers
            only where they pay (small models run in the calling thread), whatever the
            engine. Intra-op threads per task are the budget over the chunks, never decided
            by ``n_jobs``.
        engine: ``"autograd"`` (each model's own autograd graph), ``"vjp"``
            (``torch.func.vjp`` over ``functional_call``; pure models only), ``"stacked"``
            (structurally identical models vmapped as one group, the others by autograd) or
            ``"auto"`` (``parsum.config``'s engine if set, else: groups of small identical
            models stacked, 4 or more MLPs (on one thread, 5 or more of two Linear layers,
            9 of one) or 8 or more of other kinds, the rest by
            autograd).
        chunk_size: models per task; with the models' shapes and the batch rows it decides
            the order of additions (outputs small enough are added all at once at the end, in
            the chunks' order), never ``n_jobs``. Default: chunks of about equal estimated
            cost (parameters times batch rows, plus a per-model overhead), 16 at most and,
            on a budget of fewer than 8 threads, as many between 16 and two a thread as
            the estimate runs fastest; with ``step_in_backward``, two a thread of the
            budget, more where one would hold over 1M parameter elements.
        step_in_backward: a :class:`parsum.StepInBackward` over these models: in backward,
            each model's optimizer steps in the worker right after the model's pullback, and
            its gradients are dropped instead of stored (``.grad`` stays None).
        **kwargs: passed to every model, like ``args``.

    Returns:
        The sum, with the structure of one model's output (a tensor or a pytree of tensors).

    Raises:
        ParsumError: for bad arguments, outputs that differ in structure, shape, dtype or
            device (naming the first model that differs), or a model that raised (naming its
            index and type, with the original exception chained). A failed call changes no
            ``.grad`` and restores the buffers of modules in training mode.
    """
    _pool.abandon_unjoined()  # NOTE [ Interrupted callers ] in _pool
    models = _check_models(models)
    settings = _config.current_settings()
    engine = _config.check_engine(engine, _WHERE)
    if engine == "auto":
        engine = settings.engine or "auto"
    if engine == "auto" and torch.is_grad_enabled() and _pool.saved_tensor_hooks_active():
        engine = "autograd"  # NOTE [ Saved-tensor hooks ] in _pool: nothing stacked
    chunk_size = _config.check_chunk_size(chunk_size, _WHERE) or settings.chunk_size
    n_workers = _config.resolve_n_jobs(n_jobs, _WHERE)
    weight_list, weight_tensor = _check_weights(weights, len(models))

    call = CallArgs.flatten(args, kwargs)
    _check_hidden_tensors(call)
    _check_nested_tensors(call)
    if torch._C._are_functorch_transforms_active() or (
        _dual_level() >= 0 and _tangent_carrier(models, call, weight_tensor) is not None
    ):  # NOTE [ Inside a transform ] in _transformed; NOTE [ Forward-mode AD ]
        return sum_in_transform(_WHERE, models, call, weight_list, weight_tensor, step_in_backward)
    general = functools.partial(
        _general_sum, models, call, weight_list, weight_tensor, n_jobs, n_workers, engine,
        chunk_size,
    )  # fmt: skip
    if not reports_failures():
        stack = stack_for(models)
        if stack is not None and step_in_backward is not None:
            # Stacked, with each model's optimizer stepped when the backward ends; a model
            # the StepInBackward lacks goes the general way, which names it.
            if not isinstance(step_in_backward, StepInBackward) or any(
                step_in_backward.index(m) is None for m in models
            ):
                stack = None
            else:
                step_in_backward._stepped.clear()  # a new step begins
        if stack is not None:
            # NOTE [ Stacked storage ] in _stack. Models run one by one (too few for auto to
            # batch, or engine "autograd" or "vjp") still have their gradients gathered where
            # an optimizer over the stack needs them.
            limit: int | None = None
            if engine == "auto":
                batched = runs_as_program(stack.program, args, kwargs)
                few = len(models) < auto_min_group(batched)
                device = next(iter(stack.values.values())).device
                budget = _config.thread_budget()
                limit = 0 if few else storage_stack_limit(device, budget, batched)
            elif engine != "stacked":
                limit = 0
            if weight_tensor is not None and weight_tensor.is_complex():
                limit = 0  # the general way, which checks the outputs' dtypes first
            try:
                out = stacked_sum(stack, call, weight_list, weight_tensor, limit, step_in_backward)
            except StackedForwardFailed as failed:
                # One by one: raises naming the model if the call itself is bad; if it
                # succeeds, the batched forward is what failed, and is not tried again.
                out = general(step_in_backward)
                stack.give_up(f"its batched forward raised {failed.__cause__!r:.200}")
                return out
            if out is ONE_BY_ONE:
                out = general(step_in_backward)
                if step_in_backward is None:  # else the gradients are stepped and dropped
                    stack.attach_at_backward(out)
                return out
            if out is not None:
                return out
    out = general(step_in_backward)
    if step_in_backward is None and torch.is_grad_enabled():
        for stack in wanted_stacks_among(models):  # some of a stack's models, or reordered
            stack.attach_at_backward(out)
    return out


def _general_sum(
    models: list[Callable[..., Any]],
    call: CallArgs,
    weight_list: list[float] | None,
    weight_tensor: Tensor | None,
    n_jobs: int | None,
    n_workers: int,
    engine: str,
    chunk_size: int | None,
    step_in_backward: StepInBackward | None,
) -> Any:
    """``sum_models`` through ``ParallelSum``, for any models, once the arguments are checked."""
    tensors = [call.leaves[j] for j in call.tensor_positions]
    walk = known_walk(models)  # NOTE [ Reused plans ] in _plans
    found = None  # this call's walk, modules included
    if walk is None:
        # NOTE [ Models planned one by one ] in _plans
        found, joined = models_found(models)
        _check_initialized(models, found)
        params, slots, shared = _collect_params(found)
        # NOTE [ Stale slots ] in _grads
        check_slots(models, [mp.names for mp in found], [mp.tensors for mp in found])
        findings = joined.model_params if joined is not None else stripped(found)
        walk = Walk(findings, params, slots, shared, _forward_in_order(found))
        kept = keep_walk(models, found, walk, joined)
        if not kept:
            # NOTE [ State the models share ] in _engines: a walk made for one call learns
            # nothing, so every call is its first: models that share state run their forwards
            # in model order and their pullbacks last first.
            sharing = shared_state(found)
            walk.writes_shared = walk.pullbacks_write_shared = bool(
                sharing.named or sharing.reached
            )
        may_draw = layers_that_may_draw([m for mp in found for m in mp.modules])
        # NOTE [ Random numbers in forwards ] in _random: layers that draw say so, whatever
        # the last walk over these models learned (their p may have changed from 0).
        if has_drawing_layers(may_draw):
            walk.draws_random = True
        elif walk.draws_random is None and (
            not kept or walk.all_quiet(models)  # NOTE [ Models seen not to draw ] in _random
        ):
            walk.draws_random = False
        # NOTE [ Dropout drawn beforehand ] in _random
        walk.predraws = kept and None not in walk.programs and draws_only_dropout(may_draw)
        idle = idle_dropout(may_draw) if kept else []
        if idle:
            walk._watch_settings(idle)  # a p changed from 0: a new walk, which sees them draw
    model_params, params = walk.model_params, walk.params
    if engine == "vjp":
        _check_vjp_models(models, model_params)
    step_index = _check_step_in_backward(step_in_backward, models, model_params)
    batch = Batch.of(tensors)
    # NOTE [ Threads that pay ] in _grouping: with n_jobs left unset, the budget and the
    # models' sizes decide the chunks and the workers, whatever the engine.
    chosen = _config.n_jobs_is_default(n_jobs)
    budget = _config.thread_budget()
    on_device = _on_a_device(tensors, params)
    stepping = step_in_backward is not None
    # The GIL's state too: a free-threaded build enables it when a module that needs it is
    # imported (NOTE [ Threads without the GIL ] in _grouping).
    gil = _config.gil_enabled()
    # Whether a gradient of the arguments or the weights is wanted (NOTE [ Known layers on
    # one thread ] in _plain_graph)
    differentiable_args = weight_tensor is not None or any(t.requires_grad for t in tensors)
    # NOTE [ Small groups in a forward alone ] in _grouping
    forward_only = not torch.is_grad_enabled()
    key = (
        engine,
        batch,
        chunk_size,
        chosen,
        budget,
        on_device,
        stepping,
        gil,
        vmap_failure_count(),
        differentiable_args,
        forward_only,
        module_calls_watched(),  # NOTE [ Global module hooks and stacked groups ] in _grouping
    )
    derived = walk.derived.get(key)
    if derived is None:
        # Keys kept by the models' own walks only where their records were just checked
        # (NOTE [ Structure keys kept by models' own walks ] in _plans).
        key_of = _keys_of(walk, found) if found is not None else None
        found = found or [ModelParams.of(m) for m in models]
        units = plan_units(models, found, engine, batch, chunk_size, budget, key_of, forward_only)
        costs = estimated_costs(found, batch)  # read by each choice below
        chunks = chunks_of(units, found, batch, chunk_size, costs=costs)
        order = costliest_first(units, chunks, found, batch, costs)
        claim_order: tuple[int, ...] | None = order
        # One chunk with the budget's intra-op threads; a budget of 1 keeps the chunks an
        # explicit n_jobs has: one thread either way, and then the same bits (NOTE [ Threads
        # that pay ] in _grouping).
        if (
            chosen
            and chunk_size is None
            and (
                on_device
                or intra_op_only(found, batch, budget, units, chunks, order, stepping)
                or plain_graph_pays(walk, found, batch, budget, tensors, weight_tensor, stepping)
            )
        ):
            chunks, claim_order = chunks_of(units, found, batch, chunk_size, 1), None
        elif stepping and chunk_size is None:
            # NOTE [ Chunks of models that step ] in _grouping
            chunks = stepping_chunks(units, found, costs, budget, chunks)
            order = claim_order = costliest_first(units, chunks, found, batch, costs)
        elif chunk_size is None and len(chunks) > chunk_limit(budget):
            # NOTE [ Chunks a thread ] in _grouping: decided on MAX_CHUNKS's chunks above, as
            # measured, run in fewer
            chunks = thread_chunks(units, found, batch, costs, budget)
            order = claim_order = costliest_first(units, chunks, found, batch, costs)
        workers = useful_workers(found, batch, budget) if chosen else n_workers
        forward_workers = useful_forward_workers(found, batch, workers) if chosen else workers
        last = claim_order is not None and small_last_chunk(
            units, chunks, found, batch, order, costs
        )
        run_costs = None
        if too_small_for_workers(found, batch):
            run_costs = tuple(chunk_costs(units, chunks, found, batch, costs))
        # NOTE [ Workers that stop paying ] in _pace: for calls a backward follows, and for
        # forwards alone
        pace = (Pace(), Pace()) if chosen and workers > 1 and len(chunks) >= budget else None
        derived = Derived(
            units, chunks, workers, forward_workers, claim_order, last, run_costs, pace
        )
        remember_derived(walk, key, derived, found)
    units, chunks = derived.units, derived.chunks
    if chosen:
        n_workers = 1 if on_device else min(n_workers, derived.workers)
    if n_workers > 1 and torch.is_grad_enabled() and _pool.saved_tensor_hooks_active():
        n_workers = 1  # NOTE [ Saved-tensor hooks ] in _pool
    differentiable = [*tensors, *([weight_tensor] if weight_tensor is not None else [])]
    build_graph = torch.is_grad_enabled() and (
        bool(params) or any(t.requires_grad for t in differentiable)
    )
    if build_graph and not _pool.in_a_task():  # a nested call in a chunk is its caller's
        walk.trainers.several(True)  # NOTE [ Parameters trained in several threads ] in _grads
    # NOTE [ Workers that stop paying ] in _pace
    paced = None if derived.pace is None else derived.pace[0 if build_graph else 1]
    if chosen and n_workers > 1 and paced is not None and not paced.choose():
        n_workers = 1
    # NOTE [ Forwards on fewer workers ] in _grouping: where parsum chooses them
    forward_workers = min(n_workers, derived.forward_workers) if chosen else n_workers
    # NOTE [ Dropout drawn beforehand ] in _random: the forwards on the threads once the
    # noise's shapes are known at this input.
    drawn_key = None
    if walk.predraws and _draws_beforehand(walk, units, call, tensors):
        drawn_key = noise_key(tensors[0])
    predraw = drawn_key is not None and drawn_key in walk.noise_shapes
    # NOTE [ State the models share ] in _engines: while registered, in model order
    global_hooks_reach = global_hooks_reach_state()
    in_model_order = (
        walk.forward_in_order
        or walk.modifies_args  # NOTE [ Arguments modified in place ] in _function
        # NOTE [ State the models share ] in _engines: the first call learns
        or walk.writes_shared
        or (walk.writes_shared is None and walk.shares_state())
        or global_hooks_reach
        or (walk.draws_random is not False and not predraw)
        # NOTE [ Generators the models hold ] in _random: one passed to every model
        or (call.spec is not None and any(map(is_generator, call.leaves)))
    )
    # NOTE [ Pullbacks that write shared state ] in _function: the first backward learns
    looks_at_pullbacks = walk.kept and walk.shares_state() and not walk.pullbacks_write_shared
    ordered_pullbacks = (
        bool(walk.pullbacks_write_shared)
        or (walk.pullbacks_write_shared is None and looks_at_pullbacks)
        # a global forward hook too: it may register tensor hooks (ModuleTracker's)
        or global_hooks_reach
        or global_hooks_reach_state(GLOBAL_BACKWARD_HOOKS)
    )
    plan = SumPlan(
        models=models,
        call=call,
        weights=weight_list,
        has_weight_tensor=weight_tensor is not None,
        params=params,
        model_params=model_params,
        param_slots=walk.slots,
        shared=walk.shared,
        engine=engine,
        units=units,
        chunks=chunks,
        claim_order=derived.order,
        callers_last=derived.callers_last,
        n_workers=n_workers,
        # NOTE [ Random numbers in forwards ] in _random
        forward_workers=1 if in_model_order else forward_workers,
        noise_key=drawn_key,
        predraw=predraw,
        step_in_backward=step_in_backward,
        step_index=step_index,
        walk=walk,
        ordered_pullbacks=ordered_pullbacks,
        looks_at_pullbacks=looks_at_pullbacks,
        run_costs=derived.run_costs,
    )
    if _one_stacked_group(plan) and not (weight_tensor is not None and weight_tensor.is_complex()):
        try:
            stacked = cast(list[nn.Module], models)  # a stacked group holds modules
            group = plan.units[0].models
            out = group_in_callers_graph(
                stacked,
                plan.model_params,
                call,
                weight_list,
                weight_tensor,
                lambda k, exc: plan.model_error(group[k], "backward", exc),
            )
        except Exception:
            pass  # the general way runs them again, and names the model that fails
        else:
            return out
    in_callers_graph = build_graph and fits_callers_graph(plan)
    # NOTE [ Known layers in a plain graph ] in _plain_graph; with no graph, NOTE [ Known layers
    # with no graph ] there
    if in_callers_graph or (forward_only and fits_callers_graph(plan)):
        summed = sum_in_plain_graph(plan, call, weight_list, weight_tensor)
        if summed is not None:
            return summed
    if in_callers_graph:
        # NOTE [ The caller's graph ]
        leaves = sum_in_callers_graph(plan, call, weight_tensor)
    elif build_graph:
        inputs = [*tensors, *([weight_tensor] if weight_tensor is not None else [])]
        n_unwrapped = 1 + len(inputs)  # NOTE [ Applying a Function with many inputs ] in _function
        # NOTE [ Weights' gradients held back by the join ] in _inline
        held = weight_held_back(weight_tensor)
        if _joins_later(plan, [t for t in differentiable if t is not held]):
            # NOTE [ Pullbacks joined later ] in _function
            plan.join = PendingJoin()
            join = join_input(plan.join, held)  # made last before the node
            if join is None:
                plan.join = None
            else:
                inputs.append(join)
        leaves = list(direct_apply(ParallelSum, n_unwrapped, plan, *inputs, *params))
    else:
        leaves = run_forward(plan, call, weight_tensor, build_graph=False).leaves
    assert plan.out_spec is not None
    return pytree.tree_unflatten(leaves, plan.out_spec)


def _keys_of(walk: Walk, found: list[ModelParams]) -> Callable[[int], Hashable | None] | None:
    """Each model's structure key as its own walk keeps it, for a set planned from the models'
    own walks (NOTE [ Structure keys kept by models' own walks ] in _plans); else None."""
    parts = walk.parts
    if not parts:
        return None
    return lambda i: parts[i].own_structure_key(found[i])


def _draws_beforehand(walk: Walk, units: list[Unit], call: CallArgs, tensors: list[Tensor]) -> bool:
    """Whether this call's models, whose draws can be made beforehand, run as direct programs
    on the CPU here (NOTE [ Dropout drawn beforehand ] in _random)."""
    return (
        direct_calls_allowed(call)
        and tensors[0].device.type == "cpu"
        and all(unit.engine == "autograd" and len(unit.models) == 1 for unit in units)
        and walk.no_user_tensor_hooks()
    )


def _joins_later(plan: SumPlan, differentiable: list[Tensor]) -> bool:
    """Whether a ParallelSum node may hand its pullbacks over and be joined later: no
    gradient it returns could depend on them (NOTE [ Pullbacks joined later ] in _function;
    the rest is known in backward)."""
    return (
        plan.step_in_backward is None
        and not any(plan.shared)
        and may_join_later(plan, differentiable)
    )


def _one_stacked_group(plan: SumPlan) -> bool:
    """Whether one stacked group holds every model, and the call can run it in the caller's
    graph (NOTE [ One group in the caller's graph ] in _stack)."""
    units = plan.units
    return (
        len(units) == 1
        and units[0].engine == "stacked"
        and len(units[0].models) > 1
        and plan.step_in_backward is None
        and not reports_failures()
        and not has_compensated_flat_grads(plan.params)
        # NOTE [ Backward passes in several threads ] in _grads: autograd's accumulation
        # into a FlatGrad's parameters from two threads lost gradients, and crashed
        and not plan.walk.slots_in_flat_grads.used_by_threads(_pool.in_a_task())
    )


def _on_a_device(tensors: list[Tensor], params: list[Tensor]) -> bool:
    """Whether the call computes on a GPU (its first tensor argument or parameter is not on the
    CPU). There a model's CPU time is kernel launches, which the GIL serializes, and backward
    runs on the device's thread anyway (NOTE [ Device threads ]): n_jobs unset runs such
    calls in the calling thread, as the plain loop does: 0.85-0.88x the plain loop on 16 medium
    MLPs and 0.82-0.86x on 8 small CNNs on an H200 (2026-12-04), where those models
    split by hand over 2-4 threads reached 1.06-1.09x and 0.96-1.00x; whether parsum's workers
    reach that too is measured by ``benchmarks/run_16cores.sh gputhreads``, not yet run.
    """
    first = tensors[0] if tensors else (params[0] if params else None)
    return first is not None and first.device.type != "cpu"


def _check_models(models: Any) -> list[Callable[..., Any]]:
    models = _config.check_model_sequence(models, _WHERE, (nn.ModuleList, nn.Sequential))
    for i, model in enumerate(models):
        if not callable(model):
            raise ParsumError(
                f"{_WHERE}: models[{i}] is {a_kind_of(model)} ({model!r:.60}), which is "
                "not callable; expected an nn.Module or another callable"
            )
    return models


def _check_hidden_tensors(call: CallArgs) -> None:
    """Refuse an argument that holds a tensor needing a gradient where parsum cannot see it (a
    dataclass, a plain object): the plain loop gives it a gradient, parsum would give none."""
    if call.spec is None:  # tensors and scalars only
        return
    for leaf in call.leaves:
        if isinstance(leaf, (Tensor, str, bytes, numbers.Number)) or leaf is None:
            continue
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found = {f.name: getattr(leaf, f.name, None) for f in dataclasses.fields(leaf)}
        else:
            found = getattr(leaf, "__dict__", None) or {}
        for name, value in found.items():
            if isinstance(value, Tensor) and value.requires_grad:
                raise ParsumError(
                    f"{_WHERE}: an argument is {a_kind_of(leaf)} whose {name!r} is a "
                    "tensor that requires grad; parsum gives gradients to the tensors it finds "
                    "in args and kwargs (also in tuples, lists, dicts and namedtuples), so "
                    "this one would get none: pass the tensor itself, or register the class "
                    "as a pytree node (torch.utils._pytree.register_dataclass)"
                )


def _check_nested_tensors(call: CallArgs) -> None:
    """Refuse a nested tensor argument (``torch.nested``) before any model runs: the plans'
    cost estimates read an argument's shape, which a nested tensor does not have, and the
    pullbacks and sums take dense tensors."""
    for j in call.tensor_positions:
        t = call.leaves[j]
        if t.is_nested:
            if call.spec is not None:
                which = "an argument"
            elif j < call.n_args:
                which = f"argument {j}"
            else:
                which = f"keyword argument {call.keywords[j - call.n_args]!r}"
            raise ParsumError(
                f"{_WHERE}: {which} is a nested tensor (torch.nested, layout {t.layout}, "
                f"{t.size(0)} components); parsum runs models on dense tensors: pass "
                "nt.to_padded_tensor(0.0) with a mask, or one call a component"
            )


# NOTE [ Forward-mode AD ]
# The forward runs the models on parsum's threads and sums their values, detached, in one
# node: a tangent that an argument, a weight or a parameter carries (``forward_ad.make_dual``)
# would be dropped, and the result would come back without one (the plain loop propagates it).
# A call where one does is run as inside a torch.func transform (NOTE [ Inside a transform ] in
# _transformed): the models in the calling thread, their sum in plain operations, which carry
# the tangents. Looked for only while a dual level is open, a read of one module attribute
# otherwise.


def _tangent_carrier(
    models: list[Callable[..., Any]], call: CallArgs, weight_tensor: Tensor | None
) -> str | None:
    """What carries a tangent first: an argument, the weights, or a model's tensor (a
    parameter, a buffer or a plain attribute), named; None if nothing does."""
    if any(_has_tangent(call.leaves[j]) for j in call.tensor_positions):
        return "an argument"
    if weight_tensor is not None and _has_tangent(weight_tensor):
        return "weights"
    for i, model in enumerate(models):
        module = module_of(model)
        if module is None:
            continue
        for prefix, inner in module.named_modules(remove_duplicate=False):
            own = vars(inner)
            tensors = [*own["_parameters"].items(), *own["_buffers"].items(), *own.items()]
            for name, t in tensors:
                if isinstance(t, Tensor) and _has_tangent(t):
                    name = f"{prefix}.{name}" if prefix else name
                    return f"{name!r} of models[{i}] ({model_kind(model)})"
    return None


def _dual_level() -> int:
    """The open dual level, -1 if none (a private attribute of torch's: read defensively, so
    that a torch without it runs, and the forward-AD tests say what is lost)."""
    return getattr(forward_ad, "_current_level", -1)


def _has_tangent(t: Tensor) -> bool:
    return forward_ad.unpack_dual(t).tangent is not None


def _check_initialized(models: list[Callable[..., Any]], model_params: list[ModelParams]) -> None:
    for i, (model, mp) in enumerate(zip(models, model_params)):
        if mp.uninitialized is not None:
            raise ParsumError(
                f"{_WHERE}: models[{i}] ({model_kind(model)}) has lazy parameters that are "
                f"not initialized yet, in {mp.uninitialized}; parsum needs every "
                "parameter's shape before the forwards run: call the model once first (for "
                "example on one batch under torch.no_grad()), as DistributedDataParallel and "
                "torch.func also require"
            )


def _check_vjp_models(models: list[Callable[..., Any]], model_params: list[ModelParams]) -> None:
    for i, (model, mp) in enumerate(zip(models, model_params)):
        if mp.loose:
            raise ParsumError(
                f"{_WHERE}: models[{i}] ({model_kind(model)}) holds tensor attribute(s) "
                f"{mp.loose} that require grad and are not parameters; engine='vjp' "
                "differentiates parameters only (functional_call): register them as "
                "nn.Parameter, or use engine='autograd' or 'auto'"
            )
        if mp.tensors and not isinstance(model, nn.Module):
            raise ParsumError(
                f"{_WHERE}: models[{i}] is {a_kind_of(model)} of a "
                f"{type(module_of(model)).__name__}; engine='vjp' runs nn.Modules through "
                "torch.func.functional_call, which calls forward only: use engine='autograd' "
                "or 'auto' for bound methods and partials of modules"
            )


def _check_weights(weights: Any, n_models: int) -> tuple[list[float] | None, Tensor | None]:
    if weights is None:
        return None, None
    if isinstance(weights, Tensor):
        if weights.dim() != 1 or weights.shape[0] != n_models:
            raise ParsumError(
                f"{_WHERE}: weights has shape {tuple(weights.shape)}; expected a 1-D tensor of "
                f"length len(models) = {n_models}"
            )
        return None, weights
    if isinstance(weights, np.ndarray):  # weights computed with numpy: its floats, as a list
        if weights.ndim != 1:
            raise ParsumError(
                f"{_WHERE}: weights is a numpy array of shape {weights.shape}; expected 1-D, "
                f"of length len(models) = {n_models}"
            )
        weights = weights.tolist()
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
        raise ParsumError(
            f"{_WHERE}: weights is {a_kind_of(weights)}; expected a sequence of floats "
            "or a 1-D tensor"
        )
    if len(weights) != n_models:
        raise ParsumError(
            f"{_WHERE}: weights has length {len(weights)}; expected len(models) = {n_models}"
        )
    if all(type(w) is float for w in weights):  # the usual case: no ABC check a weight
        return list(weights), None
    if any(isinstance(w, Tensor) for w in weights):
        return None, _stacked_weights(weights)
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, numbers.Real):
            raise ParsumError(
                f"{_WHERE}: weights[{i}] is {w!r} ({type(w).__name__}); expected a real number"
            )
    if all(isinstance(w, numbers.Integral) for w in weights):
        # Kept as ints: w * m(x) keeps an integer output's dtype, and counts booleans in int64,
        # as in the plain loop (a float weight would make them float); floats alike.
        return [int(w) for w in weights], None
    return [float(w) for w in weights], None


def _stacked_weights(weights: Sequence[Any]) -> Tensor:
    """A list of 0-dim tensors (learned weights, each its own parameter) as one weight tensor,
    stacked so that each gets its gradient, as in the plain loop's ``w[i] * m_i(x)``."""
    for i, w in enumerate(weights):
        if not isinstance(w, Tensor) or w.dim() != 0:
            raise ParsumError(
                f"{_WHERE}: weights[{i}] is {w!r:.60} ({type(w).__name__}) among weights that "
                "are tensors; a list of weights holds floats, or 0-dim tensors only (stacked "
                "into one weight tensor)"
            )
    try:
        return torch.stack(list(weights))
    except RuntimeError as exc:
        raise ParsumError(
            f"{_WHERE}: weights are 0-dim tensors that cannot be stacked into one weight "
            f"tensor ({exc}); pass them on one device, or torch.stack them yourself"
        ) from exc


def _check_step_in_backward(
    sib: Any, models: list[Callable[..., Any]], model_params: list[ModelParams]
) -> list[int | None] | None:
    """Each model's position in ``sib``; every model with parameters must be in it, once."""
    if sib is None:
        return None
    if not isinstance(sib, StepInBackward):
        raise ParsumError(
            f"{_WHERE}: step_in_backward is {a_kind_of(sib)}; expected a "
            "parsum.StepInBackward or None"
        )
    sib._stepped.clear()  # a new step begins (NOTE [ Gradients from outside the sum ])
    index: list[int | None] = []
    seen: dict[int, int] = {}
    for i, (model, mp) in enumerate(zip(models, model_params)):
        module = module_of(model)
        j = sib.index(model if module is None else module)
        while j is None and isinstance(module, COMPILED_MODULES):  # torch.compile's wrapper
            module = cast(nn.Module, module._orig_mod)  # type: ignore[union-attr]
            j = sib.index(module)
        if mp.tensors and j is None:
            raise ParsumError(
                f"{_WHERE}: models[{i}] ({type(model).__name__}) is not one of "
                "step_in_backward's models, so nothing would step its parameters; build the "
                "StepInBackward over every model passed"
            )
        if j is not None and seen.setdefault(j, i) != i:
            raise ParsumError(
                f"{_WHERE}: models[{i}] ({type(model).__name__}) is models[{seen[j]}] again; "
                "with step_in_backward each model steps right after its one pullback, so "
                "pass each model once (use weights to count it twice)"
            )
        if mp.loose:
            raise ParsumError(
                f"{_WHERE}: models[{i}] ({model_kind(model)}) holds tensor attribute(s) "
                f"{mp.loose} that require grad and are not parameters, which its optimizer "
                "does not step; step_in_backward would drop their gradients: register them "
                "as nn.Parameter"
            )
        missed = None if j is None else sib.first_not_stepped(j, mp.tensors)
        if missed is not None:
            raise not_stepped(_WHERE, i, model, mp.names[missed])
        for name, p in zip(mp.names, mp.tensors):
            if has_user_hooks(p):
                raise ParsumError(
                    f"{_WHERE}: parameter {name!r} of models[{i}] ({type(model).__name__}) has "
                    "a gradient hook (register_hook); step_in_backward consumes gradients "
                    "inside the backward, where autograd would also call the hook with None: "
                    "remove the hook, or train this model with a regular optimizer"
                )
        index.append(j)
    return index


def _collect_params(
    model_params: list[ModelParams],
) -> tuple[list[Tensor], list[list[int]], list[bool]]:
    """Every trainable parameter once, each model's slots, and which are used by several."""
    slots: list[list[int]] = []
    every = list(itertools.chain.from_iterable(mp.tensors for mp in model_params))
    if len(set(map(id, every))) == len(every):
        # None used twice, the usual case: each model's slots follow the last model's (a set
        # of models drawn anew each call collects them every call)
        start = 0
        for mp in model_params:
            slots.append(list(range(start, start + len(mp.tensors))))
            start += len(mp.tensors)
        return every, slots, [False] * len(every)
    index: dict[int, int] = {}
    params: list[Tensor] = []
    users: list[int] = []
    for mp in model_params:
        model_slots = []
        for p in mp.tensors:
            slot = index.setdefault(id(p), len(params))
            if slot == len(params):
                params.append(p)
                users.append(0)
            users[slot] += 1
            model_slots.append(slot)
        slots.append(model_slots)
    return params, slots, [u > 1 for u in users]


def _forward_in_order(model_params: list[ModelParams]) -> bool:
    """Whether the forwards must run one after the other, in model order: when two model
    entries share a buffer, its updates (BatchNorm statistics) must happen in the plain loop's
    order, and when they hold one generator (torch's, Python's or NumPy's), its draws (NOTE
    [ Generators the models hold ] in _random). (Engines "vjp" and "stacked" swap tensors in
    shadows of the modules, never in the modules themselves, so entries that share a module
    may run at once: NOTE [ Shadow modules ].)"""
    owner: dict[int, int] = {}
    for i, mp in enumerate(model_params):
        for held in estimate(mp, "held", _held_ids, mp):
            if owner.setdefault(held, i) != i:
                return True
    return False


def _held_ids(mp: ModelParams) -> list[int]:
    """The ids of a model's buffers and of the generators its modules hold."""
    return [id(t) for t in (*mp.buffers, *(g for m in mp.modules for g in held_generators(m)))]
