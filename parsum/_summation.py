"""Compensated accumulation and the fixed-order chunk reduction.

# NOTE [ Compensated summation ]
# Two ways to carry the rounding error of every addition, chosen by dtype:
#
# float32, float16, bfloat16 (and complex64): the running sum is kept in float64 (complex128)
# and rounded once at the end. The error of that sum, n * 2**-53 * sum(|x|), is below the
# Kahan-Babuska-Neumaier bound in float32, 2 * n * 2**-48 * sum(|x|), so the result is the
# float32 rounding of the exact sum unless the terms cancel by a factor of about 2**28 / n, or
# the float64 sum lands exactly halfway between two float32 values, where the second rounding
# has lost what lay below float64's last bit ([1, 2**-24, 2**-60] gives 1, not 1 + 2**-23).
# It costs one kernel per addition (measured 2.2-2.5x a naive add chain, against 5-8x for
# TwoSum in float32, which breaking those ties would need). A chunk's outputs are added with one
# wide reduction over them (``add_all``): the same bound, in the reduction's own fixed order.
#
# float64 (and complex128), which has no wider type: Neumaier's compensated sum. Every addition
# ``s + x`` is done with Knuth's branch-free TwoSum, which yields the rounded sum ``t`` and its
# exact rounding error ``e`` (``t + e == s + x`` exactly) without comparing magnitudes; ``e`` is
# added to a compensation ``c`` and the result is ``s + c``: the error is O(eps) * |sum| +
# O(n eps^2) * sum(|x|) instead of O(n eps) * sum(|x|). ``s`` follows exactly the naive running
# sum, so once it is inf or nan it stays so, and a finite ``s`` at the end means every
# intermediate sum was finite, so ``c`` is finite too. The compensation is therefore applied
# only where ``s`` is finite, never as the nan that ``inf - inf`` inside TwoSum would give.
#
# Either way inf and nan among the terms come out exactly as in the plain sum. The one
# difference: a plain running sum in float32 that overflows to inf although the exact sum is
# finite (3e38 + 3e38 - 3e38) gives the finite sum in the wide accumulator.
#
# NOTE [ Determinism ]
# Items are cut into chunks whose boundaries depend only on ``chunk_size``; each chunk is summed
# in item order, and chunk partials are combined in chunk order (``_pool.run_ordered``). Which
# thread runs which chunk does not matter, so the bits are the same for any ``n_jobs``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import _config, _pool
from ._errors import ParsumError, a_kind_of

TensorList = list[Tensor] | tuple[Tensor, ...]


def _is_inexact(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def weigh_models(values: Tensor, weights: Tensor | Sequence[float]) -> Tensor:
    """Models' values along dim 0, each times its weight, in the dtype of the plain loop's
    ``w_i * out_i`` (a float weight makes integer and boolean outputs float); differentiable in
    a weight tensor."""
    dtype = torch.result_type(weights[0], values)
    # float16 and bfloat16 products as ``w * out`` computes them, in float32 with the weight not
    # rounded to the half type first (and the cotangents ``g * w`` alike, through the graph of
    # the casts); a weight tensor that needs a gradient keeps the half type, whose gradient
    # ``(g * out).sum()`` the plain loop takes there.
    compute = dtype
    if dtype in (torch.float16, torch.bfloat16) and not (
        isinstance(weights, Tensor) and weights.requires_grad
    ):
        compute = torch.float32
    w = torch.as_tensor(weights, dtype=compute, device=values.device)
    products = values.to(compute) * w.view(-1, *([1] * (values.dim() - 1)))
    return products if compute == dtype else products.to(dtype)


# NOTE [ Weights in the reduction ]
# With python-float weights, each model's output was added times its weight: a kernel a model
# (``value * w``), 0.26-0.34 ms of a forward of 64 tiny MLP classes. Where the outputs are float32
# and summed with one wide reduction (NOTE [ One reduction for small outputs ]), the terms wait
# unweighted beside their weights, and the stack of them is multiplied by the column of the weights
# (by the one weight where all are equal; a column only on the CPU, where it is made) before the
# reduction: each element as ``value * w`` computes it, the weight rounded to float32 and one
# product, so the bits do not change. A stacked group's float32 outputs wait so too; terms weighted
# already (a stacked group's of another dtype) stand beside them with None, multiplied by 1.0, which
# changes no value. Elsewhere each term is multiplied on its own, as before. With weights 1/M
# against the code before, in one process (``benchmarks/bench_against.py --weights mean``, 2 cores):
# ``benchmarks/results/weights-2cores-fifty-fourth.txt``.
TermWeights = Sequence[float | None] | None


def weighed_terms(xs: Sequence[Tensor], weights: TermWeights) -> Sequence[Tensor]:
    """``xs``, each times its weight where ``weights`` gives one (NOTE [ Weights in the
    reduction ])."""
    if weights is None:
        return xs
    return [x if w is None else x * w for x, w in zip(xs, weights)]


def one_weight(column: Sequence[float]) -> bool:
    """Whether every weight is one value, the same bits (not 0.0 beside -0.0, which a set
    holds as one)."""
    return len(set(column)) == 1 and column[0] != 0.0


def weigh_terms(terms: Tensor, column: Sequence[float], one: bool) -> Tensor:
    """Terms along dim 0, each times its weight: ``terms`` (a fresh tensor, written in place)
    times the one weight where ``one`` (``one_weight(column)``), else ``weigh_models``; the
    terms of an ``add_all`` and of a plain graph's sum (NOTE [ Known layers in a plain graph ]
    in _plain_graph) alike."""
    return terms.mul_(column[0]) if one else weigh_models(terms, column)


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the plain sum of tensors of ``dtype``: Python's ``sum`` starts from 0, so
    booleans are counted in int64 (an ensemble's votes), every other dtype is kept."""
    return torch.int64 if dtype == torch.bool else dtype


def wide_sum_over_models(values: Tensor) -> Tensor:
    """Models' values along dim 0 summed in the wide dtype where theirs has one, else in the
    plain sum's dtype; not rounded back."""
    return values.sum(0, dtype=WIDE.get(values.dtype, sum_dtype(values.dtype)))


# Accumulation dtype of the dtypes that have a wider one (NOTE [ Compensated summation ]).
WIDE = {
    torch.float32: torch.float64,
    torch.float16: torch.float64,
    torch.bfloat16: torch.float64,
    torch.complex64: torch.complex128,
}


class CompensatedAccumulator:
    """Running compensated sum of same-shape tensors; see NOTE [ Compensated summation ].

    The first tensor added is borrowed, not copied, and never written to.
    """

    __slots__ = ("_comp", "_dtype", "_owned", "_spare", "_sum", "_tmp1", "_tmp2")

    def __init__(self) -> None:
        self._sum: Tensor | None = None
        self._dtype: torch.dtype | None = None
        self._comp: Tensor | None = None
        self._owned = False
        self._spare: Tensor | None = None
        self._tmp1: Tensor | None = None
        self._tmp2: Tensor | None = None

    @property
    def empty(self) -> bool:
        return self._sum is None

    def add(self, x: Tensor) -> None:
        s = self._sum
        if s is None:
            dtype = sum_dtype(x.dtype)
            if dtype != x.dtype:  # booleans counted, as the plain sum counts them
                self._sum, self._owned, self._dtype = x.to(dtype), True, dtype
            else:
                self._sum, self._owned, self._dtype = x, False, dtype
            return
        assert self._dtype is not None
        wide = WIDE.get(self._dtype)
        if wide is not None:
            if not self._owned:
                s = self._sum = s.to(wide, memory_format=torch.contiguous_format, copy=True)
                self._owned = True
            s.add_(x)
            return
        if not _is_inexact(s):
            self._sum, self._owned = s + x, True
            return
        self._two_sum(s, x)

    def add_wide(self, x: Tensor, dtype: torch.dtype) -> None:
        """Add a partial sum of tensors of ``dtype`` already held in their wide dtype (a fresh
        tensor, taken over), without rounding it to ``dtype`` first."""
        if self._sum is None:
            self._sum, self._owned, self._dtype = x, True, sum_dtype(dtype)
        else:
            self.add(x)

    def add_all(self, xs: Sequence[Tensor], weights: TermWeights = None) -> None:
        """Add same-shape tensors, in order, each times its weight where ``weights`` gives one
        (NOTE [ Weights in the reduction ]). Where their dtype has a wider one, with one
        reduction in it (``torch.stack(xs).sum(0, dtype=wide)``): two kernels for all instead of
        one or two each, where every kernel call also passes the GIL (NOTE [ Compensated
        summation ])."""
        column: list[float] | None = None
        if weights is not None and any(w is not None for w in weights):
            column = [1.0 if w is None else w for w in weights]
        elif weights is not None:
            weights = None  # all weighted already (stacked groups)
        one = column is not None and one_weight(column)
        wide = WIDE.get(xs[0].dtype) if len(xs) > 1 else None
        if (
            wide is None
            or any(x.layout != torch.strided for x in xs)
            # A column on another device would be a copy to it: one weight or the CPU only.
            or (column is not None and not (xs[0].dtype == torch.float32 and (one or xs[0].is_cpu)))
        ):
            for x in weighed_terms(xs, weights):
                self.add(x)
            return
        stacked = torch.stack(list(xs))
        if column is not None:
            stacked = weigh_terms(stacked, column, one)
        self.add_wide(stacked.sum(0, dtype=wide), xs[0].dtype)

    def _two_sum(self, s: Tensor, x: Tensor) -> None:
        if self._comp is None:
            self._comp = torch.zeros_like(s, memory_format=torch.contiguous_format)
        if self._tmp1 is None or self._tmp2 is None:
            self._tmp1 = torch.empty_like(self._comp)
            self._tmp2 = torch.empty_like(self._comp)
        z, w = self._tmp1, self._tmp2
        t = self._spare if self._spare is not None else torch.empty_like(self._comp)
        # TwoSum: t = fl(s + x); e = (s - (t - z)) + (x - z) with z = t - s.
        torch.add(s, x, out=t)
        torch.sub(t, s, out=z)
        torch.sub(t, z, out=w)
        torch.sub(s, w, out=w)
        torch.sub(x, z, out=z)
        w.add_(z)
        self._comp.add_(w)
        self._spare = s if self._owned else None
        self._sum, self._owned = t, True

    def merge(self, other: CompensatedAccumulator) -> None:
        """Add another accumulator's sum and compensation (chunk partials, in chunk order)."""
        if other._sum is None:
            return
        if self._sum is None:  # take the other's state over; it is not used again
            self._sum, self._comp, self._owned = other._sum, other._comp, other._owned
            self._dtype = other._dtype
            return
        self.add(other._sum)
        if other._comp is not None:
            if self._comp is None:
                self._comp = other._comp
            else:
                self._comp.add_(other._comp)

    def result(self) -> Tensor:
        """The compensated sum, in the dtype of the tensors added, a tensor the caller owns."""
        s = self._sum
        if s is None:
            raise ParsumError("CompensatedAccumulator.result: nothing was added")
        if s.dtype != self._dtype:  # a wide sum: its one rounding
            return s.to(self._dtype)
        if self._comp is None:
            return s if self._owned else s.clone()
        # A zero compensation leaves s as it is: -0.0 + 0.0 would give +0.0 where the plain
        # sum gives -0.0.
        return torch.where(torch.isfinite(s) & (self._comp != 0), s + self._comp, s)


# NOTE [ Combining chunk partials ]
# The chunks' partial sums are combined in chunk order. Where their dtype has a wider one, the
# partials wait and are added with one reduction, ``torch.stack(partials).sum(0, dtype=wide)``,
# as many at a time as PARTIALS_BYTES of wide values hold (a count that depends on the output's
# shape and dtype alone, never on the threads; outputs too large for two are added one by one):
# 16 models of one chunk each made 31 kernel calls a forward, one per merge and the widening
# copy, against 3, with the same bound on the error as adding them one by one in the wide dtype
# (16 MLPs of widths 128-512 at batch 64, one thread: 8.00 -> 7.95 ms a step, the plain loop
# 7.14). Float64 partials are merged one by one with Neumaier's compensation, as before.
PARTIALS_BYTES = 4 * 2**20


# NOTE [ One reduction for small outputs ]
# Where all the models' outputs together fit in PARTIALS_BYTES of wide values, a chunk does not
# sum its models' outputs, nor a stacked group its own: it hands them over, and the call adds
# all of them, in the order of the chunks and their units (a group's models in its order), with
# one wide reduction at the end (``ChunkPartials.add_terms``). Sums of a few small outputs cost
# more than their arithmetic: 64 MLPs of 4 outputs at batch 32 in 16 chunks took 0.28-0.37 ms
# less a forward this way (one thread, 3% of the step; 16 medium MLPs in chunks of one model:
# the same), and 64 tiny MLPs in 12 stacked groups 0.6-3.4% less a step (budgets of 1 and 2,
# n_jobs unset, 1 and 2; in one package, the switch flipped step by step). Which outputs are
# summed at once depends on their shape, dtype and count alone, so the bits stay those of any
# n_jobs. The outputs wait until then: one that is a view keeps its base alive as long.


def sums_at_once(n_terms: int, like: Tensor) -> bool:
    """Whether ``n_terms`` tensors like ``like`` are added with one reduction at the end
    (NOTE [ One reduction for small outputs ])."""
    wide = WIDE.get(like.dtype)
    return (
        wide is not None
        and like.layout == torch.strided
        and n_terms * like.numel() * wide.itemsize <= PARTIALS_BYTES
    )


# NOTE [ Argument gradients at once ]
# The models' gradients of an argument that needs one (each read it through an alias of its
# own) were summed like parameters shared by models: model by model in a chunk, the chunks'
# sums merged in chunk order, a kernel or two for every model and chunk. Where all of them
# together fit in PARTIALS_BYTES of wide values (``sums_at_once`` for as many terms as models),
# each chunk hands its models' gradients over in model order instead, and the call adds them
# all with one wide reduction (``sum_terms`` in _sparse), as the outputs' sum does (NOTE
# [ One reduction for small outputs ]); and at one thread, where the forwards ran in model
# order, one engine call pulls back every chunk, whose gradients are then held together
# anyway. Both paths (ParallelSum and the caller's graph) sum them so, from terms that do not
# depend on the threads: the same bits for any n_jobs, and the same on both.


def terms_at_once(n_models: int, tensors: Sequence[Tensor]) -> bool:
    """Whether the models' gradients of ``tensors`` (the arguments that need one, or the
    parameters several models use) are added as terms, with one reduction at the end (NOTE
    [ Argument gradients at once ], NOTE [ Shared gradients at once ])."""
    return bool(tensors) and all(sums_at_once(n_models, t) for t in tensors)


# NOTE [ Shared gradients at once ]
# A parameter several models use (a trunk under several heads, a tied layer) gets the sum of
# its models' gradients, which was added model by model in a chunk, the chunks' sums merged in
# chunk order, a kernel or two a model; or, where the arguments' gradients were added at once
# (NOTE [ Argument gradients at once ]), as terms held to the end whatever their size: 16 heads
# over a trunk of 2048 x 2048 with ``x.requires_grad_()`` took a process's peak resident memory
# to 1.39-1.47 GiB, the plain loop's to 0.41-0.44 (0.60-0.63 GiB now). The rule is now the
# parameters' own, as the arguments' is theirs: where all the models' gradients of every such
# parameter fit PARTIALS_BYTES of wide values (``sums_at_once`` for as many terms as models),
# they are held as terms and added with one wide reduction at the end (``sum_terms``), else
# model by model, whatever the arguments need. That depends on the parameters' sizes and dtypes
# and the model count alone, so the bits stay those of any n_jobs; every path (ParallelSum, the
# caller's graph, a plain graph's ``_Reads``) asks ``SumPlan.shared_at_once``. 16 gradients of
# a 128 x 64 trunk and its bias took 82 us at once against 134 model by model (one thread).


class ChunkPartials:
    """Chunk partial sums (``CompensatedAccumulator``s) combined in chunk order; see NOTE
    [ Combining chunk partials ]. The accumulators merged are taken over. Or the terms
    themselves, in order, added at the end (NOTE [ One reduction for small outputs ])."""

    __slots__ = ("_limit", "_term_weights", "_terms", "_total", "_waiting")

    def __init__(self) -> None:
        self._total = CompensatedAccumulator()
        self._waiting: list[CompensatedAccumulator] = []
        self._limit = 0
        self._terms: list[Tensor] = []
        self._term_weights: list[float | None] | None = None

    def add_terms(self, terms: list[Tensor], weights: TermWeights = None) -> None:
        """Terms that follow those added before, each times its weight where ``weights``
        gives one, all summed in one reduction by ``result``."""
        if weights is not None and self._term_weights is None:
            self._term_weights = [None] * len(self._terms)
        if self._term_weights is not None:
            self._term_weights.extend([None] * len(terms) if weights is None else weights)
        self._terms.extend(terms)

    def merge(self, acc: CompensatedAccumulator) -> None:
        s = acc._sum
        if s is None:
            return
        assert acc._dtype is not None
        wide = WIDE.get(acc._dtype)
        if wide is None or s.layout != torch.strided:
            self._flush()
            self._total.merge(acc)
            return
        if not self._waiting:
            self._limit = PARTIALS_BYTES // max(1, s.numel() * wide.itemsize)
        self._waiting.append(acc)
        if len(self._waiting) >= self._limit:  # 1 or less: large outputs, added one by one
            self._flush()

    def _flush(self) -> None:
        waiting = self._waiting
        if len(waiting) == 1:
            self._total.merge(waiting[0])
        elif waiting:
            dtype = waiting[0]._dtype
            assert dtype is not None
            wide = WIDE[dtype]
            sums = [acc._sum for acc in waiting if acc._sum is not None]
            if len({t.dtype for t in sums}) > 1:  # some partials wide already: all of them
                sums = [t.to(wide) for t in sums]
            self._total.add_wide(torch.stack(sums).sum(0, dtype=wide), dtype)
        self._waiting = []

    def result(self) -> Tensor:
        """The combined sum, in the partials' dtype, a tensor the caller owns."""
        if self._terms:
            self._total.add_all(self._terms, self._term_weights)
            self._terms, self._term_weights = [], None
        self._flush()
        return self._total.result()


def compensated_add_(totals: TensorList, comps: TensorList, xs: TensorList) -> None:
    """``totals[i] + comps[i] += xs[i]`` in place, leaving in ``totals`` the rounded sums.

    The running value kept in ``.grad`` is read by optimizers at any time, so unlike
    ``CompensatedAccumulator`` (which applies its compensation once, at the end) the
    compensation is folded back after every addition: a second TwoSum splits ``t + comp`` into
    its rounded value (``total``) and the part below its last bit (``comp``). Written with
    ``torch._foreach_*`` ops, so a list of tensors costs about as many kernel launches as one.
    inf and nan in a total come out as in a plain ``total += x``, with a zero compensation.
    """
    # Three scratch lists and in-place ops: fresh temporaries of gradient size cost more in
    # page faults than the arithmetic. ``a - b`` is computed as ``(-b) + a``, the same bits.
    t = torch._foreach_add(totals, xs)
    z = torch._foreach_sub(t, totals)
    e = torch._foreach_sub(t, z)
    _rsub_(e, totals)  # totals - (t - z)
    _rsub_(z, xs)  # xs - z
    torch._foreach_add_(e, z)
    torch._foreach_add_(comps, e)  # the error of t, kept
    s, z = z, e  # renormalize: s = t + comps; rest = (t - (s - z)) + (comps - z), z = s - t
    torch._foreach_copy_(s, t)
    torch._foreach_add_(s, comps)
    torch._foreach_copy_(z, s)
    torch._foreach_sub_(z, t)
    rest = totals  # the old totals are no longer needed
    torch._foreach_copy_(rest, s)
    torch._foreach_sub_(rest, z)
    _rsub_(rest, t)  # t - (s - z)
    _rsub_(z, comps)  # comps - z
    torch._foreach_add_(rest, z)
    # The largest |s| of each tensor is finite exactly when the whole tensor is (NOTE
    # [ Compensated summation ]); only tensors that are not take the elementwise guard.
    largest = torch.stack(torch._foreach_norm(s, ord=float("inf")))
    if bool(torch.isfinite(largest).all()):
        torch._foreach_copy_(comps, rest)
        torch._foreach_copy_(totals, s)
        return
    for total, comp, si, ti, ri in zip(totals, comps, s, t, rest):
        finite = torch.isfinite(si)
        torch.where(finite, ri, torch.zeros((), dtype=ri.dtype, device=ri.device), out=comp)
        torch.where(finite, si, ti, out=total)


def _rsub_(xs: TensorList, ys: TensorList) -> None:
    """``xs[i] = ys[i] - xs[i]`` in place."""
    torch._foreach_neg_(xs)
    torch._foreach_add_(xs, ys)


def compensated_sum(
    tensors: Sequence[Tensor], *, chunk_size: int | None = None, n_jobs: int | None = None
) -> Tensor:
    """Sum same-shape tensors with compensation, in a fixed order, on parsum's thread pool.

    The result is far more accurate than a naive sum and bitwise identical for any ``n_jobs``.

    >>> import torch, parsum
    >>> xs = [torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8])] * 4
    >>> parsum.compensated_sum(xs)
    tensor([4.])
    >>> sum(xs)
    tensor([0.])

    Args:
        tensors: non-empty sequence of tensors of one shape, dtype and device.
        chunk_size: tensors per task; the only thing that decides the order of additions.
        n_jobs: workers, joblib's convention (``None``: ``parsum.config``, then
            ``joblib.parallel_config``, then all usable cores).

    Returns:
        A new tensor holding the sum. inf and nan propagate exactly as in a plain sum.

    Raises:
        ParsumError: if ``tensors`` is empty or holds a non-tensor, a sparse tensor or a tensor
            of another shape, dtype or device, or ``chunk_size`` / ``n_jobs`` is invalid.
    """
    where = "compensated_sum"
    if isinstance(tensors, Tensor) and tensors.dim() == 0:
        raise ParsumError(
            f"{where}: tensors is a 0-d tensor ({tensors.item()!r}); expected a sequence of "
            "tensors, or a tensor whose first dimension indexes the terms"
        )
    if isinstance(tensors, Tensor):
        items = list(tensors.unbind(0))
    else:
        try:
            items = list(tensors)
        except TypeError:
            raise ParsumError(
                f"{where}: tensors is {a_kind_of(tensors)}; expected a sequence of tensors"
            ) from None
    if not items:
        raise ParsumError(f"{where}: tensors is empty; expected at least one tensor")
    first = items[0]
    for i, t in enumerate(items):
        if not isinstance(t, Tensor):
            raise ParsumError(f"{where}: tensors[{i}] is {a_kind_of(t)}, not a Tensor")
        if (t.shape, t.dtype, t.device) != (first.shape, first.dtype, first.device):
            raise ParsumError(
                f"{where}: tensors[{i}] has shape {tuple(t.shape)}, dtype {t.dtype}, device "
                f"{t.device}; tensors[0] has shape {tuple(first.shape)}, dtype {first.dtype}, "
                f"device {first.device}"
            )
        if t.layout != torch.strided:
            raise ParsumError(
                f"{where}: tensors[{i}] has layout {t.layout}; compensated_sum adds dense "
                "(strided) tensors: pass t.to_dense()"
            )
    chunk_size = _config.check_chunk_size(chunk_size, where)
    workers = _config.resolve_n_jobs(n_jobs, where)
    size = chunk_size or _config.current_settings().chunk_size
    chunks = _pool.chunk_ranges(len(items), size or _pool.default_chunk_size(len(items)))
    total = ChunkPartials()

    def sum_chunk(k: int) -> CompensatedAccumulator:
        acc = CompensatedAccumulator()
        for i in chunks[k]:
            acc.add(items[i])
        return acc

    _pool.run_ordered(sum_chunk, len(chunks), workers, lambda k, acc: total.merge(acc))
    return total.result()
