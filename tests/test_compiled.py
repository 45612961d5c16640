"""Models compiled with torch.compile, traced by torch.fx or exported by torch.export, and
stacked models called through a wrapper, against their plain twins (NOTE [ Compiled modules ]
in parsum._engines)."""

import copy
import functools
import shutil
import warnings

import pytest
import torch
from torch import nn

import parsum
from tests.test_errors import BoomBackward
from tests.zoo import IN, mlp, param_grads

pytestmark = [
    pytest.mark.timeout(300),
    # dynamo warns about its own settings on some versions; the results are what is checked
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

BACKEND = "eager"  # dynamo's tracing without a C++ compiler; what parsum sees is the same


def mlps(n=6, seed=0):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double() for _ in range(n)]


def assert_same_grads(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g is not None and w is not None
        torch.testing.assert_close(g, w)


def compiled(models, how="torch.compile"):
    """The models compiled by torch.compile's wrapper, or in place (``Module.compile``)."""
    if how == "torch.compile":
        return [torch.compile(m, backend=BACKEND) for m in models]
    for m in models:
        m.compile(backend=BACKEND)
    return models


HOW = ["torch.compile", "Module.compile"]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"n_jobs": 1}, {"n_jobs": 2}, {"engine": "autograd"}, {"engine": "vjp"},
     {"engine": "stacked"}],
)  # fmt: skip
def test_identical_compiled_models_sum_and_train_as_their_plain_twins(kwargs, how):
    # Six identical models: "auto" would stack plain ones (it read their training flag from
    # the module's dict, which torch.compile's wrapper lacks: KeyError), and "vjp" ran the
    # compiled code on the original parameters (wrong gradients).
    plain = mlps()
    models = copy.deepcopy(plain)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y = parsum.sum_models(compiled(models, how), x, **kwargs)
    y_ref = sum(m(x_ref) for m in plain)
    torch.testing.assert_close(y, y_ref)
    y.pow(2).sum().backward()
    y_ref.pow(2).sum().backward()
    assert_same_grads(param_grads(models), param_grads(plain))
    torch.testing.assert_close(x.grad, x_ref.grad)


@pytest.mark.parametrize("how", HOW)
def test_a_hooked_parameter_of_a_compiled_model_gets_its_gradient_and_the_model_stays_compiled(
    how,
):
    plain = mlps(3)
    models = copy.deepcopy(plain)
    seen = {"plain": 0, "parsum": 0}

    def hook(key):
        def double(g):
            seen[key] += 1
            return g * 2

        return double

    plain[0][0].weight.register_hook(hook("plain"))
    models[0][0].weight.register_hook(hook("parsum"))
    wrappers = compiled(models, how)
    # What runs the compiled code: the wrapper's forward, or the module's compiled call.
    attribute = "forward" if how == "torch.compile" else "_compiled_call_impl"
    compiled_code = [vars(w)[attribute] for w in wrappers]
    x = torch.randn(5, 4, dtype=torch.float64)
    for _ in range(2):
        for m in (*plain, *models):
            m.zero_grad()
        parsum.sum_models(wrappers, x, n_jobs=2).pow(2).sum().backward()
        sum(m(x) for m in plain).pow(2).sum().backward()
        assert_same_grads(param_grads(models), param_grads(plain))
    assert seen == {"plain": 2, "parsum": 2}
    # The shadow that read the hooked parameter through an alias ran the original module
    # uncompiled; the user's module keeps its compiled code.
    assert [vars(w)[attribute] for w in wrappers] == compiled_code


def test_a_model_holding_a_compiled_submodule():
    class Holder(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.head = nn.Linear(3, 2).double()

        def forward(self, x):
            return self.head(self.inner(x))

    plain = [Holder(m) for m in mlps(5)]
    models = copy.deepcopy(plain)
    for m in models:
        m.inner = torch.compile(m.inner, backend=BACKEND)
    x = torch.randn(5, 4, dtype=torch.float64)
    for engine in ("auto", "vjp"):
        for m in (*plain, *models):
            m.zero_grad()
        parsum.sum_models(models, x, engine=engine).pow(2).sum().backward()
        sum(m(x) for m in plain).pow(2).sum().backward()
        assert_same_grads(param_grads(models), param_grads(plain))


@pytest.mark.parametrize("how", HOW)
def test_stack_refuses_compiled_models_and_says_what_to_do(how):
    kind = "OptimizedModule" if how == "torch.compile" else "Sequential"
    with pytest.raises(parsum.ParsumError, match=rf"models\[0\] \({kind}\).*compile"):
        parsum.stack_(compiled(mlps(3), how))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x):
        return self.net(x)

    def encode(self, x):
        return self.net(x) * 2


class Holder(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) + 1


WRAPPERS = {
    "bound method": (lambda m: m.encode, lambda m, x: m.encode(x)),
    "partial": (functools.partial, lambda m, x: m(x)),
    "compiled": (lambda m: torch.compile(m, backend=BACKEND), lambda m, x: m(x)),
    "compiled in place": (lambda m: m.compile(backend=BACKEND) or m, lambda m, x: m(x)),
    "traced": (torch.fx.symbolic_trace, lambda m, x: m(x)),  # a module of its own
    "held in a module": (Holder, lambda m, x: m(x) + 1),
}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_an_optimizer_over_a_stack_trains_models_called_through_a_wrapper(wrapper):
    # Stack.parameters() promises the models' gradients after every backward; the models
    # called through a wrapper left them out (the stack never trained).
    wrap, call_plain = WRAPPERS[wrapper]
    torch.manual_seed(0)
    plain = [Encoder().double() for _ in range(6)]
    models = copy.deepcopy(plain)
    stack = parsum.stack_(models)
    callables = [wrap(m) for m in models]
    opt_plain = torch.optim.SGD([p for m in plain for p in m.parameters()], lr=1e-3)
    opt = torch.optim.SGD(stack.parameters(), lr=1e-3)
    x = torch.randn(5, 4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a stack whose models run one by one says so
        for _ in range(3):
            opt_plain.zero_grad()
            opt.zero_grad()
            sum(call_plain(m, x) for m in plain).pow(2).sum().backward()
            parsum.sum_models(callables, x).pow(2).sum().backward()
            opt_plain.step()
            opt.step()
    for a, b in zip(
        [p for m in models for p in m.parameters()], [p for m in plain for p in m.parameters()]
    ):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_step_in_backward_steps_models_called_through_a_wrapper(wrapper, stacked):
    # A StepInBackward over the models, the models passed wrapped: torch.compile's wrapper
    # raised TypeError (the model's position was looked up through its truth value, which
    # the wrapper answers with len()).
    wrap, call_plain = WRAPPERS[wrapper]
    torch.manual_seed(0)
    plain = [Encoder().double() for _ in range(5)]
    models = copy.deepcopy(plain)
    if stacked:
        parsum.stack_(models)
    step = parsum.StepInBackward(models, lambda params: torch.optim.SGD(params, lr=1e-2))
    opt_plain = torch.optim.SGD([p for m in plain for p in m.parameters()], lr=1e-2)
    callables = [wrap(m) for m in models]
    x = torch.randn(5, 4, dtype=torch.float64)
    if wrapper in ("held in a module", "traced"):  # another model, not the StepInBackward's
        with pytest.raises(parsum.ParsumError, match=r"models\[0\] \(\w+\) is not one of"):
            parsum.sum_models(callables, x, step_in_backward=step)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            opt_plain.zero_grad()
            sum(call_plain(m, x) for m in plain).pow(2).sum().backward()
            opt_plain.step()
            parsum.sum_models(callables, x, step_in_backward=step).pow(2).sum().backward()
    for a, b in zip(
        [p for m in models for p in m.parameters()], [p for m in plain for p in m.parameters()]
    ):
        torch.testing.assert_close(a, b)


TRANSFORMS = {
    "torch.fx": lambda m, x: torch.fx.symbolic_trace(m),
    "torch.export": lambda m, x: torch.export.export(m, (x,)).module(),
}


@pytest.mark.parametrize("kwargs", [{}, {"n_jobs": 2}, {"engine": "vjp"}, {"hook": True}])
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_traced_and_exported_models_sum_and_train_as_their_plain_twins(transform, kwargs):
    # A GraphModule's class is made for each instance by its __new__, which the copy of the
    # module tree that parsum runs with aliases or under functorch called: the copy had no
    # forward ("missing the required forward function"), with a hooked parameter or "vjp".
    plain = mlps()
    x = torch.randn(5, 4, dtype=torch.float64)
    models = [TRANSFORMS[transform](m, x) for m in copy.deepcopy(plain)]
    kwargs = dict(kwargs)
    if kwargs.pop("hook", False):
        seen = []
        next(models[0].parameters()).register_hook(lambda g: seen.append(1) or g * 2)
        next(plain[0].parameters()).register_hook(lambda g: g * 2)
    y = parsum.sum_models(models, x, **kwargs)
    y_ref = sum(m(x) for m in plain)
    torch.testing.assert_close(y, y_ref)
    y.pow(2).sum().backward()
    y_ref.pow(2).sum().backward()
    assert_same_grads(param_grads(models), param_grads(plain))


@pytest.mark.skipif(
    not (shutil.which("c++") or shutil.which("g++")), reason="inductor needs a C++ compiler"
)
@pytest.mark.parametrize("n_jobs", [1, 2])
def test_a_failure_after_models_compiled_by_inductor_names_its_model(n_jobs):
    # Inductor's backwards free their saved tensors as they go (donated buffers) and refuse a
    # backward that keeps the graph: the search for the failing model, which pulled each back
    # again keeping its graph, named the first compiled model with that refusal, the failing
    # model's own error lost (tests/test_callers_graph.py has the same without a compiler).
    torch.manual_seed(0)
    models = [torch.compile(mlp([8])) for _ in range(3)]
    models.insert(2, BoomBackward())
    y = parsum.sum_models(models, torch.randn(5, IN), n_jobs=n_jobs)
    with pytest.raises(parsum.ParsumError, match=r"model 2 \(BoomBackward\) raised ValueError"):
        y.pow(2).sum().backward()
    assert all(g is None for g in param_grads(models))
