"""Settings of a gateway process (``LIVELORA_`` environment prefix; CLI flags override).

Example::

    settings = GatewaySettings(port=8001, max_batch_size=4)
    app = create_app(settings)
"""

from __future__ import annotations

from pydantic import Field

from livelora.adapters.settings import BaseSettings


class GatewaySettings(BaseSettings):
    """Fields of the OpenAI-compatible gateway.

    Environment: ``LIVELORA_HOST``, ``LIVELORA_PORT``, ``LIVELORA_ENGINE``, ``LIVELORA_MAX_BATCH_SIZE``, ...
    """

    host: str = Field("127.0.0.1", description="Interface to bind.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0 picks a free one).")
    engine: str = Field("transformers", description="Inference engine kind: 'transformers' (later 'vllm').")
    device: str | None = Field(None, description="Torch device for the engine (default: cuda if available, else cpu).")
    dtype: str | None = Field(None, description="Weights dtype for the engine (default: engine's choice).")
    max_batch_size: int = Field(8, ge=1, description="Sequences the engine decodes together in one step.")
    max_waiting: int = Field(64, ge=0, description="Sequences allowed to wait for a batch slot; more get 429.")
    max_model_len: int | None = Field(None, ge=16, description="Cap on prompt + completion tokens "
                                                               "(default: the model's context length).")
    served_model_name: str | None = Field(None, description="Name clients pass as `model` for the base model "
                                                           "(default: the --model name).")
    retry_after_s: float = Field(1.0, gt=0, description="Retry-After (seconds) sent with 429 queue-full answers.")
    allow_open: bool = Field(False, description="Serve without API keys on a non-loopback host (unsafe: anyone "
                                                "who reaches it can use and retrain the model).")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="Largest request body accepted (bytes); "
                                                                      "larger ones get 413.")

    @property
    def max_sequences(self) -> int:
        """Sequences admitted at once (running + waiting); beyond this requests get 429."""
        return self.max_batch_size + self.max_waiting

    @property
    def model_id(self) -> str:
        """The id listed by ``/v1/models`` for the base model."""
        return self.served_model_name or self.model

