"""Random calls of ``sum_models`` against the plain loop, across n_jobs: mixes of models (some
identical, so that they stack, also in ``stack_`` storage; repeated; tied; with buffers,
dropout, composite parameters, an EmbeddingBag), weights, argument gradients, gradients
already there, FlatGrads, terms of the loss outside the sum, ``autograd.grad``, retained
graphs, steps in the backward, models changed between calls, models that keep state in
forward, models that fail in forward or backward, and members drawn at random each step.
Every call's outputs and gradients, and the state kept, must be the plain loop's (within
rounding), the same bits for every n_jobs and beside calls in other threads, and a failed call
must change nothing.
``python -m tests.test_differential FIRST COUNT [BUDGET]`` plays more cases than the suite (on a
thread budget of 3, or BUDGET)."""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import inspect
import random
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

import parsum
from parsum import _config, _function, _grads, _summation
from tests.zoo import (
    IN,
    OUT,
    ConvNet,
    LowRankLinear,
    mlp,
    parametrized_model,
    plain_sum,
    unique_params,
)

pytestmark = pytest.mark.timeout(300)

N_JOBS = (1, 2, 3, None)
# What changes between two calls (Case._change, before Case.change_step).
CHANGES = (
    "none",
    "none",
    "eval",
    "freeze",
    "replace",
    "train",
    "load",
    "forward hook",
    "tensor hook",
    "batch",  # fewer rows: the plan's derivation for another batch shape
)


class Tied(nn.Module):
    """A head over a layer that other models may hold too."""

    def __init__(self, shared: nn.Linear) -> None:
        super().__init__()
        self.shared = shared
        self.head = nn.Linear(shared.out_features, OUT)

    def forward(self, x):
        return self.head(torch.tanh(self.shared(x)))


class TreeOut(nn.Module):
    """An output that is a pytree."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(IN, width), nn.Linear(width, OUT), nn.Linear(width, 2)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return {"y": self.b(h), "z": (self.c(h),)}


class Rows(nn.Module):
    """Reads a few rows of a table (``parsum.take_rows``: a row-sparse gradient), which other
    models may read too."""

    def __init__(self, table: nn.Parameter | None = None) -> None:
        super().__init__()
        self.table = table if table is not None else nn.Parameter(torch.randn(20, IN))
        self.register_buffer("rows", torch.randint(0, 20, (OUT,)), persistent=False)

    def forward(self, x):
        return torch.tanh(x @ parsum.take_rows(self.table, self.rows).T)


class Scaled(nn.Module):
    """A model that takes a keyword argument."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x, scale=1.0):
        return pytree.tree_map(lambda t: t * scale, self.inner(x))


class Nested(nn.Module):
    """A model whose forward sums models of its own with sum_models."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ModuleList([mlp([4]), mlp([6], nn.ReLU), mlp([4])])

    def forward(self, x):
        return parsum.sum_models(list(self.inner), x)


class Constant(nn.Module):
    """A model whose output needs no gradient: its parameter is frozen, its input unused."""

    def __init__(self) -> None:
        super().__init__()
        self.value = nn.Parameter(torch.randn(OUT), requires_grad=False)

    def forward(self, x):
        return self.value.expand(x.shape[0], OUT)


class Bag(nn.Module):
    """An EmbeddingBag over ids drawn from the input (no gradient reaches the input through
    them), beside a Linear that reads the input: a layer vmap loops over (NOTE [ Layers vmap
    loops over ] in parsum._grouping)."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(20, OUT, mode="mean")
        self.linear = nn.Linear(IN, OUT)

    def forward(self, x):
        ids = (x.detach().abs() * 7).long() % 20
        return self.bag(ids) + self.linear(x)


class Checkpointed(nn.Module):
    """A model whose forward is recomputed in backward."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a model's backward failed")


class _RaiseOnceInBackward(torch.autograd.Function):
    """Raises the first time a backward reaches one of a call's outputs, then passes: a
    failure that does not repeat (NOTE [ A failure that does not repeat ] in parsum._inline)."""

    @staticmethod
    def forward(x, left):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.left = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        if ctx.left:
            ctx.left.pop()
            raise RuntimeError("a model's backward failed")
        return grad, None


class Failing(nn.Module):
    """A model that fails in forward or in backward while ``armed`` (in backward, with
    ``once``, only the first time a backward reaches it)."""

    def __init__(self, inner: nn.Module, where: str) -> None:
        super().__init__()
        self.inner, self.where, self.armed, self.once = inner, where, False, False

    def forward(self, x, **kwargs):
        if self.armed and self.where == "forward":
            raise RuntimeError("a model's forward failed")
        y = self.inner(x, **kwargs)
        if self.armed and self.where == "backward":
            if self.once:
                left = [True]
                return pytree.tree_map(lambda t: _RaiseOnceInBackward.apply(t, left), y)
            return pytree.tree_map(_RaiseInBackward.apply, y)
        return y


class Stateful(nn.Module):
    """Counts its calls and carries a detached state to the next one, which its output reads
    (an RNN's hidden state, by feature)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(IN, OUT)
        self.calls, self.state = 0, None

    def forward(self, x):
        self.calls += 1
        out = self.layer(x)
        if self.state is not None:
            out = out + 0.5 * self.state
        self.state = out.detach().mean(0)
        return out


class CountsInBuffer(nn.Module):
    """Counts its calls in a buffer, in place (made in eval mode: stacked with its buffers),
    and scales its output by the count."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(IN, OUT)
        self.register_buffer("count", torch.zeros(()))
        self.eval()

    def forward(self, x):
        self.count += 1
        return self.layer(x) * (1 + 0.1 * self.count)


class Tally:
    """What models that log write into: their outputs' sums and a count."""

    def __init__(self) -> None:
        self.log: list[Tensor] = []
        self.calls = 0


class Logs(nn.Module):
    """Writes into a ``Tally`` it shares with other models, in forward."""

    def __init__(self, tally: Tally) -> None:
        super().__init__()
        self.layer = nn.Linear(IN, OUT)
        self.tally, self.log = tally, tally.log

    def forward(self, x):
        out = torch.tanh(self.layer(x))
        self.log.append(out.detach().sum())
        self.tally.calls += 1
        return out


def kept_state(models: list[nn.Module]) -> list[Tensor | None]:
    """What ``Stateful`` and ``Logs`` models kept: each one's calls and state, each tally's
    count and log (in order of value: forwards on threads log in any order)."""
    found: list[Tensor | None] = []
    tallies: dict[int, Tally] = {}
    for m in models:
        if isinstance(m, Stateful):
            found += [torch.tensor(m.calls), m.state]
        elif isinstance(m, Logs):
            tallies.setdefault(id(m.tally), m.tally)
    for tally in tallies.values():
        assert all(type(t) is Tensor for t in tally.log)  # no tensor of a transform's
        log = torch.stack(tally.log).sort().values if tally.log else None
        found += [torch.tensor(tally.calls), log]
    return found


class ModelMaker:
    """Models of the kinds the random tests mix, drawn from ``rng`` into ``models``: ``act``
    where a kind's hidden layer has one activation, ``acts`` for a "random mlp"'s."""

    def __init__(
        self,
        rng: random.Random,
        act: type[nn.Module] = nn.ReLU,
        acts: tuple[type[nn.Module], ...] = (nn.Tanh, nn.ReLU, nn.GELU),
    ) -> None:
        self.rng, self.act, self.acts = rng, act, list(acts)
        self.models: list[nn.Module] = []
        self.shared: nn.Linear | None = None  # the layer that "tied" models hold

    def add(self, kind: str) -> str:
        """Make a model of ``kind`` and append it; its kind ("mlp" where ``kind`` cannot be
        made: "repeated" with no model yet, or an unknown kind)."""
        rng, models = self.rng, self.models
        if kind == "relu mlp":
            m = mlp([16, 12], nn.ReLU)
        elif kind == "random mlp":
            widths = [rng.choice([3, 5, 9]) for _ in range(rng.randint(1, 3))]
            m = mlp(widths, rng.choice(self.acts))
        elif kind == "layernorm":
            m = nn.Sequential(nn.Linear(IN, 10), nn.LayerNorm(10), nn.SiLU(), nn.Linear(10, OUT))
        elif kind == "conv":
            m = ConvNet()
        elif kind == "parametrized":
            m = parametrized_model()
        elif kind == "low rank":
            m = nn.Sequential(LowRankLinear(IN, 9), nn.Tanh(), LowRankLinear(9, OUT, rank=3))
        elif kind == "batchnorm":
            m = nn.Sequential(nn.Linear(IN, 7), nn.BatchNorm1d(7), self.act(), nn.Linear(7, OUT))
        elif kind == "dropout":
            m = nn.Sequential(nn.Linear(IN, 12), self.act(), nn.Dropout(0.3), nn.Linear(12, OUT))
        elif kind == "repeated" and models:
            m = rng.choice(models)
        elif kind == "tied":
            self.shared = self.shared or nn.Linear(IN, 5)
            m = Tied(self.shared)
        elif kind == "tied sequential":  # known layers: a plain graph on one thread
            self.shared = self.shared or nn.Linear(IN, 5)
            m = nn.Sequential(self.shared, nn.Tanh(), nn.Linear(5, OUT))
        elif kind == "rows":  # the table of an earlier one, or its own
            tables = [m.table for m in models if isinstance(m, Rows)]
            m = Rows(rng.choice(tables) if tables and rng.random() < 0.5 else None)
        elif kind == "checkpointed":
            m = Checkpointed(mlp([rng.choice([4, 8])], nn.GELU))
        elif kind == "nested":
            m = Nested()
        elif kind == "constant":
            m = Constant()
        elif kind == "bag":
            m = Bag()
        elif kind == "compiled":  # NOTE [ Compiled modules ] in parsum._engines
            m = mlp([rng.choice([4, 8])])
            if rng.random() < 0.5:
                m = torch.compile(m, backend="eager")
            else:
                m.compile(backend="eager")
        elif kind == "frozen":  # its first layer frozen
            m = mlp([6])
            m[0].requires_grad_(False)
        else:
            kind, m = "mlp", mlp([8])
        models.append(m)
        return kind


@dataclass
class Case:
    """One random scenario; ``run(n_jobs)`` plays it with parsum, ``run(None, plain=True)``
    with the plain loop."""

    seed: int
    rng: random.Random = field(repr=False)
    dtype: torch.dtype = torch.float32
    models: list[nn.Module] = field(default_factory=list, repr=False)
    kinds: list[str] = field(default_factory=list)
    weights: str = "none"
    weight_values: list[float] = field(default_factory=list, repr=False)
    x_needs_grad: bool = False
    engine: str = "auto"
    join_any_size: bool = False
    grads_before: bool = False
    flat: str = "none"
    outside: bool = False
    outside_params: list[int] = field(default_factory=list)
    how: str = "backward"
    steps: int = 1
    change: str = "none"
    # A "forward hook" change registered as a global module hook (register_module_forward_hook)
    # doubling every Linear's output of the run's models: no group is stacked while it is
    # (NOTE [ Global module hooks and stacked groups ] in parsum._grouping).
    global_hook: bool = False
    step_in_backward: bool = False
    stacked_storage: bool = False
    scale: bool = False  # every model takes a keyword argument
    chunk_size: int | None = None
    module: bool = False  # parsum.SumOfModels rather than sum_models
    autocast: bool = False  # the forwards under CPU autocast to bfloat16
    failing_step: int | None = None
    failing_model: int | None = None
    failing_in: str = ""
    # How the argument is made: a leaf, a view of a larger leaf, a transposed leaf or computed
    # from a leaf (its gradient is the leaf's); whether the loss reads it beside the sum.
    x_form: str = "leaf"
    x_in_loss: bool = False
    scale_needs_grad: bool = False  # the keyword argument's tensor, where models take one
    inference: bool = False  # torch.inference_mode instead of torch.no_grad
    rows: int = 5  # the argument's batch rows
    # The models passed as bound methods (m.forward, new objects every call), to parsum and
    # the plain loop alike: their plans are reused as the modules' are (NOTE [ Reused plans ]).
    methods: bool = False
    # Each step sums models drawn at random from ``models`` (some left out, some in another
    # order), as a user sampling ensemble members per batch does: sets planned from the
    # models' own walks (NOTE [ Shared state of models planned one by one ] in parsum._plans).
    members: bool = False

    @classmethod
    def make(cls, seed: int) -> Case:
        rng = random.Random(seed)
        case = cls(seed, rng)
        torch.manual_seed(seed)
        case.dtype = rng.choice([torch.float32, torch.float64])
        case.models = [m.to(case.dtype) for m in case._models()]
        if rng.random() < 0.15:
            case.scale = True
            case._scaled()
        n = len(case.models)
        case.weights = rng.choice(["none", "list", "tensor", "tensor with grad"])
        case.weight_values = [rng.uniform(-1, 2) for _ in range(n)]
        case.x_needs_grad = rng.random() < 0.4
        case.engine = rng.choice(["auto", "auto", "auto", "autograd", "stacked", "vjp"])
        # Under torch.func: no buffer updates (vjp), sparse gradients or saved-tensor hooks.
        refused = {
            "vjp": {"batchnorm", "rows", "checkpointed", "nested"},
            "stacked": {"rows", "checkpointed", "nested"},
        }
        if refused.get(case.engine, set()) & set(case.kinds):
            case.engine = "autograd"
        case.join_any_size = rng.random() < 0.5
        case.grads_before = rng.random() < 0.25
        case.flat = rng.choice(["none", "none", "FlatGrad", "compensated"])
        case.outside = rng.random() < 0.3
        case.outside_params = rng.sample(range(40), rng.randint(1, 4))
        case.how = rng.choice(
            ["backward", "backward", "autograd.grad", "retain_graph", "no_grad", "sgd"]
        )
        case.steps = rng.randint(1, 3)
        case.change = rng.choice(CHANGES)
        # Drawn apart, so that every other draw of a seed stays what it was. Not beside a
        # compiled model: dynamo's compiled code calls no global hook registered after it
        # compiled, and whether a model runs that code or falls back to eager (a copy of the
        # model once the recompile limit is reached) depends on what the process compiled
        # before, in the plain loop as in parsum (seed 408949, after 449 other seeds).
        case.global_hook = (
            case.change == "forward hook"
            and random.Random(seed * 7919 + 3).random() < 0.5
            and "compiled" not in case.kinds
        )
        case.chunk_size = rng.choice([None, None, 1, 2, 3])
        case.module = case.weights in ("none", "list") and rng.random() < 0.15
        # (Not with a model whose output autocast leaves in float32, which sum_models refuses
        # beside others' bfloat16: LowRankLinear adds its bias after a bfloat16 matmul, a
        # constant is not cast, and an EmbeddingBag's float32 output promotes its sum.)
        case.autocast = (
            case.dtype == torch.float32
            and not {"low rank", "constant", "bag"} & set(case.kinds)
            and rng.random() < 0.1
        )
        # autograd.grad does not reach the models of a stack (docs/identical-models.md)
        case.stacked_storage = case.how != "autograd.grad" and rng.random() < 0.25
        # StepInBackward takes each model once, and no parameter of two models.
        once_each = len({id(m) for m in case.models}) == n
        once_each = once_each and not {"tied", "tied sequential"} & set(case.kinds)
        once_each = once_each and len({id(p) for p in unique_params(case.models)}) == sum(
            len(list(m.parameters())) for m in case.models
        )
        case.step_in_backward = (
            "tree" not in case.kinds
            and once_each
            and not case.outside
            and case.how == "backward"
            and case.flat == "none"
            and not case.grads_before
            # a parameter its optimizer lacks, or a hook, which StepInBackward refuses
            and case.change not in ("freeze", "replace", "tensor hook")
            and rng.random() < 0.15
        )
        # A model that fails: not with steps in the backward (the steps taken stay), nor where a
        # frozen parameter may leave no gradient to fail in.
        if not case.step_in_backward and case.change != "freeze" and rng.random() < 0.25:
            k = rng.randrange(n)
            # (A model whose output needs no gradient has no backward to fail in.)
            where = rng.choice(["forward", "forward" if _constant(case.models[k]) else "backward"])
            case.models[k] = Failing(case.models[k], where)
            case.kinds[k] += f" failing in {where}"
            case.failing_step, case.failing_model = rng.randrange(case.steps), k
            case.failing_in = where
        # (Drawn last: the draws above make the same cases as before these were added.)
        case.x_form = rng.choice(["leaf", "leaf", "leaf", "view", "transposed", "computed"])
        case.x_in_loss = case.x_needs_grad and rng.random() < 0.3
        case.scale_needs_grad = case.scale and rng.random() < 0.5
        case.inference = case.how == "no_grad" and rng.random() < 0.5
        # Fewer rows, down to one (a bias's gradient is then a view of its cotangent): not
        # with BatchNorm, which needs two rows in training mode.
        norms = (nn.modules.batchnorm._BatchNorm,)
        if not any(isinstance(mod, norms) for m in case.models for mod in m.modules()):
            case.rows = rng.choice([5, 5, 5, 2, 1])
        case.methods = (
            not case.module
            and not case.step_in_backward
            and case.engine != "vjp"  # which runs modules only
            and rng.random() < 0.15
        )
        # Models that keep state in forward, identical (auto would stack them): not under
        # engines that refuse them, nor with a failing model (which of the forwards ran before
        # it failed differs), nor with keyword arguments or beside outputs of another shape.
        if (
            case.engine in ("auto", "autograd")
            and case.failing_step is None
            and not case.scale
            and "tree" not in case.kinds
            and rng.random() < 0.2
        ):
            kind = rng.choice(["stateful", "logs", "counts in buffer"])
            tally = Tally()
            for _ in range(rng.choice([2, 3, 8])):
                made = {"stateful": Stateful, "counts in buffer": CountsInBuffer}.get(
                    kind, lambda: Logs(tally)
                )()
                case.models.append(made.to(case.dtype))
                case.kinds.append(kind)
                case.weight_values.append(rng.uniform(-1, 2))
        if not case.module and rng.random() < 0.25:
            case.members = True
            case.steps = max(case.steps, 4)
        if case.failing_in == "backward" and rng.random() < 0.5:
            failing = case.models[case.failing_model]  # type: ignore[index]
            failing.once = True
            case.kinds[case.failing_model] += " once"  # type: ignore[index]
        return case

    @property
    def change_step(self) -> int:
        """The step before which ``change`` is made: the second, or with members drawn the
        third, when the models drawn have walks of their own (made for the second step's
        set, a new one), which a new set of them is joined from."""
        return 2 if self.members else 1

    def drawn(self, step: int) -> list[int] | None:
        """The positions of the models step ``step`` sums (None: all of them, in order), the
        same in every run; the failing step holds the failing model, and every step one whose
        output needs a gradient."""
        if not self.members:
            return None
        rng = random.Random(self.seed * 7919 + step)
        n = len(self.models)
        positions = rng.sample(range(n), rng.randint(1, n))
        if step == self.failing_step and self.failing_model not in positions:
            positions.append(self.failing_model)  # type: ignore[arg-type]
        if all(_constant(self.models[k]) for k in positions):  # as _models: one to differentiate
            positions.append(next(k for k, m in enumerate(self.models) if not _constant(m)))
        if rng.random() < 0.5:
            positions.sort()
        return positions

    def _models(self) -> list[nn.Module]:
        rng = self.rng
        if rng.random() < 0.1:
            self.kinds = ["tree"] * rng.randint(1, 5)
            return [TreeOut(rng.choice([4, 8])) for _ in self.kinds]
        maker = ModelMaker(rng)
        kinds = (
            ["mlp"] * 3
            + ["relu mlp", "random mlp", "layernorm", "conv", "parametrized", "low rank"]
            + ["batchnorm", "dropout", "repeated", "tied", "rows", "checkpointed"]
            + ["nested", "constant", "bag", "compiled", "tied sequential"]
        )
        if rng.random() < 0.15:  # known layers alone (NOTE [ Known layers in a plain graph ])
            kinds = ["mlp", "relu mlp", "random mlp", "repeated", "tied sequential"]
        for _ in range(rng.randint(1, 8)):
            self.kinds.append(maker.add(rng.choice(kinds)))
        models = maker.models
        if all(map(_constant, models)):  # else nothing to differentiate (and under "vjp"
            models.append(mlp([8]))  # the plain loop's loss needs no gradient, parsum's does)
            self.kinds.append("mlp")
        return models

    def _scaled(self) -> None:
        """Every model takes ``scale=``: wrapped once each (a repeated one stays repeated)."""
        wrapped: dict[int, nn.Module] = {}
        self.models = [wrapped.setdefault(id(m), Scaled(m)) for m in self.models]

    @property
    def plain_differs(self) -> bool:
        """Whether parsum may give other results than the plain loop beyond rounding: dropout
        in a stacked group draws from vmap's stream, and under autocast the plain loop sums
        in bfloat16 (docs/limits.md)."""
        return (self.draws and self.engine != "autograd") or self.autocast

    def _autocast(self) -> Any:
        return torch.autocast("cpu", torch.bfloat16) if self.autocast else contextlib.nullcontext()

    @property
    def fits_ranks(self) -> bool:
        """Whether ``run(share=...)`` on every rank gives this rank's part of a plain run: no
        parameter of two models (each rank holds its own), no failure or step in the
        backward (tested apart), no drawing or autocast, no autograd.grad (with respect to
        this rank's parameters, it gives other results than the plain loop's)."""
        params = unique_params(self.models)
        return (
            len({id(p) for p in params}) == sum(len(list(m.parameters())) for m in self.models)
            and self.failing_step is None
            and not self.step_in_backward
            and not self.plain_differs
            and not self.draws
            and self.how != "autograd.grad"
            and not {"stateful", "logs", "counts in buffer"} & set(self.kinds)  # kept state
            and not self.members
        )

    @property
    def draws(self) -> bool:
        """Whether a model draws random numbers."""
        return any(kind.startswith("dropout") for kind in self.kinds)

    def run(
        self, n_jobs: int | None, plain: bool = False, share: list[int] | None = None
    ) -> dict[str, Any]:
        """Every step's outputs (and ``autograd.grad`` results), then the parameters, their
        ``.grad``, the buffers and the argument's and weights' gradients at the end. With
        ``share``, this rank's models of a ``parsum.distributed`` run: the parameters,
        buffers and weights of those models."""
        handles: list[Any] = []  # a global hook's, removed whatever happens
        try:
            return self._run(n_jobs, plain, share, handles)
        finally:
            for handle in handles:
                handle.remove()

    def _run(
        self, n_jobs: int | None, plain: bool, share: list[int] | None, handles: list[Any]
    ) -> dict[str, Any]:
        models = copy.deepcopy(self.models)
        first = models[0] if share is None or 0 in share else None  # what _change changes
        init = torch.Generator().manual_seed(self.seed + 1)
        before = [
            torch.randn(p.shape, generator=init, dtype=p.dtype) for p in unique_params(models)
        ]
        weight_values = self.weight_values
        everyone = models  # every model's copy, this rank's or not
        if share is not None:
            mine = {id(p) for i in share for p in models[i].parameters()}
            before = [g for p, g in zip(unique_params(models), before) if id(p) in mine]
            models = [models[i] for i in share]
            weight_values = [weight_values[i] for i in share]
        if self.stacked_storage:  # the models of kind "mlp", in parsum.stack_ storage
            kinds = self.kinds if share is None else [self.kinds[i] for i in share]
            group = [m for m, kind in zip(models, kinds) if kind == "mlp"]
            if len(group) == len({id(m) for m in group}) >= 2:
                parsum.stack_(group)
        params = unique_params(models)
        if not plain and self.flat != "none" and any(p.requires_grad for p in params):
            parsum.FlatGrad(models, compensated=self.flat == "compensated")
            for p, g in zip(params, before) if self.grads_before else ():
                if p.grad is not None:  # a frozen parameter has no slot
                    p.grad.copy_(g)
        elif self.grads_before:
            for p, g in zip(params, before):
                if p.requires_grad:  # as a FlatGrad, which gives frozen ones no slot
                    p.grad = g.clone()
        sib = None
        optimizer = None
        if self.step_in_backward:
            if plain:
                optimizer = torch.optim.SGD(params, lr=0.1)
            else:
                sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
        elif self.how == "sgd":  # not Adam, which turns rounding on gradients near zero
            # (a Linear's bias before a BatchNorm) into steps of the learning rate
            optimizer = torch.optim.SGD(params, lr=0.01)
        scale = torch.tensor(0.5, dtype=self.dtype).requires_grad_(self.scale_needs_grad)
        call = {"scale": scale} if self.scale else {}
        leaf = self._leaf(init)
        weights: Any = None
        if self.weights == "list":
            weights = list(weight_values)
        elif self.weights != "none":
            weights = torch.tensor(weight_values, dtype=self.dtype)
            weights.requires_grad_(self.weights == "tensor with grad")
        record: list[Any] = []
        for step in range(self.steps):
            x = self._argument(leaf)  # made in each step, as a batch is
            if step >= self.change_step and self.change == "batch":
                x = x[:3]
            if step == self.change_step:
                self._change(models, first, handles)
                params = unique_params(models)
            failing = step == self.failing_step
            for m in models:
                if isinstance(m, Failing):
                    m.armed = failing
            if self.draws:  # only then: a thread seeding beside a call looks like its models
                torch.manual_seed(self.seed + 100 + step)  # drawing (NOTE [ Random numbers
                # in forwards ] in parsum._random), which then run in model order
            # Bound methods are made anew for every call, as a user's list comprehension does
            # (a compiled module's forward is a function of its own: the module itself).
            calls = [_bound_forward(m) for m in models] if self.methods else models
            summed = weights
            positions = self.drawn(step)
            if positions is not None:
                calls = [calls[k] for k in positions]
                if isinstance(weights, list):
                    summed = [weights[k] for k in positions]
                elif isinstance(weights, Tensor):
                    summed = weights[positions]
            if failing and not plain:
                failing_at = self.failing_model
                if positions is not None:
                    failing_at = positions.index(failing_at)  # type: ignore[arg-type]
                drawn = models if positions is None else [models[k] for k in positions]
                self._fail(models, drawn, calls, x, summed, n_jobs, sib, failing_at)
                continue
            if plain:
                if failing:  # as if the step never ran, or its forward only
                    if self.failing_in == "backward":
                        plain_sum(calls, x, weights=summed, **call)
                    continue
                with self._no_grad(), self._autocast():
                    y = plain_sum(calls, x, weights=summed, **call)
            else:
                kwargs = {} if sib is None else {"step_in_backward": sib}
                if self.chunk_size is not None:
                    kwargs["chunk_size"] = self.chunk_size
                summing = parsum.sum_models if share is None else parsum.distributed.sum_models
                if self.module and share is None:
                    summing = _as_module(models, weights, kwargs)
                with self._no_grad(), self._autocast():
                    y = summing(
                        calls, x, weights=summed, n_jobs=n_jobs, engine=self.engine, **call,
                        **kwargs,
                    )  # fmt: skip
            record.extend(t.detach().clone() for t in pytree.tree_leaves(y))
            if self.how == "no_grad":
                continue
            loss = self._loss(y, params, unique_params(everyone), x)
            if not loss.requires_grad:  # every parameter frozen: nothing to differentiate
                continue
            if self.how == "autograd.grad":
                wanted = self._wanted(params, x, weights)
                found = torch.autograd.grad(loss, wanted, allow_unused=True)
                record.extend(None if g is None else g.clone() for g in found)
            elif self.how == "retain_graph":
                loss.backward(retain_graph=True)
                loss.backward()
            else:
                loss.backward()
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad()  # .grad None: a FlatGrad's views are set again
        params = unique_params(models)
        _assert_apart([p.grad for p in params if p.grad is not None and not p.grad.is_sparse])
        return {
            "record": record,
            "grads": [None if p.grad is None else p.grad.clone() for p in params],
            "params": [p.detach().clone() for p in params],
            "buffers": [b.clone() for m in models for b in m.buffers()],
            "x.grad": None if leaf.grad is None else leaf.grad.clone(),
            "weights.grad": getattr(weights, "grad", None),
            "scale.grad": None if scale.grad is None else scale.grad.clone(),
            "kept state": kept_state(models),
        }

    def _leaf(self, init: torch.Generator) -> torch.Tensor:
        """The leaf whose gradient is recorded as the argument's (``x_form``)."""
        rows = self.rows
        shape = {"view": (rows + 3, IN), "transposed": (IN, rows)}.get(self.x_form, (rows, IN))
        return torch.randn(shape, dtype=self.dtype, generator=init).requires_grad_(
            self.x_needs_grad
        )

    def _argument(self, leaf: torch.Tensor) -> torch.Tensor:
        """The argument, made from ``leaf`` as ``x_form`` says."""
        if self.x_form == "view":
            return leaf[1 : 1 + self.rows]
        if self.x_form == "transposed":
            return leaf.t()
        return leaf * 1.5 if self.x_form == "computed" else leaf

    def _no_grad(self) -> Any:
        if self.how != "no_grad":
            return contextlib.nullcontext()
        return torch.inference_mode() if self.inference else torch.no_grad()

    def _loss(
        self,
        y: Any,
        params: list[torch.Tensor],
        every: list[torch.Tensor] | None = None,
        x: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The loss of the sum, and, with ``outside``, a term on some parameters, chosen among
        ``every`` model's (default ``params``; a rank takes those of them it holds); with
        ``x_in_loss``, a term on the argument ``x``. Both made after the sum."""
        loss = sum((t.double() ** 2).mean() * (k + 1) for k, t in enumerate(pytree.tree_leaves(y)))
        if self.x_in_loss and x is not None:
            loss = loss + (x.double() ** 3).sum() * 0.1
        if self.outside:  # made after the sum: its gradients reach .grad before the sum's
            every = params if every is None else every
            chosen = {id(every[k % len(every)]) for k in self.outside_params}
            terms = [p for p in params if id(p) in chosen and p.requires_grad]
            loss = loss + sum((p.double() ** 2).sum() for p in terms)
        return loss  # type: ignore[return-value]

    def _wanted(self, params, x, weights) -> list[torch.Tensor]:
        wanted = [p for p in params if p.requires_grad]
        if self.x_needs_grad:
            wanted.append(x)
        if self.weights == "tensor with grad":
            wanted.append(weights)
        return wanted

    def _change(self, models: list[nn.Module], first: nn.Module | None, handles: list[Any]) -> None:
        """The change between two calls (before ``change_step``), alike in every run: to model 0
        (``first``; None where this rank does not hold it), or to every model (a global hook,
        registered into ``handles``, on this run's models alone)."""
        if self.change == "train":
            for m in models:
                m.train()
        if self.global_hook:
            # This run's modules carry its tag, which engine "vjp"'s shadows of them share
            tag = object()
            for m in (m for model in models for m in model.modules()):
                m._run_tag = tag

            def hook(module: nn.Module, args: Any, out: Any) -> Any:
                if isinstance(module, nn.Linear) and getattr(module, "_run_tag", None) is tag:
                    return pytree.tree_map(_double, out)
                return None

            handles.append(nn.modules.module.register_module_forward_hook(hook))
            return
        if first is None:
            return
        if self.change == "eval":
            first.eval()
        elif self.change == "freeze":
            next(first.parameters()).requires_grad_(False)
        elif self.change == "replace":
            owner = next(m for m in first.modules() if list(m.parameters(recurse=False)))
            name, p = next(iter(owner.named_parameters(recurse=False)))
            if "." not in name:  # not a parametrization's original
                setattr(owner, name, nn.Parameter(p.detach() * 1.5))
        elif self.change == "load":  # new values in the same tensors: a plan reused
            first.load_state_dict({k: v * 0.5 for k, v in first.state_dict().items()})
        elif self.change == "forward hook":
            first.register_forward_hook(lambda module, args, out: pytree.tree_map(_double, out))
        elif self.change == "tensor hook":
            p = next(first.parameters())
            if p.requires_grad:
                p.register_hook(_double)

    def _fail(self, models, drawn, calls, x, weights, n_jobs, sib, failing_at) -> None:
        """A call of the ``drawn`` models with a failing one at position ``failing_at`` of
        ``calls`` (those models or their bound methods): ParsumError, and nothing of
        ``models`` changed (the loss's terms outside the sum on ``drawn`` models' parameters
        alone: a plain backward would accumulate the others' before the failure)."""
        params = unique_params(drawn)
        state = _state(models)
        kwargs = {} if sib is None else {"step_in_backward": sib}
        kind = "Failing.forward" if inspect.ismethod(calls[failing_at]) else "Failing"
        named = rf"model {failing_at} \({kind}\) raised RuntimeError in {self.failing_in}"
        scale = torch.tensor(0.5, dtype=self.dtype).requires_grad_(self.scale_needs_grad)
        call = {"scale": scale} if self.scale else {}
        with pytest.raises(parsum.ParsumError, match=named):
            y = parsum.sum_models(
                calls, x, weights=weights, n_jobs=n_jobs, engine=self.engine, **call, **kwargs
            )
            if self.failing_in == "backward":
                state = _state(models)  # the forward's statistics stay, as in the plain loop
            loss = self._loss(y, params, unique_params(models), x=x)
            if self.how == "autograd.grad":
                torch.autograd.grad(loss, self._wanted(params, x, weights), allow_unused=True)
            else:
                loss.backward()
        after = _state(models)
        for what in state:  # every model's
            _compare(after[what], state[what], f"failed call changed {what}", exact=True)


def _bound_forward(model: nn.Module) -> Any:
    """``model.forward`` where it is a bound method, else the model."""
    forward = model.forward
    return forward if inspect.ismethod(forward) else model


def _as_module(models: list[nn.Module], weights: Any, kwargs: dict[str, Any]) -> Any:
    """``sum_models`` through a ``parsum.SumOfModels`` of the models, made on each call."""

    def call(models, x, weights, n_jobs, engine, **rest):
        module = parsum.SumOfModels(
            models, weights=weights, n_jobs=n_jobs, engine=engine, **kwargs
        )  # fmt: skip
        rest = {k: v for k, v in rest.items() if k not in kwargs}
        return module(x, **rest)

    return call


def _constant(model: nn.Module) -> bool:
    """Whether the model's output needs no gradient (a Constant, maybe Scaled)."""
    return isinstance(model.inner if isinstance(model, Scaled) else model, Constant)


def _double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def _state(models: list[nn.Module]) -> dict[str, list[torch.Tensor | None]]:
    params = unique_params(models)
    return {
        ".grad": [None if p.grad is None else p.grad.clone() for p in params],
        "parameters": [p.detach().clone() for p in params],
        "buffers": [b.clone() for m in models for b in m.buffers()],
    }


def _assert_apart(grads: list[torch.Tensor]) -> None:
    """No two parameters' ``.grad`` share memory (views of one FlatGrad buffer or one stacked
    gradient are fine where they do not overlap): an in-place accumulation or clip into one
    would change the other."""
    spans = sorted(
        (g.data_ptr(), g.data_ptr() + g.numel() * g.element_size(), k)
        for k, g in enumerate(grads)
        if g.numel() and g.is_contiguous()
    )
    for (_, end, k), (start, _, j) in zip(spans, spans[1:]):
        assert start >= end, f"the .grad of parameters {k} and {j} share memory"


def _compare(
    got: Any, want: Any, what: str, exact: bool, dtype=torch.float32, scale: float = 0.0
) -> None:
    """``got`` against ``want``: bit for bit, or within rounding, which ``scale`` widens in
    proportion (the largest value the compared values were computed beside)."""
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), what
        for k, (g, w) in enumerate(zip(got, want)):
            _compare(g, w, f"{what}[{k}]", exact, dtype, scale)
        return
    assert (got is None) == (want is None), f"{what}: {got is None} against {want is None}"
    if got is None:
        return
    assert got.shape == want.shape, what
    got, want = got.to_dense(), want.to_dense()  # row-sparse gradients as their values
    if exact:
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), what
    else:
        rtol, atol, eps = (1e-4, 1e-5, 2e-6) if dtype == torch.float32 else (1e-9, 1e-11, 1e-14)
        assert torch.allclose(got, want, rtol=rtol, atol=atol + eps * scale), what


def _largest(values: list[Any]) -> float:
    """The largest magnitude among ``values`` (tensors or None)."""
    return max((float(v.to_dense().abs().max()) for v in values if v is not None and v.numel()),
               default=0.0)  # fmt: skip


def check(seed: int) -> None:
    """Case ``seed`` with parsum at every n_jobs against the plain loop."""
    case = Case.make(seed)
    saved = _function.JOIN_LATER_PARAMS
    _function.JOIN_LATER_PARAMS = 0 if case.join_any_size else saved
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # dropout's order warnings, lazy modules
            runs = {n: case.run(n) for n in N_JOBS}
            plain = case.run(None, plain=True)
    finally:
        _function.JOIN_LATER_PARAMS = saved
    for what, want in plain.items():
        if want is None and what in (
            "x.grad",
            "weights.grad",
            "scale.grad",
        ):  # an argument no model reads:
            want = runs[1][what]  # the plain loop cannot differentiate, parsum gives zeros
            assert want is None or not want.any()
        if what == "record" and case.engine != "autograd":
            # torch.func.vjp gives an argument no model reads a zero gradient where the plain
            # loop's autograd.grad gives None (docs/limits.md; seed 257114: a step that drew
            # only a constant model, engine "vjp")
            want = [w if w is not None or g is None or g.to_dense().any() else g
                    for w, g in zip(want, runs[1][what])]  # fmt: skip
        if case.flat != "none" and what == "grads":  # a FlatGrad's .grad are views, never None
            want = [w if w is not None or g is None else torch.zeros_like(g)
                    for w, g in zip(want, runs[1][what])]  # fmt: skip
        if not case.plain_differs:
            # A gradient that cancels to about zero (a Linear's bias before a BatchNorm) is
            # rounding of the terms it cancels, as large as the model's other gradients (seed
            # 171576 at a budget of 2: 3.3e-5 in the plain loop, -6.4e-5 here, beside 101).
            scale = _largest(want) if what == "grads" else 0.0
            _compare(
                runs[1][what], want, f"{case}: {what} against the plain loop", False, case.dtype,
                scale,
            )  # fmt: skip
        for n in N_JOBS[1:]:
            _compare(runs[n][what], runs[1][what], f"{case}: {what} at n_jobs={n}", True)


def check_concurrently(seeds: range, n_jobs: int = 2) -> None:
    """The cases of ``seeds`` (those without dropout, whose draws come from one generator)
    run at once, one thread each, with the calling thread's budget (the bits depend on the
    budget, which is each thread's intra-op count): every run gives the bits it gives alone."""
    # (Nor a failing model beside a take_rows table: whether the table was read before the
    # failure depends on the threads' timing, and a table read makes the next call take
    # ParallelSum's path instead of the caller's graph, whose bits differ where a FlatGrad slot
    # and a term of the loss outside the sum add to one parameter: docs/limits.md.)
    # (Nor a global hook, whose presence changes the plans, hence the bits, of the other
    # threads' calls: NOTE [ Global module hooks and stacked groups ] in parsum._grouping.)
    cases = [
        case
        for case in map(Case.make, seeds)
        if not case.draws
        and not (case.failing_step is not None and "rows" in case.kinds)
        and not case.global_hook
    ]
    saved = _function.JOIN_LATER_PARAMS
    _function.JOIN_LATER_PARAMS = 0  # every case the same way: one module-wide setting
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            alone = [case.run(n_jobs) for case in cases]
            together: list[Any] = [None] * len(cases)

            budget = torch.get_num_threads()

            def play(k: int) -> None:
                # A new thread takes the count any thread set last at its first parallel op
                # (get_num_threads counts as one): asked first, then set, it keeps the budget.
                torch.get_num_threads()
                torch.set_num_threads(budget)
                try:
                    together[k] = cases[k].run(n_jobs)
                except BaseException as exc:  # raised in the test's thread below
                    together[k] = exc

            threads = [threading.Thread(target=play, args=(k,)) for k in range(len(cases))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
                assert not thread.is_alive(), "a concurrent call hangs"
    finally:
        _function.JOIN_LATER_PARAMS = saved
    for case, got, want in zip(cases, together, alone):
        if isinstance(got, BaseException):
            raise got
        for what in want:
            _compare(got[what], want[what], f"{case}: {what} beside other calls", True)


@pytest.fixture
def three_cores(cores):
    cores(3)


@pytest.mark.parametrize("seed", range(200))
def test_random_calls_match_the_plain_loop_with_the_same_bits_at_any_n_jobs(seed, three_cores):
    check(seed)


@pytest.mark.parametrize("seed", range(2000, 2030))
def test_random_calls_over_parameters_trained_in_two_threads_match_the_plain_loop(
    seed, three_cores, monkeypatch
):
    # Over parameters a second thread trains, the pullbacks return every gradient instead of
    # accumulating it (NOTE [ Parameters trained in several threads ] in parsum._grads): the
    # same checks, every parameter counted as such (300 runner cases so, none failed).
    monkeypatch.setattr(_grads.ParamTrainers, "several", lambda self, note: True)
    check(seed)


@pytest.mark.parametrize("seed", range(3000, 3030))
def test_random_calls_summing_every_term_one_by_one_match_the_plain_loop(
    seed, three_cores, monkeypatch
):
    # With the one-reduction threshold at 256 bytes, the outputs, the arguments' gradients and
    # the shared parameters' are added model by model and the chunks' partial sums one by one
    # (NOTE [ One reduction for small outputs ], NOTE [ Argument gradients at once ] and NOTE
    # [ Shared gradients at once ] in parsum._summation), which the suite's small models reach
    # only here: the same checks (400 runner cases so, none failed).
    monkeypatch.setattr(_summation, "PARTIALS_BYTES", 256)
    check(seed)


@pytest.mark.parametrize("first", range(1000, 1050, 10))
def test_random_calls_at_once_in_several_threads_give_the_bits_of_each_alone(first, three_cores):
    check_concurrently(range(first, first + 10))


class SequenceModel(nn.Module):
    """A layer over a (rows, tokens, width) sequence with a head: what NOTE [ Tokens ] and the
    recurrent layers' rule in parsum._grouping plan (per-token costs, workers)."""

    def __init__(self, kind: str, size: int) -> None:
        super().__init__()
        self.kind = kind
        if kind == "transformer":
            self.layer: nn.Module = nn.TransformerEncoderLayer(
                SEQ_WIDTH, 2, size, dropout=0.0, batch_first=True
            )
        elif kind in ("lstm", "gru"):
            cell = nn.LSTM if kind == "lstm" else nn.GRU
            self.layer = cell(SEQ_WIDTH, size, batch_first=True)
        else:  # an MLP on every token
            self.layer = nn.Sequential(nn.Linear(SEQ_WIDTH, size), nn.Tanh())
        width = SEQ_WIDTH if kind == "transformer" else size
        self.head = nn.Linear(width, OUT)

    def forward(self, x):
        y = self.layer(x)
        y = y[0][:, -1] if self.kind in ("lstm", "gru") else y.mean(1)
        return self.head(y)


SEQ_WIDTH = 8


def _compare_float64_runs(runs: list[list[Any]], what: str) -> None:
    """Runs at each of N_JOBS, then the plain loop's, in float64: the first against the plain
    loop, the others bit for bit against the first."""
    *parsum_runs, plain = runs
    _compare(parsum_runs[0], plain, f"{what} against the plain loop", False, torch.float64)
    for n_jobs, got in zip(N_JOBS[1:], parsum_runs[1:]):
        _compare(got, parsum_runs[0], f"{what} at n_jobs={n_jobs}", True)


def check_sequences(seed: int) -> None:
    """Random sequence models (transformer layers, LSTMs, GRUs, per-token MLPs) on a random
    (rows, tokens, width) batch in float64: the plain loop's sum and gradients, and the same
    bits at every n_jobs, with weights and the argument's gradient at random."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    kinds = [rng.choice(["transformer", "lstm", "gru", "mlp"]) for _ in range(rng.randint(1, 7))]
    models = [SequenceModel(k, rng.choice([4, 8, 12, 16])).double() for k in kinds]
    shape = (rng.randint(1, 6), rng.randint(1, 9), SEQ_WIDTH)
    x = torch.randn(shape, dtype=torch.float64)
    weights = [rng.uniform(-1, 2) for _ in models] if rng.random() < 0.5 else None
    x_grad = rng.random() < 0.5
    runs = []
    for n_jobs in (*N_JOBS, "plain"):
        copies = copy.deepcopy(models)
        xi = x.clone().requires_grad_(x_grad)
        if n_jobs == "plain":
            y = plain_sum(copies, xi, weights=weights)
        else:
            y = parsum.sum_models(copies, xi, n_jobs=n_jobs, weights=weights)
        (y.sin() * 3).sum().backward()
        runs.append([y.detach(), xi.grad, *(p.grad for p in unique_params(copies))])
    what = f"sequence case {seed} ({kinds}, {shape}, weights {weights is not None}, x {x_grad})"
    _compare_float64_runs(runs, what)


@pytest.mark.parametrize("seed", range(40))
def test_random_sequence_models_match_the_plain_loop_with_the_same_bits(seed, three_cores):
    check_sequences(seed)


def check_complex(seed: int) -> None:
    """Random complex models (identical ones too, some in ``stack_`` storage) with weights
    (floats, a real or a complex tensor, with or without its gradient), the argument's
    gradient, a FlatGrad, and ``backward``, ``autograd.grad`` or a retained graph backed twice:
    the plain loop's sum and gradients, PyTorch's conjugates included, and the same bits at
    every n_jobs (NOTE [ Complex weights ] in parsum._engines)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    cdtype = torch.complex128

    def member(width: int) -> nn.Module:
        return nn.Sequential(
            nn.Linear(IN, width, dtype=cdtype), nn.Tanh(), nn.Linear(width, OUT, dtype=cdtype)
        )

    widths = [rng.choice([3, 5]) for _ in range(rng.randint(1, 7))]
    models = [member(w) for w in widths]
    weights_kind = rng.choice(["none", "list", "real", "real grad", "complex", "complex grad"])
    weight_values = [complex(rng.uniform(-1, 2), rng.uniform(-1, 1)) for _ in models]
    x_grad = rng.random() < 0.5
    engine = rng.choice(["auto", "auto", "autograd", "vjp", "stacked"])
    flat = rng.choice(["none", "none", "FlatGrad", "compensated"])
    how = rng.choice(["backward", "autograd.grad", "retain_graph"])
    stacked = how != "autograd.grad" and rng.random() < 0.3
    x = torch.randn(rng.randint(1, 6), IN, dtype=cdtype)

    def weights_for() -> Any:
        if weights_kind == "none":
            return None
        if weights_kind == "list":
            return [w.real for w in weight_values]
        if weights_kind.startswith("real"):
            values = torch.tensor([w.real for w in weight_values], dtype=torch.float64)
        else:
            values = torch.tensor(weight_values, dtype=cdtype)
        return values.requires_grad_(weights_kind.endswith("grad"))

    def loss(y: Tensor) -> Tensor:
        return (y.abs() ** 2).sum() + (y * (1 + 2j)).real.sum()

    runs = []
    for n_jobs in (*N_JOBS, "plain"):
        copies = copy.deepcopy(models)
        if stacked and n_jobs != "plain" and len(set(widths)) == 1 and len(copies) > 1:
            parsum.stack_(copies)
        if flat != "none" and n_jobs != "plain":
            parsum.FlatGrad(copies, compensated=flat == "compensated")
        xi = x.clone().requires_grad_(x_grad)
        w = weights_for()
        if n_jobs == "plain":
            y = plain_sum(copies, xi, weights=w)
        else:
            y = parsum.sum_models(copies, xi, n_jobs=n_jobs, weights=w, engine=engine)
        params = unique_params(copies)
        wanted = [
            *([xi] if x_grad else []),
            *([w] if isinstance(w, Tensor) and w.requires_grad else []),
            *params,
        ]
        if how == "autograd.grad":
            grads = list(torch.autograd.grad(loss(y), wanted, allow_unused=True))
        else:
            for _ in range(2 if how == "retain_graph" else 1):
                loss(y).backward(retain_graph=how == "retain_graph")
            grads = [t.grad for t in wanted]
        runs.append([y.detach(), *grads])
    what = (
        f"complex case {seed} ({len(models)} models, weights {weights_kind}, x {x_grad}, "
        f"{engine}, {flat}, {how}, stacked {stacked})"
    )
    _compare_float64_runs(runs, what)


@pytest.mark.parametrize("seed", range(40))
def test_random_complex_models_match_the_plain_loop_with_the_same_bits(seed, three_cores):
    check_complex(seed)


def _failures(label: str, check: Any, items: Any) -> int:
    """Play ``check`` on each item, printing each failure under ``label.format(item)``; how
    many failed."""
    failed = 0
    for item in items:
        try:
            check(item)
        except (Exception, pytest.fail.Exception) as exc:  # every failure, then the count
            failed += 1
            print(f"{label.format(item)}: {type(exc).__name__}: {exc}"[:600], flush=True)
    return failed


if __name__ == "__main__":
    # A crash prints every thread's Python stack (one run of 2026-11-29 ended in a general
    # protection fault inside glibc's malloc, in the calling thread, with nothing else to go on).
    faulthandler.enable(all_threads=True)
    # An optional third argument sets the thread budget (default 3). On budgets of 1 and 2 the
    # default may plan apart from an explicit n_jobs (NOTE [ Threads that pay ] in
    # parsum._grouping): on 1 it must give their bits, on 2 it may not (one chunk on both
    # intra-op threads), and is left out.
    budget = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    _config.usable_cores = lambda: budget  # type: ignore[assignment]
    torch.set_num_threads(budget)
    if budget == 2:
        N_JOBS = (1, 2, 3)
    first, count = int(sys.argv[1]), int(sys.argv[2])
    failed = _failures("seed {}", check, range(first, first + count))
    groups = [range(g, min(g + 10, first + count)) for g in range(first, first + count, 10)]
    failed += _failures("seeds {} at once", check_concurrently, groups)
    failed += _failures("sequence seed {}", check_sequences, range(first, first + count // 10))
    failed += _failures("complex seed {}", check_complex, range(first, first + count // 10))
    print(
        f"{count} cases alone and at once, {count // 10} of sequences and {count // 10} of "
        f"complex models, {failed} failed"
    )
    sys.exit(1 if failed else 0)  # a script that plays them sees a failure
