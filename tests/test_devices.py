"""Every path on every device: forward and backward against the plain loop on the CPU, and on
CUDA where a GPU is (skipped without one; CI has none).

On CUDA, PyTorch runs backward on a device thread, where the default used to hang forever (NOTE
[ Device threads ] in ``_function``). A hang waits in C++, where a signal cannot interrupt it, so
every test here has a thread-method timeout: it dumps the stacks and ends the worker, and the test
fails instead of stalling the suite.
"""

import threading

import pytest
import torch
from torch import nn

import parsum
from tests.test_errors import BoomBackward
from tests.zoo import IN, OUT, clone_models, mlp, param_grads, plain_sum, zoo

pytestmark = pytest.mark.timeout(90, method="thread")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
TOL = dict(rtol=1e-4, atol=1e-5)


def _models(kind, device):
    torch.manual_seed(0)
    if kind == "identical":  # auto and stacked vmap them as one group
        models = [mlp([16]) for _ in range(8)]
    elif kind == "groups beside others":  # NOTE [ Stacked groups in the caller's graph ]
        group = [mlp([16]) for _ in range(6)]
        models = [*group[:3], *zoo()[:3], *group[3:]]
    elif kind == "shared":  # NOTE [ Parameters several models use in the caller's graph ]
        trunk = mlp([8])
        models = [
            *zoo()[:3],
            *(nn.Sequential(trunk, nn.Tanh(), nn.Linear(OUT, OUT)) for _ in range(3)),
        ]
    else:
        models = zoo()
    return [m.to(device) for m in models]


def _assert_like_plain(models, ref, x, x_ref, **kwargs):
    y = parsum.sum_models(models, x, **kwargs)
    y_ref = plain_sum(ref, x_ref, weights=kwargs.get("weights"))
    torch.testing.assert_close(y, y_ref, **TOL)
    y.pow(2).sum().backward()
    y_ref.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    for a, b in zip(param_grads(models), param_grads(ref)):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("engine", ["auto", "autograd", "vjp", "stacked"])
@pytest.mark.parametrize("n_jobs", [1, 2, 4, None])
@pytest.mark.parametrize("kind", ["identical", "zoo", "groups beside others", "shared"])
def test_forward_and_backward(device, engine, n_jobs, kind):
    models = _models(kind, device)
    ref = clone_models(models)
    x = torch.randn(5, IN, device=device, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    _assert_like_plain(models, ref, x, x_ref, engine=engine, n_jobs=n_jobs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_jobs", [1, 2])
def test_weight_tensor_gets_its_gradient(device, n_jobs):
    models = _models("identical", device)
    ref = clone_models(models)
    w = torch.linspace(0.5, 1.5, len(models), device=device, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_()
    x = torch.randn(5, IN, device=device)
    y = parsum.sum_models(models, x, weights=w, n_jobs=n_jobs)
    y_ref = plain_sum(ref, x, weights=w_ref)
    y.pow(2).sum().backward()
    y_ref.pow(2).sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad, **TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_jobs", [1, 2, None])
@pytest.mark.parametrize("kind", ["zoo", "groups beside others", "shared"])
def test_gradient_penalty(device, n_jobs, kind):
    # NOTE [ Double backward ]: on CUDA the second-order nodes run on the device's thread.
    models = _models(kind, device)
    ref = clone_models(models)
    x = torch.randn(5, IN, device=device, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    for t, y in ((x, parsum.sum_models(models, x, n_jobs=n_jobs)), (x_ref, plain_sum(ref, x_ref))):
        (g,) = torch.autograd.grad(y.sum(), t, create_graph=True)
        (y.pow(2).mean() + (g.norm(dim=1) - 1).pow(2).mean()).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    for a, b in zip(param_grads(models), param_grads(ref)):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compensated", [False, True])
def test_flatgrad(device, compensated):
    models = _models("zoo", device)
    ref = clone_models(models)
    flat = parsum.FlatGrad(models, compensated=compensated)
    x = torch.randn(5, IN, device=device)
    for _ in range(2):  # accumulated over two micro-batches
        parsum.sum_models(models, x, n_jobs=2).pow(2).sum().backward()
        plain_sum(ref, x).pow(2).sum().backward()
    for a, b in zip(param_grads(models), param_grads(ref)):
        torch.testing.assert_close(a, b, **TOL)
    assert flat.flat.device.type == device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_jobs", [1, 2, None])
@pytest.mark.parametrize("chunk_size", [None, 3])  # 3: small models step as one
@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam])
def test_step_in_backward(device, n_jobs, chunk_size, cls):
    models = _models("zoo", device)
    ref = clone_models(models)
    sib = parsum.StepInBackward(models, cls, lr=0.05)
    opt = cls([p for m in ref for p in m.parameters()], lr=0.05)
    x = torch.randn(5, IN, device=device)
    for _ in range(3):
        y = parsum.sum_models(models, x, step_in_backward=sib, n_jobs=n_jobs, chunk_size=chunk_size)
        y.pow(2).sum().backward()
        opt.zero_grad()
        plain_sum(ref, x).pow(2).sum().backward()
        opt.step()
    for m, r in zip(models, ref):
        for a, b in zip(m.parameters(), r.parameters()):
            torch.testing.assert_close(a, b, **TOL)


class _Bag(nn.Module):
    """A sampled embedding table read through take_rows, plus a dense head."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(40, OUT))
        self.head = nn.Linear(IN, OUT)

    def forward(self, x, index):
        return self.head(x) + parsum.take_rows(self.table, index)


@pytest.mark.parametrize("device", DEVICES)
def test_take_rows(device):
    torch.manual_seed(0)
    models = [_Bag().to(device) for _ in range(4)]
    ref = clone_models(models)
    x = torch.randn(5, IN, device=device)
    index = torch.tensor([3, 7, 3, 0, 39], device=device)
    parsum.sum_models(models, x, index, n_jobs=2).pow(2).sum().backward()
    sum(m.head(x) + m.table[index] for m in ref).pow(2).sum().backward()
    for m, r in zip(models, ref):
        torch.testing.assert_close(m.table.grad.to_dense(), r.table.grad, **TOL)
        torch.testing.assert_close(m.head.weight.grad, r.head.weight.grad, **TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_bfloat16(device):
    # Models whose outputs all come out in bfloat16 (each model must return one dtype).
    torch.manual_seed(0)
    models = [mlp([w]).to(device) for w in (8, 16, 24, 32)]
    ref = clone_models(models)
    x = torch.randn(5, IN, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = parsum.sum_models(models, x, n_jobs=2)
        y_ref = plain_sum(ref, x)
    assert y.dtype == y_ref.dtype
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=0.05, atol=0.05)
    y.float().pow(2).sum().backward()
    y_ref.float().pow(2).sum().backward()
    for a, b in zip(param_grads(models), param_grads(ref)):
        torch.testing.assert_close(a, b, rtol=0.1, atol=0.1)


@needs_cuda
def test_two_streams():
    # Two calls on two streams, each consumed on its own stream; the gradients add up.
    models = _models("zoo", "cuda")
    ref = clone_models(models)
    x = torch.randn(5, IN, device="cuda")
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = []
    for s in streams:
        with torch.cuda.stream(s):
            y = parsum.sum_models(models, x, n_jobs=2)
            y.pow(2).sum().backward()
            outs.append(y)
    torch.cuda.synchronize()
    y_ref = plain_sum(ref, x)
    y_ref.pow(2).sum().backward()
    for y in outs:
        torch.testing.assert_close(y, y_ref, **TOL)
    for a, b in zip(param_grads(models), param_grads(ref)):
        torch.testing.assert_close(a, 2 * b, **TOL)


class _OnCuda(nn.Module):
    """A CPU model whose output moves to the GPU."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(IN, OUT)

    def forward(self, x):
        return self.lin(x.cpu()).cuda()


@needs_cuda
@pytest.mark.parametrize("n_jobs", [1, 2, None])
def test_a_cpu_model_beside_cuda_models(n_jobs):
    models = [*_models("zoo", "cuda"), _OnCuda()]
    ref = clone_models(models)
    x = torch.randn(5, IN, device="cuda", requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    _assert_like_plain(models, ref, x, x_ref, n_jobs=n_jobs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_jobs", [1, 2, None])
def test_failed_backward_changes_nothing(device, n_jobs):
    models = [m.to(device) for m in [*_models("zoo", "cpu"), BoomBackward()]]
    x = torch.randn(5, IN, device=device)
    parsum.sum_models(models[:-1], x, n_jobs=n_jobs).sum().backward()
    before = [g.clone() for g in param_grads(models[:-1])]
    y = parsum.sum_models(models, x, n_jobs=n_jobs)
    with pytest.raises(parsum.ParsumError, match=r"BoomBackward\) raised ValueError"):
        y.sum().backward()
    for g, b in zip(param_grads(models[:-1]), before):
        assert torch.equal(g, b)


@pytest.mark.parametrize("device", DEVICES)
def test_concurrent_callers(device):
    # Two threads, each with its own models, call and pull back at once.
    sets = [_models("zoo", device) for _ in range(2)]
    refs = [clone_models(models) for models in sets]
    x = torch.randn(5, IN, device=device)
    errors = []

    def train(models):
        try:
            for _ in range(5):
                parsum.sum_models(models, x).pow(2).sum().backward()
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=train, args=(models,)) for models in sets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for models, ref in zip(sets, refs):
        for _ in range(5):
            plain_sum(ref, x).pow(2).sum().backward()
        for a, b in zip(param_grads(models), param_grads(ref)):
            torch.testing.assert_close(a, b, **TOL)


@needs_cuda
def test_repeated_calls_keep_gpu_memory_flat():
    models = _models("zoo", "cuda")
    x = torch.randn(64, IN, device="cuda")

    def step():
        parsum.sum_models(models, x).pow(2).sum().backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    for _ in range(30):
        step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == start


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_jobs", [1, 2])
def test_gradcheck_float64(device, n_jobs):
    torch.manual_seed(0)
    models = [mlp([w]).double().to(device) for w in (3, 4, 5)]
    x = torch.randn(2, IN, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64, device=device, requires_grad=True)
    params = [p for m in models for p in m.parameters()]

    def f(x, w, *_params):
        return parsum.sum_models(models, x, weights=w, n_jobs=n_jobs)

    assert torch.autograd.gradcheck(f, (x, w, *params))


@needs_cuda
@pytest.mark.parametrize("n_jobs", [2, None])
def test_cpu_models_with_cuda_outputs(n_jobs):
    # Parameters and input on the CPU, outputs on the GPU: backward runs on the device's thread,
    # where helpers pulling back would wait on it (the caller's graph on several threads).
    torch.manual_seed(0)
    models = [_OnCuda() for _ in range(4)]
    ref = clone_models(models)
    x = torch.randn(5, IN)
    y = parsum.sum_models(models, x, n_jobs=n_jobs, chunk_size=1)
    y.pow(2).sum().backward()
    plain_sum(ref, x).pow(2).sum().backward()
    for a, b in zip(param_grads(models), param_grads(ref)):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("n_jobs", [1, 2, None])
def test_stacked_storage_trains_like_the_loop(device, flat, n_jobs):
    # stack_ storage (and FlatGrad(stack), one buffer for it) with Adam over the stack, against
    # Adam over the models' own parameters in the plain loop.
    models = _models("identical", device)
    ref = clone_models(models)
    stack = parsum.stack_(models)
    flat_grad = parsum.FlatGrad(stack) if flat else None
    opt = torch.optim.Adam(stack.parameters(), lr=1e-2)
    opt_ref = torch.optim.Adam([p for m in ref for p in m.parameters()], lr=1e-2)
    x = torch.randn(5, IN, device=device)
    for _ in range(3):
        opt.zero_grad()
        opt_ref.zero_grad()
        parsum.sum_models(models, x, n_jobs=n_jobs).pow(2).sum().backward()
        plain_sum(ref, x).pow(2).sum().backward()
        for a, b in zip(param_grads(models), param_grads(ref)):
            torch.testing.assert_close(a, b, **TOL)
        opt.step()
        opt_ref.step()
    for m, r in zip(models, ref):
        for a, b in zip(m.parameters(), r.parameters()):
            torch.testing.assert_close(a, b, **TOL)
    if flat_grad is not None:
        assert flat_grad.flat.device.type == device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("engine", ["auto", "autograd", "vjp"])
def test_dropout_draws_the_plain_loops_numbers(device, engine):
    # NOTE [ Random numbers in forwards ]: on a GPU the threads would launch their dropout
    # kernels, which take their offsets in the device's generator, in any order.
    torch.manual_seed(0)
    models = [
        nn.Sequential(nn.Linear(IN, 16 + i), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16 + i, OUT))
        for i in range(6)
    ]
    models = [m.to(device) for m in models]
    ref = clone_models(models)
    x = torch.randn(32, IN, device=device)
    for seed in range(2):
        outs = []
        for n_jobs in (1, 2, 4):
            torch.manual_seed(seed)
            outs.append(parsum.sum_models(models, x, engine=engine, n_jobs=n_jobs, chunk_size=1))
        torch.manual_seed(seed)
        want = plain_sum(ref, x)
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
        torch.testing.assert_close(outs[0], want, **TOL)
