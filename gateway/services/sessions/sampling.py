"""Sampling sessions of Tinker clients: served by the gateway's engine, never by the trainer.

A sampling session runs on a sampler checkpoint's adapter version, loaded into the engine under its version name
(``<lineage>@<n>``, never reused). That name is also a served ``model`` for ``/v1/chat/completions``, because
the OpenAI routes resolve any loaded adapter by name. :class:`SamplingSessions` keeps the sessions' records, loads
their adapters once, and a janitor unloads those of ended sessions; the samples themselves are :mod:`.samples`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path
from typing import Any

from livelora.clients.errors import BadRequestError, ConflictError, NotFoundError
from livelora.clients.types.tinker import (
    CreateSamplingSessionRequest,
    CreateSamplingSessionResponse,
    GetSamplerResponse,
)
from livelora.core.bus import redis_unavailable
from livelora.core.session_protocol import resolve_checkpoint
from livelora.gateway.services.sessions.context import SessionContext

log = logging.getLogger(__name__)


class SamplingSessions:
    """Sampling sessions on the gateway's engine: their records, adapters and sample completion lists.

    Args:
        ctx: the session services' shared context.
    """

    def __init__(self, ctx: SessionContext):
        self.ctx = ctx
        self.redis = ctx.redis
        self.keys = ctx.keys
        self.settings = ctx.settings
        self.engine = ctx.engine
        self.home = ctx.home
        self.store = ctx.store
        self.base_model = ctx.base_model
        self._loads: dict[str, asyncio.Lock] = {}
        #: engine adapter name → session that loaded it (unloaded when the session ends)
        self.adapters: dict[str, str] = {}
        self._janitor: asyncio.Task | None = None

    async def start(self) -> None:
        """Start the janitor (unloads ended sessions' adapters)."""
        self._janitor = asyncio.create_task(self._janitor_loop())

    async def close(self) -> None:
        """Stop the janitor."""
        if self._janitor is not None:
            self._janitor.cancel()
            with contextlib.suppress(BaseException):
                await self._janitor

    async def _janitor_loop(self) -> None:
        while True:
            await asyncio.sleep(min(2.0, self.settings.session_ttl_s / 2))
            try:
                await self.unload_ended_sessions()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("session janitor: %s", exc)

    async def unload_ended_sessions(self) -> None:
        """Unload engine adapters whose session key is gone (finished or expired); retried while in use."""
        for name, sid in list(self.adapters.items()):
            if await self.redis.exists(self.keys.session(sid)):
                continue
            try:
                if name in self.engine.loaded_adapters():
                    await self.engine.unload_adapter(name)
                self.adapters.pop(name, None)
            except ConflictError:
                pass  # still sampling; next round

    async def create_sampling_session(self, req: CreateSamplingSessionRequest) -> CreateSamplingSessionResponse:
        """A sampling session on a sampler checkpoint (``model_path``) or on the base model.

        Raises:
            NotFoundError: unknown session, base model or checkpoint. BadRequestError: a training checkpoint
            path, or neither ``model_path`` nor ``base_model``.
        """
        await self.ctx.require_session(req.session_id)
        self.ctx.check_base(req.base_model)
        sampling_id = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        record = await self.record_for_path(req.model_path, req.base_model, req.session_id, sampling_id)
        with redis_unavailable():
            await self.redis.set(self.keys.sampler(sampling_id), json.dumps(record), ex=self.settings.future_ttl_s)
        await self.ensure_loaded(record)
        return CreateSamplingSessionResponse(sampling_session_id=sampling_id)

    async def record_for_path(
        self, model_path: str | None, base_model: str | None, session_id: str | None, sampling_id: str
    ) -> dict[str, Any]:
        record = {
            "sampler_id": sampling_id,
            "session_id": session_id,
            "base_model": self.base_model,
            "model_path": model_path,
            "adapter": None,
            "adapter_path": None,
        }
        if model_path is None:
            if base_model is None:
                raise BadRequestError("give model_path (a sampler checkpoint) or base_model", param="model_path")
            return record
        index, _, version = resolve_checkpoint(self.home, model_path, want="sampler_weights")
        manifest = self.store.get(index.lineage, version)
        record.update(adapter=manifest.name, adapter_path=str(self.store.version_dir(index.lineage, version)))
        return record

    async def record(self, sampling_id: str) -> dict[str, Any]:
        """The sampler record of ``sampling_id`` (Raises: NotFoundError, unknown or expired)."""
        with redis_unavailable():
            raw = await self.redis.get(self.keys.sampler(sampling_id))
        if raw is None:
            raise NotFoundError(
                f"sampling session {sampling_id!r} does not exist or has expired", param="sampling_session_id"
            )
        return json.loads(raw)

    async def get_sampler(self, sampling_id: str) -> GetSamplerResponse:
        record = await self.record(sampling_id)
        base = record["base_model"]
        return GetSamplerResponse(
            sampler_id=sampling_id,
            # the base model under its hub id (the tokenizer's; the served name is an alias of it), so SDK 0.38's
            # SamplingClient.get_tokenizer(), which loads the tokenizer by this name, resolves it
            base_model=self.ctx.tokenizer_id() if base == self.base_model else base,
            model_path=record.get("model_path"),
            adapter=record.get("adapter"),
        )

    async def ensure_sampler_loaded(self, sampling_id: str) -> None:
        await self.ensure_loaded(await self.record(sampling_id))

    async def ensure_loaded(self, record: dict[str, Any]) -> None:
        """Load the record's adapter version into the engine once (concurrent callers wait for one load)."""
        name = record.get("adapter")
        if name is None or name in self.engine.loaded_adapters():
            return
        lock = self._loads.setdefault(name, asyncio.Lock())
        async with lock:
            if name not in self.engine.loaded_adapters():
                path = record.get("adapter_path")
                if not path or not Path(path).is_dir():
                    raise NotFoundError(
                        f"the weights of adapter {name} were deleted (their session ended)", param="sampling_session_id"
                    )
                await self.engine.load_adapter(name, path)
            if record.get("session_id"):
                self.adapters[name] = record["session_id"]

    async def join_sampling_session(self, sampling_id: str) -> int:
        """A new clone number of a sampling session (1, 2, ...; 0 is the original client): an unpickled
        SamplingClient numbers its sample ``seq_id`` from ``n * 10**9``, so clones never collide.

        Raises: NotFoundError for an unknown or expired sampling session.
        """
        await self.record(sampling_id)
        with redis_unavailable():
            n = int(await self.redis.incr(self.keys.sampler_clients(sampling_id)))
            await self.redis.expire(self.keys.sampler_clients(sampling_id), self.settings.future_ttl_s)
        return n

    async def retrieve_futures(
        self, sampling_id: str, clone: int, prev_cursor: int, timeout: float | None
    ) -> tuple[list[dict[str, Any]], int]:
        """Completions of a sampling session's samples after ``prev_cursor`` (a position in its completion list),
        those of clone ``clone`` only (sample ``seq_id // 10**9``); waits up to ``timeout`` (at most
        ``long_poll_s``) for one. Returns ``(completions, cursor)``.

        Raises: NotFoundError for an unknown or expired sampling session.
        """
        await self.record(sampling_id)
        key = self.keys.sampler_completions(sampling_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(self.settings.long_poll_s, timeout if timeout is not None else 30.0)
        while True:
            with redis_unavailable():
                rows = [json.loads(x) for x in await self.redis.lrange(key, max(0, prev_cursor), -1)]
            cursor = max(0, prev_cursor) + len(rows)
            mine = [
                {k: v for k, v in r.items() if k != "seq_id"}
                for r in rows
                if ((r.get("seq_id") or 0) // 10**9) == clone
            ]
            if mine or loop.time() >= deadline:
                return mine, cursor
            await asyncio.sleep(0.25)
