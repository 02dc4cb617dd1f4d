"""Thin HTTP transport of the training-session SDK: one method per ``/api/v1`` endpoint, JSON in, JSON out.

No retries, ordering or polling here (those live in :mod:`.futures` and the clients). Every non-2xx
answer becomes the :mod:`livelora.clients.errors` class of its status (:func:`error_for_status`), except
``retrieve_future``'s 408 (not done yet), which :meth:`Transport.retrieve_future` returns as ``None``.
"""

from __future__ import annotations

import os
from typing import Any

import httpx

from livelora.clients.errors import UnavailableError, error_for_status

#: Seconds one ``retrieve_future`` long-poll may take (the server answers within 30 s by default).
POLL_TIMEOUT_S = 45.0
#: Environment variables read for the API key, in this order.
API_KEY_ENV = ("LIVELORA_API_KEY", "TINKER_API_KEY")
#: The key sent when none is configured: a placeholder an open livelora server (one with no keys) accepts.
OPEN_SERVER_KEY = "tml-local"


def configured_api_key(api_key: str | None = None) -> str | None:
    """``api_key``, else ``$LIVELORA_API_KEY``, else ``$TINKER_API_KEY``; ``None`` when none is set (empty values
    count as unset)."""
    return api_key or next((os.environ[v] for v in API_KEY_ENV if os.environ.get(v)), None)


class Transport:
    """HTTP calls to a livelora (or any Tinker-protocol) server.

    Args:
        base_url: server root, e.g. ``http://127.0.0.1:8000`` (routes are under ``/api/v1``).
        api_key: sent as ``X-API-Key``; ``None`` (no key configured) sends :data:`OPEN_SERVER_KEY`, which an open
            server accepts; a server with keys answers it 401, and the :class:`AuthenticationError` then says that
            no key was configured and names :data:`API_KEY_ENV`.
        timeout_s: timeout of ordinary calls (seconds).
    """

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float = 60.0):
        self.base_url = base_url.rstrip("/")
        self.key_configured = api_key is not None
        self._client = httpx.Client(
            base_url=self.base_url + "/api/v1",
            timeout=timeout_s,
            headers={"X-API-Key": api_key if api_key is not None else OPEN_SERVER_KEY, "Accept": "application/json"},
        )

    def close(self) -> None:
        self._client.close()

    # ------------------------------------------------------------------------------------------ plumbing
    def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
        ok: tuple[int, ...] = (),
    ) -> httpx.Response:
        try:
            kwargs: dict[str, Any] = {"json": body} if body is not None else {}
            if timeout is not None:
                kwargs["timeout"] = timeout
            response = self._client.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise UnavailableError(f"cannot reach {self.base_url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400 and response.status_code not in ok:
            raise self._error(response)
        return response

    def _error(self, response: httpx.Response):
        """:func:`_status_error`, with a 401 to an unconfigured key explained (the server only saw the placeholder)."""
        exc = _status_error(response)
        if response.status_code == 401 and not self.key_configured:
            exc.message = (
                f"no API key configured: the SDK sent the open-server placeholder {OPEN_SERVER_KEY!r}, and "
                f"{self.base_url} requires a key ({exc.message}); pass api_key= or set "
                f"{' or '.join(API_KEY_ENV)}"
            )
            exc.args = (exc.message,)
        return exc

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", path, body).json()

    # ------------------------------------------------------------------------------------------ endpoints
    def client_config(self, sdk_version: str) -> dict[str, Any]:
        return self._post("/client/config", {"sdk_version": sdk_version})

    def create_session(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._post("/create_session", body)

    def session_heartbeat(self, session_id: str) -> dict[str, Any]:
        return self._post("/session_heartbeat", {"session_id": session_id, "type": "session_heartbeat"})

    def finish_session(self, session_id: str, reason: str, detail: str | None) -> dict[str, Any]:
        return self._post(f"/sessions/{session_id}/finish", {"reason": {"type": reason}, "detail": detail})

    def create_model(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._post("/create_model", body)

    def get_info(self, model_id: str) -> dict[str, Any]:
        return self._post("/get_info", {"model_id": model_id, "type": "get_info"})

    def forward(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._post("/forward", body)

    def forward_backward(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._post("/forward_backward", body)

    def optim_step(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._post("/optim_step", body)

    def save_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._post("/save_weights", body)

    def save_weights_for_sampler(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._post("/save_weights_for_sampler", body)

    def load_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._post("/load_weights", body)

    def weights_info(self, tinker_path: str) -> dict[str, Any]:
        return self._post("/weights_info", {"tinker_path": tinker_path})

    def create_sampling_session(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._post("/create_sampling_session", body)

    def get_sampler(self, sampler_id: str) -> dict[str, Any]:
        return self._call("GET", f"/samplers/{sampler_id}").json()

    def asample(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._post("/asample", body)

    def retrieve_future(self, request_id: str) -> dict[str, Any] | None:
        """The future's JSON (a result or ``{"error", "category"}``), or ``None`` while it is not done (408).

        Raises:
            GoneError-like NotFoundError (410): unknown or expired request id; other statuses as usual.
        """
        response = self._call(
            "POST",
            "/retrieve_future",
            {"request_id": request_id, "allow_metadata_only": False},
            timeout=POLL_TIMEOUT_S,
            ok=(408,),
        )
        return None if response.status_code == 408 else response.json()

    def get_server_capabilities(self) -> dict[str, Any]:
        return self._call("GET", "/get_server_capabilities").json()

    def tokenizer(self, revision: str | None = None) -> dict[str, Any] | None:
        """The base model's tokenizer files (``GET /tokenizer``), or ``None`` when ``revision`` (sent as
        ``If-None-Match``) is still the served one (304)."""
        headers = {"If-None-Match": f'"{revision}"'} if revision else None
        try:
            response = self._client.get("/tokenizer", headers=headers)
        except httpx.TransportError as exc:
            raise UnavailableError(f"cannot reach {self.base_url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code == 304:
            return None
        if response.status_code >= 400:
            raise self._error(response)
        return response.json()

    def training_run(self, model_id: str) -> dict[str, Any]:
        return self._call("GET", f"/training_runs/{model_id}").json()

    def list_checkpoints(self, model_id: str) -> dict[str, Any]:
        return self._call("GET", f"/training_runs/{model_id}/checkpoints").json()

    def delete_checkpoint(self, model_id: str, checkpoint_id: str) -> None:
        self._call("DELETE", f"/training_runs/{model_id}/checkpoints/{checkpoint_id}")


def _status_error(response: httpx.Response):
    """The error class of an HTTP error answer, from the OpenAI envelope ``{"error": {...}}`` when present."""
    message, param, code = response.text[:500] or f"HTTP {response.status_code}", None, None
    try:
        err = response.json().get("error")
        if isinstance(err, dict):
            message, param, code = str(err.get("message", message)), err.get("param"), err.get("code")
    except ValueError:
        pass
    exc = error_for_status(
        response.status_code if response.status_code != 410 else 404, message, param=param, code=code
    )
    exc.status = response.status_code
    return exc
