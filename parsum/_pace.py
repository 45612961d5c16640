"""Whether the workers parsum chose still pay, call by call.

# NOTE [ Workers that stop paying ]
# The thread budget counts the cores a call may use, not whether other processes keep them busy
# (a data loader's workers, another run, a build). There, threads that hand each other the GIL
# and wait for each other's chunks wait for the scheduler too: on 2 cores beside one process
# spinning at nice 0, with a torch.optim.Adam step after each call, parsum's 2 workers took
# 24.1 ms a step for 16 MLPs of widths 128-512 (batch 64) against 21.2 with n_jobs=1
# (benchmarks/bench_loaded.py). How many threads run a call's chunks changes no bit: each
# chunk's intra-op threads and the order of the sums are fixed by the chunks and the budget
# (NOTE [ Thread control ] in _pool). Where parsum chooses the workers (n_jobs left unset) and
# the chunks outnumber the budget (each on one intra-op thread, so that the calling thread alone
# runs them as n_jobs=1 does; fewer chunks, each on several, were not measured), each plan
# times its calls (the forward and the backward that follows it; forwards alone apart) and now
# and then looks at the calling thread alone: LOOK_CALLS calls, first after FIRST_LOOK calls on
# the workers, then after twice as many as before each time a look changes nothing (at most
# MAX_GAP, or MAX_GAP_ALONE on the calling thread, whose time does not tell that the machine
# freed up), and soon again when the calls' time moves by RISE either way (the machine changed).
# Where a look's median is below SWITCH_BELOW of the current way's recent time, the calls go
# that way, and look back the same way. An explicit n_jobs is obeyed as it is. Measured in a
# training loop of each way's own (2 cores, a process spinning at nice 0, Adam after each call,
# 300 steps, two runs): 21.1 and 21.5 ms a step against 24.0 and 24.0 with the workers kept
# (1.12-1.14x; n_jobs=1 21.3 and 22.4, the plain loop on 2 threads 23.6 and 27.1, on 1 thread
# 16.5 and 17.1); in benchmarks/bench_loaded.py --loop 400 --adam, 22.8 against 24.0 (1.06x).
# 64 tiny MLP classes: 23.8 and 23.5 against 24.0 and 24.1 (n_jobs=1 22.8; 22.6 against 24.0 in
# bench_loaded.py):
# their calls ran as fast on the workers, and what the workers cost there was Adam's, whose
# OpenMP team each call on workers ends
# (NOTE [ The caller's OpenMP team ] in _pool), which a call's time does not see. Idle, in one
# process against the workers kept (benchmarks/bench_loaded.py, 20 rounds): 7.59 against 7.65
# ms (16 MLPs of widths 128-512, batch 64), 5.26 against 5.40 (the tiny classes), 12.27 against
# 12.29 with Adam. The looks cost an idle machine about 1% of a plan's first thousand calls,
# run alone.
"""

from __future__ import annotations

import statistics
import threading
import time

FIRST_LOOK = 32
LOOK_CALLS = 3
MAX_GAP = 1024
MAX_GAP_ALONE = 128  # a machine that frees up does not change the calling thread's time
SWITCH_BELOW = 0.9
RISE = 1.3
RECENT, SETTLED = 0.25, 0.03  # the weights of a new call's time in the two averages


class Pace:
    """One plan's choice between its workers and the calling thread alone (NOTE [ Workers that
    stop paying ]), from the times of its calls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.on_workers = True  # the way the calls go, between looks
        self._recent: float | None = None  # its calls' time, lately and settled
        self._settled: float | None = None
        self._calls = 0  # calls that way since the last look
        self._gap = FIRST_LOOK
        self._looks_left = 0  # calls the other way still to make in this look
        self._look: list[float] = []

    def choose(self) -> bool:
        """Whether this call runs on the workers."""
        with self._lock:
            if self._looks_left:
                self._looks_left -= 1
                return not self.on_workers
            self._calls += 1
            if self._calls <= self._gap:
                return self.on_workers
            self._calls = 0
            self._looks_left = LOOK_CALLS - 1
            self._look = []
            return not self.on_workers

    def record(self, on_workers: bool, seconds: float) -> None:
        """A call's time, the way it went."""
        with self._lock:
            if on_workers != self.on_workers:
                self._look.append(seconds)
                if len(self._look) == LOOK_CALLS:
                    self._judge(statistics.median(self._look))
                return
            if self._recent is None or self._settled is None:
                self._recent = self._settled = seconds
                return
            self._recent += RECENT * (seconds - self._recent)
            self._settled += SETTLED * (seconds - self._settled)
            moved = max(self._recent, self._settled) > RISE * min(self._recent, self._settled)
            if moved and self._gap > FIRST_LOOK:  # the machine changed: look again soon
                self._gap = FIRST_LOOK
                self._calls = 0
                self._settled = self._recent

    def _judge(self, other: float) -> None:
        """After a look whose calls took ``other`` (median): switch, or look later."""
        self._look = []
        if self._recent is not None and other < SWITCH_BELOW * self._recent:
            self.on_workers = not self.on_workers
            self._recent = self._settled = other
            self._gap = FIRST_LOOK
        else:
            self._gap = min(2 * self._gap, MAX_GAP if self.on_workers else MAX_GAP_ALONE)
        self._calls = 0


def clock() -> float:
    """Seconds, for the calls' times (a test's clock replaces it)."""
    return time.perf_counter()


class PacedCall:
    """One call of a paced plan: the way it went and, once its forward returned where a
    backward may follow, the forward's time."""

    __slots__ = ("backward_at", "forward", "on_workers", "pace", "started")

    def __init__(self, pace: Pace) -> None:
        self.pace = pace
        self.on_workers = pace.choose()
        self.started = clock()
        self.forward: float | None = None
        self.backward_at: float | None = None

    def forward_done(self, differentiated: bool) -> None:
        elapsed = clock() - self.started
        if differentiated:
            self.forward = elapsed  # recorded with its backward's time
        else:
            self.pace.record(self.on_workers, elapsed)

    def backward_began(self) -> None:
        self.backward_at = clock()

    def backward_done(self) -> None:
        """The backward ended: the call's time, once (a retained graph's second backward is
        not a call of its own)."""
        if self.forward is not None and self.backward_at is not None:
            self.pace.record(self.on_workers, self.forward + clock() - self.backward_at)
            self.forward = None
