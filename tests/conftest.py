import faulthandler
import os
import signal
import sys

import pytest
import torch

from parsum import _config

# A deadlock must fail fast with every thread's stack, not hang CI (pytest-timeout also guards).
faulthandler.enable(file=sys.stderr, all_threads=True)


# PARSUM_TEST_CORES=16 runs every test as on a machine with 16 usable cores (parsum's view of the
# machine and the thread budget), to check on a small machine that the suite passes on a big one.
# A machine with one usable core (a small VM, a CI runner pinned to one CPU) runs the suite as
# one with 2 would, the budget CI runs with: tests of the helpers need a second thread, which
# 12 tests lacked there (found with ``taskset -c 0``).
_SIMULATED_CORES = int(os.environ.get("PARSUM_TEST_CORES", "0")) or (
    2 if _config.usable_cores() < 2 else 0
)


def _share_the_cores_among_workers() -> None:
    """Under pytest-xdist, each worker (and every process it starts) takes its share of the
    cores, at least 2 (the budget CI runs with): 12 workers on 16 cores, each with torch's
    default of 16 intra-op threads, spun 192 OpenMP threads on 16 cores, and three tests that
    run subprocesses failed there within their limits."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or _SIMULATED_CORES:
        return
    threads = max(2, _config.usable_cores() // workers)
    if torch.get_num_threads() > threads:
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


_share_the_cores_among_workers()


# pytest-timeout's limit is Python code (a signal handler, or a thread), which needs the GIL: a
# deadlock in which one thread waits in C holding the GIL (torch's generator read: NOTE
# [ Generators' states read in one thread at a time ] in parsum._random) ran past it for 20
# minutes. faulthandler's watchdog is a C thread: past this many seconds it prints every
# thread's stack and ends the worker, which fails the test.
DEADLOCK_EXIT_S = 300


@pytest.fixture(autouse=True)
def _watchdog():
    faulthandler.dump_traceback_later(DEADLOCK_EXIT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def _fresh_seed_and_threads(monkeypatch):
    if _SIMULATED_CORES:
        monkeypatch.setattr(_config, "usable_cores", lambda: _SIMULATED_CORES)
        torch.set_num_threads(_SIMULATED_CORES)
    threads = torch.get_num_threads()
    torch.manual_seed(1234)
    yield
    assert torch.get_num_threads() == threads, "a parsum call changed torch.get_num_threads()"


@pytest.fixture
def gil(monkeypatch):
    """Worker counts by the GIL's rules, whatever the interpreter (a free-threaded build runs
    the tests too: NOTE [ Threads without the GIL ] in parsum._grouping); ``gil(False)`` gives
    a free-threaded interpreter's."""

    def set_gil(enabled: bool) -> None:
        monkeypatch.setattr(_config, "gil_enabled", lambda: enabled)

    set_gil(True)
    return set_gil


@pytest.fixture
def cores(monkeypatch):
    """``cores(n)`` makes parsum see n usable cores and sets the thread budget to n (what a
    machine with n cores gives by default), so that tests pass on any machine; restored after."""
    saved = torch.get_num_threads()

    def set_cores(n: int) -> None:
        monkeypatch.setattr(_config, "usable_cores", lambda: n)
        torch.set_num_threads(n)

    yield set_cores
    torch.set_num_threads(saved)


@pytest.fixture
def swapping():
    """PyTorch's swap of tensors on conversion and load on (``torch.__future__``), off after."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


@pytest.fixture
def ctrl_c_lands():
    """For the test's length: Python's own SIGINT handler (a process started with SIGINT
    ignored, as a shell's background job or ``nohup`` starts it, never saw a SIGINT: no
    interrupt at all), and a short switch interval, so that a
    timer thread takes the GIL within 0.1 ms of its time rather than 5 (on one core, the calls
    it was to interrupt had mostly ended: 6 interrupts in 200 calls). The tests send real
    signals to their thread (``signal.pthread_kill``): POSIX only."""
    if not hasattr(signal, "pthread_kill"):
        pytest.skip("needs signal.pthread_kill (POSIX)")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
        signal.signal(signal.SIGINT, previous)
