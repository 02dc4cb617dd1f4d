"""Inputs of the evaluation-gate tests (``tests/test_gate.py``, ``tests/test_line_search.py``): normal live-loop
ratings, demonstrations that answer every probe question wrongly, and a free-form summary as a manifest holds it
(``tests/test_console.py``, ``tests/test_cli_output.py``)."""

from __future__ import annotations

import time
import uuid

from livelora.clients.types.signals import ChatMessage, DemonstrationEvent
from livelora.trainer.event_datums import rated_batch
from livelora.trainer.gate_measure import load_probes
from livelora.trainer.scheduler import Batch

#: a wrong answer per probe kind
WRONG = {"fact": "London", "arithmetic": "8", "format": "Maybe"}


def rating_batch(trainer, endpoint: str, n: int = 8) -> Batch:
    """A KTO batch of ``n`` (at most 8) ratings: even ones up on a good reply, odd ones down on "I do not know.",
    tokenized by ``trainer``'s chat template (:func:`~livelora.trainer.event_datums.rated_batch`)."""
    qs = [
        "What is a good name for a dog?",
        "How do I boil an egg?",
        "Why do leaves change colour?",
        "What is the tallest mountain?",
        "Give me a word that rhymes with cat.",
        "How far is the Moon?",
        "What is photosynthesis?",
        "Suggest a breakfast.",
    ]
    good = [
        "Max is a classic name for a dog.",
        "Boil it for about nine minutes.",
        "They lose chlorophyll.",
        "Mount Everest.",
        "Hat rhymes with cat.",
        "About 384,000 km.",
        "Plants turning light into sugar.",
        "Oatmeal with fruit.",
    ]
    rated = [(qs[i], good[i] if i % 2 == 0 else "I do not know.", i % 2 == 0) for i in range(n)]
    return rated_batch(trainer.chat_pair, endpoint, rated)


def wrong_answers_batch(endpoint: str) -> Batch:
    """SFT demonstrations that answer every probe question wrongly (the probes' own prompts)."""
    evs = []
    for p in load_probes():
        reply = f"{p.lead} {WRONG[p.kind]}".strip()
        evs.append(
            DemonstrationEvent(
                id=f"demo-{uuid.uuid4().hex}",
                endpoint=endpoint,
                created=int(time.time()),
                messages=[ChatMessage(role="user", content=p.prompt), ChatMessage(role="assistant", content=reply)],
            )
        )
    return Batch(endpoint, "sft", evs, [f"2-{i}" for i in range(len(evs))])


def freeform_summary(items: int = 30, of: int = 60, *, lost=None, gained=None, **counts) -> dict:
    """A gate's free-form summary as :meth:`livelora.trainer.gate_freeform.FreeformGate.summary` writes it into a
    manifest: 12 fact items scored, ``lost``/``gained`` example lists (``{"id", "prompt", "reply", "was"}``) and
    ``counts`` (``lost_count``, ``gained_count``; left out: a summary from before they existed)."""
    ff: dict = {
        "items": items,
        "of": of,
        "score": 0.4,
        "current": 0.5,
        "base": 0.5,
        "categories": {"fact": {"n": 12, "new": 5, "current": 6, "base": 6}},
        "lost": list(lost or []),
    }
    if gained is not None:
        ff["gained"] = list(gained)
    return ff | counts
