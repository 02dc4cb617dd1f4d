"""Signals: ratings, preferences and demonstrations validated and put on the Redis signals stream.

:class:`SignalService` is what ``POST /v1/feedback``, ``/v1/preferences`` and ``/v1/demonstrations``
(:mod:`livelora.gateway.api.signals`) call: it finds the completions rated (the caller's own only), checks the
caller may train the endpoint's lineage and that the trainer could train the event, then hands it to
:class:`~.signal_stream.SignalStream` (2xx only once it is in the stream; 503 with ``Retry-After`` while Redis is
unreachable, nothing accepted; re-rates replace, ``Idempotency-Key`` replays). An accepted rating is then counted
for the version that served it, which may end the endpoint's canary or roll it back (:meth:`SignalService.feedback`).

Wiring: the live loop (:mod:`livelora.gateway.services.live.wiring`) builds the service; the routes pass the
caller (the tenant, in key mode) and the principal that auth identified.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis.asyncio as aredis

from livelora.clients.errors import BadRequestError, NotFoundError
from livelora.clients.types.signals import (
    CompletionRecord,
    DemonstrationEvent,
    DemonstrationRequest,
    DemonstrationResponse,
    FeedbackRequest,
    FeedbackResponse,
    PreferenceEvent,
    PreferenceRequest,
    PreferenceResponse,
    RatingEvent,
)
from livelora.core.api_keys import DEFAULT_TENANT, Principal
from livelora.core.redis_keys import KeyLayout
from livelora.gateway.services.live.completion_log import CompletionLog
from livelora.gateway.services.live.signal_stream import SignalStream
from livelora.gateway.settings import DEFAULT_IDEMPOTENCY_TTL_S

if TYPE_CHECKING:
    from livelora.gateway.services.live.live_stats import LiveStats
    from livelora.gateway.services.live.registry import AdapterRegistry

log = logging.getLogger(__name__)


class SignalService:
    """Validates signals and puts them on the bus; an accepted rating is then counted for the version that served
    it and may end the endpoint's canary or roll the endpoint back (:meth:`feedback`, with ``stats``).

    Args:
        client: asyncio Redis client (``decode_responses=True``).
        keys: key layout.
        completions: the completion log (retention also bounds rating keys).
        registry: the endpoints: ``endpoint_for(model, principal)`` names a request's endpoint (raising
            ``ModelNotFoundError``), ``check_trainable(endpoint, principal)`` raises ``ConflictError`` when the
            caller may not train its lineage, and (optional) ``segments.match(endpoint, principal, user)`` the
            segment an inline signal trains (:class:`~.registry.AdapterRegistry`). ``None``: any name as is.
        stats: per-version statistics that each accepted rating is counted in, and the sequential test run
            after it (canary end, automatic rollback); ``None``: ratings drive nothing.
        idempotency_ttl_s: lifetime of idempotency records (seconds).
        check_event: raises (400) for an event the trainer could not train, before it is queued
            (:class:`livelora.gateway.signal_checks.SignalChecker`); run on a thread. ``None`` checks nothing.
        accept_log: the accepted-signal log (:class:`~livelora.core.accept_log.AcceptLog`); ``None``: none.
    """

    def __init__(
        self,
        client: aredis.Redis,
        keys: KeyLayout,
        completions: CompletionLog,
        registry: AdapterRegistry | None = None,
        stats: LiveStats | None = None,
        idempotency_ttl_s: int = DEFAULT_IDEMPOTENCY_TTL_S,
        check_event: Callable[[Any], None] | None = None,
        ratings_to_step: Callable[[str], Any] | None = None,
        accept_log: Any = None,
    ):
        self.client = client
        self.ratings_to_step = (
            ratings_to_step  # async (endpoint, id) -> (int | None, str | None) (services/learning.py)
        )
        self.keys = keys
        self.completions = completions
        self.registry = registry
        self.stats = stats
        self.check_event = check_event
        self.stream = SignalStream(
            client, keys, idempotency_ttl_s, rating_ttl_s=completions.retention_s, accept_log=accept_log
        )

    # ------------------------------------------------------------ internals

    def _endpoint(self, model: str, principal: Principal | None, user: str | None = None) -> str:
        """The endpoint an inline signal naming ``model`` trains: the segment of it ``user`` or the caller
        belongs to (:mod:`.segments`), else the endpoint itself."""
        if self.registry is None:
            return model
        endpoint = self.registry.endpoint_for(model, principal)
        segments = getattr(self.registry, "segments", None)  # an AdapterRegistry's; a bare endpoint map has none
        return (segments.match(endpoint, principal, user) if segments is not None else None) or endpoint

    def _check_trainable(self, endpoint: str, principal: Principal | None) -> None:
        if self.registry is not None:
            self.registry.check_trainable(endpoint, principal)

    async def _after_rating(self, ev: RatingEvent) -> None:
        """Count an accepted rating for the version that served it, then run the endpoint's sequential test (which
        may end its canary or roll it back, :meth:`~.live_stats.LiveStats.after_rating`). Never raises: the rating
        is accepted already."""
        if self.stats is None:
            return
        try:
            await self.stats.count_rating(ev.endpoint, ev.adapter, ev.rating_key, ev.rating)
            if self.registry is not None:
                await self.stats.after_rating(self.registry, ev.endpoint)
        except Exception:
            log.exception("live statistics of a rating failed")

    async def _visible(self, completion_id: str, caller: str | None, param: str) -> CompletionRecord:
        try:
            rec = await self.completions.get(completion_id, caller=caller)
        except NotFoundError as exc:
            raise NotFoundError(exc.message, param=param) from None
        if (rec.caller or DEFAULT_TENANT) != (caller or DEFAULT_TENANT):
            # another tenant's completion: indistinguishable from an unknown id. Open mode (no caller) is tenant
            # 'default', also for completions recorded then: keys created later do not open them to others.
            raise self.completions.missing(completion_id, param)
        return rec

    async def _submit(
        self,
        route: str,
        event: Any,
        body: Any,
        caller: str | None,
        idempotency_key: str | None,
        rating_key: str | None = None,
    ) -> tuple[Any, str | None, bool]:
        """The door check (:attr:`check_event`, on a thread), then :meth:`.SignalStream.submit`."""
        if self.check_event is not None:
            await asyncio.to_thread(self.check_event, event)
        return await self.stream.submit(route, event, body, caller, idempotency_key, rating_key)

    @staticmethod
    def _new_id(kind: str) -> str:
        return f"{kind}-{uuid.uuid4().hex}"

    # -------------------------------------------------------------- routes

    async def feedback(
        self,
        req: FeedbackRequest,
        *,
        caller: str | None = None,
        principal: Principal | None = None,
        idempotency_key: str | None = None,
    ) -> tuple[FeedbackResponse, bool]:
        """Accept one rating, then count it and run the endpoint's rollback test (:meth:`_after_rating`); returns
        ``(response, replayed)``. ``caller``: the tenant in key mode (completions are kept per caller);
        ``principal``: whose lineages it may train (``None``: every one).

        Raises:
            NotFoundError: unknown, expired or not-visible completion id (404).
            ConflictError: idempotency key reused with another body (409).
            UnavailableError: Redis unreachable (503); nothing accepted.
        """
        rec = await self._visible(req.completion_id, caller, "completion_id")
        self._check_trainable(rec.endpoint, principal)
        rater = f"{caller or ''}/{req.user or ''}"
        event = RatingEvent(
            id=self._new_id("feedback"),
            endpoint=rec.endpoint,
            created=int(time.time()),
            caller=caller,
            user=req.user,
            completion_users=[rec.user] if rec.user is not None and rec.user != req.user else [],
            completion_id=rec.id,
            adapter=rec.adapter,
            prompt_token_ids=rec.prompt_token_ids,
            completion_token_ids=rec.completion_token_ids,
            logprobs=rec.logprobs,
            finish_reason=rec.finish_reason,
            rating=req.rating,
            score=req.score,
            comment=req.comment,
            rating_key=f"{rec.id}:{rater}",
        )
        ev, replaces, replayed = await self._submit(
            "feedback", event, req, caller, idempotency_key, rating_key=self.keys.rating(rec.id, rater)
        )
        if not replayed:
            await self._after_rating(ev)
        to_step, note = (None, None)
        if self.ratings_to_step is not None:
            to_step, note = await self.ratings_to_step(ev.endpoint, ev.id)
        return FeedbackResponse(
            id=ev.id,
            completion_id=ev.completion_id,
            endpoint=ev.endpoint,
            rating=ev.rating,
            score=ev.score,
            comment=ev.comment,
            user=ev.user,
            replaces=replaces,
            created=ev.created,
            ratings_to_step=to_step,
            training=note,
        ), replayed

    async def preference(
        self,
        req: PreferenceRequest,
        *,
        caller: str | None = None,
        principal: Principal | None = None,
        idempotency_key: str | None = None,
    ) -> tuple[PreferenceResponse, bool]:
        """Accept one chosen/rejected pair (completion-id form or inline form).

        Raises:
            BadRequestError: neither or both forms, missing fields, different prompts or
                endpoints, identical chosen and rejected (400).
            NotFoundError / ModelNotFoundError: unknown completion id or endpoint (404).
            ConflictError, UnavailableError: as :meth:`feedback`.
        """
        now = int(time.time())
        if _preference_form(req) == "completion-id":
            c = await self._visible(req.chosen_completion_id, caller, "chosen_completion_id")
            r = await self._visible(req.rejected_completion_id, caller, "rejected_completion_id")
            _check_completion_pair(c, r)
            self._check_trainable(c.endpoint, principal)
            event = PreferenceEvent(
                id=self._new_id("preference"),
                endpoint=c.endpoint,
                created=now,
                caller=caller,
                user=req.user,
                completion_users=sorted({u for u in (c.user, r.user) if u is not None and u != req.user}),
                chosen_completion_id=c.id,
                rejected_completion_id=r.id,
                prompt_token_ids=c.prompt_token_ids,
                chosen_token_ids=c.completion_token_ids,
                rejected_token_ids=r.completion_token_ids,
            )
        else:
            endpoint = self._endpoint(req.model, principal, req.user)
            self._check_trainable(endpoint, principal)
            event = PreferenceEvent(
                id=self._new_id("preference"),
                endpoint=endpoint,
                created=now,
                caller=caller,
                user=req.user,
                messages=req.messages,
                chosen=req.chosen,
                rejected=req.rejected,
            )
        ev, _, replayed = await self._submit("preferences", event, req, caller, idempotency_key)
        return PreferenceResponse(
            id=ev.id,
            endpoint=ev.endpoint,
            chosen_completion_id=ev.chosen_completion_id,
            rejected_completion_id=ev.rejected_completion_id,
            user=ev.user,
            created=ev.created,
        ), replayed

    async def demonstration(
        self,
        req: DemonstrationRequest,
        *,
        caller: str | None = None,
        principal: Principal | None = None,
        idempotency_key: str | None = None,
    ) -> tuple[DemonstrationResponse, bool]:
        """Accept one demonstration (messages ending with the ideal assistant reply).

        Raises:
            BadRequestError: last message not a non-empty assistant reply, or no user message (400).
            ModelNotFoundError: unknown endpoint (404).
            ConflictError, UnavailableError: as :meth:`feedback`.
        """
        last = req.messages[-1]
        if last.role != "assistant" or not last.content:
            raise BadRequestError(
                "The last message must be the ideal assistant reply (role 'assistant', non-empty content)",
                param="messages",
            )
        if not any(m.role == "user" for m in req.messages[:-1]):
            raise BadRequestError("A demonstration needs at least one user message before the reply", param="messages")
        endpoint = self._endpoint(req.model, principal, req.user)
        self._check_trainable(endpoint, principal)
        event = DemonstrationEvent(
            id=self._new_id("demonstration"),
            endpoint=endpoint,
            created=int(time.time()),
            caller=caller,
            user=req.user,
            messages=req.messages,
        )
        ev, _, replayed = await self._submit("demonstrations", event, req, caller, idempotency_key)
        return DemonstrationResponse(id=ev.id, endpoint=ev.endpoint, user=ev.user, created=ev.created), replayed


def _preference_form(req: PreferenceRequest) -> str:
    """``"completion-id"`` or ``"inline"``: which form ``req`` uses, its own fields checked (those of the stored
    completions are checked by :func:`_check_completion_pair`). Raises: BadRequestError (neither or both forms, a
    field of the form missing, chosen equal to rejected, a prompt ending with an assistant message)."""
    by_id = req.chosen_completion_id is not None or req.rejected_completion_id is not None
    inline = any(v is not None for v in (req.model, req.messages, req.chosen, req.rejected))
    if by_id == inline:
        which = "both forms were given" if by_id else "neither form was given"
        raise BadRequestError(
            "Give either chosen_completion_id and rejected_completion_id, or model, "
            f"messages, chosen and rejected ({which})",
            param="chosen_completion_id",
        )
    if by_id:
        for name in ("chosen_completion_id", "rejected_completion_id"):
            if getattr(req, name) is None:
                raise BadRequestError(f"{name} is required with the completion-id form", param=name)
        if req.chosen_completion_id == req.rejected_completion_id:
            raise BadRequestError("chosen and rejected are the same completion", param="rejected_completion_id")
        return "completion-id"
    for name in ("model", "messages", "chosen", "rejected"):
        if getattr(req, name) is None:
            raise BadRequestError(f"{name} is required with the inline form", param=name)
    if not req.messages or req.messages[-1].role == "assistant":
        raise BadRequestError(
            "messages is the prompt: non-empty, not ending with an assistant message", param="messages"
        )
    if not req.chosen or not req.rejected:
        raise BadRequestError("chosen and rejected must be non-empty replies", param="chosen")
    if req.chosen == req.rejected:
        raise BadRequestError("chosen and rejected are identical", param="rejected")
    return "inline"


def _check_completion_pair(chosen: CompletionRecord, rejected: CompletionRecord) -> None:
    """Raises BadRequestError unless the two stored completions answer the same prompt of one endpoint with
    different replies."""
    if chosen.endpoint != rejected.endpoint:
        raise BadRequestError(
            f"The completions come from different endpoints ({chosen.endpoint!r}, "
            f"{rejected.endpoint!r}); a preference compares replies of one endpoint",
            param="rejected_completion_id",
        )
    if chosen.prompt_token_ids != rejected.prompt_token_ids:
        raise BadRequestError(
            "The two completions answer different prompts; a preference pair needs the same prompt",
            param="rejected_completion_id",
        )
    if chosen.completion_token_ids == rejected.completion_token_ids:
        raise BadRequestError("chosen and rejected completions are identical", param="rejected_completion_id")
