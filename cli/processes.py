"""What runs in each process kind, and the start-up check every kind makes.

* ``livelora serve``: the gateway, plus signal worker + op executor in a supervised child process at lower CPU
  priority (:mod:`livelora.cli.trainer_process`; ``LIVELORA_TRAINER_PROCESS=false``: threads of this process);
* ``livelora gateway``: gateway, plus an op executor only when ``LIVELORA_EXECUTOR_IN_PROCESS`` is true;
* ``livelora trainer``: signal worker + op executor (:func:`run_trainer`).

Every kind first binds its store to its Redis prefix (:func:`~livelora.core.install.bind_install`) and
refuses to start when they belong to different installs. Tests build their gateways with :func:`gateway_app`
too, so they run what the CLI runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from livelora.core.settings import ProcessSettings, SessionSection
from livelora.gateway.api.deps import GatewayServices, services_of
from livelora.gateway.app import Component, create_app
from livelora.gateway.engines.base import Engine
from livelora.gateway.settings import GatewaySettings
from livelora.trainer.settings import TrainerSettings

log = logging.getLogger(__name__)


def check_install(settings: ProcessSettings) -> str:
    """Bind ``settings.home`` to ``settings.redis_prefix`` (first start) or check the binding; returns the
    store id.

    Raises:
        InstallMismatchError: the prefix belongs to another store (the message says what to change).
        UnavailableError: Redis unreachable.
    """
    from livelora.core.bus import connect_sync
    from livelora.core.install import bind_install
    from livelora.core.redis_keys import KeyLayout

    client = connect_sync(settings.redis_url)
    try:
        return bind_install(client, KeyLayout(settings.redis_prefix), settings.home, settings.redis_url)
    finally:
        client.close()


def build_executor(
    settings: ProcessSettings,
    sessions: SessionSection,
    *,
    device: str = "cpu",
    max_seq_len: int | None = None,
    served_name: str | None = None,
) -> Any:
    """An :class:`~livelora.trainer.executor.OpExecutor` on the settings' Redis, prefix and store (not started); a
    trainer's (settings with a ``group`` section) takes the models its placement accepts."""
    import redis

    from livelora.adapters.kept_versions import AdapterVersions
    from livelora.core.metering import Meter
    from livelora.core.quotas import Limits
    from livelora.core.redis_keys import KeyLayout
    from livelora.trainer.executor import OpExecutor

    keys = KeyLayout(settings.redis_prefix)
    observability = getattr(settings, "observability", None)
    quotas = getattr(settings, "quotas", None)
    meter = Meter(keys, enabled=observability.metering if observability is not None else True)
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    placement = None
    if getattr(settings, "group", None) is not None:  # a trainer's take rules (trainer/placement.py)
        from livelora.trainer.placement import placement_of

        placement = placement_of(settings, client, keys)
    return OpExecutor(
        client,
        keys,
        settings.home,
        settings.model,
        sessions,
        device=device,
        max_seq_len=max_seq_len,
        served_name=served_name,
        meter=meter,
        versions=AdapterVersions(settings.home, Limits.from_settings(quotas)) if quotas else None,
        placement=placement,
    )


def op_executor_component(settings: GatewaySettings) -> Component:
    """A gateway :data:`~livelora.gateway.app.Component` that runs an
    :class:`~livelora.trainer.executor.OpExecutor` in a thread while the app runs (device and sequence limit
    taken from the started engine)."""

    @contextlib.asynccontextmanager
    async def run(services: GatewayServices) -> AsyncIterator[object]:
        engine = services.engine
        device = getattr(engine, "device", None) or settings.inference.device or "cpu"
        executor = build_executor(
            settings,
            settings.sessions,
            device=str(device),
            max_seq_len=settings.inference.max_model_len or int(engine.max_model_len),
            served_name=settings.model_id,
        )
        executor.start()
        try:
            yield executor
        finally:
            # at most one op's duration; leases are given back so a peer takes the models over at once
            await asyncio.to_thread(executor.stop, 10.0)
            with contextlib.suppress(Exception):
                executor.redis.close()

    return run


def gateway_app(settings: GatewaySettings, engine: Engine | None = None, *, executor: bool | None = None) -> FastAPI:
    """The gateway app with what runs beside it in a gateway process: an op executor when ``executor`` (default
    ``settings.sessions.executor_in_process``). Checks the install binding first.

    Raises:
        InstallMismatchError: the store and the Redis prefix belong to different installs.
    """
    check_install(settings)
    run_executor = settings.sessions.executor_in_process if executor is None else executor
    components = [op_executor_component(settings)] if run_executor else []
    return create_app(settings, engine, components=components)


class DrainingServer:
    """Runs a gateway app under uvicorn; the first SIGTERM/SIGINT drains it (:mod:`livelora.gateway.middleware.drain`:
    503 for new requests, ``/health`` draining, running requests get ``drain_grace_s``), then the server exits
    once no admitted sequence is left or the grace period (plus 2 s to write the last events) is over. A second
    signal exits at once.

    Args:
        app: a gateway app (``create_app`` / :func:`gateway_app`).
        host, port: where to listen. log_level: uvicorn's.
        json_logs: leave logging to livelora's JSON handler (uvicorn's own log config would print plain lines).
    """

    #: seconds after the drain deadline before the server stops regardless (streams write their last events)
    MARGIN_S = 2.0

    def __init__(self, app: FastAPI, host: str, port: int, log_level: str = "info", *, json_logs: bool = False):
        import uvicorn

        services = services_of(app)
        outer = self

        class _Server(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:
                if services.drain.draining or self.should_exit:
                    return super().handle_exit(sig, frame)  # a second signal: stop now
                services.drain.begin()  # not recorded as captured: no re-raise of the signal after a clean drain

            async def on_tick(self, counter: int) -> bool:
                if services.drain.draining and not self.should_exit and outer.drained():
                    self.should_exit = True
                return await super().on_tick(counter)

        self.services = services
        extra = {"log_config": None} if json_logs else {}
        self.server = _Server(
            uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, **extra)
        )

    def drained(self) -> bool:
        """Whether the drain may end: nothing admitted is left, or the grace period is over."""
        drain, admission = self.services.drain, self.services.admission
        if admission is None or admission.active == 0:
            return True
        return drain.clock() >= drain.deadline + self.MARGIN_S

    def run(self, sock=None) -> None:
        """Serve until drained (blocking), on ``sock`` (a bound socket) when given."""
        self.server.run(sockets=[sock] if sock is not None else None)


def start_trainer_thread(settings: TrainerSettings, stop: threading.Event) -> threading.Thread:
    """Build a trainer worker (:func:`~livelora.trainer.worker.build_worker`) and run it in a daemon thread
    until ``stop`` is set."""
    from livelora.core.base_models import import_model_libraries
    from livelora.trainer.worker import build_worker

    worker = build_worker(settings)
    # transformers' lazy modules are not safe to initialise from two threads at once (the trainer warms up
    # while the gateway loads its engine): resolve them here first
    import_model_libraries()
    thread = threading.Thread(target=worker.run, args=(stop,), name="livelora-trainer", daemon=True)
    thread.start()
    return thread


def run_trainer(settings: TrainerSettings, stop: threading.Event | None = None) -> None:
    """A trainer process: the signal worker and an op executor (training sessions), until ``stop`` is set or
    SIGINT/SIGTERM. The executor gives its leases back on the way out.

    Raises:
        InstallMismatchError: the store and the Redis prefix belong to different installs.
    """
    import signal

    from livelora.core.base_models import import_model_libraries
    from livelora.trainer.worker import build_worker

    check_install(settings)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    import_model_libraries()
    worker = build_worker(settings)
    executor = build_executor(settings, settings.sessions, device=settings.training.device)
    executor.start()
    log.info(
        "trainer %s: signal worker consuming %s, op executor %s", worker.consumer, worker.keys.signals, executor.owner
    )
    try:
        worker.run(stop)
    finally:
        executor.stop(30.0)
