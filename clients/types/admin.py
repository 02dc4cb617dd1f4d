"""Wire types of the ``/admin`` API (endpoints, promotion, adapter versions, exports, API keys).

Requests forbid unknown fields; the CLI sends exactly these bodies.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from livelora.clients.types.nulls import NullMeansOmitted


class _Request(NullMeansOmitted):
    """Base of admin request models: unknown fields are an error; ``null`` for an optional field means "not
    given" (:mod:`.nulls`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class CreateEndpointRequest(_Request):
    """``POST /admin/endpoints``."""

    name: str = Field(
        description="Endpoint name: what clients pass as `model`. In the caller's namespace: "
        "`<tenant>.<rest>` for a tenant other than `default`; `default`'s names have no "
        "`<tenant>.` prefix (else 400 `name_not_in_namespace`)."
    )
    lineage: str = Field(
        description="Adapter lineage the endpoint serves and trains: one in the caller's namespace "
        "(same rule as `name`) or one its tenant already owns."
    )
    mode: Literal["follow", "pinned"] = Field(
        "follow", description="follow: newest version; pinned: only promotions move it."
    )
    version: str | int | None = Field(None, description="Pinned version: `<n>`, `<lineage>@<n>` or `base`.")
    reason: str = Field("", max_length=1000, description="Audit-log note.")


class PromoteRequest(_Request):
    """``POST /admin/endpoints/{name}/promote``: pin a stored version (or `base`), or follow again."""

    version: str | int | None = Field(None, description="`<n>`, `<lineage>@<n>` or `base`.")
    follow: bool = Field(False, description="Follow the lineage's newest version instead of pinning one.")
    reason: str = Field("", max_length=1000, description="Audit-log note.")


class RollbackRequest(_Request):
    """``POST /admin/endpoints/{name}/rollback``."""

    reason: str = Field("", max_length=1000, description="Audit-log note.")


class LearningPauseRequest(_Request):
    """Body of ``POST /admin/endpoints/{name}/pause`` and ``.../resume``."""

    reason: str = Field("", max_length=1000, description="Audit-log note.")


class GateRequest(_Request):
    """``PUT /admin/endpoints/{name}/gate``: the endpoint's evaluation-gate thresholds (docs/rails.md;
    names and defaults: ``GateThresholds`` in ``core/rails.py``). Give ``thresholds`` or ``reset``."""

    thresholds: dict[str, float | int | bool] | None = Field(
        None,
        description="Names: enabled, probe_margin, probe_base_margin, max_kl_current, max_kl_base, "
        "max_degenerate, min_length_ratio, signal_tolerance, min_signal_examples (an omitted "
        'one takes its default); e.g. {"probe_margin": 0.05, "probe_base_margin": 0.1, '
        '"max_kl_current": 0.3}',
    )
    reset: bool = Field(False, description="Back to the defaults (instead of thresholds).")
    reason: str = Field("", max_length=1000, description="Audit-log note.")


class CreateSegmentRequest(_Request):
    """``POST /admin/endpoints/{name}/segments``: a segment learning on a lineage of its own."""

    name: str = Field(min_length=1, max_length=32, description="Segment name: a-z, 0-9, '_', '-'.")
    reason: str = Field("", max_length=1000, description="Audit-log note.")


class SegmentMembersRequest(_Request):
    """``POST /admin/endpoints/{name}/segments/{segment}/assign`` (or ``/unassign``): members to add or remove."""

    users: list[str] = Field(default_factory=list, max_length=1000, description="OpenAI `user` values.")
    keys: list[str] = Field(default_factory=list, max_length=1000, description="API key ids of the tenant.")
    headers: list[str] = Field(default_factory=list, max_length=1000, description="`X-Livelora-Segment` header values.")
    reason: str = Field("", max_length=1000, description="Audit-log note.")


class ForgetRequest(_Request):
    """``POST /admin/users/{name}/forget``: delete a user's signals and completions (right to be forgotten)."""

    reason: str = Field(
        min_length=1, max_length=1000, description="Audit-log note (required: why, e.g. the request's reference)."
    )


class ExportRequest(_Request):
    """``POST /admin/adapters/{name}/export``."""

    format: Literal["peft", "merged", "gguf"] = Field(
        "peft",
        description="peft: adapter directory; merged: full Hugging Face model with the adapter merged; gguf: "
        "llama.cpp LoRA adapter file (llama-architecture bases).",
    )


class CreateKeyRequest(_Request):
    """``POST /admin/keys``: a key for the caller's tenant."""

    roles: list[Literal["inference", "feedback", "train", "admin", "operator"]] = Field(min_length=1)
    name: str = Field("", max_length=64, description="Label shown in `keys list` and the audit log.")
    tenant: str | None = Field(
        None,
        min_length=1,
        max_length=64,
        description="The key's tenant: the caller's own (the default); any other is a 400.",
    )


class QuotaUpdateRequest(_Request):
    """``PUT /admin/quotas`` (the operator): change one tenant's limits. A limit left out (or null) keeps its
    current value; ``unlimited`` lifts limits for this tenant, also above the settings' defaults (``max_sessions``,
    ``max_adapter_versions`` or ``tokens_per_day.<kind>``)."""

    tenant: str = Field(min_length=1, max_length=64)
    max_sessions: int | None = Field(None, ge=0, description="Training sessions alive at once (0: none).")
    max_adapter_versions: int | None = Field(
        None,
        ge=0,
        description="Adapter versions kept in the store (versions "
        "of the tenant's lineages; a session's "
        "ephemeral sampler weights do not count).",
    )
    tokens_per_day: dict[str, int] | None = Field(None, description="{kind: tokens per UTC day}.")
    max_n: int | None = Field(None, ge=1, description="Choices one served request may ask for.")
    max_n_tokens: int | None = Field(None, ge=1, description="n × max_tokens of one served request.")
    max_lora_rank: int | None = Field(None, ge=1, description="Largest LoRA rank of a training model.")
    max_models_per_session: int | None = Field(None, ge=0, description="Live training models per session.")
    max_models: int | None = Field(None, ge=0, description="Live training models of the tenant.")
    max_trainer_bytes: int | None = Field(None, ge=0, description="Estimated trainer memory of its models (bytes).")
    max_completion_log_bytes: int | None = Field(
        None, ge=0, description="Completion-log bytes within the retention period."
    )
    max_adapter_bytes: int | None = Field(None, ge=0, description="Bytes on disk of the adapter versions kept.")
    unlimited: list[str] = Field(
        default_factory=list,
        description="Limits to lift: a scalar limit's name (e.g. 'max_sessions') or 'tokens_per_day.<kind>'.",
    )
