"""FlatGrad: views into one buffer, sum_models' backward writing into them, compensation."""

import copy
import io
import threading

import pytest
import torch
from torch import nn

import parsum
from parsum import _grads
from tests.zoo import (
    IN,
    OUT,
    LowRankLinear,
    clone_models,
    mlp,
    param_grads,
    parametrized_model,
    plain_sum,
    zoo,
)

pytestmark = pytest.mark.timeout(60)


def is_view_into(t: torch.Tensor, buffer: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def trainable(models):
    seen, out = set(), []
    for m in models:
        for p in m.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


class Scale(nn.Module):
    """y = p * x: the gradient of y.sum() with respect to p is x.sum()."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.p = nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, x):
        return self.p * x


class FailsInBackward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(IN, 3)
        self.armed = False

    def forward(self, x):
        out = self.lin(x)
        if self.armed:
            out.register_hook(self._boom)
        return out

    def _boom(self, grad):
        raise ValueError("boom in backward")


# -- layout --------------------------------------------------------------------------------


def test_every_grad_is_a_view_and_flat_is_their_concatenation():
    models = zoo()
    flat = parsum.FlatGrad(models)
    params = trainable(models)
    assert flat.params == params
    assert flat.flat.numel() == sum(p.numel() for p in params)
    parsum.sum_models(models, torch.randn(5, IN)).pow(2).sum().backward()
    for p in params:
        assert is_view_into(p.grad, flat.flat)
        assert p.grad.shape == p.shape
    torch.testing.assert_close(flat.flat, torch.cat([p.grad.flatten() for p in params]))


def test_tied_parameter_one_slot_frozen_none():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight  # tied
    c = nn.Linear(4, 2)
    c.weight.requires_grad_(False)  # frozen
    flat = parsum.FlatGrad([a, b, c])
    assert flat.flat.numel() == 16 + 4 + 4 + 2
    assert c.weight.grad is None
    assert sum(p is a.weight for p in flat.params) == 1


def test_composite_parameters_get_slots_for_the_tensors_they_are_built_from():
    par = parametrized_model()
    low = LowRankLinear(IN, 3)
    flat = parsum.FlatGrad([par, low])
    names = [n for n, _ in par.named_parameters()]
    assert "0.parametrizations.weight.original" in names
    x = torch.randn(4, IN)
    ref = clone_models([par, low])
    parsum.sum_models([par, low], x).sum().backward()
    plain_sum(ref, x).sum().backward()
    for p, r in zip(trainable([par, low]), trainable(ref)):
        assert is_view_into(p.grad, flat.flat)
        torch.testing.assert_close(p.grad, r.grad)


def test_one_buffer_per_dtype_and_flat_refuses_several():
    a, b = nn.Linear(3, 2), nn.Linear(3, 2).double()
    flat = parsum.FlatGrad([a, b])
    cpu = torch.device("cpu")
    assert set(flat.buffers) == {(torch.float32, cpu), (torch.float64, cpu)}
    with pytest.raises(parsum.ParsumError, match=r"2 \(dtype, device\) pairs"):
        _ = flat.flat
    assert is_view_into(b.weight.grad, flat.buffers[torch.float64, cpu])


def test_channels_last_parameter_keeps_its_strides():
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    flat = parsum.FlatGrad(conv)
    assert conv.weight.grad.stride() == conv.weight.stride()
    x = torch.randn(2, 3, 6, 6)
    ref = clone_models([conv])[0]
    parsum.sum_models([conv], x).sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(conv.weight.grad, ref.weight.grad)
    assert is_view_into(conv.weight.grad, flat.flat)


def test_existing_grads_are_copied_in():
    lin = nn.Linear(3, 2)
    lin(torch.ones(1, 3)).sum().backward()
    before = [p.grad.clone() for p in lin.parameters()]
    parsum.FlatGrad(lin)
    for p, g in zip(lin.parameters(), before):
        assert torch.equal(p.grad, g)


def test_a_second_flatgrad_takes_the_parameters_over():
    lin = nn.Linear(3, 2)
    first = parsum.FlatGrad(lin)
    second = parsum.FlatGrad(lin)
    lin.zero_grad()
    parsum.sum_models([lin], torch.ones(2, 3)).sum().backward()
    assert is_view_into(lin.weight.grad, second.flat)
    assert first.flat.abs().sum() == 0


def _copied_and_loaded(*objects):
    """``objects`` deep-copied together, and saved and loaded together with torch.save."""
    buffer = io.BytesIO()
    torch.save(objects, buffer)
    buffer.seek(0)
    return [copy.deepcopy(objects), torch.load(buffer, weights_only=False)]


@pytest.mark.parametrize("compensated", [False, True])
def test_a_copied_or_loaded_flatgrad_holds_the_copied_models_gradients(compensated):
    # NOTE [ A copied FlatGrad ]: a deep copy's slots pointed at the original parameters. A
    # parameter frozen since the FlatGrad was made keeps its slot in the copy, and its hook.
    torch.manual_seed(0)
    models = [mlp([5]), mlp([3]), nn.Linear(IN, OUT)]
    flat = parsum.FlatGrad(models, compensated=compensated)
    x = torch.randn(6, IN)
    parsum.sum_models(models, x).square().sum().backward()
    models[1][0].weight.requires_grad_(False)
    held = flat.flat.clone()
    for twin_models, twin_flat in _copied_and_loaded(models, flat):
        params = [p for m in twin_models for p in m.parameters()]
        assert twin_flat.params == params and twin_flat.compensated == compensated
        assert all(is_view_into(p.grad, twin_flat.flat) for p in params)
        assert torch.equal(twin_flat.flat, held)  # the gradients copied with it
        if compensated:
            assert all(torch.equal(a, b) for a, b in zip(twin_flat._comps.values(),
                                                         flat._comps.values()))  # fmt: skip
        # Training the copy, the frozen parameter trained again, writes into its buffer
        # (where .grad was set to None too) and leaves the original's alone.
        twin_models[1][0].weight.requires_grad_(True)
        for m in twin_models:
            m.zero_grad(set_to_none=True)
        parsum.sum_models(twin_models, 2 * x).square().sum().backward()
        ref = clone_models(twin_models)
        for m in ref:
            m.zero_grad(set_to_none=True)
        plain_sum(ref, 2 * x).square().sum().backward()
        assert torch.equal(twin_flat.flat, torch.cat([p.grad.reshape(-1) for p in params]))
        for got, want in zip(params, trainable(ref)):
            torch.testing.assert_close(got.grad, want.grad)
        assert torch.equal(flat.flat, held)
        assert all(is_view_into(p.grad, flat.flat) for p in trainable(models))


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
@pytest.mark.parametrize("compensated", [False, True])
def test_a_copy_after_zero_grad_adds_nothing_stale(how, compensated):
    # NOTE [ A copied FlatGrad ]: after optimizer.zero_grad() (.grad None, the slots as they
    # were), a copy's .grad were every one its view, and its next backward added to the
    # gradients the original's zero_grad() had dropped (a checkpoint taken after zero_grad()
    # and trained on: 0.06-0.3 off). A .grad set by hand outside the buffer goes with its values.
    torch.manual_seed(0)
    models = [mlp([5]), mlp([3]), nn.Linear(IN, OUT)]
    flat = parsum.FlatGrad(models, compensated=compensated)
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    x = torch.randn(6, IN)
    parsum.sum_models(models, x).square().sum().backward()
    opt.step()
    opt.zero_grad()
    by_hand = torch.full_like(models[2].weight, 0.25)
    models[2].weight.grad = by_hand.clone()
    if how == "deepcopy":
        twins, twin_flat = copy.deepcopy((models, flat))
    else:
        twins, twin_flat = _copied_and_loaded(models, flat)[1]
    grads = [p.grad for m in twins for p in m.parameters()]
    assert sum(g is None for g in grads) == 9  # as the original's: all but the one by hand
    assert torch.equal(twins[2].weight.grad, by_hand)
    assert is_view_into(twins[2].weight.grad, twin_flat.flat)
    ref = clone_models(twins)
    parsum.sum_models(twins, x).square().sum().backward()
    for m in ref:
        m.zero_grad(set_to_none=True)
    ref[2].weight.grad = by_hand.clone()
    plain_sum(ref, x).square().sum().backward()
    for got, want in zip(trainable(twins), trainable(ref)):
        torch.testing.assert_close(got.grad, want.grad)
        assert is_view_into(got.grad, twin_flat.flat)


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
        (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.01}),
    ],
    ids=["SGD", "Adam"],
)
@pytest.mark.parametrize("stacked", [False, True], ids=["models", "stack_"])
def test_a_layer_frozen_during_training_stays_where_zero_grad_leaves_it(stacked, cls, kw, n_jobs):
    # NOTE [ Frozen parameters' gradients ]: zero_() gave a layer frozen since the FlatGrad was
    # made its zeroed view, which momentum, Adam's moments and weight decay moved on every
    # step (2-4e-2 off the plain loop's after two steps), where zero_grad() gives it None and
    # the optimizer leaves it. Unfrozen, it trains again.
    torch.manual_seed(0)
    models = [mlp([8]) for _ in range(8)]
    ref = clone_models(models)
    stack = parsum.stack_(models) if stacked else None
    flat = parsum.FlatGrad(stack if stack is not None else models)
    opt = cls(stack.parameters() if stack is not None else trainable(models), **kw)
    ref_opt = cls(trainable(ref), **kw)
    x = torch.randn(5, IN)
    for step in range(7):
        if step in (2, 5):  # frozen for steps 2-4, on every model at once
            for m in [*models, *ref]:
                m[0].weight.requires_grad_(step == 5)
        flat.zero_()
        ref_opt.zero_grad()
        if 2 <= step < 5:
            assert all(m[0].weight.grad is None for m in models)
            if stack is not None:
                assert stack.values["0.weight"].grad is None
            held = [m[0].weight.detach().clone() for m in models]
        parsum.sum_models(models, x, n_jobs=n_jobs).square().mean().backward()
        plain_sum(ref, x).square().mean().backward()
        opt.step()
        ref_opt.step()
        if 2 <= step < 5:
            assert all(torch.equal(m[0].weight, h) for m, h in zip(models, held))
        for a, b in zip(trainable(models), trainable(ref)):
            torch.testing.assert_close(a, b)
            assert is_view_into(a.grad, flat.flat)
    assert all(p.grad is not None for m in models for p in m.parameters())


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("compensated", [False, True])
@pytest.mark.parametrize("left", ["a frozen layer", "a member not in the call", "a model gone"])
def test_a_slot_no_backward_wrote_since_zero_grad_reads_zero(left, compensated, n_jobs):
    # NOTE [ Slots of no gradient ]: after optimizer.zero_grad() (.grad None, the slots as they
    # were), a slot the next backward did not write kept the last step's gradient, and a
    # norm of the buffer (for a clip: the docs' own example) or an all-reduce counted it.
    torch.manual_seed(0)
    models = [mlp([5]), mlp([3]), nn.Linear(IN, OUT)]
    flat = parsum.FlatGrad(models, compensated=compensated)
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    x = torch.randn(6, IN)
    for step in range(3):
        opt.zero_grad()
        called = models
        if step > 0 and left == "a frozen layer":
            models[1][0].weight.requires_grad_(False)
        elif step > 0:
            called = models[:2]
        parsum.sum_models(called, x, n_jobs=n_jobs).square().sum().backward()
        if step == 1 and left == "a model gone":
            del models[2], opt  # the model and the last reference to its parameters
            opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
        want = [p.grad for m in models for p in m.parameters() if p.grad is not None]
        norm = torch.cat([g.reshape(-1) for g in want]).norm()
        for _ in range(2):  # the second read finds them zeroed
            assert torch.equal(flat.flat.norm(), norm), step
        assert all(is_view_into(g, flat.flat) for g in want)
        opt.step()
    # the slots zeroed still take the next gradients, compensated where the FlatGrad is
    for m in models:
        m.requires_grad_(True)
    ref = clone_models(models)
    opt.zero_grad()
    for scale in (1.0, 1e-8):
        parsum.sum_models(models, scale * x, n_jobs=n_jobs).square().sum().backward()
        plain_sum(ref, scale * x).square().sum().backward()
    for got, want in zip(trainable(models), trainable(ref)):
        torch.testing.assert_close(got.grad, want.grad)


# -- sum_models' backward ------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["autograd", "vjp"])
@pytest.mark.parametrize("n_jobs", [1, 2, 3])
def test_backward_matches_plain_and_is_bitwise_across_n_jobs(engine, n_jobs):
    x = torch.randn(5, IN, dtype=torch.float64)
    results = []
    for jobs in (1, n_jobs):
        models = zoo(torch.float64)
        ref = clone_models(models)
        flat = parsum.FlatGrad(models)
        for _ in range(2):  # the second backward accumulates
            parsum.sum_models(models, x, engine=engine, n_jobs=jobs, chunk_size=2).sum().backward()
            plain_sum(ref, x).sum().backward()
        for g, r in zip(param_grads(models), param_grads(ref)):
            torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
        results.append(flat.flat.clone())
    assert torch.equal(results[0], results[1])


def test_shared_parameters_across_models():
    shared = nn.Linear(IN, 3)
    models = [nn.Sequential(shared, nn.Tanh()), nn.Sequential(shared, nn.ReLU()), shared]
    ref = clone_models(models)
    flat = parsum.FlatGrad(models)
    x = torch.randn(4, IN)
    parsum.sum_models(models, x).sum().backward()
    plain_sum(ref, x).sum().backward()
    assert flat.flat.numel() == IN * 3 + 3
    torch.testing.assert_close(shared.weight.grad, ref[2].weight.grad)
    assert is_view_into(shared.weight.grad, flat.flat)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_then_backward_puts_the_views_back(set_to_none):
    models = [mlp([8]), mlp([4, 4])]
    flat = parsum.FlatGrad(models)
    opt = torch.optim.SGD(trainable(models), lr=0.1)
    x = torch.randn(3, IN)
    parsum.sum_models(models, x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    parsum.sum_models(models, x).sum().backward()
    ref = clone_models(models)
    for m in ref:
        m.zero_grad()
    plain_sum(ref, x).sum().backward()
    for p, r in zip(trainable(models), trainable(ref)):
        assert is_view_into(p.grad, flat.flat)
        torch.testing.assert_close(p.grad, r.grad)


def test_plain_pytorch_backward_also_lands_in_the_buffer():
    model = mlp([8])
    flat = parsum.FlatGrad(model)
    x = torch.randn(3, IN)
    model.zero_grad()  # .grad None: AccumulateGrad makes a fresh tensor, the hook moves it in
    model(x).sum().backward()
    assert all(is_view_into(p.grad, flat.flat) for p in model.parameters())
    first = flat.flat.clone()
    model(x).sum().backward()  # accumulates in place into the views
    torch.testing.assert_close(flat.flat, 2 * first)


def test_autograd_grad_writes_nothing():
    models = zoo()
    flat = parsum.FlatGrad(models).zero_()
    params = trainable(models)
    x = torch.randn(5, IN, requires_grad=True)
    y = parsum.sum_models(models, x).sum()
    grads = torch.autograd.grad(y, [*params[:3], x])
    assert flat.flat.abs().sum() == 0
    ref = clone_models(models)
    want = torch.autograd.grad(plain_sum(ref, x).sum(), [*trainable(ref)[:3], x])
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w)


def test_backward_with_inputs_writes_only_those():
    models = [mlp([8]), mlp([4])]
    flat = parsum.FlatGrad(models).zero_()
    chosen = models[0][0].weight
    parsum.sum_models(models, torch.randn(3, IN)).sum().backward(inputs=[chosen])
    assert chosen.grad.abs().sum() > 0
    others = [p for p in flat.params if p is not chosen]
    assert all(p.grad.abs().sum() == 0 for p in others)


def test_a_user_hook_still_runs():
    model = mlp([8])
    flat = parsum.FlatGrad(model)
    seen = []
    model[0].weight.register_hook(lambda g: seen.append(g.clone()))
    parsum.sum_models([model], torch.randn(3, IN)).sum().backward()
    assert len(seen) == 1
    torch.testing.assert_close(model[0].weight.grad, seen[0])
    assert is_view_into(model[0].weight.grad, flat.flat)


def test_weights_and_flatgrad():
    models = zoo(torch.float64)
    ref = clone_models(models)
    parsum.FlatGrad(models)
    w = [0.5, -2.0, 1.0, 0.25, 3.0, -1.0, 0.75]
    x = torch.randn(4, IN, dtype=torch.float64)
    parsum.sum_models(models, x, weights=w).pow(2).sum().backward()
    plain_sum(ref, x, weights=w).pow(2).sum().backward()
    for g, r in zip(param_grads(models), param_grads(ref)):
        torch.testing.assert_close(g, r)


OPTIMIZERS = [
    (torch.optim.SGD, dict(lr=0.05)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    (torch.optim.Adam, dict(lr=1e-2)),
    (torch.optim.AdamW, dict(lr=1e-2, amsgrad=True)),
    (torch.optim.Adamax, dict(lr=1e-2)),
    (torch.optim.Adagrad, dict(lr=1e-2)),
    (torch.optim.Adadelta, dict(lr=1.0)),
    (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5)),
    (torch.optim.Rprop, dict(lr=1e-2)),
    (torch.optim.NAdam, dict(lr=1e-2)),
    (torch.optim.RAdam, dict(lr=1e-2)),
    (torch.optim.ASGD, dict(lr=1e-2)),
]


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize(("cls", "kw"), OPTIMIZERS, ids=lambda v: getattr(v, "__name__", ""))
def test_every_optimizer_trains_as_with_plain_pytorch(cls, kw, foreach):
    models = zoo(torch.float64)
    ref = clone_models(models)
    parsum.FlatGrad(models)
    opt = cls(trainable(models), foreach=foreach, **kw)
    opt_ref = cls(trainable(ref), foreach=foreach, **kw)
    x = torch.randn(6, IN, dtype=torch.float64)
    for _ in range(3):
        opt.zero_grad()
        parsum.sum_models(models, x).pow(2).mean().backward()
        opt.step()
        opt_ref.zero_grad()
        plain_sum(ref, x).pow(2).mean().backward()
        opt_ref.step()
    for p, r in zip(trainable(models), trainable(ref)):
        torch.testing.assert_close(p, r, rtol=1e-10, atol=1e-10)


def test_lbfgs_with_a_closure():
    models = [mlp([8]).double(), mlp([4]).double()]
    ref = clone_models(models)
    parsum.FlatGrad(models)
    x = torch.randn(6, IN, dtype=torch.float64)
    for ms, run in ((models, parsum.sum_models), (ref, plain_sum)):
        opt = torch.optim.LBFGS(trainable(ms), lr=0.5, max_iter=5)

        def closure(ms=ms, run=run, opt=opt):
            opt.zero_grad()
            loss = run(ms, x).pow(2).mean()
            loss.backward()
            return loss

        opt.step(closure)
    for p, r in zip(trainable(models), trainable(ref)):
        torch.testing.assert_close(p, r)


# -- compensated accumulation --------------------------------------------------------------


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_compensated_micro_batches_keep_small_additions(n_jobs):
    """float32: 1e6, then 0.01 a thousand times: compensated 1e6 + 10, naive stays at 1e6."""
    got = {}
    for compensated in (False, True):
        model = Scale()
        parsum.FlatGrad(model, compensated=compensated)
        parsum.sum_models([model], torch.tensor([1e6]), n_jobs=n_jobs).sum().backward()
        for _ in range(1000):
            parsum.sum_models([model], torch.tensor([0.01]), n_jobs=n_jobs).sum().backward()
        got[compensated] = model.p.grad.item()
    exact = 1e6 + 1000 * float(torch.tensor(0.01))
    assert got[False] == 1e6
    assert got[True] == float(torch.tensor(exact, dtype=torch.float32)) == 1e6 + 10


def test_compensated_accumulation_is_the_rounded_exact_sum():
    """Against the float64 sum of the same float32 per-batch gradients."""
    torch.manual_seed(0)
    models = [mlp([16]), mlp([8, 8])]
    scales = [1e3] + [1e-2] * 200
    batches = [torch.randn(8, IN) * s for s in scales]
    ref = clone_models(models)
    params = trainable(ref)
    want = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    for b in batches:
        grads = torch.autograd.grad(plain_sum(ref, b).sum(), params)
        want += torch.cat([g.flatten() for g in grads]).double()
    errors = {}
    for compensated in (False, True):
        ms = clone_models(models)
        flat = parsum.FlatGrad(ms, compensated=compensated)
        for b in batches:
            parsum.sum_models(ms, b).sum().backward()
        errors[compensated] = (flat.flat.double() - want).abs()
    half_ulp = want.float().abs().double() * 2.0**-24
    assert (errors[True] <= half_ulp * 1.01 + 1e-30).all()
    assert errors[False].sum() > 4 * errors[True].sum()


def test_compensation_is_dropped_after_the_grads_are_zeroed():
    model = Scale()
    flat = parsum.FlatGrad(model, compensated=True)
    parsum.sum_models([model], torch.tensor([1e6])).sum().backward()
    parsum.sum_models([model], torch.tensor([0.01])).sum().backward()  # kept below the last bit
    torch.optim.SGD(model.parameters(), lr=0.1).zero_grad(set_to_none=False)
    parsum.sum_models([model], torch.tensor([1.0])).sum().backward()
    assert model.p.grad.item() == 1.0
    flat.zero_()
    parsum.sum_models([model], torch.tensor([2.0])).sum().backward()
    assert model.p.grad.item() == 2.0


def test_compensated_inf_and_nan_as_in_plain_accumulation():
    model = Scale()
    parsum.FlatGrad(model, compensated=True)
    parsum.sum_models([model], torch.tensor([float("inf")])).sum().backward()
    parsum.sum_models([model], torch.tensor([1.0])).sum().backward()
    assert model.p.grad.item() == float("inf")
    parsum.sum_models([model], torch.tensor([float("-inf")])).sum().backward()
    assert torch.isnan(model.p.grad).all()


# -- a failed backward changes nothing -----------------------------------------------------


def bring_grads_to(state, models, flat, accumulate) -> None:
    """Every .grad None ("none"), the views of a zeroed buffer ("zeroed"), every other one of
    them None ("mixed"), or holding what ``accumulate()`` accumulated ("accumulated")."""
    if state == "none":
        for m in models:
            m.zero_grad()
    elif state in ("zeroed", "mixed"):
        flat.zero_()
        if state == "mixed":
            for p in flat.params[::2]:
                p.grad = None
    else:
        accumulate()


@pytest.mark.parametrize("state", ["none", "zeroed", "mixed", "accumulated"])
@pytest.mark.parametrize("compensated", [False, True])
@pytest.mark.parametrize("n_jobs", [1, 2])
def test_failed_backward_leaves_grads_as_they_were(state, compensated, n_jobs):
    models = [mlp([8]), FailsInBackward(), mlp([4])]
    flat = parsum.FlatGrad(models, compensated=compensated)
    x = torch.randn(3, IN)

    def accumulate():
        parsum.sum_models(models, x).sum().backward()
        parsum.sum_models(models, x * 1e-4).sum().backward()

    bring_grads_to(state, models, flat, accumulate)
    before = [None if p.grad is None else p.grad.clone() for p in flat.params]
    comps = [c.clone() for c in flat._comps.values()]
    models[1].armed = True
    y = parsum.sum_models(models, x, n_jobs=n_jobs, chunk_size=1)
    with pytest.raises(parsum.ParsumError, match=r"model 1 \(FailsInBackward\)"):
        y.sum().backward()
    for p, b in zip(flat.params, before):
        assert (p.grad is None) == (b is None)
        if b is not None:
            assert torch.equal(p.grad, b)
            assert is_view_into(p.grad, flat.flat)
    for c, saved in zip(flat._comps.values(), comps):
        assert torch.equal(c, saved)
    models[1].armed = False
    parsum.sum_models(models, x).sum().backward()  # and it keeps working


@pytest.mark.parametrize("route", ["hookless", "a hooked parameter", "ParallelSum"])
@pytest.mark.parametrize("n_jobs", [1, 2])
def test_a_chunks_slots_written_together_or_as_they_come_hold_the_same_bits(
    route, n_jobs, monkeypatch
):
    # A backward writes a chunk's slots once its models are pulled back, or as soon as the
    # waiting gradients reach FLAT_WRITE_ELEMENTS (the caller's graph: engine calls capturing
    # at most that many): the same bits either way, the plain loop's gradients, a hooked
    # parameter's returned to autograd (its hook runs once; its slots then looked at one by
    # one), and a model failing
    # in the middle of a chunk leaves every slot as it was (and the compensations, which
    # autograd's own write into the buffer, the hooked parameter's, makes stale: dropped by the
    # next backward either way). Hooked, the models go through ParallelSum.
    x = torch.randn(5, IN)
    hooked = route == "a hooked parameter"
    node = "CallerGraphSumBackward" if route == "hookless" else "ParallelSumBackward"
    if route == "ParallelSum":
        monkeypatch.setattr(parsum._api, "fits_callers_graph", lambda *a: False)

    def make():
        torch.manual_seed(0)
        models = [*zoo(seed=3), FailsInBackward(), mlp([6])]
        if hooked:
            models[0][0].weight.register_hook(lambda g: 2 * g)
        return models

    def train(write_elements, armed=False):
        monkeypatch.setattr(parsum._function, "FLAT_WRITE_ELEMENTS", write_elements)
        monkeypatch.setattr(parsum._inline, "FLAT_WRITE_ELEMENTS", write_elements)
        models = make()
        flat = parsum.FlatGrad(models, compensated=True)
        for scale in (1.0, 1e-4):
            y = parsum.sum_models(models, x * scale, n_jobs=n_jobs, chunk_size=3)
            assert type(y.grad_fn).__name__ == node
            y.pow(2).sum().backward()
        before = [p.grad.clone() for p in flat.params], [c.clone() for c in flat._comps.values()]
        models[-2].armed = armed
        y = parsum.sum_models(models, x, n_jobs=n_jobs, chunk_size=3)
        if armed:
            with pytest.raises(parsum.ParsumError, match=r"model \d+ \(FailsInBackward\)"):
                y.pow(2).sum().backward()
            assert all(map(torch.equal, [p.grad for p in flat.params], before[0]))
            assert hooked or all(map(torch.equal, flat._comps.values(), before[1]))
        return models, flat

    together, flat = train(parsum._function.FLAT_WRITE_ELEMENTS)
    assert all(is_view_into(p.grad, flat.flat) for p in flat.params)
    one_by_one, _ = train(1)
    for got, want in zip(param_grads(together), param_grads(one_by_one), strict=True):
        assert torch.equal(got, want)
    ref = make()
    for scale in (1.0, 1e-4):
        plain_sum(ref, x * scale).pow(2).sum().backward()
    for got, want in zip(param_grads(together), param_grads(ref), strict=True):
        torch.testing.assert_close(got, want)
    train(1, armed=True)
    train(parsum._function.FLAT_WRITE_ELEMENTS, armed=True)


@pytest.mark.parametrize("written", [3.0, 1e-40, -1e-40, float("nan")])
@pytest.mark.parametrize("n_jobs", [1, 2])
def test_a_value_written_through_data_after_zero_survives_a_failed_backward(written, n_jobs):
    # A write through .grad.data bumps no version: a buffer is taken as zero (its pullbacks
    # then accumulate into the views, and a failure zeroes them again) only if every value
    # reads as zero, a denormal and a NaN included (NOTE [ Buffer versions ]).
    models = [mlp([8]), FailsInBackward(), mlp([4])]
    flat = parsum.FlatGrad(models)
    flat.zero_()
    target = flat.params[-1]
    target.grad.data[0] = written
    before = [p.grad.clone() for p in flat.params]
    models[1].armed = True
    y = parsum.sum_models(models, torch.randn(3, IN), n_jobs=n_jobs, chunk_size=1)
    with pytest.raises(parsum.ParsumError, match=r"model 1 \(FailsInBackward\)"):
        y.sum().backward()
    for p, b in zip(flat.params, before):
        assert torch.equal(p.grad.view(-1).view(torch.int32), b.view(-1).view(torch.int32))
        assert is_view_into(p.grad, flat.flat)


@pytest.mark.parametrize("size", [10, (1 << 20) + 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_buffer_reads_as_zero_only_when_every_value_is(size, dtype):
    from parsum._grads import _all_zero

    buffer = torch.zeros(size, dtype=dtype)
    buffer[-1] = -0.0
    assert _all_zero(buffer)
    for value in (1e-40 if dtype != torch.bfloat16 else 1e-38, -3.0, float("nan"), float("inf")):
        buffer[size // 2] = value
        assert not _all_zero(buffer), value
        buffer[size // 2] = 0
    assert _all_zero(torch.zeros(size, dtype=torch.complex64))
    assert not _all_zero(torch.tensor([0j, 1e-3j]))


@pytest.mark.parametrize("state", ["none", "zeroed", "mixed", "accumulated"])
def test_the_callers_graph_serves_a_flatgrad_that_is_not_compensated(state, monkeypatch):
    """NOTE [ FlatGrad in the caller's graph ]: the same bits as ParallelSum's slot writes, on
    one thread and on several, from every state of the .grad."""
    from parsum import _api

    x = torch.randn(5, IN)
    results = []
    for n_jobs, callers_graph in [(1, True), (3, True), (1, False), (3, False)]:
        if not callers_graph:
            monkeypatch.setattr(_api, "fits_callers_graph", lambda *a: False)
        models = zoo(seed=2)
        flat = parsum.FlatGrad(models)
        bring_grads_to(
            state,
            models,
            flat,
            lambda m=models, j=n_jobs: parsum.sum_models(m, x * 0.5, n_jobs=j).sum().backward(),
        )
        y = parsum.sum_models(models, x, n_jobs=n_jobs, chunk_size=2)
        assert (type(y.grad_fn).__name__ == "CallerGraphSumBackward") == callers_graph
        y.pow(2).sum().backward()
        assert all(is_view_into(p.grad, flat.flat) for p in flat.params)
        results.append(flat.flat.clone())
    assert all(torch.equal(r, results[0]) for r in results[1:])


def _steps_match_plain(models, x, steps, flat=None):
    """``steps`` backward passes of ``sum_models`` against the plain sum's, zeroed between."""
    ref = clone_models(models)
    for _ in range(steps):
        for m in [*models, *ref]:
            m.zero_grad()
        if flat is not None:
            flat.zero_()
        parsum.sum_models(models, x, n_jobs=1).pow(2).sum().backward()
        plain_sum(ref, x).pow(2).sum().backward()
        for got, want in zip(param_grads(models), param_grads(ref)):
            torch.testing.assert_close(got, want)


class HalfUsed(nn.Module):
    """A model with a parameter its forward does not use on this input."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(IN, OUT)
        self.idle = nn.Parameter(torch.ones(OUT))

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("path", ["caller's graph", "ParallelSum", "compensated"])
def test_a_parameter_without_a_gradient_keeps_grad_none(path, n_jobs, monkeypatch):
    # Through ParallelSum, every parameter written by FlatWrites had its view set as .grad at
    # the commit, also one that got no gradient: after optimizer.zero_grad() its view held
    # the last step's gradient, which an optimizer stepped again. Plain PyTorch leaves None.
    models = [HalfUsed(), mlp([4]), HalfUsed()]
    if path == "ParallelSum":
        monkeypatch.setattr(parsum._api, "fits_callers_graph", lambda *a: False)
    twins = clone_models(models)
    flat = parsum.FlatGrad(models, compensated=path == "compensated")
    for _ in range(3):
        x = torch.randn(5, IN)
        for group in (models, twins):
            for m in group:
                m.zero_grad(set_to_none=True)
        parsum.sum_models(models, x, n_jobs=n_jobs).pow(2).sum().backward()
        plain_sum(twins, x).pow(2).sum().backward()
        assert models[0].idle.grad is None and models[2].idle.grad is None
        for got, want in zip(param_grads(models), param_grads(twins), strict=True):
            if want is None:
                assert got is None
            else:
                torch.testing.assert_close(got, want)
        flat.flat.fill_(7.0)  # what a step's gradients leave behind, .grad None or not


def test_a_kept_plan_sees_flatgrads_made_and_taking_over():
    """ParamSlots: a plan kept across calls finds its parameters' slots again when a FlatGrad
    is made over them or takes some over."""
    torch.manual_seed(0)
    models = [mlp([8]), mlp([4]), mlp([6])]
    x = torch.randn(5, IN)
    _steps_match_plain(models, x, 2)  # the plan kept, no slots
    first = parsum.FlatGrad(models)
    _steps_match_plain(models, x, 2, first)
    assert all(is_view_into(p.grad, first.flat) for p in trainable(models))
    second = parsum.FlatGrad(models[1])  # the middle run of slots moves to another buffer
    _steps_match_plain(models, x, 2, first)
    second.zero_()
    parsum.sum_models(models, x, n_jobs=1).sum().backward()
    assert all(is_view_into(p.grad, second.flat) for p in trainable(models[1:2]))
    assert all(is_view_into(p.grad, first.flat) for p in trainable([models[0], models[2]]))
    third = parsum.FlatGrad(models)  # all of them again, in a third buffer
    _steps_match_plain(models, x, 2, third)
    assert all(is_view_into(p.grad, third.flat) for p in trainable(models))


def test_a_flatgrad_over_the_models_in_another_order_reads_its_buffer_once(monkeypatch):
    """ParamSlots: slots in another order than the sum's make a run a model; the buffer is
    still read once a backward to know it is zero."""
    from parsum import _grads

    torch.manual_seed(0)
    models = [mlp([4 + i]) for i in range(6)]
    flat = parsum.FlatGrad(models[::-1])
    x = torch.randn(5, IN)
    reads = []
    all_zero = _grads._all_zero
    monkeypatch.setattr(_grads, "_all_zero", lambda b: reads.append(b) or all_zero(b))
    _steps_match_plain(models, x, 3, flat)
    assert all(is_view_into(p.grad, flat.flat) for p in trainable(models))
    assert len(flat._views) == len(trainable(models))
    assert len(reads) == 3  # one a backward, not one a model


@pytest.mark.parametrize("kind", ["post_accumulate", "tensor"])
def test_a_hook_registered_after_the_plan_is_kept_runs_once(kind):
    """ParamSlots: whether a parameter has a hook of the user's is looked at again after a
    hook was registered anywhere."""
    torch.manual_seed(0)
    models = [mlp([8]), mlp([4])]
    flat = parsum.FlatGrad(models)
    x = torch.randn(5, IN)
    _steps_match_plain(models, x, 2, flat)
    seen = []
    weight = models[1][0].weight
    if kind == "tensor":
        weight.register_hook(lambda g: seen.append(g.clone()))
    else:
        weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    flat.zero_()
    parsum.sum_models(models, x, n_jobs=1).sum().backward()
    assert len(seen) == 1
    torch.testing.assert_close(weight.grad, seen[0])
    assert is_view_into(weight.grad, flat.flat)


def test_a_flatgrad_made_under_inference_mode():
    # Its buffers were inference tensors, which keep no version: the FlatGrad raised
    # "Inference tensors do not track version counter" as it was made.
    models = [mlp([8]), mlp([4])]
    with torch.inference_mode():
        flat = parsum.FlatGrad(models)
        flat.zero_()
        parsum.sum_models(models, torch.randn(5, IN))
    x = torch.randn(5, IN)
    _steps_match_plain(models, x, 2, flat)
    assert all(is_view_into(p.grad, flat.flat) for p in trainable(models))
    assert not flat.flat.is_inference()


def test_zero_with_a_parameter_gone_or_a_grad_replaced():
    models = [mlp([8]), mlp([4])]
    flat = parsum.FlatGrad(models)
    kept = trainable(models[:1])
    kept[0].grad = torch.ones_like(kept[0])  # not the view: zero_() puts the view back
    del models[1]
    import gc

    gc.collect()
    assert len(flat.params) == len(kept)
    flat.zero_()
    assert all(is_view_into(p.grad, flat.flat) for p in kept)
    assert flat.flat.abs().sum() == 0


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_the_callers_graph_captures_a_compensated_flatgrads_slots_a_few_at_a_time(
    n_jobs, monkeypatch
):
    # Its engine calls capture at most FLAT_WRITE_ELEMENTS of the slots' gradients, or one
    # larger model's, as ParallelSum holds them (a chunk's at once grew the peak of 32 MLPs
    # of 1M parameters by 8%): the same bits as one call for all.
    x = torch.randn(5, IN)
    sizes = [sum(p.numel() for p in mlp([w]).parameters()) for w in (8, 4, 6, 30, 5)]
    calls: list[int] = []
    pull_back = parsum._inline.pull_back

    def spy(outs, wrt, *args, **kwargs):
        calls.append(sum(t.numel() for t in wrt))
        return pull_back(outs, wrt, *args, **kwargs)

    def train(limit):
        monkeypatch.setattr(parsum._inline, "FLAT_WRITE_ELEMENTS", limit)
        torch.manual_seed(0)
        models = [mlp([w]) for w in (8, 4, 6, 30, 5)]
        flat = parsum.FlatGrad(models, compensated=True)
        calls.clear()
        for scale in (1.0, 1e-4):
            y = parsum.sum_models(models, x * scale, n_jobs=n_jobs, chunk_size=5)
            assert type(y.grad_fn).__name__ == "CallerGraphSumBackward"
            y.pow(2).sum().backward()
        return flat, list(calls)

    monkeypatch.setattr(parsum._inline, "pull_back", spy)
    whole, one_call = train(sum(sizes))
    assert one_call == [sum(sizes)] * 2
    limit = sizes[0] + sizes[1]
    parts, split = train(limit)
    assert split == [limit, sizes[2], sizes[3], sizes[4]] * 2  # the fourth alone: larger
    assert torch.equal(whole.flat, parts.flat)
    for a, b in zip(whole._comps.values(), parts._comps.values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("how", ["backward", "backward(inputs=)", "autograd.grad"])
@pytest.mark.parametrize("n_jobs", [1, 2])
def test_a_compensated_flatgrad_in_the_callers_graph_holds_parallel_sums_bits(
    how, n_jobs, monkeypatch
):
    # The caller's graph writes a compensated FlatGrad as ParallelSum does: the same buffer
    # and compensations, bit for bit, over backward passes whose gradients cancel (where
    # compensation counts), a gradient from outside the sum, backward(inputs=) naming some
    # parameters (the others keep theirs) and autograd.grad, which writes nothing.
    x = torch.randn(5, IN)

    def train(route):
        torch.manual_seed(0)
        models = zoo(seed=2)
        flat = parsum.FlatGrad(models, compensated=True)
        flat.zero_()
        monkeypatch.setattr(parsum._api, "fits_callers_graph", lambda *a: False)
        if route == "callers":
            monkeypatch.undo()
        named = trainable(models)[::2]
        got = []
        for scale in (1.0, 1e-4, -1.0, 3e-5):
            y = parsum.sum_models(models, x * scale, n_jobs=n_jobs, chunk_size=2)
            want = "CallerGraphSumBackward" if route == "callers" else "ParallelSumBackward"
            assert type(y.grad_fn).__name__ == want
            loss = y.pow(2).sum() + named[0].sum() * scale  # a gradient from outside the sum
            if how == "backward":
                loss.backward()
            elif how == "backward(inputs=)":
                loss.backward(inputs=named)
            else:
                got.append(torch.autograd.grad(loss, named))
        return flat, got, {id(p) for p in named}

    (callers, got, named), (parallel, want, _) = train("callers"), train("parallel")
    assert torch.equal(callers.flat, parallel.flat)
    for a, b in zip(callers._comps.values(), parallel._comps.values(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(got, want, strict=True):
        assert all(map(torch.equal, a, b))
    if how == "autograd.grad":
        assert not callers.flat.any()
    elif how == "backward(inputs=)":
        others = [p for p in callers.params if id(p) not in named]
        assert others and all(p.grad is None or not p.grad.any() for p in others)
    else:
        assert callers.flat.any()


# -- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arg", "match"),
    [
        ("not a module", r"params_or_modules is a str"),
        ([nn.Linear(2, 2), 3], r"params_or_modules\[1\] is an int \(3\)"),
        ([nn.Linear(2, 2).weight * 2], r"params_or_modules\[0\] is a tensor computed"),
        ([nn.Linear(2, 2).requires_grad_(False)], "no trainable parameter"),
        ([], "no trainable parameter"),
        (
            [nn.Sequential(nn.Linear(2, 2), nn.LazyLinear(3))],
            r"params_or_modules\[0\]\.1\.weight is a lazy parameter that is not initialized",
        ),
    ],
)
def test_bad_input(arg, match):
    with pytest.raises(parsum.ParsumError, match=match):
        parsum.FlatGrad(arg)


def test_bad_compensated_and_nothing_changed():
    lin = nn.Linear(2, 2)
    with pytest.raises(parsum.ParsumError, match="compensated is 'yes'"):
        parsum.FlatGrad(lin, compensated="yes")
    assert lin.weight.grad is None


def _a_new_flatgrad_holds_the_gradients(models, x):
    """A FlatGrad made anew over ``models`` holds their gradients, as the plain loop's."""
    new = parsum.FlatGrad(models).zero_()
    ref = clone_models(models)
    parsum.sum_models(models, x).pow(2).sum().backward()
    plain_sum(ref, x).pow(2).sum().backward()
    for got, want in zip(param_grads(models), param_grads(ref)):
        torch.testing.assert_close(got, want)
    assert all(is_view_into(p.grad, new.flat) for p in trainable(models))


@pytest.mark.parametrize("change", ["double", "half", "resize"])
@pytest.mark.parametrize("grads_set", [True, False])
def test_a_module_cast_after_its_flatgrad_is_named_and_a_new_flatgrad_fixes_it(change, grads_set):
    # NOTE [ Stale slots ]: a cast with .grad set had made the buffer silently stop holding
    # the gradients; with .grad None the backward failed in the FlatGrad's hook, blamed on a
    # model.
    torch.manual_seed(0)
    models = [mlp([8]), mlp([6])]
    flat = parsum.FlatGrad(models)
    if not grads_set:
        for m in models:
            m.zero_grad()
    if change == "resize":
        with torch.no_grad():
            models[1][-1].bias.data = torch.zeros(OUT + 1)
        match = rf"'2.bias' of models\[1\] \(Sequential\) of shape \({OUT + 1},\)"
    else:
        for m in models:
            getattr(m, change)()
        match = rf"'0.weight' of models\[0\] \(Sequential\) .* is now torch.{dtype_name(change)}"
    x = torch.randn(5, IN, dtype=next(models[0].parameters()).dtype)
    before = [p.grad for p in trainable(models)]
    with pytest.raises(parsum.ParsumError, match=match):
        parsum.sum_models(models, x)
    assert all(p.grad is g for p, g in zip(trainable(models), before))  # nothing changed
    with pytest.raises(parsum.ParsumError, match="make a new FlatGrad"):
        flat.zero_()
    if change == "resize":
        return
    _a_new_flatgrad_holds_the_gradients(models, x)


@pytest.mark.parametrize("stacked", [False, True])
def test_a_module_cast_there_and_back_after_its_flatgrad_is_named(stacked):
    # NOTE [ Stale slots ]: .double().float() (or a move to channels_last) keeps the dtype but
    # gives each .grad data of its own: the FlatGrad had silently stopped holding them (the
    # models' .grad kept the values of before while the buffer got the new ones).
    torch.manual_seed(0)
    models = [mlp([8]) for _ in range(4)]
    flat = parsum.FlatGrad(parsum.stack_(models) if stacked else models)
    x = torch.randn(5, IN)
    parsum.sum_models(models, x).sum().backward()
    for m in models:
        m.double().float()
    with pytest.raises(parsum.ParsumError, match="no longer in the FlatGrad's buffer"):
        parsum.sum_models(models, x)
    with pytest.raises(parsum.ParsumError, match="make a new FlatGrad"):
        flat.zero_()
    _a_new_flatgrad_holds_the_gradients(models, x)


def test_a_plain_backward_after_a_move_is_named_by_the_hook():
    model = nn.Linear(3, 2)
    parsum.FlatGrad(model)
    model.zero_grad()
    model.double()
    with pytest.raises(parsum.ParsumError, match="cast, moved or resized after the FlatGrad"):
        model(torch.ones(1, 3, dtype=torch.float64)).sum().backward()


def test_a_hook_after_the_data_moved():
    """The hook looks at a slot whole only where the parameter's or the view's data moved:
    data swapped in and out (an EMA's weights for evaluation) still lands in the slot, and a
    cast after it is named."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    flat = parsum.FlatGrad(model)
    shadow = [p.detach().clone() + 1 for p in model.parameters()]
    x = torch.ones(4, 3)
    for _ in range(2):  # swapped in, then back
        for p, s in zip(model.parameters(), shadow):
            p.data, s.data = s.data, p.data
        model.zero_grad()
        model(x).sum().backward()
        assert all(is_view_into(p.grad, flat.flat) for p in model.parameters())
        torch.testing.assert_close(model.bias.grad, torch.full((2,), 4.0))
    model.zero_grad()
    model.double()
    with pytest.raises(parsum.ParsumError, match="cast, moved or resized after the FlatGrad"):
        model(x.double()).sum().backward()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_a_hook_under_create_graph_copies_the_value_alone():
    model = mlp([4])
    flat = parsum.FlatGrad(model)
    model.zero_grad()
    x = torch.randn(3, IN)
    model(x).pow(2).sum().backward(create_graph=True)
    ref = clone_models([model])[0]
    ref.zero_grad()
    ref(x).pow(2).sum().backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert is_view_into(p.grad, flat.flat) and not p.grad.requires_grad
        torch.testing.assert_close(p.grad, r.grad)


def dtype_name(change):
    return {"double": "float64", "half": "float16"}[change]


def test_repr():
    assert repr(parsum.FlatGrad(nn.Linear(2, 3))) == (
        "FlatGrad(2 parameters; torch.float32/cpu: 9; compensated=False)"
    )


def test_a_checkpoint_loads_into_a_flatgrad_with_the_swap_off_around_it(swapping):
    # docs/limits.md ("Conversions that swap tensors"): a FlatGrad holds its parameters weakly,
    # and torch.utils.swap_tensors refuses a tensor with a weak reference. Loading with the
    # swap off copies in place: the FlatGrad keeps its slots and the models train as twins.
    torch.manual_seed(0)
    models = [mlp([8]), mlp([6])]
    checkpoint = [copy.deepcopy(m.state_dict()) for m in models]
    flat = parsum.FlatGrad(models)
    x = torch.randn(5, IN)
    parsum.sum_models(models, x).pow(2).sum().backward()
    with torch.no_grad():
        for p in trainable(models):
            p.add_(1.0)
    with pytest.raises(RuntimeError, match="weakref"):  # (after copying the values in)
        models[0].load_state_dict(checkpoint[0])
    torch.__future__.set_swap_module_params_on_conversion(False)  # the fixture restores it
    for m, state in zip(models, checkpoint):
        m.load_state_dict(state)
    ref = [mlp([8]), mlp([6])]
    for m, state in zip(ref, checkpoint):
        m.load_state_dict(state)
    flat.zero_()
    parsum.sum_models(models, x).pow(2).sum().backward()
    plain_sum(ref, x).pow(2).sum().backward()
    for got, want in zip(param_grads(models), param_grads(ref)):
        torch.testing.assert_close(got, want)
    assert all(is_view_into(p.grad, flat.flat) for p in trainable(models))


@pytest.mark.parametrize("threads", [1, 2])
def test_models_without_a_flatgrad_load_and_cast_with_the_swap_on(threads, swapping):
    # What sum_models keeps of the models it ran (their plans) holds no weak reference to a
    # parameter: loading and casting with the swap on work, and the next call trains them.
    # Also once a second thread has trained them, which the plans record (NOTE [ Parameters
    # trained in several threads ] in parsum._grads; a weak reference failed there).
    torch.manual_seed(0)
    models = [mlp([8]), mlp([6])]
    ref = clone_models(models)
    checkpoint = [copy.deepcopy(m.state_dict()) for m in models]
    x = torch.randn(5, IN)
    parsum.sum_models(models, x).pow(2).sum().backward()
    if threads == 2:
        other = threading.Thread(target=lambda: parsum.sum_models(models, x))
        other.start()
        other.join(timeout=30)
        assert all(_grads.trainer_of(p) == _grads._SEVERAL for p in trainable(models))
    for m, state in zip(models, checkpoint):
        m.load_state_dict(state)
        m.zero_grad()
        m.double()
    for m in ref:
        m.double()
    x = x.double()
    parsum.sum_models(models, x).pow(2).sum().backward()
    plain_sum(ref, x).pow(2).sum().backward()
    for got, want in zip(param_grads(models), param_grads(ref)):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("n_jobs", [1, 2, None])
def test_models_moved_to_shared_memory_keep_their_flatgrad(n_jobs):
    # Module.share_memory() moves every parameter and its .grad to shared memory (as Hogwild
    # training does); a .grad that is a FlatGrad's view moves the whole buffer, in place.
    models = zoo()
    twins = clone_models(models)
    flat = parsum.FlatGrad(models)
    for m in models:
        m.share_memory()
    assert flat.flat.is_shared()
    x = torch.randn(5, IN)
    opt = torch.optim.SGD(trainable(models), lr=0.01)
    opt_twins = torch.optim.SGD(trainable(twins), lr=0.01)
    for step in range(3):
        flat.zero_()
        opt_twins.zero_grad()
        parsum.sum_models(models, x, n_jobs=n_jobs).pow(2).sum().backward()
        plain_sum(twins, x).pow(2).sum().backward()
        for got, want in zip(param_grads(models), param_grads(twins), strict=True):
            torch.testing.assert_close(got, want, msg=lambda m, step=step: f"step {step}: {m}")
        assert all(is_view_into(p.grad, flat.flat) for p in trainable(models))
        opt.step()
        opt_twins.step()
    assert all(p.is_shared() for p in trainable(models))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("n_jobs", [1, 2])
def test_a_hessian_vector_product_beside_a_compensated_flatgrad(n_jobs):
    # autograd.grad(create_graph=True) writes no slot: its gradients are differentiated again,
    # as the plain loop's (through ParallelSum that raised); backward(create_graph=True) writes
    # the slots, compensated, and returns gradients that are not differentiable.
    torch.manual_seed(0)
    models = [mlp([8]).double(), mlp([5]).double()]
    ref = clone_models(models)
    flat = parsum.FlatGrad(models, compensated=True)
    flat.zero_()
    x = torch.randn(5, IN, dtype=torch.float64)
    vs = [torch.randn_like(p) for p in trainable(models)]

    def hvp(ms, total):
        params = trainable(ms)
        grads = torch.autograd.grad(total.pow(2).sum(), params, create_graph=True)
        dot = sum((g * v).sum() for g, v in zip(grads, vs))
        return torch.autograd.grad(dot, params)

    y = parsum.sum_models(models, x, n_jobs=n_jobs)
    assert type(y.grad_fn).__name__ == "CallerGraphSumBackward"
    got, want = hvp(models, y), hvp(ref, plain_sum(ref, x))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    assert not flat.flat.any()  # nothing written
    y = parsum.sum_models(models, x, n_jobs=n_jobs)
    y.pow(2).sum().backward(create_graph=True)
    plain_sum(ref, x).pow(2).sum().backward()
    for p, q in zip(trainable(models), trainable(ref), strict=True):
        assert is_view_into(p.grad, flat.flat) and not p.grad.requires_grad
        torch.testing.assert_close(p.grad, q.grad)
