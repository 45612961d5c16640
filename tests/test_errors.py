"""Bad input and failing models: ParsumError naming the argument, value, index and type;
a failed call changes nothing and the pool stays usable."""

import copy
import functools
import re
import threading

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

import parsum
from tests.zoo import (
    IN,
    OUT,
    HalvesItsArgument,
    ReturnsItsArgument,
    SlowBackward,
    clone_models,
    mlp,
    param_grads,
    plain_sum,
    thread_recorder,
    zoo,
)

pytestmark = pytest.mark.timeout(60)


class Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(IN, OUT)

    def forward(self, x):
        raise ValueError("boom in forward")


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ValueError("boom in backward")


class BoomBackward(nn.Module):
    def __init__(self, n_in=IN, n_out=OUT):
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)

    def forward(self, x):
        return _FailingBackward.apply(self.lin(x))


@pytest.mark.parametrize(
    ("models", "kwargs", "match"),
    [
        ([], {}, "sum_models: models is empty"),
        (nn.Linear(IN, OUT), {}, "models is a single Linear; expected a sequence"),
        ("abc", {}, "models is a str"),
        ((m for m in [mlp([3])]), {}, r"models is a generator; .* pass list\(models\)"),
        ({"a": mlp([3])}.values(), {}, r"models is a dict_values; .* pass list\(models\)"),
        (nn.ModuleDict({"a": mlp([3])}), {}, r"an nn.ModuleDict; .* list\(models.values\(\)\)"),
        ({mlp([3])}, {}, "models is a set; expected a sequence of models$"),
        ([mlp([3]), 42], {}, r"models\[1\] is an int \(42\), which is not callable"),
        ([mlp([3])] * 2, dict(weights=[1.0]), "weights has length 1; expected len.models. = 2"),
        ([mlp([3])] * 2, dict(weights=torch.ones(2, 1)), r"weights has shape \(2, 1\)"),
        ([mlp([3])] * 2, dict(weights=[1.0, "a"]), r"weights\[1\] is 'a' \(str\)"),
        ([mlp([3])] * 2, dict(weights=0.5), "weights is a float"),
        ([mlp([3])] * 2, dict(weights=np.ones((2, 1))), r"numpy array of shape \(2, 1\)"),
        ([mlp([3])] * 2, dict(weights=np.array([True, False])), r"weights\[0\] is True"),
        ([mlp([3])], dict(n_jobs=0), "sum_models: invalid n_jobs=0"),
        ([mlp([3])], dict(n_jobs="2"), "invalid n_jobs='2'"),
        ([mlp([3])], dict(n_jobs=True), "invalid n_jobs=True"),
        ([mlp([3])], dict(engine="fast"), "invalid engine='fast'; expected one of 'auto'"),
        ([mlp([3])], dict(chunk_size=0), "invalid chunk_size=0"),
        ([mlp([3])], dict(chunk_size=1.5), "invalid chunk_size=1.5"),
    ],
)
def test_bad_arguments(models, kwargs, match):
    with pytest.raises(parsum.ParsumError, match=match):
        parsum.sum_models(models, torch.randn(2, IN), **kwargs)


class Returns(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(IN, OUT)

    def forward(self, x):
        return self.fn(self.lin(x))


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (
            lambda y: y[:, :2],
            r"model 4 \(Returns\) returned output leaf 0 with shape \(2, 2\), "
            r"model 0 with shape \(2, 3\)",
        ),
        (lambda y: y.double(), "model 4 .Returns. returned output leaf 0 with dtype torch.float64"),
        (lambda y: (y, y), "model 4 .Returns. returned an output of structure"),
        (lambda y: 3.0, r"model 4 \(Returns\) returned a float as output leaf 0"),
        (lambda y: None, r"model 4 \(Returns\) returned a NoneType as output leaf 0"),
        (lambda y: (), r"model 4 \(Returns\) returned no tensor \(tuple\)"),
        # A raw RuntimeError from parsum's sum before ("COO only supports memory format")
        (lambda y: y.to_sparse(), r"model 4 \(Returns\) returned a torch.sparse_coo tensor"),
        # A raw RuntimeError before ("NestedTensorImpl doesn't support sizes")
        (
            lambda y: torch.nested.nested_tensor(list(y)),
            r"model 4 \(Returns\) returned a nested tensor \(torch.nested, layout "
            r"torch.strided\) as output leaf 0",
        ),
        (
            lambda y: torch.nested.nested_tensor(list(y), layout=torch.jagged),
            r"model 4 \(Returns\) returned a nested tensor \(torch.nested, layout "
            r"torch.jagged\) as output leaf 0",
        ),
    ],
)
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("chunk_size", [2, 3])  # model 4 first in its chunk, or second
def test_outputs_that_differ_name_the_first_model(n_jobs, bad, match, chunk_size):
    models = [Returns(lambda y: y) for _ in range(4)] + [Returns(bad) for _ in range(3)]
    with pytest.raises(parsum.ParsumError, match=match):
        parsum.sum_models(models, torch.randn(2, IN), n_jobs=n_jobs, chunk_size=chunk_size)


@pytest.mark.parametrize("n_jobs", [None, 1, 2])
@pytest.mark.parametrize(
    ("good", "bad", "match"),
    [
        (
            lambda y: y.double(),
            lambda y: y,
            "with dtype torch.float32, model 0 with dtype torch.float64",
        ),
        (
            lambda y: y.repeat(1, 40_000),
            lambda y: y,
            r"with shape \(2, 3\), model 0 with shape \(2, 120000\)",
        ),
    ],
)
def test_outputs_summed_at_once_after_ones_that_are_not_are_named(n_jobs, good, bad, match):
    # Model 0's outputs too wide to be summed at once (float64 has no wider type; 120K
    # elements), model 4's narrow enough: at one thread, model 4's chunk was handed over as
    # chunk 0 and checked as chunk 0, its outputs added to model 0's (float32 to float64, or
    # broadcast) where n_jobs=2 raised.
    models = [Returns(good) for _ in range(4)] + [Returns(bad) for _ in range(3)]
    with pytest.raises(
        parsum.ParsumError, match=f"model 4 \\(Returns\\) returned output leaf 0 {match}"
    ):
        parsum.sum_models(models, torch.randn(2, IN), n_jobs=n_jobs, chunk_size=2)


class RunningMean(nn.Module):
    """Updates and returns a buffer (or a copy of it)."""

    def __init__(self, copy=False):
        super().__init__()
        self.copy = copy
        self.register_buffer("mean", torch.zeros(2, OUT))

    def forward(self, x):
        self.mean.mul_(0.5).add_(x[:, :OUT])
        return self.mean.clone() if self.copy else self.mean


def _writes_after(case):
    if case == "a view of the argument, model 1":
        return [mlp([4]), ReturnsItsArgument(), HalvesItsArgument()], 1, "ReturnsItsArgument"
    if case == "view of the argument":
        return [ReturnsItsArgument(), HalvesItsArgument()], 0, "ReturnsItsArgument"
    if case == "a buffer, the module listed twice":
        mean = RunningMean()
        return [mlp([4]), mean, mean], 1, "RunningMean"
    if case == "an argument to inplace ReLUs":
        first = [nn.Sequential(ReturnsItsArgument()) for _ in range(8)]
        return [*first, nn.Sequential(nn.ReLU(inplace=True), nn.Linear(IN, OUT))], 0, "Sequential"
    raise AssertionError(case)


@pytest.mark.parametrize("n_jobs", [None, 1, 2])
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize(
    "case",
    [
        "a view of the argument, model 1",
        "view of the argument",
        "a buffer, the module listed twice",
        "an argument to inplace ReLUs",
    ],
)
def test_an_output_that_a_later_forward_writes_in_place_is_named(case, grad, n_jobs):
    # The plain loop adds each output as it comes; parsum summed the output's later value:
    # off by the change, silently (NOTE [ Outputs written before they are summed ]).
    models, bad, kind = _writes_after(case)
    x = torch.randn(2, IN)
    with (
        torch.set_grad_enabled(grad),
        pytest.raises(
            parsum.ParsumError,
            match=rf"model {bad} \({kind}\) returned a tensor that a forward run after it wrote in "
            r"place before parsum summed it .* Return a copy \(out.clone\(\)\)",
        ),
    ):
        parsum.sum_models(models, x, n_jobs=n_jobs)
    assert all(p.grad is None for m in models for p in m.parameters())


@pytest.mark.parametrize("n_jobs", [None, 1, 2])
def test_outputs_copied_or_written_before_they_return_sum_as_in_the_plain_loop(n_jobs):
    mean, ref_mean = RunningMean(copy=True), RunningMean(copy=True)
    models = [HalvesItsArgument(), ReturnsItsArgument(copy=True), mean, mean, HalvesItsArgument()]
    refs = [copy.deepcopy(m) for m in models[:2]] + [ref_mean, ref_mean, copy.deepcopy(models[4])]
    x = torch.randn(2, IN)
    x_ref = x.clone()
    y = parsum.sum_models(models, x, n_jobs=n_jobs)
    torch.testing.assert_close(y, plain_sum(refs, x_ref))
    torch.testing.assert_close(x, x_ref)
    torch.testing.assert_close(mean.mean, ref_mean.mean)


class ReturnsAnInferenceTensor(nn.Module):
    def __init__(self):
        super().__init__()
        with torch.inference_mode():
            self.constant = torch.randn(2, OUT)

    def forward(self, x):
        return self.constant


@pytest.mark.parametrize("n_jobs", [None, 1, 2])
def test_an_inference_tensor_returned_outside_inference_mode_is_summed(n_jobs):
    # It keeps no version counter to read: the sum as the plain loop's, nothing raised.
    models = [mlp([4]), ReturnsAnInferenceTensor(), mlp([4])]
    x = torch.randn(2, IN)
    y = parsum.sum_models(models, x, n_jobs=n_jobs)
    torch.testing.assert_close(y, plain_sum(models, x))
    y.sum().backward()
    assert all(p.grad is not None for p in models[0].parameters())


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
@pytest.mark.parametrize(
    ("call", "which"),
    [
        (lambda models, nt: parsum.sum_models(models, nt), "argument 0"),
        (lambda models, nt: parsum.sum_models(models, x=nt), "keyword argument 'x'"),
        (lambda models, nt: parsum.sum_models(models, [nt]), "an argument"),
    ],
)
def test_a_nested_tensor_argument_is_refused_before_any_model_runs(layout, call, which):
    # Before, a raw RuntimeError from the plan's cost estimate ("NestedTensorImpl doesn't
    # support sizes"), or a model's backward failing on the jagged layout.
    calls = []
    models = [Returns(lambda y: calls.append(1) or y) for _ in range(3)]
    nt = torch.nested.nested_tensor(
        [torch.randn(2, IN), torch.randn(3, IN)], layout=layout, requires_grad=True
    )
    with pytest.raises(
        parsum.ParsumError,
        match=rf"sum_models: {which} is a nested tensor \(torch.nested, layout {layout}, 2 "
        r"components\); .* nt.to_padded_tensor\(0.0\)",
    ):
        call(models, nt)
    assert not calls and nt.grad is None


@pytest.mark.parametrize("n_jobs", [1, 2, 3])
def test_model_raising_in_forward(n_jobs):
    models = zoo()
    models[3] = Boom()
    before = [p.detach().clone() for m in models for p in m.parameters()]
    x = torch.randn(2, IN, requires_grad=True)
    with pytest.raises(
        parsum.ParsumError,
        match=r"model 3 \(Boom\) raised ValueError in "
        r"forward: boom in forward",
    ) as info:
        parsum.sum_models(models, x, n_jobs=n_jobs, chunk_size=1)
    assert isinstance(info.value.__cause__, ValueError)
    assert x.grad is None and all(p.grad is None for m in models for p in m.parameters())
    assert all(
        torch.equal(a, p) for a, p in zip(before, (p for m in models for p in m.parameters()))
    )
    # the pool stays usable
    y = parsum.sum_models(zoo(), x, n_jobs=n_jobs)
    assert y.shape == (2, OUT)


def _boom_function(x):
    raise ValueError("boom in forward")


_WRAPS = {
    "bound method": (lambda m: m.forward, "{}.forward"),
    "partial": (functools.partial, "partial of {}"),
    "partial of a method": (lambda m: functools.partial(m.forward), "partial of {}.forward"),
}


@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("wrap", list(_WRAPS))
def test_a_method_or_partial_is_named_by_what_it_calls(wrap, phase):
    # Named by its type alone, a bound method read "(method)", a partial "(partial)".
    failing = Boom() if phase == "forward" else BoomBackward()
    make, name = _WRAPS[wrap]
    models = [mlp([3]), make(failing)]
    named = re.escape(f"model 1 ({name.format(type(failing).__name__)}) raised ValueError")
    with pytest.raises(parsum.ParsumError, match=rf"{named} in {phase}"):
        parsum.sum_models(models, torch.randn(2, IN)).sum().backward()


def test_a_function_is_named_by_its_name():
    with pytest.raises(
        parsum.ParsumError, match=r"model 1 \(function _boom_function\) raised ValueError"
    ):
        parsum.sum_models([mlp([3]), _boom_function], torch.randn(2, IN))


def test_first_failing_model_is_reported():
    models = [mlp([3]), Boom(), mlp([3]), Boom(), Boom()]
    for n_jobs in (1, 2, 3):
        with pytest.raises(parsum.ParsumError, match=r"model 1 \(Boom\)"):
            parsum.sum_models(models, torch.randn(2, IN), n_jobs=n_jobs, chunk_size=1)


class WideBoom(nn.Module):
    """Costlier by the estimate than the other models here: claimed first."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(IN, 300)

    def forward(self, x):
        raise ValueError("wide boom in forward")


@pytest.mark.parametrize("n_jobs", [1, 2, 3])
def test_first_failing_model_is_reported_when_the_costliest_start_first(n_jobs):
    # NOTE [ Costliest chunks first ]: the wide ones are claimed (and fail) first; the chunks
    # before them still run, so model 1 is named, as a run in model order names it.
    models = [mlp([3]), Boom(), mlp([3]), WideBoom(), WideBoom()]
    x = torch.randn(2, IN)
    with pytest.raises(parsum.ParsumError, match=r"model 1 \(Boom\)"):
        parsum.sum_models(models, x, n_jobs=n_jobs, chunk_size=1)
    models[1] = mlp([3])
    with pytest.raises(parsum.ParsumError, match=r"model 3 \(WideBoom\)"):
        parsum.sum_models(models, x, n_jobs=n_jobs, chunk_size=1)


@pytest.mark.parametrize("costliest_first", [False, True])
@pytest.mark.parametrize("n_jobs", [1, 2])
def test_model_raising_in_backward_changes_no_grad(monkeypatch, n_jobs, costliest_first):
    if not costliest_first:  # chunk order, as a backward with step_in_backward claims them
        monkeypatch.setattr(parsum._api, "costliest_first", lambda *args: None)
    models = zoo()
    models.insert(5, BoomBackward())
    x = torch.randn(2, IN, requires_grad=True)
    y = parsum.sum_models(models, x, n_jobs=n_jobs, chunk_size=1)
    with pytest.raises(
        parsum.ParsumError,
        match=r"model 5 \(BoomBackward\) raised ValueError "
        r"in backward: boom in backward",
    ) as info:
        y.sum().backward()
    assert isinstance(info.value.__cause__, ValueError)
    assert x.grad is None
    assert all(g is None for g in param_grads(models))
    y2 = parsum.sum_models(zoo(), x, n_jobs=n_jobs)
    y2.sum().backward()
    assert x.grad is not None


class Unprintable(Exception):
    """An exception whose ``str()`` raises."""

    def __str__(self):
        raise ValueError("no message")


class _UnprintableInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise Unprintable()


class RaisesUnprintable(nn.Module):
    def __init__(self, phase):
        super().__init__()
        self.lin, self.phase = nn.Linear(IN, OUT), phase

    def forward(self, x):
        if self.phase == "forward":
            raise Unprintable()
        if self.phase == "backward":
            return _UnprintableInBackward.apply(self.lin(x))
        return self.lin(x)


@pytest.mark.parametrize("callers_graph", [True, False])
@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("phase", ["forward", "backward", "its optimizer step"])
def test_an_exception_that_cannot_say_itself_is_named_and_chained(
    phase, n_jobs, callers_graph, monkeypatch
):
    # Its message was formatted with str(): the ValueError that raised replaced it, unchained,
    # the model unnamed.
    models = [mlp([4]), RaisesUnprintable(phase), mlp([5])]
    kwargs = {}
    if phase == "its optimizer step":

        class Broken(torch.optim.SGD):
            def step(self, closure=None):
                if self.param_groups[0]["params"][0] is models[1].lin.weight:
                    raise Unprintable()
                return super().step(closure)

        kwargs["step_in_backward"] = parsum.StepInBackward(models, Broken, lr=0.1)
    elif not callers_graph:
        monkeypatch.setattr(parsum._api, "fits_callers_graph", lambda *a: False)
    with pytest.raises(parsum.ParsumError) as info:
        parsum.sum_models(models, torch.randn(2, IN), n_jobs=n_jobs, **kwargs).sum().backward()
    message = info.value.args[0]
    assert f"model 1 (RaisesUnprintable) raised Unprintable in {phase}" in message
    assert "<Unprintable whose str() raised>" in message
    assert isinstance(info.value.__cause__, Unprintable)
    assert all(g is None for g in param_grads(models))


def test_failed_forward_restores_batchnorm_buffers():
    models = [
        nn.Sequential(nn.Linear(IN, 5), nn.BatchNorm1d(5), nn.Linear(5, OUT)) for _ in range(5)
    ]
    models.append(Boom())
    before = [b.clone() for m in models for b in m.buffers()]
    with pytest.raises(parsum.ParsumError, match="model 5"):
        parsum.sum_models(models, torch.randn(8, IN), n_jobs=2, chunk_size=1)
    after = [b for m in models for b in m.buffers()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


class CountsCalls(nn.Module):
    """Updates a buffer of its own in forward, as a custom statistic would."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(IN, OUT)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.lin(x)


def test_failed_forward_keeps_custom_buffer_updates_as_the_plain_loop():
    # Only normalization layers' running statistics are copied and restored; copying every
    # buffer on every call would cost more than the step for a large constant buffer.
    models = [nn.Sequential(nn.Linear(IN, 5), nn.BatchNorm1d(5), nn.Linear(5, OUT)), CountsCalls()]
    models.append(Boom())
    stats = [b.clone() for b in models[0].buffers()]
    with pytest.raises(parsum.ParsumError, match="model 2"):
        parsum.sum_models(models, torch.randn(8, IN), n_jobs=1)
    assert all(torch.equal(a, b) for a, b in zip(stats, models[0].buffers()))
    assert models[1].calls.item() == 1  # what `sum(m(x) for m in models)` leaves too
    with pytest.raises(ValueError, match="boom"):
        sum(m(torch.randn(8, IN)) for m in models)
    assert models[1].calls.item() == 2


@pytest.mark.parametrize("engine", ["auto", "autograd", "stacked"])
def test_lazy_model_not_yet_initialized_is_named(engine):
    # parsum needs every parameter's shape before the forwards run (to plan and to pass the
    # parameters to its autograd Function), as DistributedDataParallel does.
    def models():
        torch.manual_seed(0)
        return [mlp([6]), nn.Sequential(nn.Linear(IN, 5), nn.Tanh(), nn.LazyLinear(OUT))]

    lazy = models()
    x = torch.randn(8, IN)
    with pytest.raises(
        parsum.ParsumError,
        match=r"models\[1\] \(Sequential\) has lazy parameters .* submodule '2' \(LazyLinear\)",
    ):
        parsum.sum_models(lazy, x, engine=engine)
    assert all(g is None for g in param_grads(lazy))
    with pytest.raises(parsum.ParsumError, match=r"in the model itself \(LazyLinear\)"):
        parsum.sum_models([nn.LazyLinear(OUT)], x, engine=engine)

    with torch.no_grad():  # what the message asks for: one call initializes the shapes
        lazy[1](x)
    plain = clone_models(lazy)
    parsum.sum_models(lazy, x, engine=engine).square().sum().backward()
    sum(m(x) for m in plain).square().sum().backward()
    for got, want in zip(param_grads(lazy), param_grads(plain)):
        torch.testing.assert_close(got, want)


def test_a_step_in_backward_over_a_lazy_model_not_yet_initialized_names_it():
    # It raised torch's ValueError from registering its gradient check on the parameter.
    lazy = [mlp([6]), nn.Sequential(nn.Linear(IN, 5), nn.Tanh(), nn.LazyLinear(OUT))]
    with pytest.raises(
        parsum.ParsumError,
        match=r"StepInBackward: parameter '2\.weight' of models\[1\] \(Sequential\) is a "
        r"lazy parameter that is not initialized yet",
    ):
        parsum.StepInBackward(lazy, torch.optim.SGD, lr=0.1)
    x = torch.randn(8, IN)
    with torch.no_grad():  # what the message asks for
        lazy[1](x)
    plain = clone_models(lazy)
    sib = parsum.StepInBackward(lazy, torch.optim.SGD, lr=0.1)
    parsum.sum_models(lazy, x, step_in_backward=sib).square().sum().backward()
    sum(m(x) for m in plain).square().sum().backward()
    torch.optim.SGD([p for m in plain for p in m.parameters()], lr=0.1).step()
    for got, want in zip(
        [p for m in lazy for p in m.parameters()], [p for m in plain for p in m.parameters()]
    ):
        torch.testing.assert_close(got, want)


class MakesItsHead(nn.Module):
    """Makes a layer in its first forward, as a lazy layer of the user's would."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(IN, 5)

    def forward(self, x):
        if not hasattr(self, "head"):
            self.head = nn.Linear(5, OUT)
            with torch.no_grad():  # the same values in every copy, made whenever it runs
                self.head.weight.copy_(torch.linspace(-1, 1, 5 * OUT).view(OUT, 5))
                self.head.bias.fill_(0.1)
        return self.head(torch.tanh(self.body(x)))


def _makes_heads():
    torch.manual_seed(0)
    return [MakesItsHead(), mlp([6]), MakesItsHead()]


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_parameters_made_in_forward_get_their_gradient_or_the_call_raises(n_jobs, monkeypatch):
    # NOTE [ Parameters made in forward ]: where the backward captures gradients for the
    # parameters planned before the forwards, the new ones got none, silently.
    x = torch.randn(8, IN)
    # Accumulating into every leaf (every .grad None, no hooks): as the plain loop.
    models, plain = _makes_heads(), _makes_heads()
    parsum.sum_models(models, x, n_jobs=n_jobs).square().sum().backward()
    sum(m(x) for m in plain).square().sum().backward()
    assert len(param_grads(models)) == len(param_grads(plain)) == 12  # the heads included
    for got, want in zip(param_grads(models), param_grads(plain)):
        torch.testing.assert_close(got, want)

    # Capturing, in the caller's graph (a .grad is set): raises in backward, writing nothing.
    models = _makes_heads()
    models[1][0].weight.grad = torch.ones_like(models[1][0].weight)
    y = parsum.sum_models(models, x, n_jobs=n_jobs)
    with pytest.raises(parsum.ParsumError, match=r"model 0 \(MakesItsHead\) made parameters in "
                       r"its forward \(head.weight, head.bias\)"):  # fmt: skip
        y.square().sum().backward()
    assert torch.equal(models[1][0].weight.grad, torch.ones_like(models[1][0].weight))
    assert all(p.grad is None for m in (models[0], models[2]) for p in m.parameters())

    # A parameter with a tensor hook, whose gradient is returned to autograd: the same.
    models = _makes_heads()
    models[1][0].weight.register_hook(lambda g: g * 2)
    y = parsum.sum_models(models, x, n_jobs=n_jobs)
    with pytest.raises(parsum.ParsumError, match=r"model 0 \(MakesItsHead\) made parameters"):
        y.square().sum().backward()
    assert all(p.grad is None for m in models for p in m.parameters())

    # Through ParallelSum: raises in forward.
    monkeypatch.setattr(parsum._api, "fits_callers_graph", lambda *a: False)
    models = _makes_heads()
    models[1][0].weight.register_hook(lambda g: g * 2)
    with pytest.raises(parsum.ParsumError, match=r"model 0 \(MakesItsHead\) made parameters"):
        parsum.sum_models(models, x, n_jobs=n_jobs)
    # The heads exist now; the next call trains them, as the message says.
    plain = _makes_heads()
    plain[1][0].weight.register_hook(lambda g: g * 2)
    for m in plain:
        m(x)
    parsum.sum_models(models, x, n_jobs=n_jobs).square().sum().backward()
    sum(m(x) for m in plain).square().sum().backward()
    for got, want in zip(param_grads(models), param_grads(plain)):
        torch.testing.assert_close(got, want)
    # Without grad nothing is differentiated: no error.
    with torch.no_grad():
        parsum.sum_models(_makes_heads(), x, n_jobs=n_jobs)


@pytest.mark.parametrize("dual", ["argument", "weights", "parameter"])
def test_forward_mode_tangents_are_carried(dual):
    # NOTE [ Forward-mode AD ] in parsum._api: the result came back without a tangent, then
    # the call was refused; now it runs as inside a torch.func transform, carrying them.
    torch.manual_seed(0)
    models = [mlp([4]) for _ in range(3)]
    x, weights = torch.randn(3, IN), torch.tensor([0.5, -1.0, 2.0])
    tangent = torch.randn_like(x if dual == "argument" else weights)
    if dual == "parameter":
        tangent = torch.randn(4, IN)
        weight = models[1][0].weight.detach().clone()
        del models[1][0].weight
    results = []
    for total in (parsum.sum_models, plain_sum, parsum.SumOfModels):
        with fwAD.dual_level():
            xd, wd = x, weights
            if dual == "argument":
                xd = fwAD.make_dual(x, tangent)
            elif dual == "weights":
                wd = fwAD.make_dual(weights, tangent)
            else:
                models[1][0].weight = fwAD.make_dual(weight, tangent)
            if total is parsum.SumOfModels:
                y = total(models, weights=wd)(xd)
            else:
                y = total(models, xd, weights=wd)
            primal, tangent_out = fwAD.unpack_dual(y)
            assert tangent_out is not None
            results.append((primal.clone(), tangent_out.clone()))
    for got in (results[0], results[2]):
        torch.testing.assert_close(got[0], results[1][0])
        torch.testing.assert_close(got[1], results[1][1])
    assert all(g is None for g in param_grads(models))


def test_an_open_dual_level_without_tangents_sums_as_usual():
    models = [mlp([4]) for _ in range(3)]
    plain = clone_models(models)
    x = torch.randn(3, IN)
    with fwAD.dual_level():
        y = parsum.sum_models(models, x)
    y.pow(2).sum().backward()
    plain_sum(plain, x).pow(2).sum().backward()
    for got, want in zip(param_grads(models), param_grads(plain)):
        torch.testing.assert_close(got, want)


def test_vjp_engine_refuses_buffer_updates_with_a_hint():
    models = [nn.Sequential(nn.Linear(IN, 5), nn.BatchNorm1d(5), nn.Linear(5, OUT))]
    x = torch.randn(8, IN, requires_grad=True)
    with pytest.raises(parsum.ParsumError, match=r"model 0 \(Sequential\).*use engine='autograd'"):
        parsum.sum_models(models, x, engine="vjp")
    parsum.sum_models(models, x, engine="auto").sum().backward()  # auto picks autograd
    assert x.grad is not None


def test_double_backward_raises_instead_of_dropping_second_order_terms():
    # A gradient penalty: torch's once_differentiable would return the first-order gradient
    # as a constant here (the incoming gradient does not require grad), and the penalty's
    # backward would drop sum_models' second-order term without a word.
    torch.manual_seed(0)
    models = [mlp([4]) for _ in range(2)]
    x = torch.randn(3, IN, requires_grad=True)
    # (engine="vjp": the models run through ParallelSum, whose gradients are not graphs; in
    # the caller's graph a second backward runs: tests/test_double_backward.py)
    loss = parsum.sum_models(models, x, engine="vjp").pow(2).sum() + x.pow(3).sum()
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    x_ref = x.detach().clone().requires_grad_()
    loss_ref = plain_sum(clone_models(models), x_ref).pow(2).sum() + x_ref.pow(3).sum()
    (g_ref,) = torch.autograd.grad(loss_ref, x_ref, create_graph=True)
    torch.testing.assert_close(g, g_ref)  # the first-order gradient is right
    with pytest.raises(RuntimeError, match="sum_models' backward is not differentiable"):
        g.pow(2).sum().backward()


def test_second_backward_without_retain_graph():
    models = zoo()
    x = torch.randn(2, IN, requires_grad=True)
    y = parsum.sum_models(models, x, n_jobs=2)
    y.sum().backward()
    with pytest.raises(RuntimeError, match="second time"):
        y.sum().backward()


def test_retain_graph_allows_a_second_backward():
    models = zoo()
    ref = clone_models(models)
    x = torch.randn(2, IN, requires_grad=True)
    y = parsum.sum_models(models, x, n_jobs=2)
    y.sum().backward(retain_graph=True)
    y.pow(2).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    y2 = sum(m(x2) for m in ref)
    y2.sum().backward(retain_graph=True)
    y2.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    for a, b in zip(param_grads(models), param_grads(ref)):
        torch.testing.assert_close(a, b)


def test_config_rejects_bad_values_and_changes_nothing():
    with (
        pytest.raises(parsum.ParsumError, match=r"parsum.config: invalid engine='x'"),
        parsum.config(engine="x"),
    ):
        pass
    with (
        pytest.raises(parsum.ParsumError, match=r"parsum.config: invalid n_jobs=0"),
        parsum.config(n_jobs=0),
    ):
        pass
    assert parsum._config.current_settings() == parsum._config._Settings()


class ExitsWhenTold(nn.Module):
    """Raises SystemExit in forward or backward once ``exit`` names it, noting the threads it
    ran in there."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(IN, OUT)
        self.exit: str | None = None
        self.threads: list[str] = []
        self.record = thread_recorder(self.threads, 0.01)

    def pulled_back_in(self, thread: str) -> None:
        self.threads.append(thread)
        if self.exit == "backward":
            raise SystemExit(3)

    def forward(self, x):
        if self.exit == "forward":
            self.record()
            raise SystemExit(3)
        return SlowBackward.apply(self.lin(x), self.pulled_back_in)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_system_exit_in_a_model_reaches_the_caller_as_itself(where, cores, monkeypatch):
    # SystemExit is no Exception: it must not be named and wrapped as a model's failure, nor
    # end the helper thread a pullback ran it in; the call changes no .grad.
    cores(2)
    models = [*(mlp([4 + i]) for i in range(3)), ExitsWhenTold()]
    # Through ParallelSum, whose pullbacks run chunk by chunk on the pool (small models in the
    # caller's graph are pulled back in the calling thread).
    monkeypatch.setattr(parsum._api, "fits_callers_graph", lambda *a: False)
    x = torch.randn(3, IN)
    caller = threading.current_thread().name
    in_a_helper = False
    for _ in range(300):  # until the last model runs in a helper (rarer without the GIL)
        models[-1].exit = None
        parsum.sum_models(models, x, n_jobs=2, chunk_size=1).sum().backward()
        for m in models:
            m.zero_grad(set_to_none=True)
        models[-1].threads.clear()
        models[-1].exit = where
        with pytest.raises(SystemExit) as exited:
            parsum.sum_models(models, x, n_jobs=2, chunk_size=1).sum().backward()
        assert exited.value.code == 3
        assert all(g is None for g in param_grads(models))
        if set(models[-1].threads) - {caller}:
            in_a_helper = True
            break
    assert in_a_helper
    models[-1].exit = None
    for _ in range(3):  # the pool still serves calls
        y = parsum.sum_models(models, x, n_jobs=2, chunk_size=1)
        torch.testing.assert_close(y, plain_sum(models, x))
        y.sum().backward()
