"""SandboxFusion's ``POST /run_code`` wire shapes, their mapping to :class:`RunResult`, and a small client.

Request: ``code``, ``language`` (only ``python`` / ``python3`` here), ``run_timeout`` / ``compile_timeout``
(seconds), ``memory_limit_MB`` (−1: the server's default), ``stdin``, ``files`` (name → base64, written next to the
program), ``fetch_files`` (names returned after the run). Response (HTTP 200 for every program outcome):
``status`` ``Success`` (exit 0) / ``Failed`` (non-zero exit, timeout, killed) / ``SandboxError`` (the sandbox
failed, ``message``), ``run_result`` ``{status: Finished | TimeLimitExceeded | Error, execution_time,
return_code, stdout, stderr}``, ``files``. docs/code-rl.md lists the fields.
"""

from __future__ import annotations

import base64
import binascii
import os
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator

from livelora.clients.sandbox.runner import Limits, RunResult, Sandbox, with_limits

LANGUAGES = ("python", "python3")
#: The environment variable holding ``livelora sandbox``'s API key, on the server and in :class:`FusionClient`.
API_KEY_ENV = "LIVELORA_SANDBOX_API_KEY"


class RunCodeRequest(BaseModel):
    """The body of ``POST /run_code`` (unknown fields are ignored, as SandboxFusion's clients send extra ones)."""

    model_config = ConfigDict(extra="ignore")

    code: str
    language: str = "python"
    run_timeout: float | None = Field(None, description="seconds (None: the server's wall limit)")
    compile_timeout: float | None = None
    memory_limit_MB: int = -1
    stdin: str | None = None
    files: dict[str, str] = Field(default_factory=dict, description="name -> base64 content")
    fetch_files: list[str] = Field(default_factory=list)

    @field_validator("language")
    @classmethod
    def _python_only(cls, v: str) -> str:
        if v not in LANGUAGES:
            raise ValueError(f"language {v!r} is not supported: this sandbox runs python only")
        return v

    def decoded_files(self) -> dict[str, bytes]:
        """``files`` as bytes. Raises: ValueError naming a file that is not valid base64."""
        out = {}
        for name, text in self.files.items():
            try:
                out[name] = base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ValueError(f"files[{name!r}] is not valid base64: {exc}") from None
        return out


class RunResultWire(BaseModel):
    status: Literal["Finished", "TimeLimitExceeded", "Error"]
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    status: Literal["Success", "Failed", "SandboxError"]
    message: str = ""
    compile_result: RunResultWire | None = None
    run_result: RunResultWire | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


def to_wire(result: RunResult) -> RunCodeResponse:
    """A :class:`RunResult` in SandboxFusion's shape (timeouts and cut output are ``Failed``, as a killed
    program is there)."""
    if result.status == "sandbox_error":
        return RunCodeResponse(status="SandboxError", message=result.message)
    run_status: Literal["Finished", "TimeLimitExceeded", "Error"] = (
        "Finished" if result.status == "finished" else "TimeLimitExceeded" if result.status == "timeout" else "Error"
    )
    return RunCodeResponse(
        status="Success" if result.ok else "Failed",
        message=result.message,
        run_result=RunResultWire(
            status=run_status,
            execution_time=round(result.wall_s, 4),
            return_code=result.exit_code,
            stdout=result.stdout,
            stderr=result.stderr,
        ),
        files={k: base64.b64encode(v).decode() for k, v in result.files.items()},
    )


def run_request(sandbox: Sandbox, req: RunCodeRequest, limits: Limits | None = None) -> RunCodeResponse:
    """Run one request on ``sandbox`` (its wall limit capped by ``limits.wall_s``). Raises: ValueError for bad
    files (names or base64)."""
    base = limits or sandbox.limits
    timeout = min(req.run_timeout, base.wall_s) if req.run_timeout and req.run_timeout > 0 else None
    lim = with_limits(base, wall_s=timeout, memory_mb=min(req.memory_limit_MB, base.memory_mb))
    result = sandbox.run(
        req.code, files=req.decoded_files(), stdin=req.stdin or "", limits=lim, fetch_files=req.fetch_files
    )
    return to_wire(result)


class FusionClient:
    """Calls a SandboxFusion-compatible ``/run_code`` URL (e.g. ``livelora sandbox``'s) and returns the
    :class:`RunCodeResponse`; sends ``Authorization: Bearer`` with ``api_key`` (default: ``$LIVELORA_SANDBOX_API_KEY``,
    none when unset). Raises: httpx.HTTPError on a non-200 answer or a transport failure."""

    def __init__(self, url: str, timeout_s: float = 120.0, api_key: str | None = None):
        self.url = url if url.rstrip("/").endswith("/run_code") else url.rstrip("/") + "/run_code"
        key = api_key or os.environ.get(API_KEY_ENV)
        self._http = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {key}"} if key else None)

    def run(self, code: str, *, files: dict[str, bytes] | None = None, run_timeout: float = 10.0, **extra: Any):
        body = {
            "code": code,
            "language": "python",
            "run_timeout": run_timeout,
            "files": {k: base64.b64encode(v).decode() for k, v in (files or {}).items()},
            **extra,
        }
        r = self._http.post(self.url, json=body)
        r.raise_for_status()
        return RunCodeResponse.model_validate(r.json())

    def close(self) -> None:
        self._http.close()
