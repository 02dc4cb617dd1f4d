"""The gateway's FastAPI application factory.

Example::

    from livelora.gateway.app import create_app
    from livelora.gateway.settings import GatewaySettings

    app = create_app(GatewaySettings(model="smollm2-135m-instruct"))
    # uvicorn.run(app, host="127.0.0.1", port=8000)

Nothing is created at import: the engine is built and started in the app's
lifespan (unless one is passed in), and closed when the app stops (only if the
app created it). Routes read their resources from ``app.state`` through the
aliases in :mod:`livelora.gateway.api.deps`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from livelora.adapters.keys import KeyStore
from livelora.gateway.api import admin, chat, completions, health, models, signals, tinker
from livelora.gateway.api.errors import install_error_handlers
from livelora.gateway.api.logprobs import TokenTexts
from livelora.gateway.api.serving import Admission
from livelora.gateway.auth import AuthMiddleware, check_bind
from livelora.gateway.engines.base import Engine
from livelora.gateway.settings import GatewaySettings

log = logging.getLogger(__name__)


def build_engine(settings: GatewaySettings) -> Engine:
    """The engine of kind ``settings.engine`` for ``settings.model`` (not started).

    Raises:
        BadRequestError: unknown engine kind (raised by the engine factory).
        ModelNotFoundError: the base model cannot be resolved.
    """
    from livelora.gateway.engines import create_engine

    device = settings.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    kwargs = {"model": settings.model, "home": settings.home, "device": device, "dtype": settings.dtype,
              "max_batch_size": settings.max_batch_size,
              # the gateway's Admission bounds sequences (429); the engine's own queue must hold them all
              "max_waiting": settings.max_sequences,
              "max_model_len": settings.max_model_len}
    return create_engine(settings.engine, **kwargs)


def create_app(settings: GatewaySettings | None = None, engine: Engine | None = None) -> FastAPI:
    """Build the gateway app.

    Args:
        settings: gateway settings (default: from the environment).
        engine: an engine to serve with (started in lifespan if needed, never closed by the
            app); ``None`` builds one from ``settings`` in lifespan and closes it on shutdown.
    """
    settings = settings or GatewaySettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own = engine is None
        served = build_engine(settings) if own else engine
        await served.start()
        app.state.engine = served
        app.state.admission = Admission(settings)
        app.state.token_texts = TokenTexts(served.tokenizer)
        log.info("serving %s with the %s engine", settings.model_id, settings.engine)
        from livelora.gateway.sessions import start_sessions  # training sessions (Tinker API, op executor)

        sessions = await start_sessions(app, settings, served, app.state.admission)
        from livelora.gateway.live import start_live_loop  # completion log, signal routes, adapter registry

        live = await start_live_loop(app, settings, served)
        try:
            yield
        finally:
            await live.close()
            await sessions.close()
            if own:
                await served.close()

    app = FastAPI(title="livelora", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible gateway whose LoRA adapter keeps learning while it serves.")
    app.state.settings = settings
    app.state.keys = KeyStore(settings.home)
    # refuses a public bind without keys (BadRequestError) unless allow_open; see livelora.gateway.auth
    app.state.auth_open = check_bind(settings.host, app.state.keys, settings.allow_open)
    if app.state.auth_open:
        log.warning("no API keys in %s: the gateway runs OPEN (every caller is tenant 'default' with every "
                    "role); create one with `livelora keys create`", settings.home)
    install_error_handlers(app)
    app.add_middleware(AuthMiddleware, fastapi_app=app, max_body_bytes=settings.max_body_bytes)
    for module in (health, models, chat, completions, tinker, signals, admin):
        app.include_router(module.router)
    return app
