"""Bounds that every route's request types share with the engines' parameter check (cheap limits, before work)."""

from __future__ import annotations

#: Most stop strings (or stop token ids) one sequence may carry, and the longest stop string (characters).
MAX_STOP_SEQUENCES, MAX_STOP_CHARS = 64, 1024
