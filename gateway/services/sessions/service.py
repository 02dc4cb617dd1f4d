"""The training-session service: Tinker sessions (create, heartbeat, finish) and its parts, started together."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import redis.asyncio as aredis

from livelora.clients.errors import BadRequestError, NotFoundError
from livelora.clients.types.tinker import CreateSessionRequest, CreateSessionResponse
from livelora.clients.types.tinker_rest import (
    GetSessionResponse,
    ListSessionsResponse,
    SessionSearchCursor,
    SessionSearchRequest,
    SessionSearchResponse,
    SessionSummary,
)
from livelora.core.api_keys import Principal
from livelora.core.base_models import HUB_IDS
from livelora.core.bus import redis_unavailable
from livelora.core.owners import OwnerStore
from livelora.core.redis_keys import KeyLayout
from livelora.gateway.engines.base import Engine
from livelora.gateway.services.serving.serve import Serving
from livelora.gateway.services.sessions.checkpoints import Checkpoints
from livelora.gateway.services.sessions.context import SessionContext
from livelora.gateway.services.sessions.futures import Futures, GoneError, NotReady
from livelora.gateway.services.sessions.history import SessionHistory
from livelora.gateway.services.sessions.samples import Samples
from livelora.gateway.services.sessions.sampling import SamplingSessions
from livelora.gateway.services.sessions.training import TrainingOps
from livelora.gateway.settings import GatewaySettings

log = logging.getLogger(__name__)


class SessionService:
    """Tinker sessions and the services of their ``/api/v1`` operations.

    Attributes:
        ops: training ops, model records, server capabilities (:mod:`.training`).
        checkpoints: training runs' checkpoints (:mod:`.checkpoints`).
        sampling: sampling sessions (:mod:`.sampling`).
        samples: ``asample`` and ``cancel_future`` (:mod:`.samples`).
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
        self.sampling = SamplingSessions(ctx)
        self.samples = Samples(ctx, self.futures, serving, self.sampling)
        self.history = SessionHistory(ctx.redis, ctx.keys, ctx.settings.session_history_ttl_s)

    async def start(self) -> None:
        """Subscribe to future notifications, start the janitor (unloads ended sessions' adapters) and the
        checkpoint housekeeping (deletes expired checkpoints every ``checkpoint_sweep_s``)."""
        try:
            if moved := await self.history.migrate_legacy():
                log.info("moved %d session summaries out of the legacy sessionhistory hash", moved)
        except Exception as exc:  # Redis not there yet: the gateway still starts (its reads answer 503)
            log.warning("session history: legacy hash not moved: %s", exc)
        await self.futures.start()
        await self.sampling.start()
        self._sweeper = asyncio.create_task(self._sweep_loop())

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.checkpoint_sweep_s)
            try:
                deleted = await asyncio.to_thread(self.checkpoints.expire_due)
                if deleted:
                    log.info("deleted expired checkpoints: %s", ", ".join(deleted))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("checkpoint housekeeping: %s", exc)

    async def close(self) -> None:
        sweeper = getattr(self, "_sweeper", None)
        if sweeper is not None:
            sweeper.cancel()
            with contextlib.suppress(BaseException):
                await sweeper
        await self.futures.close()
        await self.samples.close()
        await self.sampling.close()
        await self.redis.aclose()

    async def create_session(self, req: CreateSessionRequest, principal: Principal) -> CreateSessionResponse:
        """Create a session of ``principal``'s tenant; it holds one of the tenant's ``max_sessions`` slots until
        finished or expired.

        Raises:
            RateLimitError: every slot of the tenant is held (429 naming the limit and when a slot frees).
        """
        sid = uuid.uuid4().hex
        tenant, key_id = (
            principal.tenant,
            principal.key_id,
        )  # the op executor meters the session's ops for them (``tenant``, ``key_id``)
        record = {
            "created": time.time(),
            "tags": req.tags,
            "user_metadata": req.user_metadata,
            "sdk_version": req.sdk_version,
            "tenant": tenant,
            "key_id": key_id,
        }
        summary = {**record, "display_name": req.display_name, "project_id": req.project_id, "status": None}
        with redis_unavailable():
            await self.redis.set(self.keys.session(sid), json.dumps(record), px=self.ctx.ttl_ms())
            if self.ctx.quotas is not None:
                try:
                    await self.ctx.quotas.acquire_session(tenant, sid)
                except BaseException:
                    await self.redis.delete(self.keys.session(sid))  # over the limit: nothing is created
                    raise
            await self.history.put(sid, summary)
        OwnerStore(self.ctx.home).claim("session", sid, tenant)  # before its id leaves the server
        return CreateSessionResponse(session_id=sid)

    async def heartbeat(self, session_id: str, tenant: str) -> None:
        """Extend the session's life by ``session_ttl_s`` (and its summary's and ``tenant``'s slot set's).

        Raises:
            GoneError: the session finished or expired.
        """
        with redis_unavailable():
            if not await self.redis.pexpire(self.keys.session(session_id), self.ctx.ttl_ms()):
                raise GoneError(
                    f"session {session_id} has ended (finished, or no heartbeat for {self.settings.session_ttl_s:g} s)",
                    param="session_id",
                )
            await self.history.touch(session_id)
            if self.ctx.quotas is not None:
                await self.ctx.quotas.touch_sessions(tenant)

    async def finish_session(
        self, session_id: str, principal: Principal, reason: str = "success", detail: str | None = None
    ) -> None:
        """End a session of ``principal``'s tenant: its models are freed by the trainer and its sampler adapters
        unloaded; its summary records ``client_finished`` with ``reason`` (success, errored, interrupted).

        Raises:
            NotFoundError: unknown session (already finished or expired sessions are fine: no-op).
        """
        with redis_unavailable():
            summary = await self.history.get(session_id)
            if summary is not None:
                summary["status"] = {"type": "client_finished", "reason": {"type": reason}, "detail": detail}
                await self.history.put(session_id, summary)
            await self.redis.delete(self.keys.session(session_id))
            await self.redis.publish(self.keys.sessions_channel, session_id)
            if self.ctx.quotas is not None:
                await self.ctx.quotas.release_session(principal.tenant, session_id)
        await self.sampling.unload_ended_sessions()

    async def _summary(self, sid: str, data: dict[str, Any]) -> SessionSummary:
        status = data.get("status")
        if status is None:
            alive = await self.redis.exists(self.keys.session(sid))
            status = (
                {"type": "active"}
                if alive
                else {"type": "cancelled", "detail": f"no heartbeat for {self.settings.session_ttl_s:g} s"}
            )
        runs = [m for m in self.checkpoints.run_ids() if m.startswith(f"{sid}:")]
        count = sum(len(self.checkpoints.list_checkpoints(m).checkpoints) for m in runs)
        return SessionSummary(
            session_id=sid,
            created_at=datetime.fromtimestamp(data["created"], UTC),
            owner="local",
            project_id=data.get("project_id") or "default",
            status=status,
            checkpoints_count=count,
            display_name=data.get("display_name"),
            user_metadata=data.get("user_metadata"),
        )

    async def get_session(self, sid: str) -> GetSessionResponse:
        """Training runs and sampling sessions of a session (also after it ended).

        Raises: NotFoundError for a session this store never had.
        """
        with redis_unavailable():
            data = await self.history.get(sid)
            if data is None:
                raise NotFoundError(f"session {sid!r} does not exist", param="session_id")
            samplers = sorted(
                [
                    k.removeprefix(self.keys.sampler(""))
                    async for k in self.redis.scan_iter(match=self.keys.sampler(f"{sid}:*"), count=1000)
                ]
            )
        return GetSessionResponse(
            training_run_ids=[m for m in self.checkpoints.run_ids() if m.startswith(f"{sid}:")],
            sampler_ids=samplers,
            user_metadata=data.get("user_metadata"),
            display_name=data.get("display_name"),
        )

    async def list_sessions(self, principal: Principal, limit: int = 20, offset: int = 0) -> ListSessionsResponse:
        """``principal``'s tenant's session ids, newest first."""
        with redis_unavailable():
            rows = await self.history.newest(principal.tenant)
        owners, tenant = OwnerStore(self.ctx.home), principal.tenant
        ids = [sid for sid, _ in rows if owners.owns("session", sid, tenant)]
        return ListSessionsResponse(sessions=ids[offset : offset + limit])

    async def search_sessions(self, req: SessionSearchRequest, principal: Principal) -> SessionSearchResponse:
        """``principal``'s tenant's sessions matching ``session_id``, ``display_name``, ``user_metadata`` (all pairs)
        and ``statuses`` (types), newest first, ``limit`` per page after ``cursor``; a page ends early (with
        ``next_cursor``) before its sessions' JSON passes ``session_search_max_bytes``.

        Raises: BadRequestError for an owner filter other than own/accessible (one owner per store).
        """
        if req.owner.get("type") not in ("own", "accessible"):
            raise BadRequestError("livelora has one owner per store: search with owner {'type': 'own'}", param="owner")
        # the index's score is the float time; the cursor's microseconds may round below it (exact order below)
        before = req.cursor.last_created_at.timestamp() + 1e-3 if req.cursor is not None else None
        with redis_unavailable():
            rows = await self.history.newest(principal.tenant, before)
            owners, tenant = OwnerStore(self.ctx.home), principal.tenant
            found = [
                await self._summary(sid, data)
                for sid, data in rows
                if req.session_id in (None, sid) and owners.owns("session", sid, tenant)
            ]
        wanted = {s.get("type") for s in req.statuses or ()}
        found = [
            s
            for s in found
            if (req.display_name in (None, s.display_name))
            and all((s.user_metadata or {}).get(k) == v for k, v in req.user_metadata.items())
            and (not wanted or (s.status or {}).get("type") in wanted)
        ]
        found.sort(key=lambda s: (s.created_at, s.session_id), reverse=True)
        if req.cursor is not None:
            after = (req.cursor.last_created_at, req.cursor.last_session_id)
            found = [s for s in found if (s.created_at, s.session_id) < after]
        page, size = [], 0
        for s in found[: req.limit]:
            size += len(s.model_dump_json())
            if page and size > self.settings.session_search_max_bytes:
                break
            page.append(s)
        more = len(found) > len(page)
        return SessionSearchResponse(
            sessions=page,
            next_cursor=SessionSearchCursor(last_created_at=page[-1].created_at, last_session_id=page[-1].session_id)
            if more
            else None,
        )

    async def retrieve_future(self, request_id: str, wait_s: float | None = None) -> dict[str, Any] | NotReady:
        """The op's result dict, its ``{"error", "category", ...}`` dict, or :class:`NotReady` after waiting
        (``long_poll_s`` by default); a sampler's weights are loaded before their future answers.

        Raises:
            GoneError: unknown or expired request id.
        """
        result = await self.futures.wait(request_id, wait_s)
        if (
            isinstance(result, dict)
            and result.get("type") == "save_weights_for_sampler"
            and result.get("sampling_session_id")
        ):
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
    aliases = {settings.model, settings.model_id, *([HUB_IDS[settings.model]] if settings.model in HUB_IDS else [])}
    aliases -= {settings.model_id}
    ctx = SessionContext(
        aredis.from_url(settings.redis_url, decode_responses=True),
        KeyLayout(settings.redis_prefix),
        engine,
        settings.home,
        settings.model_id,
        {settings.model_id, *aliases},
        settings.sessions,
        max_seq_len=settings.inference.max_model_len,
        quotas=serving.metering.quotas if serving.metering is not None else None,
    )
    service = SessionService(ctx, serving)
    await service.start()
    return service
