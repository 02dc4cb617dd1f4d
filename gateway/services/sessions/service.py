"""The training-session service: Tinker sessions (create, heartbeat, finish) and its parts, started together."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import redis.asyncio as aredis

from livelora.adapters.bus import redis_unavailable
from livelora.adapters.owners import OwnerStore
from livelora.adapters.redis_keys import KeyLayout
from livelora.clients.types.tinker import CreateSessionRequest, CreateSessionResponse
from livelora.gateway.auth import caller_tenant
from livelora.gateway.engines.base import Engine
from livelora.gateway.services.serving import Serving
from livelora.gateway.services.sessions.checkpoints import Checkpoints
from livelora.gateway.services.sessions.context import SessionContext
from livelora.gateway.services.sessions.futures import Futures, GoneError, NotReady
from livelora.gateway.services.sessions.sampling import SamplingSessions
from livelora.gateway.services.sessions.training import TrainingOps
from livelora.gateway.settings import GatewaySettings


class SessionService:
    """Tinker sessions and the services of their ``/api/v1`` operations.

    Attributes:
        ops: training ops, model records, server capabilities (:mod:`.training`).
        checkpoints: training runs' checkpoints (:mod:`.checkpoints`).
        sampling: sampling sessions and ``asample`` (:mod:`.sampling`).
        futures: op results (:mod:`.futures`).
        redis: the service's asyncio Redis client (also read by auth for session owners).

    Args:
        ctx: the shared context (its Redis client is closed by :meth:`close`).
        serving: admits sampled sequences.
    """

    def __init__(self, ctx: SessionContext, serving: Serving):
        self.ctx = ctx
        self.redis = ctx.redis
        self.keys = ctx.keys
        self.settings = ctx.settings
        self.futures = Futures(ctx)
        self.ops = TrainingOps(ctx, self.futures)
        self.checkpoints = Checkpoints(ctx)
        self.sampling = SamplingSessions(ctx, self.futures, serving)

    async def start(self) -> None:
        """Subscribe to future notifications and start the janitor (unloads ended sessions' adapters)."""
        await self.futures.start()
        await self.sampling.start()

    async def close(self) -> None:
        await self.futures.close()
        await self.sampling.close()
        await self.redis.aclose()

    async def create_session(self, req: CreateSessionRequest) -> CreateSessionResponse:
        """Create a session; it holds one of its tenant's ``max_sessions`` slots until finished or expired.

        Raises:
            RateLimitError: every slot of the tenant is held (429 naming the limit and when a slot frees).
        """
        from livelora.gateway.services.metering import payer

        sid = uuid.uuid4().hex
        tenant, key_id = payer()  # the op executor meters the session's ops for them (``tenant``, ``key_id``)
        record = {"created": time.time(), "tags": req.tags, "user_metadata": req.user_metadata,
                  "sdk_version": req.sdk_version, "tenant": tenant, "key_id": key_id}
        with redis_unavailable():
            await self.redis.set(self.keys.session(sid), json.dumps(record), px=self.ctx.ttl_ms())
            if self.ctx.quotas is not None:
                try:
                    await self.ctx.quotas.acquire_session(tenant, sid)
                except BaseException:
                    await self.redis.delete(self.keys.session(sid))  # over the limit: nothing is created
                    raise
        OwnerStore(self.ctx.home).claim("session", sid, caller_tenant())  # before its id leaves the server
        return CreateSessionResponse(session_id=sid)

    async def heartbeat(self, session_id: str) -> None:
        """Extend the session's life by ``session_ttl_s``.

        Raises:
            GoneError: the session finished or expired.
        """
        with redis_unavailable():
            if not await self.redis.pexpire(self.keys.session(session_id), self.ctx.ttl_ms()):
                raise GoneError(f"session {session_id} has ended (finished, or no heartbeat for "
                                f"{self.settings.session_ttl_s:g} s)", param="session_id")

    async def finish_session(self, session_id: str) -> None:
        """End a session: its models are freed by the trainer and its sampler adapters unloaded.

        Raises:
            NotFoundError: unknown session (already finished or expired sessions are fine: no-op).
        """
        from livelora.gateway.services.metering import payer

        with redis_unavailable():
            await self.redis.delete(self.keys.session(session_id))
            await self.redis.publish(self.keys.sessions_channel, session_id)
            if self.ctx.quotas is not None:
                await self.ctx.quotas.release_session(payer()[0], session_id)
        await self.sampling.unload_ended_sessions()

    async def retrieve_future(self, request_id: str, wait_s: float | None = None) -> dict[str, Any] | NotReady:
        """The op's result dict, its ``{"error", "category", ...}`` dict, or :class:`NotReady` after waiting
        (``long_poll_s`` by default); a sampler's weights are loaded before their future answers.

        Raises:
            GoneError: unknown or expired request id.
        """
        result = await self.futures.wait(request_id, wait_s)
        if isinstance(result, dict) and result.get("type") == "save_weights_for_sampler" and \
                result.get("sampling_session_id"):
            await self.sampling.ensure_sampler_loaded(result["sampling_session_id"])
        return result


async def start_sessions(settings: GatewaySettings, engine: Engine, serving: Serving) -> SessionService:
    """Build and start the session service; close it with ``close()``.

    The ops it queues are run by an op executor (:mod:`livelora.trainer.executor`), which the process
    wiring starts beside the gateway (:mod:`livelora.cli.processes`) or a ``livelora trainer`` runs.

    Args:
        settings: the gateway's settings (``home``, ``redis_url``, ``redis_prefix``, ``model``, ``model_id``,
            ``sessions``, ``inference.max_model_len``).
        engine: the started engine.
        serving: admits sampled sequences.
    """
    aliases = {settings.model, settings.model_id} - {settings.model_id}
    ctx = SessionContext(aredis.from_url(settings.redis_url, decode_responses=True), KeyLayout(settings.redis_prefix),
                         engine, settings.home, settings.model_id, {settings.model_id, *aliases}, settings.sessions,
                         max_seq_len=settings.inference.max_model_len,
                         quotas=serving.metering.quotas if serving.metering is not None else None)
    service = SessionService(ctx, serving)
    await service.start()
    return service
