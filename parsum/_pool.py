"""A persistent thread pool that runs fixed chunks and combines their results in order.

# NOTE [ Why not joblib.Parallel ]
# One ``joblib.Parallel`` call costs milliseconds (about 10 ms for 16 no-op tasks here, threading
# backend), a step of a small ensemble costs about as much: the per-call path cannot afford it.
# parsum uses joblib for what it is good at (the usable CPU count, ``parallel_config``) and keeps
# its own pool of daemon threads, created on first use and reused, whose per-call cost is a few
# queue operations.
#
# NOTE [ Caller runs, no deadlock ]
# The thread that submits a job works on it too, claiming chunks until none is left, and then
# waits only for chunks that a helper already claimed and is running. A job can therefore always
# finish with no helper at all: a model that calls parsum from inside a worker, or several user
# threads calling at once, never wait on a helper that is waiting on them. Inside a parsum task
# (flag ``_local.in_task``) nested calls run sequentially, so they add no threads.
#
# NOTE [ Interrupted callers ]
# A KeyboardInterrupt (Ctrl-C, or an exception from a signal handler) is raised in the calling
# thread between any two bytecodes, also between a chunk's claim and the ``try`` that releases
# it, or inside that release: the job then counted a chunk as running that nobody ran, and the
# caller, waiting for the helpers' chunks to finish before it raised, waited forever (CI,
# tests/test_concurrency.py, once in six runs; forced in tests/test_reliability.py). The count
# is the helpers' chunks alone: the caller waits only after leaving ``work``, when it runs none.
# Nor may the interrupt leave a job that helpers took with nobody to wait for it: its chunks
# would write gradients after the caller raised, into the next step's (the gradients of a call
# after a Ctrl-C came out doubled, 1 call in 100-400 interrupted on 2 cores, on the interrupt
# landing in the queue's ``put``). A job goes to the helpers inside the ``try`` that cancels
# it and waits (``_work_and_wait``). A job joined later (``start_ordered``; NOTE [ Pullbacks
# joined later ] in _function) is listed in its thread until joined: an interrupt anywhere in
# between, in parsum's code or in torch's between the two nodes, leaves it listed, and the
# caller's ``except`` or, failing that, the thread's next ``sum_models`` call or sum's backward
# (a retained graph's) cancels it, waits for it and undoes its writes (``abandon_unjoined``).
# Those waits last as long as the helpers' running chunks (seconds for large models), long
# enough for a second Ctrl-C, which would leave them writing as the first would have: they wait
# through one interrupt and raise it once the chunks have ended (``_Job.wait_out``). One more
# leaves them running, with a warning: a chunk that never ends (a model waiting on something
# that never comes) must not hold the caller beyond the user's insistence. Every lock the
# caller takes, and a job's ``done``, are _locks' (NOTE [ Locks and interrupts ]): on Python
# 3.14 an interrupt could leave a plain lock's ``with`` holding it.
#
# NOTE [ The caller's last chunk ]
# At a job's end one thread runs the last chunk while the others have nothing left. Where that
# is a helper, the caller, done with its own, waits for it and then for the GIL: a helper
# releases it only once it blocks on the queue again, 50-60 us after it signals the job done
# (2 cores, median). Where the chunks are claimed costliest first and the last of them is small
# (``small_last_chunk`` in _grouping: at most CALLERS_LAST_PARAM_ROWS, a model whose kernels
# weigh half its overhead) and each thread has more than two chunks, helpers leave the last
# chunk to the caller: the wait at the end is a helper's, off the call's path, and costs at most
# that small chunk (the caller's wait at a job's end, timed in place: 100-130 us -> 5 us,
# median). In one process against the code before this and NOTE [ A helper's state ]
# (benchmarks/bench_against.py, 2 cores): 16 MLPs of widths 128-512 at batch 64 on 2 workers
# 1.007-1.025x (three runs of 100 rounds), 64 tiny MLPs at n_jobs=2 1.011x; at batch 256 (its
# last chunk too large to leave) 0.999x, 8 small CNNs at n_jobs=2 0.991x. Left to the caller
# whatever its size, the last of those CNNs (the narrowest, milliseconds) left the helper idle:
# 0.91-0.96x.
#
# NOTE [ Thread control ]
# A job uses at most min(n_jobs, chunks, usable cores) threads, caller included. Every task runs
# with budget // min(budget, chunks) intra-op threads, the budget being the threads the caller
# may use (NOTE [ Thread budget ]), so by default workers x intra-op threads <= the budget. That
# count depends on the chunks and the budget, never on n_jobs, because some PyTorch kernels
# (convolution weight gradients, large reductions) give other bits with another thread count:
# fixing it keeps every model's own result, not only the reduction, the same for any n_jobs.
# (The bits depend on the budget as they depend on the machine.) With many models that is 1
# thread per task and the cores go to models side by side. ``torch.set_num_threads`` is per
# thread under OpenMP; the caller's value is restored after the job. Grad mode, inference mode,
# autocast, the default device and CUDA's current device and stream are thread-local in PyTorch
# and do not cross threads: they are captured in the caller and re-entered by every helper
# (``ThreadState``).
#
# NOTE [ A helper's state ]
# Where grad mode and parsum's settings are the whole of the caller's state (no inference mode,
# autocast, default device or CUDA stream), a helper sets them and leaves them set: the next
# job sets its own. Entered and left as a context each job, the state cost the helper's start
# of the job and, at its end, the caller's wake-up, which waits for the GIL until the helper
# blocks on the queue again. 16 MLPs of widths 128-512 at batch 64, 2 workers on 2 cores, in
# one process against the code before (benchmarks/bench_against.py): 1.00-1.02x.
#
# NOTE [ Thread budget ]
# The budget is ``torch.get_num_threads()`` in the calling thread when the call starts, capped
# by the usable cores (affinity, cgroups): what the user, ``OMP_NUM_THREADS`` or torchrun (one
# thread per process unless told otherwise) left it. Sizing pools and intra-op threads for all
# the machine's cores instead made P processes on one host each use every core: on 16 cores, 4
# processes took 141-220 ms a step and 16 took 1.2-2.0 s, against 10-22 ms for one process, and
# 6.9 ms for 4 processes once each counted its share. With a budget of 1 and n_jobs left
# unset, a call starts no helper thread.
#
# NOTE [ Spinning intra-op threads ]
# After a parallel region, OpenMP's threads (libgomp's, in PyTorch's Linux wheels) spin before
# they sleep, each on a core: 5-9 ms here (their CPU time while the caller slept). A helper
# woken then shares its core with a spinning thread. Measured on 2 cores, 16 MLPs of widths
# 128-512 at batch 256 on 2 workers: the helper started the backward's chunks 1.1-1.8 ms after
# they were submitted (0.05-0.1 ms otherwise), and the backward took 16.5 ms against the 13.2
# it took with OMP_WAIT_POLICY=passive or in chunks of 2 models. The region was parsum's own:
# the chunk partials' wide reduction (16 x 256 x 10 elements, above the intra-op grain), run
# on the caller's 2 threads between the forward and the backward. parsum's own work between
# jobs (the final sums) therefore runs under the tasks' intra-op threads, as the chunks did.
# A parallel op of the caller's right before a call (an optimizer step on the caller's
# threads) delays the helpers the same way: NOTE [ The caller's OpenMP team ].
# OMP_WAIT_POLICY=passive, set before torch is imported, ends the spinning, at a cost to
# every parallel op.
#
# NOTE [ The caller's OpenMP team ]
# A job on several threads first ends the caller's OpenMP team where the caller ran with more
# intra-op threads than the job's tasks use: the team of its last parallel op (the user's
# optimizer step, a large loss) would spin on the cores the helpers are about to take. libgomp's
# ``omp_pause_resource_all`` joins the calling thread's team and no other thread's; the caller's
# next parallel op after the call starts a new team (about 30 us a thread here). Measured on 2
# cores (alternating processes, each method after 20 ms of untimed steps), a step with
# torch.optim.Adam after each call, against the plain loop with the same: 16 MLPs of widths
# 128-512 at batch 64 on 2 workers 0.80-0.82x -> 0.94-0.97x (one chunk on 2 intra-op threads:
# 0.91x), at batch 256 0.88-0.89x -> 0.98-1.04x; 8 CNNs of widths 8-24 (on 2 workers by default)
# 0.92-0.95x -> 1.00x. Without an optimizer it changed nothing measurable (medium MLPs at batch
# 64 on 2 workers: 8.37 against 8.32 ms). In one process, ended or kept call by call
# (benchmarks/bench_team.py): ended / kept 1.08-1.16x; against the code before, in one process
# (bench_against.py), the default with Adam 1.07-1.08x faster for the medium MLPs (now on
# workers), 1.08x for the CNNs. With the team ended, a budget of 2 goes to workers with any
# optimizer (NOTE [ Threads that pay ] in _grouping). Only libgomp, the OpenMP of PyTorch's
# Linux wheels, is called: another OpenMP's pause (LLVM's) acts on every thread of the process.
# Elsewhere nothing is ended, and a budget of 2 keeps MLPs off workers unless the optimizer
# steps in the backward. Nor in a forked child: its libgomp still lists the team threads of the
# thread that forked, which the child does not have, and the pause waited for them forever
# (reproduced). Such a child is fragile with or without parsum: a parallel op of its own on 2
# threads hangs there too. (A child seen to crash in a Linear while its caller and helper ran
# models most likely met another race: NOTE [ A forked child's autograd engine ].) The test
# checks the child with a spy. Not measured on many cores, where the user's next parallel op
# starts up to 15 threads again after each call.
#
# NOTE [ Helpers' OpenMP teams ]
# A thread that runs a parallel op on n intra-op threads keeps an OpenMP team of n - 1 threads
# for as long as it lives, and while a process holds more OpenMP threads than it has cores,
# libgomp makes every wait in the process sleep almost at once instead of spinning, so each
# parallel op of every thread pays for waking its team (libgomp's throttled spin). Measured on
# 2 cores: the caller's plain loop over 16 MLPs of widths 128-512 at batch 64, on its 2
# threads, took 17.8 ms a step while another live thread kept a team of 2, against 9.1 before
# and after that thread ended. A helper runs with more than one intra-op thread where a job has
# fewer chunks than the budget has threads (on 16 cores: 4 large models, 8 CNNs), and a team
# kept by a helper between calls would slow the user's own ops (optimizer steps, the loss,
# evaluation) for the rest of the process: such a helper starts a successor after its job and
# ends, its team with it. The successor starts between jobs: started by the next call, in the
# caller, a thread waited for a core that the caller's own OpenMP threads were spinning on. A
# fresh helper and team each job cost the call itself: simulated on 2 cores (the call seeing a
# budget of 4 over 2 chunks, the user's Adam step on the 2 cores' threads), a training step of
# 4 large MLPs took 36-39 ms against 37-41 with teams kept (parsum's call 30-33 against 28-31,
# the Adam step 5.6-5.8 against 9.3-10.1), 16 medium MLPs 16.4-17.2 against 17.2-29.3, and 8
# CNNs 62-69 against 59-65 (their Adam step is short). Not measured on a machine with that many
# cores. Helpers on one intra-op thread (many models a call, or a budget of 2) hold no team and
# stay.
#
# NOTE [ Helpers at exit ]
# A thread that ends while the interpreter finalizes may abort the process. torch 2.12 leaves a
# Python object in every thread that ran a backward pass (the autograd engine's stashed context),
# released by a C++ thread-local destructor when the thread ends, after Python's ``join`` has
# returned; where the main thread is finalizing by then, that destructor's wait for the GIL
# exits the thread inside it and the process ends in "terminate called without an active
# exception". Ending the helpers at exit did that: on torch 2.12.1 a script of parsum calls
# (tests/test_concurrency.py's ``_EXIT_SCRIPT`` kind) aborted 5 times in 40 with the helpers
# ended at exit, 0 in 40 without. At exit the pool parks them instead: each finishes what it
# runs and then blocks for good, and the process ends around it without running its thread's
# destructors; a helper that handed over (NOTE [ Helpers' OpenMP teams ]) is waited for until
# the kernel lists it no more, and later jobs (other exit handlers) run in the caller alone.
#
# NOTE [ Saved-tensor hooks ]
# Saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``, ``save_on_cpu``) are
# thread-local too, but a call made under them runs in the calling thread instead
# (``sum_models`` sets one worker): they are not written for threads, and non-reentrant
# checkpointing around ``sum_models`` matches the tensors it recomputes to those saved by the
# order they were saved in, which threads would shuffle (measured: its metadata check failed
# with 2 workers; tensors of one shape could be swapped without a word). Nor does ``auto``
# stack identical models there (``sum_models`` plans them as engine "autograd"): the stacked
# forward refuses graphs that may recompute (NOTE [ Checkpoints under vmap ] in _engines) only
# after it ran, and the tensors that failed attempt saved counted in the checkpoint's forward,
# so that its recomputation, which ran the models one by one, saved fewer and raised
# CheckpointError (4 identical MLPs in checkpoint(..., use_reentrant=False) around the call:
# every backward failed, found by trying it); and the failure marked the models as ones vmap
# cannot run, for good, which cost later calls outside the checkpoint their stacking.
#
# NOTE [ Modes stay in the calling thread ]
# Torch function modes (``TorchFunctionMode``) and dispatch modes (``TorchDispatchMode``:
# ``FlopCounterMode``, tracing) are thread-local as well, and a mode object cannot be entered
# again in another thread (``FlopCounterMode`` starts its count anew on entering). A helper ran
# its models outside the caller's mode: a function mode that changed a layer's output gave
# another sum on 2 workers than on 1, and ``FlopCounterMode`` missed the helpers' flops, in
# forward and in backward. Where such a mode is on, a job runs in the calling thread
# (``threads_for``), in forward or in backward, wherever the mode is then: the same chunks
# under the same intra-op threads, hence the same bits. The default device's context
# (``with torch.device(...)``), a function mode too, is carried instead (``ThreadState``).
# torch.profiler records only the threads it was started in unless asked for every thread
# (``experimental_config=_ExperimentalConfig(profile_all_threads=True)``): that is the user's
# choice, and a call does not leave its threads for it.
#
# NOTE [ Context variables ]
# Python's context variables (``contextvars.ContextVar``: a setting a model reads, a library's
# context manager) belong to the thread that set them: a model on a helper read their defaults,
# and a sum of models that scale their output by one came out wrong on 2 workers without a
# word. Each helper runs its part of a job in a copy of the caller's context taken when the job
# starts, as ``asyncio.to_thread`` does; what a model sets there stays in that job.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import ctypes
import enum
import functools
import math
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._device import DeviceContext

from . import _config
from ._locks import Latch, Lock

_AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_states() -> list[tuple[str, torch.dtype]]:
    """(device type, dtype) of each autocast on in this thread."""
    autocast = []
    for device in _AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(device):
                autocast.append((device, torch.get_autocast_dtype(device)))
        except RuntimeError:  # device type not built into this torch
            continue
    return autocast


class _Local(threading.local):
    in_task = False

    def __init__(self) -> None:
        # Jobs from ``start_ordered`` not joined yet (NOTE [ Interrupted callers ]).
        self.unjoined: list[_Job] = []


_local = _Local()


def chunk_ranges(n_items: int, chunk_size: int) -> list[range]:
    return [range(i, min(i + chunk_size, n_items)) for i in range(0, n_items, chunk_size)]


def default_chunk_size(n_items: int) -> int:
    """Models per task when the user gives none: at most 16 chunks, from the count alone."""
    return max(1, math.ceil(n_items / 16))


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are in effect in this thread (``saved_tensors_hooks``,
    ``save_on_cpu``, non-reentrant checkpointing around the call); read through a private
    torch function (NOTE [ Saved-tensor hooks ]). Where it is gone, False: answering True would
    keep every call in one thread."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return False
    try:
        return top(False) is not None  # ignore_is_tracing
    except TypeError:  # a torch whose function takes no argument
        return top() is not None


@dataclass(frozen=True)
class ThreadState:
    """The caller's thread-local state that models depend on, to re-enter in helper threads.

    Grad mode, inference mode and autocast; ``parsum.config`` (a model that calls sum_models
    itself must get the caller's settings in any thread, or its bits would depend on n_jobs);
    the default device (``torch.set_default_device``, ``with torch.device(...)``), which
    tensors a model creates land on. With CUDA in use, the current device and its current
    stream: a helper on another stream than the caller's would read inputs before the
    caller's stream wrote them, and the caller would read outputs before they were written.
    (Saved-tensor hooks are not carried: under them a call stays in the calling thread, NOTE
    [ Saved-tensor hooks ].)
    """

    grad_enabled: bool
    inference: bool
    autocast: tuple[tuple[str, torch.dtype], ...]
    default_device: torch.device | None = None
    cuda_device: int | None = None
    cuda_stream: Any = None
    settings: Any = None  # parsum.config's, for nested calls run in helpers
    # The caller's context variables, each helper running in a copy (NOTE [ Context
    # variables ]).
    context: contextvars.Context = field(default_factory=contextvars.copy_context)

    @classmethod
    def capture(cls) -> ThreadState:
        autocast = autocast_states()
        # A default device is a DeviceContext on the function-mode stack: with no mode there,
        # none (``get_default_device`` imports and filters in Python on every call).
        default_device = torch.get_default_device() if _function_modes() else None
        cuda_device: int | None = None
        cuda_stream = None
        if torch.cuda.is_initialized():
            # The current device's stream only: asking for another device's would create a
            # CUDA context there.
            cuda_device = torch.cuda.current_device()
            cuda_stream = torch.cuda.current_stream(cuda_device)
        return cls(
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            tuple(autocast),
            None if default_device is None or default_device.type == "cpu" else default_device,
            cuda_device,
            cuda_stream,
            _config.current_settings(),
        )

    def set_here(self) -> bool:
        """Set grad mode and parsum's settings in this thread, and leave them set, where they
        are the whole state; False (nothing set) otherwise, for ``entered``. A helper that
        entered and left a context each job paid for it at the job's start and again at its
        end, while the caller waited for the GIL (NOTE [ A helper's state ])."""
        if self.inference or self.autocast or self.default_device is not None:
            return False
        if self.cuda_device is not None:
            return False
        torch._C._set_grad_enabled(self.grad_enabled)
        _config.set_settings(self.settings)
        return True

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for device, dtype in self.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            if self.default_device is not None:
                stack.enter_context(self.default_device)
            if self.cuda_device is not None:
                stack.enter_context(torch.cuda.device(self.cuda_device))
                stack.enter_context(torch.cuda.stream(self.cuda_stream))
            stack.enter_context(_config.settings_entered(self.settings))
            yield


def _function_modes() -> bool:
    """Whether this thread has a torch function mode (a DeviceContext among them)."""
    count = getattr(torch._C, "_len_torch_function_stack", None)
    return count is None or count() > 0


# NOTE [ Helpers that cannot start ]
# A process at its limit of threads (a container's pids limit, ``ulimit -u``) cannot start a
# helper: ``Thread.start`` raises RuntimeError. The job then goes to the helpers that are there,
# none perhaps, and the caller runs the chunks they do not take: the same chunks, on the same
# intra-op threads, so the same bits, on fewer threads, with a warning that says so. Before,
# the call raised the RuntimeError, having changed nothing. A job is put in the queue once for
# each helper there is, so that entries no helper will ever take do not pile up call after call.
_NO_THREAD = (
    "parsum could not start a worker thread ({}): this call runs on the calling thread and the "
    "{} worker thread(s) there are, with the same results"
)

_LEFT_RUNNING = (
    "parsum: interrupted again while waiting for the chunks its helper threads are running; "
    "left them running: they may still write gradients, statistics or optimizer steps"
)


class _Job:
    """One call's chunks: claimed by any thread in ``order`` (default: chunk order), results
    consumed in chunk order."""

    def __init__(
        self,
        task: Callable[[int], Any],
        n_tasks: int,
        consume: Callable[[int, Any], None],
        state: ThreadState,
        intra_threads: int,
        order: Sequence[int] | None = None,
        callers_last: bool = False,
        helpers: int = 0,
    ) -> None:
        self.task: Callable[[int], Any] | None = task
        self.order = order
        self.consume: Callable[[int, Any], None] | None = consume
        self.n_tasks = n_tasks
        self.state = state
        self.intra_threads = intra_threads
        self.helpers = helpers  # the helpers it goes to
        self.handed = False  # whether it went to them
        self.on_abandon: Callable[[], None] | None = None  # NOTE [ Interrupted callers ]
        self.failures: dict[int, BaseException] = {}
        self.done = Latch()
        self._lock = Lock()
        self._next_claim = 0
        # Chunks that helpers run (NOTE [ Interrupted callers ]): the caller waits only for
        # those, once it has left ``work``.
        self._running = 0
        self._pending: dict[int, Any] = {}
        self._next_consume = 0
        self._consuming = False
        self._cancelled = False
        self.callers_last = callers_last

    def _claim(self, caller: bool) -> int | None:
        with self._lock:
            if self.task is None or self._cancelled:
                return None
            # NOTE [ The caller's last chunk ]
            end = self.n_tasks - 1 if self.callers_last and not caller else self.n_tasks
            while self._next_claim < end:
                at = self._next_claim
                self._next_claim += 1
                k = at if self.order is None else self.order[at]
                # After a failure only the chunks before it start: the smallest failing chunk
                # is then the one a run on one thread would meet first.
                if self.failures and k > min(self.failures):
                    continue
                if not caller:
                    self._running += 1
                return k
            return None

    def _release(self, caller: bool) -> None:
        with self._lock:
            if not caller:
                self._running -= 1
            if self._running == 0 and self._nothing_to_claim():
                self.done.set()

    def _nothing_to_claim(self) -> bool:
        if self.task is None or self._cancelled:
            return True
        rest = range(self._next_claim, self.n_tasks)
        if not self.failures:
            return not rest
        first = min(self.failures)
        return all((at if self.order is None else self.order[at]) > first for at in rest)

    def cancel(self) -> None:
        """Start no chunk any more; ``done`` is set once the running ones have finished."""
        with self._lock:
            self._cancelled = True
            if self._running == 0:
                self.done.set()

    def wait_out(self) -> BaseException | None:
        """Wait for ``done`` through an interrupt, which would leave chunks writing after the
        caller left (NOTE [ Interrupted callers ]), and give it, to raise once done; a second
        one leaves them running (a chunk that never ends), with a warning."""
        interrupt: BaseException | None = None
        while True:
            try:
                self.done.wait()
                return interrupt
            except BaseException as exc:
                if interrupt is not None:
                    warnings.warn(_LEFT_RUNNING, RuntimeWarning, stacklevel=2)
                    raise
                interrupt = exc

    def abandon(self) -> tuple[Callable[[], None] | None, BaseException | None]:
        """Cancel, wait out the running chunks and close (NOTE [ Interrupted callers ]); give
        what undoes their writes (``on_abandon``) and an interrupt met while waiting."""
        self.cancel()
        interrupt = self.wait_out()
        undo = self.on_abandon
        self.close()
        return undo, interrupt

    def _fail(self, k: int, exc: BaseException) -> None:
        with self._lock:
            self.failures.setdefault(k, exc)

    def _deposit(self, k: int, result: Any) -> None:
        # Whoever finds no consumer at work becomes the consumer and drains every result that
        # is next in order; results are consumed one at a time, in order, outside the lock.
        with self._lock:
            self._pending[k] = result
            if self._consuming:
                return
            self._consuming = True
        while True:
            with self._lock:
                if self.failures or self._next_consume not in self._pending:
                    self._consuming = False
                    return
                j = self._next_consume
                item = self._pending.pop(j)
                self._next_consume += 1
            try:
                assert self.consume is not None
                self.consume(j, item)
            except BaseException as exc:
                self._fail(j, exc)

    def close(self) -> BaseException | None:
        """After the job: hold no models, tensors or errors (a helper may still hold the job
        in the queue); give the failure of the smallest chunk, if any."""
        with self._lock:
            self.task = self.consume = self.on_abandon = None
            failures, self.failures = self.failures, {}
            self._pending.clear()
        return failures[min(failures)] if failures else None

    def work(self, caller: bool = False) -> None:
        """Claim and run chunks until none is left (called by the caller and by helpers)."""
        while (k := self._claim(caller)) is not None:
            try:
                assert self.task is not None
                result = self.task(k)
            except BaseException as exc:
                self._fail(k, exc)
            else:
                self._deposit(k, result)
            finally:
                self._release(caller)


class _Pool:
    def __init__(self) -> None:
        self._forget_helpers()
        atexit.register(self.park)  # NOTE [ Helpers at exit ]
        # A forked child has only the thread that forked: without this it would count the
        # parent's helpers as its own and run every job alone, or wait forever on the pool's
        # lock if another thread held it at the fork.
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget_helpers)

    def _forget_helpers(self) -> None:
        self._queue: queue.SimpleQueue[_Job | _Signal] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._leaving: list[threading.Thread] = []  # helpers that handed over and end
        self._lock = Lock()
        self._parked = threading.Semaphore(0)
        self.is_parked = False

    def stop(self) -> None:
        """End every helper thread; a later job starts new ones."""
        with self._lock:
            threads, self._threads = self._threads, []
            for _ in threads:
                self._queue.put(_Signal.END)
        for thread in threads:
            if thread.ident is not None:  # a successor not started yet meets its END later
                thread.join(timeout=5)

    def park(self, timeout: float = 5.0) -> None:
        """At exit: wait until every helper is idle and leave it blocked for good, and until
        every helper that handed over has ended; later jobs run in the caller alone (NOTE
        [ Helpers at exit ])."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self.is_parked = True
            threads, self._threads = self._threads, []
            leaving, self._leaving = self._leaving, []
            for _ in threads:
                self._queue.put(_Signal.PARK)
        for _ in threads:
            if not self._parked.acquire(timeout=max(0.0, deadline - time.monotonic())):
                break
        for thread in leaving:
            _wait_until_ended(thread, deadline)

    def ensure_helpers(self, n: int) -> int:
        """Start helpers up to ``n``; how many there are (fewer where the system starts no
        more threads: NOTE [ Helpers that cannot start ])."""
        _rebuild_engine_here()  # NOTE [ A forked child's autograd engine ]
        with self._lock:
            self._leaving = [t for t in self._leaving if not _has_ended(t)]
            # A helper that ended on a stop() meant for one that handed over (NOTE [ Helpers'
            # OpenMP teams ]) is replaced; a successor not started yet is kept.
            self._threads = [t for t in self._threads if t.ident is None or t.is_alive()]
            while len(self._threads) < n:
                thread = self._new_helper(f"parsum-worker-{len(self._threads)}")
                try:
                    thread.start()
                except RuntimeError as exc:
                    warnings.warn(_NO_THREAD.format(exc, len(self._threads)), RuntimeWarning, 3)
                    break
                self._threads.append(thread)
            return len(self._threads)

    def _new_helper(self, name: str) -> threading.Thread:
        return threading.Thread(target=self._serve, name=name, daemon=True)

    def submit(self, job: _Job, helpers: int) -> None:
        for _ in range(helpers):
            self._queue.put(job)

    @property
    def size(self) -> int:
        return len(self._threads)

    def _serve(self) -> None:
        _local.in_task = True
        while True:
            job = self._queue.get()
            if job is _Signal.END:
                return
            if job is _Signal.PARK:
                self._parked.release()
                threading.Event().wait()  # never set: the process ends around this thread
            assert isinstance(job, _Job)
            if job.done.is_set():
                continue
            _set_threads(job.intra_threads)
            # A copy for each helper: a context runs in one thread at a time.
            context = job.state.context.copy()
            if job.state.set_here():  # NOTE [ A helper's state ]
                context.run(job.work)
            else:
                with job.state.entered():
                    context.run(job.work)
            del context
            teamed = job.intra_threads > 1
            del job
            if teamed and self._hand_over():  # NOTE [ Helpers' OpenMP teams ]
                return

    def _hand_over(self) -> bool:
        """Put a new helper in this one's place in the pool; whether this one then ends (not
        once parked: it takes its PARK instead)."""
        me = threading.current_thread()
        with self._lock:
            if self.is_parked:
                return False
            if me not in self._threads:  # stop() took every helper out
                return True
            successor = self._new_helper(me.name)
            self._threads[self._threads.index(me)] = successor
            self._leaving.append(me)
        # Started here, not by the next call: a thread's start waits for a core, which the
        # caller's intra-op threads may still be spinning on.
        try:
            successor.start()
        except RuntimeError:  # the interpreter is shutting down: no new threads
            with self._lock:
                if successor in self._threads:
                    self._threads.remove(successor)
        return True


class _Signal(enum.Enum):
    """What a helper takes from the queue instead of a job."""

    END = "end"
    PARK = "park"


def _has_ended(thread: threading.Thread) -> bool:
    """Whether ``thread`` has ended, its thread-local destructors run: on Linux, once the
    kernel lists it no more (it is no longer alive for Python once its Python state is gone,
    before those)."""
    if thread.is_alive():
        return False
    return thread.native_id is None or not os.path.exists(f"/proc/self/task/{thread.native_id}")


def _wait_until_ended(thread: threading.Thread, deadline: float) -> None:
    thread.join(timeout=max(0.0, deadline - time.monotonic()))
    while not _has_ended(thread) and time.monotonic() < deadline:
        time.sleep(0.001)


_pool = _Pool()


def pool_size() -> int:
    """Number of helper threads in the pool (for tests: repeated calls must not grow it)."""
    return _pool.size


def intra_op_threads(n_tasks: int, budget: int | None = None) -> int:
    """Intra-op threads of every task of a job with ``n_tasks`` chunks (NOTE [ Thread control ]),
    for ``budget`` threads (default: this thread's, ``_config.thread_budget``)."""
    budget = _config.thread_budget() if budget is None else budget
    return max(1, budget // min(budget, n_tasks))


def threads_for(n_tasks: int, n_workers: int) -> int:
    """Threads a job of ``n_tasks`` chunks runs on, caller included (1 inside a task)."""
    if _local.in_task or modes_stay_here() or _pool.is_parked:
        return 1
    return min(n_workers, n_tasks, _config.usable_cores())


def modes_stay_here() -> bool:
    """Whether a torch function mode other than the default device's, or a dispatch mode, is
    on in this thread: then jobs run here (NOTE [ Modes stay in the calling thread ])."""
    if _dispatch_modes():
        return True
    if not _function_modes():
        return False
    stack = _function_mode_stack()
    return stack is None or not all(isinstance(mode, DeviceContext) for mode in stack)


def _dispatch_modes() -> bool:
    """Whether this thread has a torch dispatch mode (False where torch cannot tell)."""
    count = getattr(torch._C, "_len_torch_dispatch_stack", None)
    return count is not None and count() > 0


def _function_mode_stack() -> list[Any] | None:
    """This thread's torch function modes, outermost first; None where torch cannot tell."""
    stack = getattr(torch.overrides, "_get_current_function_mode_stack", None)
    return None if stack is None else list(stack())


def run_ordered(
    task: Callable[[int], Any],
    n_tasks: int,
    n_workers: int,
    consume: Callable[[int, Any], None],
    order: Sequence[int] | None = None,
    callers_last: bool = False,
    one_pass: Callable[[], None] | None = None,
) -> None:
    """Run ``task(k)`` for every chunk ``k`` on up to ``n_workers`` threads (caller included),
    the threads claiming the chunks in ``order`` (a permutation of them; default 0, 1, ...;
    NOTE [ Costliest chunks first ]); with ``callers_last`` and an ``order``, the last in it is
    left to the caller where each thread has more than two chunks (NOTE [ The caller's last
    chunk ]). Where the job runs on one thread, ``one_pass()``, if given, runs instead: every
    chunk in order, each consumed (NOTE [ Chunks in one pass ] in _function).

    ``consume(k, result)`` is called once per chunk in the order k = 0, 1, ..., never two at
    once. If a task or a consume raises, only the chunks before it may still start, the chunks
    already running finish, and the exception of the smallest failing chunk is raised in the
    caller. See NOTE [ Caller runs, no deadlock ] and NOTE [ Thread control ].
    """
    job = _new_job(task, n_tasks, n_workers, consume, order, callers_last)
    with as_one_task(n_tasks):
        if job is None:  # one thread (or nested): no job, no locks, no state to hand over
            if one_pass is not None:
                one_pass()
            else:
                _run_here(task, n_tasks, consume)
        else:
            _work_and_wait(job)


def run_last_first(
    task: Callable[[int], Any], n_tasks: int, consume: Callable[[int, Any], None]
) -> None:
    """Run ``task(k)`` in this thread for k = n_tasks - 1, ..., 0, then ``consume(k, result)``
    for k = 0, 1, ...: the plain loop's backward order, with ``run_ordered``'s sums (NOTE
    [ Pullbacks that write shared state ] in _function). A task that raises stops it."""
    with as_one_task(n_tasks):
        results = [task(k) for k in reversed(range(n_tasks))]
        results.reverse()
        for k, result in enumerate(results):
            results[k] = None  # each result goes as it is consumed
            consume(k, result)


def release_callers_team() -> None:
    """End this thread's OpenMP team, if OpenMP is libgomp (NOTE [ The caller's OpenMP
    team ]); its next parallel op starts a new one."""
    pause = _team_pause()
    if pause is not None:
        pause(_OMP_PAUSE_SOFT)


def releases_callers_team() -> bool:
    """Whether ``release_callers_team`` ends the team."""
    return _team_pause() is not None


def _team_pause() -> Callable[[int], int] | None:
    """The pause that ends this thread's team: libgomp's, where this process was not forked
    (a forked child's libgomp lists the parent's team threads, which the child does not have,
    and the pause waits for them forever)."""
    return None if _forked.child else _omp_pause()


class _Forked:
    child = False
    engine_rebuilt = True  # NOTE [ A forked child's autograd engine ]

    def after_in_child(self) -> None:
        self.child = True
        self.engine_rebuilt = False


_forked = _Forked()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked.after_in_child)


# NOTE [ A forked child's autograd engine ]
# PyTorch rebuilds its autograd engine in a forked child: a fork handler marks it, and the first
# use of the engine in the child destroys it and builds it anew in place, with no lock (its
# comment assumes the GIL is held; recording a saved tensor for backward reaches it without).
# Two threads whose first autograd use in the child comes at once both rebuild it: a child whose
# first sum_models ran models on the caller and a helper at once crashed (SIGSEGV in the
# engine's destructor, under ``SavedVariable::get_default_hooks``, from a helper's Linear; about
# one run in ten of the fork tests under pytest-xdist). Before a child's first helper starts,
# the calling thread, alone, uses the engine once: a backward of one scalar.


def _rebuild_engine_here() -> None:
    """Use the autograd engine in this thread, where this is a forked child that has not
    started a helper yet (NOTE [ A forked child's autograd engine ])."""
    if _forked.engine_rebuilt:
        return
    _forked.engine_rebuilt = True
    try:
        with torch.inference_mode(False), torch.enable_grad():
            leaf = torch.zeros((), device="cpu", requires_grad=True)
            torch.autograd.grad(leaf.sum(), leaf)  # nothing saved: no saved-tensor hook runs
    except RuntimeError:  # autograd refuses to run in this child: the models' calls will say so
        pass


_OMP_PAUSE_SOFT = 1


@functools.cache
def _omp_pause() -> Callable[[int], int] | None:
    """libgomp's ``omp_pause_resource_all``, from the libgomp that torch loaded; None where
    torch's intra-op threads are not libgomp's (another OpenMP, another platform)."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line.split("/")[-1]}
    except OSError:
        return None
    path = torchs_libgomp(paths)
    if path is None:
        return None
    try:
        pause = ctypes.CDLL(path).omp_pause_resource_all
    except (OSError, AttributeError):
        return None
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause


def torchs_libgomp(paths: set[str]) -> str | None:
    """Of the libgomp files mapped into the process, torch's: the one in torch's folder (its
    wheels' torch/lib, or torch.libs where auditwheel repaired one), else the only one."""
    torch_dir = os.path.dirname(torch.__file__)
    ours = [p for p in paths if p.startswith((torch_dir + os.sep, torch_dir + ".libs" + os.sep))]
    if len(ours) == 1:
        return ours[0]
    return next(iter(paths)) if not ours and len(paths) == 1 else None


def in_a_task() -> bool:
    """Whether this thread runs a chunk of a job (a helper, or a caller running its own)."""
    return _local.in_task


@contextlib.contextmanager
def as_one_task(n_tasks: int) -> Iterator[int]:
    """Run the block in this thread as a task of a job of ``n_tasks`` chunks: with the tasks'
    intra-op threads (NOTE [ Thread control ]; yielded), nested calls sequential. Inside a
    task (nested), as it is: this thread already has its share of the cores."""
    if _local.in_task:
        yield torch.get_num_threads()
        return
    saved_threads = torch.get_num_threads()
    intra_threads = intra_op_threads(n_tasks)
    # NOTE [ Interrupted callers ]: an interrupt is raised where the caller next runs Python
    # (at a function's start, after a call returns), so one that came while it waited in a job
    # lands in the lines below as often as not (without the GIL, 1 run in 2-20 of a test's 20
    # interrupts): the count is set inside the try and set back whatever lands in the finally.
    try:
        _set_threads(intra_threads)
        _local.in_task = True
        yield intra_threads
    finally:
        _local.in_task = False
        try:
            _set_threads(saved_threads)
        except BaseException:
            torch.set_num_threads(saved_threads)
            raise


def _set_threads(n: int) -> None:
    """``torch.set_num_threads(n)`` unless this thread already has n: the call also resets
    MKL's process-wide thread count, which other threads' kernels read."""
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def _run_here(
    task: Callable[[int], Any], n_tasks: int, consume: Callable[[int, Any], None]
) -> None:
    for k in range(n_tasks):
        consume(k, task(k))


def start_ordered(
    task: Callable[[int], Any],
    n_tasks: int,
    n_workers: int,
    consume: Callable[[int, Any], None],
    order: Sequence[int] | None = None,
    callers_last: bool = False,
    on_abandon: Callable[[], None] | None = None,
) -> _Job | None:
    """``run_ordered``'s job handed to helpers, for the caller to join later with ``join``
    (NOTE [ Pullbacks joined later ] in _function); None where it would run on one thread (or
    nested): then ``run_ordered`` runs it here. Where it is never joined, ``abandon_unjoined``
    cancels it and then calls ``on_abandon``."""
    job = _new_job(task, n_tasks, n_workers, consume, order, callers_last)
    if job is None:
        return None
    job.on_abandon = on_abandon
    _local.unjoined.append(job)  # NOTE [ Interrupted callers ]
    _give_to_helpers(job)
    return job


def join(job: _Job) -> None:
    """Work on ``job`` (from ``start_ordered``) in this thread, under its intra-op threads,
    until none of its chunks is left, and wait for the others; as ``run_ordered`` ends."""
    try:
        with as_one_task(job.n_tasks):
            _work_and_wait(job)
    except BaseException:
        # Interrupted before ``_work_and_wait`` waited, which closes the job (NOTE
        # [ Interrupted callers ]): the caller undoes what the chunks wrote once they have
        # finished (a second interrupt while it waits goes with the first). Not again where it
        # waited: a third interrupt there left the chunks running.
        if job.task is not None:
            job.abandon()
        raise
    finally:
        if job in _local.unjoined:
            _local.unjoined.remove(job)


def abandon_unjoined(leaving: bool = False) -> None:
    """Cancel the jobs of ``start_ordered`` that this thread did not join (an interrupt left
    them), wait for their running chunks and undo what they wrote (NOTE [ Interrupted
    callers ]); then raise an interrupt met while waiting, unless ``leaving`` (called as an
    error leaves, which goes with it). Not inside a task: the job this thread is joining may be
    running it."""
    interrupt: BaseException | None = None
    while _local.unjoined and not _local.in_task:
        job = _local.unjoined[-1]  # listed until abandoned: an interrupt may come in between
        undo, met = job.abandon()
        _local.unjoined.remove(job)
        if undo is not None:
            undo()
        interrupt = interrupt or met
    if interrupt is not None and not leaving:  # raised once every job's writes are undone
        try:
            raise interrupt
        finally:
            interrupt = None


def _new_job(
    task: Callable[[int], Any],
    n_tasks: int,
    n_workers: int,
    consume: Callable[[int, Any], None],
    order: Sequence[int] | None,
    callers_last: bool,
) -> _Job | None:
    """A job with the caller's state, for helpers (not handed to them yet); None where it
    would run on one thread. Its last chunk is left to the caller where ``callers_last`` and
    each thread has more than two (NOTE [ The caller's last chunk ])."""
    threads = threads_for(n_tasks, n_workers)
    if threads <= 1:
        return None
    intra_threads = intra_op_threads(n_tasks)
    if torch.get_num_threads() > intra_threads:
        release_callers_team()  # NOTE [ The caller's OpenMP team ]
    last = callers_last and order is not None and n_tasks > 2 * threads
    state = ThreadState.capture()
    return _Job(task, n_tasks, consume, state, intra_threads, order, last, threads - 1)


def _give_to_helpers(job: _Job) -> None:
    """Give ``job`` to its helpers, started where missing: to as many as there are (NOTE
    [ Helpers that cannot start ])."""
    job.handed = True
    _pool.submit(job, min(job.helpers, _pool.ensure_helpers(job.helpers)))


def _work_and_wait(job: _Job) -> None:
    """The caller's part of a job (handed to helpers here unless it was): its chunks, then
    the wait."""
    try:
        try:
            if not job.handed:
                _give_to_helpers(job)
            job.work(caller=True)
            job.done.wait()
        except BaseException:
            # Interrupted in the caller (KeyboardInterrupt, an exception from a signal handler):
            # the chunks that helpers are running finish before the error leaves, so that none
            # writes gradients, statistics or optimizer steps after the caller rolled back;
            # a second interrupt while it waits goes with the first.
            job.cancel()
            job.wait_out()
            raise
    finally:
        failure = job.close()
    if failure is not None:
        # The error's traceback holds this frame and the frames of job.work(), whose job no
        # longer holds the error: no reference cycle keeps the models' graphs alive.
        try:
            raise failure
        finally:
            failure = None
