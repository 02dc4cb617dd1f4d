"""The SDK is a setting: the same recipe code runs on livelora's SDK or on the official ``tinker`` SDK.

Recipes only touch the surface both SDKs share (Tinker's client shape): ``ServiceClient``
(``create_lora_training_client``, ``create_training_client_from_state_with_optimizer``,
``create_sampling_client``), ``TrainingClient`` (``forward``, ``forward_backward``, ``forward_backward_custom``,
``optim_step``, ``save_state``, ``save_weights_for_sampler``, ``save_weights_and_get_sampling_client``,
``get_tokenizer``), ``SamplingClient`` (``sample``, ``compute_logprobs``) and the wire types ``Datum``,
``ModelInput.from_ints``, ``TensorData``, ``SamplingParams``, ``AdamParams``.

Example::

    sdk = Sdk.load("tinker", base_url="http://127.0.0.1:8000")      # or "livelora"
    tc = sdk.service().create_lora_training_client(base_model="smollm2-135m-instruct", rank=8, seed=0)
    datum = sdk.datum(tokens, {"target_tokens": (targets, "int64"), "weights": (weights, "float32")})
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Literal

from livelora.clients._http import OPEN_SERVER_KEY, configured_api_key

SdkName = Literal["livelora", "tinker"]
#: a ``TensorData``'s element type
DType = Literal["int64", "float32"]


@dataclass
class Sdk:
    """One SDK: its wire types and a factory of service clients.

    Attributes:
        name: ``"livelora"`` or ``"tinker"``.
        types: namespace with ``Datum``, ``ModelInput``, ``TensorData``, ``SamplingParams``, ``AdamParams``.
        service_factory: ``() -> ServiceClient`` (a new session each call).
    """

    name: str
    types: Any
    service_factory: Callable[[], Any]
    base_url: str = "http://127.0.0.1:8000"
    api_key: str | None = None  # None: no key configured (the open-server placeholder is sent)

    @classmethod
    def load(cls, name: SdkName = "livelora", base_url: str | None = None, api_key: str | None = None) -> Sdk:
        """The SDK called ``name``, its clients pointed at ``base_url`` with ``api_key``.

        Defaults: ``$LIVELORA_BASE_URL`` / ``$TINKER_BASE_URL``, then ``http://127.0.0.1:8000``; the key from
        ``$LIVELORA_API_KEY`` / ``$TINKER_API_KEY``, then ``tml-local`` (what an open livelora server accepts).

        Raises:
            ValueError: unknown SDK name. ImportError: ``tinker`` asked for but not installed.
        """
        url = (
            base_url
            or os.environ.get("LIVELORA_BASE_URL")
            or os.environ.get("TINKER_BASE_URL")
            or "http://127.0.0.1:8000"
        )
        key = configured_api_key(api_key)  # None: livelora's SDK sends the open-server placeholder and explains a 401
        if name == "livelora":
            from livelora import clients

            types = SimpleNamespace(
                **{
                    n: getattr(clients, n)
                    for n in ("Datum", "ModelInput", "TensorData", "SamplingParams", "AdamParams")
                }
            )
            return cls("livelora", types, lambda: clients.ServiceClient(url, key), url, key)
        if name == "tinker":
            try:
                import tinker
                from tinker import types as ttypes
            except ImportError as exc:
                raise ImportError("sdk='tinker' needs the official SDK: pip install tinker==0.24.1") from exc
            os.environ.setdefault("TINKER_TELEMETRY", "0")
            return cls(
                "tinker", ttypes, lambda: tinker.ServiceClient(base_url=url, api_key=key or OPEN_SERVER_KEY), url, key
            )
        raise ValueError(f"unknown sdk {name!r}: use 'livelora' or 'tinker'")

    def service(self) -> Any:
        """A new service client (one session)."""
        return self.service_factory()

    def tokenizer(self, training_client: Any) -> Any:
        """The base model's tokenizer for ``training_client``, with either SDK from the files the server serves
        (``GET /api/v1/tokenizer``, kept in livelora's tokenizer cache): no hub request, no ``livelora hf-cache``.

        Raises:
            the SDK's error when neither resolves (:func:`livelora.clients.tokenizer_files.load_tokenizer`).
        """
        if self.name == "livelora":
            return training_client.get_tokenizer()  # the server's files, no hub request
        from livelora.clients._http import Transport
        from livelora.clients.tokenizer_files import load_tokenizer

        # the official SDK's get_tokenizer() asks the hub first (retrying where there is no network): ask the server
        info = training_client.get_info()
        tokenizer_id = getattr(info.model_data, "tokenizer_id", None) or info.model_name
        return load_tokenizer(tokenizer_id, Transport(self.base_url, self.api_key))

    def model_input(self, tokens: Sequence[int]) -> Any:
        return self.types.ModelInput.from_ints(list(tokens))

    def tensor(self, values: Sequence[float] | Sequence[int], dtype: DType) -> Any:
        """A 1-D ``TensorData`` of ``values`` (both SDKs accept this constructor)."""
        values = [int(v) for v in values] if dtype == "int64" else [float(v) for v in values]
        return self.types.TensorData(data=values, dtype=dtype, shape=[len(values)])

    def datum(self, tokens: Sequence[int], inputs: Mapping[str, tuple[Sequence[float], DType]]) -> Any:
        """``Datum(model_input=tokens, loss_fn_inputs={key: TensorData(values, dtype)})``."""
        return self.types.Datum(
            model_input=self.model_input(tokens),
            loss_fn_inputs={k: self.tensor(v, dt) for k, (v, dt) in inputs.items()},
        )

    def sampling_params(self, **kwargs: Any) -> Any:
        return self.types.SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})

    def adam(self, learning_rate: float, beta1: float = 0.9, beta2: float = 0.95, eps: float = 1e-8) -> Any:
        """AdamW hyperparameters (Tinker's betas; eps 1e-8 as tinker-cookbook passes)."""
        return self.types.AdamParams(learning_rate=learning_rate, beta1=beta1, beta2=beta2, eps=eps)


def close_service(service: Any, status: str = "success") -> None:
    """Finish a service client's session where the SDK can (livelora's ``close``; tinker 0.24 has none and
    ends the session when the process exits)."""
    close = getattr(service, "close", None)
    if callable(close):
        try:
            close(status)
        except TypeError:
            close()


def _is_rate_limit(exc: BaseException) -> bool:
    return getattr(exc, "status", None) == 429 or getattr(exc, "status_code", None) == 429


def gather(submits: Sequence[Callable[[], Any]], max_in_flight: int = 24, max_wait_s: float = 600.0) -> list[Any]:
    """Results of ``submit()`` futures, in order, with at most ``max_in_flight`` requests outstanding.

    A full server answers 429 at submission (livelora: the engine's admission limit); those submissions are
    retried after the server's ``Retry-After`` (or 1 s) while earlier requests finish, for up to
    ``max_wait_s`` seconds in all. Other errors propagate.
    """
    results: list[Any] = [None] * len(submits)
    pending: deque[tuple[int, Any]] = deque()
    deadline = time.monotonic() + max_wait_s
    for i, submit in enumerate(submits):
        while True:
            if len(pending) >= max_in_flight:
                j, fut = pending.popleft()
                results[j] = fut.result()
            try:
                pending.append((i, submit()))
                break
            except Exception as exc:
                if not _is_rate_limit(exc) or time.monotonic() > deadline:
                    raise
                if pending:
                    j, fut = pending.popleft()
                    results[j] = fut.result()
                else:
                    time.sleep(float(getattr(exc, "retry_after", 1.0) or 1.0))
    for j, fut in pending:
        results[j] = fut.result()
    return results


def tolist(tensor_data: Any) -> list[float]:
    """The flat values of a ``TensorData`` of either SDK."""
    return list(tensor_data.tolist())
