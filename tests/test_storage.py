"""parsum.stack_: identical models whose parameters live in stacked storage.

Every result is compared with the plain loop over deep copies that were never stacked, and the
models must stay ordinary modules: optimizers, state_dict, deepcopy, torch.save.
"""

from __future__ import annotations

import copy
import io
import threading
import warnings

import pytest
import torch
import torch.nn.utils.prune
from torch import nn

import parsum
from tests.zoo import (
    IN,
    OUT,
    mlp,
    narrow_in_place,
    param_grads,
    plain_graph,
    plain_sum,
    unique_params,
)

pytestmark = pytest.mark.timeout(120)


class TwoLayer(nn.Module):
    """Not a Sequential: runs through vmap, not the batched matmuls."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(IN, 5)
        self.b = nn.Linear(5, OUT)
        self.scale = nn.Parameter(torch.tensor(0.5), requires_grad=False)  # frozen: state
        self.a.gain = 1.0  # a plain attribute of a torch.nn layer, which forward reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x) * self.a.gain)) * self.scale


def members(kind: str = "mlp", n: int = 10, dtype: torch.dtype = torch.float32) -> list[nn.Module]:
    torch.manual_seed(0)
    if kind in ("mlp", "square"):  # square: its second layer's weight
        return [mlp([8, 7 if kind == "mlp" else 8], nn.LeakyReLU).to(dtype) for _ in range(n)]
    return [TwoLayer().to(dtype) for _ in range(n)]


def stacked_and_plain(kind: str = "mlp", n: int = 10, dtype=torch.float32):
    models = members(kind, n, dtype)
    plain = copy.deepcopy(models)
    stack = parsum.stack_(models)
    return models, plain, stack


def runs_stacked(y: torch.Tensor) -> bool:
    """Whether a result came from the stacked path rather than one by one (ParallelSum, the
    caller's graph, or a plain graph of known layers)."""
    name = type(y.grad_fn).__name__
    return name not in ("ParallelSumBackward", "CallerGraphSumBackward") and not plain_graph(y)


def step_like_plain(models, plain, x, stacked: bool) -> None:
    """A training step's gradients, run stacked or not as said, alike to the plain loop's."""
    y = parsum.sum_models(models, x)
    assert runs_stacked(y) == stacked
    y.pow(2).mean().backward()
    plain_sum(plain, x).pow(2).mean().backward()
    assert_grads_close(models, plain, atol=1e-5)


def assert_params_close(models, plain) -> None:
    for m, q in zip(models, plain):
        for a, b in zip(m.parameters(), q.parameters()):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def assert_grads_close(models, plain, atol=1e-6) -> None:
    for g, h in zip(param_grads(models), param_grads(plain)):
        assert (g is None) == (h is None)
        if g is not None:
            torch.testing.assert_close(g, h, atol=atol, rtol=1e-5)


@pytest.mark.parametrize("kind", ["mlp", "two-layer"])
def test_storage_is_shared_and_models_stay_leaves(kind):
    models, plain, stack = stacked_and_plain(kind)
    p = models[3].get_parameter("a.weight" if kind != "mlp" else "0.weight")
    name = "a.weight" if kind != "mlp" else "0.weight"
    assert p.is_leaf and isinstance(p, nn.Parameter)
    assert p.data_ptr() == stack.values[name][3].data_ptr()
    for m, q in zip(models, plain):
        for a, b in zip(m.state_dict().values(), q.state_dict().values()):
            assert torch.equal(a, b)
    with torch.no_grad():
        stack.values[name][3].add_(1.0)  # writing the stack writes the model
    assert torch.equal(p, plain[3].get_parameter(name) + 1.0)


@pytest.mark.parametrize("kind", ["mlp", "two-layer"])
def test_sum_and_gradients_equal_the_plain_loop(kind):
    models, plain, _ = stacked_and_plain(kind)
    x = torch.randn(16, IN, requires_grad=True)
    xp = x.detach().clone().requires_grad_()
    y = parsum.sum_models(models, x)
    assert runs_stacked(y)
    yp = plain_sum(plain, xp)
    torch.testing.assert_close(y, yp, atol=1e-6, rtol=1e-5)
    y.pow(2).sum().backward()
    yp.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, xp.grad, atol=1e-6, rtol=1e-5)
    assert_grads_close(models, plain)


def test_a_stack_made_under_inference_mode_trains():
    # Its stacked tensors were inference tensors: the first training call raised "Setting
    # requires_grad=True on inference tensor outside InferenceMode is not allowed". It trains
    # as a stack made outside it does, to the bit.
    torch.manual_seed(0)
    models = [mlp([8]) for _ in range(4)]
    twins = copy.deepcopy(models)
    x = torch.randn(5, IN)
    with torch.inference_mode():
        stack = parsum.stack_(models)
        torch.testing.assert_close(parsum.sum_models(models, x), plain_sum(twins, x))
    assert not any(v.is_inference() for v in stack.values.values())
    optimizers = [torch.optim.SGD(s.parameters(), lr=0.1) for s in (stack, parsum.stack_(twins))]
    for _ in range(3):
        for ms, opt in zip((models, twins), optimizers):
            parsum.sum_models(ms, x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    assert all(map(torch.equal, unique_params(models), unique_params(twins)))


def test_sum_is_closer_to_float64_than_the_plain_float32_sum():
    models, plain, _ = stacked_and_plain(n=64)
    exact = copy.deepcopy(plain)
    for m in exact:
        m.double()
    x = torch.randn(64, IN)
    y = parsum.sum_models(models, x)
    truth = plain_sum(exact, x.double())
    assert (y.double() - truth).abs().max() <= (plain_sum(plain, x).double() - truth).abs().max()


def test_weights_as_floats_and_as_a_tensor_that_requires_grad():
    models, plain, _ = stacked_and_plain()
    x = torch.randn(8, IN)
    w = torch.linspace(-1, 1, len(models), requires_grad=True)
    wp = w.detach().clone().requires_grad_()
    y = parsum.sum_models(models, x, weights=w)
    assert runs_stacked(y)
    yp = plain_sum(plain, x, weights=wp)
    torch.testing.assert_close(y, yp, atol=1e-6, rtol=1e-5)
    y.sum().backward()
    yp.sum().backward()
    torch.testing.assert_close(w.grad, wp.grad, atol=1e-5, rtol=1e-5)
    assert_grads_close(models, plain)
    floats = [0.5] * len(models)
    torch.testing.assert_close(
        parsum.sum_models(models, x, weights=floats), plain_sum(plain, x, weights=floats)
    )


@pytest.mark.parametrize("kind", ["mlp", "two-layer"])
def test_gradcheck_float64(kind):
    models, _, _ = stacked_and_plain(kind, n=4, dtype=torch.float64)
    x = torch.randn(3, IN, dtype=torch.float64, requires_grad=True)
    w = torch.rand(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: parsum.sum_models(models, x, weights=w), (x, w))


def test_gradients_accumulate_and_zero_grad_starts_over():
    models, plain, _ = stacked_and_plain()
    x = torch.randn(8, IN)
    for _ in range(2):  # without zeroing: accumulated, as autograd does
        parsum.sum_models(models, x).sum().backward()
        plain_sum(plain, x).sum().backward()
    assert_grads_close(models, plain)
    for m, q in zip(models, plain):
        m.zero_grad()
        q.zero_grad()
    parsum.sum_models(models, x).pow(2).sum().backward()
    plain_sum(plain, x).pow(2).sum().backward()
    assert_grads_close(models, plain)


def test_a_gradient_kept_from_an_earlier_step_is_never_overwritten():
    models, _, stack = stacked_and_plain()
    x = torch.randn(8, IN)
    kept = []
    for step in range(4):
        for m in models:
            m.zero_grad()
        parsum.sum_models(models, x * (step + 1)).sum().backward()
        if step == 0:
            kept.append((models[2][0].weight.grad, models[2][0].weight.grad.clone()))
        if step == 1:
            slice_ = models[5][2].bias.grad[1:]
            kept.append((slice_, slice_.clone()))
        if step == 2:
            whole = stack.values["4.weight"].grad
            kept.append((whole, whole.clone()))
    for held, value in kept:
        assert torch.equal(held, value)


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.Adam(ps, lr=0.01),
        lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=True),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True),
    ],
    ids=["sgd", "adam", "adam-foreach", "adamw-fused"],
)
def test_optimizers_over_the_models_own_parameters_train_as_plainly(make):
    models, plain, stack = stacked_and_plain()
    opt = make([p for m in models for p in m.parameters()])
    opt_plain = make([p for m in plain for p in m.parameters()])
    for _ in range(3):
        x = torch.randn(8, IN)
        for o, ms in ((opt, models), (opt_plain, plain)):
            o.zero_grad()
            y = parsum.sum_models(ms, x) if ms is models else plain_sum(ms, x)
            y.pow(2).mean().backward()
            o.step()
    assert_params_close(models, plain)
    assert models[0][0].weight.data_ptr() == stack.values["0.weight"][0].data_ptr()


@pytest.mark.parametrize("fused", [False, True])
def test_one_optimizer_over_the_stack_trains_as_one_over_every_parameter(fused):
    models, plain, stack = stacked_and_plain()
    opt = torch.optim.Adam(stack.parameters(), lr=0.01, fused=fused)
    opt_plain = torch.optim.Adam([p for m in plain for p in m.parameters()], lr=0.01)
    for step in range(4):
        x = torch.randn(8, IN)
        opt.zero_grad(set_to_none=step % 2 == 0)
        opt_plain.zero_grad()
        parsum.sum_models(models, x).pow(2).mean().backward()
        plain_sum(plain, x).pow(2).mean().backward()
        assert_grads_close(models, plain)
        torch.testing.assert_close(stack.values["0.weight"].grad[3], plain[3][0].weight.grad)
        opt.step()
        opt_plain.step()
    assert_params_close(models, plain)


def train_one_by_one_over_the_stack(models, rows, atol=1e-6, **kwargs) -> None:
    """Three steps of SGD with momentum over the stack's tensors, the models run one by one,
    against the same over the parameters of plain copies: the same gradients at each step
    (``.grad`` set to None, then zeroed in place, then None), the same parameters after."""
    plain = copy.deepcopy(models)
    stack = parsum.stack_(models)
    opt = torch.optim.SGD(stack.parameters(), lr=0.1, momentum=0.9)
    opt_plain = torch.optim.SGD([p for m in plain for p in m.parameters()], lr=0.1, momentum=0.9)
    for step in range(3):
        x = torch.randn(rows, IN)
        opt.zero_grad(set_to_none=step != 1)
        opt_plain.zero_grad()
        y = parsum.sum_models(models, x, **kwargs)
        assert not runs_stacked(y)
        y.pow(2).mean().backward()
        plain_sum(plain, x).pow(2).mean().backward()
        assert_grads_close(models, plain, atol=atol)
        opt.step()
        opt_plain.step()
    assert_params_close(models, plain)


def test_an_optimizer_over_the_stack_trains_models_too_large_to_run_stacked():
    torch.manual_seed(0)
    train_one_by_one_over_the_stack([mlp([256, 256]) for _ in range(8)], rows=1024, atol=1e-5)


@pytest.mark.parametrize(("n", "engine"), [(3, "auto"), (10, "autograd"), (10, "vjp")])
def test_an_optimizer_over_a_stack_run_one_by_one_trains_the_models(n, engine):
    # Fewer models than auto batches (AUTO_STACK_MIN_BATCHED), or an engine that runs models
    # one by one: an optimizer over the stack still gets their gradients (none before, silently).
    torch.manual_seed(0)
    train_one_by_one_over_the_stack([mlp([8]) for _ in range(n)], rows=16, engine=engine)


def test_an_optimizer_over_a_stack_trains_some_of_its_models_or_reordered():
    torch.manual_seed(0)
    models = [mlp([8]) for _ in range(10)]
    plain = copy.deepcopy(models)
    stack = parsum.stack_(models)
    opt = torch.optim.SGD(stack.parameters(), lr=0.1, momentum=0.9)
    opt_plain = torch.optim.SGD([p for m in plain for p in m.parameters()], lr=0.1, momentum=0.9)
    for pick in ([2, 3, 4, 5, 6], list(range(9, -1, -1)), list(range(10)), [0, 9]):
        x = torch.randn(16, IN)
        opt.zero_grad()
        opt_plain.zero_grad()
        parsum.sum_models([models[i] for i in pick], x).pow(2).mean().backward()
        plain_sum([plain[i] for i in pick], x).pow(2).mean().backward()
        # One stacked tensor, one gradient: zero for the models left out (their momentum
        # still moves them, as it would over plain parameters with a zero gradient).
        for p in [p for m in plain for p in m.parameters()]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grad = stack.values["0.weight"].grad
        assert grad is not None
        for i in range(10):
            torch.testing.assert_close(grad[i], plain[i][0].weight.grad)
        opt.step()
        opt_plain.step()
    assert_params_close(models, plain)


def test_models_too_large_to_run_stacked_keep_their_plan(monkeypatch):
    # Their gradients are attached to the stack's buffers by parsum's own node, not by a hook
    # registered on every call, which would make every next call plan anew.
    from parsum import _plans

    # A take_rows table another test left alive would keep any plan from being kept.
    monkeypatch.setattr(_plans, "any_sampled", lambda: False)

    models = [mlp([256, 256]) for _ in range(8)]
    parsum.stack_(models).parameters()  # as for an optimizer: gradients attached to the stack
    x = torch.randn(1024, IN)
    parsum.sum_models(models, x).sum().backward()
    walk = _plans.known_walk(models)
    assert walk is not None
    for _ in range(2):
        parsum.sum_models(models, x).sum().backward()
        assert _plans.known_walk(models) is walk


def test_models_too_large_to_run_stacked_keep_autograds_gradients_without_a_stack_optimizer():
    torch.manual_seed(0)
    models = [mlp([256, 256]) for _ in range(8)]
    plain = copy.deepcopy(models)
    stack = parsum.stack_(models)
    x = torch.randn(8, IN)
    parsum.sum_models(models, x).sum().backward()  # small enough: stacked
    assert stack.values["0.weight"].grad is not None
    x = torch.randn(1024, IN)
    for m in models:
        m.zero_grad()
    y = parsum.sum_models(models, x)
    assert not runs_stacked(y)
    y.pow(2).mean().backward()
    plain_sum(plain, x).pow(2).mean().backward()
    assert_grads_close(models, plain, atol=1e-5)
    grads = [p.grad for m in models for p in m.parameters()]
    assert all(g.untyped_storage().nbytes() == g.nbytes for g in grads)  # not the stack's
    assert stack.values["0.weight"].grad is None  # no stale stacked gradient either


def test_gradients_accumulate_over_stacked_and_one_by_one_calls():
    # Micro-batches of two sizes, one stacked and one too large, with no zero_grad between.
    torch.manual_seed(0)
    models = [mlp([256, 256]) for _ in range(8)]
    plain = copy.deepcopy(models)
    stack = parsum.stack_(models)
    for rows in (8, 1024, 8, 1024):
        # 68K parameters a model: 0.5M parameter-rows stacked, 70M one by one on any budget
        # (NOTE [ Stacked storage sizes ]).
        step_like_plain(models, plain, torch.randn(rows, IN), stacked=rows == 8)
        grad = stack.values["0.weight"].grad
        if grad is not None:  # then it holds every model's gradient
            torch.testing.assert_close(grad[3], models[3][0].weight.grad)


@pytest.mark.parametrize("threads", [1, 2])
def test_auto_batches_stacked_storage_by_size_and_budget(threads):
    # NOTE [ Stacked storage sizes ]: 68K parameters a model at 256 rows, 17.5M parameter-rows:
    # batched with a budget of 2 threads or more, one by one with 1.
    torch.manual_seed(0)
    models = [mlp([256, 256]) for _ in range(8)]
    plain = copy.deepcopy(models)
    parsum.stack_(models)
    x = torch.randn(256, IN)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        budget = parsum._config.thread_budget()
        y = parsum.sum_models(models, x)
    finally:
        torch.set_num_threads(saved)
    assert runs_stacked(y) == (budget > 1)
    y.pow(2).mean().backward()
    plain_sum(plain, x).pow(2).mean().backward()
    assert_grads_close(models, plain, atol=1e-5)


class _Block(nn.Module):
    """Not a Sequential: its stacked forward runs through vmap."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(IN, 512), nn.Linear(512, IN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


def test_auto_batches_stacked_storage_through_vmap_only_up_to_the_groups_limit():
    # NOTE [ Stacked storage sizes ]: 6.7K parameters a model, 1.7M parameter-rows at 256
    # rows (batched) and 6.9M at 1024 (one by one on any budget, 4M at most).
    torch.manual_seed(0)
    models = [_Block() for _ in range(8)]
    plain = copy.deepcopy(models)
    parsum.stack_(models)
    for rows in (256, 1024):
        step_like_plain(models, plain, torch.randn(rows, IN), stacked=rows == 256)


def test_models_that_run_one_by_one_leave_no_stacked_gradient():
    models, _, stack = stacked_and_plain()
    x = torch.randn(8, IN)
    parsum.sum_models(models, x).sum().backward()
    assert stack.values["0.weight"].grad is not None
    slope_of_one(models)
    with pytest.warns(UserWarning, match="stack.parameters"):
        parsum.sum_models(models, x).sum().backward()
    assert stack.values["0.weight"].grad is None  # none asked for (stack.parameters() never called)


def test_state_dict_deepcopy_and_save_load():
    models, _, stack = stacked_and_plain()
    x = torch.randn(4, IN)
    state = models[1].state_dict()
    fresh = mlp([8, 7], nn.LeakyReLU)
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh(x), models[1](x))
    models[2].load_state_dict(fresh.state_dict())  # copies into the stack's slice
    assert torch.equal(stack.values["0.weight"][2], fresh[0].weight)
    saved = io.BytesIO()
    torch.save(models[1].state_dict(), saved)
    alone = io.BytesIO()
    torch.save(fresh.state_dict(), alone)
    assert len(saved.getvalue()) < 1.5 * len(alone.getvalue())  # not the whole stack
    twin = copy.deepcopy(models[0])
    assert twin[0].weight.data_ptr() != models[0][0].weight.data_ptr()
    buffer = io.BytesIO()
    torch.save(models[3], buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded(x), models[3](x))
    y = parsum.sum_models(models, x)
    assert runs_stacked(y)
    torch.testing.assert_close(y, plain_sum(models, x))


def replace_weight(models):
    models[4][0].weight = nn.Parameter(torch.randn_like(models[4][0].weight))


def narrow_one_in_place(models):
    # The addresses kept, the shapes changed: the stacked forward read the whole slices.
    narrow_in_place(models[4], 5)


def class_of_one(models):
    # No attribute changes, as when a lazy module becomes its cls_to_become.
    models[4][1].__class__ = nn.Tanh


def freeze_one(models):
    models[4][0].weight.requires_grad_(False)


def one_to_double(models):
    models[4].double()


def assign_state(models):
    new = {k: torch.randn_like(v) for k, v in models[4].state_dict().items()}
    models[4].load_state_dict(new, assign=True)


def one_to_eval_with_dropout(models):
    for m in models:
        m.append(nn.Dropout(0.5))
    models[4].eval()


def slope_of_one(models):
    models[4][1].negative_slope = 0.3


def forward_hook_on_one(models):
    models[4].register_forward_hook(lambda m, args, out: out * 2)


def gradient_hook_on_one(models):
    models[4][0].weight.register_hook(lambda g: g * 3)


def post_accumulate_hook_on_one(models):
    # The pattern of an optimizer step in a hook: skipping it would silently not train.
    def triple(p: torch.Tensor) -> None:
        p.grad.mul_(3)

    models[4][0].weight.register_post_accumulate_grad_hook(triple)


@pytest.mark.parametrize(
    "change",
    [
        replace_weight,
        narrow_one_in_place,
        class_of_one,
        freeze_one,
        one_to_double,
        assign_state,
        one_to_eval_with_dropout,
        slope_of_one,
        forward_hook_on_one,
        gradient_hook_on_one,
        post_accumulate_hook_on_one,
    ],
)
def test_a_change_after_stacking_is_noticed_and_stays_correct(change):
    models, _, _ = stacked_and_plain()
    x = torch.randn(8, IN)
    parsum.sum_models(models, x).sum().backward()  # a stacked call first
    for m in models:
        m.zero_grad()
    plain = copy.deepcopy(models)
    for ms in (models, plain):
        torch.manual_seed(5)
        change(ms)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-by-one warning, where the models differ
        if change is one_to_double:
            with pytest.raises(parsum.ParsumError):  # model 4 cannot take float32 input, as plainly
                parsum.sum_models(models, x)
            return
        torch.manual_seed(0)
        y = parsum.sum_models(models, x)
    torch.manual_seed(0)
    yp = plain_sum(plain, x)
    if change is not one_to_eval_with_dropout:  # random masks drawn in another order
        torch.testing.assert_close(y, yp, atol=1e-5, rtol=1e-5)
        y.pow(2).sum().backward()
        yp.pow(2).sum().backward()
        assert_grads_close(models, plain, atol=1e-5)


def test_models_that_differ_now_run_one_by_one_with_a_warning_once():
    models, _, _ = stacked_and_plain()
    x = torch.randn(8, IN)
    slope_of_one(models)
    with pytest.warns(UserWarning, match="one by one") as warned:
        y = parsum.sum_models(models, x)
    assert warned[0].filename == __file__  # where the user called sum_models
    assert not runs_stacked(y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parsum.sum_models(models, x)  # said once


def step_over_the_stack(models, plain, opt, opt_plain, x=None) -> None:
    """One training step of the models (an optimizer over their stack) and of their plain
    twins, alike, with no warning that the stack gets no gradient."""
    x = torch.randn(8, IN) if x is None else x
    opt.zero_grad()
    opt_plain.zero_grad()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        parsum.sum_models(models, x).pow(2).mean().backward()
    assert not any("gets no gradient" in str(w.message) for w in warned)
    plain_sum(plain, x).pow(2).mean().backward()
    assert_grads_close(models, plain, atol=1e-5)
    opt.step()
    opt_plain.step()
    assert_params_close(models, plain)


def prune_one(models):
    # The weight becomes weight_orig, the same parameter, read through a forward pre-hook.
    torch.nn.utils.prune.l1_unstructured(models[4][0], "weight", amount=0.5)


def one_to_eval(models):
    models[4].eval()


def forward_pre_hook_on_one(models):
    models[4][2].register_forward_pre_hook(lambda m, args: (args[0] * 0.5,))


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize(
    "optimizer",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.Adam(ps, lr=0.02),
    ],
    ids=["sgd", "adam"],
)
@pytest.mark.parametrize(
    "change",
    [
        slope_of_one,
        forward_hook_on_one,
        forward_pre_hook_on_one,
        gradient_hook_on_one,
        post_accumulate_hook_on_one,
        class_of_one,
        one_to_eval,
        prune_one,
    ],
)
def test_models_that_differ_now_still_train_under_an_optimizer_over_the_stack(
    change, optimizer, flat
):
    # A hook, a setting or eval() on one model makes the models run one by one; their
    # parameters are still the stack's slices, so their gradients still reach the stacked
    # tensors. The optimizer over stack.parameters() had got none, and stopped training
    # every model (a warning once), where the plain loop trains on (NOTE [ Models that differ,
    # trained over the stack ] in parsum._stack).
    models, plain, stack = stacked_and_plain()
    flat_grad = parsum.FlatGrad(stack) if flat else None
    opt = optimizer(stack.parameters())
    opt_plain = optimizer([p for m in plain for p in m.parameters()])
    for step in range(4):
        x = torch.randn(8, IN)
        if step == 1:
            for ms in (models, plain):
                torch.manual_seed(5)
                change(ms)
        step_over_the_stack(models, plain, opt, opt_plain, x)
    if flat_grad is not None and change is not prune_one:  # prune: weight_orig, renamed
        assert one_buffer_for_all(flat_grad, stack)  # still the models' and the stack's


def test_some_of_models_that_differ_still_train_under_an_optimizer_over_the_stack():
    # A call on some of the stack's models runs them one by one (wanted_stacks_among): the
    # same once a hook on one of them makes them differ.
    models, plain, stack = stacked_and_plain()
    opt = torch.optim.SGD(stack.parameters(), lr=0.1)
    opt_plain = torch.optim.SGD([p for m in plain for p in m.parameters()], lr=0.1)
    for ms in (models, plain):
        forward_hook_on_one(ms)
    for step in range(3):
        x = torch.randn(8, IN)
        opt.zero_grad()
        opt_plain.zero_grad()
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            parsum.sum_models(models[2:8], x).pow(2).mean().backward()
        said = ["still reach stack.parameters" in str(w.message) for w in warned]
        assert said == ([True] if step == 0 else [])  # once
        plain_sum(plain[2:8], x).pow(2).mean().backward()
        opt.step()
        opt_plain.step()
        assert_params_close(models, plain)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize(
    "change, how",
    [(slope_of_one, "deepcopy"), (slope_of_one, "pickle"), (forward_hook_on_one, "deepcopy")],
)
def test_a_copy_of_models_that_differ_still_trains_under_an_optimizer_over_the_stack(
    change, how, flat
):
    # A checkpoint of the training state taken while the models differ: the copied models are
    # stacked into the copied tensors all the same, so the copied optimizer steps them (NOTE
    # [ Models that differ, trained over the stack ]); they had their own storage, and it
    # stepped nothing.
    models, plain, stack = stacked_and_plain()
    flat_grad = parsum.FlatGrad(stack) if flat else None
    opt = torch.optim.SGD(stack.parameters(), lr=0.1, momentum=0.9)
    opt_plain = torch.optim.SGD([p for m in plain for p in m.parameters()], lr=0.1, momentum=0.9)
    for ms in (models, plain):
        change(ms)
    for step in range(5):
        if step in (2, 3):  # a copy, and a copy of that copy
            state = (models, stack, opt, flat_grad)
            if how == "pickle":
                buffer = io.BytesIO()
                torch.save(state, buffer)
                buffer.seek(0)
                models, stack, opt, flat_grad = torch.load(buffer, weights_only=False)
            else:
                models, stack, opt, flat_grad = copy.deepcopy(state)
            plain, opt_plain = copy.deepcopy((plain, opt_plain))
        step_over_the_stack(models, plain, opt, opt_plain)
    assert all(
        m[0].weight.data_ptr() == stack.values["0.weight"][k].data_ptr()
        for k, m in enumerate(models)
    )


@pytest.mark.parametrize("change", [one_to_eval, forward_hook_on_one])
@pytest.mark.parametrize("copied", [False, True])
def test_a_layer_frozen_on_every_model_while_they_differ_rests_and_the_others_train(change, copied):
    # Frozen and unfrozen again on every model while one is in eval() or hooked (and in a
    # copy of that state): the stacked tensors are taken as they are, the frozen layer rests
    # as in the plain loop (momentum and weight decay would move it with a zero gradient), the
    # others train; the stack had got no gradient from the freeze on.
    models, plain, stack = stacked_and_plain()
    opt = torch.optim.SGD(stack.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    opt_plain = torch.optim.SGD(
        [p for m in plain for p in m.parameters()], lr=0.1, momentum=0.9, weight_decay=0.1
    )
    for ms in (models, plain):
        change(ms)
    for step in range(6):
        if step == 1 and copied:
            models, stack, opt = copy.deepcopy((models, stack, opt))
            plain, opt_plain = copy.deepcopy((plain, opt_plain))
        if step in (2, 4):
            for m in (*models, *plain):
                m[0].weight.requires_grad_(step == 4)
        step_over_the_stack(models, plain, opt, opt_plain)


def test_a_model_frozen_alone_stops_an_optimizer_over_the_stack_with_a_warning():
    # One model's slice of a stacked tensor cannot be frozen alone: an optimizer over the
    # stack would move it with a zero gradient (momentum, weight decay). It gets no gradient
    # instead, and says so, until the models are identical again.
    models, _, stack = stacked_and_plain()
    opt = torch.optim.SGD(stack.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, IN)
    parsum.sum_models(models, x).pow(2).mean().backward()
    opt.step()
    freeze_one(models)
    frozen = models[4][0].weight.detach().clone()
    opt.zero_grad()
    with pytest.warns(UserWarning, match="gets no gradient"):
        parsum.sum_models(models, x).pow(2).mean().backward()
    assert all(t.grad is None for t in stack.values.values())
    opt.step()
    assert torch.equal(models[4][0].weight, frozen)


def test_a_change_made_to_every_model_restacks_silently():
    models, _, stack = stacked_and_plain()
    x = torch.randn(8, IN)
    parsum.sum_models(models, x)
    for m in models:
        m.double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = parsum.sum_models(models, x.double())
    assert runs_stacked(y) and y.dtype == torch.float64
    assert stack.values["0.weight"].dtype == torch.float64
    assert models[7][0].weight.data_ptr() == stack.values["0.weight"][7].data_ptr()


def test_an_attribute_of_a_linear_layer_that_the_forward_reads_is_watched():
    # The check took a Linear's weight and bias alone, all its own forward reads; a model of
    # other code reads more of it, and the stacked forward took the first model's value.
    models, plain, _ = stacked_and_plain("two-layer")
    x = torch.randn(8, IN)
    parsum.sum_models(models, x)
    for ms in (models, plain):
        ms[4].a.gain = 2.0
    with pytest.warns(UserWarning, match="one by one"):
        torch.testing.assert_close(parsum.sum_models(models, x), plain_sum(plain, x))
    step_like_plain(models, plain, x, stacked=False)


def test_a_square_weight_transposed_in_place_is_noticed():
    # The same address and elements, other strides: the stacked forward read the slice as it
    # was, silently. Still identical to the others, the model is stacked again with them.
    models, plain, stack = stacked_and_plain("square")
    x = torch.randn(8, IN)
    parsum.sum_models(models, x)
    for ms in (models, plain):
        ms[4][2].weight.data = ms[4][2].weight.data.t()
    assert models[4][2].weight.data_ptr() == stack.values["2.weight"][4].data_ptr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(parsum.sum_models(models, x), plain_sum(plain, x))
        step_like_plain(models, plain, x, stacked=True)
    assert models[4][2].weight.data_ptr() == stack.values["2.weight"][4].data_ptr()


@pytest.mark.parametrize("change", ["narrowed in place", "activation's class"])
def test_a_change_to_every_model_alike_restacks_silently(change):
    models, plain, stack = stacked_and_plain()
    x = torch.randn(8, IN)
    parsum.sum_models(models, x)
    for ms in (models, plain):
        for m in ms:
            if change == "narrowed in place":
                narrow_in_place(m, 5)
            else:
                m[1].__class__ = nn.Tanh
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(parsum.sum_models(models, x), plain_sum(plain, x))
        step_like_plain(models, plain, x, stacked=True)
    width = 5 if change == "narrowed in place" else 8
    assert stack.values["0.weight"].shape == (10, width, IN)
    assert models[7][0].weight.data_ptr() == stack.values["0.weight"][7].data_ptr()


def _train_step_like_plain(models, plain, opt, plain_opt, x, flat=False):
    """A step of the stacked models and of their plain twins, each with its optimizer: the
    gradients and the stepped parameters alike (with a ``flat`` FlatGrad, whose .grad are
    never None, a zero view where the plain one is None). The stacked models' sum."""
    y = parsum.sum_models(models, x)
    y.pow(2).mean().backward()
    plain_sum(plain, x).pow(2).mean().backward()
    for got, want in zip(unique_params(models), unique_params(plain)):
        if flat and want.grad is None:
            assert not got.grad.any()
        else:
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)
    opt.step()
    plain_opt.step()
    for m, p in zip(models, plain):
        for a, b in zip(m.parameters(), p.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    return y


@pytest.mark.parametrize("zeroed", [True, False])
def test_an_optimizer_over_the_stack_keeps_training_after_the_models_are_cast(zeroed):
    # NOTE [ Gradients across a restack ]: after a step, a cast (which keeps each .grad
    # object but replaces its data) had the stacked tensors get no gradient, so the optimizer
    # over the stack stepped nothing, and the models' gradients added the zeroed step's.
    models, plain, stack = stacked_and_plain()
    opt = torch.optim.SGD(stack.parameters(), lr=0.01, momentum=0.9)
    plain_opt = torch.optim.SGD([p for m in plain for p in m.parameters()], lr=0.01, momentum=0.9)
    for step in range(4):
        x = torch.randn(8, IN, dtype=torch.float64 if step >= 2 else torch.float32)
        if step == 2:  # mid-training, the gradients zeroed or still there
            for ms, o in ((models, opt), (plain, plain_opt)):
                if zeroed:
                    o.zero_grad()
                for m in ms:
                    m.double()
        elif step != 3 or zeroed:
            opt.zero_grad()
            plain_opt.zero_grad()
        _train_step_like_plain(models, plain, opt, plain_opt, x)
    assert stack.values["0.weight"].dtype == torch.float64


@pytest.mark.parametrize("name", ["0.weight", "4.bias"])  # 4.bias: the last trainable one
@pytest.mark.parametrize("flat", [False, True], ids=["own buffers", "FlatGrad(stack)"])
@pytest.mark.parametrize("zeroed", [True, False])
def test_an_optimizer_over_the_stack_trains_a_layer_frozen_then_unfrozen(zeroed, flat, name):
    # NOTE [ Gradients across a restack ]: a layer frozen on every model (fine-tuning) and
    # unfrozen later kept its models' gradients of before as gradients of their own, so the
    # stacked tensor got no gradient from then on and the optimizer over the stack never
    # stepped that layer again, silently. With a FlatGrad over the stack, the restack forgot
    # that the optimizer had zeroed the block, and the next backward added to the stale step.
    # Frozen, a model's last trainable tensor left the order of its tensors as it was, and
    # the stack had gone on training it.
    models, plain, stack = stacked_and_plain()
    if flat:
        parsum.FlatGrad(stack)
    opt = torch.optim.Adam(stack.parameters(), lr=1e-2)
    plain_opt = torch.optim.Adam([p for m in plain for p in m.parameters()], lr=1e-2)
    for step in range(7):
        if step in (2, 5):  # frozen for steps 2-4, on every model at once
            for m in (*models, *plain):
                m.get_parameter(name).requires_grad_(step == 5)
        if zeroed or step not in (2, 5):  # or the gradients of before kept across the change
            opt.zero_grad()
            plain_opt.zero_grad()
        x = torch.randn(8, IN)
        y = _train_step_like_plain(models, plain, opt, plain_opt, x, flat=flat)
        assert runs_stacked(y)


def test_a_frozen_last_layer_of_stacked_models_stays_frozen():
    # Freezing each model's last trainable tensor kept the order of the models' tensors, so
    # the stack took it for a flag changed elsewhere and went on computing its gradient: an
    # optimizer over the models' parameters then trained the frozen layer, silently.
    models, plain, _ = stacked_and_plain()
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    plain_opt = torch.optim.SGD([p for m in plain for p in m.parameters()], lr=0.1)
    for m in (*models, *plain):
        m[4].bias.requires_grad_(False)
    frozen = [m[4].bias.detach().clone() for m in models]
    for _ in range(2):
        opt.zero_grad()
        plain_opt.zero_grad()
        assert runs_stacked(
            _train_step_like_plain(models, plain, opt, plain_opt, torch.randn(8, IN))
        )
    assert all(m[4].bias.grad is None for m in models)
    assert all(torch.equal(m[4].bias, f) for m, f in zip(models, frozen))


def test_an_optimizer_over_the_stack_steps_gradients_set_by_hand():
    # Gradients of the models' own (set by hand: loaded, or replaced by a tool that clones
    # them) had left the stacked .grad None for good: the optimizer over the stack stepped
    # nothing of that name from then on. The stack takes them in as its buffer's views.
    models, plain, stack = stacked_and_plain()
    opt = torch.optim.SGD(stack.parameters(), lr=0.1, momentum=0.9)
    plain_opt = torch.optim.SGD([p for m in plain for p in m.parameters()], lr=0.1, momentum=0.9)
    for step in range(4):
        opt.zero_grad()
        plain_opt.zero_grad()
        x = torch.randn(8, IN)
        if step == 1:
            for ms in (models, plain):
                for k, m in enumerate(ms):
                    m[0].weight.grad = torch.full_like(m[0].weight, 0.01 * k)  # by hand
        _train_step_like_plain(models, plain, opt, plain_opt, x)
        assert models[3][0].weight.grad.data_ptr() == stack.values["0.weight"].grad[3].data_ptr()


@pytest.mark.parametrize("over", ["stack", "models"])
def test_a_flatgrad_made_before_the_stacked_models_are_cast_is_named_until_replaced(over):
    # NOTE [ Stale slots ] in parsum._grads: the restacked models' float64 gradients had gone
    # around the float32 FlatGrad, silently.
    models, plain, stack = stacked_and_plain()
    parsum.FlatGrad(stack if over == "stack" else models)
    x = torch.randn(8, IN)
    parsum.sum_models(models, x).sum().backward()
    for m in (*models, *plain):
        m.double()
    for _ in range(2):  # named again on the next call, until a new FlatGrad
        with pytest.raises(
            parsum.ParsumError, match=r"'0.weight' of models\[0\] .* now torch.float64"
        ):
            parsum.sum_models(models, x.double())
    flat = parsum.FlatGrad(stack if over == "stack" else models).zero_()
    for m in plain:
        m.zero_grad()
    parsum.sum_models(models, x.double()).pow(2).sum().backward()
    plain_sum(plain, x.double()).pow(2).sum().backward()
    for got, want in zip(param_grads(models), param_grads(plain)):
        torch.testing.assert_close(got, want)
    buffer = flat.flat.untyped_storage().data_ptr()
    assert all(
        p.grad.untyped_storage().data_ptr() == buffer for m in models for p in m.parameters()
    )


# NOTE [ Stacking stacked models ]: stack_ over stacked models made a new stack, and an
# optimizer over the first one's parameters() stepped tensors no model viewed any more: the
# models stopped training, silently (these 3 cases failed, and stack_ over some of a stack's
# models raised nothing).
# With a FlatGrad over the stack, a stack that gave up after its optimizer zeroed the gradients
# forgot that they were zeroed: the next backward added to the zeroed step's (failed before).
@pytest.mark.parametrize("flat", [False, True], ids=["own buffers", "FlatGrad(stack)"])
@pytest.mark.parametrize("before", ["as it is", "given up", "cast"])
def test_stack_again_is_the_same_stack_and_keeps_its_optimizer_training(before, flat):
    models, plain, stack = stacked_and_plain()
    flat_grad = parsum.FlatGrad(stack) if flat else None
    opt = torch.optim.Adam(stack.parameters(), lr=0.01)
    plain_opt = torch.optim.Adam(unique_params(plain), lr=0.01)
    x = torch.randn(8, IN)
    for step in range(4):
        opt.zero_grad()
        plain_opt.zero_grad()
        if step == 2:
            if before == "given up":
                with pytest.warns(UserWarning, match="stack_ is called again"):
                    stack.give_up("the test said so")
            elif before == "cast":
                for ms in (models, plain):
                    ms[3].double()
                    ms[3].float()  # each parameter in storage of its own
                if flat:  # its slots no longer fit: a FlatGrad made again (NOTE [ Stale slots ])
                    flat_grad = parsum.FlatGrad(stack)
            assert parsum.stack_(models) is stack
            assert runs_stacked(parsum.sum_models(models, x))
        _train_step_like_plain(models, plain, opt, plain_opt, x, flat=flat)
        if flat_grad is not None:
            held = torch.cat([p.grad.flatten() for m in models for p in m.parameters()])
            torch.testing.assert_close(flat_grad.flat.sort().values, held.sort().values)
    assert_params_close(models, plain)
    assert models[3][0].weight.data_ptr() == stack.values["0.weight"][3].data_ptr()


def test_a_stack_that_gives_up_after_its_optimizer_zeroed_a_flatgrad_keeps_them_zeroed():
    models, plain, stack = stacked_and_plain()
    parsum.FlatGrad(stack)
    opt = torch.optim.SGD(stack.parameters(), lr=0.1)
    x = torch.randn(8, IN)
    parsum.sum_models(models, x).pow(2).mean().backward()
    opt.zero_grad()  # the stacked .grad None: every model's gradient zeroed
    with pytest.warns(UserWarning, match="one by one"):
        stack.give_up("the test said so")
    parsum.sum_models(models, x).pow(2).mean().backward()  # one by one, into the views
    plain_sum(plain, x).pow(2).mean().backward()
    assert_grads_close(models, plain, atol=1e-6)


def test_stack_over_some_of_a_stacks_models_raises_and_changes_nothing():
    models, _, stack = stacked_and_plain()
    values = dict(stack.values)
    for some in (models[:4], models[::-1], [*models, mlp([8])]):
        with pytest.raises(
            parsum.ParsumError, match=r"models\[0\] \(Sequential\) is in a stack of 10"
        ):
            parsum.stack_(some)
    assert all(stack.values[k] is v for k, v in values.items())
    assert runs_stacked(parsum.sum_models(models, torch.randn(8, IN)))
    stack.unstack_()  # then they may be stacked otherwise
    assert len(parsum.stack_(models[:4])) == 4


def test_stack_again_over_models_no_longer_identical_raises_and_changes_nothing():
    models, _, stack = stacked_and_plain()
    models[2].double()
    with pytest.raises(parsum.ParsumError, match=r"models\[2\] \(Sequential\) differs"):
        parsum.stack_(models)
    assert stack.values["0.weight"].dtype == torch.float32


def test_unstack_gives_each_model_its_storage_back():
    models, plain, stack = stacked_and_plain()
    stack.unstack_()
    x = torch.randn(8, IN)
    with torch.no_grad():
        models[0][0].weight.add_(1.0)
        plain[0][0].weight.add_(1.0)
    # Each model's own storage again (auto may still batch them, from their own tensors).
    assert len({m[0].weight.untyped_storage().data_ptr() for m in models}) == len(models)
    y = parsum.sum_models(models, x)
    torch.testing.assert_close(y, plain_sum(plain, x))


def test_bad_input_raises_naming_a_model_and_changes_nothing():
    models, _, _ = stacked_and_plain()
    with pytest.raises(parsum.ParsumError, match=r"model 0 \(Sequential\)"):
        parsum.sum_models(models, torch.randn(8, IN + 1)).sum().backward()
    assert all(g is None for g in param_grads(models))
    y = parsum.sum_models(models, torch.randn(8, IN))
    assert runs_stacked(y)  # a bad call does not give the stack up


def test_bitwise_identical_for_any_n_jobs_and_grad_of_inputs_only():
    models, _, _ = stacked_and_plain()
    x = torch.randn(8, IN, requires_grad=True)
    ys = [parsum.sum_models(models, x, n_jobs=n) for n in (1, 2, 4, None)]
    assert all(torch.equal(ys[0], y) for y in ys)
    (gx,) = torch.autograd.grad(ys[0].sum(), x)
    assert gx.shape == x.shape
    assert all(g is None for g in param_grads(models))  # as autograd.grad leaves .grad alone


def test_auto_does_not_stack_large_models_and_engine_stacked_does():
    torch.manual_seed(0)
    models = [mlp([512, 512]) for _ in range(8)]
    parsum.stack_(models)
    x = torch.randn(512, IN)
    assert not runs_stacked(parsum.sum_models(models, x))
    assert runs_stacked(parsum.sum_models(models, x, engine="stacked"))
    assert not runs_stacked(parsum.sum_models(models, x, engine="autograd"))


def test_under_no_grad_nothing_is_recorded():
    models, plain, _ = stacked_and_plain()
    x = torch.randn(8, IN)
    with torch.no_grad():
        y = parsum.sum_models(models, x)
    assert y.grad_fn is None and not y.requires_grad
    torch.testing.assert_close(y, plain_sum(plain, x))


def test_concurrent_callers_on_one_stack():
    models, plain, _ = stacked_and_plain()
    x = torch.randn(8, IN)
    errors: list[BaseException] = []

    def work() -> None:
        try:  # NOTE [ Lasting aliases ]: an alias shared by threads' graphs failed here
            for _ in range(50):
                parsum.sum_models(models, x).sum().backward()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    assert not errors and not any(t.is_alive() for t in threads)
    plain_sum(plain, x).sum().backward()
    for g, h in zip(param_grads(models), param_grads(plain)):
        torch.testing.assert_close(g, 150 * h, atol=1e-3, rtol=1e-4)


def test_graphs_alive_together_each_give_their_gradient():
    # NOTE [ Lasting aliases ]: graphs alive together each read a leaf of their own; each
    # backward hands its own gradient to the models, in whatever order they are pulled back.
    models, plain, _ = stacked_and_plain()
    xs = [torch.randn(8, IN) for _ in range(3)]
    losses = [parsum.sum_models(models, x).pow(2).sum() for x in xs]
    losses[2].backward(retain_graph=True)
    losses[0].backward()
    losses[2].backward()
    losses[1].backward()
    for x, times in zip(xs, (1, 1, 2)):
        (times * plain_sum(plain, x).pow(2).sum()).backward()
    assert_grads_close(models, plain, atol=1e-5)


def test_a_graph_pulled_back_after_a_restack_lends_no_stale_alias():
    # NOTE [ Lasting aliases ]: a graph made before the models were stacked again gives its
    # alias back only if it still views the stack's storage; the next call must read the new.
    models, plain, _ = stacked_and_plain()
    x = torch.randn(8, IN)
    before = parsum.sum_models(models, x).pow(2).sum()
    with torch.no_grad():
        for m, q in zip(models, plain):
            m[0].weight.data = m[0].weight.data + 1  # new storage: the next call restacks
            q[0].weight.add_(1)
    after = parsum.sum_models(models, x).pow(2).sum()
    before.backward()  # its graph read the old storage: first back
    after.backward()
    for m in models:
        m.zero_grad()
    parsum.sum_models(models, x).pow(2).sum().backward()
    plain_sum(plain, x).pow(2).sum().backward()
    assert_grads_close(models, plain, atol=1e-5)


def test_calls_with_and_without_step_in_backward_alternate():
    # A call with step_in_backward reads aliases of its own, whose hooks step; the lasting ones
    # of other calls must neither step nor lose a gradient meanwhile.
    models, plain, _ = stacked_and_plain()
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
    plain_opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in plain]
    x = torch.randn(8, IN)
    for step in range(4):
        if step % 2:
            parsum.sum_models(models, x, step_in_backward=sib).pow(2).mean().backward()
            plain_sum(plain, x).pow(2).mean().backward()
            for opt in plain_opts:
                opt.step()
                opt.zero_grad()
        else:
            parsum.sum_models(models, x).pow(2).mean().backward()
            plain_sum(plain, x).pow(2).mean().backward()
            assert_grads_close(models, plain, atol=1e-5)
            for m, q in zip(models, plain):
                m.zero_grad()
                q.zero_grad()
        assert_params_close(models, plain)


def test_repeated_calls_leave_nothing_behind():
    import gc
    import weakref

    from torch.utils.hooks import RemovableHandle

    models, _, stack = stacked_and_plain()
    x = torch.randn(8, IN)
    parsum.sum_models(models, x).sum().backward()
    hooks = RemovableHandle.next_id
    for _ in range(5):
        parsum.sum_models(models, x).sum().backward()
    assert RemovableHandle.next_id == hooks  # the aliases' hooks are kept (Lasting aliases)
    ref = weakref.ref(stack)
    del stack, models
    gc.collect()
    assert ref() is None


def _hooked(model: nn.Sequential) -> nn.Sequential:
    """``model`` with a forward hook on its last layer."""
    model[-1].register_forward_hook(lambda *args: None)
    return model


class _Scaled(nn.Module):
    """A Linear times a learned scale held as a plain tensor attribute, not a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(IN, OUT)
        self.scale = torch.ones(1, requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) * self.scale


def _weight_normed() -> nn.Sequential:
    """An MLP whose first layer's weight is parametrized (weight normalization)."""
    model = mlp([8])
    torch.nn.utils.parametrizations.weight_norm(model[0])
    return model


def _one_frozen(k: int, name: str) -> list[nn.Module]:
    """Two identical MLPs, model ``k``'s parameter ``name`` frozen."""
    models = [mlp([8]), mlp([8])]
    dict(models[k].named_parameters())[name].requires_grad_(False)
    return models


@pytest.mark.parametrize(
    ("models", "match"),
    [
        (lambda: [mlp([8])], "at least two"),
        # the first difference named (before: "in its modules, settings, training flags or
        # parameter names, shapes, dtypes or devices" for every one)
        (lambda: [mlp([8]), mlp([9])], r"models\[1\].*its module '0' has out_features=9 where"),
        (lambda: [mlp([8]), mlp([8], nn.ReLU)], r"its module '1' is a ReLU where models\[0\]'s"),
        (lambda: [mlp([8]), mlp([8]).eval()], r"its root module is in eval mode where"),
        (lambda: [mlp([8]), mlp([8]).double()], r"its '0.weight' has dtype torch.float64 where"),
        (lambda: [mlp([8]), nn.Sequential(*mlp([8]), nn.Tanh())], r"its modules: 5 where .* 4"),
        (
            lambda: [nn.Linear(2, 2), nn.Linear(2, 2, bias=False)],
            r"models\[0\] has 'bias', which it lacks",
        ),
        # the difference named where it is a frozen parameter (hidden among "names" before)
        (lambda: _one_frozen(1, "2.bias"), r"models\[1\].*its '2.bias' is frozen where"),
        (lambda: _one_frozen(0, "0.weight"), r"models\[1\].*its '0.weight' is trainable where"),
        (lambda: [mlp([8]), "x"], r"models\[1\] is a str"),
        (lambda: [nn.Linear(2, 2)] * 2, r"models\[1\].*shares"),
        (lambda: [nn.BatchNorm1d(3), nn.BatchNorm1d(3)], r"models\[0\].*training mode"),
        # parametrize makes a class for each module: "a ParametrizedLinear where models[0]'s
        # is a ParametrizedLinear" before
        (lambda: [_weight_normed(), _weight_normed()], r"another class .*utils.parametrize makes"),
        # why a model cannot be stacked, named (before: one sentence listing every reason)
        (
            lambda: [mlp([8]), _hooked(mlp([8]))],
            r"models\[1\].*module '2' \(Linear\) has a forward hook",
        ),
        (lambda: [_Scaled(), _Scaled()], r"models\[0\].*tensor attribute 'scale' requires grad"),
    ],
)
def test_stack_refuses_models_it_cannot_stack(models, match):
    ms = models()
    before = [p.data_ptr() for m in ms if isinstance(m, nn.Module) for p in m.parameters()]
    with pytest.raises(parsum.ParsumError, match=match):
        parsum.stack_(ms)
    after = [p.data_ptr() for m in ms if isinstance(m, nn.Module) for p in m.parameters()]
    assert before == after


def test_a_stack_is_a_sequence_of_its_models():
    models, _, stack = stacked_and_plain()
    assert len(stack) == len(models) and stack[2] is models[2] and list(stack) == models
    x = torch.randn(4, IN)
    assert runs_stacked(parsum.sum_models(stack, x))
    assert "Stack(10 x Sequential" in repr(stack)


# -- FlatGrad over stacked models ----------------------------------------------------------


def flat_is_the_grads(flat, models) -> bool:
    grads = [p.grad for m in models for p in m.parameters()]
    views = all(
        g is not None and g.untyped_storage().data_ptr() == flat.flat.untyped_storage().data_ptr()
        for g in grads
    )
    return views and torch.equal(flat.flat, torch.cat([g.flatten() for g in grads]))


@pytest.mark.parametrize("order", ["flat first", "stack first"])
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("batched", [True, False])
def test_flatgrad_over_stacked_models_holds_their_gradients(order, set_to_none, batched):
    models = members() if batched else [mlp([256, 256]) for _ in range(4)]  # auto: one by one
    plain = copy.deepcopy(models)
    if order == "stack first":
        stack = parsum.stack_(models)
        flat = parsum.FlatGrad(models)
    else:
        flat = parsum.FlatGrad(models)
        stack = parsum.stack_(models)
    stack.parameters()  # as for an optimizer over the stack too, which then gets no gradient:
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    opt_plain = torch.optim.SGD([p for m in plain for p in m.parameters()], lr=0.1)
    with pytest.warns(UserWarning, match="stack.parameters.. would not step them"):
        parsum.sum_models(models, torch.randn(8 if batched else 1024, IN)).sum().backward()
    for _ in range(3):
        x = torch.randn(8 if batched else 1024, IN)
        opt.zero_grad(set_to_none=set_to_none)
        opt_plain.zero_grad()
        y = parsum.sum_models(models, x)
        assert runs_stacked(y) == batched
        y.pow(2).mean().backward()
        plain_sum(plain, x).pow(2).mean().backward()
        assert_grads_close(models, plain, atol=1e-5)
        assert flat_is_the_grads(flat, models)  # the buffer holds this step's gradients
        opt.step()
        opt_plain.step()
    assert_params_close(models, plain)


def params_of(models):
    return [p for m in models for p in m.parameters()]


def one_buffer_for_all(flat, stack) -> bool:
    """Whether the FlatGrad's buffer is, name by name, the stacked tensors' ``.grad`` and the
    models' ``.grad`` (NOTE [ One buffer for a stack ])."""
    buffer = flat.flat
    start, found = 0, []
    for name, _ in stack[0].named_parameters():
        stacked = stack.values[name]
        g = stacked.grad
        size = stacked.numel()
        if g is None or g.data_ptr() != buffer[start:].data_ptr() or g.shape != stacked.shape:
            return False
        for k, m in enumerate(stack):
            if m.get_parameter(name).grad.data_ptr() != g[k].data_ptr():
                return False
        found.append(g.flatten())
        start += size
    return start == buffer.numel() and torch.equal(torch.cat(found), buffer)


@pytest.mark.parametrize("zero", ["stack optimizer", "stack optimizer in place", "flat", "models"])
@pytest.mark.parametrize("batched", [True, False])
def test_flatgrad_over_a_stack_is_one_buffer_for_the_models_the_stack_and_itself(zero, batched):
    models = members() if batched else [mlp([256, 256]) for _ in range(4)]  # auto: one by one
    plain = copy.deepcopy(models)
    stack = parsum.stack_(models)
    flat = parsum.FlatGrad(stack)
    opt = torch.optim.SGD(stack.parameters(), lr=0.1, momentum=0.9)
    opt_plain = torch.optim.SGD([p for m in plain for p in m.parameters()], lr=0.1, momentum=0.9)
    rows = 8 if batched else 1024
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "the stack's tensors get none"
        for _ in range(3):
            if zero == "stack optimizer":
                opt.zero_grad()
            elif zero == "stack optimizer in place":
                opt.zero_grad(set_to_none=False)
            elif zero == "flat":
                flat.zero_()
            else:
                for m in models:
                    m.zero_grad()
            opt_plain.zero_grad()
            for _ in range(2):  # two micro-batches accumulate
                x = torch.randn(rows, IN)
                y = parsum.sum_models(models, x)
                assert runs_stacked(y) == batched
                y.pow(2).mean().backward()
                plain_sum(plain, x).pow(2).mean().backward()
            assert_grads_close(models, plain, atol=1e-5)
            assert one_buffer_for_all(flat, stack)
            opt.step()
            opt_plain.step()
    assert_params_close(models, plain)


def test_flatgrad_over_a_stack_takes_in_grads_set_by_hand_or_none():
    models, plain, stack = stacked_and_plain()
    flat = parsum.FlatGrad(stack)
    x = torch.randn(8, IN)
    parsum.sum_models(models, x).sum().backward()
    plain_sum(plain, x).sum().backward()
    for ms in (models, plain):
        ms[2][0].weight.grad = torch.ones_like(ms[2][0].weight)  # by hand
        ms[5][0].weight.grad = None
    y = parsum.sum_models(models, x)
    assert runs_stacked(y)
    y.pow(2).sum().backward()
    plain_sum(plain, x).pow(2).sum().backward()
    assert_grads_close(models, plain, atol=1e-5)
    assert one_buffer_for_all(flat, stack)


def test_flatgrad_over_a_stack_is_laid_out_name_by_name():
    models, _, stack = stacked_and_plain()
    flat = parsum.FlatGrad(stack)
    names = [n for n, _ in models[0].named_parameters()]
    assert flat.params == [m.get_parameter(n) for n in names for m in models]
    offset = 0
    for n in names:
        for m in models:
            grad = m.get_parameter(n).grad
            assert grad.data_ptr() == flat.flat[offset:].data_ptr()
            offset += grad.numel()
    assert offset == flat.flat.numel()


@pytest.mark.parametrize("over", ["models", "stack"])
def test_compensated_flatgrad_over_stacked_models_keeps_small_additions(over):
    """float32: a large micro-batch, then many small ones; against float64 sums."""
    torch.manual_seed(0)
    models = members(n=8)
    ref = [m.double() for m in copy.deepcopy(models)]
    batches = [torch.randn(8, IN) * s for s in [1e3] + [1e-2] * 200]
    errors = {}
    for compensated in (False, True):
        ms = copy.deepcopy(models)
        # A FlatGrad lives as long as its parameters (their hooks hold it).
        if over == "models":
            parsum.FlatGrad(ms, compensated=compensated)
            parsum.stack_(ms)
        else:
            parsum.FlatGrad(parsum.stack_(ms), compensated=compensated)
        for b in batches:
            y = parsum.sum_models(ms, b)
            assert runs_stacked(y)
            y.sum().backward()
        errors[compensated] = torch.cat([p.grad.double().flatten() for p in params_of(ms)])
    params = params_of(ref)
    want = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    for b in batches:
        grads = torch.autograd.grad(plain_sum(ref, b.double()).sum(), params)
        want += torch.cat([g.flatten() for g in grads])
    err = {k: (v - want).abs().sum().item() for k, v in errors.items()}
    assert err[False] > 4 * err[True]


# -- StepInBackward over stacked models ----------------------------------------------------

SIB_OPTIMIZERS = [
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    (torch.optim.Adam, dict(lr=1e-2)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, foreach=True)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, fused=True, amsgrad=True)),
]


@pytest.mark.parametrize(("cls", "kw"), SIB_OPTIMIZERS, ids=lambda v: getattr(v, "__name__", ""))
def test_step_in_backward_over_stacked_models_equals_plain_training(cls, kw):
    torch.manual_seed(0)
    models = members(n=10, dtype=torch.float64)
    plain = copy.deepcopy(models)
    parsum.stack_(models)
    sib = parsum.StepInBackward(models, cls, **kw)
    opt = cls([p for m in plain for p in m.parameters()], **kw)
    for _ in range(3):
        x = torch.randn(8, IN, dtype=torch.float64)
        y = parsum.sum_models(models, x, step_in_backward=sib)
        assert runs_stacked(y)
        y.pow(2).mean().backward()
        assert all(p.grad is None for m in models for p in m.parameters())
        plain_sum(plain, x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for m, q in zip(models, plain):
        for a, b in zip(m.parameters(), q.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_step_in_backward_over_stacked_models_steps_not_under_autograd_grad():
    models = members(n=10)
    parsum.stack_(models)
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
    before = [p.detach().clone() for m in models for p in m.parameters()]
    y = parsum.sum_models(models, torch.randn(8, IN), step_in_backward=sib)
    assert runs_stacked(y)
    x = torch.randn(8, IN, requires_grad=True)
    y = parsum.sum_models(models, x, step_in_backward=sib)
    torch.autograd.grad(y.sum(), x)
    after = [p.detach() for m in models for p in m.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_step_in_backward_over_stacked_models_names_a_failing_step():
    models = members(n=10)
    parsum.stack_(models)

    class Broken(torch.optim.SGD):
        def step(self, closure=None):
            if self is sib.optimizers[3]:
                raise RuntimeError("no step today")
            return super().step(closure)

    sib = parsum.StepInBackward(models, Broken, lr=0.1)
    y = parsum.sum_models(models, torch.randn(8, IN), step_in_backward=sib)
    assert runs_stacked(y)
    with pytest.raises(
        parsum.ParsumError,
        match=r"model 3 \(Sequential\) raised RuntimeError in its optimizer step: no step "
        r"today; the optimizer step already ran for models \[0, 1, 2\]",
    ):
        y.sum().backward()


def test_step_in_backward_over_stacked_models_keeps_lr_schedulers_and_step_hooks():
    # One step over the stack records the step for each model's LR scheduler (which warns of
    # a scheduler stepped before its optimizer otherwise); an optimizer with a step hook of
    # its own steps itself, so that the hook runs.
    models = members(n=10)
    parsum.stack_(models)
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1)
    schedulers = [
        torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in sib.optimizers
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for _ in range(2):
            y = parsum.sum_models(models, torch.randn(8, IN), step_in_backward=sib)
            assert runs_stacked(y)
            y.pow(2).mean().backward()
            for s in schedulers:
                s.step()
    assert all(o.param_groups[0]["lr"] == pytest.approx(0.025) for o in sib.optimizers)
    hooked = []
    sib.optimizers[4].register_step_pre_hook(lambda opt, args, kwargs: hooked.append(opt))
    parsum.sum_models(models, torch.randn(8, IN), step_in_backward=sib).sum().backward()
    assert hooked == [sib.optimizers[4]]


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_step_in_backward_over_stacked_models_keeps_its_optimizer(momentum):
    # The optimizer over the stack and the state it installed in the models' optimizers are
    # kept from step to step, also where the optimizer keeps no state (SGD without momentum,
    # whose models' entries it had found "changed" on every step, gathering anew each time).
    models = members(n=10)
    parsum.stack_(models)
    sib = parsum.StepInBackward(models, torch.optim.SGD, lr=0.1, momentum=momentum)
    kept = []
    for _ in range(3):
        y = parsum.sum_models(models, torch.randn(8, IN), step_in_backward=sib)
        assert runs_stacked(y)
        y.pow(2).mean().backward()
        (stacked,) = sib._stacked.values()
        kept.append(stacked.optimizer)
    assert kept[1] is kept[2]


def test_step_in_backward_without_every_stacked_model_is_refused():
    models = members(n=10)
    parsum.stack_(models)
    sib = parsum.StepInBackward(models[1:], torch.optim.SGD, lr=0.1)
    with pytest.raises(parsum.ParsumError, match=r"models\[0\] .* is not one of step_in_backward"):
        parsum.sum_models(models, torch.randn(8, IN), step_in_backward=sib)


def test_step_in_backward_over_stacked_models_steps_them_as_one_and_falls_back(monkeypatch):
    """NOTE [ One step over stacked models ]: one step over the stacked tensors while the
    models' optimizers agree; their own steps when not (a model's learning rate changed alone,
    models run one by one), their states gathered again after those or after a state load;
    plain training with one Adam per model throughout."""
    torch.manual_seed(0)
    models = members(n=10, dtype=torch.float64)
    plain = copy.deepcopy(models)
    parsum.stack_(models)
    sib = parsum.StepInBackward(models, torch.optim.Adam, lr=1e-2)
    own = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in plain]
    calls = [0] * len(models)
    step = torch.optim.Adam.step

    def counted(self, *args, **kwargs):  # the models' own steps, counted
        if self in sib.optimizers:
            calls[sib.optimizers.index(self)] += 1
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", counted)

    def train(engine="auto", stacked=True):
        x = torch.randn(8, IN, dtype=torch.float64)
        y = parsum.sum_models(models, x, step_in_backward=sib, engine=engine)
        assert runs_stacked(y) == stacked
        y.pow(2).mean().backward()
        plain_sum(plain, x).pow(2).mean().backward()
        for opt in own:
            opt.step()
            opt.zero_grad()
        for m, q in zip(models, plain):
            for a, b in zip(m.parameters(), q.parameters()):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)

    train()
    train()
    assert calls == [0] * 10  # one step over the stack, none of the models' own
    train(engine="autograd", stacked=False)  # one by one: each model's optimizer
    assert calls == [1] * 10
    train()  # the states gathered again, the step counts each model's own
    sib.load_state_dict(sib.state_dict())
    train()
    assert calls == [1] * 10
    for opt in (sib.optimizers[0], own[0]):  # one model's learning rate alone
        opt.param_groups[0]["lr"] = 5e-3
    train()
    assert calls == [2] * 10
