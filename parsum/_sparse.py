"""take_rows: ``weight[index]`` with a row-sparse gradient; row-sparse gradient reduction.

# NOTE [ Row-sparse gradients ]
# The gradient of ``weight[index]`` is zero outside the rows ``index`` touches, yet autograd's
# ``index`` backward materializes it densely: the step grows with the table although the
# forward does not. ``take_rows`` returns the same values and gives ``weight`` a coalesced
# sparse COO gradient instead (one sparse dim, the rows; the other dims dense, as
# ``nn.Embedding(sparse=True)`` does): the touched rows sorted, each once. Its cost is a sort of
# the index and one pass over the touched rows. A matrix goes through ``F.embedding(sparse=True)``,
# forward and backward in C++ (a custom Function cost twice the whole embedding op); other
# shapes through ``_TakeRows``. Both give the rows as they come; a hook that ``take_rows``
# puts on the weight once, the first time it reads it, coalesces the weight's gradient, after
# autograd has added up every use of the weight in the backward. A hook on each call's
# backward node cost about 18 us a step here, 8% of a step of bench_sparse.py's sampled layer;
# the weight's own hook about 6 us. The hook stays on the weight: a sparse gradient that
# reaches it from elsewhere is coalesced too (the same values), and ``torch.save`` leaves it out.
# Duplicate rows in one call are summed by ``coalesce()`` in the gradient's dtype, as
# ``weight[index]``'s gradient sums them: a float64 accumulator measured 1.5x the cost of the
# whole coalesce (35 against 25 us for 64 rows of 512).
#
# Across models (a table several models sample from), ``RowSparseAccumulator`` keeps the
# gradients as they come, in model order, and reduces them at the end over the union of their
# rows: a row that one entry holds passes through as it is; the others are summed in a float64
# accumulator for float32 and narrower, with TwoSum and a compensation for float64, the same
# rules as every other reduction. When no row holds more than two entries, one addition in the
# dtype itself gives the same bits. A row's entries are added in the order of the parts, so the
# bits depend only on the order of the models. Nothing of the table's size is allocated unless one
# of the gradients is dense (a model that uses the whole table), which makes the sum dense.
#
# Inside ``sum_models``' pullbacks, the hook leaves the gradients of such a shared table
# uncoalesced (``coalesce_later``): the accumulator sorts all entries once anyway, and sums a
# model's own duplicate rows with the others, in float64. A coalesce per model cost about 8% of
# a step of the sampled ensemble in bench_sparse.py.
#
# torch.func transforms (vmap, vjp, grad) cannot carry sparse gradients, so ``take_rows``
# refuses to run under them; ``sum_models``' engine "auto" then runs such models one by one with
# autograd instead of stacking them.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils.hooks import RemovableHandle

from ._errors import ParsumError, a_kind_of
from ._locks import Lock
from ._summation import WIDE, CompensatedAccumulator

_WHERE = "take_rows"
_INDEX_DTYPES = (torch.int64, torch.int32)
_transforms_active = torch._C._are_functorch_transforms_active  # vmap, vjp, grad


class _Table:
    """What take_rows keeps of a weight it has read (alive as long as the weight)."""

    __slots__ = ("elements", "hooked", "ref")

    def __init__(self, ref: weakref.ref[Tensor]) -> None:
        self.ref = ref
        self.elements = 0  # gathered by the last call: what a step costs in sum_models' estimates
        self.hooked = False  # whether the weight carries the hook that coalesces its gradients


_tables: dict[int, _Table] = {}
_tables_lock = Lock()


def any_sampled() -> bool:
    """Whether any tensor alive has been read by ``take_rows``."""
    return bool(_tables)


def sampled_elements(p: Tensor) -> int | None:
    """Elements the last ``take_rows`` call on ``p`` gathered, or None if it never ran."""
    entry = _tables.get(id(p))
    return entry.elements if entry is not None and entry.ref() is p else None


def _note_table(weight: Tensor, elements: int) -> None:
    """Record the elements this call gathers, and hook ``weight`` once so that its gradients
    are coalesced (NOTE [ Row-sparse gradients ])."""
    entry = _tables.get(id(weight))
    if entry is None or entry.ref() is not weight:
        entry = _new_table(weight)
    entry.elements = elements
    if not entry.hooked and weight.requires_grad:
        with _tables_lock:  # workers may read one table at once: one hook only
            if not entry.hooked:
                weight.register_hook(_CoalesceHook(id(weight)))
                entry.hooked = True


def _new_table(weight: Tensor) -> _Table:
    key = id(weight)

    def forget(ref: weakref.ref[Tensor]) -> None:
        entry = _tables.get(key)
        if entry is not None and entry.ref is ref:
            del _tables[key]

    with _tables_lock:
        entry = _tables.get(key)
        if entry is None or entry.ref() is not weight:
            entry = _tables[key] = _Table(weakref.ref(weight, forget))
        return entry


class _CoalesceHook:
    """The gradient hook of a table: its sparse gradient coalesced, unless ``coalesce_later``
    holds the table in this thread. Dense and coalesced gradients pass as they are."""

    __slots__ = ("weight_id",)
    __torch_unserializable__ = True  # torch.save leaves it out, without a warning

    def __init__(self, weight_id: int) -> None:
        self.weight_id = weight_id

    def __call__(self, grad: Tensor | None) -> Tensor | None:
        if grad is None or grad.layout != torch.sparse_coo or grad.is_coalesced():
            return None
        if self.weight_id in _deferred.ids:
            return None
        return grad.coalesce()


def has_user_hooks(p: Tensor) -> bool:
    """Whether ``p`` has gradient hooks other than the one ``take_rows`` puts on a table."""
    hooks = p._backward_hooks
    return hooks is not None and any(not isinstance(h, _CoalesceHook) for h in hooks.values())


class OwnPostHook(functools.partial):
    """A post-accumulate-grad hook of parsum's own (a FlatGrad's, a StepInBackward's)."""

    __slots__ = ()


post_accumulate_hooks = operator.attrgetter("_post_accumulate_grad_hooks")  # None or a dict


def has_user_post_hooks(p: Tensor) -> bool:
    """Whether ``p`` has post-accumulate-grad hooks other than parsum's own."""
    hooks = p._post_accumulate_grad_hooks
    return hooks is not None and any(not isinstance(h, OwnPostHook) for h in hooks.values())


def handle_count() -> int | None:
    """Hooks registered so far in this process, of every kind (module, tensor, global): every
    registration makes a ``RemovableHandle``, whose ids come from one counter."""
    return getattr(RemovableHandle, "next_id", None)


def take_rows(weight: Tensor, index: Tensor) -> Tensor:
    """``weight[index]``, whose gradient for ``weight`` is row-sparse.

    Backward gives ``weight`` a coalesced sparse COO gradient that holds only the rows
    ``index`` touched (duplicates summed), at a cost in proportion to those rows, not to the
    rows of ``weight``. ``torch.optim.SGD`` and ``torch.optim.SparseAdam`` take such
    gradients; SGD (without weight decay or momentum) leaves the untouched rows as they were.
    The index may be computed inside forward from values (hashing, top-k): it needs no
    gradient. Autograd's accumulation into ``.grad`` drops the coalesced flag, as it does for
    ``nn.Embedding(sparse=True)``; ``.grad.coalesce()`` then costs a sort of the rows. The first
    call on a weight that requires grad puts a gradient hook on it that coalesces every sparse
    gradient reaching it, once per backward; ``torch.save`` and ``copy.deepcopy`` leave it out.

    >>> import torch, parsum
    >>> table = torch.nn.Parameter(torch.ones(1000, 4))
    >>> rows = parsum.take_rows(table, torch.tensor([[3, 7], [7, 998]]))
    >>> rows.shape
    torch.Size([2, 2, 4])
    >>> rows.sum().backward()
    >>> grad = table.grad.coalesce()    # .grad drops the flag; the data is coalesced already
    >>> grad.layout, grad.indices(), grad.values()[:, 0]
    (torch.sparse_coo, tensor([[  3,   7, 998]]), tensor([1., 2., 1.]))

    Args:
        weight: the table, a dense tensor of at least one dimension, normally a leaf
            parameter.
        index: an int64 or int32 tensor of row numbers, of any shape; negative numbers count
            from the end, as in ``weight[index]``.

    Returns:
        ``weight[index]``: a tensor of shape ``index.shape + weight.shape[1:]``.

    Raises:
        ParsumError: for a weight that is not a dense tensor of at least one dimension, an
            index of another dtype or device, a row number out of range, or a call under a
            ``torch.func`` transform (which cannot carry a sparse gradient).
    """
    if (
        not (
            isinstance(weight, Tensor)
            and isinstance(index, Tensor)
            and weight.layout == torch.strided
            and weight.dim() >= 1
            and index.dtype in _INDEX_DTYPES
            and ((index.is_cpu and weight.is_cpu) or index.device == weight.device)
        )
        or _transforms_active()
    ):
        _refuse(weight, index)
    if weight.dim() == 2 and not weight.is_complex():  # embedding's autograd refuses complex
        rows = _in_bounds(_embedding, weight, index)
    else:
        rows = _in_bounds(_TakeRows.apply, weight, index.reshape(-1).long())
        rows = rows if index.dim() == 1 else rows.view(index.shape + weight.shape[1:])
    _note_table(weight, rows.numel())  # after the checks: a failed call changes nothing
    return rows


def _refuse(weight: object, index: object) -> NoReturn:
    """The ParsumError for arguments that take_rows cannot take. take_rows itself checks in one
    condition: each group of checks written out there cost about 1% of bench_sparse's step."""
    if not isinstance(weight, Tensor) or weight.layout != torch.strided or weight.dim() < 1:
        what = (
            f"a tensor of shape {tuple(weight.shape)} and layout {weight.layout}"
            if isinstance(weight, Tensor)
            else a_kind_of(weight)
        )
        raise ParsumError(
            f"{_WHERE}: weight is {what}; expected a dense tensor of at least one dimension"
        )
    if not isinstance(index, Tensor) or index.dtype not in _INDEX_DTYPES:
        what = f"a {index.dtype} tensor" if isinstance(index, Tensor) else a_kind_of(index)
        raise ParsumError(
            f"{_WHERE}: index is {what}; expected an int64 or int32 tensor of row numbers "
            "(for a boolean mask, take mask.nonzero().squeeze(1))"
        )
    if index.device != weight.device:
        raise ParsumError(
            f"{_WHERE}: index is on {index.device}, weight on {weight.device}; expected both on "
            "one device"
        )
    raise ParsumError(
        f"{_WHERE}: called under a torch.func transform (vmap, vjp, grad), which cannot "
        "carry a sparse gradient; index the weight directly (weight[index]) there, or, in "
        "sum_models, use engine='autograd' or 'auto'"
    )


def _embedding(weight: Tensor, index: Tensor) -> Tensor:
    return torch.embedding(weight, index, -1, False, True)  # F.embedding(sparse=True), direct


def _in_bounds(take: Callable[[Tensor, Tensor], Tensor], weight: Tensor, index: Tensor) -> Tensor:
    """``take(weight, index)`` with negative row numbers counted from the end and a ParsumError
    for any out of range. On the CPU the gather checks the bounds itself, so the index is
    checked only when it raises (negatives land there too); elsewhere an index out of range
    would be a device-side assert, so it is checked first. (Python work here costs far more in
    a step than in timeit: ``index.device.type``, 0.3 us in timeit, measured 3-4% of
    bench_sparse's sampled step, ``is_cpu`` nothing.)"""
    if index.is_cpu:
        try:
            return take(weight, index)
        except IndexError:
            pass
    return take(weight, _in_range(index.reshape(-1), weight).view(index.shape))


def _in_range(flat: Tensor, weight: Tensor) -> Tensor:
    """``flat`` with negative row numbers counted from the end; a ParsumError if any is out of
    range."""
    n_rows = weight.shape[0]
    if not flat.numel():
        return flat
    low, high = (int(v) for v in torch.aminmax(flat))
    if low < -n_rows or high >= n_rows:
        bad = low if low < -n_rows else high
        raise ParsumError(
            f"{_WHERE}: index holds row {bad}, outside [-{n_rows}, {n_rows}) for a weight "
            f"of shape {tuple(weight.shape)}"
        )
    return torch.where(flat < 0, flat + n_rows, flat) if low < 0 else flat


class _Deferred(threading.local):
    ids: frozenset[int] = frozenset()


_deferred = _Deferred()


@contextlib.contextmanager
def coalesce_later(weights: Iterable[Tensor]) -> Iterator[None]:
    """In this thread, ``take_rows`` leaves the gradients of ``weights`` uncoalesced: they go to
    a ``RowSparseAccumulator``, which sums duplicate rows itself (NOTE [ Row-sparse gradients ])."""
    saved = _deferred.ids
    _deferred.ids = frozenset(id(w) for w in weights)
    try:
        yield
    finally:
        _deferred.ids = saved


class _TakeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: Tensor, index: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        ctx.weight_shape = weight.shape
        return weight.index_select(0, index)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None
        (index,) = ctx.saved_tensors
        return _uncoalesced(index, grad, ctx.weight_shape), None  # the weight's hook coalesces


def row_sparse(index: Tensor, values: Tensor, shape: torch.Size) -> Tensor:
    """The coalesced sparse tensor of ``shape`` whose row ``index[k]`` holds ``values[k]``,
    duplicate rows summed (NOTE [ Row-sparse gradients ])."""
    return _uncoalesced(index, values, shape).coalesce()


def _uncoalesced(index: Tensor, values: Tensor, shape: torch.Size) -> Tensor:
    return torch.sparse_coo_tensor(index.unsqueeze(0), values, shape, check_invariants=False)


def _coalesced(rows: Tensor, values: Tensor, shape: torch.Size) -> Tensor:
    return torch.sparse_coo_tensor(
        rows.unsqueeze(0), values, shape, is_coalesced=True, check_invariants=False
    )


def _is_row_sparse(g: Tensor) -> bool:
    return g.layout == torch.sparse_coo and g.sparse_dim() == 1


class RowSparseAccumulator:
    """Compensated sum of one parameter's gradients, some or all row-sparse (coalesced or
    not), in the order added; see NOTE [ Row-sparse gradients ]. Tensors added are borrowed,
    never written to."""

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: list[Tensor] = []

    @property
    def empty(self) -> bool:
        return not self._parts

    def add(self, g: Tensor) -> None:
        self._parts.append(g)

    def merge(self, other: RowSparseAccumulator | CompensatedAccumulator) -> None:
        """Add another accumulator's parts after this one's (chunk partials, in chunk order)."""
        if isinstance(other, RowSparseAccumulator):
            self._parts.extend(other._parts)
        elif not other.empty:
            self._parts.append(other.result())

    def result(self) -> Tensor:
        """The sum: coalesced row-sparse if every part is sparse, else dense."""
        parts = self._parts
        if not parts:
            raise ParsumError("RowSparseAccumulator.result: nothing was added")
        if not all(_is_row_sparse(p) for p in parts):
            dense = CompensatedAccumulator()
            for p in parts:
                dense.add(p if p.layout == torch.strided else p.coalesce().to_dense())
            return dense.result()
        first = parts[0]
        if len(parts) == 1 and first.is_coalesced():
            return first
        index = torch.cat([p._indices()[0] for p in parts])
        # The distinct rows, sorted; each entry's position among them, in the order added. One
        # unique instead of a stable sort, duplicate checks and unique_consecutive: for the
        # 4 x 64 entries of bench_sparse's ensemble, 210 -> 172 us at 256 rows, 78 -> 74 us at
        # 1024, where every row is hit once (found from the sizes, with no sync).
        rows, where, counts = torch.unique(index, return_inverse=True, return_counts=True)
        shape = (rows.numel(), *first.shape[1:])
        if rows.numel() == index.numel():  # every row once: nothing to add, only to sort
            values = torch.cat([p._values() for p in parts])
            return _coalesced(rows, values.index_select(0, where.argsort()), first.shape)
        most = int(counts.max())
        wide = WIDE.get(first.dtype)
        if most > 2 and wide is not None:
            # Part after part into the wide rows, so each row's terms are added in the order
            # of the entries; cheaper than index_add_ of all entries at once, which copies every
            # value twice.
            total = torch.zeros(shape, dtype=wide, device=rows.device)
            start = 0
            for p in parts:
                part = p._values()
                stop = start + part.shape[0]
                total.index_add_(0, where[start:stop], part.to(wide))
                start = stop
            return _coalesced(rows, total.to(first.dtype), first.shape)
        values = torch.cat([p._values() for p in parts])
        if most == 2:
            # No row holds more than two entries: their sum, rounded once in their own dtype,
            # has the bits of the wide (or compensated) sum rounded to it, since rounding twice
            # is harmless for one addition when the wide format has 2p + 2 bits or more
            # (Figueroa). The reduction of 4 x 64 rows of 512 in bench_sparse: 0.23 against 0.37 ms.
            total = values.new_zeros(shape).index_add_(0, where, values)
            return _coalesced(rows, total, first.shape)
        order = where.argsort(stable=True)  # each row's entries together, in the order added
        values = values.index_select(0, order)
        total = _two_sum_rows(shape, where.index_select(0, order), counts, values)
        return _coalesced(rows, total, first.shape)


def _two_sum_rows(
    shape: tuple[int, ...], inverse: Tensor, counts: Tensor, values: Tensor
) -> Tensor:
    """Neumaier's sum of ``values[k]`` into row ``inverse[k]`` of ``shape``, the entries of a
    row in order (NOTE [ Compensated summation ]); ``inverse`` is sorted, ``counts`` gives
    each row's number of entries."""
    s = torch.zeros(shape, dtype=values.dtype, device=values.device)
    c = torch.zeros_like(s)
    # An entry's rank among its row's entries: one TwoSum per rank, each row at most once.
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(inverse.numel(), device=inverse.device) - starts[inverse]
    for k in range(int(counts.max())):
        at = (rank == k).nonzero().squeeze(1)
        pos, x = inverse.index_select(0, at), values.index_select(0, at)
        old = s.index_select(0, pos)
        t = old + x
        z = t - old
        c.index_add_(0, pos, (old - (t - z)) + (x - z))
        s.index_copy_(0, pos, t)
    return torch.where(torch.isfinite(s), s + c, s)


GradSum = CompensatedAccumulator | RowSparseAccumulator


def add_grad(accs: dict[int, GradSum], k: int, g: Tensor) -> None:
    """Add gradient ``g`` of parameter ``k`` into ``accs[k]``; an accumulator made for a dense
    gradient takes later sparse ones densified."""
    acc = accs.get(k)
    if acc is None:
        acc = accs[k] = RowSparseAccumulator() if g.is_sparse else CompensatedAccumulator()
    if g.is_sparse and isinstance(acc, CompensatedAccumulator):
        g = g.to_dense()
    acc.add(g)


def add_term(terms: dict[int, list[Tensor]], k: int, g: Tensor) -> None:
    """Gradient ``g`` of argument ``k`` as its next term (NOTE [ Argument gradients at once ]
    in _summation)."""
    terms.setdefault(k, []).append(g)


def merge_argument_grads(totals: dict[int, Any], partial: dict[int, Any], at_once: bool) -> None:
    """A chunk's argument gradients, its terms where ``at_once`` (NOTE [ Argument gradients at
    once ] in _summation) or else summed, after those of the chunks before it."""
    for k, acc in partial.items():
        if at_once:
            totals.setdefault(k, []).extend(acc)
        else:
            merge_grads(totals, k, acc)


def argument_grad(totals: dict[int, Any], k: int, at_once: bool) -> Tensor | None:
    """Argument ``k``'s gradient from what ``merge_argument_grads`` gathered; None where no
    model gave it one."""
    total = totals.get(k)
    if total is None:
        return None
    return sum_terms(total) if at_once else total.result()


def sum_terms(terms: list[Tensor]) -> Tensor:
    """An argument's gradients (NOTE [ Argument gradients at once ] in _summation) summed in
    order: with one wide reduction, or where one is row-sparse (``take_rows``, a sparse
    embedding of the argument) one by one, as ``add_grad`` adds them."""
    if all(t.layout == torch.strided for t in terms):
        acc = CompensatedAccumulator()
        acc.add_all(terms)
        return acc.result()
    accs: dict[int, GradSum] = {}
    for t in terms:
        add_grad(accs, 0, t)
    return accs[0].result()


def merge_grads(totals: dict[int, GradSum], k: int, acc: GradSum) -> None:
    """Merge a chunk's accumulator for parameter ``k`` into ``totals[k]``, in chunk order."""
    total = totals.get(k)
    if total is None:
        totals[k] = acc  # taken over; the chunk's accumulator is not used again
    elif isinstance(total, RowSparseAccumulator) or isinstance(acc, CompensatedAccumulator):
        total.merge(acc)  # type: ignore[arg-type]
    else:
        g = acc.result()
        total.add(g.to_dense() if g.is_sparse else g)
