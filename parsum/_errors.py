"""The one exception type parsum raises for bad input and failed models."""

from __future__ import annotations


class ParsumError(RuntimeError):
    """Bad input to parsum, or a model that failed inside a parsum call.

    Messages start with the public function's name, name the argument and the bad value
    (for a model: its index and type) and say what is allowed. When a model raised, the
    original exception is chained as ``__cause__``.
    """


def message_of(exc: BaseException) -> str:
    """``str(exc)`` for a message, or what it is where its ``__str__`` raises: a user's
    exception that cannot say itself must still be named and chained, not replaced."""
    try:
        return str(exc)
    except Exception:
        return f"<{type(exc).__name__} whose str() raised>"


def model_failed(
    where: str, i: int, kind: str, phase: str, exc: BaseException, who: str = "", hint: str = ""
) -> ParsumError:
    """The error that names model ``i`` (of type ``kind``, as ``model_kind`` says it) for
    ``exc``, raised in ``phase`` ("forward", "backward"), with ``exc`` chained."""
    raised = "ParsumError" if isinstance(exc, ParsumError) else type(exc).__name__
    err = ParsumError(
        f"{where}: model {i} ({kind}){who} raised {raised} in {phase}: {message_of(exc)}{hint}"
    )
    err.__cause__ = exc
    return err


def a_kind_of(value: object) -> str:
    """``value``'s type name with its article, for messages: "an int", "a Linear"."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeio' else 'a'} {name}"
