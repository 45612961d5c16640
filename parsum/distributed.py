"""sum_models across processes (torch.distributed): each rank sums its own models, and every rank
gets the sum over all ranks.

# NOTE [ Cross-rank sum ]
# forward: each rank computes the sum of its own models with ``parsum.sum_models`` (its thread
# pool, its compensated reduction). The ranks then exchange, with one small ``all_gather``,
# whether that succeeded and a checksum of their output's structure, shapes and dtypes: a
# failure or a mismatch on one rank becomes an error on every rank at once, instead of a hang
# in the next collective. Then they all-gather their sums, and every rank adds them in rank
# order in a compensated accumulator (float64 for float32; NOTE [ Compensated summation ]), so
# every rank holds the same bits whatever the timing. Each rank's sum is rounded to its dtype
# once before the exchange.
# backward: every rank computes the same loss from the replicated result, so the gradient that
# reaches it is the same on every rank; it goes on unchanged (not world_size times) to the
# rank's own sum, whose backward gives each model's parameters their gradients as a
# single-process run would. An input that every rank passed gets, on every rank, the sum over
# all ranks' models: ``_SumGradsAcrossRanks``, an identity in forward, all-gathers the input
# gradients in backward and adds them in rank order. Before that all-gather the ranks exchange
# whether their backward succeeded: a rank whose own sum fails in backward takes part in that
# exchange from its failure path (``announcing_backward_failures``) before it raises, so every
# rank raises, none waits for a gradient that will not come, and none takes the failed rank's
# next collective for this one (which gave uninitialised gradients and then a gloo abort).
# With no input that needs a gradient there is no exchange in backward, and none is needed:
# each rank's parameters get their gradients from its own models alone.
#
# NOTE [ Balanced shares ]
# A rank's step lasts as long as the slowest rank's: ``share`` splits the models by their
# estimated cost (parameters times batch rows, a convolution's times its positions, plus a fixed
# cost a model: NOTE [ Chunks ] in _grouping), the costliest first, each to the rank with the
# least so far. Identical models that run stacked when there are AUTO_STACK_MIN_BATCHED or more
# of them (NOTE [ Stacked groups ]) stay together on one rank where their cost allows it, and
# are otherwise dealt round robin, a part to every rank; where fewer items than ranks remain
# (a group kept whole beside one costly model, on 3 ranks), the largest groups are halved
# until every rank gets one. 2 processes on 2 cores: 8 CNNs of
# widths 8-24 took 59.3 ms a step dealt round robin (the widest models on one rank) and 47.8
# balanced, 16 MLPs of widths 128-512 at batch 64 5.52 and 5.28 ms.
#
# NOTE [ One exchange a forward ]
# A rank learns whether every rank succeeded, with outputs of its structure, before it may use
# their sums; exchanging that first and the sums second cost two collectives a forward, each a
# round trip (200-400 us with gloo on one 2-core host; 2 processes, 64 identical tiny MLPs: 0.39
# and 0.32 ms of a 1.7 ms forward). Every rank keeps, per process group, the payload size that
# every rank agreed on in the last call that succeeded everywhere: each rank updates it from the
# same gathered statuses, so it is the same on every rank whatever each passed. A call that finds
# one sends its status and its sums in one all_gather of bytes, a rank that failed or whose sums
# have another size sending zeros of the agreed size in their place. The statuses decide as before
# (every rank reads the same ones), and where the sizes changed on every rank alike (a smaller
# last batch, an evaluation between training steps) the sums follow in a second exchange (through
# the shared slots where they hold them: NOTE [ Exchanges on one host ] in _host_exchange; 2
# processes on 2 cores, 16 MLPs at batch 64 and 32 in turn, 7.0-7.3 -> 5.2-5.7 ms a step on
# average, against gloo for that second exchange), as on a first call. Every rank therefore makes
# the same collectives, also where ranks pass arguments of different shapes by mistake (the
# statuses then name them). The agreed size is held per process-group object, weakly: a process
# that destroys its group and makes one of the same name with other processes has nothing agreed
# for it, as the newcomers have not (held by name, it had sent a first all_gather of another size
# than theirs).
#
# NOTE [ One rank ]
# A group of one rank sums its models with ``parsum.sum_models`` and exchanges nothing: the sum in
# rank order of one rank's sum is that sum (bit for bit: one compensated add of one tensor), and
# a failure has no other rank to tell. The exchange cost such a group a gloo all_gather with
# itself (0.31 ms on 2 cores) and its bookkeeping, 0.64 ms a call in all (16 MLPs of widths
# 128-512 at batch 64, one thread: 6.77 against 6.13 ms for the forward alone).
#
# NOTE [ Releasing the process group ]
# torch.distributed.nn.functional declares ``group=group.WORLD`` defaults, evaluated when it is
# first imported. torch imports it lazily (``torch.optim`` does, through ``torch._dynamo``), so a
# script that builds its optimizer after ``init_process_group`` pins the default group for the
# life of the process: ``destroy_process_group`` then leaves gloo's threads running into
# interpreter shutdown, where the process can abort ("terminate called without an active
# exception"; 8 in 76 runs of a torch-only script under load, 0 in 100 with the module
# imported first). Importing it here, before any group exists, binds those defaults to None.
"""

from __future__ import annotations

import functools
import weakref
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # NOTE [ Releasing the process group ]
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ._api import sum_models as _local_sum
from ._engines import ModelParams, flatten_output
from ._errors import ParsumError
from ._function import announcing_backward_failures, distributed_call, not_differentiable
from ._grouping import AUTO_STACK_MIN_BATCHED, Batch, estimated_cost, structure_key
from ._host_exchange import GroupSlots, group_object
from ._summation import CompensatedAccumulator

_WHERE = "parsum.distributed.sum_models"
_PARSUM_KEYWORDS = ("weights", "n_jobs", "engine", "chunk_size", "step_in_backward")


def sum_models(
    models: Sequence[Callable[..., Any]], *args: Any, group: Any = None, **kwargs: Any
) -> Any:
    """The sum of every rank's models, identical on every rank (``torch.distributed``).

    Each rank passes its own models, for example ``all_models[rank::world_size]``, and the
    same arguments; each computes its local sum with :func:`parsum.sum_models` on its own
    threads, and the ranks add their sums in rank order, compensated, so the result has the
    same bits on every rank. Launch with ``torchrun`` and call
    ``torch.distributed.init_process_group`` first (gloo on CPU, NCCL for CUDA tensors). Ranks
    that all run on one host (x86-64 Linux) exchange their sums through shared memory once a
    call succeeded on every rank, instead of through gloo's threads; give each its share of the
    cores (``OMP_NUM_THREADS``).

    Backward: when every rank computes the same loss from the result and calls backward,
    every rank's input gradient equals the single-process input gradient (the sum over all
    ranks' models), and each rank's parameters get the gradients a single-process run gives
    them; nothing is multiplied by the world size.

    Run under ``torchrun --nproc-per-node 2 script.py`` (``examples/distributed_ensemble.py``):

    >>> torch.distributed.init_process_group("gloo")  # doctest: +SKIP
    >>> rank, size = dist.get_rank(), dist.get_world_size()  # doctest: +SKIP
    >>> y = parsum.distributed.sum_models(all_models[rank::size], x)  # doctest: +SKIP
    >>> y.pow(2).mean().backward()  # doctest: +SKIP

    Args:
        models: this rank's models, non-empty.
        *args: passed to every model; the same on every rank.
        group: the process group, or None for the default one.
        **kwargs: ``weights`` (for this rank's models), ``n_jobs``, ``engine``,
            ``chunk_size`` and ``step_in_backward`` as in :func:`parsum.sum_models`; any other
            keyword goes to the models.

    Returns:
        The sum over all ranks' models, with the structure of one model's output.

    Raises:
        ParsumError: when torch.distributed is not initialized, when this rank's models fail
            (naming the model), or when another rank's failed or returned another structure,
            shape or dtype (naming the ranks).
    """
    _check_initialized(_WHERE)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1:  # NOTE [ One rank ]: the rank's own sum is every rank's
        with distributed_call():  # NOTE [ Pullbacks joined later ] in _function
            return _local_sum(models, *args, **kwargs)
    if torch._C._are_functorch_transforms_active():  # before any exchange: ranks stay in step
        raise ParsumError(
            f"{_WHERE}: called inside a torch.func transform (grad, vmap, jacrev, ...) with "
            f"{world} ranks: the exchange between ranks runs outside the transform, which "
            "would not see the other ranks' part; call parsum.sum_models on all the models in "
            "the transform, or differentiate with torch.autograd.grad"
        )
    device = _status_device(group)
    # The models' arguments are the same on every rank; parsum's own keywords (weights for this
    # rank's models) are the rank's alone.
    own = {k: kwargs.pop(k) for k in _PARSUM_KEYWORDS if k in kwargs}
    leaves, spec = pytree.tree_flatten((args, kwargs))
    wanted = [j for j, leaf in enumerate(leaves) if isinstance(leaf, Tensor) and leaf.requires_grad]
    if wanted and torch.is_grad_enabled():
        synced = _SumGradsAcrossRanks.apply(group, *[leaves[j] for j in wanted])
        for j, t in zip(wanted, synced):
            leaves[j] = t
        args, kwargs = pytree.tree_unflatten(leaves, spec)
    kwargs = {**kwargs, **own}
    error: Exception | None = None
    local_leaves: list[Tensor] = []
    out_spec = None
    announce = functools.partial(_exchange_backward_status, group, device, 1)
    try:
        with announcing_backward_failures(announce if wanted else None), distributed_call():
            local = _local_sum(models, *args, **kwargs)
        local_leaves, out_spec = flatten_output(local)
    except Exception as exc:  # announced to the other ranks before it is raised here
        error = exc
    signature = repr([(tuple(t.shape), str(t.dtype)) for t in local_leaves]) + repr(out_spec)
    payload = None if error is not None else _packed([t.detach() for t in local_leaves], device)
    size = -1 if payload is None else payload.numel()
    status = torch.tensor(
        [int(error is not None), zlib.crc32(signature.encode()), size],
        dtype=torch.int64,
        device=device,
    )
    # NOTE [ One exchange a forward ]
    # By name, not by object: holding a process group keeps gloo's threads alive into the
    # interpreter's shutdown (NOTE [ Releasing the process group ]).
    key = _group_key(group)
    held = _agreed_sizes.get(key)
    # A group destroyed and made again under its name is another object: nothing agreed yet.
    agreed = held[1] if held is not None and held[0]() is group_object(group) else None
    payloads: list[Tensor] | None = None
    if agreed is None:
        statuses = [torch.empty_like(status) for _ in range(world)]
        dist.all_gather(statuses, status, group=group)
    else:
        mine = payload if size == agreed else None
        if mine is None:
            mine = torch.zeros(agreed, dtype=torch.uint8, device=device)
        both = torch.cat([status.view(torch.uint8), mine])
        gathered = _all_gather(both, group)  # through the slots where they hold it
        at = status.numel() * status.element_size()
        statuses = [g[:at].view(torch.int64) for g in gathered]
        payloads = [g[at:] for g in gathered]
    if error is not None:
        try:
            raise error
        finally:
            error = None  # this frame is on the error's traceback: no cycle through it
    table = torch.stack(statuses).tolist()  # one conversion: (failed, checksum, size) a rank
    failed = [r for r, (fails, _, _) in enumerate(table) if fails]
    if failed:
        raise ParsumError(
            f"{_WHERE}: rank(s) {failed} failed in forward (see their errors); rank {rank} "
            "stops too"
        )
    differ = [r for r, (_, checksum, _) in enumerate(table) if checksum != table[rank][1]]
    if differ:
        raise ParsumError(
            f"{_WHERE}: rank(s) {differ} returned another output structure, shape or dtype than "
            f"rank {rank} ({signature}); every rank's models must return the same"
        )
    assert out_spec is not None and payload is not None
    if payloads is None or size != agreed:  # the same on every rank: every size is this one
        payloads = _all_gather(payload, group)  # through the slots where they hold it
    if len(_agreed_sizes) >= 64:  # groups made and dropped again and again: bounded
        _agreed_sizes.clear()
    _agreed_sizes[key] = (weakref.ref(group_object(group)), size)
    if device.type == "cpu":  # gloo's: the next calls' exchange through shared memory
        _slots.prepare(key, group, status.numel() * status.element_size() + size)
    totals = _sums_in_rank_order(payloads, local_leaves)
    total = _SumAcrossRanks.apply(totals, *local_leaves)
    return pytree.tree_unflatten(list(total), out_spec)


# Per process group (its name, the same on every rank, and size): the payload bytes every rank
# agreed on in the last call that succeeded everywhere (NOTE [ One exchange a forward ]).
_agreed_sizes: dict[tuple[str | None, int], tuple[weakref.ref, int]] = {}
_slots = GroupSlots()
_ALIGN = 16  # bytes: each leaf starts where any dtype may be viewed


def _packed(leaves: list[Tensor], device: torch.device) -> Tensor:
    """The leaves' bytes, one after another, each padded to _ALIGN bytes, on ``device`` (the
    backend's: gloo's CPU for CUDA outputs too)."""
    parts: list[Tensor] = []
    for t in leaves:
        raw = t.contiguous().reshape(-1).view(torch.uint8).to(device)
        parts.append(raw)
        pad = -raw.numel() % _ALIGN
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=device))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=device)


def _sums_in_rank_order(payloads: list[Tensor], leaves: list[Tensor]) -> list[Tensor]:
    """Each leaf's sum over the ranks' payloads, added in rank order, compensated: the same
    bits on every rank."""
    totals = []
    at = 0
    for t in leaves:
        n = t.numel() * t.element_size()
        ranks = [p[at : at + n].view(t.dtype).view(t.shape) for p in payloads]
        totals.append(_added_in_rank_order(ranks).to(t.device))
        at += n + (-n % _ALIGN)
    return totals


def share(
    models: Sequence[Callable[..., Any]], *args: Any, group: Any = None, **kwargs: Any
) -> list[int]:
    """The positions in ``models`` of the models this rank runs: every model on one rank,
    the ranks' parts of about equal estimated cost, the same split on every rank.

    Pass every model and the arguments of a call (on every rank the same); then
    ``parsum.distributed.sum_models([models[i] for i in mine], x)`` with ``mine`` this
    rank's positions, in order (weights: ``[w[i] for i in mine]``). NOTE [ Balanced shares ].

    Raises:
        ParsumError: when torch.distributed is not initialized, or there are fewer models
            than ranks.
    """
    _check_initialized("parsum.distributed.share")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    models = list(models)
    if len(models) < world:
        raise ParsumError(
            f"parsum.distributed.share: {len(models)} model(s) for {world} ranks; every rank "
            "needs one at least"
        )
    return balanced_shares(models, args, kwargs, world)[rank]


def balanced_shares(
    models: list[Callable[..., Any]], args: tuple[Any, ...], kwargs: dict[str, Any], world: int
) -> list[list[int]]:
    """Every rank's positions (NOTE [ Balanced shares ])."""
    found = [ModelParams.of(m) for m in models]
    leaves = pytree.tree_leaves((args, kwargs))
    batch = Batch.of([t for t in leaves if isinstance(t, Tensor)])
    costs = [estimated_cost(mp, batch) for mp in found]
    fair = sum(costs) / world
    groups: dict[Any, list[int]] = {}
    for i, mp in enumerate(found):
        key = structure_key(mp) if isinstance(models[i], nn.Module) else None
        groups.setdefault(("alone", i) if key is None else key, []).append(i)
    items: list[list[int]] = []
    for members in groups.values():
        if len(members) < AUTO_STACK_MIN_BATCHED:  # too few to run stacked: one by one
            items.extend([i] for i in members)
        elif sum(costs[i] for i in members) > fair:  # a part for every rank, round robin
            items.extend(members[r::world] for r in range(world) if members[r::world])
        else:
            items.append(members)
    # Every rank needs a model: groups split, the largest first, until each rank can have an
    # item (a group kept whole on a rank had left another rank with nothing to run).
    while len(items) < world:
        largest = max(range(len(items)), key=lambda k: (len(items[k]), -k))
        members = items.pop(largest)
        items[largest:largest] = [members[0::2], members[1::2]]
    weight = [sum(costs[i] for i in item) for item in items]
    loads = [0] * world
    parts: list[list[int]] = [[] for _ in range(world)]
    for k in sorted(range(len(items)), key=lambda k: (-weight[k], items[k][0])):
        r = min(range(world), key=lambda r: (loads[r], len(parts[r]), r))
        loads[r] += weight[k]
        parts[r].extend(items[k])
    return [sorted(part) for part in parts]


def _check_initialized(where: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise ParsumError(
            f"{where}: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group first (launch with torchrun)"
        )


def _status_device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _exchange_backward_status(group: Any, device: torch.device, failed: int) -> list[int]:
    """Tell every rank whether this one's backward failed; the ranks that did."""
    status = torch.tensor([failed], device=device)
    statuses = _all_gather(status, group)
    return [r for r, s in enumerate(statuses) if int(s[0])]


def _sum_in_rank_order(tensor: Tensor, group: Any) -> Tensor:
    """Every rank's ``tensor`` added in rank order, compensated: the same bits on every rank."""
    if _status_device(group).type == "cpu":  # gloo's: the slots may grow to hold it
        _slots.prepare(_group_key(group), group, tensor.numel() * tensor.element_size())
    return _added_in_rank_order(_all_gather(tensor.contiguous(), group))


def _all_gather(tensor: Tensor, group: Any) -> list[Tensor]:
    """Every rank's ``tensor`` (the same shape and dtype on every rank), in rank order: through
    the group's shared slots where they hold it (NOTE [ Exchanges on one host ] in
    _host_exchange), else through the group."""
    slots = _slots.get(_group_key(group), group)
    size = tensor.numel() * tensor.element_size()
    if slots is not None and size <= slots.capacity:
        raw = tensor.reshape(-1).view(torch.uint8).cpu()
        shape, dtype, device = tensor.shape, tensor.dtype, tensor.device
        return [b.view(dtype).view(shape).to(device) for b in slots.all_gather(raw)]
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, tensor, group=group)
    return gathered


def _group_key(group: Any) -> tuple[str | None, int]:
    """The group's key in _agreed_sizes and _slots: by name, not by object (NOTE [ One exchange
    a forward ])."""
    return (None if group is None else group.group_name, dist.get_world_size(group))


def _added_in_rank_order(tensors: list[Tensor]) -> Tensor:
    """The ranks' tensors added in rank order, compensated: the same bits on every rank."""
    total = CompensatedAccumulator()
    for t in tensors:
        total.add(t)
    return total.result()


_ACROSS_RANKS = (
    f"{_WHERE}: its gradients across ranks are not differentiable (a backward with "
    "create_graph=True returned them, and a second backward reached them): derivatives of "
    "higher order through a sum over ranks would need the exchange differentiated too; "
    "parsum.sum_models in one process differentiates to any order"
)


def _first_order(backward: Callable[..., tuple[Tensor | None, ...]]) -> Callable[..., Any]:
    """torch's ``once_differentiable`` for the exchange's nodes, but a second backward that
    reaches the gradients raises a ParsumError, whatever it is taken with respect to: torch's
    detaches them, so ``torch.autograd.grad(penalty, params, allow_unused=True)`` found no path
    and returned None for every parameter without a word (2 gloo ranks). Incoming gradients
    that need none (``y.sum()``'s) give gradients that need none, exactly: the exchange is
    linear."""

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        with torch.no_grad():
            out = backward(ctx, *grads)
        anchors = [g for g in grads if g is not None and g.requires_grad]
        if not torch.is_grad_enabled() or not anchors:
            return out
        return not_differentiable(out, anchors, _ACROSS_RANKS)

    return wrapper


class _SumAcrossRanks(torch.autograd.Function):
    """forward: the sums over ranks of the leaves, computed beforehand (``totals``); backward:
    the gradient, unchanged, to this rank's own sum (NOTE [ Cross-rank sum ])."""

    @staticmethod
    def forward(ctx: Any, totals: list[Tensor], *leaves: Tensor) -> tuple[Tensor, ...]:
        return tuple(totals)

    @staticmethod
    @_first_order
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        return (None, *grads)


class _SumGradsAcrossRanks(torch.autograd.Function):
    """forward: the inputs as they are; backward: each input's gradient summed over ranks."""

    @staticmethod
    def forward(ctx: Any, group: Any, *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.group = group
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    @_first_order
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        group = ctx.group
        failed = _exchange_backward_status(group, _status_device(group), 0)
        if failed:
            raise ParsumError(
                f"{_WHERE}: rank(s) {failed} failed in backward (see their errors); rank "
                f"{dist.get_rank(group)} stops too, and no gradient of this backward reaches "
                "its inputs"
            )
        return (None, *(_sum_in_rank_order(g, group) for g in grads))
