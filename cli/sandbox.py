"""``livelora sandbox``: SandboxFusion's ``POST /run_code`` over :class:`~livelora.clients.sandbox.Sandbox`.

Any SandboxFusion client (tinker-cookbook's ``SandboxFusionClient`` with ``SANDBOX_URL``, the code-rl recipe's
``--sandbox-url``) works against it unchanged. Program outcomes are HTTP 200 (``Success`` / ``Failed`` /
``SandboxError``); a malformed body is 400 in the OpenAI error envelope. Runs go to a pool of
``max_concurrency`` threads. docs/code-rl.md describes the isolation and the limits.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from livelora.clients.sandbox import IsolationUnavailableError, Limits, Sandbox
from livelora.clients.sandbox.fusion import RunCodeRequest, RunCodeResponse, run_request


def _bad_request(message: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}
    return JSONResponse(body, status_code=400)


def create_sandbox_app(sandbox: Sandbox, max_concurrency: int = 2) -> FastAPI:
    """The FastAPI app: ``POST /run_code``, ``GET /v1/ping`` (``pong``, as SandboxFusion) and ``GET /health``
    (whether runs are isolated)."""
    app = FastAPI(title="livelora sandbox")
    slots = asyncio.Semaphore(max_concurrency)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"] if p != "body")
        return _bad_request(f"{where}: {err['msg'].removeprefix('Value error, ')}", where or None)

    @app.post("/run_code", response_model=RunCodeResponse)
    async def run_code(req: RunCodeRequest) -> RunCodeResponse | JSONResponse:
        async with slots:
            try:
                return await run_in_threadpool(run_request, sandbox, req)
            except ValueError as exc:
                return _bad_request(str(exc), "files")

    @app.get("/v1/ping")
    async def ping() -> str:
        return "pong"

    @app.get("/health")
    async def health() -> dict:
        return {"isolated": sandbox.isolated, "why_not": sandbox.why_not_isolated, "limits": vars(sandbox.limits)}

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
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Serve SandboxFusion's POST /run_code (Python) on a bubblewrap sandbox: no network, a private work
    directory, a read-only system, limits on CPU, wall time, memory, processes and output."""
    import uvicorn

    limits = Limits(
        wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb, max_processes=max_processes, max_output_bytes=max_output_bytes
    )
    try:
        box = Sandbox(limits, require_isolation=require_isolation)
    except IsolationUnavailableError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"sandbox: isolated={box.isolated} on http://{host}:{port}/run_code", err=True)
    uvicorn.run(create_sandbox_app(box, max_concurrency), host=host, port=port, log_level=log_level)
