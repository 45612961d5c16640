"""parsum.distributed.sum_models with 2 gloo processes on 127.0.0.1, against a single-process
sum_models over all the models: outputs, input gradients, parameter gradients, and failures."""

import contextlib
import datetime
import glob
import os
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import parsum
from parsum import _function, _host_exchange
from parsum._function import JOIN_LATER_PARAMS
from parsum.distributed import balanced_shares
from tests.test_errors import Boom, BoomBackward
from tests.zoo import IN, OUT, clone_models, mlp, param_grads, plain_sum, unique_params, zoo

WORLD = 2
TOL = dict(rtol=1e-12, atol=1e-12)
F32 = dict(rtol=1e-5, atol=1e-6)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario: str, timeout_s: float = 30, backend: str = "gloo", world: int = WORLD) -> None:
    """Run ``scenario`` on ``world`` spawned ranks; a failed assertion in any rank fails here.

    A port found free may be taken before the ranks bind it (by another xdist worker's
    ranks): then the ranks run again on another port."""
    for attempt in range(3):
        args = (scenario, free_port(), timeout_s, backend, world)
        try:
            mp.spawn(_rank_main, args=args, nprocs=world, join=True)
            return
        except mp.ProcessRaisedException as exc:
            if attempt == 2 or "Address already in use" not in str(exc):
                raise


def _rank_main(
    rank: int, scenario: str, port: int, timeout_s: float, backend: str, world: int
) -> None:
    torch.set_num_threads(1)
    global _PORT
    _PORT = port
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        SCENARIOS[scenario](rank)
    finally:
        dist.destroy_process_group()


_PORT = 0  # the rank's group's port (_rank_main), for a scenario that makes a group anew


def _same_on_every_rank(t: torch.Tensor) -> None:
    gathered = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(gathered, t.contiguous())
    assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks hold different bits"


def _agrees_with_one_process(rank: int) -> None:
    models = zoo(torch.float64)
    ref = clone_models(models)
    weights = [0.5 + 0.25 * i for i in range(len(models))]
    torch.manual_seed(5)
    x = torch.randn(9, IN, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    mine = models[rank::WORLD]
    y = parsum.distributed.sum_models(mine, x, weights=weights[rank::WORLD])
    (y**2).sum().backward()
    y_ref = parsum.sum_models(ref, x_ref, weights=weights, n_jobs=1)
    (y_ref**2).sum().backward()
    plain = sum(w * m(x_ref.detach()) for w, m in zip(weights, clone_models(models)))
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(y, plain, **TOL)
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)  # not WORLD times it
    for got, want in zip(param_grads(mine), param_grads(ref[rank::WORLD])):
        torch.testing.assert_close(got, want, **TOL)
    _same_on_every_rank(y)
    _same_on_every_rank(x.grad)
    # Weights as a tensor with its own gradient: each rank's for its own models.
    w_all = torch.tensor(weights, dtype=torch.float64, requires_grad=True)
    w_mine = w_all.detach()[rank::WORLD].clone().requires_grad_()
    x.grad = None
    (parsum.distributed.sum_models(mine, x, weights=w_mine) ** 2).sum().backward()
    (parsum.sum_models(ref, x_ref.detach(), weights=w_all) ** 2).sum().backward()
    torch.testing.assert_close(w_mine.grad, w_all.grad[rank::WORLD], **TOL)
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    # A pytree output and no input gradient: every rank still agrees.
    with torch.no_grad():
        pair = parsum.distributed.sum_models([lambda t: {"a": t, "b": 2 * t}] * (rank + 1), x)
    torch.testing.assert_close(pair["b"], 2 * pair["a"])
    torch.testing.assert_close(pair["a"], 3 * x.detach())
    # Rank 1's part needs no gradient (its model reads x through indices only): the sum over
    # ranks does, and every rank runs the backward that exchanges x's gradient.
    table = torch.randn(10, OUT, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    part = [lambda t: table[(t.abs() * 3).long().clamp(max=9)].sum(1)] if rank else mine
    x.grad = None
    (parsum.distributed.sum_models(part, x) ** 2).sum().backward()
    x_ref.grad = None
    lookup = table[(x_ref.abs() * 3).long().clamp(max=9)].sum(1)
    (sum(m(x_ref) for m in clone_models(models[::WORLD])) + lookup).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)


def _second_backward(rank: int) -> None:
    """A gradient penalty through the sum over ranks: the first derivative is right; a second
    backward raises, with respect to anything (torch's once_differentiable had given None for
    every parameter under autograd.grad(..., allow_unused=True), without a word)."""
    models = zoo(torch.float64)
    ref = clone_models(models)
    mine = models[rank::WORLD]
    x = torch.randn(4, IN, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x.requires_grad_()
    (g,) = torch.autograd.grad(parsum.distributed.sum_models(mine, x).sum(), x, create_graph=True)
    x_ref = x.detach().clone().requires_grad_()
    (g_ref,) = torch.autograd.grad(plain_sum(ref, x_ref).sum(), x_ref, create_graph=True)
    torch.testing.assert_close(g, g_ref, **TOL)
    params = [p for m in mine for p in m.parameters()]
    for second in (
        lambda: torch.autograd.grad(g.pow(2).sum(), params, allow_unused=True, retain_graph=True),
        lambda: torch.autograd.grad(g.pow(2).sum(), x, retain_graph=True),
        lambda: g.pow(2).sum().backward(retain_graph=True),
    ):
        with pytest.raises(parsum.ParsumError, match="across ranks are not differentiable"):
            second()
    assert all(p.grad is None for p in params)
    # Within a rank too (its models run through ParallelSum there, which announces failures
    # to the other ranks): a Hessian-vector product in the own parameters raises.
    grads = torch.autograd.grad(
        parsum.distributed.sum_models(mine, x).sum(), params, create_graph=True
    )
    with pytest.raises(parsum.ParsumError, match="not differentiable"):
        torch.autograd.grad(sum(gr.sum() for gr in grads), params, allow_unused=True)


def _complex_outputs(rank: int) -> None:
    """Complex models and a complex weight tensor: each rank's share against one process, its
    conjugates included (NOTE [ Complex weights ] in parsum._engines)."""
    torch.manual_seed(3)
    models = [
        nn.Sequential(
            nn.Linear(IN, 2 + i, dtype=torch.complex128),
            nn.Linear(2 + i, OUT, dtype=torch.complex128),
        )
        for i in range(4)
    ]
    ref = clone_models(models)
    x = torch.randn(3, IN, dtype=torch.complex128, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    w_all = torch.randn(4, dtype=torch.complex128, requires_grad=True)
    w_mine = w_all.detach()[rank::WORLD].clone().requires_grad_()
    mine = models[rank::WORLD]
    y = parsum.distributed.sum_models(mine, x, weights=w_mine)
    (y.abs() ** 2).sum().backward()
    plain = sum(w * m(x_ref) for w, m in zip(w_all, ref))
    (plain.abs() ** 2).sum().backward()
    torch.testing.assert_close(y, plain.detach(), **TOL)
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    torch.testing.assert_close(w_mine.grad, w_all.grad[rank::WORLD], **TOL)
    for got, want in zip(param_grads(mine), param_grads(ref[rank::WORLD])):
        torch.testing.assert_close(got, want, **TOL)


def _raises_for_rank_1s_model(rank: int, mine: list[nn.Module], x: torch.Tensor) -> None:
    """Rank 1's model 1 raises in forward: rank 1's error names it, the others' name rank 1."""
    if rank == 1:
        with pytest.raises(parsum.ParsumError, match=r"model 1 \(Boom\) raised ValueError"):
            parsum.distributed.sum_models(mine, x)
    else:
        with pytest.raises(parsum.ParsumError, match=r"rank\(s\) \[1\] failed in forward"):
            parsum.distributed.sum_models(mine, x)


def _forward_failure(rank: int) -> None:
    mine = [nn.Linear(IN, OUT)] + ([Boom()] if rank == 1 else [])
    x = torch.randn(4, IN)
    _raises_for_rank_1s_model(rank, mine, x)
    assert all(p.grad is None for p in mine[0].parameters())
    # The ranks are still in step: the next call works.
    y = parsum.distributed.sum_models(mine[:1], x)
    _same_on_every_rank(y)


def _inside_a_transform(rank: int) -> None:
    # Each rank raises before any exchange (the transform would not see the other ranks'
    # part), and the ranks are still in step.
    mine = [nn.Linear(IN, OUT)]
    x = torch.randn(4, IN)
    with pytest.raises(parsum.ParsumError, match=r"inside a torch.func transform .* with 2 ranks"):
        torch.func.grad(lambda x: parsum.distributed.sum_models(mine, x).sum())(x)
    with pytest.raises(parsum.ParsumError, match=r"inside a torch.func transform"):
        torch.func.vmap(lambda x: parsum.distributed.sum_models(mine, x))(x)
    _same_on_every_rank(parsum.distributed.sum_models(mine, x))


def _nested_argument(rank: int) -> None:
    # Every rank refuses it (the arguments are the same on every rank) before any model runs,
    # with or without a gradient wanted, and the ranks are still in step.
    mine = [nn.Linear(IN, OUT)]
    parts = [torch.randn(2, IN), torch.randn(3, IN)]
    for needs_grad in (False, True):
        nt = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=needs_grad)
        with pytest.raises(parsum.ParsumError, match=r"argument 0 is a nested tensor"):
            parsum.distributed.sum_models(mine, nt)
    assert all(p.grad is None for p in mine[0].parameters())
    _same_on_every_rank(parsum.distributed.sum_models(mine, torch.randn(4, IN)))


def _mismatch(rank: int) -> None:
    mine = [nn.Linear(IN, OUT + rank)]
    with pytest.raises(parsum.ParsumError, match=r"returned another output structure, shape"):
        parsum.distributed.sum_models(mine, torch.randn(4, IN))


def _backward_failure(rank: int) -> None:
    # Rank 1's model fails once in backward and training goes on: rank 0 used to complete its
    # step with an input gradient from uninitialised memory, and rank 1 then aborted on a
    # collective mismatch. Now both raise, and both stay in step.
    torch.manual_seed(0)
    mine = [nn.Linear(IN, OUT)] + ([BoomBackward()] if rank == 1 else [])
    x = torch.randn(4, IN, requires_grad=True)
    y = parsum.distributed.sum_models(mine, x)
    if rank == 1:
        with pytest.raises(parsum.ParsumError, match=r"model 1 \(BoomBackward\) raised"):
            y.sum().backward()
    else:
        with pytest.raises(parsum.ParsumError, match=r"rank\(s\) \[1\] failed in backward"):
            y.sum().backward()
    assert x.grad is None
    shared = _host_exchange.supported()
    for k in range(3):  # training goes on with the models that work
        x.grad = None
        slots = parsum.distributed._slots.get((None, WORLD), None)
        before = slots.step if slots is not None else 0
        y = parsum.distributed.sum_models(mine[:1], x)
        y.pow(2).sum().backward()
        _same_on_every_rank(y)
        _same_on_every_rank(x.grad)
        if shared and k:  # the forward's sums, the backward's statuses and input gradients
            assert parsum.distributed._slots.get((None, WORLD), None).step == before + 3


def _stacked_storage(rank: int) -> None:
    # Each rank keeps its identical models in stack_ storage; an optimizer over the stack steps
    # them as the plain loop over all the models would.
    torch.manual_seed(0)
    models = [mlp([8]) for _ in range(8 * WORLD)]
    ref = clone_models(models)
    mine = models[rank::WORLD]
    stack = parsum.stack_(mine)
    opt = torch.optim.Adam(stack.parameters(), lr=0.01)
    opt_ref = torch.optim.Adam([p for m in ref for p in m.parameters()], lr=0.01)
    for step in range(3):
        torch.manual_seed(step)
        x = torch.randn(6, IN)
        opt.zero_grad()
        opt_ref.zero_grad()
        y = parsum.distributed.sum_models(mine, x)
        y.pow(2).mean().backward()
        plain_sum(ref, x).pow(2).mean().backward()
        torch.testing.assert_close(y, plain_sum(ref, x).detach(), **F32)
        opt.step()
        opt_ref.step()
        _same_on_every_rank(y)
    for got, want in zip(mine, ref[rank::WORLD]):
        for p, q in zip(got.parameters(), want.parameters()):
            torch.testing.assert_close(p, q, **F32)


def _one_exchange(rank: int) -> None:
    # NOTE [ One exchange a forward ]: once a call succeeded everywhere, statuses and sums go
    # in one all_gather; a failure, a new batch size or a mismatch after that still raise, or
    # run, on every rank alike, and the sums have the bits of the two exchanges.
    torch.manual_seed(0)  # the same model on both ranks: the sum is WORLD times its output
    good = nn.Linear(IN, OUT)
    x = torch.randn(4, IN)
    calls = []
    gather = dist.all_gather

    def counted(*args, **kwargs):
        calls.append(args[1].numel())
        return gather(*args, **kwargs)

    shared = _host_exchange.supported()  # NOTE [ Exchanges on one host ]
    dist.all_gather = counted
    try:
        first = parsum.distributed.sum_models([good], x)
        # statuses, then sums: nothing agreed yet; then the shared slots made, or not
        made = len(calls)
        assert made == 2 + (3 if shared else 1)
        again = parsum.distributed.sum_models([good], x)
        assert len(calls) == made + (0 if shared else 1)  # one exchange, through the slots
    finally:
        dist.all_gather = gather
    slots = parsum.distributed._slots.get((None, WORLD), None)
    assert (slots is not None) == shared and (not shared or slots.step == 1)
    if rank == 0:  # its file, unlinked once both ranks mapped it
        assert not glob.glob(f"/dev/shm/parsum-exchange-{os.getpid()}-*")
    assert torch.equal(first, again)
    torch.testing.assert_close(again, WORLD * good(x).detach(), **F32)
    _same_on_every_rank(again)
    _raises_for_rank_1s_model(rank, [good] + ([Boom()] if rank == 1 else []), x)
    # A smaller batch on every rank (the sizes agreed before no longer hold), then the
    # agreed one again, and leaves of two dtypes whose bytes do not fill whole words.
    # A larger batch too, whose sums outgrow the slots: made anew, larger, and used.
    torch.manual_seed(1)  # the same batch on every rank
    wide = torch.randn(8, IN)
    for batch in (x[:3], x, wide, wide, x):
        y = parsum.distributed.sum_models([good], batch)
        torch.testing.assert_close(y, WORLD * good(batch).detach(), **F32)
        _same_on_every_rank(y)
    with torch.no_grad():
        for _ in range(2):
            pair = parsum.distributed.sum_models(
                [lambda t: {"h": t[:, :3].half(), "d": t.double()}], x
            )
            assert pair["h"].dtype == torch.float16 and pair["d"].dtype == torch.float64
            assert torch.equal(pair["h"], (WORLD * x[:, :3]).half())
            assert torch.equal(pair["d"], WORLD * x.double())
    with pytest.raises(parsum.ParsumError, match=r"returned another output structure, shape"):
        parsum.distributed.sum_models([nn.Linear(IN, OUT + rank)], x)
    _same_on_every_rank(parsum.distributed.sum_models([good], x))  # still in step
    # Arguments of different shapes on the ranks, by mistake: an error on both, no hang.
    with pytest.raises(parsum.ParsumError, match=r"returned another output structure, shape"):
        parsum.distributed.sum_models([good], x[: 3 + rank])
    _same_on_every_rank(parsum.distributed.sum_models([good], x))
    # A group of its own keeps its own agreed size (by name: the group is not held).
    group = dist.new_group(list(range(WORLD)))
    for _ in range(2):
        y = parsum.distributed.sum_models([good], x[:2], group=group)
        torch.testing.assert_close(y, WORLD * good(x[:2]).detach(), **F32)
    assert parsum.distributed._agreed_sizes[(group.group_name, WORLD)][0]() is group


def _one_rank_cannot_map(rank: int) -> None:
    # Slots on every rank or on none: rank 1 cannot take the shared-memory way, so neither
    # takes it, and the sums go through gloo on both (NOTE [ Exchanges on one host ]).
    if rank == 1:
        _host_exchange.supported = lambda: False
    torch.manual_seed(0)
    good = nn.Linear(IN, OUT)
    x = torch.randn(4, IN)
    for _ in range(3):
        y = parsum.distributed.sum_models([good], x)
        torch.testing.assert_close(y, WORLD * good(x).detach(), **F32)
        _same_on_every_rank(y)
    assert parsum.distributed._slots.get((None, WORLD), None) is None


def _no_room(rank: int) -> None:
    # Sums larger than a slot may hold, and a /dev/shm with no room for the slots: gloo, on
    # both ranks, with the same sums (NOTE [ Exchanges on one host ]).
    torch.manual_seed(0)
    good = nn.Linear(IN, OUT)
    x = torch.randn(4, IN)
    limit = _host_exchange.MAX_SLOT_BYTES
    _host_exchange.MAX_SLOT_BYTES = 4 * OUT * 4  # the sums fit, with the statuses they do not
    try:
        for _ in range(3):
            y = parsum.distributed.sum_models([good], x)
            torch.testing.assert_close(y, WORLD * good(x).detach(), **F32)
            _same_on_every_rank(y)
        assert parsum.distributed._slots.get((None, WORLD), None) is None
    finally:
        _host_exchange.MAX_SLOT_BYTES = limit
    group = dist.new_group(list(range(WORLD)))
    if rank == 0:

        def full(*args):
            raise OSError(28, "No space left on device")

        os.posix_fallocate = full
    for _ in range(3):
        y = parsum.distributed.sum_models([good], x, group=group)
        torch.testing.assert_close(y, WORLD * good(x).detach(), **F32)
        _same_on_every_rank(y)
    assert parsum.distributed._slots.get((group.group_name, WORLD), group) is None
    assert not glob.glob(f"/dev/shm/parsum-exchange-{os.getpid()}-*")


def _sums_agree(rank: int, pairs: tuple[tuple[int, int], ...]) -> list[Any]:
    """Six calls of every rank with batches that shrink and grow and an input that needs a
    gradient: one process's sums and input gradients over every rank's models, the same bits on
    every rank. Then groups of two ranks (``pairs``), their calls between the whole group's.
    The slots of the whole group and of each pair this rank is in."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    models = [mlp([4 + 2 * i]) for i in range(2 * world)]
    mine = models[rank::world]
    ref = clone_models(models)
    for k, rows in enumerate([4, 4, 2, 8, 4, 4]):
        torch.manual_seed(100 + k)  # the same batch on every rank
        x = torch.randn(rows, IN, dtype=torch.float64).float().requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        y = parsum.distributed.sum_models(mine, x)
        y.pow(2).sum().backward()
        y_ref = plain_sum(ref, x_ref)
        y_ref.pow(2).sum().backward()
        torch.testing.assert_close(y, y_ref.detach(), **F32)
        torch.testing.assert_close(x.grad, x_ref.grad, **F32)
        for t in (y.detach(), x.grad):
            gathered = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(gathered, t)
            assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks hold different bits"
    slots = parsum.distributed._slots.get((None, world), None)
    # Made anew, larger, for the input gradient of the batch of 8 rows (after its backward's
    # status went through the slots made for its sums); since: that gradient, a call of four
    # exchanges (at another size: its sums in a second one) and a call of three.
    assert slots is None or slots.step == 8, slots.step
    held = [slots]
    groups = [dist.new_group(list(pair)) for pair in pairs]
    x = torch.ones(3, IN)
    for _ in range(3):
        for pair, group in zip(pairs, groups):
            if rank in pair:
                y = parsum.distributed.sum_models(mine, x, group=group)
                both = plain_sum(models[pair[0] :: world] + models[pair[1] :: world], x)
                torch.testing.assert_close(y, both.detach(), **F32)
        y = parsum.distributed.sum_models(mine, x)
        torch.testing.assert_close(y, plain_sum(models, x).detach(), **F32)
    for pair, group in zip(pairs, groups):
        if rank in pair:
            held.append(parsum.distributed._slots.get((group.group_name, 2), group))
    return held


def _four_ranks(rank: int) -> None:
    # Four ranks through the shared slots (two sets of four, in turn); a group of two of them
    # with slots of its own.
    whole, *pair = _sums_agree(rank, ((1, 2),))
    assert (whole is not None) == _host_exchange.supported()
    assert isinstance(whole, _host_exchange.HostSlots) or whole is None
    for held in pair:
        assert (held is not None) == _host_exchange.supported()


def _on_hosts(rank: int, hosts: tuple[int, ...]) -> None:
    # NOTE [ Ranks on several hosts ], simulated: each rank reports the host ``hosts[rank]``.
    # The whole group's exchange goes through each host's file and its leader; a pair on one
    # host takes that host's slots, a pair across hosts gloo.
    _host_exchange._host_id = lambda: 1000 + hosts[rank]
    same = next((a, b) for a in range(4) for b in range(a + 1, 4) if hosts[a] == hosts[b])
    across = next((a, b) for a in range(4) for b in range(a + 1, 4) if hosts[a] != hosts[b])
    whole, *held = _sums_agree(rank, (same, across))
    shared = _host_exchange.supported()
    assert isinstance(whole, _host_exchange.HostLeaders) == shared
    if shared:  # larger sums: slots made again, at least twice as large, with the same leaders
        torch.manual_seed(0)
        one = nn.Linear(IN, OUT)  # the same model on every rank
        y = parsum.distributed.sum_models([one], torch.ones(64, IN))
        torch.testing.assert_close(y, 4 * one(torch.ones(64, IN)).detach(), **F32)
        grown = parsum.distributed._slots.get((None, 4), None)
        assert grown is not whole and grown.capacity >= 2 * whole.capacity
        assert grown.leaders is whole.leaders
    kinds = [pair for pair in (same, across) if rank in pair]
    for pair, slots in zip(kinds, held):
        assert (slots is not None) == (shared and pair == same)


def _host_leader_ends(rank: int) -> None:
    # Two simulated hosts of two ranks; the leader of the second ends: its host's other rank
    # names it, the first host's leader fails in gloo, and its host's other rank raises with it.
    _host_exchange._host_id = lambda: 1000 + rank // 2
    good, x = _slots_made()
    assert isinstance(parsum.distributed._slots.get((None, 4), None), _host_exchange.HostLeaders)
    if rank == 2:
        os._exit(0)
    expected = {
        0: r"",  # gloo's own error
        1: r"rank 0, which exchanges rank 1's host's sums with the other hosts, failed",
        3: r"rank 2 \(process \d+\) ended while rank 3",
    }[rank]
    start = time.monotonic()
    with pytest.raises(Exception, match=expected) as raised:
        parsum.distributed.sum_models([good], x)
    assert rank == 0 or raised.type is parsum.ParsumError
    assert time.monotonic() - start < 15


def _two_hosts(rank: int) -> None:
    _on_hosts(rank, (0, 0, 1, 1))


def _uneven_hosts(rank: int) -> None:
    _on_hosts(rank, (0, 1, 0, 0))  # three ranks on host 0, its leader rank 0; rank 1 alone


def _group_made_anew(rank: int) -> None:
    # The default group destroyed and made again, under the same name, with rank 1 new to it (a
    # process of its own would know nothing of the old group): what rank 0 agreed with the old
    # group is not used with the new one, and both make their first exchange alike.
    torch.manual_seed(0)
    good = nn.Linear(IN, OUT)
    x = torch.randn(4, IN)
    for _ in range(2):
        parsum.distributed.sum_models([good], x)
    dist.destroy_process_group()
    path = f"/tmp/parsum-test-group-{_PORT}"
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{path}",
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=30),
        )
        if rank == 1:
            parsum.distributed._agreed_sizes.clear()
            parsum.distributed._slots._held.clear()
        for _ in range(3):
            y = parsum.distributed.sum_models([good], x)
            torch.testing.assert_close(y, WORLD * good(x).detach(), **F32)
            _same_on_every_rank(y)
        dist.barrier()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _slots_made() -> tuple[nn.Module, torch.Tensor]:
    """A model and a batch, after two calls with them: the second through the shared slots
    (NOTE [ Exchanges on one host ]), made at the end of the first."""
    good = nn.Linear(IN, OUT)
    x = torch.randn(4, IN)
    for _ in range(2):
        parsum.distributed.sum_models([good], x)
    return good, x


def _peer_ends(rank: int) -> None:
    # NOTE [ Exchanges on one host ]: a rank whose process ends while the other waits in the
    # shared slots makes the other raise, naming it, instead of waiting forever.
    good, x = _slots_made()
    if rank == 1:
        os._exit(0)
    start = time.monotonic()
    with pytest.raises(parsum.ParsumError, match=r"rank 1 \(process \d+\) ended while rank 0"):
        parsum.distributed.sum_models([good], x)
    assert time.monotonic() - start < 10


def _peer_stuck(rank: int) -> None:
    # A rank alive but stuck keeps the one waiting in the shared slots until the process
    # group's timeout (8 s, launch's), as gloo would, and no longer.
    good, x = _slots_made()
    if rank == 1:
        time.sleep(12)
        return
    start = time.monotonic()
    with pytest.raises(parsum.ParsumError, match=r"waited 8 s, the process group's timeout"):
        parsum.distributed.sum_models([good], x)
    assert 8 <= time.monotonic() - start < 11


def _shares(rank: int) -> None:
    # Every model on one rank, the same split on both, and the sum over the shares that of one
    # process over all the models.
    torch.manual_seed(0)
    models = [mlp([4 + 8 * i]) for i in range(5)] + [mlp([6]) for _ in range(6)]
    x = torch.randn(5, IN)
    mine = parsum.distributed.share(models, x)
    both = [None] * WORLD
    dist.all_gather_object(both, mine)
    assert both[rank] == mine and sorted(i for part in both for i in part) == list(range(11))
    y = parsum.distributed.sum_models([models[i] for i in mine], x)
    torch.testing.assert_close(y, plain_sum(models, x).detach(), **F32)
    with pytest.raises(parsum.ParsumError, match=r"1 model\(s\) for 2 ranks"):
        parsum.distributed.share(models[:1], x)


def _nccl(rank: int) -> None:
    models = [m.cuda() for m in zoo()]
    x = torch.randn(9, IN, device="cuda", requires_grad=True)
    dist.broadcast(x.data, 0)
    y = parsum.distributed.sum_models(models[rank::WORLD], x)
    y.sum().backward()
    y_ref = sum(m(x.detach()) for m in models)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    _same_on_every_rank(y)


def _random_cases(rank: int) -> None:
    """tests/test_differential.py's scenarios that fit ranks, each rank running its models of
    each (round robin), against the plain loop over all of them: the sum, the argument's
    gradient, and this rank's parameters, gradients, buffers and weights' gradients."""
    from tests.test_differential import Case, _compare

    played = 0
    for seed in range(RANDOM_CASES):
        case = Case.make(seed)
        # (Every rank needs a model: the same decision on every rank.)
        if not case.fits_ranks or len(case.models) < WORLD:
            continue
        share = list(range(rank, len(case.models), WORLD))
        _function.JOIN_LATER_PARAMS = 0 if case.join_any_size else JOIN_LATER_PARAMS
        try:
            got = case.run(2, share=share)
        except parsum.ParsumError as exc:
            raise AssertionError(f"{case} on rank {rank}") from exc
        finally:
            _function.JOIN_LATER_PARAMS = JOIN_LATER_PARAMS
        want = case.run(None, plain=True)
        mine = _per_model_parts(case.models, share)
        for what in ("record", "x.grad", "scale.grad"):
            _compare(got[what], want[what], f"{case}: {what}", False, case.dtype)
        for what in ("grads", "params", "buffers"):
            part = [want[what][k] for k in mine[what]]
            if case.flat != "none" and what == "grads":  # a FlatGrad's .grad is never None
                part = [w if w is not None or g is None else torch.zeros_like(g)
                        for w, g in zip(part, got[what])]  # fmt: skip
            _compare(got[what], part, f"{case}: {what}", False, case.dtype)
        if want["weights.grad"] is not None:
            torch.testing.assert_close(got["weights.grad"], want["weights.grad"][share])
        played += 1
    assert played >= 20, played


RANDOM_CASES = 200


def _per_model_parts(models: list[nn.Module], share: list[int]) -> dict[str, list[int]]:
    """Where the parameters and buffers of the models of ``share`` are among all models'."""
    parts: dict[str, list[int]] = {"grads": [], "buffers": []}
    at = {"grads": 0, "buffers": 0}
    for i, m in enumerate(models):
        counts = {"grads": len(list(m.parameters())), "buffers": len(list(m.buffers()))}
        for what, count in counts.items():
            if i in share:
                parts[what].extend(range(at[what], at[what] + count))
            at[what] += count
    parts["params"] = parts["grads"]
    return parts


def _data_parallel(rank: int) -> None:
    """``DistributedDataParallel`` around a ``SumOfModels`` (data parallelism, every rank all
    the models, its half of the batch): three SGD steps give, on every rank, the parameters
    of the plain loop over the whole batch in one process."""
    from torch.nn.parallel import DistributedDataParallel

    for identical in (False, True):
        members = [mlp([8]) for _ in range(6)] if identical else zoo(torch.float64)
        members = [m.double() for m in members]
        ref = clone_models(members)
        ensemble = DistributedDataParallel(
            parsum.SumOfModels(members, weights=[0.5] * 6 if identical else None)
        )
        opt = torch.optim.SGD(ensemble.parameters(), lr=0.05)
        opt_ref = torch.optim.SGD(unique_params(ref), lr=0.05)
        generator = torch.Generator().manual_seed(9)
        for _ in range(3):
            x = torch.randn(8, IN, dtype=torch.float64, generator=generator)
            opt.zero_grad()
            ensemble(x.chunk(WORLD)[rank]).pow(2).mean().backward()  # DDP averages the ranks'
            opt.step()
            opt_ref.zero_grad()
            weights = [0.5] * 6 if identical else None
            plain_sum(ref, x, weights=weights).pow(2).mean().backward()
            opt_ref.step()
        for got, want in zip(unique_params(members), unique_params(ref), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
            _same_on_every_rank(got.detach())


SCENARIOS = {
    "second_backward": _second_backward,
    "random_cases": _random_cases,
    "agree": _agrees_with_one_process,
    "complex": _complex_outputs,
    "forward_failure": _forward_failure,
    "inside_a_transform": _inside_a_transform,
    "mismatch": _mismatch,
    "nested_argument": _nested_argument,
    "backward_failure": _backward_failure,
    "nccl": _nccl,
    "stacked_storage": _stacked_storage,
    "one_exchange": _one_exchange,
    "shares": _shares,
    "peer_ends": _peer_ends,
    "one_rank_cannot_map": _one_rank_cannot_map,
    "peer_stuck": _peer_stuck,
    "no_room": _no_room,
    "four_ranks": _four_ranks,
    "group_made_anew": _group_made_anew,
    "two_hosts": _two_hosts,
    "uneven_hosts": _uneven_hosts,
    "host_leader_ends": _host_leader_ends,
    "data_parallel": _data_parallel,
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "scenario",
    [
        "random_cases",
        "agree",
        "second_backward",
        "complex",
        "forward_failure",
        "inside_a_transform",
        "mismatch",
        "nested_argument",
        "stacked_storage",
        "one_exchange",
        "shares",
        "one_rank_cannot_map",
        "no_room",
        "group_made_anew",
        "data_parallel",
    ],
)
def test_two_processes(scenario):
    launch(scenario)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _host_exchange.supported(), reason="the shared-memory exchange's hosts")
def test_a_rank_that_ends_is_named_by_the_one_waiting_for_it():
    launch("peer_ends")


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _host_exchange.supported(), reason="the shared-memory exchange's hosts")
def test_a_stuck_rank_is_waited_for_until_the_groups_timeout():
    launch("peer_stuck", timeout_s=8)


@pytest.mark.timeout(120)
def test_four_processes():
    launch("four_ranks", world=4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", ["two_hosts", "uneven_hosts"])
def test_four_processes_on_several_hosts(scenario):
    launch(scenario, world=4)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _host_exchange.supported(), reason="the shared-memory exchange's hosts")
def test_a_host_leader_that_ends_makes_every_rank_raise():
    launch("host_leader_ends", timeout_s=20, world=4)


def test_balanced_shares():
    # NOTE [ Balanced shares ]: the costliest first, each to the least loaded rank; identical
    # models that run stacked together where they fit, dealt to every rank where they do not.
    torch.manual_seed(0)
    wide = [mlp([512 * (i + 1)]) for i in range(4)]  # costs about 1 : 2 : 3 : 4
    few = [mlp([8]) for _ in range(3)]  # too few to stack: one by one
    group = [mlp([16]) for _ in range(4)]  # stacked together
    models = wide + few + group
    x = torch.randn(4096, IN)  # rows enough for the parameters to outweigh a model's own cost
    parts = balanced_shares(models, (x,), {}, 2)
    assert sorted(i for part in parts for i in part) == list(range(len(models)))
    assert all(part == sorted(part) for part in parts)
    assert any(set(range(7, 11)) <= set(part) for part in parts)  # the group on one rank
    assert {0, 3} <= set(parts[0]) or {0, 3} <= set(parts[1])  # 1 + 4 against 2 + 3
    assert balanced_shares(models, (x,), {}, 2) == parts  # the same split every time
    # A group costlier than a fair share goes to every rank.
    big = [mlp([512]) for _ in range(8)]
    parts = balanced_shares(big + few, (x,), {}, 2)
    assert all(len(set(part) & set(range(8))) == 4 for part in parts)
    # Every rank gets a model where there are as many models as ranks: a group kept whole
    # beside one costly model had left the third rank with none (its sum_models then raised).
    costly = mlp([2048, 2048])
    for world in (2, 3, 5, 9):
        parts = balanced_shares([*(mlp([16]) for _ in range(8)), costly], (x,), {}, world)
        assert all(parts) and sorted(i for part in parts for i in part) == list(range(9))
    with pytest.raises(parsum.ParsumError, match="not initialized"):
        parsum.distributed.share(models, x)


@pytest.mark.timeout(120)
def test_a_backward_failure_raises_on_every_rank_and_keeps_them_in_step():
    launch("backward_failure", timeout_s=20)


@pytest.mark.timeout(120)
@pytest.mark.skipif(
    not (
        torch.cuda.is_available()
        and torch.cuda.device_count() >= WORLD
        and dist.is_nccl_available()
    ),
    reason="NCCL needs two CUDA devices",
)
def test_nccl_on_two_gpus():
    launch("nccl", backend="nccl")


def test_needs_an_initialized_process_group():
    with pytest.raises(parsum.ParsumError, match=r"torch.distributed is not initialized"):
        parsum.distributed.sum_models([nn.Linear(IN, OUT)], torch.randn(2, IN))


RELEASE_SCRIPT = """
import os, torch, torch.distributed as dist
import parsum
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])  # imports torch._dynamo, as training does
dist.destroy_process_group()
threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(sorted(t for t in threads if "gloo" in t))
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_destroy_process_group_stops_gloo_threads_when_parsum_is_imported_first():
    # NOTE [ Releasing the process group ]. Without the import of parsum this prints gloo's
    # three threads on torch 2.13.
    assert run_script(RELEASE_SCRIPT) == "[]"


def run_script(script: str) -> str:
    """What ``script`` (its ``%d`` a free port) prints, run in a Python process of its own."""
    done = subprocess.run(
        [sys.executable, "-c", script % free_port()],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


ONE_RANK_SCRIPT = """
import copy, torch, torch.distributed as dist
import parsum
from tests.zoo import IN, param_grads, zoo
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
def no_exchange(*args, **kwargs):
    raise AssertionError("a group of one rank exchanged something")
dist.all_gather = no_exchange
models = zoo(seed=5)
ref = copy.deepcopy(models)
x = torch.randn(4, IN, requires_grad=True)
x_ref = x.detach().clone().requires_grad_()
y = parsum.distributed.sum_models(models, x, weights=[0.5] * len(models))
y_ref = parsum.sum_models(ref, x_ref, weights=[0.5] * len(ref))
y.pow(2).sum().backward()
y_ref.pow(2).sum().backward()
assert torch.equal(y, y_ref) and torch.equal(x.grad, x_ref.grad)
assert all(torch.equal(a, b) for a, b in zip(param_grads(models), param_grads(ref)))
dist.destroy_process_group()
print("ok")
"""


@pytest.mark.timeout(120)
def test_one_rank_exchanges_nothing_and_gives_the_local_bits():
    # NOTE [ One rank ]
    assert run_script(ONE_RANK_SCRIPT) == "ok"
