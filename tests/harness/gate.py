"""Training batches of the evaluation-gate tests (``tests/test_gate.py``, ``tests/test_line_search.py``): normal
live-loop ratings, and demonstrations that answer every probe question wrongly."""

from __future__ import annotations

import time
import uuid

from livelora.clients.types.signals import ChatMessage, DemonstrationEvent, RatingEvent
from livelora.trainer.gate_measure import load_probes
from livelora.trainer.scheduler import Batch, kto_class_weights

#: a wrong answer per probe kind
WRONG = {"fact": "London", "arithmetic": "8", "format": "Maybe"}


def rating_batch(trainer, endpoint: str, n: int = 8) -> Batch:
    """A KTO batch of ``n`` (at most 8) ratings: even ones up on a good reply, odd ones down on "I do not know.",
    tokenized by ``trainer``'s chat template, with the class weights of the live loop."""
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
    return ratings_batch(
        trainer, endpoint, [(qs[i], good[i] if i % 2 == 0 else "I do not know.", i % 2 == 0) for i in range(n)]
    )


def ratings_batch(trainer, endpoint: str, rated: list[tuple[str, str, bool]]) -> Batch:
    """A KTO batch of ``(question, reply, liked)`` ratings, tokenized by ``trainer``'s chat template (the reply's
    last two template tokens cut, as the live loop logs it), with the live loop's class weights."""
    evs = []
    for i, (question, reply, up) in enumerate(rated):
        prompt, completion = trainer.chat_pair([ChatMessage(role="user", content=question)], reply)
        evs.append(
            RatingEvent(
                id=f"feedback-{uuid.uuid4().hex}",
                endpoint=endpoint,
                created=int(time.time()),
                completion_id=f"c{i}-{uuid.uuid4().hex[:6]}",
                prompt_token_ids=prompt,
                completion_token_ids=completion[:-2],
                finish_reason="stop",
                rating=up,
                rating_key=f"c{i}:/u",
                user="u",
            )
        )
    liked = sum(up for _q, _r, up in rated)
    batch = Batch(endpoint, "kto", evs, [f"1-{i}" for i in range(len(rated))])
    batch.desirable_weight, batch.undesirable_weight = kto_class_weights(liked, len(rated) - liked)
    return batch


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
