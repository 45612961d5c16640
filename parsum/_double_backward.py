"""Derivatives of any order through a sum of models run in the caller's graph.

# NOTE [ Double backward ]
# A backward run with ``create_graph=True`` (a gradient penalty, the derivatives in x of a
# physics-informed loss, a Hessian-vector product) must return gradients that are themselves
# differentiable. In the caller's graph (NOTE [ The caller's graph ] in _inline) the models'
# graphs are ordinary autograd graphs, so there CallerGraphSum's backward, run with grad mode
# on, hands the pullback to a node of its own, a ``DifferentiablePullback``:
# - its forward pulls every model back in one engine call with ``create_graph=True``, reading
#   the incoming gradients through leaves of its own, and returns the derivatives: each
#   parameter's, and each argument's summed over the models' aliases in model order, in the
#   wide dtype (float32 in float64), by ops that record their graph;
# - its backward differentiates those derivatives in one engine call with respect to its
#   incoming-gradient leaves, the parameters and the aliases, and returns what reaches each
#   (the aliases' gradients added with the compensated sum, in model order, as a first
#   backward adds them); run with ``create_graph=True`` itself, it hands that to a node of the
#   next order, which also differentiates with respect to the leaves of the orders before it.
# The models' aliases are leaves cut from the arguments, so without these nodes a second
# backward stopped at them: d2y/dx2 would have been lost without a word (it raised instead).
# Everything runs in the calling thread, one engine call a node, whatever ``n_jobs``: the bits
# do not depend on it. The nested calls keep the graphs they walk, which nodes of another order
# may walk later in the same backward (plain autograd walks each node once, with its gradients
# added up first); where the running backward frees its graph, the models' graphs are dropped
# when it ends (``release_at_end``), so their saved tensors go then. A model that fails is named
# (each model alone, in order, as in NOTE [ Engine calls of the caller's graph ]). Stacked
# groups are there too (NOTE [ Stacked groups in the caller's graph ] in _inline): autograd
# differentiates their batched graphs again, and so are parameters several models use. Where
# the models ran through ParallelSum (a parameter with a tensor hook, step_in_backward, a
# compensated FlatGrad, ``take_rows``, ``engine="vjp"``, parsum.distributed's ranks), the
# gradients are not ordinary graphs of the models, and a second backward that reaches them
# raises (``_once_differentiable``). A weight tensor that needs a gradient: NOTE [ A learned
# weight tensor's derivatives ].
# Each node differentiates only what the running backward wants (``wanted_gradients``): the
# gradient in x of a penalty's first step made every weight's derivative and its graph too,
# and the step ran at 0.663x the plain loop's speed, now 0.718x in the same run (16 MLPs of
# widths 128-512, batch 64, 2 cores; benchmarks/bench_against.py --step penalty); the models'
# graphs walked twice in the last backward, once by the sum's node and once by its
# derivative's, took most of the rest (NOTE [ One pullback for a sum and its derivatives ]).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

from ._engines import SinglePullback, pull_back
from ._errors import ParsumError
from ._function import (
    SumPlan,
    _at_end_of_backward,
    _engine_keeps_graph,
    _on_device_thread,
    check_groups,
    check_outputs_kept,
    direct_apply,
    freed_graph_error,
    model_weight_grad,
    raise_first_failing_model,
    stack_weight_grads,
    stacks_attached,
    under_vmap,
)
from ._grads import wanted_gradients, wanted_inputs
from ._locks import Lock
from ._summation import WIDE, CompensatedAccumulator

# NOTE [ A learned weight tensor's derivatives ]
# With a weight tensor that needs a gradient, the sum's derivatives depend on it too: each
# model's cotangent is the incoming gradient times the model's weight. A gradient penalty whose
# first backward differentiates with respect to x alone (``autograd.grad(y.sum(), x,
# create_graph=True)``) then differentiates, in its second backward, x's gradient with respect
# to the weights (d/dw_i of J_i^T (w_i g) is J_i^T g). So the order-1 node takes the weight
# tensor as its last incoming input and makes its cotangents from a leaf of it, ``leaf[i] * g``,
# recording their graph: the next order differentiates with respect to that leaf as with
# respect to the incoming gradients' leaves, and returns the weight tensor's gradient. Where
# the backward run with create_graph=True wants the weight tensor's own gradient,
# sum(g * m_i(x)) (``backward(create_graph=True)``, ``autograd.grad`` with respect to the
# logits), the node computes it from the models' outputs as they returned them, with their
# graphs (kept by the forward beside the detached ones the first-order gradient reads: the same
# tensors), and returns it as its last output: the next order differentiates it with the
# derivatives, through the incoming gradients' leaves and the models' graphs, each model's part
# apart where a failing model is to be named. Until 2026-12-05 such a second backward raised.
# Checked against the plain sum in float64 (a penalty in x, the weights' gradient alone, every
# gradient, third order; `gradgradcheck` in x, the logits and the parameters), the bits the
# same for n_jobs 1, 2 and 3, and in the random scenarios of tests/test_double_backward.py.
#
# NOTE [ The weights' gradient carried by the sum's node ]
# In a penalty step's last backward the order-1 node runs before the sum's node (it was made
# later, and the incoming gradient it differentiates may come from the sum), and it left its
# pullback for the sum's node (NOTE [ One pullback for a sum and its derivatives ]) only where
# it had no gradient of its own to return: a learned weight tensor's made it pull back alone,
# and the models' graphs were walked twice (a penalty step 0.57-0.64x the plain loop's speed,
# against 0.73-0.83x without weights). The weight tensor is an input of the sum's node too, on
# the same edge: so the order-1 node leaves its pullback all the same where the weights are
# all it has to return, the sum's node differentiates its weight leaf in the one engine call,
# and returns that gradient added to its own weights' gradient. Where the order-1 node is the
# last after all (another node left its pullback, and none is to come), it returns it itself.
# The penalty step with learned weights 1.18-1.23x faster (0.66-0.78x the plain loop; 2 cores,
# benchmarks/results/learned-weights-penalty-2cores-fifty-sixth.txt).


class Holds:
    """The derivative nodes made from one CallerGraphSum's models (weakly: each holds this),
    and its state (weakly: it holds this), whose hold on the models' graphs ``release`` drops
    with theirs."""

    def __init__(self, state: Any, node: Any, on_cpu: bool) -> None:
        self.state = weakref.ref(state)
        self.refs: list[weakref.ref[Derivatives]] = []
        self.node = weakref.ref(node)  # the CallerGraphSum node
        self.on_cpu = on_cpu  # its outputs
        # The pullbacks left for the last of the nodes to run in a backward, by its graph
        # task (NOTE [ One pullback for a sum and its derivatives ]): backward passes through
        # a retained graph may run at once in several threads.
        self.merges: dict[int, Merge] = {}
        self.lock = Lock()

    def __bool__(self) -> bool:
        return any(ref() is not None for ref in self.refs)

    def add(self, held: Derivatives) -> None:
        self.refs.append(weakref.ref(held))

    def release(self) -> None:
        self.merges = {}
        state = self.state()
        if state is not None:
            state.edges = state.aliases = None
            state.outputs = []
        for ref in self.refs:
            held = ref()
            if held is not None:
                held.free()
        self.refs = []


class Derivatives:
    """What a ``DifferentiablePullback`` node differentiates and, once its forward ran, what it
    found, with their graphs. Order 1 differentiates the models' outputs (their edges, each
    model's cotangents weighted); order k + 1 the derivatives order k found."""

    def __init__(
        self,
        holds: Holds,
        plan: SumPlan,
        aliases: list[list[Tensor]] | None,
        edges: list[list[tuple[GradientEdge, int]]] | None = None,
        weight_tensor: Tensor | None = None,
        source: Derivatives | None = None,
        wrt_params: list[Tensor] | None = None,
    ) -> None:
        self.holds = holds
        self.plan = plan
        self.aliases = aliases
        # What each parameter is differentiated through: the view a hooked one was read
        # through (NOTE [ Tensor hooks in the caller's graph ] in _inline), else itself.
        if wrt_params is None:
            wrt_params = plan.params if source is None else source.wrt_params
        self.wrt_params: list[Tensor] = wrt_params
        self.edges = edges  # order 1
        self.weight_tensor = weight_tensor
        # Order 1 of a learned weight tensor: its leaf is the last of ``leaves``, and each
        # model's cotangents are the incoming gradients times its element, with their graph
        # (NOTE [ A learned weight tensor's derivatives ]).
        self.weight_leaf = False
        # Where the running backward wants the weight tensor's gradient: each model's output
        # leaves with their graph, and the gradient's part from each model once found.
        self.weight_outputs: list[list[Tensor] | None] | None = None
        self.weight_parts: list[Tensor | None] = []
        # Order 2 of a learned weight tensor, left for the sum's node: that node returns the
        # gradient of the weight leaf among ``earlier`` with its own weights' gradient (NOTE
        # [ The weights' gradient carried by the sum's node ]).
        self.carries_weight = False
        self.source = source  # order k + 1: order k, whose derivatives are differentiated
        # The leaves of the orders before (their incoming gradients), latest first.
        self.earlier: list[Tensor | None] = (
            [] if source is None else [*source.leaves, *source.earlier]
        )
        self.leaves: list[Tensor | None] = []  # the incoming gradients, as leaves of its own
        self.found: list[Tensor | None] = []  # [*earlier's, *arguments', *parameters']
        self.alias_found: Sequence[Tensor | None] = []  # model by model, argument by argument
        # Which of [*earlier, *arguments, *parameters] the running backward wants a gradient
        # of (``wanted``); the others are not differentiated.
        self.wanted: list[bool] | None = None
        self.freed = False
        self.node: weakref.ref[Any] | None = None  # its DifferentiablePullback node

    @classmethod
    def of_sum(cls, state: Any, weight_tensor: Tensor | None) -> Derivatives:
        """Order 1 of a CallerGraphSum node's ``state`` (its models' outputs)."""
        assert state.derivatives is not None
        return cls(
            state.derivatives,
            state.plan,
            state.aliases,
            state.edges,
            weight_tensor,
            wrt_params=state.wrt_params,
        )

    def free(self) -> None:
        self.freed = True
        self.edges = self.aliases = self.source = self.weight_outputs = None
        self.weight_parts = []
        self.earlier, self.leaves, self.found, self.alias_found = [], [], [], []

    def n_args(self) -> int:
        return len(self.aliases[0]) if self.aliases else 0

    def _wanted(self) -> tuple[list[bool], list[bool], list[bool]]:
        n_earlier, n_args = len(self.earlier), self.n_args()
        wanted = self.wanted or [True] * (n_earlier + n_args + len(self.plan.params))
        earlier = [w and t is not None for w, t in zip(wanted, self.earlier)]
        return earlier, wanted[n_earlier : n_earlier + n_args], wanted[n_earlier + n_args :]

    def wrt(self, models: Sequence[int] | None = None) -> list[Tensor]:
        """What this order differentiates with respect to (for ``models`` alone, where
        given): the earlier orders' leaves, the parameters and the models' aliases, those
        wanted."""
        earlier, args, params = self._wanted()
        plan = self.plan
        slots = range(len(plan.params)) if models is None else _slots(plan, models)
        mine = range(len(self.aliases or ())) if models is None else models
        aliases = self.aliases or []
        return [
            *(t for t, w in zip(self.earlier, earlier) if w and t is not None),
            *(self.wrt_params[s] for s in slots if params[s]),
            *(a for i in mine for a, w in zip(aliases[i], args) if w),
        ]

    def spread(
        self, found: Sequence[Tensor | None]
    ) -> tuple[list[Tensor | None], list[Tensor | None], list[Tensor | None]]:
        """``found`` (with respect to ``wrt()``) as the earlier orders', the parameters' and
        the aliases' derivatives, None where not wanted."""
        earlier, args, params = self._wanted()
        taken = iter(found)
        earlier_found = [next(taken) if w else None for w in earlier]
        param_found = [next(taken) if w else None for w in params]
        alias_found = [next(taken) if w else None for _ in self.aliases or () for w in args]
        return earlier_found, param_found, alias_found

    def outputs_and_cotangents(
        self, models: Sequence[int] | None = None
    ) -> tuple[list[Any], list[Tensor]]:
        """What this order differentiates, with its cotangents (of ``models`` alone, where
        given)."""
        outs: list[Any] = []
        cots: list[Tensor] = []
        if self.edges is not None:
            grads: Sequence[Tensor | None] = self.leaves
            leaf = None
            if self.weight_leaf:  # the weights' leaf, after the incoming gradients
                *grads, leaf = self.leaves
                assert leaf is not None
            for i in range(len(self.edges)) if models is None else models:
                model_edges = self.edges[i]
                if not model_edges:
                    continue
                weight = self.plan.weight(i, self.weight_tensor) if leaf is None else leaf[i]
                cotangents = SinglePullback.cotangents(grads, weight)  # type: ignore[arg-type]
                outs.extend(edge for edge, _ in model_edges)
                cots.extend(cotangents[j] for _, j in model_edges)
            return outs, cots
        source = self.source
        assert source is not None
        pairs = zip(source.found, self.leaves)
        if models is not None:  # each model's share: its parameters' and its aliases'
            pairs = zip(*source.model_share(models, self.leaves))
        for first, leaf in pairs:
            if first is not None and leaf is not None and first.requires_grad:
                outs.append(first)
                cots.append(leaf)
        return outs, cots

    def model_share(
        self, models: Sequence[int], incoming: Sequence[Tensor | None]
    ) -> tuple[list[Tensor | None], list[Tensor | None]]:
        """The derivatives of ``models`` found here (their parameters' and their aliases'),
        with the incoming gradients of the outputs they went into."""
        plan = self.plan
        n_earlier = len(self.earlier)
        n_args = self.n_args()
        at_params = n_earlier + n_args
        found: list[Tensor | None] = []
        into: list[Tensor | None] = []
        for i in models:
            for s in plan.param_slots[i]:
                found.append(self.found[at_params + s])
                into.append(incoming[at_params + s])
            for j in range(n_args):
                found.append(self.alias_found[i * n_args + j])
                into.append(incoming[n_earlier + j])  # each alias' share of its argument's sum
            if self.weight_parts:  # its part of the weights' gradient, the node's last output
                weight_grad = incoming[-1]
                found.append(self.weight_parts[i])
                into.append(None if weight_grad is None else weight_grad[i])
        return found, into


def _slots(plan: SumPlan, models: Sequence[int]) -> list[int]:
    return [s for i in models for s in plan.param_slots[i]]


def release_at_end(holder: Any) -> None:
    """Unless the running backward keeps its graph, drop ``holder``'s hold on the models'
    graphs (``release()``) when it ends (NOTE [ Double backward ])."""
    if not _engine_keeps_graph():
        ref = weakref.ref(holder)
        _at_end_of_backward(lambda: _release(ref))


def _release(ref: weakref.ref[Any]) -> None:
    holder = ref()
    if holder is not None:
        holder.release()


def keeps_models_graphs(state: Any) -> bool:
    """Whether a first-order pullback of ``state``'s models keeps their graphs: where the
    running backward does, or where derivative nodes read them too (then they go when the
    backward ends)."""
    if state.derivatives:
        release_at_end(state.derivatives)
        return True
    return _engine_keeps_graph()


def second_order_fits(ctx: Any) -> bool:
    """Whether a CallerGraphSum backward run with create_graph=True returns differentiable
    gradients (NOTE [ Double backward ]): the models' graphs are there and something is
    differentiated (a learned weight tensor too: NOTE [ A learned weight tensor's
    derivatives ])."""
    state = ctx.state
    plan: SumPlan = state.plan
    return state.edges is not None and (bool(plan.params) or state.aliases is not None)


def wanted_of_sum(ctx: Any, n_args: int) -> list[bool]:
    """``wanted_gradients`` of a ``CallerGraphSum`` node's first ``n_args`` arguments, then its
    parameters (its tensor inputs: the anchor, the arguments, the weight tensor if any, the
    parameters)."""
    plan = ctx.plan
    first_param = 1 + ctx.n_args + int(plan.has_weight_tensor)
    params = wanted_inputs(ctx, first_param, len(plan.params), plan.param_slots)
    return [*wanted_inputs(ctx, 1, n_args), *params]


def differentiable_backward(ctx: Any, grad_outputs: Sequence[Tensor]) -> tuple[Tensor | None, ...]:
    """CallerGraphSum's backward with create_graph=True: the gradients of its inputs, from a
    ``DifferentiablePullback`` node (NOTE [ Double backward ])."""
    with stacks_attached(ctx):
        return _differentiable_backward(ctx, grad_outputs)


def _differentiable_backward(ctx: Any, grad_outputs: Sequence[Tensor]) -> tuple[Tensor | None, ...]:
    ctx.create_graph = True
    state = ctx.state
    plan: SumPlan = state.plan
    if state.made_in_forward is not None:  # NOTE [ Parameters made in forward ] in _function
        raise ParsumError(state.made_in_forward)
    check_groups(plan, state.groups)
    weight_tensor = ctx.saved_tensors[0] if plan.has_weight_tensor else None
    if state.derivatives is None:
        state.derivatives = Holds(state, ctx, not _on_device_thread(grad_outputs))
    held = Derivatives.of_sum(state, weight_tensor)
    # Those a model made need a gradient (the last) are not differentiated here (docs/limits.md)
    n_args = ctx.n_args - len(state.flipped)
    held.wanted = wanted_of_sum(ctx, n_args)
    incoming = list(grad_outputs)
    weight_part: list[Tensor | None] = [None] if plan.has_weight_tensor else []
    if weight_tensor is not None and weight_tensor.requires_grad:
        held.weight_leaf = True  # NOTE [ A learned weight tensor's derivatives ]
        incoming.append(weight_tensor)
        if wanted_inputs(ctx, 1 + ctx.n_args, 1)[0]:
            # Kept by the forward where the weights need a gradient, dropped with the edges
            assert state.attached is not None
            check_outputs_kept(plan, state.outputs, state.output_versions)
            held.weight_outputs = state.attached
    grads = _apply(held, incoming, (), ctx.call_tensors[:n_args])
    if held.weight_outputs is not None:  # the weights' gradient: the node's last output
        weight_part, grads = [grads[-1]], grads[:-1]
    joined = (None,) if state.pending is not None else ()
    flipped = [None] * len(state.flipped)
    return (None, None, None, *grads[:n_args], *flipped, *weight_part, *grads[n_args:], *joined)


def _apply(
    held: Derivatives,
    incoming: Sequence[Tensor | None],
    earlier: Sequence[Tensor | None],
    arguments: Sequence[Tensor],
) -> tuple[Tensor | None, ...]:
    """A new ``DifferentiablePullback`` node's outputs, ``held`` registered."""
    held.holds.add(held)
    release_at_end(held.holds)
    # NOTE [ Applying a Function with many inputs ] in _function
    n_unwrapped = 4 + len(incoming) + len(earlier) + len(arguments)
    return direct_apply(
        DifferentiablePullback,
        n_unwrapped,
        held,
        len(incoming),
        len(earlier),
        len(arguments),
        *incoming,
        *earlier,
        *arguments,
        *held.plan.params,
    )


class DifferentiablePullback(torch.autograd.Function):
    """Derivatives of a sum of models in the caller's graph, differentiable again (NOTE
    [ Double backward ]). Inputs: ``(held, n_incoming, n_earlier, n_args, *incoming,
    *earlier, *arguments, *params)``, ``earlier`` being the incoming gradients of the orders
    before; outputs: the derivatives with respect to ``earlier`` (None for a None), the
    arguments and the parameters."""

    @staticmethod
    def forward(
        ctx: Any,
        held: Derivatives,
        n_incoming: int,
        n_earlier: int,
        n_args: int,
        *tensors: Tensor | None,
    ) -> tuple[Tensor | None, ...]:
        plan = held.plan
        ctx.held = held
        held.node = weakref.ref(ctx)
        ctx.n_args = n_args
        ctx.inputs = tensors[: n_incoming + n_earlier]  # the next order's earlier ones
        ctx.arguments = tensors[n_incoming + n_earlier : n_incoming + n_earlier + n_args]
        ctx.set_materialize_grads(False)
        with torch.enable_grad():
            held.leaves = [
                None if g is None else g.detach().requires_grad_() for g in tensors[:n_incoming]
            ]
            outs, cots = held.outputs_and_cotangents()
            wrt = held.wrt()
            try:
                # Nothing but the weights' gradient wanted: no engine call
                found = _grad(outs, wrt, cots, create_graph=True) if wrt else ()
            except Exception as exc:
                models = range(len(plan.models))
                raise_first_failing_model(plan, [(i, _attempt(held, [i])) for i in models], exc)
                raise
            earlier_found, param_found, held.alias_found = held.spread(found)
            arg_found = [
                _wide_sum([g for g in held.alias_found[j::n_args] if g is not None])
                for j in range(n_args)
            ]
            held.found = [*earlier_found, *arg_found, *param_found]
            if held.weight_outputs is not None:
                held.found.append(_weight_grad(held))
        return tuple(None if g is None else g.detach() for g in held.found)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        held: Derivatives = ctx.held
        plan = held.plan
        if held.freed:
            raise freed_graph_error(plan)
        n_args = ctx.n_args
        following = Derivatives(held.holds, plan, held.aliases, source=held)
        n_params = len(plan.params)
        first_arg = len(ctx.next_functions) - n_args - n_params  # the last inputs
        following.wanted = [
            *wanted_gradients(ctx.inputs),  # None where no gradient came: no edge
            *wanted_inputs(ctx, first_arg, n_args),
            *wanted_inputs(ctx, first_arg + n_args, n_params, plan.param_slots),
        ]
        if torch.is_grad_enabled():  # create_graph=True: the next order's node
            return (None, None, None, None, *_apply(following, grads, ctx.inputs, ctx.arguments))
        following.leaves = list(grads)
        release_at_end(held.holds)
        vmapped = any(map(under_vmap, grads))  # NOTE [ Gradients under vmap ] in _inline
        if held.source is None and merges(held.holds, grads):  # NOTE [ One pullback for
            earlier = following._wanted()[0]  # a sum and its derivatives ]
            if held.weight_leaf and earlier[-1]:  # NOTE [ The weights' gradient carried by
                following.carries_weight = True  # the sum's node ]
                earlier = earlier[:-1]
            merged = merge_pullbacks(held.holds, ctx, following, may_wait=not any(earlier))
            if merged is not None:
                inputs_found, carried = merged[0], merged[3]
                if carried is not None:  # this node the last: with its own weight leaf's
                    at = len(held.leaves) - 1
                    own = inputs_found[at]
                    inputs_found[at] = carried if own is None else own + carried
                return (None, None, None, None, *inputs_found, *merged[1], *merged[2])
        outs, cots = following.outputs_and_cotangents()
        wrt = following.wrt()
        found: Sequence[Tensor | None] = [None] * len(wrt)
        if outs:
            try:
                found = _grad(outs, wrt, cots)
            except Exception as exc:
                models = range(len(plan.models))
                raise_first_failing_model(
                    plan, [(i, _attempt(following, [i])) for i in models], exc
                )
                raise
        inputs_grads, param_grads, alias_grads = following.spread(found)
        arg_grads = _argument_sums(alias_grads, n_args, vmapped)
        return (None, None, None, None, *inputs_grads, *arg_grads, *param_grads)


def _weight_grad(held: Derivatives) -> Tensor:
    """The weight tensor's gradient, sum(g * m_i(x)) model by model, recording its graph
    (NOTE [ A learned weight tensor's derivatives ]); each model's part kept for its share."""
    assert held.weight_outputs is not None and held.weight_tensor is not None
    grads = [g for g in held.leaves[:-1] if g is not None]
    held.weight_parts = [
        None if out is None else model_weight_grad(grads, out) for out in held.weight_outputs
    ]
    return stack_weight_grads(held.weight_tensor, held.weight_parts)


def _argument_sums(
    alias_grads: Sequence[Tensor | None], n_args: int, vmapped: bool = False
) -> list[Tensor | None]:
    """Each argument's gradient: its models' aliases' (``alias_grads``, model by model,
    argument by argument) added in model order, compensated, or under vmap in the wide dtype
    out of place (NOTE [ Gradients under vmap ] in _inline)."""
    arg_grads: list[Tensor | None] = []
    for j in range(n_args):
        mine = [g for g in alias_grads[j::n_args] if g is not None]
        if vmapped:
            arg_grads.append(_wide_sum(mine))
            continue
        acc = CompensatedAccumulator()
        for g in mine:
            acc.add(g)
        arg_grads.append(None if acc.empty else acc.result())
    return arg_grads


# NOTE [ One pullback for a sum and its derivatives ]
# A gradient penalty's last backward, ``(loss(y) + penalty(dy/dx)).backward()``, reaches two
# nodes that pull the models back: the sum's (CallerGraphSum, with the loss's gradient in y)
# and its derivative's (the DifferentiablePullback of order 1, with the penalty's gradient in
# dy/dx), and the derivative's graph runs through the models' own graphs. Pulled back apart,
# each walked the models' graphs, twice in all, where plain autograd adds both gradients into
# each node first and walks them once: 16 MLPs of widths 128-512 at batch 64 took 24.6 ms in
# that backward against the plain loop's 15.5 (one thread; 17.0 now). So the nodes of a sum
# that the running backward will run (``_will_engine_execute_node``) wait for each other: each
# but the last to run leaves what it would pull back (``Merge``) and returns no gradient for
# the arguments and parameters, which the last returns for all of them from one engine call
# (``_pull_back_together``), the arguments' summed over the models' aliases in model order
# (compensated). A derivative node with gradients of its own to return (with respect to its
# incoming gradients: a Hessian-vector product's vector) neither waits nor is waited for (it
# may run first); it takes what the others left. Not where a backward records its graph
# (create_graph: the next order's nodes), under vmap, where a model made an argument need a
# gradient, or where the sum is not on the CPU (a device's thread runs its node; not tried on
# one): there each node pulls back its own, as before. Which nodes run depends on the
# backward alone, never on n_jobs, and the nodes run on the calling thread in the engine's
# order: the same bits for any n_jobs. What is left is kept by graph task (backward passes
# through a retained graph may run at once in several threads). A whole penalty step against
# the code before, in one run of benchmarks/bench_against.py --step penalty on 2 cores: 16
# MLPs of widths 128-512 at batch 64 23.3 -> 18.7 ms (the plain loop's 15.9), 16 MLP classes
# of widths 128-488 23.1 -> 18.4 (15.3), 64 tiny MLP classes 17.1 -> 16.3 (10.9).


class Merge:
    """The pullbacks left by the nodes of a sum that ran first in one backward, for the last to
    run (NOTE [ One pullback for a sum and its derivatives ])."""

    def __init__(self) -> None:
        self.parts: list[Derivatives] = []
        self.ran: set[int] = set()  # the ids of the nodes that left them


def merges(holds: Holds, grads: Sequence[Tensor | None]) -> bool:
    """Whether a node of ``holds``' sum receiving ``grads`` takes part in NOTE [ One pullback
    for a sum and its derivatives ] (alike for every node of the sum in one backward)."""
    state = holds.state()
    return (
        state is not None
        and holds.on_cpu
        and not torch.is_grad_enabled()
        and _GRAPH_TASK_ID is not None
        and not state.plan.args_made_to_need_grad
        and not any(map(under_vmap, grads))
    )


_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


def merge_first_order(
    ctx: Any, grad_outputs: Sequence[Tensor], weight_tensor: Tensor | None, runs_all: bool
) -> tuple[list[Tensor | None], list[Tensor | None], Tensor | None] | None:
    """A CallerGraphSum node's part in NOTE [ One pullback for a sum and its derivatives ]:
    the gradients of its arguments and parameters and the weights' gradient that derivatives
    left it to carry (NOTE [ The weights' gradient carried by the sum's node ]; None where
    none did), or None where it pulls back its own."""
    state = ctx.state
    if not state.derivatives or not merges(state.derivatives, grad_outputs):
        return None
    part = Derivatives.of_sum(state, weight_tensor)
    part.leaves = list(grad_outputs)
    part.wanted = None if runs_all else wanted_of_sum(ctx, ctx.n_args)
    merged = merge_pullbacks(state.derivatives, ctx, part, may_wait=True)
    return None if merged is None else merged[1:]


def merge_pullbacks(holds: Holds, node: Any, part: Derivatives, may_wait: bool) -> Merged | None:
    """``node``'s pullback ``part`` (an order 1 whose ``leaves`` are its incoming gradients):
    left for a node of the same sum that the running backward runs later, where ``may_wait``
    (no gradient then), or pulled back with those left before (NOTE [ One pullback for a sum
    and its derivatives ]); None where none was left and none is to come: ``node`` pulls
    back its own. The gradients of ``part.earlier``, the arguments and the parameters, and the
    weights' gradient carried for parts left before (``Merged``)."""
    assert _GRAPH_TASK_ID is not None
    task = _GRAPH_TASK_ID()
    with holds.lock:
        merge = holds.merges.pop(task, None)
        if may_wait and _others_to_run(holds, node, merge):
            if merge is None:
                merge = Merge()
            holds.merges[task] = merge
            merge.parts.append(part)
            merge.ran.add(id(node))
            n_args = part.n_args()
            return [None] * len(part.earlier), [None] * n_args, [None] * len(part.plan.params), None
    if merge is None:
        return None
    return _pull_back_together([*merge.parts, part])


def _others_to_run(holds: Holds, node: Any, merge: Merge | None) -> bool:
    """Whether the running backward will run a node of ``holds``' sum other than ``node`` that
    has not run yet and takes what is left: the sum's node, or a derivative of order 1 (one
    with gradients of its own to return takes it too, but is not waited for: it may run
    first)."""
    derivatives = (ref() for ref in holds.refs)
    members = [
        holds.node(),
        *(h.node() for h in derivatives if h is not None and h.source is None and h.node),
    ]
    ran = merge.ran if merge is not None else ()
    for member in members:
        if member is None or member is node or id(member) in ran:
            continue
        if not torch._C._will_engine_execute_node(member):
            continue
        if isinstance(getattr(member, "held", None), Derivatives) and any(
            wanted_gradients(member.inputs)
        ):
            continue  # has gradients of its own to return: never waits
        return True
    return False


Merged = tuple[list["Tensor | None"], list["Tensor | None"], list["Tensor | None"], "Tensor | None"]


def _pull_back_together(parts: list[Derivatives]) -> Merged:
    """The pullbacks of ``parts`` (of one sum; the last's earlier gradients its own) in one
    engine call: the gradients of the last's ``earlier``, the arguments and the parameters,
    and the sum of the weight leaves' gradients of the parts before that carry theirs (NOTE
    [ The weights' gradient carried by the sum's node ])."""
    last = parts[-1]
    plan = last.plan
    wanted = [p._wanted() for p in parts]
    earlier = wanted[-1][0]
    args = [any(w) for w in zip(*(a for _, a, _ in wanted))]
    params = [any(w) for w in zip(*(q for _, _, q in wanted))]
    aliases = last.aliases or []
    n_args = last.n_args()

    # The weight leaves whose gradients the last part carries (earlier parts only)
    carried = [p.earlier[_weight_at(p)] for p in parts[:-1] if p.carries_weight]

    def wrt(models: Sequence[int] | None = None) -> list[Tensor]:
        slots = range(len(plan.params)) if models is None else _slots(plan, models)
        mine = range(len(aliases)) if models is None else models
        return [
            *(t for t, w in zip(last.earlier, earlier) if w and t is not None),
            *(last.wrt_params[s] for s in slots if params[s]),
            *(a for i in mine for a, w in zip(aliases[i], args) if w),
            *(t for t in carried if t is not None and models is None),
        ]

    def outputs_and_cotangents(
        models: Sequence[int] | None = None,
    ) -> tuple[list[Any], list[Tensor]]:
        outs: list[Any] = []
        cots: list[Tensor] = []
        for p in parts:
            o, c = p.outputs_and_cotangents(models)
            outs += o
            cots += c
        return outs, cots

    everyone = range(len(plan.models))
    inputs = wrt()
    outs, cots = outputs_and_cotangents()
    found: Sequence[Tensor | None] = [None] * len(inputs)
    if outs and inputs:
        try:
            found = _grad(outs, inputs, cots)
        except Exception as exc:

            def attempt(i: int) -> Callable[[], object]:
                def run() -> object:
                    o, c = outputs_and_cotangents([i])
                    return _grad(o, wrt([i]), c) if o and wrt([i]) else None

                return run

            raise_first_failing_model(plan, [(i, attempt(i)) for i in everyone], exc)
            raise
    taken = iter(found)
    earlier_found = [
        next(taken) if w and t is not None else None for t, w in zip(last.earlier, earlier)
    ]
    param_found = [next(taken) if w else None for w in params]
    alias_found = [next(taken) if w else None for _ in aliases for w in args]
    weight: Tensor | None = None
    for t in carried:  # in the order the parts were left
        g = next(taken) if t is not None else None
        if g is not None:
            weight = g if weight is None else weight + g
    return earlier_found, _argument_sums(alias_found, n_args), param_found, weight


def _weight_at(part: Derivatives) -> int:
    """Where an order 2 has its order 1's weight leaf among ``earlier``: that order's last
    leaf."""
    assert part.source is not None
    return len(part.source.leaves) - 1


def _attempt(held: Derivatives, models: Sequence[int]) -> Callable[[], object]:
    """``held``'s differentiation of ``models`` alone, the graphs kept."""

    def attempt() -> object:
        outs, cots = held.outputs_and_cotangents(models)
        wrt = held.wrt(models)
        return _grad(outs, wrt, cots, create_graph=torch.is_grad_enabled()) if outs else None

    return attempt


def _grad(
    outputs: Sequence[Any],
    inputs: Sequence[Tensor],
    cotangents: Sequence[Tensor],
    create_graph: bool = False,
) -> tuple[Tensor | None, ...]:
    """``torch.autograd.grad``, the graphs kept (``release_at_end`` drops them); through the
    engine directly (``pull_back``): the Python wrapper's checks of every output's shape
    against its cotangent's took 0.3-0.4 ms a call for 64 tiny models, whose cotangents are
    the outputs' own gradients."""
    if not inputs:  # what autograd.grad refuses, refused as it does
        return torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True)
    return pull_back(outputs, inputs, cotangents, True, create_graph=create_graph)


def _wide_sum(grads: list[Tensor]) -> Tensor | None:
    """The sum of ``grads`` in order, recording its graph: in the wide dtype where there is
    one (float32 in float64), otherwise plainly."""
    if not grads:
        return None
    if len(grads) == 1:
        return grads[0]
    wide = WIDE.get(grads[0].dtype)
    if wide is None or any(g.layout != torch.strided for g in grads):
        total = grads[0]
        for g in grads[1:]:
            total = total + g
        return total
    return torch.stack(grads).sum(0, dtype=wide).to(grads[0].dtype)
