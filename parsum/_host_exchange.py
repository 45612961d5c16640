"""The exchanges between ranks on one host, through shared memory instead of gloo.

# NOTE [ Exchanges on one host ]
# A gloo all_gather passes through three threads on each rank (the caller, the process group's
# worker, the transport's event loop), each woken by the one before. On a host whose cores are all
# computing, a woken thread may wait for a core: on 2 cores, two ranks computing 3.5 ms a step and
# exchanging 2.6 KB after it (benchmarks/bench_exchange.py), the exchange took 1.2-1.75 ms on
# average, 22-39% of them about 4 ms (a scheduler tick), where the whole step's compute was 3.4
# ms; so 2 processes ran slower than one (16 MLPs of widths 128-512 at batch 64: 8-9 ms a step
# against 7.5). Through shared memory the same exchange took 0.03-0.06 ms: every rank maps one
# file of /dev/shm, writes its bytes to its slot and then the call's number, and waits until every
# rank's slot holds that number, spinning for SPIN_SECONDS and then napping (a rank far behind,
# evaluating or saving, costs its peers no core). Two sets of slots, used in turn: a rank writes a
# set again only two calls later, once every rank has read it (each writes the next call's number
# only after reading this call's bytes). The bytes are written before the number, and read after
# it, in program order, which x86's memory model keeps for other processes (stores are not
# reordered with stores, loads with loads): only x86-64 takes this way. Ranks take it once every
# rank finds the others on its host (hostname, boot id, the /dev/shm and the PID namespace it
# sees) and maps the file that rank 0 made (a token written there, read back by each); ranks on
# several hosts share a file a host (NOTE [ Ranks on several hosts ]); otherwise, and for NCCL,
# gloo as before. The file is unlinked once every rank mapped it: nothing stays in /dev/shm, also
# when a rank is killed. A rank that ends while its peers wait (its process gone) makes them raise
# within LIVENESS_SECONDS; a rank alive but stuck makes them wait up to the process group's
# timeout, as gloo would, napping longer once LONG_WAIT_SECONDS have passed. (Ranks in PID
# namespaces of their own, containers sharing a /dev/shm, could not tell a peer's process from
# another: hence the namespace in the check.) Backward's exchanges, where an input needs a
# gradient (whether each rank's backward succeeded, then the input gradients), go through the same
# slots, grown where a gradient does not fit (collective too: every rank reaches them, or every
# rank raised before): 2 processes, 16 MLPs of widths 128-512 at batch 64 with an input that needs
# a gradient, 10.7-10.9 -> 8.1-8.3 ms a step on average. A slot holds at most MAX_SLOT_BYTES; the
# file's pages are all taken when it is made, so a /dev/shm too small for it makes the ranks keep
# gloo instead of raising SIGBUS at a first write.
"""

from __future__ import annotations

import contextlib
import os
import platform
import secrets
import socket
import sys
import time
import weakref
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ._errors import ParsumError

SPIN_SECONDS = 0.002
NAP_SECONDS = 50e-6
LONG_WAIT_SECONDS = 0.1  # then naps of LONG_NAP_SECONDS: a peer that late is not about to come
LONG_NAP_SECONDS = 0.001
LIVENESS_SECONDS = 1.0
# The most bytes a rank's slot holds: 2 * world slots of them in /dev/shm, whose size a
# container may keep small (Docker's default: 64 MB); larger exchanges go through gloo.
MAX_SLOT_BYTES = 2**20
TIMEOUT_SECONDS = 30 * 60.0  # torch.distributed's default, where a group's cannot be read
_HEADER = 16  # bytes before each slot's data (its call's number), and before the slots (a token)


def supported() -> bool:
    """Whether this process can take the shared-memory way (NOTE [ Exchanges on one host ])."""
    return (
        sys.platform.startswith("linux")
        and platform.machine() in ("x86_64", "AMD64")
        and os.access("/dev/shm", os.W_OK)
    )


def _host_id() -> int:
    """A number that ranks of one host share where they see one /dev/shm and one another's
    processes (a PID namespace of their own would make a live peer look ended)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        shm = os.stat("/dev/shm")
        pids = os.readlink("/proc/self/ns/pid")  # a peer's process number means the same
    except OSError:
        return 0
    where = f"{socket.gethostname()}/{boot}/{shm.st_dev}/{shm.st_ino}/{pids}"
    return zlib.crc32(where.encode())


def _stride(size: int) -> int:
    """Bytes from one slot (its number, then ``size`` bytes) to the next: _HEADER-aligned."""
    return _HEADER + size + (-size % _HEADER)


class HostSlots:
    """Every rank's slots in one shared file, mapped by every rank of a group on one host."""

    def __init__(
        self, mem: Tensor, rank: int, world: int, capacity: int, pids: list[int], timeout: float
    ):
        self.mem, self.rank, self.world, self.capacity, self.pids = mem, rank, world, capacity, pids
        self.timeout = timeout
        self.step = 0
        stride = _stride(capacity)
        view = mem.numpy()
        self.numbers = []
        self.data = []
        for half in range(2):
            at = [_HEADER + (half * world + r) * stride for r in range(world)]
            self.numbers.append([view[a : a + 8].view("int64") for a in at])
            self.data.append([mem[a + _HEADER : a + _HEADER + capacity] for a in at])

    @staticmethod
    def size(world: int, capacity: int) -> int:
        return _HEADER + 2 * world * _stride(capacity)

    def all_gather(self, mine: Tensor) -> list[Tensor]:
        """Every rank's ``mine`` (bytes, as many on every rank), in rank order."""
        n = mine.numel()
        self.step += 1
        half = self.step & 1
        self.data[half][self.rank][:n].copy_(mine)
        self.numbers[half][self.rank][0] = self.step  # after the bytes
        gathered = []
        for r in range(self.world):
            self._wait(self.numbers[half][r], r)
            gathered.append(self.data[half][r][:n].clone())
        return gathered

    def _wait(self, number: Any, r: int) -> None:
        _wait(number, self.step, r, self.pids[r], self.rank, self.timeout)


def _wait(
    number: Any,
    step: int,
    r: int,
    pid: int,
    rank: int,
    timeout: float,
    failed: int | None = None,
) -> None:
    """Wait until ``number`` holds ``step`` (or ``failed``), written by rank ``r`` (process
    ``pid``): spinning, then napping; raise where ``r`` ended or ``timeout`` passed."""
    if number[0] == step or number[0] == failed:
        return
    start = checked = time.perf_counter()
    while number[0] != step and number[0] != failed:
        now = time.perf_counter()
        if now - start < SPIN_SECONDS:
            continue
        time.sleep(NAP_SECONDS if now - start < LONG_WAIT_SECONDS else LONG_NAP_SECONDS)
        if now - checked > LIVENESS_SECONDS:
            checked = now
            if not _alive(pid):
                raise ParsumError(
                    f"parsum.distributed.sum_models: rank {r} (process {pid}) ended while rank "
                    f"{rank} waited for its sum"
                )
            if now - start > timeout:
                raise ParsumError(
                    f"parsum.distributed.sum_models: rank {rank} waited {timeout:.0f} s, the "
                    f"process group's timeout, for rank {r}'s sum"
                )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that number: alive
        return True
    return True


def make_slots(
    group: Any, rank: int, world: int, capacity: int, leaders: Any = None
) -> Slots | None:
    """The group's slots of ``capacity`` bytes, where every rank can map them; None where one
    cannot. Collective: every rank of ``group`` calls it at the same point, and gets slots on
    every rank or on none. ``leaders``: the group of the hosts' first ranks that earlier slots
    of ``group`` made (NOTE [ Ranks on several hosts ]), used again."""
    info = torch.tensor([int(supported()), _host_id(), os.getpid()], dtype=torch.int64)
    table = _gathered(group, world, info)
    if not all(ok for ok, _, _ in table):
        return None
    pids = [pid for _, _, pid in table]
    hosts: dict[int, list[int]] = {}  # each host's ranks, the hosts in the order of their first
    for r, (_, host, _) in enumerate(table):
        hosts.setdefault(host, []).append(r)
    if len(hosts) > 1:  # NOTE [ Ranks on several hosts ]
        layout = list(hosts.values())
        return _make_host_leaders(group, rank, world, capacity, layout, pids, leaders)
    mem = _shared_file(group, world, rank, [list(range(world))], HostSlots.size(world, capacity))
    if mem is None:
        return None
    return HostSlots(mem, rank, world, capacity, pids, _timeout_of(group))


def _shared_file(
    group: Any, world: int, rank: int, hosts: list[list[int]], size: int
) -> Tensor | None:
    """A file of ``size`` bytes that the first rank of each host makes and the host's other
    ranks map, unlinked once mapped; this rank's mapping, or None on every rank where one rank
    could not make or map its host's (collective)."""
    mine = next(ranks for ranks in hosts if rank in ranks)
    maker = rank == mine[0]
    token = secrets.randbits(62) if maker else 0
    path = f"/dev/shm/parsum-exchange-{os.getpid()}-{token}"
    mem: Tensor | None = None
    made, created = 1, 0
    if maker:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            created = 1
            try:
                # Every page taken now: a /dev/shm too small fails here (and the ranks take
                # gloo), not with a SIGBUS when a rank first writes its slot.
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
            mem = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            mem[:8].view(torch.int64).fill_(token)
        except (OSError, RuntimeError):
            made = 0
    pid = os.getpid()
    rows = _gathered(group, world, torch.tensor([made, token, pid], dtype=torch.int64))
    made, token, pid = rows[mine[0]]  # this host's maker's
    mapped = made
    if made and not maker:
        path = f"/dev/shm/parsum-exchange-{pid}-{token}"
        try:
            mem = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            mapped = int(mem[:8].view(torch.int64).item() == token)
        except (OSError, RuntimeError):
            mapped = 0
    everyone = all(row[0] for row in _gathered(group, world, torch.tensor([mapped, 0])))
    if created:
        with contextlib.suppress(OSError):  # mapped by every rank, or given up: not kept
            os.unlink(path)
    return mem if everyone else None


# NOTE [ Ranks on several hosts ]
# Where the ranks span hosts, one all_gather of every rank through gloo goes round a ring of all
# of them, each step through each rank's gloo threads. Instead the ranks of each host write their
# bytes to their slots in a file of that host, as on one host; the first rank of each host (its
# leader) waits for its host's slots, sends their bytes, in its host's rank order, in one gloo
# all_gather among the leaders (a process group of its own, made once by every rank, as
# torch.distributed.new_group needs), and writes every rank's bytes, in rank order, with the
# call's number into its host's file, which the host's other ranks wait for and read. A leader
# whose exchange fails (another host gone) writes the call's number negated, and its host's
# ranks raise with it. Hosts with fewer ranks send zeros for the rest: gloo's all_gather needs
# as many bytes from every leader. Only for the default group (new_group is called by every rank
# of it); another group that spans hosts goes through gloo as before. Simulated here, hosts told
# apart by a number each rank reports (tests), not run on several machines: 4 ranks on 2 cores as
# 2 hosts of 2, 16 MLPs of widths 128-512 at batch 64, 14.9-15.0 ms a step on average through
# gloo alone, 11.9-12.4 through the hosts' files and their leaders (one host's file: 10.9-11.2).


class HostLeaders:
    """Every rank's bytes through its host's file and, between hosts, its host's leader (NOTE
    [ Ranks on several hosts ])."""

    def __init__(
        self,
        mem: Tensor,
        rank: int,
        world: int,
        capacity: int,
        hosts: list[list[int]],
        leaders: Any,
        pids: list[int],
        timeout: float,
    ):
        self.rank, self.world, self.capacity, self.hosts = rank, world, capacity, hosts
        self.local = next(ranks for ranks in hosts if rank in ranks)
        self.widest = max(map(len, hosts))
        self.leaders, self.pids, self.timeout = leaders, pids, timeout
        self.mem = mem
        self.step = 0
        stride = _stride(capacity)
        view = mem.numpy()
        local = len(self.local)
        results = _HEADER + 2 * local * stride  # then two results: a number, every rank's bytes
        result_stride = _stride(world * capacity)
        self.numbers, self.data, self.result_numbers, self.results = [], [], [], []
        for half in range(2):
            at = [_HEADER + (half * local + i) * stride for i in range(local)]
            self.numbers.append([view[a : a + 8].view("int64") for a in at])
            self.data.append([mem[a + _HEADER : a + _HEADER + capacity] for a in at])
            r = results + half * result_stride
            self.result_numbers.append(view[r : r + 8].view("int64"))
            self.results.append(mem[r + _HEADER : r + _HEADER + world * capacity])

    @staticmethod
    def size(world: int, local: int, capacity: int) -> int:
        return _HEADER + 2 * local * _stride(capacity) + 2 * _stride(world * capacity)

    def all_gather(self, mine: Tensor) -> list[Tensor]:
        """Every rank's ``mine`` (bytes, as many on every rank), in rank order."""
        n = mine.numel()
        self.step += 1
        half = self.step & 1
        me = self.local.index(self.rank)
        self.data[half][me][:n].copy_(mine)
        self.numbers[half][me][0] = self.step  # after the bytes
        result = self.results[half]
        if me == 0:
            self._lead(half, n)
        else:
            self._wait_result(half)
        return [result[r * n : (r + 1) * n].clone() for r in range(self.world)]

    def _lead(self, half: int, n: int) -> None:
        step = self.step
        sent = torch.zeros(self.widest * n, dtype=torch.uint8)
        for i, rank in enumerate(self.local):
            _wait(self.numbers[half][i], step, rank, self.pids[rank], self.rank, self.timeout)
            sent[i * n : (i + 1) * n] = self.data[half][i][:n]
        try:
            got = [torch.empty_like(sent) for _ in self.hosts]
            dist.all_gather(got, sent, group=self.leaders)
        except BaseException:
            self.result_numbers[half][0] = -step  # this host's other ranks raise too
            raise
        result = self.results[half]
        for ranks, their in zip(self.hosts, got):
            for i, r in enumerate(ranks):
                result[r * n : (r + 1) * n] = their[i * n : (i + 1) * n]
        self.result_numbers[half][0] = step  # after the bytes

    def _wait_result(self, half: int) -> None:
        leader = self.local[0]
        number = self.result_numbers[half]
        step = self.step
        _wait(number, step, leader, self.pids[leader], self.rank, self.timeout, failed=-step)
        if number[0] == -step:
            raise ParsumError(
                f"parsum.distributed.sum_models: rank {leader}, which exchanges rank "
                f"{self.rank}'s host's sums with the other hosts, failed in that exchange"
            )


def _make_host_leaders(
    group: Any,
    rank: int,
    world: int,
    capacity: int,
    hosts: list[list[int]],
    pids: list[int],
    leaders: Any = None,
) -> HostLeaders | None:
    """The two-level exchange of NOTE [ Ranks on several hosts ], or None (collective). Its
    group of leaders is ``leaders`` where given (the same ranks: slots made again, larger)."""
    if group is not None and group is not dist.group.WORLD:
        return None  # new_group needs every rank of the default group
    if max(map(len, hosts)) < 2:  # a rank a host: nothing to share
        return None
    if leaders is None:
        leaders = dist.new_group([ranks[0] for ranks in hosts])
    local = next(ranks for ranks in hosts if rank in ranks)
    mem = _shared_file(group, world, rank, hosts, HostLeaders.size(world, len(local), capacity))
    if mem is None:
        return None
    return HostLeaders(mem, rank, world, capacity, hosts, leaders, pids, _timeout_of(group))


def _timeout_of(group: Any) -> float:
    """The group's timeout in seconds (given to ``init_process_group`` or ``new_group``), read
    through a private attribute of gloo's backend: TIMEOUT_SECONDS where it cannot be read."""
    try:
        backend = group_object(group)._get_backend(torch.device("cpu"))
        return float(backend.options._timeout.total_seconds())
    except (AttributeError, RuntimeError, TypeError):
        return TIMEOUT_SECONDS


def _gathered(group: Any, world: int, row: Tensor) -> list[list[int]]:
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row, group=group)
    return torch.stack(rows).tolist()


Slots = HostSlots | HostLeaders


class GroupSlots:
    """Slots per process group, held weakly by the group object: a group destroyed and made
    again under its name is another object, whose ranks make slots anew."""

    def __init__(self) -> None:
        self._held: dict[tuple[str | None, int], tuple[weakref.ref, Slots | None]] = {}

    def get(self, key: tuple[str | None, int], group: Any) -> Slots | None:
        found = self._held.get(key)
        if found is None or found[0]() is not group_object(group):
            return None
        return found[1]

    def prepare(self, key: tuple[str | None, int], group: Any, capacity: int) -> None:
        """Make slots for this group where it has none of ``capacity`` bytes yet (collective:
        every rank calls it at the same point, with the same held state)."""
        if capacity > MAX_SLOT_BYTES:  # through gloo, whose latency such bytes outweigh
            return
        owner = group_object(group)
        found = self._held.get(key)
        if found is not None and found[0]() is owner:
            slots = found[1]
            if slots is None or slots.capacity >= capacity:  # not on one host: never
                return
        old = found[1] if found is not None and found[0]() is owner else None
        if old is not None:  # at least twice as large: sizes that grow make few files
            capacity = min(max(capacity, 2 * old.capacity), MAX_SLOT_BYTES)
        if len(self._held) >= 64:  # groups made and dropped again and again: bounded
            self._held.clear()
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        leaders = old.leaders if isinstance(old, HostLeaders) else None  # one group of leaders
        made = make_slots(group, rank, world, capacity, leaders)
        self._held[key] = (weakref.ref(owner), made)


def group_object(group: Any) -> Any:
    """The process group object ``group`` names (None: the default group)."""
    return dist.group.WORLD if group is None else group
