"""Argument checks shared by every layer, so each rule is written (and worded) once."""

from __future__ import annotations

from nemo_wrap.errors import NeMoWrapError


def require_positive_int(value: object, what: str, error: type[NeMoWrapError]) -> int:
    """``value`` if it is an ``int`` of at least 1 (``bool`` excluded), else ``error`` naming ``what``.

    ``True`` is an ``int`` in Python; a flag passed where a count belongs is a caller's mistake,
    so it is refused rather than read as 1.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error(f"{what} must be a positive int, got {value!r}")
    return value
