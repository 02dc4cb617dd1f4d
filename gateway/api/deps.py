"""What the route handlers depend on: one :class:`GatewayServices` per app, and ``Annotated`` aliases for it.

This is the only module that knows where the gateway keeps its services on the FastAPI app (``app.state``);
handlers take typed dependencies (``serving: ServingDep``), the process wiring and tests use
:func:`services_of`. ``create_app`` makes the services object with what exists before start-up (settings,
key store, auth mode) and its lifespan fills in the rest (engine, serving, live loop, sessions), so nothing is
created at import time.

Example::

    @router.get("/v1/models")
    async def get_models(serving: ServingDep) -> ModelList:
        return ModelList(data=serving.list_models())
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated

from fastapi import Depends, FastAPI, Request

from livelora.adapters.kept_versions import AdapterVersions
from livelora.adapters.segments import HEADER_VALUE_RE
from livelora.clients.errors import BadRequestError, InternalError, UnavailableError
from livelora.core.api_keys import OPEN_PRINCIPAL, KeyStore, Principal
from livelora.core.quotas import Limits
from livelora.gateway.engines.base import Engine
from livelora.gateway.middleware.drain import Drain
from livelora.gateway.services.console.login import ConsoleLogins
from livelora.gateway.services.console.views import ConsoleContext
from livelora.gateway.services.live.completion_log import CompletionLog
from livelora.gateway.services.live.learning import LearningService
from livelora.gateway.services.live.registry import AdapterRegistry
from livelora.gateway.services.live.segments import SEGMENT_HEADER
from livelora.gateway.services.live.signals import SignalService
from livelora.gateway.services.serving.admission import Admission
from livelora.gateway.services.serving.serve import Serving
from livelora.gateway.services.serving.token_texts import TokenTexts
from livelora.gateway.services.sessions import Checkpoints, Samples, SamplingSessions, SessionService, TrainingOps
from livelora.gateway.services.tenants.admin import GatewayAdmin
from livelora.gateway.services.tenants.usage import MeteringService
from livelora.gateway.settings import GatewaySettings


@dataclass
class GatewayServices:
    """Everything a gateway app serves with. ``settings``, ``keys`` and ``auth_open`` exist from
    ``create_app`` on; the rest is set while the app runs (``None`` before start-up and without the live loop).

    Attributes:
        settings: the gateway settings.
        keys: the API key store (``keys.json`` in the store).
        auth_open: open mode (no keys yet: every caller is tenant ``default`` with every role); it turns
            ``False`` for good once a key exists (:mod:`livelora.gateway.middleware.auth`).
        engine: the started engine.
        admission: the sequence bound (429 beyond it).
        serving: target resolution, models, the start of every served request.
        registry: endpoints → adapter versions (live loop).
        completions: the completion log (live loop).
        signals: ratings, preferences, demonstrations (live loop).
        sessions: the Tinker training-session service.
        drain: the graceful-drain state (set by the process wiring on SIGTERM/SIGINT).
        metering: token counters and the usage report.
        learning: the learning status of endpoints (live loop).
        console: the admin console's log-ins (sessions, CSRF tokens).
    """

    settings: GatewaySettings
    keys: KeyStore
    auth_open: bool
    engine: Engine | None = None
    admission: Admission | None = None
    serving: Serving | None = None
    registry: AdapterRegistry | None = None
    completions: CompletionLog | None = None
    signals: SignalService | None = None
    sessions: SessionService | None = None
    drain: Drain | None = None
    metering: MeteringService | None = None
    learning: LearningService | None = None
    console: ConsoleLogins | None = None


def attach(app: FastAPI, services: GatewayServices) -> None:
    """Give ``app`` its services (called once, by ``create_app``)."""
    app.state.services = services


def services_of(app: FastAPI) -> GatewayServices:
    """The services of an app made by ``create_app`` (for the process wiring and tests)."""
    return app.state.services


def get_services(request: Request) -> GatewayServices:
    return services_of(request.app)


ServicesDep = Annotated[GatewayServices, Depends(get_services)]


def get_serving(services: ServicesDep) -> Serving:
    return services.serving


def get_token_texts(services: ServicesDep) -> TokenTexts:
    return services.serving.texts


def get_principal(request: Request) -> Principal:
    """The caller, as auth identified it (open mode: :data:`~livelora.core.api_keys.OPEN_PRINCIPAL`), with the
    ``X-Livelora-Segment`` header's value.

    Raises:
        BadRequestError: a header value outside ``[A-Za-z0-9._-]{1,64}``.
    """
    principal = getattr(request.state, "principal", None) or OPEN_PRINCIPAL
    header = request.headers.get(SEGMENT_HEADER)
    if header is None:
        return principal
    if not HEADER_VALUE_RE.fullmatch(header):
        raise BadRequestError(
            f"invalid {SEGMENT_HEADER} header: use 1-64 characters of A-Z, a-z, 0-9, '.', '_', '-'",
            param=SEGMENT_HEADER,
        )
    return replace(principal, segment=header)


async def tinker_body(request: Request):
    """The Tinker request's body as the auth middleware decoded it, once, and checked for its owner
    (:mod:`livelora.gateway.api.tinker_wire.body`); decoded here by the same function when auth did not run."""
    decoded = getattr(request.state, "tinker_body", None)
    if decoded is None:
        from livelora.gateway.api.tinker_wire.body import decode_body

        h = request.headers
        decoded = decode_body(request.url.path, await request.body(), h.get("content-type"), h.get("content-encoding"))
    return decoded


def get_public_url(request: Request, services: ServicesDep) -> str:
    """Base of the URLs the gateway hands out (signed downloads): ``LIVELORA_PUBLIC_URL``, else the server's own
    address the connection arrived on (the ASGI ``server`` of the accepted socket), never the ``Host`` header."""
    configured = services.settings.server.public_url
    if configured:
        return configured.rstrip("/")
    host, port = request.scope.get("server") or (services.settings.server.host, services.settings.server.port)
    host = f"[{host}]" if ":" in str(host) else host
    return f"http://{host}:{port}"


def get_caller(request: Request) -> str | None:
    """The caller's tenant in key mode, ``None`` in open mode: completions and signals are kept per caller."""
    return getattr(request.state, "caller", None)


def get_signal_service(services: ServicesDep) -> SignalService:
    if services.signals is None:  # wiring bug, not the client's fault
        raise InternalError("signal routes are mounted without a signal service")
    return services.signals


def get_learning(services: ServicesDep) -> LearningService:
    if services.learning is None:
        raise UnavailableError("the learning status is not available (the gateway is starting or stopping)")
    return services.learning


def get_sessions(services: ServicesDep) -> SessionService:
    if services.sessions is None:
        raise UnavailableError("training sessions are not available (the gateway is starting or stopping)")
    return services.sessions


def get_training_ops(sessions: Annotated[SessionService, Depends(get_sessions)]) -> TrainingOps:
    return sessions.ops


def get_checkpoints(sessions: Annotated[SessionService, Depends(get_sessions)]) -> Checkpoints:
    return sessions.checkpoints


def get_sampling_sessions(sessions: Annotated[SessionService, Depends(get_sessions)]) -> SamplingSessions:
    return sessions.sampling


def get_samples(sessions: Annotated[SessionService, Depends(get_sessions)]) -> Samples:
    return sessions.samples


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def get_metering(services: ServicesDep) -> MeteringService:
    if services.metering is None:
        raise UnavailableError("usage metering is not available (the gateway is starting or stopping)")
    return services.metering


def get_auth_open(services: ServicesDep) -> bool:
    """Whether the gateway runs open (no API keys): every caller sees every tenant."""
    return services.auth_open


def get_admin(services: ServicesDep, principal: PrincipalDep) -> GatewayAdmin:
    m, settings = services.metering, services.settings
    if m is not None:
        versions = m.quotas.versions
    else:
        versions = AdapterVersions(settings.home, Limits.from_settings(settings.quotas))
    return GatewayAdmin(services.settings.home, principal, services.registry, versions=versions)


def get_console_logins(services: ServicesDep) -> ConsoleLogins:
    if services.console is None:  # wiring bug
        raise InternalError("console routes are mounted without console log-ins")
    return services.console


#: Console pages on which the operator reads every tenant's objects (read-only).
OPERATOR_PAGES = ("/console/endpoints", "/console/lineages", "/console/versions", "/console/charts")


def get_console(
    request: Request,
    services: ServicesDep,
    principal: PrincipalDep,
    admin: Annotated[GatewayAdmin, Depends(get_admin)],
    public_url: Annotated[str, Depends(get_public_url)],
) -> ConsoleContext:
    """What one console page reads with (the caller's ``/admin`` service and the services it shows). The
    operator's endpoint, version and chart pages (``GET``) read every tenant's; its feedback page (end users' ids)
    and its changes stay in its own tenant."""
    if "operator" in principal.roles and request.method == "GET" and request.url.path.startswith(OPERATOR_PAGES):
        admin = GatewayAdmin(services.settings.home, principal, services.registry, every_tenant=True)
    return ConsoleContext(
        admin=admin,
        principal=principal,
        learning=services.learning,
        canary_share=services.settings.live.canary_share,
        texts=services.serving.texts if services.serving is not None else None,
        sessions=services.sessions,
        metering=services.metering,
        open_mode=services.auth_open,
        public_url=public_url,
    )


ServingDep = Annotated[Serving, Depends(get_serving)]
TokenTextsDep = Annotated[TokenTexts, Depends(get_token_texts)]
CallerDep = Annotated[str | None, Depends(get_caller)]
SignalsDep = Annotated[SignalService, Depends(get_signal_service)]
LearningDep = Annotated[LearningService, Depends(get_learning)]
SessionsDep = Annotated[SessionService, Depends(get_sessions)]
TrainingOpsDep = Annotated[TrainingOps, Depends(get_training_ops)]
CheckpointsDep = Annotated[Checkpoints, Depends(get_checkpoints)]
SamplingDep = Annotated[SamplingSessions, Depends(get_sampling_sessions)]
SamplesDep = Annotated[Samples, Depends(get_samples)]
AdminDep = Annotated[GatewayAdmin, Depends(get_admin)]
MeteringDep = Annotated[MeteringService, Depends(get_metering)]
AuthOpenDep = Annotated[bool, Depends(get_auth_open)]
PublicUrlDep = Annotated[str, Depends(get_public_url)]
ConsoleLoginsDep = Annotated[ConsoleLogins, Depends(get_console_logins)]
ConsoleDep = Annotated[ConsoleContext, Depends(get_console)]
