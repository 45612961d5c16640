"""PyTorch's global switches around a call: deterministic algorithms, the default dtype, anomaly
mode, autograd's multithreading, mutation of saved tensors. Each call must give what the plain
loop gives under the same switch (these were tried by hand once, 2026-12-01; kept here so that
a change of parsum's cannot break them unseen)."""

import pytest
import torch
from torch import nn

import parsum
from tests.zoo import IN, OUT, clone_models, mlp, param_grads, plain_sum, zoo

pytestmark = pytest.mark.timeout(120)

N_JOBS = [1, 2, None]


def assert_like_plain(models, x, n_jobs, weights=None, **tolerances):
    """``sum_models`` and its backward against the plain loop over copies of ``models`` (whose
    ``.grad`` must be None or zero, a FlatGrad's view: a deep copy drops it): the outputs and
    the gradients of ``x``, of the parameters and of a weight tensor."""
    assert all(g is None or not g.any() for g in param_grads(models))
    twins = clone_models(models)
    x1 = x.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    w1 = w2 = weights
    if isinstance(weights, torch.Tensor):
        w1 = weights.detach().clone().requires_grad_()
        w2 = weights.detach().clone().requires_grad_()
    y = parsum.sum_models(models, x1, weights=w1, n_jobs=n_jobs)
    expected = plain_sum(twins, x2, weights=w2)
    torch.testing.assert_close(y, expected, **tolerances)
    y.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, **tolerances)
    for got, want in zip(param_grads(models), param_grads(twins), strict=True):
        assert got is not None and want is not None
        torch.testing.assert_close(got, want, **tolerances)
    if isinstance(weights, torch.Tensor):
        torch.testing.assert_close(w1.grad, w2.grad, **tolerances)


@pytest.fixture
def deterministic():
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@pytest.fixture
def default_float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


class TableReader(nn.Module):
    """Reads a few rows of a table it shares with the other models (row-sparse gradients)."""

    def __init__(self, table: nn.Parameter):
        super().__init__()
        self.table = table
        self.head = nn.Linear(4, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = parsum.take_rows(self.table, torch.tensor([1, 5, 5, 9]))
        return self.head(torch.tanh(x[:, :4] + rows.sum(0)))


@pytest.mark.parametrize("n_jobs", N_JOBS)
def test_deterministic_algorithms(deterministic, n_jobs):
    x = torch.randn(9, IN)
    assert_like_plain(zoo(), x, n_jobs, weights=torch.linspace(0.2, 1.0, 7))
    table = nn.Parameter(torch.randn(12, 4))
    assert_like_plain([TableReader(table) for _ in range(3)], x, n_jobs)
    # Identical models in stacked storage, their gradients in one FlatGrad
    stacked = [mlp([8]) for _ in range(6)]
    twins = clone_models(stacked)
    parsum.stack_(stacked)
    flat = parsum.FlatGrad(stacked)
    parsum.sum_models(stacked, x, n_jobs=n_jobs).sum().backward()
    plain_sum(twins, x).sum().backward()
    for got, want in zip(param_grads(stacked), param_grads(twins), strict=True):
        torch.testing.assert_close(got, want)
    assert flat.flat.abs().sum() > 0


@pytest.mark.parametrize("n_jobs", N_JOBS)
def test_the_default_dtype_float64(default_float64, n_jobs):
    x32 = torch.randn(9, IN, dtype=torch.float32)
    # Models made before the switch stay float32, and so do their sums, weights of Python floats
    # or a float32 tensor alike.
    assert_like_plain(zoo(torch.float32), x32, n_jobs, weights=[0.5 + 0.1 * i for i in range(7)])
    weights32 = torch.linspace(0.2, 1.0, 7, dtype=torch.float32)
    assert_like_plain(zoo(torch.float32), x32, n_jobs, weights=weights32)
    # Models made after it are float64, with a FlatGrad of their dtype
    models = [mlp([5 + i]) for i in range(5)]
    flat = parsum.FlatGrad(models)
    assert flat.flat.dtype == torch.float64
    assert_like_plain(models, torch.randn(9, IN), n_jobs, weights=[0.3] * 5)
    assert flat.flat.abs().sum() > 0
    module = parsum.SumOfModels(zoo(torch.float32), weights=[0.2] * 7)
    torch.testing.assert_close(module(x32), plain_sum(list(module.members), x32, weights=[0.2] * 7))


class NanInBackward(nn.Module):
    """Its forward is finite; its backward makes a nan (sqrt at 0 gives inf, times 0)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.sqrt(self.lin(x) * 0)


@pytest.mark.parametrize("n_jobs", N_JOBS)
def test_anomaly_mode(n_jobs):
    x = torch.randn(9, IN)
    with torch.autograd.set_detect_anomaly(True):
        assert_like_plain(zoo(), x, n_jobs, weights=[0.5] * 7)
        models = [mlp([4]), mlp([6]), NanInBackward(), mlp([5])]
        with (
            pytest.warns(UserWarning, match="Error detected in"),
            pytest.raises(RuntimeError, match="returned nan values"),  # the plain loop's
        ):
            plain_sum(clone_models(models), x).sum().backward()
        y = parsum.sum_models(models, x.clone().requires_grad_(), n_jobs=n_jobs)
        with (
            pytest.warns(UserWarning, match="Error detected in"),
            pytest.raises(parsum.ParsumError, match=r"model 2 \(NanInBackward\) raised") as failed,
        ):
            y.sum().backward()
    assert "returned nan values" in str(failed.value.__cause__)
    assert all(g is None for g in param_grads(models))  # a failed call changes no .grad


@pytest.mark.parametrize("n_jobs", N_JOBS)
def test_autograd_multithreading_disabled(n_jobs):
    x = torch.randn(9, IN)
    with torch.autograd.set_multithreading_enabled(False):
        assert_like_plain(zoo(), x, n_jobs, weights=torch.linspace(0.2, 1.0, 7))


@pytest.mark.parametrize("n_jobs", N_JOBS)
def test_mutation_on_saved_tensors_allowed(n_jobs):
    x = torch.randn(9, IN)
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        assert_like_plain(zoo(), x, n_jobs, weights=torch.linspace(0.2, 1.0, 7))
