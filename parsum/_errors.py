"""The one exception type parsum raises for bad input and failed models."""

from __future__ import annotations


class ParsumError(RuntimeError):
    """Bad input to parsum, or a model that failed inside a parsum call.

    Messages start with the public function's name, name the argument and the bad value
    (for a model: its index and type) and say what is allowed. When a model raised, the
    original exception is chained as ``__cause__``.
    """


def a_kind_of(value: object) -> str:
    """``value``'s type name with its article, for messages: "an int", "a Linear"."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeio' else 'a'} {name}"
