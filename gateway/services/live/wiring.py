"""Wires the live loop into a gateway process: Redis bus, completion log, signal service, adapter registry.

:func:`start_live_loop` is called from the app's lifespan. It never blocks serving on Redis: if Redis is
unreachable at start, inference still works (endpoints catch up from the store by polling), completions are
not logged and the signal routes answer 503 with ``Retry-After`` until Redis is back.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import redis

from livelora.clients.errors import UnavailableError
from livelora.core.accept_log import AcceptLog
from livelora.core.bus import connect_async, ensure_group_async, redis_unavailable, volatile_warning
from livelora.core.key_migration import migrate_user_text_keys
from livelora.core.redis_keys import KeyLayout
from livelora.gateway.engines.base import Engine
from livelora.gateway.services.live.completion_log import CompletionLog
from livelora.gateway.services.live.learning import LearningService
from livelora.gateway.services.live.live_stats import LiveStats
from livelora.gateway.services.live.registry import AdapterRegistry
from livelora.gateway.services.live.signals import SignalService
from livelora.gateway.settings import GatewaySettings

log = logging.getLogger(__name__)


@dataclass
class LiveLoop:
    """The gateway's live-loop services, sharing one asyncio Redis client; :meth:`close` stops them."""

    keys: KeyLayout
    client: Any
    completions: CompletionLog
    signals: SignalService
    registry: AdapterRegistry
    learning: LearningService

    async def close(self) -> None:
        if self.registry.stats is not None:
            await self.registry.stats.close()
        await self.registry.close()
        await self.client.aclose()


async def start_live_loop(settings: GatewaySettings, engine: Engine) -> LiveLoop:
    """Create the live loop and start the registry (catch-up from the store, notice subscriber, resync).

    Args:
        settings: the gateway settings (``redis_url``, ``redis_prefix``, ``home``, ``model_id``, ``live``).
        engine: the started engine.
    """
    live = settings.live
    keys = KeyLayout(settings.redis_prefix)
    client = connect_async(settings.redis_url)
    completions = CompletionLog(client, keys, retention_s=live.completion_retention_s)
    registry = AdapterRegistry(
        engine,
        settings.home,
        settings.model_id,
        client=client,
        keys=keys,
        resync_s=live.resync_s,
        max_on_demand=live.max_on_demand_versions,
    )
    registry.stats = LiveStats(client, keys, live, home=settings.home)  # counts requests; canaries
    learning = LearningService(client, keys, registry)
    signals = SignalService(
        client,
        keys,
        completions,
        registry=registry,
        stats=registry.stats,  # each accepted rating: counted, then the rollback test
        idempotency_ttl_s=live.idempotency_ttl_s,
        check_event=signal_checker(settings),
        ratings_to_step=learning.ratings_to_step,
        accept_log=AcceptLog(settings.home, keys.prefix),  # durable before the answer (docs/scaling-out.md)
    )
    try:
        await ensure_group_async(client, keys)
        with redis_unavailable():
            if moved := await migrate_user_text_keys(client, keys):
                log.info("renamed %d rating and idempotency keys to their digest form", moved)
        with contextlib.suppress(redis.exceptions.ResponseError):  # CONFIG disabled (managed Redis): cannot tell
            warning = volatile_warning(await client.config_get("append*"), settings.redis_url)
            if warning:
                log.warning(warning)
    except UnavailableError as exc:
        log.warning(
            "Redis at %s is unreachable (%s): serving without the completion log and signal routes until it is back",
            settings.redis_url,
            exc,
        )
    await registry.start()
    return LiveLoop(keys, client, completions, signals, registry, learning)


def signal_checker(settings):
    """The door check of signals (:class:`~livelora.gateway.signal_checks.SignalChecker`): a tokenizer of its own
    (loaded as the trainer loads it) and the trainer's context length for ``settings.model``."""
    from livelora.core.base_models import load_tokenizer, resolve_base_model
    from livelora.core.chat_tokens import model_context_length
    from livelora.gateway.signal_checks import SignalChecker

    ref = resolve_base_model(settings.model, settings.home)
    return SignalChecker(load_tokenizer(ref), model_context_length(ref)).check
