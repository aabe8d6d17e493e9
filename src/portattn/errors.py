"""Input errors in one form ("expected X, got Y") and the exceptions raised by portattn's public API.

Imports nothing from portattn, so that every floor (kernels included) can raise its errors the same way.
"""

from __future__ import annotations

import numbers
from typing import NoReturn


def expect(cond: bool, what: str, got: object) -> None:
    """Raise ``ValueError("expected {what}, got {got}")`` unless ``cond``: the one form of input errors."""
    if not cond:
        fail(what, got)


def is_int(value: object) -> bool:
    """An integer (``int``, NumPy's) that is not a ``bool``: ``True`` is not a count, a size or a token id."""
    if type(value) is int:  # the common case, without the abstract base class's check (token ids: one per token)
        return True
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def all_ints(values) -> bool:
    """Every item of the sequence ``values`` a plain ``int`` (not a ``bool``, nor NumPy's): one pass in C."""
    return set(map(type, values)) <= {int}


def is_real(value: object) -> bool:
    """A real number (``int``, ``float``, NumPy's) that is not a ``bool``."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(name: str, value: object, low: int) -> None:
    """Raise ``ValueError`` unless ``value`` is an int (not a ``bool``) of at least ``low``."""
    expect(is_int(value) and value >= low, f"{name} to be an int >= {low}", value)


def fail(what: str, got: object) -> NoReturn:
    """Raise ``ValueError("expected {what}, got {got}")``; for hot paths that build the message only on error."""
    raise ValueError(f"expected {what}, got {got}")


class UnsupportedFeatureError(ValueError):
    """A backend was asked for a feature it does not declare.

    The message names the feature, the backend asked and the registered backends that do
    support it, so the fix (pick another backend, or drop the feature) is in the error itself.
    """

    def __init__(self, feature: str, backend: str, supported_by: list[str]):
        self.feature = feature
        self.backend = backend
        self.supported_by = list(supported_by)
        others = ", ".join(repr(name) for name in self.supported_by) or "no registered backend"
        super().__init__(f"attention backend {backend!r} does not support {feature}; backends that do: {others}")


class OutOfPagesError(RuntimeError):
    """The page pool has fewer free pages than an allocation asked for."""
