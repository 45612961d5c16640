"""sum_models inside torch.func transforms (NOTE [ Inside a transform ] in parsum._transformed):
each against the plain sum under the same transform, and float64 where it tells accuracy."""

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, vmap

import parsum
from tests.zoo import IN, OUT, HalvesItsArgument, ReturnsItsArgument, mlp, plain_sum, zoo

TRANSFORMS = {
    "grad": lambda f: grad(lambda x: f(x).pow(2).sum()),
    "vmap": lambda f: vmap(f),
    "jacrev": lambda f: jacrev(f),
    "jacfwd": lambda f: jacfwd(f),
    "hessian": lambda f: hessian(lambda x: f(x).tanh().sum()),
    "vmap of jacrev": lambda f: vmap(jacrev(f)),
    "grad of grad": lambda f: grad(lambda x: grad(lambda y: f(y).pow(3).sum())(x).pow(2).sum()),
}


@pytest.mark.parametrize("n_jobs", [1, 2, None])
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_transforms_of_the_sum_match_those_of_the_plain_sum(name, n_jobs):
    # Refused before with a ParsumError: parsum's threads ran outside the transform.
    torch.manual_seed(0)
    models = [mlp([5]).double(), mlp([6, 4], nn.GELU).double(), mlp([3]).double()]
    models.append(nn.Sequential(nn.Linear(IN, OUT), nn.LayerNorm(OUT)).double())
    x = torch.randn(3, IN, dtype=torch.float64)
    transform = TRANSFORMS[name]
    got = transform(lambda x: parsum.sum_models(models, x, n_jobs=n_jobs))(x)
    want = transform(lambda x: plain_sum(models, x))(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert all(p.grad is None for m in models for p in m.parameters())


class _Ensemble(nn.Module):
    def __init__(self, members, weights=None):
        super().__init__()
        self.members = nn.ModuleList(members)
        self.weights = weights

    def forward(self, x, through_parsum=True):
        if through_parsum:
            return parsum.sum_models(list(self.members), x, weights=self.weights)
        return plain_sum(list(self.members), x, weights=self.weights)


@pytest.mark.parametrize("weights", [None, "floats", "tensor"])
def test_per_sample_gradients_of_an_ensemble(weights):
    # The torch.func recipe: vmap over grad of a functional_call, one gradient a sample.
    torch.manual_seed(0)
    w = {None: None, "floats": [0.5, 1.5, -1.0], "tensor": torch.tensor([0.5, 1.5, -1.0])}
    model = _Ensemble([mlp([5]), mlp([6, 4]), mlp([3])], w[weights])
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(6, IN), torch.randn(6, OUT)

    def loss(params, x, y, through_parsum):
        out = functional_call(model, params, (x[None],), {"through_parsum": through_parsum})
        return (out - y[None]).pow(2).mean()

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0, None))
    got = per_sample(params, x, y, True)
    want = per_sample(params, x, y, False)
    assert got.keys() == want.keys()
    for name in got:
        assert got[name].shape[0] == 6
        torch.testing.assert_close(got[name], want[name])


def test_the_gradient_of_a_weight_tensor_inside_a_transform():
    models = zoo()[:3]
    x = torch.randn(4, IN)
    w = torch.tensor([0.3, -1.2, 2.0])
    got = grad(lambda w: parsum.sum_models(models, x, weights=w).pow(2).sum())(w)
    want = grad(lambda w: plain_sum(models, x, weights=w).pow(2).sum())(w)
    torch.testing.assert_close(got, want)


class _Constant(nn.Module):
    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, x):
        return x * 0 + self.value


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_sum_inside_a_transform_is_compensated(dtype):
    big = 1e8 if dtype == torch.float32 else 1e16
    models = [_Constant(big), _Constant(1.0), _Constant(-big)]
    x = torch.ones(3, 1, dtype=dtype)
    got = vmap(lambda r: parsum.sum_models(models, r))(x)
    assert torch.equal(got, torch.ones_like(x))  # the plain sum gives 0
    assert torch.equal(plain_sum(models, x), torch.zeros_like(x))
    # inf and nan as in the plain sum: no nan made from the compensation of an inf
    models = [_Constant(float("inf")), _Constant(1.0), _Constant(-1.0)]
    assert torch.equal(vmap(lambda r: parsum.sum_models(models, r))(x), plain_sum(models, x))


def test_pytree_outputs_inside_a_transform():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(IN, OUT), nn.Linear(IN, 2)

        def forward(self, x):
            return {"a": self.a(x), "b": (self.b(x).tanh(),)}

    models = [Two(), Two()]
    x = torch.randn(3, IN)

    def f(total):
        return lambda x: sum(t.sum() for t in torch.utils._pytree.tree_leaves(total(x)))

    got = grad(f(lambda x: parsum.sum_models(models, x)))(x)
    want = grad(f(lambda x: plain_sum(models, x)))(x)
    torch.testing.assert_close(got, want)


def test_failures_inside_a_transform_are_named():
    class Fails(nn.Module):
        def forward(self, x):
            raise ValueError("bad input")

    x = torch.randn(3, IN)
    failing = [mlp([4]), Fails()]
    with pytest.raises(parsum.ParsumError, match=r"model 1 \(Fails\) raised ValueError") as info:
        vmap(lambda x: parsum.sum_models(failing, x))(x)
    assert isinstance(info.value.__cause__, ValueError)
    mismatched = [mlp([4]), nn.Linear(IN, OUT + 1)]
    with pytest.raises(parsum.ParsumError, match=r"model 1 \(Linear\) returned \(4,\)"):
        vmap(lambda x: parsum.sum_models(mismatched, x))(x)
    models = [mlp([4]), mlp([5])]
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
    with pytest.raises(parsum.ParsumError, match=r"step_in_backward cannot run inside"):
        vmap(lambda x: parsum.sum_models(models, x, step_in_backward=sib))(x)
    parsum.FlatGrad(models, compensated=True)
    with pytest.raises(parsum.ParsumError, match=r"FlatGrad with compensated=True"):
        vmap(lambda x: parsum.sum_models(models, x))(x)
    with pytest.raises(parsum.ParsumError, match=r"invalid n_jobs=0"):
        vmap(lambda x: parsum.sum_models(models, x, n_jobs=0))(x)


@pytest.mark.parametrize("name", ["grad", "vmap", "vmap of jacrev"])
def test_an_output_that_a_later_forward_writes_in_place_is_named_inside_a_transform(name):
    # Summed after every model ran, the view's later value was summed: off by the change,
    # silently (vmap: a batched tensor's own version stays 0; the tensor it wraps is read).
    models = [ReturnsItsArgument(), HalvesItsArgument()]
    x = torch.randn(3, IN)
    with pytest.raises(
        parsum.ParsumError, match=r"model 0 \(ReturnsItsArgument\) returned a tensor"
    ):
        TRANSFORMS[name](lambda x: parsum.sum_models(models, x.clone()))(x)
    copied = [ReturnsItsArgument(copy=True), models[1]]
    got = TRANSFORMS[name](lambda x: parsum.sum_models(copied, x.clone()))(x)
    torch.testing.assert_close(got, TRANSFORMS[name](lambda x: plain_sum(copied, x.clone()))(x))
