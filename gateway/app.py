"""The gateway's FastAPI application factory, :func:`create_app`.

Example::

    from livelora.gateway.app import create_app
    from livelora.gateway.settings import GatewaySettings

    app = create_app(GatewaySettings(model="smollm2-135m-instruct"))
    # uvicorn.run(app, host="127.0.0.1", port=8000)

Nothing is created at import: the lifespan builds the engine and the services into one
:class:`~livelora.gateway.api.deps.GatewayServices` (start-up order and ``components``: docs/architecture.md).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager

from fastapi import FastAPI

from livelora.core.api_keys import KeyStore
from livelora.gateway.api import (
    admin,
    chat,
    completions,
    console,
    console_actions,
    health,
    learning,
    messages,
    models,
    observability,
    signals,
    tinker,
)
from livelora.gateway.api.deps import GatewayServices, attach
from livelora.gateway.api.errors import install_error_handlers
from livelora.gateway.engines.base import Engine
from livelora.gateway.middleware.auth import AuthMiddleware, check_bind
from livelora.gateway.middleware.drain import Drain, DrainMiddleware
from livelora.gateway.middleware.metrics import MetricsMiddleware
from livelora.gateway.services.console.login import ConsoleLogins
from livelora.gateway.services.live.wiring import start_live_loop
from livelora.gateway.services.serving.admission import Admission
from livelora.gateway.services.serving.serve import Serving
from livelora.gateway.services.sessions import start_sessions
from livelora.gateway.services.tenants.usage import MeteringService
from livelora.gateway.settings import GatewaySettings

log = logging.getLogger(__name__)


def build_engine(settings: GatewaySettings) -> Engine:
    """The engine of kind ``settings.inference.engine`` for ``settings.model`` (not started).

    Raises:
        BadRequestError: unknown engine kind (raised by the engine factory).
        ModelNotFoundError: the base model cannot be resolved.
    """
    from livelora.gateway.engines import create_engine

    inference = settings.inference
    device = inference.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    kwargs = {
        "model": settings.model,
        "home": settings.home,
        "device": device,
        "dtype": inference.dtype,
        "max_batch_size": inference.max_batch_size,
        # the gateway's Admission bounds sequences (429); the engine's own queue must hold them all
        "max_waiting": inference.max_sequences,
        "max_model_len": inference.max_model_len,
    }
    if inference.engine == "vllm":
        kwargs["settings"] = settings.vllm
    else:
        if inference.engine_threads:
            kwargs["num_threads"] = inference.engine_threads
        if inference.engine_weights is not None:
            kwargs["weights"] = inference.engine_weights
        kwargs["merge_lora"] = inference.engine_merge_lora
        kwargs["max_loaded_versions"] = inference.engine_max_loaded_versions
        if device == "cpu" and inference.engine_threads_while_training != 0:
            kwargs.update(share_cores=True, threads_while_training=inference.engine_threads_while_training)
    if inference.engine == "llama_cpp":  # a native crash ends the engine's child process, not the gateway
        kwargs.update(child_process=True, exit_on_failure=True)
    return create_engine(inference.engine, **kwargs)


#: A part of the process run for the app's lifetime: ``component(services)`` returns an async context manager.
Component = Callable[[GatewayServices], AbstractAsyncContextManager]


def create_app(
    settings: GatewaySettings | None = None, engine: Engine | None = None, components: Sequence[Component] = ()
) -> FastAPI:
    """Build the gateway app.

    Args:
        settings: gateway settings (default: from the environment).
        engine: an engine to serve with (started in lifespan if needed, never closed by the
            app); ``None`` builds one from ``settings`` in lifespan and closes it on shutdown.
        components: other parts of the process to run while the app runs (see the module docstring).
    """
    settings = settings or GatewaySettings()
    services = _services(settings)
    app = FastAPI(
        title="livelora",
        version="0.1.0",
        lifespan=_lifespan(settings, services, engine, components),
        description="OpenAI-compatible gateway whose LoRA adapter keeps learning while it serves.",
    )
    attach(app, services)
    install_error_handlers(app)
    app.add_middleware(AuthMiddleware, services=services, max_body_bytes=settings.server.max_body_bytes)
    app.add_middleware(DrainMiddleware, drain=services.drain)  # refuses before auth reads a body
    app.add_middleware(MetricsMiddleware)  # outermost: counts every answer, 401s and 503s included
    for module in ROUTERS:
        app.include_router(module.router)
    return app


#: the route modules, in the order their routers are included
ROUTERS = (
    health,
    models,
    chat,
    completions,
    messages,
    tinker,
    signals,
    learning,
    admin,
    observability,
    console,
    console_actions,
)


def _services(settings: GatewaySettings) -> GatewayServices:
    """The services known before start-up (API keys, auth mode, drain, console logins); the lifespan fills in
    the rest. Raises: BadRequestError (a public bind without keys, unless ``allow_open``)."""
    keys = KeyStore(settings.home)
    # refuses a public bind without keys (BadRequestError) unless allow_open; see livelora.gateway.middleware.auth
    services = GatewayServices(
        settings,
        keys,
        check_bind(settings.server.host, keys, settings.server.allow_open),
        drain=Drain(settings.server.drain_grace_s, settings.inference.retry_after_s),
    )
    services.console = ConsoleLogins(settings.home, keys, lambda: services.auth_open)
    if services.auth_open:
        log.warning(
            "no API keys in %s: the gateway runs OPEN (every caller is tenant 'default' with every "
            "role); create one with `livelora keys create --home %s`",
            settings.home,
            settings.home,
        )
    return services


def _lifespan(
    settings: GatewaySettings, services: GatewayServices, engine: Engine | None, components: Sequence[Component]
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: engine → admission → live loop → metering → serving → training sessions →
    ``components`` into ``services`` at start-up, closed the other way at shutdown (the engine only when
    ``engine`` is ``None`` and the lifespan built it)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own = engine is None
        served = build_engine(settings) if own else engine
        await served.start()
        services.engine = served
        services.admission = Admission(settings)
        log.info("serving %s with the %s engine", settings.model_id, settings.inference.engine)
        live = await start_live_loop(settings, served)  # completion log, signals, adapter registry
        services.registry, services.completions, services.signals = live.registry, live.completions, live.signals
        services.learning = live.learning
        services.metering = metering = MeteringService(settings)
        await metering.start()
        services.serving = Serving(
            served, settings, services.admission, live.registry, live.completions, services.drain, metering
        )
        sessions = await start_sessions(settings, served, services.serving)  # training sessions (Tinker API)
        services.sessions = sessions
        try:
            async with AsyncExitStack() as stack:
                for component in components:
                    await stack.enter_async_context(component(services))
                yield
        finally:
            await live.close()
            await sessions.close()
            await metering.close()
            if own:
                await served.close()

    return lifespan
