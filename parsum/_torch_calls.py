"""torch.nn's own calls, which parsum's shortcuts stand in for."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional

# NOTE [ torch.nn's calls replaced ]
# Direct and batched programs (NOTE [ Direct programs ], NOTE [ Batched layers ] in _engines)
# stand in for ``nn.Module.__call__``, ``nn.Sequential.forward`` and ``nn.Linear.forward``
# (``F.linear``), and noise drawn beforehand for ``nn.Dropout.forward`` (``F.dropout``: NOTE
# [ Dropout drawn beforehand ] in _random). A library or a user may replace one of them on the
# class (``nn.Linear.forward = f``, to scale or log every layer; Monte Carlo dropout's
# ``nn.Dropout.forward`` that drops in eval mode too), or the function of torch.nn.functional
# itself, which those forwards look up on each call: the plain loop then runs the replacement,
# and the programs did not (3 and 8 MLPs with Linear's forward doubling its output summed to
# values off by 2.0-2.5, silently; 4 MLPs with dropout in training whose forward was replaced
# by one of another p, by 2.9). So programs run only while these are torch's own functions,
# told by where they were defined (a replacement made before parsum was imported is seen too);
# otherwise the modules are called. A replaced dropout counts as drawing, in eval mode too (it
# may), and a walk made before the replacement no longer holds (NOTE [ Reused plans ] in
# _plans). Other layers' programs call their class's ``forward`` as it is at the time.
_TORCH_NN_CALLS = (
    (nn.Module, "__call__", "Module._wrapped_call_impl"),
    (nn.Module, "_call_impl", "Module._call_impl"),
    (nn.Sequential, "forward", "Sequential.forward"),
    (nn.Linear, "forward", "Linear.forward"),
    (nn.Dropout, "forward", "Dropout.forward"),
    (functional, "dropout", "dropout"),
)


def _torch_own(owner: Any, name: str, qualname: str) -> Any:
    """``owner.name`` (a class or a module) where it is torch's own function of that name,
    else None."""
    fn = getattr(owner, name, None)
    own = getattr(fn, "__qualname__", None) == qualname and getattr(
        fn, "__module__", ""
    ).startswith("torch.nn.")
    return fn if own else None


# The functions as torch defined them, and F.linear, torch's C binding (a None, for a torch
# whose functions are named otherwise, never compares equal: no shortcut is taken there)
_TORCH_NN_OWN = (*(_torch_own(*entry) for entry in _TORCH_NN_CALLS), torch._C._nn.linear)
_DROPOUT_OWN = _TORCH_NN_OWN[4:6]


def torch_nn_untouched() -> bool:
    """Whether torch.nn's module call, Sequential's, Linear's and Dropout's forwards and
    F.dropout and F.linear are torch's own (NOTE [ torch.nn's calls replaced ])."""
    # written out: a loop over _TORCH_NN_CALLS took 1.6 us a call, this 0.2
    current = (
        nn.Module.__call__,
        nn.Module._call_impl,
        nn.Sequential.forward,
        nn.Linear.forward,
        nn.Dropout.forward,
        functional.dropout,
        functional.linear,
    )
    return current == _TORCH_NN_OWN


def dropout_untouched() -> bool:
    """Whether nn.Dropout's forward and F.dropout are torch's own."""
    return (nn.Dropout.forward, functional.dropout) == _DROPOUT_OWN
