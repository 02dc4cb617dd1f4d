"""``livelora sandbox``: SandboxFusion's ``POST /run_code`` over :class:`~livelora.clients.sandbox.Sandbox`.

Any SandboxFusion client (tinker-cookbook's ``SandboxFusionClient`` with ``SANDBOX_URL``, the code-rl recipe's
``--sandbox-url``) works against it unchanged. Program outcomes are HTTP 200 (``Success`` / ``Failed`` /
``SandboxError``); a malformed body is 400 in the OpenAI error envelope. Every request's ``Host`` must be on
the allow-list (else 421) and, with an API key, carry ``Authorization: Bearer KEY`` (else 401); binding beyond
loopback needs a key. Runs go to a pool of ``max_concurrency`` threads. docs/code-rl.md: isolation, limits, access.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import socket
from typing import Annotated

import typer
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from livelora.clients.sandbox import IsolationUnavailableError, Limits, Sandbox
from livelora.clients.sandbox.fusion import API_KEY_ENV, RunCodeRequest, RunCodeResponse, run_request

log = logging.getLogger("livelora.sandbox")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def _error(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error", code=None):
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def _bad_request(message: str, param: str | None = None) -> JSONResponse:
    return _error(400, message, param)


def _host_name(header: str) -> str:
    """The name of a ``Host`` header without its port, lower case (``[::1]:8080`` → ``::1``)."""
    name = header.strip().lower()
    if name.startswith("["):
        return name[1 : name.find("]")] if "]" in name else name
    head, sep, port = name.rpartition(":")
    return head if sep and port.isdigit() and ":" not in head else name


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` listens on loopback interfaces only (a name counts when all it resolves to is)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)


def allowed_hosts(bind: str, extra: list[str] | None = None) -> set[str]:
    """The ``Host`` names answered: loopback names, the bound host (unless a wildcard) and ``extra``."""
    names = {*LOOPBACK_NAMES, *(_host_name(h) for h in extra or [])}
    if bind not in ("0.0.0.0", "::", ""):
        names.add(_host_name(bind) if not bind.count(":") > 1 else bind.lower())
    return names


def _refusal(request: Request, hosts: set[str], expected: bytes | None) -> JSONResponse | None:
    """The error answered instead of running ``request``, or ``None`` to let it through: 421 for a ``Host`` not
    in ``hosts`` (or none, or several); with an API key (``expected``: ``b"Bearer KEY"``), on every route but
    ``/v1/ping``, 400 for several ``Authorization`` headers and 401 for a missing or wrong one."""
    host = request.headers.getlist("host")
    if len(host) != 1 or _host_name(host[0]) not in hosts:
        shown = ", ".join(host) or "none"
        return _error(
            421,
            f"Host {shown!r} is not served here (allowed: {', '.join(sorted(hosts))}; "
            "livelora sandbox --allow-host NAME adds one)",
            code="host_not_allowed",
        )
    if expected is not None and request.url.path != "/v1/ping":
        given = request.headers.getlist("authorization")
        if len(given) > 1:
            return _error(400, "send one Authorization header", "authorization")
        if not given or not hmac.compare_digest(given[0].encode(), expected):
            return _error(
                401,
                "missing or wrong API key (Authorization: Bearer KEY)",
                None,
                "authentication_error",
                "invalid_api_key",
            )
    return None


def create_sandbox_app(
    sandbox: Sandbox, max_concurrency: int = 2, *, api_key: str | None = None, hosts: set[str] | None = None
) -> FastAPI:
    """The FastAPI app: ``POST /run_code``, ``GET /v1/ping`` (``pong``, as SandboxFusion) and ``GET /health``
    (whether runs are isolated, the limits, runs started). ``hosts``: the allowed ``Host`` names (default: the
    loopback names); ``api_key``: required as ``Authorization: Bearer`` on every route but ``/v1/ping``."""
    app = FastAPI(title="livelora sandbox")
    slots = asyncio.Semaphore(max_concurrency)
    hosts = hosts or set(LOOPBACK_NAMES)
    expected = f"Bearer {api_key}".encode() if api_key else None

    @app.middleware("http")
    async def _access(request: Request, call_next):
        refused = _refusal(request, hosts, expected)
        return refused if refused is not None else await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"] if p != "body")
        return _bad_request(f"{where}: {err['msg'].removeprefix('Value error, ')}", where or None)

    runs = {"started": 0}

    @app.post("/run_code", response_model=RunCodeResponse)
    async def run_code(req: RunCodeRequest) -> RunCodeResponse | JSONResponse:
        async with slots:
            runs["started"] += 1
            try:
                return await run_in_threadpool(run_request, sandbox, req)
            except ValueError as exc:
                return _bad_request(str(exc), "files")

    @app.get("/v1/ping")
    async def ping() -> str:
        return "pong"

    @app.get("/health")
    async def health() -> dict:
        limits = vars(sandbox.limits)
        return {
            "isolated": sandbox.isolated,
            "why_not": sandbox.why_not_isolated,
            "limits": limits,
            "runs": runs["started"],
        }

    return app


def sandbox(
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (SandboxFusion's default 8080).")] = 8080,
    wall_s: Annotated[
        float,
        typer.Option(
            envvar="LIVELORA_SANDBOX_WALL_S",
            help="Most wall seconds a run may take (a request's run_timeout is capped by it).",
        ),
    ] = 30.0,
    cpu_s: Annotated[float, typer.Option(envvar="LIVELORA_SANDBOX_CPU_S", help="CPU seconds per process.")] = 30.0,
    memory_mb: Annotated[
        int, typer.Option(envvar="LIVELORA_SANDBOX_MEMORY_MB", help="Address space per process (MiB).")
    ] = 512,
    max_processes: Annotated[
        int, typer.Option(envvar="LIVELORA_SANDBOX_MAX_PROCESSES", help="Processes and threads per run.")
    ] = 32,
    max_output_bytes: Annotated[
        int, typer.Option(envvar="LIVELORA_SANDBOX_MAX_OUTPUT_BYTES", help="stdout and stderr each are cut there.")
    ] = 1_000_000,
    max_concurrency: Annotated[int, typer.Option(envvar="LIVELORA_SANDBOX_MAX_CONCURRENCY", help="Runs at once.")] = 2,
    require_isolation: Annotated[
        bool,
        typer.Option(
            "--require-isolation/--allow-unisolated",
            envvar="LIVELORA_SANDBOX_REQUIRE_ISOLATION",
            help="Refuse to start without working bubblewrap (else: rlimited subprocesses, loud warning).",
        ),
    ] = False,
    work_mb: Annotated[
        int, typer.Option(envvar="LIVELORA_SANDBOX_WORK_MB", help="Work directory total, MiB (tmpfs: RAM).")
    ] = 256,
    tmp_mb: Annotated[int, typer.Option(envvar="LIVELORA_SANDBOX_TMP_MB", help="Private /tmp, MiB (tmpfs).")] = 64,
    shm_mb: Annotated[int, typer.Option(envvar="LIVELORA_SANDBOX_SHM_MB", help="Private /dev/shm, MiB (tmpfs).")] = 64,
    max_file_mb: Annotated[
        int, typer.Option(envvar="LIVELORA_SANDBOX_MAX_FILE_MB", help="Largest file a run writes or is given, MiB.")
    ] = 16,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar=API_KEY_ENV,
            help="Require 'Authorization: Bearer KEY' (required when --host is not loopback).",
        ),
    ] = None,
    allow_host: Annotated[
        list[str] | None,
        typer.Option(help="A Host header name to answer besides localhost, 127.0.0.1, [::1] and --host (repeat)."),
    ] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Serve SandboxFusion's POST /run_code (Python) on a bubblewrap sandbox: no network, a private work
    directory, a read-only system, limits on CPU, wall time, memory, processes and output."""
    import uvicorn

    loopback = is_loopback(host)
    if not loopback and not api_key:
        typer.echo(
            f"error: --host {host} is not a loopback interface: anyone who reaches it could run code. Set an API key "
            "(--api-key or LIVELORA_SANDBOX_API_KEY; clients send it from LIVELORA_SANDBOX_API_KEY) or bind 127.0.0.1",
            err=True,
        )
        raise typer.Exit(2)
    limits = Limits(
        wall_s=wall_s,
        cpu_s=cpu_s,
        memory_mb=memory_mb,
        max_processes=max_processes,
        max_output_bytes=max_output_bytes,
        max_file_mb=max_file_mb,
        work_mb=work_mb,
        tmp_mb=tmp_mb,
        shm_mb=shm_mb,
    )
    try:
        box = Sandbox(limits, require_isolation=require_isolation)
    except IsolationUnavailableError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    hosts = allowed_hosts(host, allow_host)
    if not loopback:
        log.warning("livelora sandbox binds %s, beyond loopback: only requests with the API key run code", host)
    typer.echo(f"sandbox: isolated={box.isolated} on http://{host}:{port}/run_code, Host in {sorted(hosts)}", err=True)
    app = create_sandbox_app(box, max_concurrency, api_key=api_key, hosts=hosts)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
