"""``ServiceClient``: the entry point of the training-session SDK (Tinker's client shape, livelora server).

Example::

    from livelora.clients import ServiceClient, AdamParams

    with ServiceClient("http://127.0.0.1:8000", api_key="tml-local") as service:
        tc = service.create_lora_training_client("smollm2-135m-instruct", rank=8, alpha=16)
        ...
        sampler = tc.save_weights_and_get_sampling_client()

The session is created on the first factory call and kept alive by a heartbeat thread (every 10 s);
:meth:`ServiceClient.close` (or leaving the ``with`` block) finishes it, which frees its models on the
server. A session whose heartbeats stop expires (``LIVELORA_SESSION_TTL_S`` on the server, default 60 s).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from livelora.clients._http import Transport, configured_api_key
from livelora.clients.errors import BadRequestError, InternalError
from livelora.clients.futures import APIFuture, SeqCounter
from livelora.clients.sampling_client import SamplingClient
from livelora.clients.training_client import TrainingClient
from livelora.clients.types.tinker import (
    CreateModelResponse,
    GetInfoResponse,
    GetServerCapabilitiesResponse,
    LoadWeightsResponse,
    LoraConfig,
)

SDK_VERSION = "livelora-0.1.0"
#: Seconds between heartbeats (as the tinker SDK).
HEARTBEAT_S = 10.0


def load_tokenizer(tokenizer_id: str, transport: Transport | None = None):
    """With ``transport``: the tokenizer files the server serves, kept in ``~/.cache/livelora/tokenizers`` (no
    hub request); without, or for a server without them: ``AutoTokenizer.from_pretrained(tokenizer_id)``
    (:func:`livelora.clients.tokenizer_files.load_tokenizer`).

    Raises:
        OSError/ValueError: the id does not resolve and there is no server to ask. UnavailableError: neither
        the server, the local cache nor the hub has it.
    """
    from livelora.clients.tokenizer_files import load_tokenizer as load

    return load(tokenizer_id, transport)


class ServiceClient:
    """Connection to a livelora server's training-session API.

    Args:
        base_url: server root (default ``$LIVELORA_BASE_URL``, else ``http://127.0.0.1:8000``).
        api_key: sent as ``X-API-Key`` (default ``$LIVELORA_API_KEY``, else ``$TINKER_API_KEY``; with none of
            them the placeholder ``tml-local`` is sent, which an open server accepts, and a server with keys
            answers :class:`~livelora.clients.errors.AuthenticationError` saying no key was configured).
        user_metadata: stored with the session.
        heartbeat_s: seconds between heartbeats (keep it well under the server's session TTL).
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        user_metadata: dict[str, str] | None = None,
        heartbeat_s: float = HEARTBEAT_S,
    ):
        base_url = base_url or os.environ.get("LIVELORA_BASE_URL") or "http://127.0.0.1:8000"
        self.transport = Transport(base_url, configured_api_key(api_key))
        self.user_metadata = user_metadata
        self.session_id: str | None = None
        self._lock = threading.Lock()
        self._model_seq = SeqCounter(0)
        self._sampling_seq = SeqCounter(0)
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.heartbeat_s = heartbeat_s

    # ------------------------------------------------------------------------------------------ session
    def _session(self) -> str:
        with self._lock:
            if self.session_id is None:
                answer = self.transport.create_session(
                    {
                        "tags": [],
                        "user_metadata": self.user_metadata,
                        "sdk_version": SDK_VERSION,
                        "type": "create_session",
                    }
                )
                self.session_id = answer["session_id"]
                self._heartbeat = threading.Thread(
                    target=self._beat, args=(answer["session_id"],), name="livelora-heartbeat", daemon=True
                )
                self._heartbeat.start()
            return self.session_id

    def _beat(self, session_id: str) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.transport.session_heartbeat(session_id)
            except Exception as exc:  # 410: the session ended; anything else: try again next beat
                if getattr(exc, "status", None) == 410:
                    return

    def close(self, status: str = "success", detail: str | None = None) -> None:
        """Finish the session (``status``: success, errored or interrupted) and stop the heartbeat."""
        self._stop.set()
        if self.session_id is not None:
            try:
                self.transport.finish_session(self.session_id, status, detail)
            finally:
                self.transport.close()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("success" if exc_type is None else ("interrupted" if exc_type is KeyboardInterrupt else "errored"))

    # ------------------------------------------------------------------------------------------ factories
    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        *,
        alpha: float | None = None,
        user_metadata: dict[str, Any] | None = None,
    ) -> TrainingClient:
        """A new LoRA model on ``base_model`` (blocks until the server has built it).

        ``alpha`` (livelora extension; None = 32): the LoRA scale is ``alpha / rank``.

        Raises:
            BadRequestError: invalid LoRA shape (e.g. no train_* flag set). NotFoundError: unknown base model.
        """
        lora = LoraConfig(
            rank=rank, seed=seed, train_mlp=train_mlp, train_attn=train_attn, train_unembed=train_unembed, alpha=alpha
        )
        sid = self._session()
        body = {
            "session_id": sid,
            "model_seq_id": self._model_seq.take(),
            "base_model": base_model,
            "lora_config": lora.model_dump(exclude_none=True),
            "type": "create_model",
        }
        if user_metadata is not None:
            body["user_metadata"] = user_metadata
        answer = self.transport.create_model(body)
        created = APIFuture.polling(self.transport, answer["request_id"], CreateModelResponse.model_validate).result()
        return self._client(created.model_id)

    def _client(self, model_id: str) -> TrainingClient:
        info = GetInfoResponse.model_validate(self.transport.get_info(model_id))
        return TrainingClient(self, model_id, info)

    def _from_state(self, path: str, optimizer: bool, user_metadata: dict[str, Any] | None) -> TrainingClient:
        sid = self._session()
        body = {
            "session_id": sid,
            "model_seq_id": self._model_seq.take(),
            "path": path,
            "optimizer": optimizer,
            "type": "load_weights",
        }
        if user_metadata is not None:
            body["user_metadata"] = user_metadata
        answer = self.transport.load_weights(body)
        loaded = APIFuture.polling(self.transport, answer["request_id"], LoadWeightsResponse.model_validate).result()
        if loaded.model_id is None:  # a load into a new model names it; a server that does not is broken
            raise InternalError(f"the server loaded {path} but named no model_id for it")
        return self._client(loaded.model_id)

    def create_training_client_from_state(
        self, path: str, *, user_metadata: dict[str, Any] | None = None
    ) -> TrainingClient:
        """A new model shaped like checkpoint ``path`` (``tinker://<model_id>/weights/<name>``) with its
        weights; the optimizer starts fresh.

        Raises:
            NotFoundError: unknown checkpoint. BadRequestError: a sampler checkpoint or malformed path.
        """
        return self._from_state(path, False, user_metadata)

    def create_training_client_from_state_with_optimizer(
        self, path: str, *, user_metadata: dict[str, Any] | None = None
    ) -> TrainingClient:
        """As :meth:`create_training_client_from_state`, also restoring Adam moments, step count and RNG state,
        so training continues exactly as if it had not stopped."""
        return self._from_state(path, True, user_metadata)

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None) -> SamplingClient:
        """Sample a sampler checkpoint (``tinker://<model_id>/sampler_weights/<name>``) or the base model.

        Raises:
            BadRequestError: neither argument, or a training checkpoint path. NotFoundError: unknown checkpoint.
        """
        if model_path is None and base_model is None:
            raise BadRequestError("give model_path or base_model", param="model_path")
        sid = self._session()
        body = {
            "session_id": sid,
            "sampling_session_seq_id": self._sampling_seq.take(),
            "type": "create_sampling_session",
        }
        if model_path is not None:
            body["model_path"] = model_path
        if base_model is not None:
            body["base_model"] = base_model
        sampling_id = self.transport.create_sampling_session(body)["sampling_session_id"]
        sampler = self.transport.get_sampler(sampling_id)
        return SamplingClient(self, sampling_id, base_model=sampler["base_model"], adapter=sampler.get("adapter"))

    def get_server_capabilities(self) -> GetServerCapabilitiesResponse:
        """The base models this server trains and samples."""
        return GetServerCapabilitiesResponse.model_validate(self.transport.get_server_capabilities())

    def _tokenizer_id(self) -> str:
        caps = self.get_server_capabilities().supported_models
        return caps[0].tokenizer_id or caps[0].model_name

    def get_tokenizer(self):
        """The served base model's Hugging Face tokenizer, by the ``tokenizer_id`` the server reports (see
        :func:`load_tokenizer`: the server's own files, no hub request)."""
        return load_tokenizer(self._tokenizer_id(), self.transport)

    # ------------------------------------------------------------------------------------------ checkpoints
    def list_checkpoints(self, model_id: str) -> list[dict[str, Any]]:
        """Checkpoints of a training run (``checkpoint_id``, ``checkpoint_type``, ``tinker_path``, ...)."""
        return self.transport.list_checkpoints(model_id)["checkpoints"]

    def delete_checkpoint(self, tinker_path: str) -> None:
        """Delete a checkpoint given its ``tinker://`` path."""
        rest = tinker_path.removeprefix("tinker://")
        model_id, _, checkpoint_id = rest.partition("/")
        self.transport.delete_checkpoint(model_id, checkpoint_id)
