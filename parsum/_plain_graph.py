"""Models of known layers summed in the caller's graph with no node of parsum's.

# NOTE [ Known layers in a plain graph ]
# In the caller's graph (NOTE [ The caller's graph ] in _inline) one ``CallerGraphSum`` node
# stands for the sum: the models' graphs hang off the parameters, and the node's backward pulls
# them back in an engine call of its own, so that a model whose backward fails is named and no
# ``.grad`` is left changed. That costs, for every parameter, an edge from the node that the
# running engine walks to the parameter's AccumulateGrad with nothing to accumulate (1.8 us
# each: 0.7 ms of a 9 ms step for 64 tiny MLPs of 382 parameters), and for every model its
# output's edge, a detached copy and the node's Python. Models made only of layers whose
# backward cannot fail (Sequentials of ``nn.Linear`` and the elementwise activations of
# ``_engines.ELEMENTWISE``, dropout aside, run as their direct programs, NOTE [ Direct
# programs ] in _engines) need none of it where the call runs on one thread: their outputs, and
# each stacked group's batched output, are joined along a new first dimension in the order the
# general path adds its terms (chunk by chunk, unit by unit, a group's models in its order; one
# ``stack`` where no unit is a group: a step of 16 small heads one by one 1.04x faster than
# an unsqueeze a model and a ``cat``, in one process on one thread),
# weighted and summed with one wide reduction, as ``ChunkPartials`` adds terms at once (NOTE
# [ One reduction for small outputs ] in _summation), all of it differentiable: the caller's
# own backward then runs the models' nodes as it runs the plain loop's. The same operations on
# the same values give the same bits as the general path's (whose node returns ``g * w`` to
# each model, as the product's backward here does), at the intra-op threads the general path
# would run every chunk with; only where those are the caller's own (one chunk, or a budget of
# one). A failure in forward (a bad input, outputs that differ) runs the call the general way,
# which names the model; these layers change nothing when they run, the input excepted, which
# a first layer in place would change (such models go the general way).
# What is left to the general path: a weight tensor not read as floats (NOTE [ A weight
# tensor in a plain graph ]), an argument whose gradient is too large to sum at once (NOTE
# [ An argument that needs a gradient in a plain graph ]) or a parameter several models use
# whose gradients are (NOTE [ Parameters several models use in a plain graph ]), tensor
# hooks, FlatGrad slots, random layers, outputs other than float32 or too large to sum at
# once, other devices, autocast, anomaly detection and saved-tensor hooks (Python that the
# backward would run in the models' graphs, which may fail there), and calls on several
# threads.
#
# NOTE [ An argument that needs a gradient in a plain graph ]
# The argument's gradient is a sum over the models, which autograd would add in its own order,
# uncompensated. So where it needs one, each unit reads it through an alias of its own, an
# output of one ``_Reads`` node, whose backward sums the units' gradients in the order of
# the pieces (a stacked group's is its first model's term, as on the general path) with
# ``sum_terms``: the general path's own sum where the gradients fit one reduction (NOTE
# [ Argument gradients at once ] in _summation), the same bits, tested with a trunk's features
# as the argument. Larger ones, summed chunk by chunk there, go the general way. Against the
# code before in one process (bench_against.py, 30 rounds, 2 cores): with ``n_jobs=1`` on a
# budget of 1, a step with x.requires_grad_() 1.25x faster for 64 tiny MLPs (0.98x -> 1.22x
# the plain loop), 1.19x for 16 small heads, 16 MLPs of widths 128-512 at batch 64 unchanged;
# the gradient in x alone 1.34x, 1.25x and 1.10x. By default on a budget of 2, where such
# models now run in one chunk too (NOTE [ Known layers on one thread ]): a step 1.30x, 1.41x
# (0.66x -> 0.92x the plain loop) and, for the 16 MLPs at batch 32, 0.95x (their kernels weigh
# 1-2 times their Python: the trade-off of that note, a backward alone); the gradient in x
# alone 1.49x, 1.30x and 1.13x.
#
# NOTE [ A weight tensor in a plain graph ]
# A weight tensor that the general path reads as Python floats (a real floating-point one on
# the CPU: NOTE [ A weight tensor read as floats ] in _function) weighs the terms as those
# floats do. Where it needs a gradient (learned weights, ``softmax(logits)``), one node,
# ``_LearnedWeights``, weighs, sums and rounds the terms as the other path does, and its
# backward (after the check of NOTE [ Tensors written before the backward ]) gives each term
# ``g * w`` with the weight taken from the tensor, rounded as the forward's float, and the
# weights' gradient by ``weight_grad_of``, the general path's own, from the outputs it saved
# (each model's in model order, a stacked group's rows included): the same bits, tested
# against the caller's graph and ParallelSum at n_jobs 1-3 for a leaf, a softmax and a frozen
# tensor. Both from tensors with their graphs, so that a derivative under create_graph=True
# (a penalty on the weights' or the parameters' gradients) reaches the weights and the
# parameters as the plain loop's does (tested): the weights as floats alone, in a first
# version, gave a second derivative without the weights' part. The tensor is saved for
# backward as there: written in place since, it raises. Against the session's first code in
# one process (bench_against.py --rev f8c6510 --weights learned, 30 rounds, 2 cores): by
# default 1.256x a step for 64 tiny MLPs, 1.409x for 16 small heads (0.59x -> 0.83x the
# unweighted plain loop), 0.961x for 16 MLPs of widths 128-512 at batch 32 (the trade-off of
# NOTE [ Known layers on one thread ]); the first version, against its parent, with n_jobs=1
# on a budget of 1: 1.296x, 1.234x and, at batch 64, 1.016x.
#
# NOTE [ Tensors written before the backward ]
# One failure in backward these layers can meet: a tensor their graph saved (a Linear's weight
# after the first layer, the argument) written in place between the forward and the backward
# (an optimizer's step taken early, a weight clipped by hand), which autograd finds as it
# reaches the node that saved it, with other models' gradients written already. The general
# path names the model and writes none. So the sum's rounding to float32 is a node of
# parsum's (``_CheckedRounding``), which the backward runs before any model's node: where the
# version counter of the argument or of a Linear layer's weight (a bias is never saved)
# changed since the forward, every tensor each model's graph saved is read, model after model
# in model order, as its backward would read it, and the first model whose graph raises is
# named with that error, as the general path names it, before any gradient is written. A
# change that no graph saved (a first layer's weight, a bias) raises nothing, as in the plain
# loop. The node's backward returns the gradient in float64, as the rounding's own node does:
# the same bits. Its cost, toggled in one process (one thread, 250 interleaved steps, twice):
# 64 tiny MLPs 1.3-1.4% of a step (about 0.11 ms), 16 small heads 1.3-2.9%. A pre-hook on the
# rounding's node doing the same check cost more (about 3% for the heads against the code
# before, which bench_against.py's two revisions also showed), and so did a Python wrapper of
# a node of the graph held for the check (the join's, now found from the node on failure).
#
# NOTE [ Known layers on one thread ]
# With n_jobs left unset, models of known layers whose kernels weigh less than
# PLAIN_GRAPH_MAX_KERNEL_SHARE times their Python (``_grouping.one_thread_pays``) run in one
# chunk in the calling thread on a budget of 2, as a plain graph, rather than on workers (their
# forwards too, or their pullbacks alone: NOTE [ Pullbacks of small models ] in _grouping): the
# workers paid for the caller's-graph node, its engine calls and per-model Python, which the
# plain graph does not have. Measured on 2 cores (interleaved in one process, against the code
# before: benchmarks/results/known-layers-plain-graph-2cores-fifty-ninth.txt): 16 heads of
# widths 32-80 at batch 64-1024 (C / O 0.2-2.0) 1.12-1.50x faster, 64 tiny Sequentials 1.19x,
# 16 MLPs of widths 128-512 at batch 16 1.12x. Between C / O 1 and 2 the choice depends on what
# follows the call: with an Adam step after each (a training step), one chunk ran those 16 MLPs
# at batch 32 and 48 1.05x and 1.02x faster than the workers, and the main example's 12 members
# (1.4) 1.07x; with a backward alone, 0.94x and 0.91x. One chunk is taken up to 2, for the
# training step; from 2.2 (batch 64) the two are alike with Adam (1.00x) and the workers stay.
# For a few hours of 2026-12-07 models that run alone (not stacked) went to workers from C / O 1:
# on that session's VM, with Adam after each call, the main example's 12 members at batch 64
# (C / O 1.38) ran 1.07x the plain loop on workers against 1.01x in one chunk, 16 MLPs of
# widths 128-512 at batch 32 and 48 1.045x and 1.025x faster on workers (bench_against.py, 40
# rounds); an hour later the two tied with Adam. The next session's VM, whose two vCPUs ran two
# threads of 256x256 matmuls only 1.3-1.6x as fast as one (most likely one core's two
# hyperthreads, as a 2-vCPU cloud VM gives), said the opposite, in one process against the code
# with that limit and against the code before it (``bench_against.py``, 40 rounds, two runs;
# the example's members, the MLPs at batch 32 and 48): with Adam after each call one chunk
# 1.016-1.027x, 1.023-1.035x and 1.001-1.030x as fast as the workers; forwards alone under
# no_grad 1.087-1.105x, 1.041-1.057x and 0.977-1.000x; a backward alone 1.001-1.036x,
# 1.004-1.008x and 0.967-0.975x. Which of the two wins between C / O 1 and 2 depends on the
# machine, by up to 10% either way. One chunk runs the models as the plain loop does: with Adam
# it ran 0.97-1.02x the plain loop on both VMs, the workers 0.91-1.07x. So the limit is 2 for
# every model again, the choice whose worst case is the better one.
# Not where a weight tensor is not read as floats, an argument's gradient is too large to sum
# at once, or the optimizer steps in the backward (the general path would run the one chunk);
# larger budgets are not measured (16 cores: ``benchmarks/run_16cores.sh``).
#
# NOTE [ Known layers with no graph ]
# Under no_grad or inference_mode (an ensemble's evaluation) the same models run the plain
# graph's forward, with nothing recorded: their outputs joined by one stack, weighted and summed
# with one wide reduction, where the general path runs each model through its forward with no
# graph (NOTE [ Forwards with no graph ] in _function) and adds the outputs with a chunk's
# partials: the same operations on the same values, so the same bits (tested against the general
# path at n_jobs 1-3 and against the sum with a graph, weights as floats, as a tensor and as a
# tensor that needs a gradient). Nothing the backward checks is taken (no backward follows; an
# inference tensor has no version to read). A plain graph, with a graph or without, teaches the
# walk what the general path's first call would have (NOTE [ Models seen not to draw ] in
# _random): known layers draw nothing. Without that, a call with no graph (``tests.zoo.learned``,
# a validation pass) left the walk unsure, and the next call on workers ran its forwards in model
# order on one thread. Against the code before in one process
# (bench_against.py --step eval, 60 rounds, 2 cores): 64 tiny MLPs 1.19x (0.85x -> 1.02x the
# plain loop), 16 heads of widths 32-80 at batch 64 1.16x and at 256 1.07x, 16 MLPs of widths
# 128-512 at batch 16 and 32 1.03x and 1.06x, the main example's members at batch 32 and 64
# 1.04x and 1.01x (1.06x in an earlier run); a training step unchanged (0.996-1.002x).
#
# NOTE [ Parameters several models use in a plain graph ]
# A parameter several models use (a trunk each model runs before its head, a model listed
# twice) gets a gradient that is a sum over its models, which autograd would add in its own
# order, uncompensated. So each use reads it through an alias of its own, an output of one
# ``_Reads`` node a parameter, whose backward adds the uses' gradients as the general
# path does (NOTE [ Parameters several models use in the caller's graph ] in _inline): in the
# order it pulls the models back, with one wide reduction (NOTE [ Shared gradients at once ]
# in _summation): the same bits, tested against the caller's graph and ParallelSum at n_jobs
# 1-3, with chunks of 3 models too. Only where they fit one reduction: the node receives
# every use's gradient together (autograd holds each until all have come), which the general
# path, adding them model by model, does not (16 heads over a 2048 x 2048 trunk at a budget
# of one took a process's peak resident memory to 0.66-0.68 GiB, the plain loop's to
# 0.39-0.41, the general path's to 0.45-0.62). Under create_graph=True it adds them as
# autograd would, differentiably (so does the general path, in one engine call).
# Until 2026-12-06 such calls kept the general path, whose pullback ran each model that uses
# one in an engine call of its own: 16 heads over one trunk that each model runs, batch 64, 2
# cores, 1.22x a step in one process against the code before (0.71x -> 0.87x the plain loop,
# by default and at n_jobs=1 on one thread alike).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node

from . import _pool
from ._engines import (
    ELEMENTWISE,
    LEAF_SPEC,
    CallArgs,
    DirectProgram,
    GroupReads,
    ModelParams,
    Unit,
    _version_of,
    batched_in_graph,
    direct_calls_allowed,
    program_of,
    program_reading,
    run_direct,
    unpack_saved,
)
from ._function import SumPlan, stacks_attached, weight_grad_of, weight_values
from ._grouping import Batch, one_thread_pays
from ._plans import Walk
from ._sparse import sum_terms
from ._summation import (
    one_weight,
    sums_at_once,
    terms_at_once,
    weigh_models,
    weigh_terms,
    wide_sum_over_models,
)

# Elementwise layers of a known layer program (random ones aside: NOTE [ Random numbers in
# forwards ] in _random).
_QUIET_ELEMENTWISE = frozenset(kind for kind in ELEMENTWISE if kind is not nn.Dropout)


def sum_in_plain_graph(
    plan: SumPlan,
    call: CallArgs,
    weights: Sequence[float] | None,
    weight_tensor: Tensor | None = None,
) -> Tensor | None:
    """The weighted sum of the models run in the caller's graph as plain autograd operations
    (NOTE [ Known layers in a plain graph ]); None where the call does not fit, or a forward
    failed (the general path then runs it, and names the model)."""
    if weight_tensor is not None:  # NOTE [ A weight tensor in a plain graph ]
        weights = _floats_of(weight_tensor)
        if weights is None:
            return None
    if not _fits(plan, call, weights):
        return None
    x = call.leaves[0]
    programs = plan.walk.programs
    models, units = plan.models, plan.units
    pieces: list[Tensor] = []
    groups: dict[int, GroupReads] = {}  # each stacked group's reads, by its piece
    order: list[int] = []
    placed: list[Unit] = []  # each piece's unit, whose first model a failure in backward names
    # NOTE [ An argument that needs a gradient in a plain graph ]: each unit's alias of it
    n_units = sum(map(len, plan.chunks))
    differentiated = torch.is_grad_enabled()  # NOTE [ Known layers with no graph ]
    reads = (
        _Reads.apply(x, n_units, False) if differentiated and x.requires_grad else (x,) * n_units
    )
    # NOTE [ Parameters several models use in a plain graph ]
    own_reads = _shared_reads(plan) if any(plan.shared) else {}
    try:
        for chunk in plan.chunks:
            for u in chunk:
                members = units[u].models
                read = reads[len(pieces)]
                if len(members) == 1:
                    program = programs[members[0]]
                    assert program is not None
                    model_reads = own_reads.get(members[0])
                    if model_reads is not None:
                        program = program_reading(program, model_reads)
                    piece = run_direct(program, read)
                else:
                    first = models[members[0]]
                    assert isinstance(first, nn.Module)  # a direct program's model
                    group = [plan.model_params[i] for i in members]
                    trainable, state, leaves, spec = batched_in_graph(first, group, (read,), {})
                    if spec != LEAF_SPEC:
                        return None
                    piece = leaves[0]
                    # NOTE [ Weights written before a group's backward ] in _engines (with no
                    # graph, no backward: an inference tensor has no version to read)
                    if differentiated:
                        groups[len(pieces)] = GroupReads.of(
                            trainable,
                            [mp.tensors for mp in group],
                            program_of(first),
                            (read,),
                            state,
                            group,
                        )
                if piece.dtype != torch.float32 or piece.layout != torch.strided:
                    return None
                pieces.append(piece)
                order.extend(members)
                placed.append(units[u])
        # Outputs of different shapes raise here (neither joins them by broadcasting). Where
        # every piece is one model's output, one stack joins them, with no unsqueezes.
        singles = [len(unit.models) == 1 for unit in placed]
        if all(singles):
            terms = torch.stack(pieces)
        else:
            terms = torch.cat([p.unsqueeze(0) if one else p for p, one in zip(pieces, singles)])
    except Exception:
        return None
    if not sums_at_once(1, terms):  # as many values as the models' outputs together
        return None
    walk = plan.walk
    walk.saw_no_draw(models)  # what the general path's first call learns: known layers draw nothing

    def guard() -> _Guard:
        """What the backward checks (NOTE [ Tensors written before the backward ])."""
        watched = [x, *walk.linear_weights]
        return _Guard(plan, placed, watched, list(map(_version_of, watched)), groups)

    if differentiated and weight_tensor is not None and weight_tensor.requires_grad:
        # NOTE [ A weight tensor in a plain graph ]
        assert weights is not None
        return _LearnedWeights.apply(terms, weight_tensor, guard(), weights, order)
    if weights is not None:  # as ``CompensatedAccumulator.add_all`` weighs its terms
        column = [weights[i] for i in order]
        terms = weigh_terms(terms, column, one_weight(column))
    wide = wide_sum_over_models(terms)
    if not wide.requires_grad:
        return wide.to(torch.float32)
    return _CheckedRounding.apply(wide, guard(), weight_tensor)


class _Reads(torch.autograd.Function):
    """``t`` as ``n`` aliases, one for each reader (a unit reading the argument, a model using
    a parameter several use), whose gradients are summed in the readers' order as the general
    path sums them: with its wide reduction (NOTE [ An argument that needs a gradient in a
    plain graph ], NOTE [ Parameters several models use in a plain graph ]); under
    create_graph, a parameter's (``as_autograd``) as autograd adds them, differentiably, as the
    general path's one engine call does, an argument's by the same reduction, differentiable
    too."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, n: int, as_autograd: bool) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)  # a reader whose graph does not reach t gives None
        ctx.as_autograd = as_autograd
        return tuple(t.view_as(t) for _ in range(n))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, None, None]:
        given = [g for g in grads if g is not None]
        if not given:
            return None, None, None
        if ctx.as_autograd and torch.is_grad_enabled():
            total = given[0]
            for g in given[1:]:
                total = total + g
            return total, None, None
        return sum_terms(given), None, None


def _shared_reads(plan: SumPlan) -> dict[int, dict[int, Tensor]]:
    """For each model that uses a parameter another model uses, the alias of it that the
    model reads, one ``_Reads`` node a parameter (NOTE [ Parameters several models use in
    a plain graph ]): model index -> {id of the parameter: its alias}."""
    users: dict[int, list[int]] = {}  # slot -> its models, in pullback order
    for chunk in plan.chunks:
        for u in chunk:
            for i in plan.units[u].models:
                for slot in plan.param_slots[i]:
                    if plan.shared[slot]:
                        users.setdefault(slot, []).append(i)
    found: dict[int, dict[int, Tensor]] = {}
    for slot, its_users in users.items():
        param = plan.params[slot]
        aliases = _Reads.apply(param, len(its_users), True)
        for i, alias in zip(its_users, aliases):
            found.setdefault(i, {})[id(param)] = alias
    return found


class _Guard(NamedTuple):
    """What the backward checks before it reaches any model (NOTE [ Tensors written before the
    backward ]): the tensors the models' graphs may have saved and their versions then, and
    each piece's unit, in the order the pieces are joined."""

    plan: SumPlan
    units: list[Unit]
    watched: list[Tensor]
    versions: list[int]
    groups: dict[int, GroupReads]  # each stacked group's, by its piece

    def check(self, node: Any) -> None:
        """Raise, naming the model, where a tensor the models' graphs saved was written in
        place since; ``node``: the node the backward runs, above the pieces' join."""
        if list(map(_version_of, self.watched)) != self.versions:
            _raise_first_failure(self.plan, self.units, _pieces_of(node), self.groups)


class _CheckedRounding(torch.autograd.Function):
    """The wide sum rounded to float32 (``.to(torch.float32)``), whose backward first checks
    that no tensor the models' graphs saved was written in place since (NOTE [ Tensors written
    before the backward ]). A node of parsum's own: a pre-hook on the rounding's node cost
    more. A weight tensor read as floats is saved here as the general path's node saves it
    (and the plain loop's products): written in place before the backward, autograd's error
    is raised before any model's gradient is written (it ran on with the forward's floats,
    where every other path and the plain loop raise)."""

    @staticmethod
    def forward(ctx: Any, wide: Tensor, guard: _Guard, weight_tensor: Tensor | None) -> Tensor:
        ctx.guard = guard
        ctx.before_backward = None  # Stack.attach_at_backward's, where it sets one
        if weight_tensor is not None:
            ctx.save_for_backward(weight_tensor)
        return wide.to(torch.float32)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        with stacks_attached(ctx):
            _ = ctx.saved_tensors  # read: a weight tensor written in place since raises
            ctx.guard.check(ctx)
        return grad.to(torch.float64), None, None


class _LearnedWeights(torch.autograd.Function):
    """The terms weighted by a weight tensor that needs a gradient, summed and rounded as
    ``_CheckedRounding`` rounds them (NOTE [ A weight tensor in a plain graph ]): forward with
    its values as the general path reads them, floats; backward with the tensor itself, so
    that derivatives of higher order reach the weights."""

    @staticmethod
    def forward(
        ctx: Any,
        terms: Tensor,
        weight_tensor: Tensor,
        guard: _Guard,
        weights: Sequence[float],
        order: list[int],
    ) -> Tensor:
        ctx.guard, ctx.order = guard, order
        ctx.before_backward = None  # Stack.attach_at_backward's, where it sets one
        ctx.save_for_backward(terms, weight_tensor)  # written in place since, it raises
        column = [weights[i] for i in order]
        # out of place: the terms are saved
        weighed = terms * column[0] if one_weight(column) else weigh_models(terms, column)
        return wide_sum_over_models(weighed).to(torch.float32)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        with stacks_attached(ctx):
            ctx.guard.check(ctx)
            terms, weight_tensor = ctx.saved_tensors
        order = ctx.order
        terms_grad = weight_grad = None
        if ctx.needs_input_grad[0]:
            # Each term's cotangent ``g * w``, as the product's backward gives it (the sum's
            # backward hands every term ``g`` itself), with the weight rounded as the forward
            # rounds it
            column = weight_tensor[torch.tensor(order)].to(torch.float32)
            terms_grad = grad.unsqueeze(0) * column.view(-1, *([1] * grad.dim()))
        if ctx.needs_input_grad[1]:
            rows = dict(zip(order, terms.unbind(0)))  # each model's output, in model order
            outputs = [[rows[i]] for i in range(len(rows))]
            weight_grad = weight_grad_of(weight_tensor, [grad], outputs)
        return terms_grad, weight_grad, None, None, None


def _pieces_of(node: Any) -> list[Node | None]:
    """The node of each piece the sum below ``node`` joined, in order: the join's edges, found
    under the weighing and the wide sum (a Python wrapper of the join's node held from the
    forward cost more than the check itself)."""
    below = node.next_functions[0][0]
    while below is not None and below.name() not in ("CatBackward0", "StackBackward0"):
        below = below.next_functions[0][0] if below.next_functions else None
    return [] if below is None else [edge[0] for edge in below.next_functions]


def _raise_first_failure(
    plan: SumPlan, units: list[Unit], roots: list[Node | None], groups: dict[int, GroupReads]
) -> None:
    """Raise, naming its model, the error that the first unit in model order whose graph
    saved a tensor changed since would raise in backward (a stacked group's model whose own
    tensor was written, else its first: ``groups``, by the unit's place); nothing where none
    would."""
    places = sorted(range(len(units)), key=lambda p: units[p].models[0])
    for place in places:
        unit, root = units[place], roots[place]
        reads = groups.get(place)
        found = None if reads is None else reads.first_saved_write([root])
        if found is not None:
            k, exc = found
            raise plan.model_error(unit.models[k], "backward", exc) from exc
        try:
            unpack_saved([root])
        except Exception as exc:
            raise plan.model_error(unit.models[0], "backward", exc, unit) from exc


def plain_graph_pays(
    walk: Walk,
    model_params: Sequence[ModelParams],
    batch: Batch,
    budget: int,
    tensors: Sequence[Tensor],
    weight_tensor: Tensor | None,
    stepping: bool,
) -> bool:
    """Whether ``auto`` runs the models in one chunk in the calling thread as a plain graph
    rather than their pullbacks on workers (NOTE [ Known layers on one thread ]), a choice made
    once a plan: the models' layers and sizes, whether an argument or a weight tensor is
    differentiated, whether the optimizer steps in the backward."""
    if stepping or budget != torch.get_num_threads():
        return False
    if weight_tensor is not None and _floats_of(weight_tensor) is None:
        return False
    if not _of_known_layers(walk) or len(model_params) < 2:
        return False
    # NOTE [ An argument that needs a gradient in a plain graph ]
    if any(t.requires_grad for t in tensors) and not (
        len(tensors) == 1 and terms_at_once(len(model_params), tensors)
    ):
        return False
    return one_thread_pays(model_params, batch, budget)


def _floats_of(weight_tensor: Tensor) -> list[float] | None:
    """A weight tensor's values as the general path's products read them, where they are
    Python floats (NOTE [ A weight tensor read as floats ] in _function); else None."""
    read = weight_values(weight_tensor)
    if not isinstance(read, list) or not all(type(w) is float for w in read):
        return None
    return read


def _fits(plan: SumPlan, call: CallArgs, weights: Sequence[float] | None) -> bool:
    """Whether the call can run as plain autograd operations (NOTE [ Known layers in a plain
    graph ]), the caller's-graph conditions (``fits_callers_graph``) holding already."""
    walk = plan.walk
    if not _of_known_layers(walk) or len(plan.models) < 2:
        return False
    if not direct_calls_allowed(call):  # one tensor argument, no global module hook
        return False
    x = call.leaves[0]
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        # NOTE [ An argument that needs a gradient in a plain graph ]
        and (not x.requires_grad or terms_at_once(len(plan.models), [x]))
        # NOTE [ Parameters several models use in a plain graph ]
        and (not any(plan.shared) or plan.shared_at_once())
        and (weights is None or all(type(w) is float for w in weights))
        and walk.params_are_leaves
        and walk.no_user_tensor_hooks()
        and not walk.slots_in_flat_grads.any_slot()
        and not torch.is_autocast_enabled("cpu")
        # Python the backward would run in the models' graphs, which may fail there
        and not torch.is_anomaly_enabled()
        and not _pool.saved_tensor_hooks_active()
        and not _pool.in_a_task()
        and _pool.threads_for(len(plan.chunks), plan.n_workers) <= 1
        and _pool.intra_op_threads(len(plan.chunks)) == torch.get_num_threads()
    )


def _of_known_layers(walk: Walk) -> bool:
    """Whether every model of the walk runs as a direct program of Linear layers and quiet
    elementwise ones, none of which writes into its input first (NOTE [ Known layers in a plain
    graph ]); found once a walk: its programs do not change."""
    if walk.known_layers is None:
        programs = walk.programs
        walk.known_layers = bool(programs) and _programs_of_known_layers(programs)
        if walk.known_layers:
            walk.linear_weights = [
                step[0] for p in programs if p for step in p.steps if isinstance(step, tuple)
            ]
    return walk.known_layers


def _programs_of_known_layers(programs: Sequence[DirectProgram | None]) -> bool:
    for program in programs:
        if program is None:
            return False
        for k, step in enumerate(program.steps):
            if isinstance(step, tuple):
                continue
            module = step()
            if type(module) not in _QUIET_ELEMENTWISE:
                return False
            if k == 0 and getattr(module, "inplace", False):
                return False
    return True
