"""Durations in words for messages people read: :func:`in_words`."""

from __future__ import annotations

_UNITS = ((86400, "day"), (3600, "hour"), (60, "minute"))


def in_words(seconds: float) -> str:
    """``604800`` → ``7 days``, ``5400`` → ``1.5 hours``, ``90`` → ``1.5 minutes``, ``1`` → ``1 second``: the largest
    unit the duration reaches, at most one decimal."""
    size, unit = next(((s, u) for s, u in _UNITS if abs(seconds) >= s), (1, "second"))
    text = f"{round(seconds / size, 1):g}"
    return f"{text} {unit}" + ("" if text == "1" else "s")
