"""The one-thread path of ``sum_models``: the models run in the caller's graph.

# NOTE [ The caller's graph ]
# When a call runs on one thread (the budget or the models leave no work for a second: NOTE
# [ Threads that pay ] in _grouping), ParallelSum's machinery (per-model pullback objects,
# gradient routing, the pool) costs far more than the models for small ones: 64 tiny MLPs at one
# thread took 2.1 ms forward and 3.3 ms backward in the plain loop, 3.9 and 4.9 through
# ParallelSum. There the models run as the plain loop runs them, in the calling thread on the
# caller's tensors, and one ``CallerGraphSum`` node returns their compensated, ordered sum,
# computed by ``run_forward`` exactly as ParallelSum computes it (the same chunks, weights and
# intra-op threads, hence the same bits). Like ParallelSum, its inputs are the parameters, so
# ``autograd.grad`` with respect to them works, and it keeps the models' output edges itself:
# the models' graphs hang off the parameters, never off the node, so the running engine does
# not walk them a second time. Its backward pulls every model back in one engine call, with
# each output's cotangent (the incoming gradient times the model's weight), under the same
# intra-op threads: into ``.grad`` directly where the running backward accumulates into every
# leaf and every ``.grad`` is None (NOTE [ Accumulating in the pullback ] in _function),
# otherwise (``autograd.grad``, ``backward(inputs=...)``, create_graph, gradients to add to,
# post-accumulate hooks, which autograd also calls for the None returned) capturing the
# gradients and returning them for autograd to accumulate. A failure
# sets the ``.grad`` it wrote back to None, and each model is then pulled back alone (the call
# kept the graphs) to name the first one that fails.
# The path is taken only where its gradients are those of ParallelSum bit for bit and its
# hooks run as there: no argument needs a gradient (the models' argument gradients would be
# summed by autograd, uncompensated), no parameter is used by two entries (same), none has a
# tensor hook (captured gradients would meet it twice: NOTE [ Hooks run once ] in _engines),
# no FlatGrad slot, take_rows table, step_in_backward or distributed failure announcement (each
# routes gradients itself), and every model is a module, a method or a partial of one (a plain
# callable's captured tensors are checked by the other path).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

from . import _pool
from ._engines import CallArgs, SinglePullback, _edge, module_of, pull_back
from ._function import (
    SumPlan,
    _engine_keeps_graph,
    _once_differentiable,
    freed_graph_error,
    model_weight_grad,
    reports_failures,
    run_forward,
    stack_weight_grads,
)
from ._grads import engine_runs_all, has_flat_grads
from ._sparse import any_sampled, has_user_hooks, sampled_elements


def fits_callers_graph(plan: SumPlan, tensors: Sequence[Tensor]) -> bool:
    """Whether the call runs in the caller's graph (NOTE [ The caller's graph ])."""
    return (
        _pool.threads_for(len(plan.chunks), plan.n_workers) <= 1
        and plan.step_in_backward is None
        and all(unit.engine == "autograd" for unit in plan.units)
        and not any(t.requires_grad for t in tensors)
        and not any(plan.shared)
        and not reports_failures()
        and all(module_of(m) is not None for m in plan.models)
        and not has_flat_grads(plan.params)
        and all(p._backward_hooks is None or not has_user_hooks(p) for p in plan.params)
        and not (any_sampled() and any(sampled_elements(p) is not None for p in plan.params))
    )


class _State:
    """What a ``CallerGraphSum`` node needs besides its tensors."""

    def __init__(
        self,
        plan: SumPlan,
        leaves: list[Tensor],
        edges: list[list[tuple[GradientEdge, int]]],
        outputs: list[list[Tensor] | None],
    ) -> None:
        self.plan = plan
        self.leaves = leaves  # the sum, computed before the node is made
        # Each model's output edges, with the output leaf each belongs to; None once freed.
        self.edges: list[list[tuple[GradientEdge, int]]] | None = edges
        self.outputs = outputs  # detached, for the weights' gradient


def sum_in_callers_graph(
    plan: SumPlan, call: CallArgs, weight_tensor: Tensor | None
) -> list[Tensor]:
    """Run the models in the caller's graph; their sum, as one node of it."""
    roots: list[list[Tensor] | None] = [None] * len(plan.models)
    weight_needs_grad = weight_tensor is not None and weight_tensor.requires_grad
    result = run_forward(
        plan, call, weight_tensor, build_graph=False, keep_outputs=weight_needs_grad, roots=roots
    )
    edges = [
        [(_edge(leaf), j) for j, leaf in enumerate(leaves or ()) if leaf.requires_grad]
        for leaves in roots
    ]
    state = _State(plan, result.leaves, edges, result.outputs)
    del roots, result, edges
    anchor = torch.empty(0, requires_grad=True)  # its node says how backward runs
    weights = [weight_tensor] if weight_tensor is not None else []
    return list(CallerGraphSum.apply(state, anchor, *weights, *plan.params))


class CallerGraphSum(torch.autograd.Function):
    """The sum of models run in the caller's graph (computed beforehand by ``run_forward``);
    see NOTE [ The caller's graph ]. Inputs: ``(state, anchor, [weight_tensor], *params)``."""

    @staticmethod
    def forward(ctx: Any, state: _State, anchor: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.state = state
        ctx.plan = state.plan  # for _once_differentiable
        has_weights = state.plan.has_weight_tensor
        ctx.call_tensors = tensors[:1] if has_weights else ()
        if has_weights:
            ctx.save_for_backward(tensors[0])
        leaves, state.leaves = state.leaves, []  # held by the state, they would be a cycle
        return tuple(leaves)

    @staticmethod
    @_once_differentiable
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Tensor | None, ...]:
        state: _State = ctx.state
        plan = state.plan
        edges = state.edges
        if edges is None:
            raise freed_graph_error(plan)
        keep_graph = _engine_keeps_graph()
        if not keep_graph:
            state.edges = None  # the models' graphs go when this backward ends
        weight_tensor = ctx.saved_tensors[0] if plan.has_weight_tensor else None
        grads_in: list[Tensor | None] = [None, None]  # the state's, the anchor's
        if weight_tensor is not None:
            weight_grad = None
            if ctx.needs_input_grad[2]:
                per_model: list[Tensor | None] = []
                for out in state.outputs:
                    assert out is not None
                    per_model.append(model_weight_grad(grad_outputs, out))
                weight_grad = stack_weight_grads(weight_tensor, per_model)
                if not keep_graph:
                    state.outputs = []
            grads_in.append(weight_grad)
        params = plan.params
        outs: list[GradientEdge] = []
        cots: list[Tensor] = []
        for i, model_edges in enumerate(edges):
            if model_edges:
                cotangents = SinglePullback.cotangents(grad_outputs, plan.weight(i, weight_tensor))
                for edge, j in model_edges:
                    outs.append(edge)
                    cots.append(cotangents[j])
        accumulate = (
            not ctx.create_graph
            and engine_runs_all([ctx.next_functions[0][0]])[0]  # the anchor's
            and not has_flat_grads(params)
            # Autograd calls post-accumulate hooks also for the None this node returns.
            and all(p.grad is None and p._post_accumulate_grad_hooks is None for p in params)
        )
        param_grads: Sequence[Tensor | None] = [None] * len(params)
        if not outs or not params:
            return (*grads_in, *param_grads)
        error: BaseException | None = None
        try:
            with _pool.as_one_task(len(plan.chunks)):
                # Into every leaf, as the running backward would: no inputs to mark.
                wrt = () if accumulate else params
                found = pull_back(outs, wrt, cots, retain_graph=True, accumulate=accumulate)
        except BaseException as exc:
            if accumulate:
                for p in params:
                    p.grad = None  # what it was: none of it stays
            error = exc
        if error is not None:
            # Raised out here, and the frames' references dropped: an error whose traceback
            # holds a frame that holds it is a cycle, which keeps the models' graphs alive
            # until the garbage collector runs.
            try:
                if isinstance(error, Exception):
                    _raise_first_failure(plan, edges, grad_outputs, weight_tensor)
                raise error
            finally:
                error = outs = cots = edges = None  # type: ignore[assignment]
        if not accumulate:
            param_grads = found
        return (*grads_in, *param_grads)


def _raise_first_failure(
    plan: SumPlan,
    edges: list[list[tuple[GradientEdge, int]]],
    grad_outputs: Sequence[Tensor],
    weight_tensor: Tensor | None,
) -> None:
    """Pull each model back alone, in order, and raise naming the first that fails."""
    for i, model_edges in enumerate(edges):
        wrt = plan.model_params[i].tensors
        if not model_edges or not wrt:
            continue
        cotangents = SinglePullback.cotangents(grad_outputs, plan.weight(i, weight_tensor))
        error = None
        try:
            pull_back(
                [e for e, _ in model_edges], wrt, [cotangents[j] for _, j in model_edges], True
            )
        except Exception as exc:
            error = plan.model_error(i, "backward", exc)  # the exception is its cause
        if error is not None:
            try:
                raise error
            finally:
                error = None
