"""Thread-local configuration and ``n_jobs`` resolution (joblib's conventions)."""

from __future__ import annotations

import contextlib
import functools
import numbers
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence, Set
from dataclasses import dataclass, replace
from typing import Any, cast

import joblib
import torch
from joblib.parallel import get_active_backend
from torch import Tensor, nn

from ._errors import ParsumError, a_kind_of

ENGINES = ("auto", "autograd", "vjp", "stacked")


@dataclass(frozen=True)
class _Settings:
    n_jobs: int | None = None
    engine: str | None = None
    chunk_size: int | None = None


class _Local(threading.local):
    settings = _Settings()


_local = _Local()


def current_settings() -> _Settings:
    return _local.settings


def set_settings(settings: _Settings) -> None:
    """Make ``settings`` this thread's (a helper, for the caller's chunks it runs)."""
    _local.settings = settings


@contextlib.contextmanager
def settings_entered(settings: _Settings) -> Iterator[None]:
    """Enter settings captured in another thread (a helper running the caller's chunks)."""
    old, _local.settings = _local.settings, settings
    try:
        yield
    finally:
        _local.settings = old


@contextlib.contextmanager
def config(
    n_jobs: int | None = None, engine: str | None = None, chunk_size: int | None = None
) -> Iterator[None]:
    """Set parsum's defaults for the current thread inside a ``with`` block.

    Values left as ``None`` keep what the enclosing configuration says; the previous values are
    restored on exit, also when the block raises. An explicit argument to ``sum_models`` wins
    over the configuration, and the configuration wins over ``joblib.parallel_config``.

    >>> import torch, parsum
    >>> models = [torch.nn.Linear(3, 2) for _ in range(4)]
    >>> with parsum.config(n_jobs=1):
    ...     y = parsum.sum_models(models, torch.ones(5, 3))
    >>> y.shape
    torch.Size([5, 2])

    Args:
        n_jobs: default number of workers (joblib's convention, see ``sum_models``).
        engine: default engine, one of ``"auto"``, ``"autograd"``, ``"vjp"``, ``"stacked"``.
        chunk_size: default number of models per task.

    Raises:
        ParsumError: for an invalid value, before anything is changed.
    """
    n_jobs = check_n_jobs(n_jobs, "parsum.config")
    if engine is not None:
        check_engine(engine, "parsum.config")
    chunk_size = check_chunk_size(chunk_size, "parsum.config")
    old = _local.settings
    _local.settings = replace(
        old,
        n_jobs=old.n_jobs if n_jobs is None else n_jobs,
        engine=old.engine if engine is None else engine,
        chunk_size=old.chunk_size if chunk_size is None else chunk_size,
    )
    try:
        yield
    finally:
        _local.settings = old


def _is_integer(value: object) -> bool:
    # numbers.Integral takes numpy's integers too (parameter grids give them); bool is not one.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_n_jobs(n_jobs: object, where: str) -> int | None:
    if n_jobs is None:
        return None
    if not _is_integer(n_jobs) or n_jobs == 0:
        raise ParsumError(
            f"{where}: invalid n_jobs={n_jobs!r}; expected None, a positive int, or a negative "
            "int (-1 = all cores, -2 = all but one, ...)"
        )
    return int(n_jobs)  # type: ignore[call-overload]


def check_engine(engine: object, where: str) -> str:
    if engine not in ENGINES:
        raise ParsumError(
            f"{where}: invalid engine={engine!r}; expected one of {', '.join(map(repr, ENGINES))}"
        )
    return str(engine)


def check_model_sequence(
    models: Any, where: str, containers: tuple[type[nn.Module], ...]
) -> list[Any]:
    """``models`` as a non-empty list: a sequence, or one of the module ``containers``."""
    if isinstance(models, nn.ModuleDict):
        raise ParsumError(
            f"{where}: models is an nn.ModuleDict; expected a sequence of models: pass "
            "list(models.values())"
        )
    if isinstance(models, nn.Module) and not isinstance(models, containers):
        raise ParsumError(
            f"{where}: models is a single {type(models).__name__}; expected a sequence of "
            "models (a list, tuple or nn.ModuleList)"
        )
    if isinstance(models, (str, bytes, Tensor)) or not isinstance(models, (Sequence, *containers)):
        # An iterable in a fixed order (dict values, a generator) says how to pass it; a set,
        # whose order may change from run to run, would change the sum's bits with it.
        hint = ""
        if isinstance(models, Iterable) and not isinstance(models, (str, bytes, Tensor, Set)):
            hint = ": pass list(models)"
        raise ParsumError(
            f"{where}: models is {a_kind_of(models)}; expected a sequence of models{hint}"
        )
    found = list(cast(Iterable[Any], models))
    if not found:
        raise ParsumError(f"{where}: models is empty; expected at least one model")
    return found


def check_chunk_size(chunk_size: object, where: str) -> int | None:
    if chunk_size is None:
        return None
    if not _is_integer(chunk_size) or chunk_size < 1:  # type: ignore[operator]
        raise ParsumError(
            f"{where}: invalid chunk_size={chunk_size!r}; expected None or a positive int"
        )
    return int(chunk_size)  # type: ignore[call-overload]


@functools.cache
def usable_cores() -> int:
    """Cores this process may use (affinity and cgroup quotas included, through joblib).

    Cached: joblib reads cgroup files on every call, which would cost tens of microseconds per
    ``sum_models`` call. ``usable_cores.cache_clear()`` picks up a changed affinity.
    """
    return max(1, int(joblib.cpu_count()))


def thread_budget() -> int:
    """The threads this call may use, workers times intra-op threads: ``torch.get_num_threads()``
    (which follows ``OMP_NUM_THREADS``, ``torch.set_num_threads`` and torchrun's setting of one
    per process), capped by the usable cores. NOTE [ Thread budget ] in ``_pool``."""
    return max(1, min(torch.get_num_threads(), usable_cores()))


def gil_enabled() -> bool:
    """Whether this interpreter runs with the GIL now: always before Python 3.13; a
    free-threaded build runs without it until a module that needs it is imported (NOTE
    [ Threads without the GIL ] in _grouping)."""
    check = getattr(sys, "_is_gil_enabled", None)
    return True if check is None else bool(check())


def n_jobs_is_default(n_jobs: int | None) -> bool:
    """Whether nobody chose a worker count: not the call, parsum.config or joblib."""
    return n_jobs is None and _local.settings.n_jobs is None and get_active_backend()[1] is None


def resolve_n_jobs(n_jobs: int | None, where: str) -> int:
    """Turn ``n_jobs`` into a positive worker count, following joblib's conventions.

    ``None`` falls back to ``parsum.config``, then ``joblib.parallel_config``, then the thread
    budget (``thread_budget``). Negative values count back from the budget (-1 = all of it,
    -2 = all but one), so that P processes on one host, each with its share of threads, stay
    within their share.
    """
    n_jobs = check_n_jobs(n_jobs, where)
    if n_jobs is None:
        n_jobs = _local.settings.n_jobs
    if n_jobs is None:
        n_jobs = check_n_jobs(get_active_backend()[1], "joblib.parallel_config")
    budget = thread_budget()
    if n_jobs is None:
        return budget
    if n_jobs < 0:
        return max(1, budget + 1 + n_jobs)
    return n_jobs
