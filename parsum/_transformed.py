"""``sum_models`` inside a ``torch.func`` transform: the models and their sum as plain ops.

# NOTE [ Inside a transform ]
# Under ``torch.func.grad``, ``vjp``, ``jacrev``, ``jacfwd``, ``hessian`` or ``vmap`` (per-sample
# gradients, Jacobians of an ensemble, meta-learning with ``functional_call``), the transform
# sees only the operations run in its own thread, and differentiates or batches them itself:
# parsum's threads, its autograd Function and its pullbacks would run outside it (the call was
# refused with a ParsumError). There the models run one after the other in the calling thread,
# as the plain loop runs them, and their outputs are added with the same compensation as
# parsum's sum, written in plain, differentiable operations: in float64 (complex128) for the
# narrower dtypes, rounded once; Neumaier's sum with Knuth's TwoSum in float64, applied where the
# sum is finite (NOTE [ Compensated summation ] in _summation). Their derivatives are those of
# the plain sum: the compensation's parts cancel exactly (each a difference of the same
# incoming value). One thread runs it, so ``n_jobs`` changes nothing; nothing is chunked. A
# call whose tensors carry forward-mode tangents runs here too (NOTE [ Forward-mode AD ] in
# _api).
# ``step_in_backward`` (an optimizer step inside a backward the transform computes itself) and
# a compensated FlatGrad (whose accumulation a backward of the transform's result would
# bypass) are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._C import _functorch
from torch.utils import _pytree as pytree

from ._engines import (
    CallArgs,
    ModelParams,
    check_weight_tensor,
    model_kind,
    version_of,
    written_after_return,
)
from ._errors import ParsumError, model_failed
from ._grads import has_compensated_flat_grads
from ._summation import WIDE, sum_dtype


def sum_in_transform(
    where: str,
    models: Sequence[Callable[..., Any]],
    call: CallArgs,
    weight_list: Sequence[float] | None,
    weight_tensor: Tensor | None,
    step_in_backward: object | None,
) -> Any:
    """The weighted sum of the models' outputs, in plain operations (NOTE [ Inside a
    transform ])."""
    if step_in_backward is not None:
        raise ParsumError(
            f"{where}: step_in_backward cannot run inside a torch.func transform, which "
            "computes the gradients itself: step the optimizers after it"
        )
    params = [p for m in models for p in ModelParams.of(m).tensors]
    if has_compensated_flat_grads(params):
        raise ParsumError(
            f"{where}: a model's parameter has a slot in a FlatGrad with compensated=True, "
            "whose compensated accumulation a call inside a torch.func transform would bypass"
        )
    args, kwargs = call.build()
    outputs: list[list[Tensor]] = []
    versions: list[list[int]] = []  # of each output leaf, as its model returned it
    spec: pytree.TreeSpec | None = None
    first: list[Tensor] = []  # model 0's output leaves, unweighted
    for i, model in enumerate(models):
        try:
            out = model(*args, **kwargs)
        except Exception as exc:
            raise model_failed(where, i, model_kind(model), "forward", exc) from exc
        leaves, out_spec = pytree.tree_flatten(out)
        bad = [
            j
            for j, t in enumerate(leaves)
            if not isinstance(t, Tensor) or t.layout != torch.strided
        ]
        if not leaves or bad:
            leaf = leaves[bad[0]] if bad else None
            kind = leaf.layout if isinstance(leaf, Tensor) else type(leaf).__name__
            what = f"a {kind} as leaf {bad[0]}" if bad else "no tensor"
            raise ParsumError(
                f"{where}: model {i} ({model_kind(model)}) returned {what}; expected a dense "
                "tensor or a pytree of them"
            )
        if spec is None:
            spec, first = out_spec, leaves
        elif out_spec != spec or any(
            (a.shape, a.dtype) != (b.shape, b.dtype) for a, b in zip(leaves, first)
        ):
            raise ParsumError(
                f"{where}: model {i} ({model_kind(model)}) returned "
                f"{_describe(out_spec, leaves)}, where model 0 returned "
                f"{_describe(spec, first)}; every model must return the same structure, "
                "shapes and dtypes"
            )
        if weight_tensor is not None:
            check_weight_tensor(where, weight_tensor, leaves, i, model)
            leaves = [t * weight_tensor[i] for t in leaves]
        elif weight_list is not None:
            leaves = [t * weight_list[i] for t in leaves]
        outputs.append(leaves)
        versions.append([_unwrapped_version(t) for t in leaves])
    # NOTE [ Outputs written before they are summed ] in _function
    for i, (leaves, seen) in enumerate(zip(outputs, versions)):
        if [_unwrapped_version(t) for t in leaves] != seen:
            raise written_after_return(where, i, models[i])
    assert spec is not None
    sums = [compensated_sum([out[j] for out in outputs]) for j in range(len(outputs[0]))]
    return pytree.tree_unflatten(sums, spec)


def _unwrapped_version(t: Tensor) -> int:
    """The version counter of the tensor a transform's wrappers hold: a batched tensor's own
    stays 0 when the tensor it wraps is written in place."""
    while _functorch.is_functorch_wrapped_tensor(t):
        t = _functorch.get_unwrapped(t)
    return version_of(t)


def _describe(spec: pytree.TreeSpec, leaves: Sequence[Tensor]) -> str:
    shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in leaves)
    return shapes if spec == pytree.tree_structure(leaves[0]) else f"{spec} of {shapes}"


def compensated_sum(terms: Sequence[Tensor]) -> Tensor:
    """The sum of ``terms`` in order, compensated, in differentiable operations."""
    dtype = terms[0].dtype
    if not (dtype.is_floating_point or dtype.is_complex):
        total = terms[0].to(sum_dtype(dtype))  # booleans counted, as the plain sum counts them
        for t in terms[1:]:
            total = total + t
        return total
    wide = WIDE.get(dtype)
    if wide is not None:  # a wider accumulator, rounded once
        return torch.stack(list(terms)).sum(0, dtype=wide).to(dtype)
    s = terms[0]
    c = torch.zeros_like(s)
    for x in terms[1:]:
        t = s + x
        z = t - s
        c = c + ((s - (t - z)) + (x - z))  # TwoSum: the exact error of t
        s = t
    return torch.where(torch.isfinite(s), s + c, s)
