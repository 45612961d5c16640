"""Whether the workers parsum chose still pay, call by call.

# NOTE [ Workers that stop paying ]
# The thread budget counts the cores a call may use, not whether other processes keep them busy (a
# data loader's workers, another run, a build). There, threads that hand each other the GIL and wait
# for each other's chunks wait for the scheduler too, and a job on workers ends the caller's OpenMP
# team (NOTE [ The caller's OpenMP team ] in _pool), which the user's next parallel op (an optimizer
# step) then starts again on busy cores: on 2 cores beside one process spinning at nice 0, with a
# torch.optim.Adam step after each call, parsum's 2 workers took 24.0 ms a step for 64 tiny MLP
# classes against 17.1 with n_jobs=1 (benchmarks/bench_loaded.py --loop). How many threads run a
# call's chunks changes no bit: each chunk's intra-op threads and the order of the sums are fixed by
# the chunks and the budget (NOTE [ Thread control ] in _pool). Where parsum chooses the workers
# (n_jobs left unset) and the chunks outnumber the budget (each on one intra-op thread, so that the
# calling thread alone runs them as n_jobs=1 does; fewer chunks, each on several, were not
# measured), each plan times its steps, from each call to its next (what the choice changes is the
# whole step: the optimizer's and the data loader's time too; calls that only run forward apart),
# ignoring a step PAUSE times the recent ones (an evaluation, a checkpoint), and now and then looks
# at the calling thread alone: LOOK_CALLS calls, first after FIRST_LOOK calls on the workers, then
# after twice as many as before each time a look changes nothing (at most MAX_GAP, or MAX_GAP_ALONE
# on the calling thread, whose time does not tell that the machine freed up), and soon again when
# the steps' time moves by RISE either way (the machine changed). Where a look's steps are below
# SWITCH_BELOW of the current way's RECENT_STEPS latest, in their median and in their fastest, the
# calls go that way, and look back the same way. The fastest, because a loop that calls the plan
# twice a step (two forwards, or a turn among other work) times a short step and a long one in turn,
# and a look of LOOK_CALLS calls sees that pattern in another phase: judged by the median against
# the recent average, such looks at calls each 3 ms slower alone switched to the calling thread (a
# test's clock), and in benchmarks/bench_against.py (two calls a turn among two other methods'), a
# plan of 16 MLPs at batch 256 stepping Adam in the backward ran 52 ms a step against 28-30 on its
# workers. A look contains a short step as the latest steps do, and the fastest of each compares
# like with like. (Requiring steady steps instead, the slowest at most 1.5 times the fastest, kept
# the workers beside a spinning process, whose steps jitter more than that; with the fastest too, 2
# runs of 3 there switched at their second and third look, the other's looks ran no faster alone.)
# An explicit n_jobs is obeyed as it is. Timing the calls alone (their forward and backward) missed
# what the optimizer lost and misjudged the other way beside a data loader: with 2 loader workers
# whose transform kept both cores busy, the calls ran faster alone while the steps, whose optimizer
# then kept its OpenMP team spinning on the loaders' cores, ran slower (23.7-27.5 against 20.3-22.1
# ms with the workers kept). Measured with steps timed, each way a training loop in a process of its
# own (2 cores, Adam, 300-400 steps, medians): beside the process at nice 0, the tiny classes 17.4
# and 18.1 ms against 24.0 and 24.0 with the workers kept (n_jobs=1 17.1), 16 MLPs of widths 128-512
# at batch 64 21.9 and 20.3 against 23.8 and 20.6 (n_jobs=1 20.6); beside the 2 loader workers the
# looks kept the workers (24.2 and 24.7 against 23.6 and 23.9: the spread of such runs); idle, 11.6
# and 11.8 against 11.9 and 12.2 (the MLPs), 10.9-12.0 against 10.9-11.2 (the tiny classes). Against
# the code before, in one process (benchmarks/bench_against.py, 30 and 40 rounds, no optimizer): the
# MLPs 0.986x and 0.988x, the medium classes 0.979x and 1.005x, the tiny classes 0.982x and 1.005x:
# the looks of a plan's first hundred calls, 6 of them alone, cost a short run up to 1.5%; a long
# one about 0.3% of its calls.
#
# A look's step that spans a pause (or is PAUSE times the current way's, as the calling thread
# alone may be on many cores) is not timed: the look takes one more call in its place, up to
# LOOK_CALLS more, and then changes nothing. Such a look used to be never judged, and the next
# one came FIRST_LOOK calls later, every time: in runs of 5 calls between other work (an
# interleaved benchmark's turns, a loop that evaluates often) 8.6% of the calls ran alone,
# about 1.5 times as slow on 16 cores. (Taken for the cause of the default's 0.89-0.97x against
# the code before the pace on the medium models there, forty-sixth session: at 150 rounds there
# the pace, the code before it and the fix all ran within 5% of each other, so that was noise;
# docs/benchmarks.md.) The machine counts as changed once the median of the latest
# RECENT_STEPS steps stays RISE from a slow average of that median for more than half as many
# steps in a row: on the steps' average, a step 3 times as long every 50th brought a look every
# FIRST_LOOK calls.
# Simulated (benchmarks/bench_pace.py, 20000 calls, 6.2 ms a step on the workers, 9.1 alone),
# the share of calls alone before -> after: 10% noise 0.34 -> 0.34%, 20% noise 0.34 -> 0.39%,
# a step 3x every 50th 4.29 -> 0.36%, runs of 5 calls 8.57 -> 0.40%, runs of 3 calls with 3.5
# steps' work between 0.50 -> 0.65%, alone 5 times as slow 8.57 -> 0.47%; a busy machine
# (alone 0.7x) still goes alone, 97.55% either way. In interleaved turns on 2 cores (the medium
# MLPs at batch 64 beside the plain loop, 20 ms of untimed steps a turn, 300 rounds), the
# default ran 7.5% of its calls alone before, 2.6% after.
"""

from __future__ import annotations

import statistics
import time

FIRST_LOOK = 32
LOOK_CALLS = 3
MAX_GAP = 1024
MAX_GAP_ALONE = 128  # a machine that frees up does not change the calling thread's time
SWITCH_BELOW = 0.9
RISE = 1.3
PAUSE = 4.0  # a step this many times the recent ones: a pause (an evaluation, a checkpoint)
RECENT_STEPS = 6  # the current way's latest steps, against which a look is judged
SETTLED = 0.03  # the weight of the latest steps' median in the settled average


def _apart(a: float, b: float) -> bool:
    """Whether ``a`` and ``b`` differ by more than RISE, either way."""
    return max(a, b) > RISE * min(a, b)


def clock() -> float:
    """Seconds, for the steps' times (a test's clock replaces it)."""
    return time.perf_counter()


class Pace:
    """One plan's choice between its workers and the calling thread alone (NOTE [ Workers that
    stop paying ]), from the time from each of its calls to the next."""

    def __init__(self) -> None:
        self.on_workers = True  # the way the calls go, between looks
        self._recent: float | None = None  # its latest steps' median, and a slow average of it
        self._settled: float | None = None
        self._apart_steps = 0  # steps in a row whose median was RISE from the settled one
        self._calls = 0  # calls that way since the last look
        self._gap = FIRST_LOOK
        self._looks_left = 0  # calls the other way still to make in this look
        self._retakes = 0  # calls this look added in place of steps it could not time
        self._look: list[float] = []
        self._steps: list[float] = []  # the current way's latest steps (RECENT_STEPS)
        self._last: tuple[bool, float] | None = None  # the last call's way and start

    def choose(self) -> bool:
        """Whether this call runs on the workers; the step since the last call is timed. No
        lock: calls of one plan from several threads at once may mistime a step, which changes
        no result (a look two of them judge at once is judged by the first), where a
        KeyboardInterrupt landing as a lock was taken would have left it taken, and the plan's
        next call waiting forever (NOTE [ Interrupted callers ] in _pool)."""
        now = clock()
        last, self._last = self._last, None
        if last is not None:
            self._record(last[0], now - last[1])
        way = self._next_way()
        self._last = (way, now)
        return way

    def _next_way(self) -> bool:
        if self._looks_left:
            self._looks_left -= 1
            return not self.on_workers
        self._calls += 1
        if self._calls <= self._gap:
            return self.on_workers
        self._calls = 0
        self._looks_left = LOOK_CALLS - 1
        self._retakes = 0
        self._look = []
        return not self.on_workers

    def _record(self, on_workers: bool, seconds: float) -> None:
        """A step's time, the way its call went."""
        pause = self._recent is not None and seconds > PAUSE * self._recent
        if on_workers != self.on_workers:
            if pause:
                self._retake()
                return
            self._look.append(seconds)
            if len(self._look) == LOOK_CALLS:
                self._judge()
            return
        if pause:
            return  # a pause between steps, not a step
        self._steps.append(seconds)
        del self._steps[:-RECENT_STEPS]
        # The latest steps' median, and a slow average of it: a slow step now and then (a
        # garbage collection, other work between some calls) moves neither.
        self._recent = typical = sorted(self._steps)[len(self._steps) // 2]
        if self._settled is None:
            self._settled = typical
            return
        self._settled += SETTLED * (typical - self._settled)
        # Apart for as many steps in a row as a median takes to move: the machine changed.
        self._apart_steps = self._apart_steps + 1 if _apart(typical, self._settled) else 0
        if self._apart_steps > RECENT_STEPS // 2 and self._gap > FIRST_LOOK:
            self._gap = FIRST_LOOK  # look again soon
            self._calls = 0
            self._settled = typical

    def _judge(self) -> None:
        """After a look: switch where its steps ran faster than the current way's latest, the
        typical step and the fastest alike, or look later."""
        look, self._look = self._look, []
        if len(look) < LOOK_CALLS:  # judged by another caller of the plan at once
            return
        steps, typical = self._steps, statistics.median(look)
        if (
            len(steps) >= LOOK_CALLS
            and typical < SWITCH_BELOW * statistics.median(steps)
            and min(look) < SWITCH_BELOW * min(steps)
        ):
            self.on_workers = not self.on_workers
            self._recent = self._settled = typical
            self._steps = look
            self._gap = FIRST_LOOK
            self._calls = 0
        else:
            self._look_later()

    def _retake(self) -> None:
        """A look's step that was a pause, or PAUSE times the current way's: one more call in
        its place, up to LOOK_CALLS of them; then the look changes nothing."""
        if self._retakes < LOOK_CALLS:
            self._retakes += 1
            self._looks_left += 1
            return
        self._looks_left = 0
        self._look = []
        self._look_later()

    def _look_later(self) -> None:
        """After a look that changed nothing: the next one after twice as many calls."""
        self._gap = min(2 * self._gap, MAX_GAP if self.on_workers else MAX_GAP_ALONE)
        self._calls = 0
