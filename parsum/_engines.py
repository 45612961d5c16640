"""Per-model pullback makers: run one model, return its output and a function for its VJP.

# NOTE [ Engines ]
# "autograd": the model's own autograd graph, built in the worker under ``enable_grad`` on
#   detached inputs, pulled back with ``torch.autograd.grad`` (PyTorch supports concurrent
#   backward calls from different CPU threads). Works for any callable and any module, also
#   modules that update buffers in forward (BatchNorm). The fastest per call.
# "vjp": ``torch.func.vjp`` over ``torch.func.functional_call``. Pure functions only: a model
#   that mutates a buffer in forward fails under functorch, and parsum says so.
# Both pull back with respect to the same things: the tensor arguments that need a gradient and
# the model's trainable parameters, in ``ModelParams.tensors`` order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.utils import _pytree as pytree

# A pullback takes the output leaves' cotangents and whether to keep its graph for another
# call, and gives (argument grads, parameter grads).
Pullback = Callable[[Sequence[Tensor], bool], tuple[list[Tensor | None], list[Tensor | None]]]


@dataclass
class CallArgs:
    """The positional and keyword arguments of a call, flattened to leaves."""

    leaves: list[Any]
    spec: pytree.TreeSpec
    tensor_positions: list[int]
    grad_positions: list[int] = field(default_factory=list)

    @classmethod
    def flatten(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallArgs:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        positions = [j for j, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        return cls(leaves, spec, positions)

    def with_tensors(self, tensors: Sequence[Tensor], grad_mask: Sequence[bool]) -> CallArgs:
        """The same call with new tensor leaves; ``grad_mask`` marks those that get gradients."""
        leaves = list(self.leaves)
        for j, t in zip(self.tensor_positions, tensors):
            leaves[j] = t
        grads = [j for j, need in zip(self.tensor_positions, grad_mask) if need]
        return CallArgs(leaves, self.spec, self.tensor_positions, grads)

    def build(self, replaced: dict[int, Tensor] | None = None) -> tuple[tuple[Any, ...], dict]:
        leaves = self.leaves
        if replaced:
            leaves = [replaced.get(j, leaf) for j, leaf in enumerate(leaves)]
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return tuple(args), kwargs


@dataclass
class ModelParams:
    """A model's trainable parameters (each once), with their names for functional_call."""

    names: list[str]
    tensors: list[Tensor]

    @classmethod
    def of(cls, model: Callable[..., Any]) -> ModelParams:
        if not isinstance(model, nn.Module):
            return cls([], [])
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return cls([n for n, _ in named], [p for _, p in named])


def plain_forward(model: Callable[..., Any], call: CallArgs) -> Any:
    """Run the model with no graph (no grad, inference mode, or nothing to differentiate)."""
    args, kwargs = call.build()
    return model(*args, **kwargs)


def autograd_forward(
    model: Callable[..., Any], call: CallArgs, params: ModelParams
) -> tuple[Any, Pullback]:
    """Run the model on detached inputs under enable_grad; pull back with autograd.grad."""
    with torch.enable_grad():
        inputs = {j: call.leaves[j].detach().requires_grad_() for j in call.grad_positions}
        args, kwargs = call.build(inputs)
        out = model(*args, **kwargs)
    # The pullback keeps the outputs' gradient edges, not the outputs: plain PyTorch frees a
    # model's output once it is summed, so holding M of them until backward would be memory
    # that grows with M.
    roots = [
        get_gradient_edge(o) if isinstance(o, Tensor) and o.requires_grad else None
        for o in pytree.tree_leaves(out)
    ]
    wrt = [*inputs.values(), *params.tensors]
    n_args = len(inputs)

    def pullback(
        cotangents: Sequence[Tensor], retain_graph: bool
    ) -> tuple[list[Tensor | None], list[Tensor | None]]:
        pairs = [(o, c) for o, c in zip(roots, cotangents) if o is not None]
        if not pairs or not wrt:
            return [None] * n_args, [None] * len(params.tensors)
        outs, cots = zip(*pairs)
        grads = torch.autograd.grad(outs, wrt, cots, retain_graph=retain_graph, allow_unused=True)
        return list(grads[:n_args]), list(grads[n_args:])

    return out, pullback


def vjp_forward(
    model: Callable[..., Any], call: CallArgs, params: ModelParams
) -> tuple[Any, Pullback]:
    """Run the model through torch.func.vjp over torch.func.functional_call."""
    positions = call.grad_positions
    primal_args = [call.leaves[j].detach() for j in positions]
    primal_params = {n: p.detach() for n, p in zip(params.names, params.tensors)}

    def function(arg_tensors: list[Tensor], param_tensors: dict[str, Tensor]) -> Any:
        args, kwargs = call.build(dict(zip(positions, arg_tensors)))
        if isinstance(model, nn.Module):
            return torch.func.functional_call(model, param_tensors, args, kwargs)
        return model(*args, **kwargs)

    out, vjp_fn = torch.func.vjp(function, primal_args, primal_params)  # type: ignore[misc]
    out_spec = pytree.tree_structure(out)

    def pullback(
        cotangents: Sequence[Tensor], retain_graph: bool
    ) -> tuple[list[Tensor | None], list[Tensor | None]]:
        # functorch keeps the graph for as long as vjp_fn lives; the caller drops it.
        arg_grads, param_grads = vjp_fn(pytree.tree_unflatten(list(cotangents), out_spec))
        return list(arg_grads), [param_grads[n] for n in params.names]

    return out, pullback


ENGINE_FORWARDS: dict[str, Callable[..., tuple[Any, Pullback]]] = {
    "autograd": autograd_forward,
    "vjp": vjp_forward,
}
