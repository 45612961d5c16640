"""SumOfModels against sum_models and the plain loop, as a module users save, move and train."""

import copy
import io
import subprocess
import sys

import pytest
import torch
from torch import nn

import parsum
from tests.zoo import IN, OUT, clone_models, param_grads, plain_sum, zoo

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("weights", [None, [0.5, 1.0, 1.5, 2.0, 0.25, 0.75, 1.25]])
def test_forward_and_backward_match_sum_models_and_the_plain_loop(weights):
    models = zoo()
    ref = clone_models(models)
    ensemble = parsum.SumOfModels(models, weights=weights, n_jobs=2)
    x = torch.randn(5, IN, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y = ensemble(x)
    y_ref = plain_sum(ref, x_ref, weights=weights)
    torch.testing.assert_close(y, y_ref)
    assert torch.equal(y, parsum.sum_models(models, x, weights=weights, n_jobs=2))
    y.pow(2).sum().backward()
    y_ref.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    for a, b in zip(param_grads(models), param_grads(ref)):
        torch.testing.assert_close(a, b)


def test_trainable_weights_are_a_parameter_and_get_their_gradient():
    models = zoo()
    ref = clone_models(models)
    w = nn.Parameter(torch.linspace(0.5, 1.5, len(models)))
    w_ref = w.detach().clone().requires_grad_()
    ensemble = parsum.SumOfModels(models, weights=w)
    assert any(p is w for p in ensemble.parameters())
    x = torch.randn(4, IN)
    ensemble(x).pow(2).sum().backward()
    plain_sum(ref, x, weights=w_ref).pow(2).sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad)


def picklable_zoo(seed=0):
    return [m for i, m in enumerate(zoo(seed=seed)) if i != 4]  # 4: parametrized, not picklable


def test_state_dict_round_trip_and_save_load():
    torch.manual_seed(0)
    ensemble = parsum.SumOfModels(picklable_zoo(), weights=[1.0] * 6)
    other = parsum.SumOfModels(picklable_zoo(seed=1), weights=[2.0] * 6)
    other.load_state_dict(ensemble.state_dict())
    x = torch.randn(3, IN)
    assert torch.equal(other(x), ensemble(x))
    buffer = io.BytesIO()
    torch.save(ensemble, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(x), ensemble(x))
    assert torch.equal(copy.deepcopy(ensemble)(x), ensemble(x))


def test_to_dtype_train_eval_and_repr():
    ensemble = parsum.SumOfModels(
        [nn.Sequential(nn.Linear(IN, 8), nn.BatchNorm1d(8), nn.Linear(8, OUT)) for _ in range(3)],
        weights=[1.0, 2.0, 3.0],
        chunk_size=1,
    )
    ensemble.double()
    assert ensemble.weights.dtype == torch.float64
    assert all(p.dtype == torch.float64 for p in ensemble.parameters())
    x = torch.randn(6, IN, dtype=torch.float64)
    assert ensemble(x).dtype == torch.float64
    ensemble.eval()
    assert not any(m.training for m in ensemble.modules())
    stats = ensemble.members[0][1].running_mean.clone()
    ensemble(x)
    assert torch.equal(ensemble.members[0][1].running_mean, stats)  # eval: no update
    ensemble.train()
    assert all(m.training for m in ensemble.modules())
    text = repr(ensemble)
    assert text.startswith("SumOfModels(\n  3 members, weights buffer, engine='auto', chunk_size=1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float_weights_keep_their_precision(dtype):
    # Kept as a float32 buffer, the weights were rounded, and float64 members summed with the
    # rounded ones (found by tests/test_differential.py): now float64, and float32 members give
    # the bits of sum_models with the floats themselves.
    torch.manual_seed(0)
    members = [m.to(dtype) for m in zoo()[:3]]
    weights = [0.1, 0.7123456789, -1.3]
    x = torch.randn(6, IN, dtype=dtype)
    got = parsum.SumOfModels(members, weights=weights)(x)
    assert torch.equal(got, parsum.sum_models(members, x, weights=weights))
    if dtype == torch.float64:
        torch.testing.assert_close(got, plain_sum(members, x, weights=weights), rtol=1e-13, atol=0)


def test_bad_arguments_name_what_is_wrong():
    with pytest.raises(parsum.ParsumError, match=r"SumOfModels: models\[1\] is a function"):
        parsum.SumOfModels([nn.Linear(IN, OUT), lambda x: x])
    with pytest.raises(parsum.ParsumError, match=r"weights has shape \(3,\); expected one"):
        parsum.SumOfModels([nn.Linear(IN, OUT)] * 2, weights=[1.0, 2.0, 3.0])
    for weights in ("ab", {}, [None, None], object()):  # torch.as_tensor's TypeErrors
        with pytest.raises(parsum.ParsumError, match=r"SumOfModels: weights is .*; expected None"):
            parsum.SumOfModels([nn.Linear(IN, OUT)] * 2, weights=weights)
    with pytest.raises(parsum.ParsumError, match=r"SumOfModels: invalid engine='fast'"):
        parsum.SumOfModels([nn.Linear(IN, OUT)], engine="fast")


def test_a_standard_training_loop_matches_the_plain_one():
    torch.manual_seed(0)
    models = zoo()
    ref = clone_models(models)
    ensemble = parsum.SumOfModels(models)
    opt = torch.optim.Adam(ensemble.parameters(), lr=1e-2)
    opt_ref = torch.optim.Adam([p for m in ref for p in m.parameters()], lr=1e-2)
    x, target = torch.randn(16, IN), torch.randn(16, OUT)
    for _ in range(5):
        opt.zero_grad()
        nn.functional.mse_loss(ensemble(x), target).backward()
        opt.step()
        opt_ref.zero_grad()
        nn.functional.mse_loss(plain_sum(ref, x), target).backward()
        opt_ref.step()
    for a, b in zip(ensemble.parameters(), (p for m in ref for p in m.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


DDP_SCRIPT = """
import socket, torch, torch.distributed as dist
from torch import nn
import parsum
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
torch.manual_seed(0)
members = [nn.Sequential(nn.Linear(6, 8 + i), nn.Tanh(), nn.Linear(8 + i, 3)) for i in range(4)]
ref = [nn.Sequential(*[type(l)(*([l.in_features, l.out_features] if hasattr(l, "in_features")
       else [])) for l in m]) for m in members]
for m, r in zip(members, ref):
    r.load_state_dict(m.state_dict())
model = nn.parallel.DistributedDataParallel(parsum.SumOfModels(members, n_jobs=2))
x = torch.randn(5, 6)
for _ in range(2):
    model.zero_grad()
    model(x).pow(2).sum().backward()
    for r in ref:
        r.zero_grad()
    sum(r(x) for r in ref).pow(2).sum().backward()
for m, r in zip(members, ref):
    for a, b in zip(m.parameters(), r.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
dist.destroy_process_group()
print("ddp ok")
"""


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_under_distributed_data_parallel():
    # DDP hooks every parameter's gradient accumulator; each must run once per backward.
    done = subprocess.run(
        [sys.executable, "-c", DDP_SCRIPT], capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ddp ok" in done.stdout


def test_torch_compile_around_it_leaves_the_sum_eager():
    # sum_models is a graph break for dynamo: the code around it compiles, the sum runs as is.
    torch.manual_seed(0)
    ensemble = parsum.SumOfModels([nn.Linear(IN, OUT), nn.Linear(IN, OUT)])
    head = nn.Linear(OUT, 1)

    def loss(x):
        return head(torch.relu(ensemble(x))).sum()

    x = torch.randn(4, IN)
    compiled = torch.compile(loss, backend="eager")
    torch.testing.assert_close(compiled(x), loss(x))
    compiled(x).backward()
    assert all(p.grad is not None for p in ensemble.parameters())


class _Encoded(nn.Module):
    """A model that holds an ensemble after a layer of its own."""

    def __init__(self, weights):
        super().__init__()
        torch.manual_seed(0)
        self.encode = nn.Linear(IN, IN)
        self.ensemble = parsum.SumOfModels(
            [m for m in zoo() if type(m) is nn.Sequential], weights=weights
        )

    def forward(self, x):
        return self.ensemble(torch.tanh(self.encode(x)))


@pytest.mark.parametrize("weights", [None, [0.5, 0.25, 2.0, 1.0, -1.0, 3.0]])
def test_torch_export_of_a_module_holding_it(weights):
    # The exported program holds the members' operations and their sum: the same values.
    model = _Encoded(weights)
    program = torch.export.export(model, (torch.randn(4, IN),))
    x = torch.randn(4, IN)
    torch.testing.assert_close(program.module()(x), model(x))


def test_torch_fx_traces_a_module_holding_it_as_a_leaf():
    # symbolic_trace runs forward on proxies, which the sum cannot take: a tracer that keeps
    # SumOfModels a leaf module, as torch.nn's layers are, traces the rest.
    class Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m, name):
            return isinstance(m, parsum.SumOfModels) or super().is_leaf_module(m, name)

    model = _Encoded(None)
    traced = torch.fx.GraphModule(model, Tracer().trace(model))
    assert any(n.op == "call_module" and n.target == "ensemble" for n in traced.graph.nodes)
    x = torch.randn(4, IN, requires_grad=True)
    torch.testing.assert_close(traced(x), model(x))
    traced(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
