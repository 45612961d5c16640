"""Heterogeneous models mapping (batch, IN) -> (batch, OUT), and the plain-PyTorch references."""

from __future__ import annotations

import copy
import threading
import time
import weakref

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils import _pytree as pytree

import parsum

IN, OUT = 6, 3


def mlp(widths: list[int], act: type[nn.Module] = nn.Tanh) -> nn.Sequential:
    dims = [IN, *widths, OUT]
    layers: list[nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), act()]
    return nn.Sequential(*layers[:-1])


class TwoLayers(nn.Module):
    """``mlp([8], act)`` as a class of its own: what is not a Sequential of torch.nn layers runs
    through module calls, and its stacked groups through vmap, not batched matmuls."""

    def __init__(self, act: type[nn.Module] = nn.Tanh) -> None:
        super().__init__()
        self.a, self.act, self.b = nn.Linear(IN, 8), act(), nn.Linear(8, OUT)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


def zeros_of_width_8(x: torch.Tensor) -> torch.Tensor:
    """A forward to assign to a model's first layer of width 8 (``layer.forward = ...``)."""
    return torch.zeros(x.shape[0], 8)


@torch.no_grad()
def narrow_in_place(model: nn.Sequential, width: int) -> None:
    """The first hidden layer of an ``mlp`` cut to ``width`` units by ``.data`` slices that
    keep each tensor's address (the first rows of the first layer, the first columns of the
    next): the model's shapes change, its tensors' addresses do not."""
    first, second = model[0], model[2]
    first.weight.data = first.weight.data[:width]
    first.bias.data = first.bias.data[:width]
    second.weight.data = second.weight.data[:, :width]


def tiny_mlps(n: int, depth: int = 2) -> list[nn.Sequential]:
    """``n`` tiny MLPs of different widths, ``depth`` hidden layers each: none stacked, and too
    small for workers in forward (NOTE [ Pullbacks of small models ] in parsum._grouping)."""
    return [mlp([4 + i, 4 + i % 3][:depth]) for i in range(n)]


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 4, kernel_size=3, padding=1)
        self.head = nn.Linear(4 * IN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x.unsqueeze(1))).flatten(1))


class LowRankLinear(nn.Module):
    """A layer whose weight is composed of several tensors: U diag(s) V^T."""

    def __init__(self, n_in: int, n_out: int, rank: int = 2) -> None:
        super().__init__()
        self.u = nn.Parameter(torch.randn(n_out, rank) / rank**0.5)
        self.s = nn.Parameter(torch.rand(rank) + 0.5)
        self.v = nn.Parameter(torch.randn(n_in, rank) / n_in**0.5)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.u * self.s @ self.v.T).T + self.bias


class Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).T


def parametrized_model() -> nn.Module:
    square = nn.Linear(IN, IN)
    parametrize.register_parametrization(square, "weight", Symmetric())
    return nn.Sequential(square, nn.GELU(), nn.Linear(IN, OUT))


def zoo(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[nn.Module]:
    """Seven different models: widths, depths, activations, LayerNorm, Conv1d, composites."""
    torch.manual_seed(seed)
    models: list[nn.Module] = [
        mlp([8], nn.Tanh),
        mlp([16, 12], nn.ReLU),
        nn.Sequential(nn.Linear(IN, 10), nn.LayerNorm(10), nn.SiLU(), nn.Linear(10, OUT)),
        ConvNet(),
        parametrized_model(),
        nn.Sequential(LowRankLinear(IN, 9), nn.Tanh(), LowRankLinear(9, OUT, rank=3)),
        mlp([5, 7, 5], nn.Sigmoid),
    ]
    return [m.to(dtype) for m in models]


class TwoHeads(nn.Module):
    """A module with a method besides forward, as encoders often have."""

    def __init__(self):
        super().__init__()
        self.body = mlp([6])
        self.head = nn.Linear(OUT, OUT)

    def encode(self, x, scale=1.0):
        return self.body(x) * scale

    def forward(self, x):
        return self.head(self.encode(x))


class Probe(nn.Module):
    """A small model that calls ``record()`` as its forward starts, in whichever thread runs it."""

    def __init__(self, record):
        super().__init__()
        self.lin = nn.Linear(IN, OUT)
        self.record = record

    def forward(self, x):
        self.record()
        return torch.tanh(self.lin(x))


class SlowBackward(torch.autograd.Function):
    """Identity whose backward calls ``record`` with its thread's name, then sleeps (releasing
    the GIL, so that a helper takes other chunks meanwhile)."""

    @staticmethod
    def forward(ctx, x, record):
        ctx.record = record
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.record(threading.current_thread().name)
        time.sleep(0.05)
        return g, None


def thread_recorder(seen: list[str], seconds: float):
    """A ``record`` for Probe: note the running thread in ``seen``, then sleep (releasing the
    GIL) long enough for the other threads of a job to take chunks too."""

    def record() -> None:
        seen.append(threading.current_thread().name)
        time.sleep(seconds)

    return record


def doubling_hook(calls: dict[str, int], key: str):
    """A tensor hook that counts its calls in ``calls[key]`` and doubles the gradient."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        calls[key] += 1
        return grad * 2

    return hook


def clone_models(models: list[nn.Module]) -> list[nn.Module]:
    """Deep copies that keep object identity inside the list (a module repeated stays shared)."""
    return copy.deepcopy(models)


def plain_sum(models, *args, weights=None, **kwargs):
    """The plain PyTorch expression parsum must equal: sum(w_i * m_i(...)), leaf by leaf."""
    total = None
    for i, m in enumerate(models):
        out = m(*args, **kwargs)
        if weights is not None:
            out = pytree.tree_map(lambda t, w=weights[i]: w * t, out)
        total = out if total is None else pytree.tree_map(torch.add, total, out)
    return total


def unique_params(models: list[nn.Module]) -> list[torch.Tensor]:
    """Every parameter of the models once, in order of first appearance."""
    seen: set[int] = set()
    found = []
    for m in models:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                found.append(p)
    return found


def param_grads(models: list[nn.Module]) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in unique_params(models)]


class Branchy(nn.Module):
    """Data-dependent control flow, which vmap cannot run."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y if y.sum() > 0 else -y


def learned(models, *args, **kwargs):
    """The models, after one call of ``sum_models`` without a graph: a walk's first call runs
    its forwards in model order, to learn whether the models draw random numbers (NOTE [ Random
    numbers in forwards ] in parsum._random); the calls after it run them on the threads."""
    with torch.no_grad():
        parsum.sum_models(models, *args, **kwargs)
    return models


def without_plain_graphs(monkeypatch) -> None:
    """This test's calls take the general paths, with their choice of threads, as models
    other than Sequentials of known layers do (NOTE [ Known layers in a plain graph ] and NOTE
    [ Known layers on one thread ] in parsum._plain_graph)."""
    monkeypatch.setattr(parsum._api, "sum_in_plain_graph", lambda *a: None)
    monkeypatch.setattr(parsum._api, "plain_graph_pays", lambda *a: False)


def through_parallel_sum(monkeypatch) -> None:
    """This test's later calls go through ParallelSum instead of the caller's graph, as a
    tensor hook on a parameter took them until 2026-12-05 (NOTE [ Tensor hooks in the
    caller's graph ] in parsum._inline)."""
    monkeypatch.setattr(parsum._api, "fits_callers_graph", lambda *a: False)


# The results ``sum_models`` summed as plain graphs of known layers (NOTE [ Known layers in a
# plain graph ] in parsum._plain_graph), by id, held weakly: what ``plain_graph`` reads.
_PLAIN_RESULTS: dict[int, weakref.ref] = {}
_sum_in_plain_graph = parsum._api.sum_in_plain_graph


def _recording_sum_in_plain_graph(*args, **kwargs):
    out = _sum_in_plain_graph(*args, **kwargs)
    if out is not None:
        if len(_PLAIN_RESULTS) > 10_000:
            _PLAIN_RESULTS.clear()
        _PLAIN_RESULTS[id(out)] = weakref.ref(out)
    return out


parsum._api.sum_in_plain_graph = _recording_sum_in_plain_graph


def plain_graph(y: torch.Tensor) -> bool:
    """Whether ``sum_models`` returned ``y`` summed as a plain graph of known layers."""
    ref = _PLAIN_RESULTS.get(id(y))
    return ref is not None and ref() is y


class ReturnsItsArgument(nn.Module):
    """Returns a view of its argument (or a copy of it)."""

    def __init__(self, copy=False):
        super().__init__()
        self.copy = copy

    def forward(self, x):
        view = x[..., :OUT]
        return view.clone() if self.copy else view


class HalvesItsArgument(nn.Module):
    """Halves its argument in place after reading it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(IN, OUT)

    def forward(self, x):
        y = self.lin(x)
        x.mul_(0.5)
        return y
