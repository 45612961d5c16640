"""ParallelSum: forward fans out the models, backward fans out their pullbacks.

# NOTE [ Data flow ]
# forward: the pool maps fixed chunks of models; in a chunk each model runs through its engine
# (``_engines``), giving an output and a pullback; the weighted output is added into the
# chunk's compensated accumulator; chunk partials are combined in chunk order
# (NOTE [ Determinism ] in ``_summation``). Pullbacks are kept on ``ctx``.
# backward: the same chunks again; each pullback gives argument and parameter gradients;
# argument gradients and the gradients of parameters used by several models go into the chunk's
# accumulators (never all M held at once); every other parameter gradient is that model's
# alone and is returned as it is. A pullback is dropped as soon as it ran, so each model's graph
# is freed during backward, as in plain PyTorch.
#
# NOTE [ Failed calls change nothing ]
# backward raises before returning any gradient, so autograd accumulates nothing from this node
# into any ``.grad``. forward restores the buffers that torch.nn's modules update in forward in
# training mode (the running statistics of BatchNorm and InstanceNorm, the vectors of spectral
# normalization) to what they were before the call. A failed backward leaves them as forward
# left them, as in the plain loop, whose forward ran too. Other buffers are not copied:
# copying every buffer of a module in training mode on every call made 8 small models with a
# 1024 x 1024 mask buffer each run at 0.13x the plain loop (``bench_overhead.py --only
# buffers``; 0.60x without the copies). A custom module that updates a buffer in forward
# therefore keeps the update of a failed call, as it does in the plain loop.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.utils.checkpoint
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge
from torch.utils import _pytree as pytree

from . import _pool
from ._engines import (
    GLOBAL_BACKWARD_HOOKS,
    INTERNAL_LEAVES,
    LEAF_SPEC,
    ArgumentHooked,
    CallArgs,
    ForeignLeaves,
    GraphPullback,
    GroupReads,
    GroupWritten,
    ModelParams,
    SinglePullback,
    Unit,
    UnitPullback,
    UnitRun,
    WeightedCotangents,
    _edge,
    _version_of,
    check_argument_hooks,
    check_no_graph_needed,
    check_own_leaves,
    check_weight_tensor,
    direct_calls_allowed,
    flatten_output,
    graph_nodes,
    leaf_of,
    model_arguments,
    model_kind,
    output_edges,
    pull_back_together,
    run_direct,
    run_through_views,
    shared_snapshot,
    stacked_in_graph,
    unit_forward,
    version_of,
    written_after_return,
    wrote_shared,
)
from ._errors import ParsumError, message_of, model_failed
from ._fused import MERGED_STEP_ELEMENTS, StepInBackward, stepped_twice
from ._grads import FlatWrites, engine_runs_all, has_flat_grads
from ._locks import Lock
from ._random import (
    Turns,
    draw_noise,
    generator_states,
    may_recompute,
    warn_drawn_on_threads,
    warn_thread_timing,
)
from ._sparse import (
    add_grad,
    add_term,
    argument_grad,
    coalesce_later,
    merge_argument_grads,
)
from ._summation import (
    ChunkPartials,
    CompensatedAccumulator,
    sums_at_once,
    terms_at_once,
    weigh_models,
    wide_sum_over_models,
)

if TYPE_CHECKING:
    from ._plans import Walk

# Exceptions that are torch's control flow, not a model's failure: non-reentrant checkpointing
# around sum_models stops its recomputation with one once it has what it needs.
_CONTROL_FLOW: tuple[type[BaseException], ...] = tuple(
    t for t in [getattr(torch.utils.checkpoint, "_StopRecomputationError", None)] if t is not None
)

# (structure, ((shape, dtype, device) per leaf)) of one model's output.
Signature = tuple[pytree.TreeSpec, tuple[tuple[torch.Size, torch.dtype, torch.device], ...]]


@dataclass
class SumPlan:
    """Everything a ``ParallelSum`` call needs besides its tensors; built by ``sum_models``.

    Attributes:
        models: the models, in order.
        call: the call's arguments flattened; its tensor leaves are ``ParallelSum`` inputs.
        weights: python-float weights, or None (no weights, or a weight tensor input).
        has_weight_tensor: whether a 1-D weight tensor follows the argument tensors.
        params: every trainable parameter of every model, once each; the last inputs.
        model_params: per model, what a walk over its modules found (its trainable
            parameters are what its pullback differentiates).
        param_slots: per model, the index in ``params`` of each of its parameters.
        shared: per entry of ``params``, whether more than one model entry uses it.
        engine: the engine asked for ("autograd", "vjp", "stacked", "auto").
        units: models that run as one (a model, or a stacked group); each has its engine.
        chunks: the units of each task; never decided by ``n_workers`` (NOTE [ Chunks ]).
        claim_order: the order threads claim the chunks in (NOTE [ Costliest chunks first ] in
            _grouping); None: chunk order.
        callers_last: whether the last chunk in ``claim_order`` is left to the calling thread
            (NOTE [ The caller's last chunk ] in _pool).
        n_workers: threads for the call; ``forward_workers`` for forward (1 when models share
            buffers, which must then be updated in model order as in the plain loop).
        where: the public name to start error messages with.
        step_in_backward: the fused optimizer steps, or None; ``step_index`` gives each
            model's position in it.
        walk: the walk over the models the plan came from (NOTE [ Reused plans ] in _plans).
        one_thread_backward: whether the pullbacks must run on one thread, set by forward.
        ordered_pullbacks: whether the pullbacks run on the calling thread, the last model's
            first, as the plain loop's backward runs them; ``looks_at_pullbacks``: whether the
            backward looks for a write into what the models share (NOTE [ Pullbacks that write
            shared state ]).
    """

    models: list[Callable[..., Any]]
    call: CallArgs
    weights: list[float] | None
    has_weight_tensor: bool
    params: list[Tensor]
    model_params: list[ModelParams]
    param_slots: list[list[int]]
    shared: list[bool]
    engine: str
    units: list[Unit]
    chunks: list[range]
    n_workers: int
    forward_workers: int
    walk: Walk
    claim_order: Sequence[int] | None = None
    callers_last: bool = False
    where: str = "sum_models"
    out_spec: pytree.TreeSpec | None = None
    step_in_backward: StepInBackward | None = None
    step_index: list[int | None] | None = None
    # Set by the forward: its models drew random numbers that a pullback may draw again
    # (NOTE [ Random numbers replayed in backward ] in _random).
    one_thread_backward: bool = False
    # Set by the forward: a model made an argument need a gradient, whose gradient the
    # pullbacks then accumulate chunk by chunk in chunk order (NOTE [ Arguments made to need a
    # gradient ]).
    args_made_to_need_grad: bool = False
    ordered_pullbacks: bool = False
    looks_at_pullbacks: bool = False
    # Models too small for forward workers: each chunk's estimated cost, by which their runs of
    # chunks pulled back on several threads are cut (NOTE [ Pullbacks in runs of chunks ] in
    # _inline); None for other models.
    run_costs: tuple[int, ...] | None = None
    # NOTE [ Dropout drawn beforehand ] in _random: the call's noise_key where its draws can
    # be made beforehand, and whether they are (else the forward records their shapes).
    noise_key: Hashable | None = None
    predraw: bool = False
    # Where a join node's output is an input (before the parameters), what it runs (NOTE
    # [ Pullbacks joined later ]).
    join: PendingJoin | None = None

    def model_error(
        self, i: int, phase: str, exc: BaseException, unit: Unit | None = None
    ) -> ParsumError:
        model = self.models[i]
        hint = who = ""
        if self.engine == "vjp" and "mutate" in message_of(exc):
            hint = (
                "; engine='vjp' cannot run a model that updates buffers in forward (BatchNorm "
                "in training mode): use engine='autograd' or 'auto'"
            )
        if self.engine == "vjp" and any(
            isinstance(m, torch.jit.ScriptModule) for m in ModelParams.of(model).modules
        ):
            hint = (
                "; engine='vjp' cannot run TorchScript modules (torch.func.functional_call "
                "refuses them): use engine='autograd' or 'auto'"
            )
        if self.engine == "vjp" and _has_backward_hooks(model):
            hint = (
                "; engine='vjp' cannot run a module with a backward hook (a full one's "
                "autograd.Function is refused by torch.func, an old one's module is vjp's "
                "shadow, gone by backward): use engine='autograd' or 'auto'"
            )
        if unit is not None and unit.engine == "stacked":
            who = f", stacked with models {list(unit.models[1:])} (engine='stacked'),"
            if not isinstance(exc, (ForeignLeaves, ArgumentHooked)):  # which no engine runs
                hint += "; engine='autograd' runs each model on its own"
        return model_failed(self.where, i, model_kind(model), phase, exc, who, hint)

    def weight(self, i: int, weights: Tensor | list[float] | None) -> float | Tensor | None:
        """Model ``i``'s weight: from the call's ``weights`` (``weight_values``), else the
        plan's floats."""
        if isinstance(weights, Tensor):
            return weights[i].detach()
        if weights is not None:
            return weights[i]
        return None if self.weights is None else self.weights[i]

    def shared_params(self) -> list[Tensor]:
        """The parameters several of the models use."""
        return [p for p, used in zip(self.params, self.shared) if used]

    def shared_at_once(self) -> bool:
        """Whether the models' gradients of the parameters several of them use are added as
        terms, with one reduction at the end, on every path (NOTE [ Shared gradients at once ]
        in _summation)."""
        return terms_at_once(len(self.models), self.shared_params())


# NOTE [ A weight tensor read as floats ]
# A weight tensor gave each model its weight as ``weights[i].detach()``, an index and a detach a
# model (about 5 us), and each output a product of its own: 16 medium MLP classes with a
# softmax's weights took 0.3 ms more a forward than with float weights. A product by a
# floating-point 0-dim CPU tensor and by the Python float of its value round alike (the scalar
# is cast to the product's compute type either way, tested for float16, bfloat16, float32 and
# float64 each way), so a real floating weight tensor on the CPU is read once, ``tolist()``,
# and its weights go where float weights go (NOTE [ Weights in the reduction ] in
# _summation; NOTE [ Weighted cotangents shared ] in _engines), with the bits of the products
# by the tensor's elements. Only products read the floats: integer or boolean outputs, whose
# product's dtype a float and a tensor set apart (``int * 0.5`` is float32, ``int *
# tensor(0.5, dtype=float64)`` float64), stay with the tensor, as do the weights' own gradient
# and the derivatives of higher order. The tensor is still saved for backward, so that
# changing it in place before backward raises as in the plain loop.


def weight_values(weight_tensor: Tensor | None) -> Tensor | list[float] | None:
    """A call's weight tensor as its products read it: a real floating-point one on the CPU as
    Python floats (NOTE [ A weight tensor read as floats ]), any other as itself."""
    if (
        weight_tensor is None
        or type(weight_tensor) not in (Tensor, nn.Parameter)
        or not weight_tensor.is_floating_point()
        or weight_tensor.device.type != "cpu"
        or weight_tensor.layout != torch.strided
        or torch._C._functorch.is_functorch_wrapped_tensor(weight_tensor)
    ):
        return weight_tensor
    return weight_tensor.detach().tolist()


def _has_backward_hooks(model: Any) -> bool:
    """Whether a module backward hook or pre-hook runs on some module of ``model`` (its own
    or a global one)."""
    return any(GLOBAL_BACKWARD_HOOKS) or any(
        m._backward_pre_hooks or m._backward_hooks for m in ModelParams.of(model).modules
    )


def _signature(plan: SumPlan, i: int, out: Any) -> tuple[list[Tensor], Signature]:
    if isinstance(out, Tensor) and out.layout == torch.strided and not out.is_nested:
        # the usual output: no pytree walk
        return [out], (LEAF_SPEC, ((out.shape, out.dtype, out.device),))
    leaves, spec = pytree.tree_flatten(out)
    if not leaves:
        raise ParsumError(
            f"{plan.where}: model {i} ({model_kind(plan.models[i])}) returned "
            f"no tensor ({type(out).__name__}); expected a tensor or a pytree of "
            "tensors"
        )
    for j, leaf in enumerate(leaves):
        if not isinstance(leaf, Tensor):
            raise ParsumError(
                f"{plan.where}: model {i} ({model_kind(plan.models[i])}) returned a "
                f"{type(leaf).__name__} as output leaf {j}; expected tensors only"
            )
        if leaf.is_nested:
            raise ParsumError(
                f"{plan.where}: model {i} ({model_kind(plan.models[i])}) returned a nested "
                f"tensor (torch.nested, layout {leaf.layout}) as output leaf {j}; parsum sums "
                "dense (strided) tensors: return out.to_padded_tensor(0.0)"
            )
        if leaf.layout != torch.strided:
            raise ParsumError(
                f"{plan.where}: model {i} ({model_kind(plan.models[i])}) returned a "
                f"{leaf.layout} tensor as output leaf {j}; parsum sums dense (strided) "
                "tensors: return out.to_dense()"
            )
    return leaves, (spec, tuple((t.shape, t.dtype, t.device) for t in leaves))


def _describe_mismatch(plan: SumPlan, i: int, sig: Signature, ref: Signature) -> ParsumError:
    head = f"{plan.where}: model {i} ({model_kind(plan.models[i])}) returned"
    if sig[0] != ref[0]:
        return ParsumError(
            f"{head} an output of structure {sig[0]}, model 0 one of "
            f"structure {ref[0]}; every model must return the same structure"
        )
    for j, ((shape, dtype, device), (rshape, rdtype, rdevice)) in enumerate(zip(sig[1], ref[1])):
        for what, mine, theirs in (
            ("shape", tuple(shape), tuple(rshape)),
            ("dtype", dtype, rdtype),
            ("device", device, rdevice),
        ):
            if mine != theirs:
                return ParsumError(
                    f"{head} output leaf {j} with {what} {mine}, model 0 with "
                    f"{what} {theirs}; every model must return the same {what}"
                )
    raise AssertionError("signatures differ but no difference was found")


class _ChunkMismatch(Exception):
    """Raised inside a chunk whose models disagree; resolved against model 0 by the caller."""


@dataclass
class _Forward:
    leaves: list[Tensor]
    pullbacks: list[UnitPullback | None]
    outputs: list[list[Tensor] | None]
    # Parameters a model made in its forward (NOTE [ Parameters made in forward ]): what a
    # backward that cannot reach them raises (a message: an error held would hold its frames).
    made_in_forward: str | None = None
    # In the caller's graph, where outputs are kept: each model's output leaves as it returned
    # them, with their graph (NOTE [ A learned weight tensor's derivatives ] in
    # _double_backward); the same tensors as ``outputs``, not detached.
    attached: list[list[Tensor] | None] | None = None
    # Each of ``outputs``' version counters as its model returned it (NOTE [ Outputs written
    # before they are summed ]).
    output_versions: list[list[int] | None] | None = None
    # In the caller's graph, each stacked group's models, reads and output nodes (NOTE
    # [ Weights written before a group's backward ] in _engines).
    groups: list[GroupInGraph] | None = None


class GroupInGraph(NamedTuple):
    """A stacked group run in the caller's graph: its models, what its graph read (NOTE
    [ Weights written before a group's backward ] in _engines) and its output's nodes."""

    models: Sequence[int]
    reads: GroupReads
    nodes: list[Any]


def check_groups(plan: SumPlan, groups: Sequence[GroupInGraph] | None) -> None:
    """Raise, naming the model, where a stacked group's model's tensor that its graph saved
    was written in place since the forward (NOTE [ Weights written before a group's
    backward ] in _engines), before any gradient is written."""
    for group in groups or ():

        def error(k: int, exc: Exception, models: Sequence[int] = group.models) -> ParsumError:
            return plan.model_error(models[k], "backward", exc)

        group.reads.check(group.nodes, error)


# NOTE [ Parameters made in forward ]
# A model may make parameters in its forward (``if not hasattr(self, "head"): self.head =
# nn.Linear(...)``, a lazy layer of its own). The call planned before the forwards ran, so its
# pullbacks differentiate the parameters found then: where a backward captures gradients
# (ParallelSum's, and the caller's graph's where it does not accumulate into every leaf:
# NOTE [ Accumulating in the pullback ]), the new parameters got none, silently, where the
# plain loop's backward gives them theirs. After the forwards, the sizes of the modules'
# parameter, buffer and submodule dicts (recorded by a kept walk; a read of each) tell whether
# any changed; where one did and a model holds a trainable tensor the plan did not know,
# ParallelSum's forward raises (restoring buffers, as any failed call does), and the caller's
# graph raises in a backward that would capture, before any gradient is written. The
# parameters exist from then on: the next call plans with them. torch.nn's lazy modules are
# refused before the forwards run (``_check_initialized`` in _api), for the same reason.


def params_made_in_forward(plan: SumPlan) -> str | None:
    """The error message naming the first model that holds trainable tensors the plan did not
    know, once its forward ran; None if none does (NOTE [ Parameters made in forward ])."""
    for i, model in enumerate(plan.models):
        found = ModelParams.of(model)
        known = set(map(id, plan.model_params[i].tensors))
        new = [name for name, t in zip(found.names, found.tensors) if id(t) not in known]
        if new:
            return (
                f"{plan.where}: model {i} ({model_kind(model)}) made parameters in its "
                f"forward ({', '.join(new)}), which this call's backward cannot reach: it "
                "differentiates the parameters found before the forwards ran. They exist now, "
                "and the next call trains them; call each model once first (for example on "
                "one batch under torch.no_grad()), as lazy modules need"
            )
    return None


def run_forward(
    plan: SumPlan,
    call: CallArgs,
    weight_tensor: Tensor | None,
    build_graph: bool,
    keep_outputs: bool = False,
    roots: list[list[tuple[GradientEdge, int]] | None] | None = None,
    aliases: list[list[Tensor]] | None = None,
    views: dict[int, Tensor | None] | None = None,
) -> _Forward:
    """Run every model, sum the weighted outputs; see NOTE [ Data flow ].

    With ``roots`` (and ``build_graph`` False), the models run in the caller's graph, and
    ``roots[i]`` receives the gradient edge of each of model ``i``'s output leaves that needs a
    gradient, with the leaf's index (NOTE [ The caller's graph ] in ``_inline``), taken as the
    model returns, so that the outputs go with their chunk's sum: held to the end of the
    forward, 128 MLPs' outputs of 512 x 128 had made the call's peak 42 MiB above the plain
    loop's. Where arguments need a gradient (``call.grad_positions``), each model reads aliases
    of them of its own, ``aliases[i]``. With ``views`` (in the caller's graph), the slots of
    parameters with tensor hooks: each is read through a view of it, put there by its slot
    (NOTE [ Tensor hooks in the caller's graph ] in ``_inline``).
    """
    n = len(plan.models)
    signatures: list[Signature | None] = [None] * n
    pullbacks: list[UnitPullback | None] = [None] * len(plan.units)
    outputs: list[list[Tensor] | None] = [None] * n
    output_versions: list[list[int] | None] = [None] * n  # of ``outputs``, as returned
    groups: list[GroupInGraph] = []  # the caller's graph's stacked groups
    attached: list[list[Tensor] | None] | None = (
        [None] * n if keep_outputs and roots is not None else None
    )
    totals: list[ChunkPartials] = []  # NOTE [ Combining chunk partials ] in _summation

    def models_of(chunks: range) -> list[int]:
        return sorted(i for k in chunks for u in plan.chunks[k] for i in plan.units[u].models)

    def raise_first_mismatch(models: list[int]) -> None:
        # Raised where it is built, never held in a variable: a frame on the error's own
        # traceback that held it would make a cycle, keeping the models' graphs alive until
        # the garbage collector runs.
        ref = signatures[0]
        for i in models:
            sig = signatures[i]
            if ref is not None and sig is not None and sig != ref:
                raise _describe_mismatch(plan, i, sig, ref) from None

    failed_chunks: list[int] = []
    # The runs' terms summed at the end, watched until then (NOTE [ Outputs written before
    # they are summed ]): ``pending``, ``versions`` and ``admitted`` of each.
    awaiting: list[tuple[list[list[Tensor]], list[list[int]], list[int]]] = []
    weighted = weight_tensor is not None or plan.weights is not None
    # NOTE [ Weights in the reduction ] in _summation: float weights wait beside their terms,
    # as do a weight tensor's read as floats (NOTE [ A weight tensor read as floats ]) beside
    # floating-point outputs.
    read_weights = weight_values(weight_tensor)
    floats = plan.weights if weight_tensor is None else None
    if isinstance(read_weights, list):
        floats = read_weights
    in_reduction = floats is not None and len(floats) > 0 and type(floats[0]) is float
    models = plan.models
    positions = call.grad_positions
    # Grad enabled, but nothing to differentiate: an output that needs a gradient anyway
    # reached a tensor its model does not own (check_no_graph_needed).
    check_no_graph = not build_graph and roots is None and torch.is_grad_enabled()
    # NOTE [ Forwards with no graph ]
    no_graph = not build_graph and roots is None and not check_no_graph and call.spec is None
    # In the caller's graph every model reads the same arguments, built once (a model gets its
    # own keyword dict from ``**``), unless each reads aliases of its own; so do the models of a
    # flat call run with no graph (tensors and scalars: nothing one model could change for the
    # next, whatever thread runs it).
    shared_args = call.build() if (roots is not None and aliases is None) or no_graph else None
    programs = None  # NOTE [ Direct programs ] in _engines
    if plan.walk.programs and direct_calls_allowed(call):
        programs = plan.walk.programs
    # NOTE [ Random numbers in forwards ] in _random
    walk = plan.walk
    parallel = _pool.threads_for(len(plan.chunks), plan.forward_workers) > 1
    records: list[list[Any]] | None = None
    turns: Turns | None = None  # NOTE [ Dropout drawn beforehand ] in _random
    misses: list[nn.Module] = []  # dropout layers whose input did not match the noise drawn
    if plan.noise_key is not None and programs is not None:
        if plan.predraw:  # each chunk draws its noise in its turn, in chunk order
            shapes = walk.noise_shapes[plan.noise_key]
            programs = list(programs)  # this call's, with noise: not the walk's
            turns = Turns()
        else:
            records = [[] for _ in programs]
            programs = [p if p is None else p._replace(record=r) for p, r in zip(programs, records)]
    # Forwards in model order of a kept walk that saw no draw are watched where the pullbacks
    # may run on several threads: one that starts from what it did not see (NOTE [ Models seen
    # not to draw ]) may meet a first draw there, and a model whose graph recomputes must then
    # be pulled back on one thread. (A walk made for one call is not: torch.export traces calls
    # that plan anew, and its tracing refuses to read a generator's state.)
    watch = (
        walk.draws_random is None
        or (parallel and turns is None)
        or (
            walk.draws_random is False
            and walk.kept
            and _pool.threads_for(len(plan.chunks), plan.n_workers) > 1
        )
    )
    # NOTE [ Tensors a module does not own ] in _engines: once for a kept walk.
    check_leaves = not walk.leaves_checked and (build_graph or roots is not None)
    states = generator_states() if watch else None
    # The outputs' nodes, to look for recomputation where the models may draw random numbers:
    # once for a kept walk. A walk made for one call would look on every call (1.3 ms a step
    # for 64 tiny MLPs), more than its pullbacks on one thread cost.
    nodes: list[Any] | None = None
    if walk.draws_random is not False and walk.recomputes is None and walk.kept:
        nodes = []

    def in_graph(i: int) -> Any:
        """Model i's output, run as the plain loop runs it: in the caller's graph, or with
        no graph (NOTE [ Forwards with no graph ])."""
        mine: dict[int, Tensor] = {}
        if shared_args is not None:
            args, kwargs = shared_args
        else:  # aliases of its own, for its own argument gradients
            mine = {j: call.leaves[j].detach().requires_grad_() for j in positions}
            aliases[i] = list(mine.values())  # type: ignore[index]
            read = model_arguments(mine)
            args, kwargs = call.build(read)
        # NOTE [ Tensor hooks in the caller's graph ] in _inline
        hooked = views_of_hooked(i) if views is not None else None
        program = programs[i] if programs is not None else None
        if hooked:
            read_as = {id(plan.params[s]): view for s, view in hooked.items()}
            out = run_through_views(models[i], read_as, args, kwargs, program)
        elif program is not None:
            return run_direct(program, args[0])
        else:
            out = models[i](*args, **kwargs)
        if mine:
            check_argument_hooks(read.values())
        if check_leaves:
            check_own_leaves(
                models[i], output_edges(out), plan.model_params[i].tensors, mine.values(), call
            )
        return out

    def stacked_group_in_graph(unit: Unit) -> UnitRun:
        """A stacked group's models run as one in the caller's graph, or one by one where
        vmap cannot run them (NOTE [ Stacked groups in the caller's graph ] in _inline)."""
        group = unit.models
        mine: dict[int, Tensor] = {}
        if shared_args is not None:
            args, kwargs = shared_args
        else:
            # The group's argument gradient is its first model's aliases'; the others' are
            # leaves no graph reaches, so that every model has as many aliases.
            assert aliases is not None
            for i in group:
                aliases[i] = [call.leaves[j].detach().requires_grad_() for j in positions]
            mine = dict(zip(positions, aliases[group[0]]))
            args, kwargs = call.build(model_arguments(mine))
        read = None
        if views is not None:  # NOTE [ Tensor hooks in the caller's graph ] in _inline
            params = plan.params
            read = []
            for i in group:
                hooked = views_of_hooked(i)
                read.append([hooked.get(s, params[s]) for s in plan.param_slots[i]])
        return stacked_in_graph(
            [models[i] for i in group],
            [plan.model_params[i] for i in group],
            args,
            kwargs,
            lambda: [in_graph(i) for i in group],
            plan.engine == "auto",
            (mine.values(), call) if check_leaves else None,
            read,
        )

    def views_of_hooked(i: int) -> dict[int, Tensor]:
        """A view of each of model i's hooked parameters, by slot, made for this call and put
        in ``views``."""
        assert views is not None
        params = plan.params
        made = {s: params[s].view_as(params[s]) for s in plan.param_slots[i] if s in views}
        views.update(made)
        return made

    def forward_chunk(k: int) -> ChunkSum:
        summed: list[ChunkSum] = []
        sum_chunks(range(k, k + 1), lambda _, chunk: summed.append(chunk))
        return summed[0]

    def draw_chunk_noise(k: int) -> None:
        """The noise of chunk k's models, drawn once chunk k - 1 drew its own."""
        assert turns is not None and programs is not None
        turns.wait(k)
        try:
            for u in plan.chunks[k]:
                for i in plan.units[u].models:
                    program = programs[i]
                    if program is not None:
                        noise = draw_noise(program, shapes[i])
                        programs[i] = program._replace(noise=noise, misses=misses)
        finally:
            turns.done(k)

    def sum_chunks(ks: range, done: Callable[[int, ChunkSum], None]) -> None:
        """Run chunks ``ks`` in order in this thread, each with its noise drawn first, and hand
        their sums to ``done(k, sum)``: one a chunk, or one for all of them where their outputs
        are summed at once (NOTE [ Chunks in one pass ]). A chunk that fails is noted in
        ``failed_chunks``."""
        accs: list[CompensatedAccumulator] = []
        at_once = False  # NOTE [ One reduction for small outputs ] in _summation
        # Each output leaf's values not added yet: added together, in model order, with one
        # reduction (CompensatedAccumulator.add_all) before a group's sum and at the end.
        pending: list[list[Tensor]] = []
        # NOTE [ Outputs written before they are summed ]: each waiting term's version when its
        # model returned it, beside ``pending``, and the models whose terms wait, in order.
        versions: list[list[int]] = []
        admitted: list[int] = []
        # The weight of each term waiting, where they are added times it (None: weighted
        # already), the same for every output leaf; None where none waits.
        term_weights: list[float | None] | None = None
        first: int | None = None
        # The first output's shape, dtype and device where it is one strided tensor, for the
        # models after it in the caller's graph (NOTE [ One output a model ])
        lone: tuple[Any, ...] | None = None

        def admit(i: int, leaves: list[Tensor], sig: Signature) -> None:
            """Model i's output leaves: the chunk's first (its sums follow them), or checked
            against the first's."""
            nonlocal first, accs, pending, versions, term_weights, at_once, lone
            if first is None:
                check_weight_tensor(plan.where, weight_tensor, leaves, i, models[i])
                first = i
                accs = [CompensatedAccumulator() for _ in leaves]
                pending = [[] for _ in leaves]
                versions = [[] for _ in leaves]
                term_weights = (
                    []
                    if in_reduction
                    and (weight_tensor is None or all(t.is_floating_point() for t in leaves))
                    else None
                )
                at_once = all(sums_at_once(n, t) for t in leaves)
                if sig[0] is LEAF_SPEC:
                    lone = sig[1][0]
            elif sig != signatures[first]:
                raise _ChunkMismatch

        def flush() -> None:
            """The terms waiting added to ``accs``, once none was written since it came."""
            check_unwritten(plan, pending, versions, admitted)
            for seen in versions:
                seen.clear()
            admitted.clear()
            _flush(accs, pending, term_weights)

        def sum_units(k: int) -> None:
            """Chunk k's models, run and added to the terms waiting."""
            for u in plan.chunks[k]:
                unit = plan.units[u]
                try:
                    if (roots is not None or (no_graph and unit.engine != "stacked")) and len(
                        unit.models
                    ) == 1:  # the caller's graph, or no graph: run as the plain loop runs it
                        i = unit.models[0]
                        out = in_graph(i)
                        run = None
                    elif roots is not None:  # NOTE [ Stacked groups in the caller's graph ]
                        run = stacked_group_in_graph(unit)
                    else:
                        one = (
                            programs[unit.models[0]] if programs and len(unit.models) == 1 else None
                        )
                        run = unit_forward(
                            unit,
                            models,
                            call,
                            plan.model_params,
                            build_graph,
                            plan.engine == "auto",
                            one,
                            check_leaves,
                        )
                        if check_no_graph:
                            for i, out in zip(unit.models, run.outs):
                                check_no_graph_needed(models[i], out, plan.model_params[i], call)
                except _CONTROL_FLOW:
                    raise
                except Exception as exc:
                    raise plan.model_error(unit.models[0], "forward", exc, unit) from exc
                if run is None:  # a model in the caller's graph, or with no graph
                    if (
                        lone is not None
                        and nodes is None
                        and isinstance(out, Tensor)
                        and out.layout == torch.strided
                        and (out.shape, out.dtype, out.device) == lone
                    ):  # NOTE [ One output a model ]
                        assert first is not None
                        signatures[i] = signatures[first]
                        if roots is not None and out.requires_grad:
                            roots[i] = [(_edge(out), 0)]
                        value = out.detach() if out.requires_grad else out
                        if keep_outputs:
                            outputs[i] = [value]
                            output_versions[i] = [version_of(value)]
                            if attached is not None:
                                attached[i] = [out]
                        if term_weights is not None:
                            term_weights.append(floats[i])  # type: ignore[index]
                        elif weighted:
                            value = value * plan.weight(i, weight_tensor)  # type: ignore[operator]
                        pending[0].append(value)
                        versions[0].append(version_of(value))
                        admitted.append(i)
                        continue
                    run = UnitRun([out], None)
                pullbacks[u] = run.pullback
                if roots is not None and run.reads is not None:
                    ends = [t.grad_fn for t in run.stacked or () if t.grad_fn is not None]
                    groups.append(GroupInGraph(unit.models, run.reads, ends))
                if nodes is not None:  # extend holds the GIL
                    produced = pytree.tree_leaves([run.outs, run.stacked])
                    nodes.extend(t.grad_fn for t in produced if isinstance(t, Tensor))
                # A stacked group's models share one output signature, and are added as one
                # (unless each model's output is kept for the weights' gradient).
                if run.stacked is not None and not keep_outputs:
                    if roots is not None:  # each model's output views, with their graph
                        for i, out in zip(unit.models, run.outs):
                            roots[i] = [
                                (_edge(leaf), j)
                                for j, leaf in enumerate(flatten_output(out)[0])
                                if leaf.requires_grad
                            ]
                    leaves, sig = _signature(plan, unit.models[0], run.outs[0])
                    for i in unit.models:
                        signatures[i] = sig
                    admit(unit.models[0], leaves, sig)
                    if at_once:  # each model's output a term, in the group's order
                        if term_weights is not None and all(
                            v.dtype == torch.float32 for v in run.stacked
                        ):  # NOTE [ Weights in the reduction ] in _summation
                            group = [v.detach() for v in run.stacked]
                            term_weights.extend(floats[i] for i in unit.models)  # type: ignore[index]
                        else:
                            group = _weighted_group(plan, unit.models, run.stacked, weight_tensor)
                            if term_weights is not None:
                                term_weights.extend([None] * len(unit.models))
                        for waiting, seen, v in zip(pending, versions, group):
                            waiting.extend(v.unbind(0))
                            seen.extend([version_of(v)] * len(unit.models))
                        admitted.extend(unit.models)
                        continue
                    flush()
                    for acc, v in zip(
                        accs, _weighted_group(plan, unit.models, run.stacked, weight_tensor)
                    ):
                        acc.add_wide(wide_sum_over_models(v), v.dtype)
                    continue
                for i, out in zip(unit.models, run.outs):
                    leaves, sig = _signature(plan, i, out)
                    signatures[i] = sig
                    admit(i, leaves, sig)
                    if roots is not None:
                        roots[i] = [
                            (_edge(leaf), j) for j, leaf in enumerate(leaves) if leaf.requires_grad
                        ]
                    # Detached values and weights: no graph is recorded, with no grad-mode switch.
                    values = [leaf.detach() for leaf in leaves]
                    if keep_outputs:
                        outputs[i] = values
                        output_versions[i] = list(map(version_of, values))
                        if attached is not None:
                            attached[i] = leaves
                    if term_weights is not None:
                        term_weights.append(floats[i])  # type: ignore[index]
                    elif weighted:
                        w = plan.weight(i, weight_tensor)
                        values = [v * w for v in values]  # type: ignore[operator]  # never None
                    for waiting, seen, v in zip(pending, versions, values):
                        waiting.append(v)
                        seen.append(version_of(v))
                    admitted.append(i)

        # The first chunk whose terms wait: where its outputs are summed at once, it is the
        # one handed over, whose first model consume checks against model 0 (a later chunk's
        # models that differ from model 0's may be small enough where model 0's were not).
        start = ks[0]
        for k in ks:
            try:
                if turns is not None:
                    draw_chunk_noise(k)
                sum_units(k)
            except BaseException:
                failed_chunks.append(k)
                raise
            if at_once:
                if k == ks[-1]:
                    done(start, ChunkSum(None, pending, term_weights))
                    awaiting.append((pending, versions, admitted))
                continue  # the next chunk's terms follow this one's
            flush()
            done(k, ChunkSum(accs, None))
            first = lone = None  # the next chunk admits its own first model
            start = k + 1

    def consume(k: int, chunk: ChunkSum) -> None:
        # The chunk's models all match its first (sum_chunk): that one against model 0's.
        if signatures[plan.units[plan.chunks[k][0]].models[0]] != signatures[0]:
            raise_first_mismatch(models_of(range(k, k + 1)))
        if chunk.terms is not None:
            if not totals:
                totals.extend(ChunkPartials() for _ in chunk.terms)
            for total, terms in zip(totals, chunk.terms):
                total.add_terms(terms, chunk.weights)
            return
        assert chunk.accs is not None
        if not totals:
            totals.extend(ChunkPartials() for _ in chunk.accs)
        for total, acc in zip(totals, chunk.accs):
            total.merge(acc)

    in_order = bool(walk.draws_random and not walk.predraws)
    # NOTE [ Arguments made to need a gradient ]
    not_needing = []
    if build_graph or roots is not None:
        given = (call.leaves[j] for j in call.tensor_positions)
        not_needing = [t for t in given if not t.requires_grad]
    # NOTE [ Arguments modified in place ]
    versions = argument_versions(call) if parallel and not in_order else None
    # NOTE [ State the models share ] in _engines: learned on a kept walk's call in model order,
    # looked for again where the forwards run on the threads
    look = walk.kept and walk.shares_state() and (walk.writes_shared is None or parallel)
    shared = walk.shared_objects() if look else []
    shared_before = shared_snapshot(shared) if shared else None
    snapshot = _BufferSnapshot(plan.model_params)
    try:
        every_chunk = functools.partial(sum_chunks, range(len(plan.chunks)), consume)
        if in_order:  # NOTE [ Random numbers in forwards ]
            with _pool.as_one_task(1):  # one forward at a time: the budget's threads
                every_chunk()
        else:
            _pool.run_ordered(
                forward_chunk,
                len(plan.chunks),
                plan.forward_workers,
                consume,
                plan.claim_order if turns is None else None,  # turns: in chunk order
                plan.callers_last,
                every_chunk,  # NOTE [ Chunks in one pass ]
            )
        for run in sorted(awaiting, key=lambda run: run[2][0]):  # the first model named
            check_unwritten(plan, *run)
        # Where a backward will run (the caller's graph runs only with grad enabled).
        differentiated = build_graph or roots is not None
        made = params_made_in_forward(plan) if differentiated and walk.grew() else None
        if made is not None and roots is None:  # ParallelSum: its backward cannot reach them
            raise ParsumError(made)
    except BaseException:
        snapshot.restore()
        # The chunks before the first failed one all ran; an output mismatch among them or in
        # that chunk is the error to report, the first in model order.
        last = min(failed_chunks) + 1 if failed_chunks else len(plan.chunks)
        raise_first_mismatch(models_of(range(last)))
        raise
    assert signatures[0] is not None
    plan.out_spec = signatures[0][0]
    if shared_before is not None:
        wrote = wrote_shared(shared, shared_before)
        if wrote and parallel:
            _note_shared_writes(plan)
        walk.writes_shared = wrote or bool(walk.writes_shared)
    if versions is not None and argument_versions(call) != versions:
        _note_modified_arguments(plan)
    if records is not None:
        if len(walk.noise_shapes) >= 8:  # input shapes seen lately
            walk.noise_shapes.pop(next(iter(walk.noise_shapes)))
        walk.noise_shapes[plan.noise_key] = records
    if states is not None or walk.draws_random:
        _note_random_draws(plan, states, nodes, bool(misses), parallel and not in_order)
    if any(t.requires_grad for t in not_needing):  # NOTE [ Arguments made to need a gradient ]
        plan.args_made_to_need_grad = plan.one_thread_backward = True
    # Under the chunks' intra-op threads, as the chunks ran: a wide reduction of many partials
    # on the caller's threads would leave OpenMP's threads spinning on the cores that the next
    # job's helpers need (NOTE [ Spinning intra-op threads ] in _pool).
    if check_leaves and walk.kept:
        walk.leaves_checked = True
        for part in walk.parts:  # NOTE [ Models planned one by one ] in _plans
            part.leaves_checked = True
    with _pool.as_one_task(len(plan.chunks)):
        leaves = [t.result() for t in totals]
    return _Forward(leaves, pullbacks, outputs, made, attached, output_versions, groups)


# NOTE [ Chunks in one pass ]
# Where the forwards run in this thread, chunk after chunk, the chunks' setup is paid once where
# their outputs are summed at once (NOTE [ One reduction for small outputs ] in _summation):
# every output is then a term of the call's one reduction, in model order whatever the chunks,
# so the pass admits its first model once, checks every other model's output against it (for
# one strided tensor, by its shape, dtype and device: NOTE [ One output a model ]) and hands all
# the terms over together. Larger outputs still get a sum a chunk, handed over as each chunk
# ends: there the chunks decide the order of additions. A chunk that fails is noted as before.
# Against the code before, in one process (bench_against.py, 60 rounds, 2 cores): 64 tiny MLP
# classes 1.045x a step at n_jobs=1 and 1.058x by default (forwards in the calling thread), 16
# medium MLP classes 1.026x at n_jobs=1; workloads whose forwards run on workers unchanged
# (0.996-1.004x). A chunk's setup had cost about 14 us in place, 16 chunks 0.2 ms a forward.

# NOTE [ One output a model ]
# In the caller's graph a chunk's models after its first are added with no record of their
# own where the first returned one strided tensor and they return one of its shape, dtype and
# device (the usual case): the first's signature stands for theirs, and their output goes
# straight to the chunk's terms, as the general way puts it there. Whatever else a model
# returns takes the general way, which names a mismatch as before. Timed around the models'
# own forwards (one thread, 64 tiny MLP classes, three runs each): parsum's forward outside
# them 0.667-0.682 -> 0.611-0.631 ms (the plain loop's 0.17); a step at n_jobs=1 against the
# code before 1.011x (bench_against.py, 40 rounds), the medium classes unchanged.

# NOTE [ Forwards with no graph ]
# Under no_grad or inference_mode (an ensemble's evaluation) a model's forward needs no more
# than the plain loop gives it: where the call is flat (tensors and scalars), every model reads
# one build of the arguments and a one-model unit runs as in the caller's graph, its output
# going straight to the terms (NOTE [ One output a model ]), where it went through a unit's
# run, a build of the arguments and a signature of its own. The same kernels in the same order,
# so the same bits; stacked units keep their batched run. Against the code before in one
# process (bench_against.py --step eval, 100 rounds; 1 and 2 threads): 64 tiny MLP classes
# 1.05x and 1.13x, 8 EmbeddingBags 1.09x and 1.10x, 16 heads over a shared trunk 1.08x and
# 1.05x, 16 medium classes 1.03x and 1.01x, 8 transformer layers 1.00x and 1.01x.
# Sequentials of known layers in one chunk skip this path: NOTE [ Known layers with no graph ]
# in _plain_graph.


# NOTE [ Arguments modified in place ]
# A model that modifies its argument in place (``x.mul_(2)``, a first ``ReLU(inplace=True)``)
# changes what the models after it read: in the plain loop each reads the changes of those
# before it, and so do forwards in model order, but forwards on several threads read and write
# it at once, so the outputs depend on the threads' timing (six models doubling ``x`` in place
# on 2 threads: outputs other than the plain loop's). The arguments' version counters before
# and after such forwards tell (0.4 us a read for one argument): where one changed, the call
# warns, naming the caller's line, and the next calls with these models run their forwards in
# model order, as the plain loop does. Arguments that need a gradient are read through aliases
# that autograd protects: modifying one in place raises in the model, named.


# NOTE [ Outputs written before they are summed ]
# The plain loop adds each model's output to its sum as the model returns it; parsum adds them
# once a chunk's forwards (or all of them: NOTE [ One reduction for small outputs ] in
# _summation) have run. An output that is its argument, a buffer or other state of its module,
# or a view of one, and that a forward after it writes in place (one model returns ``x``, the
# next halves it or starts with ``ReLU(inplace=True)``; a module listed twice updates and
# returns a running mean), had its later value summed: off by the change, silently, and not the
# same at every n_jobs. Each waiting term's version counter, read as its model returns it and
# again before it is added (about 0.22 us a model), tells: the call raises, naming the model,
# as a failed forward does (torch.nn's running statistics restored). So does a backward whose
# learned weights' gradient needs an output written since (``check_outputs_kept``), where
# autograd raises for the output the plain loop's product saved. Copying every output instead
# would cost a kernel a model on every call, for what models almost never do.


def check_outputs_kept(
    plan: SumPlan,
    outputs: Sequence[list[Tensor] | None],
    versions: Sequence[list[int] | None] | None,
) -> None:
    """Raise, naming the first model, where an output kept for the weights' gradient was
    written in place since its model returned it (NOTE [ Outputs written before they are
    summed ]): the plain loop's product with the weight saved it, and autograd raises there."""
    for i, (kept, seen) in enumerate(zip(outputs, versions or ())):
        if kept is not None and seen is not None and list(map(version_of, kept)) != seen:
            raise ParsumError(
                f"{plan.where}: model {i} ({model_kind(plan.models[i])}) returned a tensor "
                "that was written in place since (its argument, or its module's buffer or "
                "state, or a view of one), and the weights' gradient needs its value as "
                "returned, as autograd needs a tensor its graph saved: return a copy "
                "(out.clone())"
            )


def check_unwritten(
    plan: SumPlan, pending: list[list[Tensor]], versions: list[list[int]], admitted: list[int]
) -> None:
    """Raise, naming the first model, where a term waiting in ``pending`` (``admitted[k]``'s
    for each output leaf's k-th term) was written in place since its model returned it (NOTE
    [ Outputs written before they are summed ])."""
    for terms, seen in zip(pending, versions):
        try:
            if list(map(_version_of, terms)) == seen:
                continue
        except RuntimeError:  # an inference tensor among them
            if list(map(version_of, terms)) == seen:
                continue
        k = next(k for k, (t, v) in enumerate(zip(terms, seen)) if version_of(t) != v)
        i = admitted[k]
        raise written_after_return(plan.where, i, plan.models[i])


# NOTE [ Arguments made to need a gradient ]
# A model may turn on its argument's ``requires_grad`` in its forward, as force fields do with
# the positions (``pos.requires_grad_()``, then the forces ``-autograd.grad(energy, pos,
# create_graph=True)``). The argument did not need a gradient when the call began, so every
# model read it itself, not an alias of its own, and each model's pullback accumulates its
# part into the argument's ``.grad``: on several threads in the threads' order, so that its bits
# changed from run to run at n_jobs=2 (13 runs of 20, 8 energy models), where the parameters'
# did not. Where an argument needs a gradient after the forwards that it did not need before,
# the call's pullbacks run on one thread, one engine call a chunk in chunk order, also where
# one call would pull back every chunk: each chunk's models ran in model order on one thread,
# so the engine adds their parts in the same order on every path, and the chunks' sums are
# added in chunk order, the same bits for any n_jobs. The backward loses its threads there, and
# in the caller's graph runs on the budget's intra-op threads (as the plain loop's does; the
# same for any n_jobs): 8 energy models of widths 64-288 at batch 256 on 2 cores, 0.87x the
# plain loop where the pullbacks on the threads, whose bits changed, ran 0.94x, and 0.68x on
# the tasks' one intra-op thread. A model that differentiates with respect to
# ``pos.detach().requires_grad_()`` instead keeps them: 0.94-0.96x (NOTE [ Leaves made from the
# arguments ] in _engines).
# In the caller's graph, such arguments become the node's last arguments once the forwards
# ran, so that a backward that captures gradients (``torch.autograd.grad(loss, x)``,
# ``backward(inputs=...)``, a ``.grad`` already set, a second backward through a retained
# graph) gets theirs: captured chunk by chunk with the parameters' and added in chunk order,
# returned by the node (where the backward accumulates, it goes into ``.grad`` as above, which
# a failure sets back to None; a ``.grad`` already set is captured into instead). Before, such
# a backward left them without a gradient, and ``autograd.grad`` raised that the argument was
# not used in the graph. Through ParallelSum (whose inputs are fixed before the forwards) and
# in derivatives of higher order they still get none (docs/limits.md).


def argument_versions(call: CallArgs) -> list[int]:
    """The version counters of the call's tensor arguments (inference tensors have none)."""
    leaves = call.leaves
    return [t._version for t in (leaves[j] for j in call.tensor_positions) if not t.is_inference()]


def _note_modified_arguments(plan: SumPlan) -> None:
    """An argument changed while forwards ran on several threads: warn, and run the next
    forwards of a kept walk in model order (NOTE [ Arguments modified in place ])."""
    walk = plan.walk
    warn_thread_timing(
        plan.where,
        "an argument was modified in place while the forwards ran on several threads (by a "
        "model, or by another thread meanwhile); where a model reads what another writes, this "
        "call's outputs depend on the threads' timing",
        "Arguments modified in place",
        "_function",
        walk.kept,
    )
    walk.modifies_args = walk.kept


def _note_shared_writes(plan: SumPlan) -> None:
    """A forward on the threads wrote into state the models share: warn, and run the next
    forwards of the walk in model order (NOTE [ State the models share ] in _engines)."""
    warn_thread_timing(
        plan.where,
        "a model wrote into state that several models hold (a list, dict, set, object, tensor "
        "or module) while the forwards ran on several threads, so in the threads' order",
        "State the models share",
        "_engines",
        True,
    )


# NOTE [ Pullbacks that write shared state ]
# Backward hooks that log into something the models share (a full backward hook on each model
# appending its gradient's norm to one list; a tensor hook a forward registers, writing into a
# dict the models hold) run in the pullbacks: in the plain loop's backward one model after the
# other, the last model first (the engine runs the nodes of highest sequence number first, and
# a thread numbers them in creation order), and on the threads in the threads' order: 6 MLPs
# whose full backward hooks appended their index to one list at n_jobs=2 logged 5 4 3 1 2 0 in
# one call of three, where the plain loop logs 5 4 3 2 1 0. What the modules' backward hooks
# and pre-hooks reach counts among what the models share (``shared_state`` in _engines, NOTE
# [ State the models share ] there), and a kept walk learns from its first backward whether
# the pullbacks write into it, as its first forward learns whether the forwards do: that
# backward pulls the models back on the calling thread from the last chunk to the first
# (``run_last_first``; each chunk's models ran on one thread in model order, so one engine
# call a chunk pulls them back from the last, and one call pulls back every chunk where the
# forwards ran on one thread), its sums still added in chunk order (the same bits), and looks
# for a write after it (``pullback_snapshot``, ``learn_pullback_writes``). Where one was
# written, every backward of the walk runs so; otherwise on the threads, looking again after
# each (a write that starts later warns and switches). A global module hook that reaches such
# state orders the pullbacks while it is registered: a backward hook, or a forward hook, which
# may register tensor hooks (ModuleTracker's, which FlopCounterMode uses, write its parents).
# Pullbacks joined later (NOTE [ Pullbacks joined later ]) are not taken where the backward
# orders them, and looked at when they are joined.


def pullback_snapshot(plan: SumPlan, on_threads: bool) -> tuple[list[Any], list[Any]] | None:
    """What the models share and what it holds, before a backward that learns whether its
    pullbacks write into it or would run ``on_threads`` (NOTE [ Pullbacks that write shared
    state ]); None where it does not look."""
    walk = plan.walk
    if not plan.looks_at_pullbacks or not (walk.pullbacks_write_shared is None or on_threads):
        return None
    objects = walk.shared_objects()
    return (objects, shared_snapshot(objects)) if objects else None


def learn_pullback_writes(plan: SumPlan, looked: tuple[list[Any], list[Any]] | None) -> None:
    """After a backward that succeeded: whether its pullbacks wrote into what the models share,
    learned by the walk; a write on the threads warns (NOTE [ Pullbacks that write shared
    state ])."""
    if looked is None:
        return
    wrote = wrote_shared(*looked)
    walk = plan.walk
    if wrote and not plan.ordered_pullbacks:
        warn_thread_timing(
            plan.where,
            "a backward hook wrote into state that several models hold (a list, dict, set, "
            "object, tensor or module) while the models were pulled back on several threads, "
            "so in the threads' order",
            "Pullbacks that write shared state",
            "_function",
            True,
            then="the next backward passes with these models pull them back on one thread, "
            "the last model first, as the plain loop does",
        )
    walk.pullbacks_write_shared = wrote or bool(walk.pullbacks_write_shared)


def _note_random_draws(
    plan: SumPlan,
    states: list[bytes] | None,
    nodes: list[Any] | None,
    missed: bool,
    on_threads: bool,
) -> None:
    """Learn from a forward whether the models draw random numbers, and whether the call's
    pullbacks must then run on one thread (NOTE [ Random numbers in forwards ] in _random);
    ``on_threads``: whether the forwards ran on several threads."""
    walk = plan.walk
    drew = bool(walk.draws_random) if states is None else generator_states() != states
    if plan.predraw:  # NOTE [ Dropout drawn beforehand ]: a layer's noise missed, it drew
        if missed:
            warn_drawn_on_threads(plan.where, walk.kept)
            walk.predraws = False
        drew = True
    elif states is not None:
        known = walk.draws_random
        if known is False and drew and on_threads:
            warn_drawn_on_threads(plan.where, walk.kept)
        # NOTE [ Models seen not to draw ] in _random: once a walk, when it learns
        if drew and not known:
            walk.draws_random = True
            walk.unmark_quiet(plan.models)
        elif not drew:
            walk.saw_no_draw(plan.models)
    if not drew:
        return
    if walk.recomputes is None and nodes is not None:
        walk.recomputes = may_recompute(nodes)
    # Not looked for (forwards on several threads, or a walk for one call): one thread.
    plan.one_thread_backward = walk.recomputes is not False


class ChunkSum(NamedTuple):
    """A chunk's outputs: summed per output leaf (``accs``), or, to be summed with every other
    chunk's at the end, the terms themselves per output leaf (``terms``; NOTE [ One reduction
    for small outputs ] in _summation)."""

    accs: list[CompensatedAccumulator] | None
    terms: list[list[Tensor]] | None
    weights: list[float | None] | None = None  # each term's (NOTE [ Weights in the reduction ])


def _flush(
    accs: list[CompensatedAccumulator],
    pending: list[list[Tensor]],
    term_weights: list[float | None] | None,
) -> None:
    for acc, waiting in zip(accs, pending):
        if waiting:
            acc.add_all(waiting, term_weights)
            waiting.clear()
    if term_weights is not None:
        term_weights.clear()


def _weighted_group(
    plan: SumPlan,
    members: tuple[int, ...],
    stacked: list[Tensor],
    weight_tensor: Tensor | None,
) -> list[Tensor]:
    """A stacked group's outputs (models along dim 0), detached and weighted."""
    w: Tensor | list[float] | None = None
    if weight_tensor is not None:
        w = weight_tensor.detach()[list(members)]
    elif plan.weights is not None:
        w = [plan.weights[i] for i in members]
    # On the output's device, whatever the weights' device.
    return [leaf.detach() if w is None else weigh_models(leaf.detach(), w) for leaf in stacked]


class _BufferSnapshot:
    """Copies of the running statistics a forward updates, to undo a failed one."""

    def __init__(self, model_params: Sequence[ModelParams]) -> None:
        seen = {id(b): b for mp in model_params for b in mp.restored_buffers}
        self._saved: list[tuple[Tensor, Tensor]] = []
        if not seen:
            return
        with torch.no_grad():
            self._saved = [(b, b.clone()) for b in seen.values()]

    def restore(self) -> None:
        with torch.no_grad():
            for buffer, saved in self._saved:
                buffer.copy_(saved)


class _Announcer(threading.local):
    hook: Callable[[], object] | None = None


_announcer = _Announcer()


@contextlib.contextmanager
def announcing_backward_failures(hook: Callable[[], object] | None) -> Iterator[None]:
    """Calls of ``ParallelSum`` made inside the block call ``hook()`` when their backward
    fails, before raising (``parsum.distributed``: NOTE [ Cross-rank sum ])."""
    saved, _announcer.hook = _announcer.hook, hook
    try:
        yield
    finally:
        _announcer.hook = saved


def reports_failures() -> bool:
    """Whether this thread is inside ``announcing_backward_failures`` with a hook."""
    return _announcer.hook is not None


# NOTE [ Device threads ]
# PyTorch's autograd engine runs the backward nodes of CUDA tensors on one thread per device,
# and picks a node's thread by the device of its incoming gradients. A pullback started from a
# helper thread queues its CUDA nodes on that device thread; when that thread is the one running
# ParallelSum.backward, waiting for the helpers, neither ever moves (seen on an H100: the
# default hung forever in backward). There the pullbacks run in the calling thread, which the
# engine allows as a reentrant backward; the forwards keep their threads. With gradients on the
# CPU, backward runs on a CPU thread, and a helper's CUDA nodes find the device thread free.


def _on_device_thread(grad_outputs: Sequence[Tensor | None]) -> bool:
    """Whether this backward runs on one of autograd's device threads (NOTE [ Device threads ])."""
    return any(g is not None and g.device.type != "cpu" for g in grad_outputs)


def _notes_a_trainer(grad_outputs: Sequence[Tensor | None]) -> bool:
    """Whether this backward's thread is to be noted as one that trains the parameters (NOTE
    [ Parameters trained in several threads ] in _grads): not a device thread, which pulls
    back the graphs of every thread using the device, nor a task of a call, part of its
    caller's."""
    return not _pool.in_a_task() and not _on_device_thread(grad_outputs)


_BATCHED_CHECKS = tuple(
    getattr(torch._C._functorch, name)
    for name in ("is_legacy_batchedtensor", "is_batchedtensor")
    if hasattr(torch._C._functorch, name)
)


def under_vmap(t: Tensor | None) -> bool:
    """Whether ``t`` is batched by a vmap that runs the backward (NOTE [ Gradients under vmap ]
    in _inline)."""
    return t is not None and any(check(t) for check in _BATCHED_CHECKS)


def _at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward ends (autograd's final callbacks, which
    DistributedDataParallel uses too); where they are missing, it is not run."""
    queue = getattr(torch.autograd.Variable._execution_engine, "queue_callback", None)
    if queue is not None:
        queue(callback)


def _engine_keeps_graph() -> bool:
    """Whether the running backward was asked to keep the graph (retain_graph=True)."""
    try:
        return bool(torch._C._autograd._get_current_graph_task_keep_graph())
    except (AttributeError, RuntimeError):  # not in this torch: keep, never free too early
        return True


_SECOND_BACKWARD = (
    "parsum: sum_models' backward is not differentiable here (it was run with "
    "create_graph=True, and a second backward reached the gradients it returned): derivatives "
    "of higher order run where the models run in the caller's graph, which this call did not "
    "(a parameter with a tensor hook, step_in_backward, a compensated FlatGrad, take_rows, "
    "engine='vjp', several ranks of parsum.distributed); see docs/limits.md, or use the plain "
    "sum of the models"
)


_UNDER_VMAP = (
    "sum_models: its backward ran under vmap (torch.autograd.grad(..., is_grads_batched=True), "
    "torch.autograd.functional.jacobian or hessian with vectorize=True), which it supports "
    "where the models run in the caller's graph; this call ran through ParallelSum (a "
    "parameter with a tensor hook, step_in_backward, a compensated FlatGrad, take_rows, "
    "engine='vjp', several ranks of parsum.distributed): pass vectorize=False, one backward "
    "per row"
)


class _NotDifferentiable(torch.autograd.Function):
    """The gradients a backward with ``create_graph=True`` returned, as they are; their
    backward raises. Its inputs also include every tensor ``sum_models`` differentiated
    (arguments, weights, parameters), so that a second backward with respect to any of them
    reaches it and raises: with the gradients alone as inputs, ``torch.autograd.grad(penalty,
    params)`` found no path to the parameters and returned None without a word. Its
    backward raises a ParsumError with ``message``."""

    @staticmethod
    def forward(ctx: Any, message: str, n_grads: int, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.message = message
        return tuple(g.view_as(g) for g in tensors[:n_grads])

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[None, ...]:
        raise ParsumError(ctx.message)


def not_differentiable(
    grads: Sequence[Tensor | None], anchors: Sequence[Tensor], message: str
) -> tuple[Tensor | None, ...]:
    """``grads`` as they are, but a second backward that reaches them, or that differentiates
    with respect to any of ``anchors`` through them, raises a ParsumError with ``message``
    (``_NotDifferentiable``)."""
    present = [g for g in grads if g is not None]
    marked = iter(_NotDifferentiable.apply(message, len(present), *present, *anchors))
    return tuple(None if g is None else next(marked) for g in grads)


# NOTE [ Applying a Function with many inputs ]
# From torch 2.14 on, ``Function.apply`` is torch's C ``apply`` itself; before, it ran a Python
# preamble first, which passes every input through a generator (to unwrap functorch wrappers left
# over from a finished transform). ParallelSum and CallerGraphSum take every parameter as an
# input: for 96 of them the preamble cost 45 us of a step's forward in place (16 MLPs of widths
# 128-512, batch 64, one thread; the whole call's overhead beyond the models is about 0.9 ms).
# ``sum_models`` refuses to run inside a transform, and a parameter is never such a wrapper, so
# the C ``apply`` is called directly, with the arguments (the only inputs that could be left-over
# wrappers) unwrapped as the preamble would.


def direct_apply(
    function: type[torch.autograd.Function], n_unwrapped: int, *inputs: Any
) -> tuple[Tensor, ...]:
    """``function.apply(*inputs)`` through torch's C ``apply`` (NOTE [ Applying a Function with
    many inputs ]); the first ``n_unwrapped`` inputs unwrapped as ``Function.apply`` does."""
    head = _unwrap_dead_wrappers(inputs[:n_unwrapped])
    return _C_APPLY.__get__(None, function)(*head, *inputs[n_unwrapped:])


_C_APPLY = torch._C._FunctionBase.__dict__["apply"]
_unwrap_dead_wrappers = torch._functorch.utils.unwrap_dead_wrappers


# NOTE [ Pullbacks joined later ]
# A node whose backward accumulates every gradient into ``.grad`` in its pullbacks (NOTE
# [ Accumulating in the pullback ]) returns None for each of its parameters, and the engine
# then runs each parameter's AccumulateGrad on that None, in the calling thread, after the
# node: 1.5 us each warm, 2-3 us in a step (16 MLPs of widths 128-512: 94 parameters, 0.19-0.28
# ms; 64 tiny MLPs: 382, 0.85 ms), while the helpers, their chunks done, wait for the next call.
# Where nothing the node returns depends on its pullbacks (no argument, weight or shared
# parameter gradient, no FlatGrad slot, no optimizer step), its backward only hands the
# pullbacks to the helpers (``_pool.start_ordered``) and returns: the engine runs those
# AccumulateGrads while the helpers pull back, and then the join node, where the caller works
# on the chunks left and waits for the rest (``_pool.join``), undoing every ``.grad`` and
# raising the first model's error on a failure, as before. Only for JOIN_LATER_PARAMS or more
# parameters: with the 94 of the medium MLPs, steps at 2 threads took 1.02-1.05x as long (the
# join node costs the forward about 0.05 ms in a step, and the visits slow the helper's chunks).
# The join node is an input of the node, made right before it: the engine runs the ready node
# of highest sequence number first, AccumulateGrads before any other, and sequence numbers
# grow in creation order, so it runs right after the node's AccumulateGrads and before any
# other node of the caller's graph: none can fail, or read a ``.grad``, while the helpers write
# them (an engine callback would run after every node, and after a failure not at all, leaving
# the helpers writing ``.grad`` after ``backward()`` raised). What the caller's graph gives a
# parameter besides is added to its ``.grad`` in one addition, before or after the pullback's:
# the same bits either way (a + b = b + a). Where the node does not hand over its
# pullbacks (another thread, ``autograd.grad``, ...), the join node has nothing to do.
# A term of the loss made after the sum (an L2 penalty on the parameters) sends its gradient to
# a parameter's AccumulateGrad before the node runs, so the engine accumulates it right after
# the node, while the helpers pull back: the helpers' engine calls accumulate theirs through the
# same AccumulateGrad, one after the other, but a gradient that the node stores itself (NOTE
# [ Gradients stored, not returned ]), written by a helper, had raced the engine's write (the
# sum's or the term's gradient lost: found by tests/test_differential.py). The helpers hand those
# to the join, where the caller's thread stores them, added to what the engine stored meanwhile
# (a + b = b + a: the bits of one thread); 64 tiny MLPs at n_jobs=2, whose stacked groups' 382
# gradients are stored so, took 0.97-1.00x a step against a helper's stores (three runs in one
# process; still 1.10x the pullbacks joined in the node). A FlatGrad's hook, which moves a fresh
# gradient into its slot, raced the same way: NOTE [ Slots filled after the join ] in _grads.
# Nor does a node join later where it returns a gradient for the weights or arguments
# (``may_join_later``): the engine would accumulate it before a failing pullback is joined;
# except weights made by a node before the join (NOTE [ Weights' gradients held back by the
# join ] in _inline), whose gradient the engine passes on only after the join.
# Those AccumulateGrads also run the hooks on the nodes themselves, before the pullbacks' own:
# DistributedDataParallel's, which count each parameter ready once per backward, saw the None
# first and then raised on the pullback's gradient ("marked as ready twice"; after the
# pullbacks, as before, its backward is over and they are ignored). Where a process group
# exists, only parsum.distributed's own calls hand their pullbacks over.


# A chunk's FlatGrad slots are written together once its models are pulled back, or as soon as
# the gradients waiting reach this many elements (4 MiB of float32): a large model's are not
# held to its chunk's end.
FLAT_WRITE_ELEMENTS = 1 << 20


class PendingJoin:
    """What a join node runs: the caller's part of pullbacks handed to helpers, if any."""

    __slots__ = ("__weakref__", "finish")

    def __init__(self) -> None:
        self.finish: Callable[[], None] | None = None


class JoinPullbacks(torch.autograd.Function):
    """The join node of NOTE [ Pullbacks joined later ]. Inputs: ``(pending, anchor)``."""

    @staticmethod
    def forward(ctx: Any, pending: PendingJoin, anchor: Tensor) -> Tensor:
        ctx.pending = pending
        ctx.set_materialize_grads(False)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None) -> tuple[None, None]:
        pending: PendingJoin = ctx.pending
        finish, pending.finish = pending.finish, None
        if finish is not None:
            with torch.no_grad():
                finish()
        return None, None


def may_join_later(plan: SumPlan, differentiable: Sequence[Tensor]) -> bool:
    """Whether the node of ``plan``'s call may hand its pullbacks over (NOTE [ Pullbacks
    joined later ]), as far as both kinds of node tell alike: no argument or weight tensor
    (``differentiable``) that needs a gradient, which the node would return for the engine to
    accumulate before a failing pullback is joined; on several threads, with JOIN_LATER_PARAMS
    parameters or more; and no process group, unless the call is parsum.distributed's own."""
    return (
        bool(plan.params)
        and not plan.ordered_pullbacks  # NOTE [ Pullbacks that write shared state ]
        and not any(t.requires_grad for t in differentiable)
        and len(plan.params) >= JOIN_LATER_PARAMS
        and _pool.threads_for(len(plan.chunks), plan.n_workers) > 1
        and (
            _dist is None
            or not _dist.is_initialized()
            or getattr(_join_guard, "distributed", False)
        )
    )


# Parameters from which handing the pullbacks over paid on 2 cores at 2 threads (1.03x with 192,
# 1.06-1.10x with 382-384; 0.95-0.98x with the 94 of 16 medium MLPs, benchmarks/bench_join.py).
JOIN_LATER_PARAMS = 128


_dist = torch.distributed if torch.distributed.is_available() else None
_join_guard = threading.local()  # ``distributed``: set by parsum.distributed around its calls


@contextlib.contextmanager
def distributed_call() -> Iterator[None]:
    """The block's calls are parsum.distributed's own: no DistributedDataParallel hooks their
    parameters (NOTE [ Pullbacks joined later ])."""
    saved = getattr(_join_guard, "distributed", False)
    _join_guard.distributed = True
    try:
        yield
    finally:
        _join_guard.distributed = saved


# The join node's input, for it to be a node: one leaf for all calls, whose AccumulateGrad
# receives None. On the CPU whatever the default device at import.
_JOIN_ANCHOR = torch.empty(0, requires_grad=True, device="cpu")
INTERNAL_LEAVES.append(_JOIN_ANCHOR)


def weight_held_back(weight_tensor: Tensor | None) -> Tensor | None:
    """The weight tensor, where the engine may pass its gradient on only after a join node
    made next: made by a node, on the CPU (NOTE [ Weights' gradients held back by the join ]
    in _inline; ``join_input`` tells once the join node is made)."""
    if weight_tensor is not None and weight_tensor.grad_fn is not None and weight_tensor.is_cpu:
        return weight_tensor
    return None


def join_input(pending: PendingJoin, held: Tensor | None) -> Tensor | None:
    """A new join node's output, to pass to the node it joins (NOTE [ Pullbacks joined
    later ]); None where ``held``, the weight tensor of ``weight_held_back``, was made by a node
    of a higher sequence number than the join node's, whose gradient the engine would pass on
    before the join (NOTE [ Weights' gradients held back by the join ] in _inline)."""
    join = _C_APPLY.__get__(None, JoinPullbacks)(pending, _JOIN_ANCHOR)
    if held is None:
        return join
    node, joins = held.grad_fn, join.grad_fn
    assert node is not None and joins is not None  # weight_held_back's, and a Function's
    return join if node._sequence_nr() < joins._sequence_nr() else None


@contextlib.contextmanager
def stacks_attached(ctx: Any) -> Iterator[None]:
    """Around a node's backward: first ``ctx.before_backward`` (set by
    ``Stack.attach_at_backward``: the stacks' models' gradients made views of their buffers),
    undone where the backward fails, so that a failed call leaves every ``.grad`` as it was."""
    undo = ctx.before_backward() if ctx.before_backward is not None else None
    try:
        yield
    except BaseException:
        if undo is not None:
            undo()
        raise


def _once_differentiable(backward: Callable[..., tuple[Tensor | None, ...]]) -> Callable[..., Any]:
    """``torch.autograd.function.once_differentiable``, but a backward run with
    ``create_graph=True`` always returns gradients whose differentiation raises, with respect
    to anything (``_NotDifferentiable``): torch's decorator marks them only when the incoming
    gradients require grad, and otherwise lets a second backward drop sum_models'
    second-order terms without a word."""

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grad_outputs: Tensor) -> tuple[Tensor | None, ...]:
        create_graph = ctx.create_graph = torch.is_grad_enabled()
        with stacks_attached(ctx), torch.no_grad():
            grads = backward(ctx, *grad_outputs)
        if not create_graph:
            return grads
        plan: SumPlan = ctx.plan
        anchors = [
            t
            for t in [*ctx.call_tensors, *plan.params]
            if isinstance(t, Tensor) and t.requires_grad
        ]
        return not_differentiable(grads, anchors, _SECOND_BACKWARD)

    return wrapper


# NOTE [ Accumulating in the pullback ]
# Capturing every model's parameter gradients and handing them back through ParallelSum keeps
# them all alive until the last pullback, in fresh memory, and adds them into .grad afterwards:
# measured here against the plain loop, 16 medium MLPs took 0.79x and 4 wide ones 0.88x, and
# the capture alone 0.95x and 0.93x. Where the running backward would itself accumulate into a
# parameter's ``.grad`` (``backward()``), the parameter is used by this one model, its ``.grad``
# is None (``zero_grad()``'s default), no second thread trains it (NOTE [ Parameters trained
# in several threads ] in _grads), and nothing else wants to see its gradient first (a
# FlatGrad slot, step_in_backward, a tensor or post-accumulate hook, create_graph), the
# pullback's engine call accumulates it into ``.grad`` itself, as the plain loop's backward
# does, and ParallelSum returns None for it. The values are the ones a capture would give: no
# sum is involved. A failed backward sets those ``.grad`` back to None, what they were.


# NOTE [ Gradients stored, not returned ]
# Where the engine would store a gradient that ParallelSum returns for a parameter into its
# unset ``.grad`` (the parameter ``direct``: NOTE [ Accumulating in the pullback ]), but the
# pullback gave it instead of accumulating it (a stacked group's, vjp's), it is stored there by
# ParallelSum itself, on any number of threads: then no gradient ParallelSum returns depends on
# its pullbacks, which can be joined later (NOTE [ Pullbacks joined later ]), and a gradient
# from outside the sum meets the same ``.grad`` on one thread and on several. (Returned, it
# would be added to the outside ones in the engine's buffer first: another order of additions,
# other bits, than stored by a pullback handed over.)
# Backward passes of several user threads through the same parameters at once (threads training
# shared models) each found ``.grad`` None and stored their gradient over the others': 4
# threads x 30 backward passes through ParallelSum kept 117 of 120 contributions. Stores are
# made under one lock: set where ``.grad`` is still None, else added by the parameter's
# AccumulateGrad (under its own lock, in place, as the engine adds). (Another thread's engine
# sets an unset ``.grad`` outside this lock: once a second thread trains a parameter, nothing
# is stored into its ``.grad`` any more, NOTE [ Parameters trained in several threads ] in
# _grads.)
_STORE_LOCK = Lock()


def _store_grad(param: Tensor, grad: Tensor) -> None:
    """Store ``grad`` into ``param.grad`` as autograd's AccumulateGrad would: set where unset,
    else added (NOTE [ Gradients stored, not returned ])."""
    grad = _stored_grad(param, grad)
    with _STORE_LOCK:
        if param.grad is None:
            param.grad = grad
            return
        accumulate: Any = _edge(param).node  # the parameter's AccumulateGrad
        with torch.no_grad():
            accumulate(grad)


def _stored_grad(param: Tensor, grad: Tensor) -> Tensor:
    """What autograd's AccumulateGrad stores as a parameter's unset ``.grad`` when a node
    returns ``grad`` for it: ``grad`` itself, in the parameter's dtype and, dense, strides
    (its layout contract)."""
    if grad.dtype != param.dtype:
        grad = grad.to(param.dtype)
    # Two contiguous tensors of one shape have one layout: the usual case, told in two calls.
    if grad.layout != torch.strided or (grad.is_contiguous() and param.is_contiguous()):
        return grad
    if grad.stride() != param.stride():
        grad = torch.empty_like(param).copy_(grad)
    return grad


def _graph_pullback(plan: SumPlan, u: int, pullback: UnitPullback | None) -> GraphPullback | None:
    """The model's own autograd graph pullback, if the unit is one model pulled back by the
    "autograd" engine whose parameters no other entry uses (NOTE [ One engine call per
    chunk ])."""
    if not isinstance(pullback, SinglePullback) or not isinstance(pullback.inner, GraphPullback):
        return None
    slots = plan.param_slots[plan.units[u].models[0]]
    if any(plan.shared[s] for s in slots):
        return None
    return pullback.inner


@dataclass
class BatchFailure:
    """A unit's share in an engine call over several that failed: the call's error; the
    model found to reach a graph freed before the call, if the error is such a graph's
    (NOTE [ Graphs freed before the call ]), else the model the call was running, where its
    graphs tell (NOTE [ A failure that does not repeat ] in _inline); and the call's last
    unit, after whose pullback a failure that passed again in every unit is raised."""

    error: Exception
    culprit: int | None
    last: int


Batched = dict[int, tuple[list[Tensor | None], list[Tensor | None]] | BatchFailure]


def _pull_back_batched(
    plan: SumPlan,
    units: Iterable[int],
    pullbacks: list[UnitPullback | None],
    grad_outputs: Sequence[Tensor],
    weights: Tensor | list[float] | None,
    direct: Sequence[bool],
    keep_graph: bool,
    failures: list[BaseException] | None = None,
) -> Batched:
    """(argument grads, parameter grads) of the ``units`` that can share an engine call, by
    unit (NOTE [ One engine call per chunk ] in ``_engines``): one call for the models whose
    parameters all go straight into ``.grad`` (``direct``, NOTE [ Accumulating in the
    pullback ]; their parameter grads come back as None), one for the others. The units'
    forwards ran on one thread, in order. The calls free the graphs as they go, unless
    ``keep_graph``: a graph a model keeps beyond the call (a state carried to the next call)
    must not be pulled back again by the next (NOTE [ Graphs freed before the call ]). A unit
    whose call failed gets a ``BatchFailure`` and is pulled back on its own, which names the
    first model that fails (NOTE [ Engine calls of the caller's graph ] in _inline). What a
    failed call accumulated is set back to None, or, with ``failures`` (pullbacks joined
    later, whose ``.grad`` only the caller's thread may write: NOTE [ Pullbacks joined
    later ]), left for the caller to undo, and the failure recorded there."""
    together: Batched = {}
    groups: dict[bool, list[tuple[int, GraphPullback, Sequence[Tensor]]]] = {True: [], False: []}
    by_weight = WeightedCotangents(grad_outputs)
    for u in units:
        graph = _graph_pullback(plan, u, pullbacks[u])
        if graph is None:
            continue
        i = plan.units[u].models[0]
        slots = plan.param_slots[i]
        accumulate = bool(slots) and all(direct[s] for s in slots) and not graph.aliased
        cotangents = by_weight.of(plan.weight(i, weights))
        groups[accumulate].append((u, graph, cotangents))
    for accumulate, members in groups.items():
        if len(members) < (1 if accumulate else 2):
            continue
        items = [(graph, cotangents) for _, graph, cotangents in members]
        try:
            results = pull_back_together(items, retain_graph=keep_graph, accumulate=accumulate)
            together.update(zip([u for u, _, _ in members], results))
        except Exception as exc:  # the failing model is found one at a time, by the caller
            edges = [[e for e in graph.roots if e is not None] for _, graph, _ in members]
            found = reaching_a_graph_freed_before(edges) if freed_by_the_failed_call(exc) else None
            if found is None and not keep_graph:
                found = running_when_failed(edges)  # read before anything runs again
            culprit = None if found is None else plan.units[members[found][0]].models[0]
            for u, _, _ in members:
                together[u] = BatchFailure(exc, culprit, members[-1][0])
            if failures is not None and accumulate:
                failures.append(exc)
            else:
                for u, _, _ in members if accumulate else ():
                    for s in plan.param_slots[plan.units[u].models[0]]:
                        plan.params[s].grad = None  # what it was: none of it stays
        del items, members
    # This frame lives on in a failure's traceback, which ``together`` and ``failures`` hold:
    # with their names here, the graphs of units not yet pulled back again stayed until the
    # garbage collector ran.
    try:
        return together
    finally:
        del together, failures, groups


def _pull_back_chunk(
    plan: SumPlan,
    units: range,
    pullbacks: list[UnitPullback | None],
    grad_outputs: Sequence[Tensor],
    weights: Tensor | list[float] | None,
    keep_graph: bool,
    direct: Sequence[bool],
    together: Batched | None = None,
    alone: frozenset[int] = frozenset(),
    failures: list[BaseException] | None = None,
) -> Iterator[tuple[Unit, list[Tensor | None], list[list[Tensor | None]]]]:
    """(unit, argument grads, each model's parameter grads) of a chunk's units, in order.

    ``together`` holds what a call over several chunks already pulled back; else the chunk's
    units that can share an engine call get one (``_pull_back_batched``), except those in
    ``alone``. Every other unit is pulled back on its own, when the units before it are done
    with.
    """
    if together is None:
        shared = [u for u in units if u not in alone]
        together = _pull_back_batched(
            plan, shared, pullbacks, grad_outputs, weights, direct, keep_graph, failures
        )
    for u in units:
        unit = plan.units[u]
        pullback = pullbacks[u]
        if not keep_graph:
            pullbacks[u] = None
        done = together.pop(u, None)
        if isinstance(done, tuple):
            arg_grads, param_grads = done
            yield unit, arg_grads, [param_grads]
            continue
        assert pullback is not None
        unit_weights = [plan.weight(i, weights) for i in unit.models]
        try:
            arg_grads, model_grads = pullback(grad_outputs, unit_weights, keep_graph)
        except GroupWritten as written:  # NOTE [ Weights written before a group's backward ]
            error = written.error
            raise plan.model_error(unit.models[written.member], "backward", error) from error
        except Exception as exc:
            if done is None or not freed_by_the_failed_call(exc):
                raise plan.model_error(unit.models[0], "backward", exc, unit) from exc
            # Its graph freed by the failed call (models ran from the last to the first:
            # this one failed in it), or before the call by the culprit's own backward.
            i = unit.models[0] if done.culprit is None else done.culprit
            raise plan.model_error(i, "backward", done.error) from done.error
        del pullback
        if done is not None and (
            done.culprit == unit.models[0] or (done.culprit is None and u == done.last)
        ):
            # It passed again: a failure that does not repeat (NOTE [ A failure that does
            # not repeat ] in _inline), named where the graphs told.
            if done.culprit is None:
                raise done.error
            raise plan.model_error(done.culprit, "backward", done.error) from done.error
        yield unit, arg_grads, model_grads


def model_weight_grad(grad_outputs: Sequence[Tensor], out: Sequence[Tensor]) -> Tensor:
    """d loss / d w_i = <grad of the sum, model i's output>, over the output's leaves: for
    complex outputs ``sum(g * conj(o))``, PyTorch's convention for the product ``w_i * o``
    (NOTE [ Complex weights ] in _engines)."""
    return sum((g * o.conj()).sum() for g, o in zip(grad_outputs, out))  # type: ignore[return-value]


# NOTE [ Weight gradients at once ]
# A weight tensor that needs a gradient got it model by model: ``model_weight_grad``'s product
# and reduction (three kernels and a Python sum) and a conversion each, then a stack: 64 tiny
# MLP classes with learned weights took 0.7 ms more a backward than without (2 cores). Where
# every output leaf is a float32 or float64 CPU tensor of at most WEIGHT_GRAD_ELEMENTS elements,
# laid out row-major as its gradient is (``_row_major``: contiguous, a stacked group's rows, or
# broadcast), or of any layout where the gradient is row-major and dense (``_dense``: it lays
# out each model's product, as the stack's), every model's outputs are stacked, multiplied by
# the gradient and reduced over all but the models' dimension, in a few kernels for all: each
# row is reduced as the model's own ``.sum()`` reduces it, so the bits are those of
# ``model_weight_grad`` (tested on 1 and 2 intra-op threads for shapes up to 32768 elements,
# and for 2,144 layouts of outputs and gradients: permuted, a stacked group's rows, stepped,
# broadcast). A larger reduction of one tensor is split over intra-op threads
# (at::internal::GRAIN_SIZE), which the rows of a stack are not, and a column-major gradient
# makes each model's product column-major, reduced in another order: the bits would differ
# there, and those go model by model, as do others.
WEIGHT_GRAD_ELEMENTS = 32768

# NOTE [ Weights' gradient before the steps ]
# A learned weight tensor's gradient reads the models' outputs. An output may be a view of its
# model's own parameter (``self.bias.expand(n, k)``), which ``step_in_backward`` writes in place
# in the backward; the plain loop takes every gradient before its optimizer steps. So the
# weights' gradient is taken before any step: at once before the pullbacks, or model by model
# before the unit's models step (their weights' gradient was taken after, and read the stepped
# values: off by 4.6 in a probe, silently).


def fits_weight_grad_at_once(
    grad_outputs: Sequence[Tensor | None], outputs: Sequence[Sequence[Tensor] | None]
) -> bool:
    """Whether ``weight_grad_at_once`` takes these (NOTE [ Weight gradients at once ])."""
    if not outputs or outputs[0] is None or len(outputs[0]) != len(grad_outputs):
        return False
    for g, o in zip(grad_outputs, outputs[0]):
        if (
            g is None
            or o.dtype not in (torch.float32, torch.float64)
            or g.dtype != o.dtype
            or g.shape != o.shape
            or o.device.type != "cpu"
            or g.device.type != "cpu"
            or o.layout != torch.strided
            or g.layout != torch.strided
            or o.numel() > WEIGHT_GRAD_ELEMENTS
            or not _row_major(g)
        ):
            return False
    if all(_dense(g) for g in grad_outputs if g is not None):
        return all(out is not None for out in outputs)  # g lays each product out
    return all(out is not None and all(map(_row_major, out)) for out in outputs)


def _dense(t: Tensor) -> bool:
    """Whether every dimension of ``t`` but those of size 1 has a stride: a product ``t * o``
    is then laid out as ``t`` is, whatever ``o``'s layout (TensorIterator orders dimensions
    by the first input whose strides there are not 0)."""
    return all(stride != 0 for size, stride in zip(t.shape, t.stride()) if size != 1)


def _row_major(t: Tensor) -> bool:
    """Whether ``t``'s elements lie in row-major order, with gaps (a stacked group's rows) or
    broadcast: its strides, but those of size-1 dimensions and zeros, decrease. A product of two
    such tensors is laid out contiguously, so its ``.sum()`` reduces in the stack's order (NOTE
    [ Weight gradients at once ]); a column-major gradient made the product column-major."""
    last = None
    for size, stride in zip(t.shape, t.stride()):
        if size == 1 or stride == 0:
            continue
        if last is not None and stride >= last:
            return False
        last = stride
    return True


def weight_grad_at_once(
    weight_tensor: Tensor,
    grad_outputs: Sequence[Tensor],
    outputs: Sequence[Sequence[Tensor] | None],
) -> Tensor:
    """The weight tensor's gradient, every model's ``model_weight_grad`` at once, with its bits
    (NOTE [ Weight gradients at once ]); where ``fits_weight_grad_at_once``."""
    kept = [out for out in outputs if out is not None]
    assert len(kept) == len(outputs)  # every model's, row by row (fits_weight_grad_at_once)
    total: Tensor | None = None
    for j, g in enumerate(grad_outputs):
        products = torch.stack([out[j] for out in kept]).mul_(g)
        if products.dim() > 1:
            products = products.sum(dim=tuple(range(1, products.dim())))
        # model_weight_grad's Python sum starts from 0, which makes a -0.0 0.0
        total = products.add_(0) if total is None else total.add_(products)
    assert total is not None
    return total.to(weight_tensor.device, weight_tensor.dtype)


def weight_grad_of(
    weight_tensor: Tensor,
    grad_outputs: Sequence[Tensor],
    outputs: Sequence[Sequence[Tensor] | None],
) -> Tensor:
    """The weight tensor's gradient from every model's kept outputs: at once where it fits
    (NOTE [ Weight gradients at once ]), else model by model."""
    if fits_weight_grad_at_once(grad_outputs, outputs):
        return weight_grad_at_once(weight_tensor, grad_outputs, outputs)
    per_model: list[Tensor | None] = []
    for out in outputs:
        assert out is not None
        per_model.append(model_weight_grad(grad_outputs, out))
    return stack_weight_grads(weight_tensor, per_model)


def stack_weight_grads(weight_tensor: Tensor, grads: Sequence[Tensor | None]) -> Tensor:
    """The weight tensor's gradient from each model's (None: zero), on the weights' device,
    which may differ from the models' (CPU weights, CUDA models, as in the plain loop's
    ``w[i] * m_i(x)``)."""
    dtype, device = weight_tensor.dtype, weight_tensor.device
    return torch.stack(
        [
            torch.zeros((), dtype=dtype, device=device)
            if g is None
            # Complex outputs, a real weight: the real part (NOTE [ Complex weights ] in _engines).
            else (g.real if g.is_complex() and not dtype.is_complex else g).to(device, dtype)
            for g in grads
        ]
    )


class FreedGraphError(ParsumError):
    """``freed_graph_error``'s type, for the caller's graph to tell it apart (NOTE [ Engine
    calls of the caller's graph ] in ``_inline``)."""


def freed_graph_error(plan: SumPlan) -> ParsumError:
    """A second backward through a result whose graph the first one freed."""
    return FreedGraphError(
        f"{plan.where}: backward ran a second time through the same result, whose graph was "
        "freed by the first one; pass retain_graph=True to the first backward, or call "
        "sum_models again"
    )


def freed_by_the_failed_call(exc: Exception) -> bool:
    """Whether ``exc`` is autograd's error, or a nested sum_models', for a graph whose saved
    tensors were freed."""
    return isinstance(exc, FreedGraphError) or (
        isinstance(exc, RuntimeError)
        and "backward through the graph a second time" in message_of(exc)
    )


# NOTE [ Graphs freed before the call ]
# A model that carries a state across calls without detaching it (an RNN's hidden state, a
# running estimate) reaches, in its graph, nodes made by an earlier call whose backward freed
# them: the next backward fails with autograd's "backward through the graph a second time".
# Such a node is older than every node of the call, so the engine, which runs the ready node of
# highest sequence number first, reaches it after every model's own nodes ran and freed theirs:
# pulled back alone, every model then fails with that error, and the first in model order was
# named whatever model carried the state (three models, the third carrying it: "model 0
# (Sequential)"). The node that failed is not in the error. But the models of one engine call
# ran forward on one thread in model order, and a thread numbers its nodes in creation order:
# the nodes model i made are numbered above the last output node of the model before it, so a
# node numbered at or below that one, and freed, was made before model i ran, and model i is the
# one that reaches it. The first model of the call has no such bound: it is named by the rule
# above when no later model is found (a state made on another thread, numbered by that thread,
# is not found either).
# ParallelSum's engine calls over several models (NOTE [ One engine call per chunk ] in
# _engines) kept the graphs, for the failing model to be found by pulling each back again, and
# dropped them after: a graph that the model's state kept alive kept its saved tensors, so each
# backward went on through every call before it (after 21 calls a gradient 22 times the first),
# where the plain loop raises. They free the graphs as they go, as the caller's graph does, and
# a model pulled back again after a failed call is named as there (``_pull_back_chunk``).


def reaching_a_graph_freed_before(
    output_edges: Sequence[Sequence[GradientEdge]],
) -> int | None:
    """Of models whose forwards ran on one thread in this order (each given by its output
    leaves' edges), the first after the first whose graph reaches a node with freed saved
    tensors made before that model ran (NOTE [ Graphs freed before the call ])."""
    bound: int | None = None
    for i, edges in enumerate(output_edges):
        if bound is not None and any(
            leaf_of(node) is None and node._sequence_nr() <= bound and _saved_state(node) is True
            for node in graph_nodes(edges)
        ):
            return i
        bound = _last_output_number(edges, bound)
    return None


def _last_output_number(edges: Sequence[GradientEdge], before: int | None) -> int | None:
    """The highest number of a model's output nodes (its leaves' aside), or ``before`` where
    it has none: a bound on the numbers of the nodes the model made, for the model after it
    (NOTE [ Graphs freed before the call ])."""
    numbers = [e.node._sequence_nr() for e in edges if leaf_of(e.node) is None]
    return max(numbers) if numbers else before


def _saved_state(node: Any) -> bool | None:
    """Whether ``node``'s saved tensors were freed by a backward (True) or are kept (False);
    None where it saved none. A kept one is not unpacked: it is seen by its data or its hooks
    (an unpacked tensor would be one more reference to the graph), a freed one by the error of
    reading it, where an undefined one (a None saved) reads None. A custom Function's node
    tells even where it saved nothing: its buffers are marked freed once it ran."""
    try:
        if hasattr(type(node), "saved_tensors"):  # a custom Function's node
            node._raw_saved_tensors  # noqa: B018  # raises once freed
            return False
        raw = {n[len("_raw") :]: getattr(node, n) for n in _raw_saved_names(type(node))}
    except Exception as exc:  # only a failure's naming hangs on it: never raise instead
        return True if freed_by_the_failed_call(exc) else None
    for saved in raw.values():
        for one in saved if isinstance(saved, (list, tuple)) else (saved,):
            if one.unpack_hook is not None or one.data is not None:
                return False
    for name in raw:
        try:
            getattr(node, name)  # nothing defined: reads None, or raises where freed
        except Exception as exc:
            if freed_by_the_failed_call(exc):
                return True
    return None


_RAW_SAVED_NAMES: dict[type, list[str]] = {}


def _raw_saved_names(node_type: type) -> list[str]:
    """The ``_raw_saved_*`` attributes of a kind of autograd node, kept (``dir`` on every
    node of a large graph took 20 us a node)."""
    names = _RAW_SAVED_NAMES.get(node_type)
    if names is None:
        names = [n for n in dir(node_type) if n.startswith("_raw_saved_")]
        _RAW_SAVED_NAMES[node_type] = names
    return names


def running_when_failed(output_edges: Sequence[Sequence[GradientEdge]]) -> int | None:
    """Of models pulled back in one engine call that failed, freeing their graphs as it went
    (each given by its output leaves' edges; their forwards ran on one thread in this order),
    the one it was pulling back, or None where their saved tensors do not tell
    (NOTE [ A failure that does not repeat ] in _inline)."""
    states: list[tuple[int, bool, bool]] = []  # (model, some freed, some kept)
    bound: int | None = None  # the last output node of the model before
    for i, edges in enumerate(output_edges):
        if not edges:
            continue
        freed = kept = False
        for node in graph_nodes(edges, newer_than=bound):  # the model's own nodes
            if leaf_of(node) is None:
                state = _saved_state(node)
                freed, kept = freed or state is True, kept or state is False
        states.append((i, freed, kept))
        bound = _last_output_number(edges, bound)
    for i, freed, kept in states:
        if freed and kept:  # run in part
            return i
    first_done = next((k for k, (_, freed, _) in enumerate(states) if freed), len(states))
    if any(kept for _, _, kept in states[first_done:]):
        return None  # not run from the last to the first
    # The failing model is the last before the first run through that did not finish: the
    # last kept one, or a model after it whose nodes save nothing (no telling whether it ran).
    last_kept = max((k for k in range(first_done) if states[k][2]), default=0)
    suspects = states[last_kept:first_done]
    return suspects[0][0] if len(suspects) == 1 else None


def raise_first_failing_model(
    plan: SumPlan,
    attempts: Sequence[tuple[int, Callable[[], object]]],
    original: Exception,
    running: int | None = None,
    groups: Mapping[int, Unit] | None = None,
) -> None:
    """Run each model's attempt in order and raise the error of the first that fails, named:
    its own, or ``original`` where the failed call freed part of its graph; named ``running``
    (the model the failed call was running, where known) where the failure does not repeat
    or the call freed part of a graph; return if none fails and ``running`` is None (the
    caller raises ``original``). ``groups``: the stacked groups whose models were attempted
    together, by their first model, named with it."""

    def error_of(i: int, exc: BaseException) -> ParsumError:
        return plan.model_error(i, "backward", exc, groups.get(i) if groups else None)

    for i, attempt in attempts:
        error = None
        try:
            attempt()
        except Exception as exc:
            # The exception is its cause (no local may hold it: a cycle through its frame).
            if not freed_by_the_failed_call(exc):
                error = error_of(i, exc)
            else:
                error = error_of(i if running is None else running, original)
        if error is not None:
            try:
                raise error
            finally:
                error = None
    if running is not None:
        try:
            raise error_of(running, original)
        finally:
            original = None  # type: ignore[assignment]


class ParallelSum(torch.autograd.Function):
    """``sum_i w_i * models[i](*args, **kwargs)`` with parallel forward and backward.

    The ``torch.autograd.Function`` under :func:`parsum.sum_models`, documented for those who
    build their own front end; ``sum_models`` is the normal door, since it checks the arguments
    and builds the ``SumPlan``. Inputs: ``(plan, *argument_tensors, [weight_tensor], [join],
    *params)`` in the order the plan describes (``join``: where ``plan.join`` is set, a join
    node's output, NOTE [ Pullbacks joined later ]); outputs: the summed output leaves
    (``plan.out_spec`` gives their structure). backward is once differentiable (a second
    backward through the gradients it returns raises); after a backward with
    ``retain_graph=True`` it may run again.

    >>> import torch, parsum
    >>> models = [torch.nn.Linear(3, 1) for _ in range(3)]
    >>> x = torch.ones(2, 3, requires_grad=True)
    >>> parsum.sum_models(models, x).sum().backward()  # runs ParallelSum.apply
    >>> x.grad.shape
    torch.Size([2, 3])
    """

    @staticmethod
    def forward(ctx: Any, plan: SumPlan, *tensors: Tensor) -> tuple[Tensor, ...]:
        n_args = len(plan.call.tensor_positions)
        arg_tensors = tensors[:n_args]
        weight_tensor = tensors[n_args] if plan.has_weight_tensor else None
        call = plan.call.with_tensors(arg_tensors, ctx.needs_input_grad[1 : 1 + n_args])
        weight_needs_grad = plan.has_weight_tensor and ctx.needs_input_grad[1 + n_args]
        result = run_forward(plan, call, weight_tensor, True, keep_outputs=weight_needs_grad)
        if (
            not weight_needs_grad
            and not reports_failures()
            and not any(map(_differentiable, result.pullbacks))
        ):
            # As in the plain loop, and in the caller's graph: a sum of outputs that need no
            # gradient needs none, though an argument does. Not a rank's part of a
            # parsum.distributed sum, whose backward every rank runs, to exchange the
            # argument's gradient (NOTE [ Cross-rank sum ] in distributed).
            ctx.mark_non_differentiable(*result.leaves)
        ctx.plan = plan
        ctx.before_backward = None
        ctx.call = call
        ctx.pullbacks = result.pullbacks
        ctx.outputs = result.outputs
        ctx.output_versions = result.output_versions
        ctx.weight_needs_grad = weight_needs_grad
        ctx.announce_failure = _announcer.hook
        ctx.call_tensors = tensors[: n_args + int(plan.has_weight_tensor)]
        if weight_tensor is not None:
            ctx.save_for_backward(weight_tensor)
        return tuple(result.leaves)

    @staticmethod
    @_once_differentiable
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Tensor | None, ...]:
        plan: SumPlan = ctx.plan
        if ctx.pullbacks is None:
            raise freed_graph_error(plan)
        _pool.abandon_unjoined()  # a backward interrupted before: NOTE [ Interrupted callers ]
        run = _Backward(ctx, grad_outputs)
        try:
            run.pull_back_all()
            return run.gradients()
        except RuntimeError as exc:  # NOTE [ Gradients under vmap ] in _inline
            if isinstance(exc, ParsumError) or not any(map(under_vmap, grad_outputs)):
                raise
            raise ParsumError(_UNDER_VMAP) from exc


def _differentiable(pullback: UnitPullback | None) -> bool:
    """Whether a unit's output may need a gradient: known for a model of engine "autograd"
    (its outputs' gradient edges), assumed for one under ``torch.func``."""
    if pullback is None:
        return False
    if isinstance(pullback, SinglePullback) and isinstance(pullback.inner, GraphPullback):
        return any(edge is not None for edge in pullback.inner.roots)
    return True


# NOTE [ Large models pulled back alone ]
# A chunk's models share one engine call (NOTE [ One engine call per chunk ] in _engines), which
# gives every model's gradients at once. With optimizers stepping in the backward, a model too
# large to wait for its chunk's others (``WaitingSteps``) steps right after its pullback, and its
# gradients go with the step: in a call of its own it is pulled back only once the models before
# it stepped, so that a thread holds one such model's gradients, not its chunk's. 32 MLPs (512 ->
# 1024 -> 512, 4 MiB of gradients each) in 16 chunks of 2: the peak of two Adam steps with
# StepInBackward 32.2 -> 23.8 MiB on 2 workers (78% -> 85% of the 128 MiB of gradients saved),
# 20.2 -> 16.4 at n_jobs=1 (benchmarks/bench_memory.py); the call's fixed cost (25-80 us) is
# small beside such a model's backward (a step against the code before: 1.014x and 0.992x in
# 40 and 60 rounds, within the noise).


# NOTE [ Steps after a failure ]
# A backward whose optimizers step in the pullbacks claims its chunks costliest first, as one
# without steps does (NOTE [ Costliest chunks first ] in _grouping): in chunk order, the
# costliest chunk might start last and run alone at the end, and with fewer, larger chunks a
# call (NOTE [ Chunks of models that step ] in _grouping) it did: 16 MLPs of widths 128-512 at
# batch 256 in 4 chunks on 2 threads, the chunk holding the widest started last, 17.4 ms a
# backward against 16.9 in 16 chunks; claimed costliest first, the call ran as fast as in 16
# (a step 0.99x and 0.98x, against 0.96x in chunk order). After a failure, the chunks
# before the failing one still start, so that the failure reported is the one a run on one
# thread meets first; claimed in chunk order, they had all started before it. Once a chunk
# fails, no step runs any more: the chunks that start or end after it drop their models'
# gradients instead of stepping (and steps waiting in a chunk, NOTE [ One step over a chunk's
# small models ] in _fused, are dropped with them), and the failed call names the models that
# stepped before, as before.


class WaitingSteps:
    """The optimizer steps of a chunk's small models, waiting for the chunk's last pullback
    (NOTE [ One step over a chunk's small models ] in _fused), with their gradients: at most
    MERGED_STEP_ELEMENTS parameter elements in all."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, int, list[Tensor], list[Tensor | None]]] = []
        self.elements = 0

    def add(self, i: int, j: int, params: list[Tensor], grads: list[Tensor | None]) -> bool:
        """Wait with model ``i``'s step (``sib.optimizers[j]``); False for a model too large
        to wait, which steps now."""
        if self.too_large(params):
            return False
        self.entries.append((i, j, params, grads))
        self.elements += sum(map(Tensor.numel, params))
        return True

    @staticmethod
    def too_large(params: Sequence[Tensor]) -> bool:
        """Whether a model stepping ``params`` is too large to wait: it steps now."""
        return sum(map(Tensor.numel, params)) > MERGED_STEP_ELEMENTS

    @property
    def full(self) -> bool:
        """Whether as many elements wait as may: the waiting steps run now."""
        return self.elements >= MERGED_STEP_ELEMENTS

    def take(self) -> tuple[list[tuple[int, int, list[Tensor], list[Tensor | None]]], list[int]]:
        """The waiting steps and their models; none wait any more."""
        entries, self.entries, self.elements = self.entries, [], 0
        return entries, [i for i, _, _, _ in entries]


class _Backward:
    """One backward of ``ParallelSum``, step by step: route the incoming gradients
    (``__init__``), pull back each chunk and route each model's gradients (``chunk``), reduce
    the chunks' partials in order (``consume``, ``pull_back_all``, which undoes everything on a
    failure), and return one gradient per input (``gradients``). NOTE [ Data flow ]."""

    def __init__(self, ctx: Any, grad_outputs: Sequence[Tensor]) -> None:
        plan: SumPlan = ctx.plan
        self.ctx, self.plan, self.grad_outputs = ctx, plan, grad_outputs
        self.pullbacks: list[UnitPullback | None] = ctx.pullbacks
        self.outputs: list[list[Tensor] | None] = ctx.outputs
        if ctx.weight_needs_grad:
            check_outputs_kept(plan, self.outputs, ctx.output_versions)
        # NOTE [ Freeing per-model graphs ]: keep them only when the engine keeps the graph
        # (retain_graph=True, gradcheck, jacobian); otherwise each pullback is dropped as soon
        # as it ran, so memory falls during backward as in plain PyTorch.
        self.keep_graph = _engine_keeps_graph()
        if not self.keep_graph:
            ctx.pullbacks = ctx.outputs = None
        self.weight_tensor = ctx.saved_tensors[0] if plan.has_weight_tensor else None
        # NOTE [ A weight tensor read as floats ]
        self.weights = weight_values(self.weight_tensor)
        self.param_grads: list[Tensor | None] = [None] * len(plan.params)
        self.weight_grads: list[Tensor | None] = [None] * len(plan.models)
        self.weight_grad: Tensor | None = None  # taken at once (NOTE [ Weight gradients at once ])
        self.weight_grads_per_model = ctx.weight_needs_grad and not fits_weight_grad_at_once(
            grad_outputs, self.outputs
        )
        self.arg_totals: dict[int, Any] = {}  # GradSum, or lists of terms
        # NOTE [ Argument gradients at once ] in _summation
        arguments = [ctx.call.leaves[j] for j in ctx.call.grad_positions]
        self.args_at_once = terms_at_once(len(plan.models), arguments)
        # GradSum, or lists of terms (NOTE [ Shared gradients at once ] in _summation)
        self.shared_totals: dict[int, Any] = {}
        self.sib = plan.step_in_backward
        if self.sib is not None:  # NOTE [ Gradients from outside the sum ] in _fused
            _at_end_of_backward(self.sib._stepped.clear)
        # NOTE [ Who writes a FlatGrad slot ] in _grads; NOTE [ Fused steps ] in _fused.
        first_param = len(ctx.next_functions) - len(plan.params)
        self.accumulates = engine_runs_all([node for node, _ in ctx.next_functions[first_param:]])
        if self.sib is not None:
            self.note_steps()
        # Gradients that step_in_backward consumes never reach .grad, FlatGrad or not.
        stepping = {
            s
            for i, j in enumerate(plan.step_index or ())
            if j is not None
            for s in plan.param_slots[i]
        }
        to_grad = [acc and k not in stepping for k, acc in enumerate(self.accumulates)]
        self.flat = (
            FlatWrites(plan.params, to_grad, slots=plan.walk.slots_in_flat_grads)
            if any(to_grad) and has_flat_grads(plan.params)
            else None
        )
        self.stepped: list[int] = []
        # NOTE [ Steps after a failure ]: set once a chunk failed
        self.failed = False
        # NOTE [ Accumulating in the pullback ] (per parameter on every call: plain reads)
        # NOTE [ Parameters trained in several threads ] in _grads (noted on every backward)
        self.trainers = plan.walk.trainers
        several_threads = self.trainers.several(_notes_a_trainer(grad_outputs))
        plainly = not ctx.create_graph and plan.walk.params_are_leaves and not several_threads
        self.direct = [
            acc
            and plainly
            and not shared
            and p.grad is None
            and p._backward_hooks is None
            and p._post_accumulate_grad_hooks is None
            for p, acc, shared in zip(plan.params, to_grad, plan.shared)
        ]
        if self.flat is not None:
            flat = self.flat
            self.direct = [d and k not in flat for k, d in enumerate(self.direct)]
        self.shared_params = plan.shared_params()
        self.shared_at_once = plan.shared_at_once()
        self.one_call = False
        self.all_chunks: Batched | None = None
        # Pullbacks joined later (NOTE [ Pullbacks joined later ]): the gradients to store,
        # by slot, and what batched engine calls failed, both for the caller's thread.
        self.to_store: list[tuple[int, Tensor]] | None = None
        self.failures: list[BaseException] | None = None
        self.finish: Callable[[], None] | None = None  # the join node's, while pending

    def route(
        self,
        i: int,
        grads: list[Tensor | None],
        shared_accs: dict[int, Any],
        waiting: WaitingSteps | None,
        to_flat: list[tuple[int, Tensor]],
    ) -> None:
        """Model ``i``'s parameter gradients: to its optimizer step (now, or with its chunk's
        other small models: ``waiting``), a shared parameter's accumulator, a FlatGrad slot
        (``to_flat``, written once its chunk is pulled back), or what backward returns."""
        plan, flat, accumulates = self.plan, self.flat, self.accumulates
        slots = plan.param_slots[i]
        j = None if plan.step_index is None else plan.step_index[i]
        if self.sib is not None and j is not None and any(accumulates[s] for s in slots):
            mine = [
                (p, g)
                for p, g, s in zip(plan.model_params[i].tensors, grads, slots)
                if accumulates[s]
            ]
            params, param_grads = [p for p, _ in mine], [g for _, g in mine]
            if waiting is None or not waiting.add(i, j, params, param_grads):
                self.step(i, j, params, param_grads)
            elif waiting.full:
                self.step_waiting(waiting)
            grads = [None if accumulates[s] else g for g, s in zip(grads, slots)]
        for slot, g in zip(slots, grads):
            if g is None:
                continue
            if plan.shared[slot]:
                (add_term if self.shared_at_once else add_grad)(shared_accs, slot, g)
            elif flat is not None and slot in flat:
                to_flat.append((slot, g))
            elif self.direct[slot]:  # NOTE [ Gradients stored, not returned ]
                if self.to_store is not None:
                    self.to_store.append((slot, g))
                else:
                    _store_grad(plan.params[slot], g)
            else:
                self.param_grads[slot] = g

    def note_steps(self) -> None:
        """Note the models this backward steps; raise where another call's backward in the
        same backward stepped one (NOTE [ One step a backward ] in _fused)."""
        plan, sib, accumulates = self.plan, self.sib, self.accumulates
        assert sib is not None and plan.step_index is not None
        mine = {
            j: i
            for i, j in enumerate(plan.step_index)
            if j is not None and any(accumulates[s] for s in plan.param_slots[i])
        }
        again = sib.claim_steps(list(mine), True)
        if again is not None:
            i = mine[again[0]]
            raise stepped_twice(plan.where, f"model {i}", plan.models[i], again[1])

    def step(self, i: int, j: int, params: list[Tensor], grads: list[Tensor | None]) -> None:
        """Model ``i``'s optimizer step (``sib.optimizers[j]``); none after a failure, its
        gradients dropped (NOTE [ Steps after a failure ])."""
        assert self.sib is not None
        if self.failed:
            return
        try:
            self.sib.step(j, params, grads)
        except Exception as exc:
            raise self.plan.model_error(i, "its optimizer step", exc) from exc
        self.stepped.append(i)

    def step_waiting(self, waiting: WaitingSteps) -> None:
        """The steps of a chunk's small models that wait: as one where their optimizers
        allow (NOTE [ One step over a chunk's small models ] in _fused)."""
        assert self.sib is not None
        entries, models = waiting.take()
        if self.failed:  # NOTE [ Steps after a failure ]
            return
        if len(entries) > 1:
            try:
                as_one = self.sib.step_as_one([(j, ps, gs) for _, j, ps, gs in entries])
            except Exception as exc:
                self.stepped.extend(models)  # some of their parameters may have changed
                who = ", ".join(map(str, models))
                raise self.plan.model_error(
                    models[0], f"the optimizer step it took as one with models {who}", exc
                ) from exc
            if as_one:
                self.stepped.extend(models)
                return
        for i, j, params, grads in entries:
            self.step(i, j, params, grads)

    def stepping_alone(self, units: range) -> frozenset[int]:
        """The units of one model whose optimizer steps right after its pullback, too large to
        wait for its chunk's others (``WaitingSteps``): pulled back each in an engine call of
        its own, so that a thread holds one such model's gradients at a time, not its chunk's
        (NOTE [ Large models pulled back alone ])."""
        plan, step_index, accumulates = self.plan, self.plan.step_index, self.accumulates
        assert step_index is not None
        alone = []
        for u in units:
            models = plan.units[u].models
            if len(models) != 1 or step_index[models[0]] is None:
                continue
            tensors, slots = plan.model_params[models[0]].tensors, plan.param_slots[models[0]]
            stepped = [p for p, s in zip(tensors, slots) if accumulates[s]]  # as route() steps
            if WaitingSteps.too_large(stepped):
                alone.append(u)
        return frozenset(alone)

    def chunk(self, k: int) -> tuple[dict[int, Any], dict[int, Any]]:
        """Pull back chunk ``k``; its argument gradients (summed, or its terms: NOTE [ Argument
        gradients at once ] in _summation) and shared-parameter gradients summed."""
        try:
            return self._chunk(k)
        except BaseException:
            self.failed = True  # NOTE [ Steps after a failure ]
            raise

    def _chunk(self, k: int) -> tuple[dict[int, Any], dict[int, Any]]:
        plan, grad_outputs = self.plan, self.grad_outputs
        if self.one_call and self.all_chunks is None:
            self.all_chunks = _pull_back_batched(
                plan,
                range(len(plan.units)),
                self.pullbacks,
                grad_outputs,
                self.weights,
                self.direct,
                self.keep_graph,
            )
        arg_accs: dict[int, Any] = {}
        shared_accs: dict[int, Any] = {}
        # A chunk of one model steps it right after its pullback.
        units = plan.chunks[k]
        one_model = len(units) == 1 and len(plan.units[units[0]].models) == 1
        waiting = None if self.sib is None or one_model else WaitingSteps()
        alone = frozenset() if waiting is None else self.stepping_alone(units)
        # The chunk's FlatGrad slots, written in one call: a few kernels for the chunk, where
        # one call a model cost 64 tiny MLP classes 1.0 ms a backward in its 64 calls.
        to_flat: list[tuple[int, Tensor]] = []
        # NOTE [ Row-sparse gradients ]: shared tables' take_rows gradients go to a
        # RowSparseAccumulator, which coalesces them all at once.
        with coalesce_later(self.shared_params):
            for unit, arg_grads, model_grads in _pull_back_chunk(
                plan,
                plan.chunks[k],
                self.pullbacks,
                grad_outputs,
                self.weights,
                self.keep_graph,
                self.direct,
                self.all_chunks,
                alone,
                self.failures,
            ):
                for j, g in enumerate(arg_grads):
                    if g is not None:
                        (add_term if self.args_at_once else add_grad)(arg_accs, j, g)
                del arg_grads
                # Before the unit's models step (in route, or after the chunk): an output may
                # be a view of its model's parameter (NOTE [ Weights' gradient before the
                # steps ]).
                for i in unit.models if self.weight_grads_per_model else ():
                    out = self.outputs[i]
                    if not self.keep_graph:
                        self.outputs[i] = None
                    assert out is not None
                    self.weight_grads[i] = model_weight_grad(grad_outputs, out)
                for i, grads in zip(unit.models, model_grads):
                    self.route(i, grads, shared_accs, waiting, to_flat)
                del model_grads
                if to_flat and sum(g.numel() for _, g in to_flat) >= FLAT_WRITE_ELEMENTS:
                    self.write_flat(to_flat)  # large models' gradients go as they come
        self.write_flat(to_flat)
        if waiting is not None and waiting.entries:
            self.step_waiting(waiting)
        return arg_accs, shared_accs

    def write_flat(self, to_flat: list[tuple[int, Tensor]]) -> None:
        """Write the FlatGrad slots waiting in ``to_flat``, and empty it."""
        if to_flat:
            assert self.flat is not None
            self.flat.write(to_flat)
            to_flat.clear()

    def consume(self, k: int, partial: tuple[dict[int, Any], dict[int, Any]]) -> None:
        arg_accs, shared_accs = partial
        merge_argument_grads(self.arg_totals, arg_accs, self.args_at_once)
        merge_argument_grads(self.shared_totals, shared_accs, self.shared_at_once)

    def pull_back_all(self) -> None:
        """Every chunk, on the pool; on a failure, undo what was written and raise.

        The parameters' tensor hooks run once, on what backward returns: NOTE [ Hooks run
        once ] in _engines. (step_in_backward, which consumes gradients here, refuses
        parameters with hooks.)
        """
        plan, flat = self.plan, self.flat
        if self.ctx.weight_needs_grad and not self.weight_grads_per_model:
            # NOTE [ Weight gradients at once ], before any step (NOTE [ Weights' gradient
            # before the steps ])
            assert self.weight_tensor is not None
            with _pool.as_one_task(len(plan.chunks)):
                self.weight_grad = weight_grad_at_once(
                    self.weight_tensor, self.grad_outputs, self.outputs
                )
            if not self.keep_graph:
                self.outputs = []
        try:
            with torch.no_grad():
                # NOTE [ Device threads ]
                # NOTE [ Random numbers replayed in backward ] in _random
                one_thread = plan.one_thread_backward or _on_device_thread(self.grad_outputs)
                workers = 1 if one_thread else plan.n_workers
                # NOTE [ Pullbacks that write shared state ]
                looked = pullback_snapshot(plan, _pool.threads_for(len(plan.chunks), workers) > 1)
                if plan.ordered_pullbacks:
                    workers = 1
                # One thread runs every chunk: one engine call for all of them, made by the
                # first chunk (under the tasks' intra-op threads). Each call inside a backward
                # measured about 80 us here: 16 medium MLPs at one thread took 11.4 ms a step
                # in 16 calls, 9.0 ms in one. The results are consumed chunk by chunk, in
                # order, so the sums and bits are unchanged. Not where each chunk's gradients
                # go somewhere as it ends, which one call would hold all at once: optimizers
                # stepping in the backward (32 models with 128 MiB of gradients at n_jobs=1:
                # a peak of 140 MiB, more than without StepInBackward, against 20 chunk by
                # chunk), or FlatGrad slots (compensated: 405 -> 285 MiB, 1.5% slower).
                # The forwards ran on one thread too, in model order, which a failure's
                # search relies on (_pull_back_batched), as it does on the chunks' order.
                self.one_call = (
                    _pool.threads_for(len(plan.chunks), workers) <= 1
                    and _pool.threads_for(len(plan.chunks), plan.forward_workers) <= 1
                    and self.sib is None
                    and self.flat is None
                    and not plan.args_made_to_need_grad
                )
                # Costliest first (NOTE [ Costliest chunks first ]), also with optimizer
                # steps in the pullbacks, whose chunks that start after a failure step nothing
                # (NOTE [ Steps after a failure ]). In chunk order with argument gradients:
                # their sums wait for the chunks in front of them (NOTE [ Argument gradients
                # chunk by chunk ] in _inline).
                ordered = not self.ctx.call.grad_positions
                order = plan.claim_order if ordered else None
                job_args = (self.chunk, len(plan.chunks), workers, self.consume, order)
                if plan.join is not None and self.returns_none():
                    # NOTE [ Pullbacks joined later ]
                    self.to_store, self.failures = [], []
                    job = _pool.start_ordered(*job_args, plan.callers_last, self.abandoned)
                    if job is not None:
                        self.finish = functools.partial(self.join, job, looked)
                        plan.join.finish = self.finish
                        return
                    self.to_store = self.failures = None
                if plan.ordered_pullbacks and not self.one_call:  # one call: in that order
                    _pool.run_last_first(self.chunk, len(plan.chunks), self.consume)
                else:
                    _pool.run_ordered(*job_args, plan.callers_last)
                # NOTE [ Spinning intra-op threads ] in _pool
                with _pool.as_one_task(len(plan.chunks)):
                    for slot in self.shared_totals:
                        total = argument_grad(self.shared_totals, slot, self.shared_at_once)
                        assert total is not None  # a slot is there once a model gave it one
                        if flat is not None and slot in flat:
                            flat.write([(slot, total)])
                        else:
                            self.param_grads[slot] = total
        except BaseException as exc:
            _pool.abandon_unjoined(leaving=True)  # NOTE [ Interrupted callers ] in _pool
            self.undo()
            if self.stepped:
                raise ParsumError(
                    f"{message_of(exc)}; the optimizer step (step_in_backward) already ran for "
                    f"models {sorted(self.stepped)}, whose parameters changed"
                ) from (exc.__cause__ or exc)
            raise
        if flat is not None:
            flat.commit()
        learn_pullback_writes(plan, looked)

    def undo(self) -> None:
        """After a failure: what the pullbacks wrote, undone; the failure announced."""
        # The units not pulled back again hold the failed call's error, whose traceback holds
        # this object (its methods' frames): a cycle that kept their graphs until the garbage
        # collector ran.
        self.all_chunks = None
        if self.flat is not None:
            self.flat.rollback()
        self.undo_direct()
        if self.ctx.announce_failure is not None:
            self.ctx.announce_failure()

    def undo_direct(self) -> None:
        # Another thread trains them since this backward started: setting .grad could meet
        # its engine (NOTE [ Parameters trained in several threads ] in _grads).
        if self.trainers.several(note=False):
            return
        for p, was_none in zip(self.plan.params, self.direct):
            if was_none:  # accumulated in a pullback, or about to be: None before
                p.grad = None

    def abandoned(self) -> None:
        """Pullbacks handed to helpers and never joined, cancelled (NOTE [ Interrupted
        callers ] in _pool): what they wrote undone, the join forgotten."""
        assert self.plan.join is not None
        if self.plan.join.finish is self.finish:
            self.plan.join.finish = None
        self.finish = None
        self.to_store = self.failures = None
        self.all_chunks = None
        self.undo_direct()

    def returns_none(self) -> bool:
        """Whether every gradient this backward returns is None whatever its pullbacks give
        (NOTE [ Pullbacks joined later ])."""
        return (
            all(self.direct)
            and self.flat is None
            and self.sib is None
            and not self.shared_params
            and not self.ctx.call.grad_positions
            # A weight tensor's, where the node was made to join later, is held back by the
            # join (NOTE [ Weights' gradients held back by the join ] in _inline) and reduced
            # at once, apart from the pullbacks.
            and not self.weight_grads_per_model
        )

    def join(self, job: Any, looked: tuple[list[Any], list[Any]] | None) -> None:
        """The caller's part of the pullbacks handed to helpers, then the wait, then the
        gradients they gave to store; on a failure, undo and raise (NOTE [ Pullbacks joined
        later ]); then whether they wrote what the models share (``looked``: NOTE
        [ Pullbacks that write shared state ])."""
        to_store = self.to_store
        assert to_store is not None
        try:
            _pool.join(job)
            if self.failures:  # a batched call failed, its models alone did not: still failed
                raise self.failures[0]
        except BaseException:
            self.undo()
            raise
        finally:
            self.to_store = self.failures = None
        params = self.plan.params
        for slot, g in to_store:
            # Set already by the engine (a gradient from outside the sum, whose nodes ran
            # before this one): added, as the engine would have added it to the stored one.
            _store_grad(params[slot], g)
        learn_pullback_writes(self.plan, looked)

    def gradients(self) -> tuple[Tensor | None, ...]:
        """One gradient per input of ``ParallelSum.forward``: None for the plan, the
        arguments', the weights', the parameters'."""
        ctx, plan = self.ctx, self.plan
        n_arg_grads = len(ctx.call.grad_positions)
        with _pool.as_one_task(len(plan.chunks)):  # NOTE [ Spinning intra-op threads ]
            arg_results = iter(
                [argument_grad(self.arg_totals, j, self.args_at_once) for j in range(n_arg_grads)]
            )
        needs = ctx.needs_input_grad[1 : 1 + len(plan.call.tensor_positions)]
        grads_in: list[Tensor | None] = [next(arg_results) if need else None for need in needs]
        if plan.has_weight_tensor:
            weight_grad = self.weight_grad
            if self.weight_grads_per_model:
                assert self.weight_tensor is not None
                weight_grad = stack_weight_grads(self.weight_tensor, self.weight_grads)
            grads_in.append(weight_grad)
        joined = (None,) if plan.join is not None else ()  # the join node's gradient
        return (None, *grads_in, *joined, *self.param_grads)
