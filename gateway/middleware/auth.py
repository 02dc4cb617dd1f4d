"""Who may call what: API keys → principal (tenant + roles), the route policy, body-size limits.

:class:`AuthMiddleware` (pure ASGI, installed by ``create_app``) runs before every route: body size (413), key
(``Authorization: Bearer`` or ``X-API-Key``, one key per request, else 400; under ``/console`` the console's
session cookie instead; 401), role by path (:data:`POLICY`, unlisted routes need ``admin``; 403), the principal
on ``request.state``, and the owner of every training-session id a Tinker body names (:func:`check_owner`; 404).
Each step's rules: ``docs/internals/tenancy.md``. Errors answer in the route's envelope (OpenAI's; Anthropic's on
the Messages API) through the app's one handler (:func:`error_response`).
"""

from __future__ import annotations

import ipaddress
import logging
import re
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from livelora.clients.errors import (
    AuthenticationError,
    BadRequestError,
    LiveloraError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
)
from livelora.core.api_keys import OPEN_PRINCIPAL, KeyStore, Principal
from livelora.core.object_ids import refs_of_request
from livelora.core.owners import OwnerStore
from livelora.core.redis_keys import KeyLayout
from livelora.gateway.json_text import json_body

if TYPE_CHECKING:
    from livelora.gateway.api.deps import GatewayServices

log = logging.getLogger(__name__)

PUBLIC = "public"
#: Role of routes any valid key may call, whatever its roles (``GET /api/v1/tokenizer``).
AUTHENTICATED = "authenticated"
#: Role of ``GET /metrics``: ``operator`` when ``LIVELORA_METRICS_REQUIRE_KEY`` is true (default), else public.
METRICS = "metrics"
#: (method or "*", path regex) → role; first match wins; anything unmatched needs ``admin``.
POLICY: list[tuple[str, re.Pattern[str], str]] = [
    ("GET", re.compile(r"/health"), PUBLIC),
    ("GET", re.compile(r"/metrics"), METRICS),
    ("GET", re.compile(r"/api/v1/healthz"), PUBLIC),
    ("GET", re.compile(r"/api/v1/checkpoint_archives/[^/]+"), PUBLIC),  # signed URL (HMAC): its own credential
    ("GET", re.compile(r"/api/v1/external_weights_files/[^/]+/[^/]+"), PUBLIC),  # signed URL, as above
    ("GET", re.compile(r"/api/v1/tokenizer"), AUTHENTICATED),
    ("GET", re.compile(r"/(docs|redoc|openapi\.json|docs/oauth2-redirect)"), PUBLIC),
    ("*", re.compile(r"/v1/(chat/completions|completions|models(/.*)?|messages(/count_tokens)?)"), "inference"),
    ("*", re.compile(r"/v1/(feedback|preferences|demonstrations|learning/.+)"), "feedback"),
    ("*", re.compile(r"/api/v1/.*"), "train"),
    ("*", re.compile(r"/admin(/.*)?"), "admin"),
    ("*", re.compile(r"/console/login"), PUBLIC),  # the log-in form and its POST (the key is in the form)
    ("GET", re.compile(r"/console/static/[^/]+"), PUBLIC),  # the console's own CSS and htmx
    ("*", re.compile(r"/console(/.*)?"), "admin"),  # the session cookie's key must hold the role
]
#: Paths whose credential is the console's session cookie, not a key header
# (:mod:`livelora.gateway.services.console.login`).
CONSOLE = re.compile(r"/console(/.*)?")


def required_role(method: str, path: str, *, metrics_key: bool = False) -> str:
    """The role a request needs (``"public"`` for none, ``"authenticated"`` for any valid key); unmatched paths
    need ``admin``; ``/metrics`` needs ``operator`` when ``metrics_key`` (``LIVELORA_METRICS_REQUIRE_KEY``), else
    nothing."""
    method = "GET" if method == "HEAD" else method
    for m, pattern, role in POLICY:
        if (m == "*" or m == method) and pattern.fullmatch(path):
            if role == METRICS:
                return "operator" if metrics_key else PUBLIC
            return role
    return "admin"


def app_routes(app) -> list[tuple[str, str]]:
    """Every ``(method, path template)`` the app serves, including routes of included routers (which
    FastAPI keeps as lazily resolved entries)."""
    out = []
    stack = list(app.routes)
    while stack:
        route = stack.pop(0)
        if hasattr(route, "effective_candidates"):
            stack[:0] = list(route.effective_candidates())
            continue
        for method in sorted(getattr(route, "methods", None) or ()):
            out.append((method, route.path))
    return out


def is_loopback(host: str) -> bool:
    """Whether ``host`` binds only to the loopback interface (``localhost``, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, keys: KeyStore, allow_open: bool) -> bool:
    """Decide the auth mode at start-up. Returns ``True`` for open mode (no keys).

    Raises:
        BadRequestError: no active key, a non-loopback ``host`` and not ``allow_open``.
    """
    if keys.active():
        return False
    if not is_loopback(host) and not allow_open:
        raise BadRequestError(
            f"refusing to serve on {host} without API keys: anyone who can reach it could use and retrain "
            "the model. Create a key first (`livelora keys create --tenant default --roles "
            "inference,feedback,train,admin --home <store>`), bind to 127.0.0.1, or pass --allow-open "
            "(LIVELORA_ALLOW_OPEN=1) to run open on purpose.",
            param="host",
        )
    return True


#: Host names that address this machine's loopback interface (``Host`` values an open gateway answers).
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})


def bearer_key(headers: dict[str, str]) -> str | None:
    """The key from ``Authorization: Bearer`` or ``X-API-Key`` (``None`` if neither)."""
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return headers.get("x-api-key") or None


def check_one_credential(raw_headers: list[tuple[bytes, bytes]]) -> None:
    """A request names at most one key: ``Authorization`` and ``X-API-Key`` each at most once, and when both are
    sent they carry the same key (a reader taking the first and one taking the last would see two callers).

    Raises:
        BadRequestError: 400, code ``ambiguous_credentials``, ``param`` the header.
    """
    seen: dict[bytes, int] = {}
    for name, _ in raw_headers:
        if name.lower() in (b"authorization", b"x-api-key"):
            seen[name.lower()] = seen.get(name.lower(), 0) + 1
    if not seen:
        return
    for name, count in seen.items():
        if count > 1:
            header = "Authorization" if name == b"authorization" else "X-API-Key"
            raise _ambiguous(f"the {header} header is sent {count} times; send one key, once", header)
    if len(seen) == 2:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw_headers}
        auth = headers["authorization"]
        bearer = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        if bearer is not None and bearer != headers["x-api-key"].strip():
            raise _ambiguous("Authorization and X-API-Key carry different keys; send one of them", "X-API-Key")


def _ambiguous(message: str, header: str) -> BadRequestError:
    return BadRequestError(
        f"ambiguous credentials: {message} (livelora refuses rather than pick one)",
        param=header,
        code="ambiguous_credentials",
    )


class AuthMiddleware:
    """ASGI middleware doing the five steps of the module docstring.

    Args:
        app: the inner ASGI app.
        services: the gateway's services (``keys``, ``auth_open``, ``settings``; ``sessions`` once started, whose
            Redis client holds session owners).
        max_body_bytes: request-body limit (bytes).
    """

    def __init__(self, app, services: GatewayServices, max_body_bytes: int):
        self.app = app
        self.services = services
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            principal = self.authenticate(scope)
            self.check_open_host(scope)
        except LiveloraError as err:
            return await _send_error(scope, send, err)
        state = scope.setdefault("state", {})
        state["principal"] = principal
        if principal is not None and not self.services.auth_open:
            state["caller"] = principal.tenant
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await _send_error(scope, send, _too_large(self.max_body_bytes))
        path = scope.get("path", "")
        tinker = path.startswith("/api/v1/") and principal is not None
        body = b""
        if tinker or scope.get("method") in ("POST", "PUT", "PATCH"):
            # read (and bound) the body here so a Tinker request can be checked for its session's owner
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > self.max_body_bytes:
                    return await _send_error(scope, send, _too_large(self.max_body_bytes))
            try:
                if tinker:  # decoded once; the owner check and the route both use this object
                    state["tinker_body"] = decoded = decode_tinker_body(path, body, headers, self.max_body_bytes)
                    await self.check_sessions(path, tinker_owner_fields(decoded), principal)
                else:
                    if headers.get("content-encoding", "identity").strip().lower() not in ("", "identity"):
                        raise BadRequestError(
                            f"unsupported Content-Encoding {headers['content-encoding']!r}: {path} takes an "
                            "uncompressed body (the Tinker routes, /api/v1/..., also take zstd and gzip)",
                            param="Content-Encoding",
                            code="unsupported_content_encoding",
                        )
                    json_body(body, headers.get("content-type"))
            except LiveloraError as err:
                return await _send_error(scope, send, err)
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    # -------------------------------------------------------------------------------- steps

    def check_open_host(self, scope) -> None:
        """In open mode on loopback, only a loopback ``Host`` (or ``LIVELORA_PUBLIC_URL``'s) reaches a route: a web
        page whose name was rebound to 127.0.0.1 (DNS rebinding) would otherwise drive the keyless API.

        Raises:
            BadRequestError: another ``Host`` (400, ``host_not_allowed``).
        """
        server = self.services.settings.server
        if not self.services.auth_open or server.allow_open:
            return
        host = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"host"), "")
        name = urlsplit(f"//{host}").hostname or ""
        public = urlsplit(server.public_url).hostname if server.public_url else None
        if name in LOOPBACK_NAMES or name.endswith(".localhost") or name == public:
            return
        raise BadRequestError(
            f"Host {host!r} is not this gateway's: without API keys it answers only requests addressed to "
            "127.0.0.1, localhost or [::1] (or LIVELORA_PUBLIC_URL), so that no web page can reach it through "
            "DNS rebinding; create an API key to serve other names",
            code="host_not_allowed",
        )

    def authenticate(self, scope) -> Principal | None:
        """The request's principal (``None`` for public routes without a key).

        Raises:
            BadRequestError: two keys in one request (:func:`check_one_credential`).
            AuthenticationError: missing, unknown or revoked key (401).
            PermissionDeniedError: the key lacks the route's role (403).
        """
        check_one_credential(scope.get("headers", []))
        services = self.services
        keys: KeyStore = services.keys
        if services.auth_open and keys.active():
            services.auth_open = False  # a key was created: key mode from now on, never back
            log.warning("API keys exist now: the gateway requires keys from here on")
        role = required_role(
            scope.get("method", "GET"),
            scope.get("path", ""),
            metrics_key=services.settings.observability.metrics_require_key,
        )
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if CONSOLE.fullmatch(scope.get("path", "")):
            return self.console_principal(scope, headers, role)
        if services.auth_open:
            return OPEN_PRINCIPAL
        key = bearer_key(headers)
        principal = keys.verify(key)
        if role == PUBLIC:
            return principal
        if principal is None:
            raise AuthenticationError(
                "missing API key: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'"
                if not key
                else "invalid or revoked API key"
            )
        if role != AUTHENTICATED and role not in principal.roles:
            raise PermissionDeniedError(
                f"this key (tenant {principal.tenant!r}, roles "
                f"{', '.join(sorted(principal.roles))}) lacks the {role!r} role needed "
                f"for {scope.get('method')} {scope.get('path')}"
            )
        return principal

    def console_principal(self, scope, headers: dict[str, str], role: str) -> Principal | None:
        """The caller of a ``/console`` request: the key of its session cookie, as the key store says now (open
        mode too: a console action needs the session's CSRF token). Public console paths need none.

        Raises:
            AuthenticationError: no valid session (401; a browser is sent to the log-in page instead).
            PermissionDeniedError: the session's key lacks the route's role (403).
        """
        from starlette.requests import cookie_parser

        from livelora.gateway.services.console.login import COOKIE

        token = cookie_parser(headers.get("cookie", "")).get(COOKIE)
        logins = self.services.console
        principal = logins.principal(token) if logins is not None and token else None
        if role == PUBLIC:
            return principal
        if principal is None:
            raise AuthenticationError(
                "no console session (or it expired, was ended, or its key was revoked): log in at /console/login"
            )
        if role != AUTHENTICATED and role not in principal.roles:
            raise PermissionDeniedError(
                f"this key (tenant {principal.tenant!r}) lacks the {role!r} role needed for {scope.get('path')}"
            )
        return principal

    async def check_sessions(self, path: str, data: object, principal: Principal) -> None:
        """Every id a Tinker request names (path parameters and body fields, :mod:`livelora.core.object_ids`)
        must be in its one spelling (else 400) and belong to the caller's tenant (else 404, the same as a
        missing object: :func:`check_owner`).

        Raises:
            NotFoundError: a missing or another tenant's session (and so its models, samplers, requests, paths).
            BadRequestError: an id in another spelling.
        """
        for ref in refs_of_request(path[len("/api/v1/") :], data):
            if ref.session is not None:
                check_owner(self.services.settings.home, "session", ref.session, principal.tenant)
            else:  # an ad-hoc sample's request id: the future's own owner record
                redis = getattr(self.services.sessions, "redis", None)
                key = KeyLayout(self.services.settings.redis_prefix).request_owner(ref.text)
                owner = await redis.get(key) if redis is not None else None
                if owner is None or (owner.decode() if isinstance(owner, bytes) else owner) != principal.tenant:
                    raise NotFoundError(f"request {ref.text!r} does not exist", param="request_id")


def check_owner(home, kind: str, name: str, tenant: str) -> None:
    """The one owner check of the gateway: ``tenant`` owns ``kind`` ``name``
    (:meth:`livelora.core.owners.OwnerStore.check`: deny by default, one 404 for missing and foreign).

    Raises:
        NotFoundError: no owner record, or another tenant's.
    """
    OwnerStore(home).check(kind, name, tenant)


def decode_tinker_body(path: str, body: bytes, headers: dict[str, str], max_bytes: int):
    """The body of a Tinker request, decoded once (:func:`livelora.gateway.api.tinker_wire.body.decode_body`)."""
    from livelora.gateway.api.tinker_wire.body import decode_body  # the codec lives with the Tinker routes

    return decode_body(path, body, headers.get("content-type"), headers.get("content-encoding"), max_bytes=max_bytes)


def tinker_owner_fields(decoded) -> dict:
    from livelora.gateway.api.tinker_wire.body import owner_fields

    return owner_fields(decoded)


def _too_large(limit: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"request body is larger than the limit of {limit} bytes (LIVELORA_MAX_BODY_BYTES)")


def _replay(body: bytes, receive):
    sent = {"done": False}

    async def replay():
        if not sent["done"]:
            sent["done"] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_error(scope, send, err: LiveloraError) -> None:
    from livelora.gateway.api.errors import error_response

    response = error_response(err, scope.get("path"))
    path = scope.get("path", "")
    if isinstance(err, AuthenticationError) and CONSOLE.fullmatch(path) and path != "/console/login":
        response = _console_login_redirect(scope, path) or response
    if isinstance(err, AuthenticationError):
        response.headers["WWW-Authenticate"] = 'Bearer realm="livelora"'
    await response(scope, _noop_receive, send)


def _console_login_redirect(scope, path: str):
    """A browser without a console session goes to the log-in page (htmx: ``HX-Redirect``); other clients get
    the 401 envelope."""
    from urllib.parse import quote

    from starlette.responses import RedirectResponse, Response

    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    target = "/console/login?next=" + quote(path)
    if headers.get("hx-request"):
        return Response(status_code=401, headers={"HX-Redirect": target})
    if scope.get("method") == "GET" and "text/html" in headers.get("accept", ""):
        return RedirectResponse(target, status_code=303)
    return None


async def _noop_receive():
    return {"type": "http.disconnect"}
