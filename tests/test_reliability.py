"""Defects found by adversarial testing: concurrent callers on the same models, hooks under
concurrency, FlatGrad lifetimes, interrupted calls. Each test failed before its fix.

Tests that could crash the interpreter run their scenario in a subprocess; every test runs under
a short timeout, so a deadlock fails fast.
"""

import gc
import subprocess
import sys
import textwrap
import threading
import weakref

import pytest
import torch
from torch import nn

import parsum
from tests.zoo import IN, OUT, clone_models, param_grads, plain_sum

pytestmark = pytest.mark.timeout(120)


def _identical(n, seed=0):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(IN, 32), nn.Tanh(), nn.Linear(32, OUT)) for _ in range(n)]


def _run_threads(target, n_threads):
    errors = []

    def guarded():
        try:
            target()
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    return errors


@pytest.mark.parametrize("engine", ["auto", "stacked", "vjp", "autograd"])
def test_concurrent_callers_keep_the_models_intact(engine):
    # Two user threads summing the same identical models: functional_call used to swap tensors
    # in the user's modules, and the two calls' swaps interleaved (vjp left plain tensors in
    # place of the parameters, auto broke the models).
    models = _identical(10)
    before = [[(id(p), p.detach().clone()) for p in m.parameters()] for m in models]
    x = torch.randn(8, IN)
    expected = plain_sum(models, x).detach()

    def calls():
        for _ in range(20):
            y = parsum.sum_models(models, x, engine=engine)
            torch.testing.assert_close(y.detach(), expected)
            y.sum().backward()

    assert _run_threads(calls, 3) == []
    for m, saved in zip(models, before):
        for p, (pid, value) in zip(m.parameters(), saved):
            assert id(p) == pid and isinstance(p, nn.Parameter)
            assert torch.equal(p.detach(), value)
    torch.testing.assert_close(models[0](x), _identical(10)[0](x))


def test_a_thread_running_a_model_plainly_meanwhile_sees_its_own_parameters():
    models = _identical(10)
    x = torch.randn(8, IN)
    alone = models[0](x).detach()
    stop = threading.Event()

    def plain():
        while not stop.is_set():
            torch.testing.assert_close(models[0](x).detach(), alone)

    def summing():
        try:
            for _ in range(30):
                parsum.sum_models(models, x, engine="stacked").sum().backward()
        finally:
            stop.set()

    errors = []
    plain_thread = threading.Thread(target=lambda: errors.extend(_run_threads(plain, 1)))
    plain_thread.start()
    errors += _run_threads(summing, 1)
    plain_thread.join(timeout=100)
    assert errors == []
