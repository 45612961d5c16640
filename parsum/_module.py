"""SumOfModels: an ``nn.Module`` whose forward is ``sum_models`` over its members."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from . import _config
from ._api import sum_models
from ._errors import ParsumError, a_kind_of
from ._fused import StepInBackward

_WHERE = "SumOfModels"


class SumOfModels(nn.Module):
    """``sum_i w_i * members[i](*args, **kwargs)`` as an ``nn.Module``, computed by
    :func:`parsum.sum_models`.

    The members are an ``nn.ModuleList``, so the module saves and loads with ``state_dict``,
    moves with ``.to()``, switches every member with ``.train()`` / ``.eval()``, and prints
    them; it fits where a module is expected (a LightningModule's attribute; wrapped in
    DistributedDataParallel, tested). Under ``torch.compile`` the sum is a graph break: the
    code around it compiles, the sum runs as ``sum_models`` does. ``torch.export`` of a module
    holding it exports the members' operations and their sum; ``torch.fx.symbolic_trace``
    needs it kept a leaf module (a ``Tracer`` whose ``is_leaf_module`` says so: tested);
    ``torch.jit.script`` cannot compile it (its forward takes any arguments).

    >>> import torch, parsum
    >>> ensemble = parsum.SumOfModels([torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)],
    ...                               weights=[0.5, 0.5])
    >>> ensemble
    SumOfModels(
      2 members, weights buffer, engine='auto'
      (members): ModuleList(
        (0-1): 2 x Linear(in_features=4, out_features=2, bias=True)
      )
    )
    >>> ensemble(torch.ones(3, 4)).shape
    torch.Size([3, 2])
    >>> len(ensemble.state_dict())  # 2 members x (weight, bias), and the weights buffer
    5

    Args:
        models: the members, ``nn.Module``s (architectures may differ).
        weights: None, or one weight per member: floats (kept as a float64 buffer, saved and
            moved with the module, not trained), or a tensor (a buffer as it is; an
            ``nn.Parameter`` or a tensor that requires grad is registered as a parameter and
            trained with the members).
        n_jobs: as in :func:`parsum.sum_models`.
        engine: as in :func:`parsum.sum_models`.
        chunk_size: as in :func:`parsum.sum_models`.
        step_in_backward: as in :func:`parsum.sum_models`.

    Raises:
        ParsumError: for a member that is not an ``nn.Module``, weights of the wrong length or
            shape, or an invalid ``n_jobs``, ``engine`` or ``chunk_size``.
    """

    def __init__(
        self,
        models: Sequence[nn.Module],
        *,
        weights: Sequence[float] | Tensor | None = None,
        n_jobs: int | None = None,
        engine: str = "auto",
        chunk_size: int | None = None,
        step_in_backward: StepInBackward | None = None,
    ) -> None:
        super().__init__()
        found = _config.check_model_sequence(models, _WHERE, (nn.ModuleList, nn.Sequential))
        for i, model in enumerate(found):
            if not isinstance(model, nn.Module):
                raise ParsumError(
                    f"{_WHERE}: models[{i}] is {a_kind_of(model)}; expected an nn.Module "
                    "(members live in an nn.ModuleList); call parsum.sum_models for other "
                    "callables"
                )
        self.members = nn.ModuleList(found)
        self.n_jobs = _config.check_n_jobs(n_jobs, _WHERE)
        self.engine = _config.check_engine(engine, _WHERE)
        self.chunk_size = _config.check_chunk_size(chunk_size, _WHERE)
        self.step_in_backward = step_in_backward
        self.weights: Tensor | None
        if weights is None:
            self.register_buffer("weights", None)
        elif isinstance(weights, Tensor) and weights.requires_grad:
            self.weights = weights if isinstance(weights, nn.Parameter) else nn.Parameter(weights)
        else:
            # Floats kept in float64, as given: a float32 buffer had rounded them, and sums of
            # float64 models took the rounded weights (found by tests/test_differential.py);
            # a float32 model's output times a 0-dim float64 weight stays float32, as before.
            if not isinstance(weights, Tensor):
                weights = _float64_weights(weights)
            elif not weights.is_floating_point():
                weights = weights.to(torch.get_default_dtype())
            self.register_buffer("weights", weights)
        w = self.weights
        if w is not None and (w.dim() != 1 or w.shape[0] != len(found)):
            raise ParsumError(
                f"{_WHERE}: weights has shape {tuple(w.shape)}; expected one weight per member "
                f"({len(found)})"
            )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return sum_models(
            list(self.members),
            *args,
            weights=self.weights,
            n_jobs=self.n_jobs,
            engine=self.engine,
            chunk_size=self.chunk_size,
            step_in_backward=self.step_in_backward,
            **kwargs,
        )

    def extra_repr(self) -> str:
        parts = [f"{len(self.members)} members"]
        if isinstance(self.weights, nn.Parameter):
            parts.append("weights parameter")
        elif self.weights is not None:
            parts.append("weights buffer")
        parts.append(f"engine={self.engine!r}")
        if self.n_jobs is not None:
            parts.append(f"n_jobs={self.n_jobs}")
        if self.chunk_size is not None:
            parts.append(f"chunk_size={self.chunk_size}")
        return ", ".join(parts)


def _float64_weights(weights: Any) -> Tensor:
    """``weights`` (floats) as a float64 tensor, or a ParsumError naming them."""
    try:
        return torch.as_tensor(weights, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        raise ParsumError(
            f"{_WHERE}: weights is {weights!r:.60} ({a_kind_of(weights)}); expected None, one "
            "float per member, or a tensor of them"
        ) from None
