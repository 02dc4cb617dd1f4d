"""Settings of a gateway process: one :class:`GatewaySettings` object with nested sections.

Environment variables keep their flat ``LIVELORA_*`` names (``LIVELORA_PORT`` → ``settings.server.port``,
``LIVELORA_MAX_BATCH_SIZE`` → ``settings.inference.max_batch_size``, ``LIVELORA_VLLM_MAX_LORAS`` →
``settings.vllm.max_loras``); see :mod:`livelora.core.settings`. CLI flags override them.

Example::

    settings = GatewaySettings(port=8001, max_batch_size=4)   # flat keywords go to their sections
    settings.server.port, settings.inference.max_batch_size        # (8001, 4)
    app = create_app(settings)
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import SettingsConfigDict

from livelora.core.settings import (
    ENV_PREFIX,
    ObservabilitySection,
    ProcessSettings,
    QuotaSection,
    Section,
    SessionSection,
)

#: Default retention of completion records and rating keys: 7 days, in seconds.
DEFAULT_RETENTION_S = 7 * 24 * 3600
#: Default lifetime of idempotency keys: 24 hours, in seconds.
DEFAULT_IDEMPOTENCY_TTL_S = 24 * 3600
#: LoRA ranks vLLM accepts for ``max_lora_rank`` (vllm/config/lora.py).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


#: Why the llama_cpp engine cannot start without its package, and how to get it.
LLAMA_CPP_MISSING = (
    "the llama_cpp engine needs llama-cpp-python: pip install -e '.[llamacpp]' in the livelora checkout "
    "(compiles llama.cpp, about 5 minutes on 2 cores)"
)

#: The ``LIVELORA_ENGINE_WEIGHTS`` values each engine kind serves (the first is its default).
ENGINE_WEIGHTS = {
    "transformers": ("fp32", "bf16", "int8", "int4"),
    "llama_cpp": ("f16", "gguf"),
    "vllm": ("fp32",),
}


class ServerSection(Section):
    """HTTP server: ``LIVELORA_HOST``, ``LIVELORA_PORT``, ``LIVELORA_PUBLIC_URL``, ``LIVELORA_ALLOW_OPEN``,
    ``LIVELORA_MAX_BODY_BYTES``."""

    host: str = Field("127.0.0.1", description="Interface to bind.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0 picks a free one).")
    public_url: str | None = Field(
        None,
        pattern=r"^https?://[^/?#\s]+(/[^?#\s]*)?$",
        description="Base URL clients reach this gateway at (e.g. https://lora.example.com), used in signed "
        "download URLs; default: the address the connection arrived on (never the request's Host header).",
    )
    allow_open: bool = Field(
        False,
        description="Serve without API keys on a non-loopback host (unsafe: anyone "
        "who reaches it can use and retrain the model).",
    )
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Largest request body accepted (bytes); larger ones get 413."
    )
    drain_grace_s: float = Field(
        20.0,
        ge=0,
        description="On SIGTERM/SIGINT: seconds running requests get to finish "
        "while new ones get 503; then open streams end with an "
        "error event and [DONE], and the process exits.",
    )


class InferenceSection(Section):
    """Inference: engine kind, device, batching and admission (``LIVELORA_ENGINE``, ``LIVELORA_DEVICE``,
    ``LIVELORA_MAX_BATCH_SIZE``, ...)."""

    engine: str = Field(
        "transformers",
        description="Inference engine kind: 'transformers', 'vllm' (GPU) or 'llama_cpp' (CPU, a built-in GGUF "
        "model's quantized weights; needs the llamacpp extra; docs/serving.md).",
    )
    device: str | None = Field(None, description="Torch device for the engine (default: cuda if available, else cpu).")
    dtype: str | None = Field(None, description="Weights dtype for the engine (default: engine's choice).")
    max_batch_size: int = Field(8, ge=1, description="Sequences the engine decodes together in one step.")
    engine_threads: int | None = Field(
        None,
        ge=1,
        description="Threads of the engine's forward passes: torch's for the transformers engine (process-wide), "
        "llama.cpp's for the llama_cpp engine; default all cores.",
    )
    engine_threads_while_training: int | None = Field(
        None,
        ge=0,
        description="Torch threads of the transformers engine (CPU) while a training step runs on this "
        "machine (core/cpu_share.py); default half the engine's threads, at least 1; "
        "0: never change them.",
    )
    engine_merge_lora: bool = Field(
        True,
        description="Serve an adapter version that every row of the batch uses from merged weights. "
        "Transformers engine: one copy of the adapted layers (425 MB for SmolLM2-135M in float32; "
        "gateway/engines/lora_slots.py). llama_cpp engine with f16 weights: a merged copy of the model and a "
        "context of its own (258 MB plus a KV cache as large as the base's; gateway/engines/llama_cpp/lane.py).",
    )
    engine_max_loaded_versions: int | None = Field(
        None,
        ge=1,
        description="Adapter versions whose weights the transformers and llama_cpp engines keep in memory; the "
        "least recently used idle ones beyond it are cold (a copy on the engine's disk) and loaded back when a "
        "request names them (a request waits for a resident version to drain, never fails for the bound). "
        "Default: a tenth of the machine's memory (the GPU's on CUDA) over one version's size, at least "
        "max_batch_size (gateway/engines/residency.py).",
    )
    engine_weights: Literal["fp32", "bf16", "int8", "int4", "f16", "gguf"] | None = Field(
        None,
        description="Format of the served weights (default: the engine's). Transformers engine: 'fp32' "
        "(default; what training uses), 'bf16' (the model in bfloat16), 'int8' (weight-only int8 per output "
        "channel, each version's merged weights re-quantized) or 'int4' (attention and MLP weight-only int4 in "
        "groups of 32, the GGUF Q4_1 grid of the built-in model; lm_head in bfloat16; versions never merged; "
        "gateway/engines/quantized.py). llama_cpp engine: 'f16' (default; the GGUF's weights converted to "
        "float16 once) or 'gguf' (the file's own quantized types). Measured side by side: docs/serving.md.",
    )
    max_waiting: int = Field(64, ge=0, description="Sequences allowed to wait for a batch slot; more get 429.")
    max_model_len: int | None = Field(
        None, ge=16, description="Cap on prompt + completion tokens (default: the model's context length)."
    )
    served_model_name: str | None = Field(
        None, description="Name clients pass as `model` for the base model (default: the --model name)."
    )
    retry_after_s: float = Field(1.0, gt=0, description="Retry-After (seconds) sent with 429 queue-full answers.")
    unknown_fields: Literal["reject", "ignore"] = Field(
        "reject",
        description="A chat or completion request field that is neither OpenAI's nor a served extension: "
        "'reject' answers 400 unknown_parameter (as OpenAI); 'ignore' serves the request and names the fields "
        "in the X-Livelora-Ignored-Fields header (gateway/services/serving/request_fields.py).",
    )
    tenant_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Share of the admitted sequences and of the batch slots one tenant may hold (key mode); "
        "beyond it only idle capacity, while share_reserve of it stays free (gateway/services/serving/admission.py).",
    )
    key_share: float = Field(0.5, gt=0, le=1, description="Share of its tenant's share one API key may hold.")
    share_reserve: float = Field(
        0.25,
        ge=0,
        lt=1,
        description="Share of the admitted sequences and batch slots a tenant or key beyond its share "
        "leaves free for the others.",
    )
    generation_config: str = Field(
        "auto",
        min_length=1,
        description="Sampling defaults for requests that omit temperature, top_p or top_k (vLLM's "
        "--generation-config): 'auto' takes the served model's generation_config.json, 'none' "
        "OpenAI's (1, 1, off), or a directory holding a generation_config.json "
        "(gateway/services/serving/sampling_defaults.py).",
    )

    @field_validator("engine")
    @classmethod
    def _engine(cls, value: str) -> str:
        import importlib.util

        if value == "llama_cpp" and importlib.util.find_spec("llama_cpp") is None:
            raise ValueError(LLAMA_CPP_MISSING)
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("engine") == "llama_cpp" and value not in (None, "cpu"):
            raise ValueError(f"the llama_cpp engine runs on the CPU, not {value!r}")
        return value

    @field_validator("engine_weights")
    @classmethod
    def _engine_weights(cls, value: str | None, info: ValidationInfo) -> str | None:
        engine = info.data.get("engine")
        allowed = ENGINE_WEIGHTS.get(engine)
        if value is not None and allowed is not None and value not in allowed:
            raise ValueError(
                f"the {engine} engine serves LIVELORA_ENGINE_WEIGHTS {', '.join(allowed)}, not {value!r}"
                + (" (it loads the model in LIVELORA_DTYPE)" if engine == "vllm" else "")
            )
        return value

    @field_validator("generation_config")
    @classmethod
    def _generation_config(cls, value: str) -> str:
        if value not in ("auto", "none") and not (Path(value).expanduser() / "generation_config.json").is_file():
            raise ValueError(f"{value!r} is neither 'auto', 'none' nor a directory holding a generation_config.json")
        return value

    @property
    def max_sequences(self) -> int:
        """Sequences admitted at once (running + waiting); beyond this requests get 429."""
        return self.max_batch_size + self.max_waiting


class VLLMSection(Section):
    """vLLM-only knobs (``LIVELORA_VLLM_`` environment prefix); engine constructor arguments override them."""

    model_config = SettingsConfigDict(env_prefix=f"{ENV_PREFIX}VLLM_", extra="forbid")

    gpu_memory_utilization: float = Field(
        0.85, gt=0, le=1, description="Fraction of GPU memory vLLM may use (weights + KV cache)."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs the model is sharded over (vLLM tensor parallelism).")
    max_loras: int = Field(2, ge=2, description="Distinct adapters in one batch (old + new during a swap).")
    max_cpu_loras: int | None = Field(
        None,
        ge=2,
        description="Adapters vLLM keeps in host memory, ready to move to the GPU when a batch needs them (its LRU "
        "cache behind max_loras; at least max_loras; default max_loras + 1).",
    )
    max_lora_rank: int = Field(64, description=f"Largest adapter rank; one of {VLLM_LORA_RANKS}.")
    enforce_eager: bool | None = Field(None, description="Disable CUDA graphs (default: on for CPU, off for GPU).")
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prompt prefixes.")
    snapshot_dir: Path | None = Field(
        None, description="Where adapter snapshots live (default /dev/shm, else the temp dir)."
    )


class LiveSection(Section):
    """The live loop in the gateway: ``LIVELORA_COMPLETION_RETENTION_S``, ``LIVELORA_IDEMPOTENCY_TTL_S``,
    ``LIVELORA_RESYNC_S``, ``LIVELORA_MAX_ON_DEMAND_VERSIONS``, ..."""

    completion_retention_s: int = Field(
        DEFAULT_RETENTION_S, gt=0, description="Seconds completions stay rateable (default 7 days)."
    )
    idempotency_ttl_s: int = Field(DEFAULT_IDEMPOTENCY_TTL_S, gt=0, description="Lifetime of Idempotency-Keys.")
    resync_s: float = Field(30.0, ge=0, description="Seconds between endpoint catch-ups from the store.")
    max_on_demand_versions: int = Field(
        4,
        ge=1,
        description="Stored adapter versions (<lineage>@<n>) held in the "
        "engine because requests named them; loading one more "
        "unloads the least recently used idle one "
        "(gateway/services/live/on_demand.py).",
    )
    canary_share: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Share of a follow endpoint's requests a new version serves first (0: switch at once).",
    )
    canary_min_ratings: int = Field(
        20,
        ge=1,
        description="Ratings of the canary after which the switch "
        "completes when the sequential test shows no regression.",
    )
    rollback_enabled: bool = Field(
        True,
        description="Roll a follow endpoint back automatically when its serving "
        "version's thumbs-up rate is worse than its predecessor's "
        "(sequential test, core/rails.py sprt_thumbs).",
    )
    rollback_min_ratings: int = Field(20, ge=1, description="Ratings the predecessor needs before the test runs.")
    rollback_delta: float = Field(0.2, gt=0, lt=1, description="Drop in thumbs-up rate the test detects (H1).")
    rollback_alpha: float = Field(0.05, gt=0, lt=0.5, description="Chance of rolling back an equally good version.")
    rollback_beta: float = Field(0.2, gt=0, lt=0.5, description="Chance of keeping a version delta worse.")
    stats_max_ratings: int = Field(
        10_000,
        ge=1,
        description="Ratings kept per version for its statistics and the rollback test (the newest; older ones "
        "are dropped in batches of a tenth once it is passed).",
    )
    stats_ttl_s: int = Field(
        90 * 86400,
        gt=0,
        description="Lifetime of a version's rating statistics after its latest rating (seconds).",
    )


class GatewaySettings(ProcessSettings):
    """The gateway process's settings: common fields plus ``server``, ``inference``, ``vllm``, ``live`` and
    ``sessions`` sections."""

    server: ServerSection = Field(default_factory=ServerSection)
    inference: InferenceSection = Field(default_factory=InferenceSection)
    vllm: VLLMSection = Field(default_factory=VLLMSection)
    live: LiveSection = Field(default_factory=LiveSection)
    sessions: SessionSection = Field(default_factory=SessionSection)
    observability: ObservabilitySection = Field(default_factory=ObservabilitySection)
    quotas: QuotaSection = Field(default_factory=QuotaSection)

    @property
    def model_id(self) -> str:
        """The id listed by ``/v1/models`` for the base model."""
        return self.inference.served_model_name or self.model
