"""Random training lifecycles against plain twins: what a training script does between calls.

Models trained with ``sum_models`` and plain twins trained with the plain loop go through the
same random events between steps: layers frozen and unfrozen on every model, state loaded,
``.data`` swapped, gradients kept, set by hand, clipped or scaled, micro-batches, and copies of
the whole training state (``copy.deepcopy`` of the models with their stack, FlatGrad,
optimizer or StepInBackward). After every step the gradients and the parameters must be the
plain twins' (within rounding). Four kinds: stacked models (``stack_``, with or without
``FlatGrad(stack)``, an optimizer over ``stack.parameters()`` or over the models), a FlatGrad
over models of several architectures, ``StepInBackward`` over stacked or unstacked models, and
members drawn at random each step from models of several widths.
``python -m tests.test_lifecycles FIRST COUNT`` plays more than the suite.
"""

from __future__ import annotations

import copy
import random
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import parsum

pytestmark = pytest.mark.timeout(120)

NAMES = ("0.weight", "0.bias", "2.weight", "2.bias")
# Adam with a large eps: with the default one, a gradient element within rounding of zero, of
# either sign in one run and the other, steps its parameter by +-lr.
OPTIMIZERS = (
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    (torch.optim.SGD, {"lr": 0.05}),
    (torch.optim.Adam, {"lr": 0.01, "eps": 1e-4}),
)


# In float64: a step's rounding (the plain sum's against parsum's compensated one), which Adam
# with eps 1e-4 turns into parameter differences 100 times larger, stays far below the
# tolerances (in float32 it failed 1 lifecycle of 400: seed 50136 of the stacked kind).
DTYPE = torch.float64


def _mlp(width: int = 8) -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 3)).to(DTYPE)


def _freeze_or_unfreeze(rng: random.Random, event: str, frozen: set[str], models: list) -> None:
    """At most two names frozen at once, on every model (a loss with none trainable left
    would have nothing to differentiate)."""
    if event == "freeze" and len(frozen) < 2:
        name = rng.choice(sorted(set(NAMES) - frozen))
        frozen.add(name)
    elif event == "unfreeze" and frozen:
        name = frozen.pop()
    else:
        return
    for m in models:
        m.get_parameter(name).requires_grad_(name not in frozen)


def _reload_or_swap(event: str, plain: list, models: list, every: bool = False) -> None:
    """``load``: the plain twins' state loaded into the models; ``data``: a new first weight
    swapped in (``.data =``) on the first model and its twin, or on ``every`` one."""
    if event == "load":
        for a, b in zip(plain, models):
            b.load_state_dict(copy.deepcopy(a.state_dict()))
    elif event == "data":
        w = torch.randn(8, 6, dtype=DTYPE)
        for a, b in zip(plain, models) if every else [(plain[0], models[0])]:
            a[0].weight.data, b[0].weight.data = w.clone(), w.clone()


def _differences(plain: list, models: list, step: int, flat: bool, grads: bool) -> str | None:
    """Where ``models`` differ from their plain twins after ``step``: gradients (a FlatGrad's
    ``.grad`` is never None: a zero view where the plain one is None) or parameters."""
    for a, b in zip(plain, models):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            if grads:
                if p.grad is None and (q.grad is None or (flat and not q.grad.any())):
                    continue
                if p.grad is None or q.grad is None:
                    return f"{name}'s .grad is None on one side only at step {step}"
                got = q.grad.to_dense() if q.grad.is_sparse else q.grad
                if not torch.allclose(p.grad, got, rtol=1e-4, atol=1e-6):
                    return f"{name}'s .grad differs at step {step}"
            elif not torch.allclose(p, q, rtol=1e-4, atol=1e-6):
                return f"{name} differs after step {step}"
    return None


def _zero_grads(plain: list) -> None:
    """What ``FlatGrad.zero_()`` does, on the plain twins of models under a FlatGrad: a
    trainable parameter's ``.grad`` zeroed (its view), a frozen one's None, as ``zero_grad()``
    leaves it."""
    for m in plain:
        for p in m.parameters():
            if not p.requires_grad:
                p.grad = None
            elif p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()


def _zero_all(
    plain_opt: torch.optim.Optimizer,
    opt: torch.optim.Optimizer,
    plain: list,
    flat: parsum.FlatGrad | None,
) -> None:
    """Zero both sides' gradients: by ``flat`` (and ``_zero_grads`` on the plain twins) where
    it is given, else by the optimizers."""
    if flat is not None:
        _zero_grads(plain)
        flat.zero_()
    else:
        plain_opt.zero_grad()
        opt.zero_grad()


def _optimizers(rng: random.Random, plain: list, models: list) -> tuple:
    """An optimizer of OPTIMIZERS drawn from ``rng``: its class, its keywords, and one over
    the plain twins' parameters and one over the models'."""
    cls, kw = rng.choice(OPTIMIZERS)
    plain_opt = cls([p for m in plain for p in m.parameters()], **kw)
    return cls, kw, plain_opt, cls([p for m in models for p in m.parameters()], **kw)


def check_stacked(seed: int) -> None:
    """Stacked models, with or without ``FlatGrad(stack)``, an optimizer over the stack or over
    the models, through freezes, reloads, swaps, gradients kept, set by hand, clipped or scaled,
    and copies of the whole training state."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    base = [_mlp() for _ in range(rng.choice([3, 5]))]
    plain, models = copy.deepcopy(base), copy.deepcopy(base)
    stack = parsum.stack_(models)
    flat = parsum.FlatGrad(stack) if rng.random() < 0.4 else None
    over_stack = rng.random() < 0.5
    cls, kw = rng.choice(OPTIMIZERS)
    plain_opt = cls([p for m in plain for p in m.parameters()], **kw)
    opt = cls(
        list(stack.parameters()) if over_stack else [p for m in models for p in m.parameters()],
        **kw,
    )
    frozen: set[str] = set()
    # NOTE [ Models that differ, trained over the stack ] in parsum._stack: a hook or eval()
    # on one model and its twin makes them differ; "same" takes the hooks off again. A copy
    # keeps them differing for good (the twins' hooks are the originals'), and none is made
    # after a tensor hook (deepcopy drops those).
    differing: list[Any] = []  # hook handles, and models switched to eval()
    copied_differing = tensor_hooked = False
    log = [f"{len(base)} models, FlatGrad {flat is not None}, over the stack {over_stack}"]
    log.append(cls.__name__)
    for step in range(8):
        event = rng.choice(
            [
                "none", "freeze", "unfreeze", "keep", "data", "load", "hand", "clip", "scale",
                "copy", "written", "differ", "same",
            ]
        )  # fmt: skip
        if event == "copy" and tensor_hooked:
            event = "none"
        if event == "same" and copied_differing:
            event = "none"
        log.append(event)
        if event == "differ":
            k, how = rng.randrange(len(base)), rng.choice(["forward", "pre", "eval", "tensor"])
            if how == "tensor" and not models[k][0].weight.requires_grad:  # frozen: no hook
                how = "forward"
            log.append(f"{how} on model {k}")
            tensor_hooked = tensor_hooked or how == "tensor"
            for ms in (plain, models):
                if how == "forward":
                    differing.append(ms[k].register_forward_hook(lambda m, a, out: out * 0.5))
                elif how == "pre":
                    differing.append(ms[k][2].register_forward_pre_hook(lambda m, a: (a[0] * 2,)))
                elif how == "tensor":
                    differing.append(ms[k][0].weight.register_hook(lambda g: g * 0.5))
                else:
                    differing.append(ms[k].eval())
        elif event == "same":
            for held in differing:
                if isinstance(held, nn.Module):
                    held.train()
                else:
                    held.remove()
            differing.clear()
        copied_differing = copied_differing or (event == "copy" and bool(differing))
        _freeze_or_unfreeze(rng, event, frozen, [*plain, *models])
        _reload_or_swap(event, plain, models, every=True)
        copy_after = event == "copy" and rng.random() < 0.5  # a checkpoint after zero_grad()
        # A FlatGrad zeroes trainable parameters' gradients in place: the plain twins' as
        # well, where the FlatGrad zeroes (always, where the optimizer is over the models)
        zero_as_flat = flat is not None and (not over_stack or rng.random() < 0.5)
        if event == "copy" and not copy_after:
            models, stack, opt, flat = copy.deepcopy((models, stack, opt, flat))
            if rng.random() < 0.5:  # a layer frozen in the copy before its first backward
                log.append("freeze")
                _freeze_or_unfreeze(rng, "freeze", frozen, [*plain, *models])
        elif event == "hand":
            for k, (a, b) in enumerate(zip(plain, models)):
                if a[2].weight.requires_grad:
                    a[2].weight.grad = torch.full_like(a[2].weight, 0.01 * k)
                    b[2].weight.grad = torch.full_like(b[2].weight, 0.01 * k)
        if event not in ("keep", "hand"):
            _zero_all(plain_opt, opt, plain, flat if zero_as_flat else None)
        if copy_after:
            models, stack, opt, flat = copy.deepcopy((models, stack, opt, flat))
        x = torch.randn(5, 6, dtype=DTYPE)
        y, y_plain = parsum.sum_models(models, x), sum(m(x) for m in plain)
        if event == "written":  # NOTE [ Weights written before a group's backward ]
            k, name = rng.randrange(len(base)), rng.choice(NAMES)
            log.append(f"model {k}'s {name}")
            with torch.no_grad():
                for ms in (plain, models):
                    ms[k].get_parameter(name).mul_(0.5)
        before = [
            None if p.grad is None else p.grad.clone() for m in models for p in m.parameters()
        ]
        raised = []
        for out in (y, y_plain):
            try:
                out.pow(2).mean().backward()
            except Exception as exc:
                raised.append(exc)
        if raised:  # as the plain loop, naming the model, nothing written
            assert len(raised) == 2, f"seed {seed}: {raised}; events: {', '.join(log)}"
            assert event == "written", f"seed {seed}: {raised}; events: {', '.join(log)}"
            assert isinstance(raised[0], parsum.ParsumError) and f"model {k}" in str(raised[0])
            params = [p for m in models for p in m.parameters()]
            for p, was in zip(params, before):
                # An optimizer over the stack that zeroed it zeroed the models' gradients, which
                # are the buffer's views: a backward's start may write those zeros in place
                # (NOTE [ One buffer for a stack ])
                zeroed = over_stack and was is not None and not p.grad.any()
                assert zeroed or ((p.grad is None) if was is None else torch.equal(p.grad, was))
            # The plain loop wrote some: both zeroed, as a script would after the error
            _zero_all(plain_opt, opt, plain, flat if zero_as_flat else None)
            continue
        if event in ("clip", "scale"):
            for ms in (plain, models):
                params = [p for m in ms for p in m.parameters()]
                if event == "clip":
                    torch.nn.utils.clip_grad_norm_(params, 0.1)
                else:
                    for p in params:
                        if p.grad is not None:
                            p.grad.mul_(0.5)
        found = _differences(plain, models, step, flat is not None, grads=True)
        plain_opt.step()
        opt.step()
        found = found or _differences(plain, models, step, flat is not None, grads=False)
        assert found is None, f"seed {seed}: {found}; events: {', '.join(log)}"


def check_flat(seed: int) -> None:
    """A FlatGrad, compensated or not, over models of several architectures, through
    freezes, reloads, swaps, gradients kept, clips, scalings, micro-batches and copies."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    base = [_mlp() for _ in range(3)] + [_mlp(5), nn.Linear(6, 3).to(DTYPE)]
    plain, models = copy.deepcopy(base), copy.deepcopy(base)
    flat = parsum.FlatGrad(models, compensated=rng.random() < 0.5)
    _zero_grads(plain)
    cls, kw, plain_opt, opt = _optimizers(rng, plain, models)
    n_jobs = rng.choice([1, 2, None])
    frozen: set[str] = set()
    log = [f"compensated {flat.compensated}, {cls.__name__}, n_jobs {n_jobs}"]
    for step in range(7):
        event = rng.choice(
            ["none", "freeze", "unfreeze", "load", "data", "clip", "scale", "keep", "micro", "copy"]
        )
        log.append(event)
        _freeze_or_unfreeze(rng, event, frozen, [*plain[:3], *models[:3]])
        _reload_or_swap(event, plain, models)
        # A copy before the zeroing, or after it (a checkpoint after zero_grad()); the
        # zeroing by the FlatGrad, or by the optimizers (.grad None, the slots as they were)
        copy_after = event == "copy" and rng.random() < 0.5
        if event == "copy" and not copy_after:
            models, flat, opt = _copied_flat(models, flat, opt, cls, kw)
        if event != "keep":
            by_flat = rng.random() < 0.7
            log.append("zeroed by " + ("the FlatGrad" if by_flat else "the optimizers"))
            _zero_all(plain_opt, opt, plain, flat if by_flat else None)
        if copy_after:
            models, flat, opt = _copied_flat(models, flat, opt, cls, kw)
        for _ in range(2 if event == "micro" else 1):
            x = torch.randn(5, 6, dtype=DTYPE)
            parsum.sum_models(models, x, n_jobs=n_jobs).pow(2).mean().backward()
            sum(m(x) for m in plain).pow(2).mean().backward()
        if event == "clip":
            for ms in (plain, models):
                torch.nn.utils.clip_grad_norm_([p for m in ms for p in m.parameters()], 0.1)
        elif event == "scale":
            for m in plain:
                for p in m.parameters():
                    if p.grad is not None:
                        p.grad.mul_(0.5)
            flat.flat.mul_(0.5)
        found = _differences(plain, models, step, True, grads=True)
        _check_flat_holds_the_grads(flat, models, seed, step)
        assert all(
            (p.grad is None and not p.requires_grad)
            or p.grad.untyped_storage().data_ptr() == flat.flat.untyped_storage().data_ptr()
            for m in models
            for p in m.parameters()
        ), f"seed {seed}: a .grad left the FlatGrad's buffer at step {step}"
        plain_opt.step()
        opt.step()
        found = found or _differences(plain, models, step, True, grads=False)
        assert found is None, f"seed {seed}: {found}; events: {', '.join(log)}"


def _check_flat_holds_the_grads(flat: parsum.FlatGrad, models: list, seed: int, step: int) -> None:
    """The FlatGrad's buffer read whole holds the models' gradients, and zero where a
    ``.grad`` is None (NOTE [ Slots of no gradient ]): its norm is theirs."""
    grads = [p.grad.reshape(-1) for m in models for p in m.parameters() if p.grad is not None]
    want = torch.cat(grads).norm() if grads else torch.zeros((), dtype=DTYPE)
    got = flat.flat.norm()
    assert torch.allclose(got, want), f"seed {seed}: the buffer's norm {got} at step {step}, {want}"


def _copied_flat(models: list, flat: parsum.FlatGrad, opt: Any, cls: type, kw: dict) -> tuple:
    """A deep copy of the models and their FlatGrad, with an optimizer over the copies that
    holds the original's state."""
    models, flat, state = copy.deepcopy((models, flat, opt.state_dict()))
    opt = cls([p for m in models for p in m.parameters()], **kw)
    opt.load_state_dict(state)
    return models, flat, opt


def check_step_in_backward(seed: int) -> None:
    """``StepInBackward`` over stacked or unstacked models, through freezes, reloads, swaps and
    copies of the models with it: every step the plain loop's, and no ``.grad`` left."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    stacked = rng.random() < 0.6
    base = [_mlp() for _ in range(rng.choice([3, 5]))]
    if not stacked and rng.random() < 0.5:
        base.append(_mlp(5))
    plain, models = copy.deepcopy(base), copy.deepcopy(base)
    if stacked:
        parsum.stack_(models)
    cls, kw = rng.choice(
        [*OPTIMIZERS, (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1, "eps": 1e-4})]
    )
    sib = parsum.StepInBackward(models, cls, **kw)
    plain_opt = cls([p for m in plain for p in m.parameters()], **kw)
    n_jobs = rng.choice([1, 2, None])
    frozen: set[str] = set()
    log = [f"stacked {stacked}, {cls.__name__}, n_jobs {n_jobs}"]
    for step in range(6):
        event = rng.choice(["none", "freeze", "unfreeze", "load", "data", "copy"])
        log.append(event)
        _freeze_or_unfreeze(rng, event, frozen, [*plain, *models])
        _reload_or_swap(event, plain, models)
        if event == "copy":
            models, sib = copy.deepcopy((models, sib))
        plain_opt.zero_grad()
        x = torch.randn(5, 6, dtype=DTYPE)
        sum(m(x) for m in plain).pow(2).mean().backward()
        plain_opt.step()
        y = parsum.sum_models(models, x, step_in_backward=sib, n_jobs=n_jobs)
        y.pow(2).mean().backward()
        found = _differences(plain, models, step, False, grads=False)
        assert found is None, f"seed {seed}: {found}; events: {', '.join(log)}"
        assert all(p.grad is None for m in models for p in m.parameters())


def check_members(seed: int) -> None:
    """Members drawn at random each step (some left out, some reordered) from models of
    several widths, those of one width in ``stack_`` storage or a FlatGrad over all, with one
    optimizer over every model, through freezes, reloads, swaps, gradients kept and copies:
    every step the plain loop's over the same members (sets planned from the models' own
    walks, NOTE [ Models planned one by one ] in parsum._plans)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    widths = [8] * rng.choice([2, 3]) + [rng.choice([5, 12]) for _ in range(rng.choice([2, 4]))]
    base = [_mlp(w) for w in widths]  # the first of width 8, which "data" swaps
    plain, models = copy.deepcopy(base), copy.deepcopy(base)
    stacked = rng.random() < 0.4
    if stacked:
        parsum.stack_([m for m, w in zip(models, widths) if w == 8])
    flat = None if stacked or rng.random() < 0.6 else parsum.FlatGrad(models)
    if flat is not None:
        _zero_grads(plain)
    cls, _, plain_opt, opt = _optimizers(rng, plain, models)
    n_jobs = rng.choice([1, 2, None])
    frozen: set[str] = set()
    log = [f"widths {widths}, stacked {stacked}, FlatGrad {flat is not None}, {cls.__name__}"]
    log.append(f"n_jobs {n_jobs}")
    for step in range(8):
        event = rng.choice(["none", "freeze", "unfreeze", "load", "data", "keep", "copy"])
        _freeze_or_unfreeze(rng, event, frozen, [*plain, *models])
        _reload_or_swap(event, plain, models)
        copy_after = event == "copy" and rng.random() < 0.5  # a checkpoint after zero_grad()
        if event == "copy" and not copy_after:
            models, opt, flat = copy.deepcopy((models, opt, flat))
        if event != "keep":
            by_flat = flat is not None and rng.random() < 0.7
            _zero_all(plain_opt, opt, plain, flat if by_flat else None)
        if copy_after:
            models, opt, flat = copy.deepcopy((models, opt, flat))
        positions = rng.sample(range(len(models)), rng.randint(1, len(models)))
        if rng.random() < 0.5:
            positions.sort()
        log.append(f"{event} {positions}")
        x = torch.randn(5, 6, dtype=DTYPE)
        parsum.sum_models([models[k] for k in positions], x, n_jobs=n_jobs).pow(2).mean().backward()
        sum(plain[k](x) for k in positions).pow(2).mean().backward()
        found = _differences(plain, models, step, flat is not None, grads=True)
        if flat is not None:
            _check_flat_holds_the_grads(flat, models, seed, step)
        plain_opt.step()
        opt.step()
        found = found or _differences(plain, models, step, flat is not None, grads=False)
        assert found is None, f"seed {seed}: {found}; events: {', '.join(log)}"


CHECKS: dict[str, Callable[[int], None]] = {
    "stacked": check_stacked,
    "flat": check_flat,
    "step_in_backward": check_step_in_backward,
    "members": check_members,
}


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("kind", CHECKS)
def test_lifecycle_like_the_plain_loop(kind, seed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stacks that give up say so; the twins tell the rest
        CHECKS[kind](seed)


if __name__ == "__main__":
    first, count = int(sys.argv[1]), int(sys.argv[2])
    failed = 0
    for kind, check in CHECKS.items():
        for seed in range(first, first + count):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    check(seed)
            except AssertionError as exc:
                failed += 1
                print(f"{kind}: {exc}")
    print(f"{count} lifecycles of each kind ({', '.join(CHECKS)}), {failed} failed")
    sys.exit(1 if failed else 0)  # a script that plays them sees a failure
