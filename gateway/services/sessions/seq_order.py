"""Gateway side of a training model's op order: the bound ahead, and the seqs of ops refused with an HTTP error.

A model's ops run strictly in ``seq_id`` order (:mod:`livelora.trainer.executor`), so an op the gateway queues
under a seq that can never come up, or a seq it leaves unused while later ones wait, would block the model.
Rules, one per way in:

* **too far ahead**: a ``seq_id`` more than ``session_max_seq_ahead`` past the model's next op (one past the
  highest committed, ``opruns`` ``applied``) is refused at once, 400 naming the bound, and nothing is recorded;
* **refused with an HTTP error** (413, 429, an undecodable body): nothing is queued and the seq stays free, so a
  corrected retry under it runs; the refusal is kept in ``seqrefused:{model}``, and the first op of a later seq
  (its client moved on) queues a ``failed`` marker for it (:meth:`SeqOrder.take_refused`), so the executor passes
  it at once instead of waiting out the gap timeout.
"""

from __future__ import annotations

from typing import Any

from livelora.clients.errors import BadRequestError, LiveloraError
from livelora.core.bus import redis_unavailable
from livelora.core.redis_keys import KeyLayout
from livelora.core.session_protocol import future_failed
from livelora.core.settings import SessionSection


class SeqOrder:
    """Args: ``redis`` (async client), ``keys`` (layout), ``settings`` (``session_max_seq_ahead``, TTLs)."""

    def __init__(self, redis, keys: KeyLayout, settings: SessionSection):
        self.redis, self.keys, self.settings = redis, keys, settings

    async def next_seq(self, model_id: str, record: dict[str, Any]) -> int | None:
        """The seq the executor runs next: one past the highest committed; 0 while the model is being created
        (``record``: the model's record); ``None`` when the count expired (the model idle past ``future_ttl_s``)."""
        applied = await self.redis.hget(self.keys.op_runs(model_id), "applied")
        if applied is not None:
            return int(applied) + 1
        return 0 if record.get("state") == "creating" else None

    def check_ahead(self, model_id: str, seq_id: int, next_seq: int | None) -> None:
        """Raises: BadRequestError (400, code ``seq_too_far_ahead``) for a ``seq_id`` more than
        ``session_max_seq_ahead`` past ``next_seq``: it could only wait in the executor's buffer."""
        bound = self.settings.session_max_seq_ahead
        if next_seq is not None and seq_id > next_seq + bound:
            raise BadRequestError(
                f"seq_id {seq_id} of model {model_id} is more than {bound} ahead of the model's next op (seq_id "
                f"{next_seq}); ops run in seq order, one seq per op in call order (bound: "
                "LIVELORA_SESSION_MAX_SEQ_AHEAD)",
                param="seq_id",
                code="seq_too_far_ahead",
            )

    async def refuse(self, model_id: str, seq_id: int | None, error: LiveloraError, record: dict[str, Any]) -> None:
        """Record op ``seq_id`` of an existing model as refused with ``error`` (answered by the caller). Does
        nothing for a missing seq, one already claimed, behind the model's next op or beyond the bound."""
        if not isinstance(seq_id, int) or isinstance(seq_id, bool) or seq_id < 1:
            return
        with redis_unavailable():
            if await self.redis.exists(self.keys.seq(model_id, seq_id)):
                return
            nxt = await self.next_seq(model_id, record)
            if nxt is not None and not nxt <= seq_id <= nxt + self.settings.session_max_seq_ahead:
                return
            key = self.keys.seq_refused(model_id)
            await self.redis.hset(key, str(seq_id), future_failed(error))
            await self.redis.expire(key, self.settings.future_ttl_s)

    async def take_refused(self, model_id: str, seq_id: int) -> list[tuple[int, str]]:
        """``(seq, failed future record)`` of every refused seq below ``seq_id`` that no retry claimed since
        (to queue as ``failed`` markers); all below ``seq_id`` are forgotten here."""
        key = self.keys.seq_refused(model_id)
        out = []
        for raw_seq, failed in (await self.redis.hgetall(key)).items():
            seq = int(raw_seq)
            if seq >= seq_id:
                continue
            if not await self.redis.exists(self.keys.seq(model_id, seq)):
                out.append((seq, failed.decode() if isinstance(failed, bytes) else failed))
            await self.redis.hdel(key, raw_seq)
        return sorted(out)
