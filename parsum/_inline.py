"""The caller's-graph path of ``sum_models``: the models run in the caller's own autograd graph.

# NOTE [ The caller's graph ]
# When a call runs on one thread (the budget or the models leave no work for a second:
# NOTE [ Threads that pay ] in _grouping; several: below), ParallelSum's machinery (per-model
# pullback objects, gradient routing, the pool) costs far more than the models for small ones: 64
# tiny MLPs at one thread took 2.1 ms forward and 3.3 ms backward in the plain loop, 3.9 and 4.9
# through ParallelSum. There the models run as the plain loop runs them, in the calling thread on
# the caller's tensors, and one ``CallerGraphSum`` node returns their compensated, ordered sum,
# computed by ``run_forward`` exactly as ParallelSum computes it (the same chunks, weights and
# intra-op threads, hence the same bits). Like ParallelSum, its inputs are the parameters, so
# ``autograd.grad`` with respect to them works, and it keeps the models' output edges itself: the
# models' graphs hang off the parameters, never off the node, so the running engine does not walk
# them a second time. Its backward pulls the models back in few engine calls
# (NOTE [ Engine calls of the caller's graph ]), with each output's cotangent (the incoming gradient
# times the model's weight), under the same intra-op threads: into ``.grad`` directly where the
# running backward accumulates into every leaf and every ``.grad`` is None
# (NOTE [ Accumulating in the pullback ] in _function), otherwise (``autograd.grad``,
# ``backward(inputs=...)``, create_graph, gradients to add to, post-accumulate hooks, which autograd
# also calls for the None returned) capturing the gradients and returning them for autograd to
# accumulate. A failure sets the ``.grad`` it wrote back to None and names the first model that
# fails.
#
# NOTE [ Engine calls of the caller's graph ]
# The models whose forwards ran on one thread, in model order, are pulled back in one engine
# call, their graphs freed as it goes (unless the caller retains them): an engine call costs
# about 25 us, which 64 tiny models one by one would pay 64 times, and a graph retained until
# the last model is done keeps every model's activations alive, so the gradients are written to
# fresh pages instead of reusing them (the plain loop's own backward: 5.9 ms freed, 7.2 retained,
# 16 MLPs of width 256, batch 256). Measured at 2 threads, a whole step, models in one call
# against each model of 1M parameter-rows or more in a call of its own (as before): 16 identical
# MLPs of width 256 11.7 -> 10.6-11.0 ms, 16 of widths 128-512 16.1-16.6 -> 15.3-15.7 (plain loop
# 10.0 and 14.4-15.0). Each model's gradients are those of a call of its own (disjoint graphs),
# so the bits do not depend on the split.
# A failure must name its model, although the graphs it ran through are freed: the engine runs
# the ready node of highest sequence number first, and sequence numbers grow in creation order on
# each thread, so models run one after the other from the last to the first, and when model k
# fails, the models after it are done (freed), the ones before it untouched. Each model is then
# pulled back alone in model order: the first that fails is the one a run on one thread would
# name, with its own error (``_raise_first_failure``), unless the failure does not repeat
# (NOTE [ A failure that does not repeat ]). Its graph is kept only where the failed call kept
# them: a backward torch.compile made with donated buffers refuses to keep it ("requires
# create_graph=False and retain_graph=False"), which named the first compiled model, with that
# refusal, for any later model's failure.
#
# NOTE [ A failure that does not repeat ]
# A failure that does not repeat (an out-of-memory error the retry survives, a flaky check)
# passes when model k is pulled back again: searched that way alone, the first model to fail
# was k + 1, whose graph the failed call freed, or none where k was the last (7 models at
# n_jobs=1, the flaky one placed at 0, 3 or 6: named 1, 4 and none). So before anything runs
# again, the failed call's graphs are read for how far it went (``running_when_failed``): each
# model's nodes (those numbered above the model before it's outputs) with their saved tensors
# freed or kept, seen without unpacking a kept one (an unpacked tensor held by the error's
# frames kept the graphs alive without the garbage collector; a custom Function's node tells
# whether it ran though it saved nothing). A model with both is k; else k is the last model
# before the first one freed throughout that did not finish: the last one kept (its failing
# node ran before any that saves a tensor), or a model after it whose nodes save nothing where
# it is the only one. It is named with the original error where the pull back again fails with
# a freed graph's error or none fails. Where the graphs do not tell (a graph the caller
# retains, two models in a row whose nodes save nothing), the search names as before.
#
# NOTE [ Pullbacks in runs of chunks ]
# Models too small for workers in forward (NOTE [ Pullbacks of small models ] in _grouping) run
# their forwards in model order in the calling thread, and their pullbacks on several threads.
# A chunk pulled back in an engine call of its own paid that call's fixed cost (about 25 us)
# and its Python, for a chunk of 4 tiny MLPs' few hundred us of work: pulled back that way, 16
# tiny MLP classes ran 0.91x as fast on 2 threads as on one. So a thread pulls back a run of
# consecutive chunks in one engine call: 16 classes 1.05x, 8 0.94x (one thread for those), 32
# 1.06 -> 1.165x, 64 1.14 -> 1.16x (2 cores, 2026-12-01, against the calling thread alone), in
# 2 runs a thread of as many chunks, claimed in chunk order. That left a helper idle at the
# end: the caller starts its runs last, after the node's parameters' None visits (NOTE
# [ Pullbacks joined later ] in _function: 0.57 ms for the 64 tiny classes' 383, while the
# helper's first run took 0.72), and the models' costs may grow with their index (the last run
# ran alone for 0.6 ms). So the runs are cut by estimated cost (``pullback_runs``):
# RUNS_PER_THREAD a thread of about equal cost, none under MIN_RUN_PARAM_ROWS (an engine call's
# fixed cost against about 4 tiny models' work), the costliest claimed first. Against the runs
# before (2 cores, 2026-12-01, in place, 60 rounds): 64 tiny classes at batch 32 1.029-1.047x
# (two runs), 32 of them 1.014x, 16 0.984x (4 runs either way: the order alone). A run is
# one engine call over graphs recorded in model order on one thread, as the call for every
# chunk at one thread is: a failure names its model as there (above), the first in the runs
# that failed; the gradients, each model's own, do not depend on the runs.
#
# NOTE [ The caller's graph on several threads ]
# A call on several threads takes this path too: ``run_forward`` runs the chunks on the pool's
# threads as ParallelSum does, and the backward pulls each chunk's models back on the pool's
# threads (their engine calls as above, per chunk), writing into disjoint ``.grad``; where it
# runs on a device's thread, it pulls them back there, one chunk after the other (NOTE [ Device
# threads ] in _function). Models on a GPU took ParallelSum on several threads until an H200
# showed why not: a gradient penalty (create_graph=True) at n_jobs=2 raised, since derivatives
# of higher order run in the caller's graph alone (NOTE [ Double backward ] in
# _double_backward). It skips ParallelSum's per-model machinery
# (argument aliases, pullback objects, gradients routed back through the node), which the
# other threads' GIL turns into waits: 64 tiny MLPs at n_jobs=2 on 2 cores took 9.7 ms a step
# against 11.6 through ParallelSum (16 MLPs of widths 128-512, batch 256: 13.9 against a
# two-phase split by hand, the models' forwards over the threads then their backwards, 13.7).
# A failure undoes every ``.grad`` as above; the smallest failing chunk's first failing model
# is named, the one a run on one thread would name.
#
# Arguments that need a gradient are read by each model through aliases of its own
# (``x.detach().requires_grad_()``, as ParallelSum does), leaves that the models' engine call
# accumulates into with the parameters (or captures with them); the node, which has the
# arguments among its inputs, returns their sum in ParallelSum's order and compensation
# (``_argument_gradients``): autograd would add the models' gradients uncompensated, in its
# own order. With ``x.requires_grad_()``, against the plain loop (2 threads, three alternating
# processes each): 64 tiny MLPs 0.66 -> 0.71x, 16 MLPs of widths 128-512 at batch 64
# 0.83 -> 0.87-0.90x, 16 identical width-256 MLPs 0.86-0.89 -> 0.88-0.90x.
#
# The path is taken only where its gradients are those of ParallelSum bit for bit and its
# hooks run as there: a parameter used by two entries has its gradient summed as there (NOTE
# [ Parameters several models use in the caller's graph ]), one with a tensor hook is read
# through a view (NOTE [ Tensor hooks in the caller's graph ]), no take_rows table,
# step_in_backward or distributed failure announcement (each routes gradients itself), and
# every model is a module, a method or a partial of one (a plain callable's captured tensors
# are checked by the other path).
#
# NOTE [ Stacked groups in the caller's graph ]
# A stacked group (identical models that ``auto`` or engine "stacked" runs as one batched
# forward) beside other models runs in the caller's graph too, as one group alone does (NOTE
# [ One group in the caller's graph ] in _stack): each parameter name's tensors stacked by
# ``torch.stack`` with their graph (whose backward hands each model its slice, into its own
# ``.grad``, through autograd's accumulation), the batched forward, and each model's output a
# view of the batched leaves (``unbind``), whose edge is the model's root. The models' outputs
# are summed as ParallelSum sums a group's, and the node's backward pulls each model back
# with its own cotangent, the engine adding the views' gradients into the batched output's;
# a chunk holds whole units, so a group is always pulled back in one engine call. Where
# arguments need a gradient the group reads its first model's aliases, and the others get
# aliases no graph reaches, so that every model has as many (the group's gradient is its
# first model's term in the compensated sum). The same bits as ParallelSum's stacked unit (the
# same batched kernels; tests/test_callers_graph.py compares them on 1-3 threads). A
# failure is traced to a group as to a model (its graph made where its first model's would
# be) and pulled back again with its models together; the first model is named. Until
# 2026-12-05 such calls ran through ParallelSum, where a second backward (a gradient
# penalty, a Hessian-vector product, a Jacobian with ``vectorize=True``) raised a ParsumError.
# Against that, on 2 cores (one process, 40 rounds): 64 MLPs of 12 architectures at batch 32
# 1.10x a step by default, 1.02x at n_jobs=1, 1.14x with weights 1/64 and 1.035x with Adam; 24
# small MLPs stacked beside 8 large ones 1.035x with weights, 1.45x for the gradient in x
# alone (NOTE [ Gradients not wanted ]); a gradient penalty's step on the 64 MLPs 1.10x the
# plain loop's speed (it raised before).
#
# NOTE [ Parameters several models use in the caller's graph ]
# Models that share a parameter (a trunk with several heads, a tied layer) run in the caller's
# graph too. Such a parameter's gradient is a sum over its models, which autograd would add in
# its own order, uncompensated, across the threads' engine calls: so the pullback captures it
# (nothing accumulates into ``.grad`` during it), each model that uses one with another model
# of its chunk in an engine call of its own (a model's contribution alone; one used by a single
# model of the chunk is pulled back with the chunk), and adds them as the arguments' are added:
# compensated, model by model within a chunk and the chunks in order (or every term at once,
# where they fit one reduction: NOTE [ Shared gradients at once ] in _summation), one engine
# call a chunk at most (no runs of chunks, no one call for all), so that the bits do not
# depend on ``n_jobs``: they are ParallelSum's, which pulled such models back alone and summed
# them the same way. Derivatives of higher order differentiate every model in one engine
# call, as without shared parameters, where autograd adds a shared parameter's parts itself
# (the bits of any ``n_jobs`` still: that call runs in the calling thread). A compensated
# FlatGrad, whose slots the pullbacks write chunk by chunk in the threads that pull back,
# keeps such calls in ParallelSum. Until 2026-12-05 every call with a shared parameter ran
# through ParallelSum, where a second backward raised.
#
# NOTE [ Tensor hooks in the caller's graph ]
# A parameter with a tensor hook (``p.register_hook``: a gradient mask for pruning, a clip) must
# have its hook run once, on its whole gradient, as in the plain loop; captured by the
# pullback with respect to the parameter itself, the gradient would meet the hook there and
# again when autograd accumulates what the node returns. So its model reads it through a
# view made for the call, in a shadow of the model's module (as ParallelSum's autograd engine
# does: NOTE [ Hooks run once ] in _engines; ``run_through_views``), the pullbacks, of every
# order, differentiate with respect to the view (``_State.wrt_params``), and the node returns
# the gradient, which autograd hands to the hook once (the pullback never accumulates: a
# None returned would reach the hook too); a stacked group stacks the views of its models'
# hooked parameters in their place. The pullbacks differentiate with respect to each view's
# gradient edge as the forward made it: a parameter written in place between the forward and
# the backward (a clamp, an optimizer stepped early) makes its view's grad_fn anew, which no
# model's graph reaches, and until 2026-12-07 a first layer's weight so written, whose graph
# never reads it back (the plain loop gives its gradient), got None, silently, its hook
# called with None. Only where each such parameter is used by one model, and
# no compensated FlatGrad, whose slots the node writes itself (``hooks_fit``); the others
# stay in ParallelSum. Until 2026-12-05 every call with a hooked parameter ran through
# ParallelSum, where a second backward raised, and on 2 cores 16 MLPs of widths 128-512 with a
# mask hook on each weight ran at 0.68x the plain loop with the same hooks (1.17x without
# hooks), 64 tiny MLP classes at 0.54x (1.01x).
#
# NOTE [ Gradients not wanted ]
# Under ``torch.autograd.grad`` or ``backward(inputs=...)`` the running backward may want the
# gradient of the arguments alone (an adversarial example, a saliency map, a gradient penalty's
# first derivative) or of the parameters alone. A captured pullback differentiates only what
# it wants (autograd's ``_will_engine_execute_node`` on each input's node, asked only where the
# backward does not run every leaf, a model's parameters together: NOTE [ Asking what the
# backward wants ] in _grads), so that the models' weight gradients, half of a linear
# layer's backward, are not computed for nothing: 16 MLPs of widths 128-512 at batch 64, 2
# threads, the gradient in x alone 0.705x -> 0.885x the plain loop's (which prunes them itself),
# in one run of benchmarks/bench_against.py --step grad-x.
#
# NOTE [ FlatGrad in the caller's graph ]
# A parameter with a slot in a FlatGrad that is not compensated has as its ``.grad`` the slot's
# view (or None), which autograd accumulates into in place, as in a plain backward (NOTE [ Who
# writes a FlatGrad slot ] in _grads). The pullback may accumulate there itself where a failure
# can be undone: every view in a buffer nothing was written to since ``zero_()`` (zeroed again),
# every other ``.grad`` None (set back to None); otherwise the gradients are captured and handed
# to autograd, which adds them in. Through ParallelSum, which copies every gradient into its
# slot, 16 medium MLPs took 0.79-0.81x and 64 tiny ones 0.65x a plain loop over the same
# FlatGrad (2 threads).
#
# NOTE [ A compensated FlatGrad in the caller's graph ]
# A compensated FlatGrad's slots are written by the node itself, as ParallelSum writes them
# (``FlatWrites``: the same kernels, so the same bits): the pullbacks capture the gradients of
# the parameters whose AccumulateGrad the running backward runs (all of them under
# ``backward()``, those it names under ``backward(inputs=...)``, none under
# ``autograd.grad``), write them, and return None for them; a failure rolls the slots and
# compensations back. An engine call captures at most FLAT_WRITE_ELEMENTS of them (a larger
# model alone), which is what ParallelSum holds: capturing a chunk's at once, two backward
# passes of 32 MLPs of 1M parameters each grew the peak by 326 MiB, against ParallelSum's
# 300 (2 threads; 296 against 284 at n_jobs=1); so, 296 (280). Under ``create_graph=True``
# a backward that writes slots returns gradients that are not differentiable, as through
# ParallelSum (``differentiable_backward`` would hand them to autograd, which adds them
# uncompensated); one that writes none (``autograd.grad``: a Hessian-vector product, a
# gradient penalty) is differentiable. Through ParallelSum,
# which this path replaced, 64 tiny MLP classes took 0.55x and 16 medium classes 0.70x the
# plain loop (2 threads, zeroed each step).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import operator
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

from . import _pool
from ._double_backward import (
    Holds,
    _wide_sum,
    differentiable_backward,
    keeps_models_graphs,
    merge_first_order,
    second_order_fits,
    wanted_of_sum,
)
from ._engines import (
    INTERNAL_LEAVES,
    CallArgs,
    SinglePullback,
    WeightedCotangents,
    _edge,
    module_of,
    pull_back,
)
from ._errors import ParsumError
from ._function import (
    FLAT_WRITE_ELEMENTS,
    GroupInGraph,
    PendingJoin,
    SumPlan,
    _notes_a_trainer,
    _on_device_thread,
    _once_differentiable,
    check_groups,
    check_outputs_kept,
    direct_apply,
    freed_by_the_failed_call,
    freed_graph_error,
    join_input,
    learn_pullback_writes,
    may_join_later,
    pullback_snapshot,
    raise_first_failing_model,
    reaching_a_graph_freed_before,
    reports_failures,
    run_forward,
    running_when_failed,
    under_vmap,
    weight_grad_of,
    weight_held_back,
    weight_values,
)
from ._grads import (
    FlatWrites,
    engine_runs_all,
    has_compensated_flat_grads,
    release_slots,
)
from ._sparse import (
    add_grad,
    add_term,
    any_sampled,
    argument_grad,
    coalesce_later,
    merge_argument_grads,
    post_accumulate_hooks,
    sampled_elements,
)
from ._summation import terms_at_once


def fits_callers_graph(plan: SumPlan) -> bool:
    """Whether the call runs in the caller's graph (NOTE [ The caller's graph ])."""
    return (
        plan.step_in_backward is None
        # NOTE [ Stacked groups in the caller's graph ]
        and all(unit.engine in ("autograd", "stacked") for unit in plan.units)
        # NOTE [ Parameters several models use in the caller's graph ]: a compensated
        # FlatGrad's slots are written chunk by chunk, in whichever thread pulls back
        and not (any(plan.shared) and has_compensated_flat_grads(plan.params))
        and not reports_failures()
        and all(module_of(m) is not None for m in plan.models)
        and (plan.walk.no_user_tensor_hooks() or hooks_fit(plan))
        and not (any_sampled() and any(sampled_elements(p) is not None for p in plan.params))
        # NOTE [ Backward passes in several threads ] in _grads
        and not plan.walk.slots_in_flat_grads.used_by_threads(_pool.in_a_task())
    )


def hooks_fit(plan: SumPlan) -> bool:
    """Whether each parameter with a tensor hook can be read through a view of its own in the
    caller's graph: used by one model, without a compensated FlatGrad, whose slots the node
    writes itself (NOTE [ Tensor hooks in the caller's graph ])."""
    hooked = plan.walk.hooked_slots()
    return not any(plan.shared[s] for s in hooked) and not has_compensated_flat_grads(plan.params)


# NOTE [ Pullbacks in runs of chunks ]: the runs of each thread that pulls back, each of
# MIN_RUN_PARAM_ROWS of estimated cost at least (about 4 tiny models).
RUNS_PER_THREAD = 4
MIN_RUN_PARAM_ROWS = 16_000_000


@functools.lru_cache(maxsize=256)
def pullback_runs(
    costs: tuple[int, ...], threads: int
) -> tuple[Mapping[int, range], tuple[int, ...]]:
    """The runs of consecutive chunks (of estimated ``costs``) that ``threads`` threads pull
    back, each by its first chunk, and the order the threads claim the chunks in: the runs'
    first chunks, costliest run first, then the others (NOTE [ Pullbacks in runs of
    chunks ]). The runs are read-only: every call with these costs shares them."""
    total = sum(costs)
    n_runs = max(threads, min(RUNS_PER_THREAD * threads, total // MIN_RUN_PARAM_ROWS))
    target = total / n_runs
    runs: dict[int, range] = {}
    start, cost = 0, 0
    for k, c in enumerate(costs):
        if cost and cost + c / 2 > target:  # more than half of k past the target: a new run
            runs[start] = range(start, k)
            start, cost = k, 0
        cost += c
    runs[start] = range(start, len(costs))
    run_cost = {k: sum(costs[j] for j in run) for k, run in runs.items()}
    firsts = sorted(runs, key=lambda k: -run_cost[k])
    return MappingProxyType(runs), (*firsts, *(k for k in range(len(costs)) if k not in runs))


class _State:
    """What a ``CallerGraphSum`` node needs besides its tensors."""

    def __init__(
        self,
        plan: SumPlan,
        leaves: list[Tensor],
        edges: list[list[tuple[GradientEdge, int]]],
        outputs: list[list[Tensor] | None],
        in_order: bool,
        aliases: list[list[Tensor]] | None,
    ) -> None:
        self.plan = plan
        self.leaves = leaves  # the sum, computed before the node is made
        # Each model's output edges, with the output leaf each belongs to; None once freed.
        self.edges: list[list[tuple[GradientEdge, int]]] | None = edges
        self.outputs = outputs  # detached, for the weights' gradient
        # Their version counters as returned (NOTE [ Outputs written before they are summed ]
        # in _function).
        self.output_versions: list[list[int] | None] | None = None
        # Its stacked groups (NOTE [ Weights written before a group's backward ] in _engines).
        self.groups: list[GroupInGraph] | None = None
        # The same outputs with their graph, for the weights' gradient made differentiable
        # (NOTE [ A learned weight tensor's derivatives ] in _double_backward).
        self.attached: list[list[Tensor] | None] | None = None
        # Whether the forwards ran on one thread in model order: then one engine call can
        # pull back every chunk (NOTE [ Engine calls of the caller's graph ]).
        self.in_order = in_order
        # Each model's aliases of the arguments that need a gradient (None: none does).
        self.aliases = aliases
        # The arguments a model made need a gradient, the node's last arguments (NOTE
        # [ Arguments made to need a gradient ] in _function).
        self.flipped: list[Tensor] = []
        # Where the node has a join node among its inputs, what that node runs: the caller's
        # part of pullbacks handed to helpers (NOTE [ Pullbacks joined later ]).
        self.pending: PendingJoin | None = None
        # What a backward that captures gradients raises: parameters made in a forward
        # (NOTE [ Parameters made in forward ] in _function).
        self.made_in_forward: str | None = None
        # The derivative nodes made by backward passes with create_graph=True, which read the
        # models' graphs too (NOTE [ Double backward ] in _double_backward); made with the
        # first, not on every call.
        self.derivatives: Holds | None = None
        # What the pullbacks differentiate with respect to for each parameter: the view a
        # parameter with a tensor hook was read through, else itself (NOTE [ Tensor hooks in
        # the caller's graph ]).
        self.wrt_params: Sequence[Tensor | GradientEdge] = plan.params


def sum_in_callers_graph(
    plan: SumPlan, call: CallArgs, weight_tensor: Tensor | None
) -> list[Tensor]:
    """Run the models in the caller's graph; their sum, as one node of it."""
    roots: list[list[tuple[GradientEdge, int]] | None] = [None] * len(plan.models)
    weight_needs_grad = weight_tensor is not None and weight_tensor.requires_grad
    tensors = [call.leaves[j] for j in call.tensor_positions]
    needs = [t.requires_grad for t in tensors]
    aliases: list[list[Tensor]] | None = None
    if any(needs):
        call = call.with_tensors(tensors, needs)
        aliases = [[] for _ in plan.models]
    # NOTE [ Tensor hooks in the caller's graph ]
    views: dict[int, Tensor | None] | None = None
    if not plan.walk.no_user_tensor_hooks():
        views = dict.fromkeys(plan.walk.hooked_slots())
    result = run_forward(
        plan,
        call,
        weight_tensor,
        build_graph=False,
        keep_outputs=weight_needs_grad,
        roots=roots,
        aliases=aliases,
        views=views,
    )
    edges = [model_edges or [] for model_edges in roots]
    if not weight_needs_grad and not any(edges):
        # No model's output needs a gradient (frozen, or reading the arguments through
        # indices only): nor does the sum, as in the plain loop, where a node over the
        # arguments would make it need one, and backward() run without error.
        return result.leaves
    in_order = _pool.threads_for(len(plan.chunks), plan.forward_workers) <= 1
    state = _State(plan, result.leaves, edges, result.outputs, in_order, aliases)
    state.made_in_forward = result.made_in_forward
    state.output_versions = result.output_versions
    state.groups = result.groups
    state.attached = result.attached
    if views:
        read_as = [views.get(s) for s in range(len(plan.params))]
        # Each view's edge as its model's graph holds it: a parameter written in place since
        # gives its view a new grad_fn, which no graph reaches (NOTE [ Tensor hooks in the
        # caller's graph ])
        state.wrt_params = [p if v is None else _edge(v) for p, v in zip(plan.params, read_as)]
    del roots, result, edges
    arguments = [t for t, need in zip(tensors, needs) if need]
    if plan.args_made_to_need_grad:  # NOTE [ Arguments made to need a gradient ] in _function
        state.flipped = made_to_need_grad(tensors, needs)
        arguments += state.flipped
    weights = [weight_tensor] if weight_tensor is not None else []
    join: list[Tensor] = []
    # NOTE [ Weights' gradients held back by the join ]
    held_back = weight_held_back(weight_tensor)
    if not plan.one_thread_backward and may_join_later(
        plan, [*arguments, *([] if held_back is not None else weights)]
    ):
        # NOTE [ Pullbacks joined later ]; made last before the node, whose input it is
        state.pending = PendingJoin()
        made = join_input(state.pending, held_back)
        if made is None:
            state.pending = None
        else:
            join.append(made)
    n_unwrapped = 3 + len(arguments)  # NOTE [ Applying a Function with many inputs ] in _function
    inputs = (state, _ANCHOR, len(arguments), *arguments, *weights, *plan.params, *join)
    return list(direct_apply(CallerGraphSum, n_unwrapped, *inputs))


# NOTE [ Weights' gradients held back by the join ]
# A node that returns the weights' gradient did not hand its pullbacks over (NOTE [ Pullbacks
# joined later ] in _function): where the weight tensor is a leaf, the engine accumulates into
# its ``.grad`` right after the node, before a failing pullback is joined (found by
# tests/test_differential.py). Learned weights are mostly made from a leaf (``softmax(logits)``),
# and the gradient of a tensor made by a node goes on only when that node runs: the engine runs
# the ready node of highest sequence number first, AccumulateGrads before any other, so a node
# made before the join node, in the same thread (sequence numbers are counted per thread), runs
# after it, and not at all where the join raises. So the node hands its pullbacks over where the
# weight tensor is made on the CPU by a node with a lower sequence number than the join node's;
# the weights' gradient does not depend on the pullbacks (the outputs kept from the forward times
# the sum's gradient), so the node returns it at once. 64 tiny MLP classes with a softmax's
# weights, on 2 cores: a step 1.023x and 1.025x faster (against the code before, in one process).
# A weight tensor that is a leaf, on another device (whose nodes run on the device's thread), or
# made by a later node (in another thread) has its gradient returned with the pullbacks joined
# in the node, as before. ParallelSum's node hands its pullbacks over so too where it reduces
# the weights' gradient at once (NOTE [ Weight gradients at once ] in _function), not chunk by
# chunk in its pullbacks.


def made_to_need_grad(tensors: Sequence[Tensor], needs: Sequence[bool]) -> list[Tensor]:
    """The arguments that need a gradient now and did not before the forwards (``needs``),
    each once."""
    flipped: dict[int, Tensor] = {}
    for t, need in zip(tensors, needs):
        if not need and t.requires_grad:
            flipped.setdefault(id(t), t)
    return list(flipped.values())


# Every node's first tensor input: whether the running backward runs the anchor's AccumulateGrad
# (which receives None) says whether it accumulates into every leaf (NOTE [ Accumulating in the
# pullback ] in _function). One for all calls: a new leaf and its AccumulateGrad on every call
# cost 50-60 us of a step's forward in place (16 MLPs of widths 128-512, batch 64, one thread),
# for a node that only answers that question. On the CPU whatever the default device at import.
_ANCHOR = torch.empty(0, requires_grad=True, device="cpu")
INTERNAL_LEAVES.append(_ANCHOR)
_ANCHOR_NODE = _edge(_ANCHOR).node


class CallerGraphSum(torch.autograd.Function):
    """The sum of models run in the caller's graph (computed beforehand by ``run_forward``);
    see NOTE [ The caller's graph ]. Inputs: ``(state, anchor, n_args, *arguments,
    [weight_tensor], *params)``, ``arguments`` being those that need a gradient."""

    @staticmethod
    def forward(
        ctx: Any, state: _State, anchor: Tensor, n_args: int, *tensors: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.state = state
        ctx.plan = state.plan  # for _once_differentiable
        ctx.before_backward = None
        ctx.n_args = n_args
        has_weights = state.plan.has_weight_tensor
        ctx.call_tensors = tensors[: n_args + int(has_weights)]
        if has_weights:
            ctx.save_for_backward(tensors[n_args])
        leaves, state.leaves = state.leaves, []  # held by the state, they would be a cycle
        return tuple(leaves)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Tensor | None, ...]:
        _pool.abandon_unjoined()  # a backward interrupted before: NOTE [ Interrupted callers ]
        if (
            torch.is_grad_enabled()
            and second_order_fits(ctx)  # NOTE [ Double backward ]
            and not any(compensated_writes(ctx) or ())
        ):
            return differentiable_backward(ctx, grad_outputs)
        return _pull_back_models(ctx, *grad_outputs)


def compensated_writes(ctx: Any) -> list[bool] | None:
    """Whether the running backward accumulates into each parameter of a ``CallerGraphSum``
    node that has a slot in a compensated FlatGrad, which the node then writes itself (NOTE
    [ A compensated FlatGrad in the caller's graph ]); None where none has."""
    plan = ctx.state.plan
    slots = plan.walk.slots_in_flat_grads
    if not (slots.any_slot() and slots.compensated()):
        return None
    if engine_runs_all([_ANCHOR_NODE])[0]:
        return [True] * len(plan.params)
    # backward(inputs=...): those it names; autograd.grad: none
    first_param = 1 + ctx.n_args + int(plan.has_weight_tensor)
    nodes = ctx.next_functions[first_param : first_param + len(plan.params)]
    return engine_runs_all([node for node, _ in nodes])


@_once_differentiable
def _pull_back_models(ctx: Any, *grad_outputs: Tensor) -> tuple[Tensor | None, ...]:
    """CallerGraphSum's backward: the models pulled back, their gradients not differentiable."""
    state: _State = ctx.state
    plan = state.plan
    edges = state.edges
    if edges is None:
        raise freed_graph_error(plan)
    if plan.has_weight_tensor and ctx.needs_input_grad[3 + ctx.n_args]:
        check_outputs_kept(plan, state.outputs, state.output_versions)
    check_groups(plan, state.groups)
    keep_graph = keeps_models_graphs(state)
    if not keep_graph:
        state.edges = None  # the models' graphs go when this backward ends
        state.groups = None  # and the groups' stacked copies with them
    weight_tensor = ctx.saved_tensors[0] if plan.has_weight_tensor else None
    n_args = ctx.n_args
    aliases = state.aliases
    # NOTE [ Arguments made to need a gradient ] in _function: the node's last arguments,
    # which the models read themselves (no aliases)
    flipped = state.flipped
    n_aliased = n_args - len(flipped)
    weight_part: list[Tensor | None] = []
    if weight_tensor is not None:
        weight_grad = None
        if ctx.needs_input_grad[3 + n_args]:
            weight_grad = weight_grad_of(weight_tensor, grad_outputs, state.outputs)
            if not keep_graph:
                state.outputs = []
                state.attached = None
        weight_part.append(weight_grad)
    params = plan.params
    wrt_params = state.wrt_params
    joined = (None,) if state.pending is not None else ()  # the join node's gradient
    # NOTE [ One pullback for a sum and its derivatives ] in _double_backward
    runs_all = engine_runs_all([_ANCHOR_NODE])[0]
    merged = merge_first_order(ctx, grad_outputs, weight_tensor, runs_all)
    if merged is not None:
        carried = merged[2]  # NOTE [ The weights' gradient carried by the sum's node ]
        if carried is not None:
            assert weight_part, "a weight leaf's gradient carried by a node without weights"
            own = weight_part[0]
            weight_part[0] = carried if own is None else own + carried
        return (None, None, None, *merged[0], *weight_part, *merged[1], *joined)
    # NOTE [ Parameters trained in several threads ] in _grads (noted on every backward)
    trainers = plan.walk.trainers
    several_threads = trainers.several(_notes_a_trainer(grad_outputs))
    # Accumulating in the pullback must be undone on a failure: every .grad None, or a
    # FlatGrad's view known to be zero (NOTE [ FlatGrad in the caller's graph ]).
    zeroed: list[Tensor] | None = []
    flat_slots = plan.walk.slots_in_flat_grads
    flat_grads = flat_slots.any_slot()
    compensated = flat_grads and flat_slots.compensated()
    if compensated:  # NOTE [ A compensated FlatGrad in the caller's graph ]
        zeroed = None
    elif flat_grads:
        zeroed = flat_slots.zeroed_views()
    # Identity tests: ``list.count(None)`` would call Tensor.__eq__ on every .grad that is
    # set, about 9 us each (96 parameters with their .grad set: 0.9 ms a backward).
    elif (
        not plan.walk.params_are_leaves  # aliases (their .grad is not theirs to read)
        or any(map(operator.is_not, map(_grad_of, params), itertools.repeat(None)))
        # Autograd calls post-accumulate hooks also for the None this node returns.
        or (not plan.walk.hookless_params() and any(map(post_accumulate_hooks, params)))
    ):
        zeroed = None
    # NOTE [ Parameters several models use in the caller's graph ]
    shared = plan.shared
    shared_any = any(shared)
    shared_params = plan.shared_params() if shared_any else []
    shared_at_once = shared_any and plan.shared_at_once()  # NOTE [ Shared gradients at once ]
    # NOTE [ Row-sparse gradients ] in _sparse: a shared table's take_rows gradients
    # uncoalesced, for a RowSparseAccumulator to sum in the wide dtype
    deferred = (
        functools.partial(coalesce_later, shared_params) if shared_any else contextlib.nullcontext
    )
    # NOTE [ Tensor hooks in the caller's graph ]: a hooked parameter's gradient is returned
    accumulate = (
        zeroed is not None
        and not ctx.create_graph
        and runs_all
        and not shared_any
        and wrt_params is params
    )
    # Accumulated into, a flipped argument's .grad must be None for a failure to undo it.
    accumulate = accumulate and all(f.grad is None for f in flipped)
    accumulate = accumulate and (state.made_in_forward is not None or not several_threads)
    # NOTE [ Gradients not wanted ]
    wanted = None if runs_all else wanted_of_sum(ctx, n_args)
    arguments_wanted = wanted is None or any(wanted[:n_args])
    if state.made_in_forward is not None and not accumulate:
        # Captured, their gradients would be lost (NOTE [ Parameters made in forward ]).
        raise ParsumError(state.made_in_forward)
    weighted = weight_tensor is not None or plan.weights is not None
    param_grads: list[Tensor | None] = [None] * len(params)
    # The arguments' gradients, each chunk's summed as soon as its models are pulled back
    # and added in chunk order (NOTE [ Argument gradients chunk by chunk ]), or every model's
    # added at the end (NOTE [ Argument gradients at once ] in _summation).
    totals: dict[int, Any] = {}
    at_once = (
        aliases is not None
        and not flipped
        and terms_at_once(len(plan.models), ctx.call_tensors[:n_args])
    )
    if not params and aliases is None and not flipped:
        return (None, None, None, *weight_part)
    writes = None
    accumulates = compensated_writes(ctx) if compensated else None
    if accumulates is not None and any(accumulates):
        writes = FlatWrites(params, accumulates, slots=flat_slots)
    split = writes is not None and sum(map(Tensor.numel, params)) > FLAT_WRITE_ELEMENTS
    error: BaseException | None = None
    # The models each failing chunk was pulling back when it failed.
    failing: dict[int, list[int]] = {}
    graphs = edges  # as narrowed here, for the function below
    by_weight = WeightedCotangents(grad_outputs)
    given = weight_values(weight_tensor)  # NOTE [ A weight tensor read as floats ] in _function

    def edges_and_cotangents(running: Sequence[int]) -> tuple[list[Any], list[Tensor]]:
        """The output edges of models ``running`` and their gradients."""
        outs = [edge for i in running for edge, _ in graphs[i]]
        if weighted:
            cots: list[Tensor] = []
            for i in running:
                cotangents = by_weight.of(plan.weight(i, given))
                cots.extend(cotangents[j] for _, j in graphs[i])
        else:
            cots = [grad_outputs[j] for i in running for _, j in graphs[i]]
        return outs, cots

    def by_elements(running: Sequence[int]) -> list[list[int]]:
        """``running`` in runs whose parameters hold at most FLAT_WRITE_ELEMENTS together
        (a larger model alone)."""
        groups: list[list[int]] = []
        held = FLAT_WRITE_ELEMENTS
        for i in running:
            size = sum(params[s].numel() for s in plan.param_slots[i])
            if held + size > FLAT_WRITE_ELEMENTS:
                groups.append([])
                held = 0
            groups[-1].append(i)
            held += size
        return groups

    def apart(running: list[int]) -> list[list[int]]:
        """``running`` with each model that uses a parameter another of them uses alone,
        after the others (NOTE [ Parameters several models use in the caller's graph ])."""
        users = collections.Counter(
            s for i in running for s in set(plan.param_slots[i]) if shared[s]
        )
        alone = [i for i in running if any(users[s] > 1 for s in plan.param_slots[i] if shared[s])]
        if not alone:
            return [running]
        rest = [i for i in running if i not in alone]
        return [*([rest] if rest else []), *([i] for i in alone)]

    def capture(
        running: Sequence[int],
        captured: dict[int, Sequence[Tensor | None]],
        shared_part: dict[int, Any],
    ) -> list[tuple[int, Tensor | None]] | None:
        """Pull back models ``running`` in one engine call that returns the gradients it
        wants: the parameters' stored (or written into their slots), the aliases' in
        ``captured``, those of parameters several models use added to ``shared_part``; the
        flipped arguments' returned. None where it wants none."""
        slots = [s for i in running for s in plan.param_slots[i]]
        if wanted is not None:
            slots = [s for s in slots if wanted[n_args + s]]
        mine = []
        if aliases is not None and arguments_wanted:
            mine = [a for i in running for a in aliases[i]]
        flips = [j for j in range(n_aliased, n_args) if wanted is None or wanted[j]]
        if not slots and not mine and not flips:
            return None
        outs, cots = edges_and_cotangents(running)
        wrt = [*(wrt_params[s] for s in slots), *mine, *(flipped[j - n_aliased] for j in flips)]
        with deferred():
            found = pull_back(outs, wrt, cots, keep_graph)
        del outs, cots
        to_flat = []
        for slot, grad in zip(slots, found):
            if shared[slot]:  # a term of its sum, in model order
                if grad is not None:
                    (add_term if shared_at_once or vmapped else add_grad)(shared_part, slot, grad)
            elif writes is not None and grad is not None and slot in writes:
                to_flat.append((slot, grad))
            else:
                param_grads[slot] = grad
        if to_flat:
            assert writes is not None
            writes.write(to_flat)
            del to_flat
        if mine:
            at = len(slots)
            for i in running:
                captured[i] = found[at : at + n_aliased]
                at += n_aliased
        # A flipped argument's gradient: the models' parts, added by the engine in the order
        # of their graphs, one thread
        return list(zip(flips, found[len(found) - len(flips) :]))

    def pull_back_chunks(k: int, chunks: Sequence[int]) -> dict[int, Any] | None:
        """Pull back the models of ``chunks`` in one engine call (NOTE [ Engine calls of
        the caller's graph ]); a failure is recorded under ``k``. The chunks' argument
        gradients summed, where arguments need them."""
        captured: dict[int, Sequence[Tensor | None]] = {}  # argument gradients returned
        shared_part: dict[int, Any] = {}  # NOTE [ Parameters several models use in ...
        flip_grads: list[tuple[int, Tensor | None]] = []
        running = [i for c in chunks for u in plan.chunks[c] for i in plan.units[u].models]
        running = [i for i in running if graphs[i]]  # an output that needs a gradient
        if not running:
            return None
        failing[k] = running
        if accumulate:  # into every leaf, as the running backward would: no inputs
            # (the arguments' aliases included: each model's are leaves of its own)
            outs, cots = edges_and_cotangents(running)
            pull_back(outs, (), cots, retain_graph=keep_graph, accumulate=True)
        else:
            # A compensated FlatGrad's slots: at most FLAT_WRITE_ELEMENTS captured at once, as
            # ParallelSum holds them (NOTE [ A compensated FlatGrad in the caller's graph ])
            groups = by_elements(running) if split and not flipped else [running]
            if shared_any:
                groups = [apart_group for group in groups for apart_group in apart(group)]
            ran = []
            for group in groups:
                failing[k] = group  # the models whose graphs a failure leaves to search
                ran.append(capture(group, captured, shared_part))
            if all(flips is None for flips in ran):  # nothing wanted
                del failing[k]
                return None
            flip_grads = [g for flips in ran for g in flips or ()]
        del failing[k]
        if aliases is None and not flip_grads and not shared_part:
            return None
        if vmapped:  # NOTE [ Gradients under vmap ]: added at the end, out of place
            vmapped_captured.update(captured)
            (chunk,) = chunks  # one chunk a call
            vmapped_flipped[chunk] = flip_grads
            vmapped_shared[chunk] = shared_part
            return None
        accs: dict[int, Any] = {}
        if aliases is not None:
            accs = _chunk_argument_gradients(plan, chunks, aliases, captured, at_once)
        for j, grad in flip_grads:
            if grad is not None:
                add_grad(accs, j, grad)
        for slot, part in shared_part.items():  # merged in chunk order as the arguments'
            accs[-1 - slot] = part
        return accs

    def add_in_order(k: int, partial: dict[int, Any] | None) -> None:
        for key, acc in (partial or {}).items():  # a shared parameter's under -1 - slot
            merge_argument_grads(totals, {key: acc}, at_once if key >= 0 else shared_at_once)

    n_chunks = len(plan.chunks)
    # A model with CPU parameters may still return CUDA tensors: then this backward runs
    # on the device's thread, which helpers would wait on (NOTE [ Device threads ]). And
    # where the pullbacks may draw random numbers again (NOTE [ Random numbers replayed in
    # backward ] in _random).
    # NOTE [ Gradients under vmap ]
    vmapped = any(map(under_vmap, grad_outputs))
    vmapped_captured: dict[int, Sequence[Tensor | None]] = {}
    vmapped_flipped: dict[int, list[tuple[int, Tensor | None]]] = {}
    vmapped_shared: dict[int, dict[int, list[Tensor]]] = {}
    one_thread = plan.one_thread_backward or _on_device_thread(grad_outputs) or vmapped
    workers = 1 if one_thread else plan.n_workers
    # NOTE [ Pullbacks that write shared state ] in _function
    looked = pullback_snapshot(plan, _pool.threads_for(n_chunks, workers) > 1)
    if plan.ordered_pullbacks:
        workers = 1
    pending = state.pending

    def undo() -> None:
        """What the pullbacks accumulated, undone after a failure."""
        for alias in (a for mine in aliases or () for a in mine):
            alias.grad = None  # what a model that ran accumulated
        # What they were, none of it stays; unless another thread trains them since this
        # backward started (NOTE [ Parameters trained in several threads ] in _grads)
        if accumulate and not trainers.several(note=False):
            for f in flipped:
                f.grad = None
            assert zeroed is not None
            kept = {id(view) for view in zeroed}  # zeroed views; every other .grad None
            for view in zeroed:
                view.zero_()
            for p in params:
                if id(p.grad) not in kept:
                    p.grad = None

    def pulled_back(i: int) -> bool:
        """Whether the engine call that pulled model ``i`` back could run its graph."""
        if accumulate or flipped or (aliases is not None and arguments_wanted and aliases[i]):
            return True
        return any(wanted is None or wanted[n_args + s] for s in plan.param_slots[i])

    def raise_failure(error: BaseException) -> None:
        """Raise ``error``, or the error of the first model that fails, named."""
        running = failing[min(failing)] if failing else []
        # Capturing, the failed engine call ran only what leads to an input it wanted: a model
        # with none (a constant times an argument whose gradient is not asked) was never run,
        # and its kept graph had said that the call did not run from the last model to the
        # first (NOTE [ A failure that does not repeat ]; a model before it was then named).
        running = [i for i in running if pulled_back(i)]
        # The frames' references dropped: an error whose traceback holds a frame that
        # holds it is a cycle, which keeps the models' graphs alive until the garbage
        # collector runs.
        try:
            if isinstance(error, Exception):
                if len(running) == 1:
                    raise plan.model_error(running[0], "backward", error)
                mine = [e if i in running else [] for i, e in enumerate(graphs)]
                _raise_first_failure(
                    plan,
                    mine,
                    grad_outputs,
                    weight_tensor,
                    error,
                    aliases,
                    not keep_graph,
                    wrt_params,
                )
            raise error
        finally:
            error = None  # type: ignore[assignment]

    # NOTE [ Pullbacks in runs of chunks ]
    runs: Mapping[int, range] | None = None
    claim_order = plan.claim_order
    callers_last = plan.callers_last
    threads = _pool.threads_for(n_chunks, workers)
    if (
        threads > 1
        and state.in_order
        and aliases is None
        and not shared_any  # each chunk's sum of them its own, as on any number of threads
        and plan.run_costs is not None
    ):
        runs, claim_order = pullback_runs(plan.run_costs, threads)
        callers_last = False

    def pull_back_one(k: int) -> dict[int, Any] | None:
        if runs is None:
            return pull_back_chunks(k, (k,))
        chunks = runs.get(k)
        if chunks is None:  # pulled back with the first chunk of its run
            return None
        return pull_back_chunks(k, chunks)

    if pending is not None and accumulate and aliases is None:
        # NOTE [ Pullbacks joined later ]; NOTE [ Slots filled after the join ] in _grads
        held = flat_slots.hold_unset() if flat_grads else []
        unjoined: weakref.finalize | None = None
        finish: Callable[[], None] | None = None  # made below

        def abandoned() -> None:  # NOTE [ Interrupted callers ] in _pool
            if finish is not None and pending.finish is finish:
                pending.finish = None
            undo()
            if unjoined is not None:
                unjoined.detach()
            release_slots(held, fill=False)

        try:
            job = _pool.start_ordered(
                pull_back_one, n_chunks, workers, add_in_order, claim_order, callers_last,
                abandoned,
            )  # fmt: skip
        except BaseException:
            _pool.abandon_unjoined(leaving=True)
            raise
        if job is None:
            release_slots(held, fill=False)  # nothing ran
        else:
            # Released when the graph goes, where the join never runs.
            unjoined = weakref.finalize(pending, release_slots, held, False) if held else None

            def join() -> None:
                failure: BaseException | None = None
                try:
                    _pool.join(job)
                except BaseException as exc:
                    undo()
                    failure = exc
                if unjoined is not None:
                    unjoined.detach()
                    release_slots(held, fill=failure is None)
                if failure is not None:
                    try:
                        raise_failure(failure)
                    finally:
                        failure = None
                learn_pullback_writes(plan, looked)

            pending.finish = finish = join
            return (None, None, None, *weight_part, *param_grads, *joined)
    try:
        if plan.ordered_pullbacks and (
            plan.args_made_to_need_grad or not (state.in_order and aliases is None)
        ):
            _pool.run_last_first(pull_back_one, n_chunks, add_in_order)
        elif threads <= 1:
            # The chunks' threads; chunk by chunk on the budget's threads where a model made
            # an argument need a gradient (NOTE [ Arguments made to need a gradient ] in
            # _function).
            made = plan.args_made_to_need_grad
            with _pool.as_one_task(1 if made else n_chunks):
                if state.in_order and (aliases is None or at_once) and not made and not shared_any:
                    add_in_order(0, pull_back_chunks(0, range(n_chunks)))
                else:  # forwards on several threads: each chunk's ran in order
                    for k in range(n_chunks):
                        add_in_order(k, pull_back_one(k))
        else:  # NOTE [ The caller's graph on several threads ]
            _pool.run_ordered(
                pull_back_one,
                n_chunks,
                workers,
                add_in_order,
                claim_order if aliases is None else None,  # NOTE [ Argument
                callers_last,  # gradients chunk by chunk ]
            )
    except BaseException as exc:
        undo()
        if writes is not None:
            writes.rollback()
        error = exc
    if error is not None:
        try:
            raise_failure(error)
        finally:
            error = edges = None
    if writes is not None:
        writes.commit()
    learn_pullback_writes(plan, looked)
    arg_grads: list[Tensor | None] = [None] * n_args
    if aliases is not None or flipped:
        if vmapped:
            terms: list[list[Tensor]] = [[] for _ in range(n_args)]
            for _, grads in sorted(vmapped_captured.items()):  # model by model
                for j, g in enumerate(grads):
                    if g is not None:
                        terms[j].append(g)
            for _, flip_grads in sorted(vmapped_flipped.items()):  # chunk by chunk
                for j, g in flip_grads:
                    if g is not None:
                        terms[j].append(g)
            arg_grads = list(map(_wide_sum, terms))
        else:
            with _pool.as_one_task(n_chunks):  # NOTE [ Spinning intra-op threads ] in _pool
                arg_grads = [argument_grad(totals, j, at_once) for j in range(n_args)]
        if not keep_graph:
            state.aliases = None
    if shared_any:  # NOTE [ Parameters several models use in the caller's graph ]
        if vmapped:
            by_slot: dict[int, list[Tensor]] = {}
            for _, part in sorted(vmapped_shared.items()):  # chunk by chunk
                for slot, slot_terms in part.items():
                    by_slot.setdefault(slot, []).extend(slot_terms)
            for slot, slot_terms in by_slot.items():
                param_grads[slot] = _wide_sum(slot_terms)
        else:
            with _pool.as_one_task(n_chunks):
                for key in [key for key in totals if key < 0]:
                    param_grads[-1 - key] = argument_grad(totals, key, shared_at_once)
    return (None, None, None, *arg_grads, *weight_part, *param_grads, *joined)


# NOTE [ Gradients under vmap ]
# ``torch.autograd.grad(..., is_grads_batched=True)`` (``torch.autograd.functional.jacobian``
# and ``hessian`` with ``vectorize=True``) runs the backward under vmap: the incoming gradients
# are batched, and the compensated sum's in-place and ``out=`` kernels have no batching rule
# ("Batching rule not implemented for aten::add.out"). There the pullback runs in the calling
# thread and the arguments' gradients are added at the end, model by model, in the wide dtype
# out of place (``_wide_sum``, as derivatives of higher order add them); the parameters'
# need no sum.
#
# NOTE [ Argument gradients chunk by chunk ]
# Each model reads the arguments through aliases of its own, whose gradients are added with
# ParallelSum's compensated sum: model by model within a chunk, then the chunks in order. A
# chunk's sum is taken as soon as its models are pulled back, in the thread that pulled them
# back, its models' gradients dropped, and added to the total in chunk order as soon as the
# chunks before it are (``run_ordered``'s consume), so that a call holds the total, the sums of
# chunks that finished before those in front of them, and the gradients of the chunks being
# pulled back, never one gradient a model: 32 small heads reading a 4096 x 512 batch that
# needs a gradient peaked 300 MiB above the plain loop (a float64 sum of 16 MiB a chunk kept
# for every chunk to the end), at one thread also where one engine call pulled back every
# chunk. At one thread such chunks are pulled back one engine call each, unless every model's
# gradients together are small (NOTE [ Argument gradients at once ] in _summation).


def _chunk_argument_gradients(
    plan: SumPlan,
    chunks: Sequence[int],
    aliases: list[list[Tensor]],
    captured: dict[int, Sequence[Tensor | None]],
    at_once: bool,
) -> dict[int, Any]:
    """The argument gradients of the models of ``chunks`` summed, model by model in model
    order, or with ``at_once`` listed so (NOTE [ Argument gradients at once ] in _summation),
    from each model's aliases (``.grad``, where the pullback accumulated into every leaf, taken
    so that a retained graph's next backward starts from None again) or ``captured``."""
    accs: dict[int, Any] = {}
    add = add_term if at_once else add_grad
    for u in (u for c in chunks for u in plan.chunks[c]):
        for i in plan.units[u].models:
            grads = captured.pop(i, None)
            if grads is None:
                grads = list(map(_grad_of, aliases[i]))
                for alias in aliases[i]:
                    alias.grad = None
            for j, g in enumerate(grads):
                if g is not None:
                    add(accs, j, g)
    return accs


_grad_of = operator.attrgetter("grad")


def _raise_first_failure(
    plan: SumPlan,
    edges: list[list[tuple[GradientEdge, int]]],
    grad_outputs: Sequence[Tensor],
    weight_tensor: Tensor | None,
    original: Exception,
    aliases: list[list[Tensor]] | None,
    freed_as_it_went: bool,
    wrt_params: Sequence[Tensor | GradientEdge],
) -> None:
    """Pull each model back alone, in order, and raise naming the first that fails, with its
    own error; or, where none fails again or a graph the failed call freed does, name with
    ``original`` the model the failed call was running (NOTE [ A failure that does not
    repeat ]); or, where ``original`` is itself a freed graph's error, the model whose graph
    reaches one freed before the call (NOTE [ Graphs freed before the call ])."""
    outputs = [[e for e, _ in m] for m in edges]
    if freed_by_the_failed_call(original):
        culprit = reaching_a_graph_freed_before(outputs)
        if culprit is not None:
            try:
                raise plan.model_error(culprit, "backward", original)
            finally:
                original = None  # type: ignore[assignment]  # no cycle through this frame
    # Unit by unit, in model order: a stacked group's models share one graph, made where its
    # first model's would be, read and pulled back together, named by the first (NOTE
    # [ Stacked groups in the caller's graph ]).
    units = plan.units
    running = None
    if freed_as_it_went:  # with the graphs kept, their saved tensors say nothing
        # Read before anything runs again.
        found = running_when_failed([[e for m in u.models for e in outputs[m]] for u in units])
        running = None if found is None else units[found].models[0]
    attempts = []
    for unit in units:
        wrt: list[Tensor | GradientEdge] = []
        outs: list[GradientEdge] = []
        cots: list[Tensor] = []
        for m in unit.models:
            wrt += [wrt_params[s] for s in plan.param_slots[m]]
            wrt += aliases[m] if aliases is not None else ()
            cotangents = SinglePullback.cotangents(grad_outputs, plan.weight(m, weight_tensor))
            outs += [e for e, _ in edges[m]]
            cots += [cotangents[j] for _, j in edges[m]]
        if not outs or not wrt:
            continue
        # Freed as they go where the failed call freed its graphs, which no backward can run
        # through again: a compiled model's backward (donated buffers) refuses to keep its
        # graph, and named, with its own error, a model that did not fail.
        attempt = functools.partial(pull_back, outs, wrt, cots, not freed_as_it_went)
        attempts.append((unit.models[0], attempt))
    groups = {u.models[0]: u for u in units if len(u.models) > 1}
    raise_first_failing_model(plan, attempts, original, running, groups)
