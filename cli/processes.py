"""What runs beside the gateway in one process: the op executor of training sessions and the trainer worker.

``livelora serve`` = gateway + op executor + signal worker; ``livelora gateway`` = gateway + op executor
(``LIVELORA_TRAINER_IN_PROCESS``, default true); ``livelora trainer`` = signal worker. Tests build their
gateways with :func:`gateway_app` too, so they run what the CLI runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

from fastapi import FastAPI

from livelora.gateway.api.deps import GatewayServices
from livelora.gateway.app import Component, create_app
from livelora.gateway.engines.base import Engine
from livelora.gateway.settings import GatewaySettings
from livelora.trainer.settings import TrainerSettings


def op_executor_component(settings: GatewaySettings) -> Component:
    """A gateway :data:`~livelora.gateway.app.Component` that runs an
    :class:`~livelora.trainer.executor.OpExecutor` in a thread while the app runs (device and sequence limit
    taken from the started engine)."""

    @contextlib.asynccontextmanager
    async def run(services: GatewayServices) -> AsyncIterator[object]:
        import redis

        from livelora.adapters.redis_keys import KeyLayout
        from livelora.trainer.executor import OpExecutor

        engine = services.engine
        device = getattr(engine, "device", None) or settings.inference.device or "cpu"
        executor = OpExecutor(redis.Redis.from_url(settings.redis_url, decode_responses=True),
                              KeyLayout(settings.redis_prefix), settings.home, settings.model, settings.sessions,
                              device=device,
                              max_seq_len=settings.inference.max_model_len or int(engine.max_model_len),
                              served_name=settings.model_id)
        executor.start()
        try:
            yield executor
        finally:
            # at most one op's duration; no thread left running at interpreter exit
            await asyncio.to_thread(executor.stop, 10.0)
            with contextlib.suppress(Exception):
                executor.redis.close()

    return run


def gateway_app(settings: GatewaySettings, engine: Engine | None = None) -> FastAPI:
    """The gateway app with what runs beside it in a gateway process: the op executor when
    ``settings.sessions.trainer_in_process``."""
    components = [op_executor_component(settings)] if settings.sessions.trainer_in_process else []
    return create_app(settings, engine, components=components)


def start_trainer_thread(settings: TrainerSettings, stop: threading.Event) -> threading.Thread:
    """Build a trainer worker (:func:`~livelora.trainer.worker.build_worker`) and run it in a daemon thread
    until ``stop`` is set."""
    from livelora.adapters.models import import_model_libraries
    from livelora.trainer.worker import build_worker

    worker = build_worker(settings)
    # transformers' lazy modules are not safe to initialise from two threads at once (the trainer warms up
    # while the gateway loads its engine): resolve them here first
    import_model_libraries()
    thread = threading.Thread(target=worker.run, args=(stop,), name="livelora-trainer", daemon=True)
    thread.start()
    return thread

