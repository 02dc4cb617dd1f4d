"""Settings of a trainer process: one :class:`TrainerSettings` object with nested sections.

``training`` holds the live loop's batching thresholds and hyperparameters (``LIVELORA_KTO_MIN_BATCH``,
``LIVELORA_KTO_LR``, ...), ``sessions`` the timing of training-session ops (shared with the gateway). CLI
flags override the environment; flat keywords go to their section (:mod:`livelora.core.settings`).

Example::

    settings = TrainerSettings(kto_min_batch=4, max_wait_s=10)
    settings.training.kto_min_batch   # 4
    worker = build_worker(settings)
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from livelora.clients.types.tinker import LoraConfig
from livelora.core.settings import ObservabilitySection, ProcessSettings, QuotaSection, Section, SessionSection


class TrainingSection(Section):
    """Online training (the live loop): when queued signals become a step, and the step's hyperparameters.

    Batching (counts are events, times seconds): ratings → KTO at ``kto_min_batch`` (or ≥ 2 once the oldest
    waited ``max_wait_s``: KTO's KL estimate needs mismatched pairs), demonstrations → SFT at
    ``sft_min_batch``, preference pairs → DPO at ``dpo_min_batch`` (≥ 1 after ``max_wait_s``); at most
    ``max_batch`` events per step.

    Hyperparameters follow docs/internals/losses.md §5–§6 (LoRA learning rates ≈ 10× full fine-tuning;
    KTO/DPO β = 0.1). ``kto_lr`` 1e-3 was found by experiment on SmolLM2 with ``bench/live_loop.py``: in 80
    ratings the held-out liked share goes from 9 % to 13 % at 5e-5, 25 % at 2e-4, 97 % at 1e-3 (docs/live-loop.md).
    """

    consumer: str | None = Field(
        None,
        description="Consumer name in the 'trainers' group (default host-pid); "
        "reuse it after a restart to resume this worker's pending events.",
    )
    kto_min_batch: int = Field(8, ge=2, description="Ratings that trigger a KTO step.")
    sft_min_batch: int = Field(4, ge=1, description="Demonstrations that trigger an SFT step.")
    dpo_min_batch: int = Field(4, ge=1, description="Preference pairs that trigger a DPO step.")
    max_batch: int = Field(32, ge=2, description="Most events in one step.")
    max_wait_s: float = Field(
        30.0,
        ge=0,
        description="Seconds the oldest queued event waits before a smaller batch is trained (KTO needs at least 2).",
    )
    claim_idle_s: float = Field(120.0, gt=0, description="Events pending this long in a dead worker are reclaimed.")
    reconcile_s: float = Field(
        60.0,
        gt=0,
        description="Seconds between checks for accepted signals missing from Redis (re-queued from "
        "data/accepted) and pruning of settled accepted-signal logs.",
    )
    kto_lr: float = Field(
        1e-3,
        gt=0,
        description="KTO learning rate (LoRA); 1e-3 found by experiment on SmolLM2 "
        "(bench/live_loop.py, docs/live-loop.md).",
    )
    sft_lr: float = Field(1e-4, gt=0, description="SFT learning rate (LoRA).")
    dpo_lr: float = Field(1e-5, gt=0, description="DPO learning rate (LoRA; tinker-cookbook's value).")
    beta: float = Field(0.1, gt=0, description="KTO/DPO beta.")
    lora_rank: int = Field(
        8, ge=1, le=512, description="Rank of new lineages' adapters (RL-style signals need little rank)."
    )
    lora_alpha: float = Field(32.0, gt=0, description="LoRA alpha of new lineages' adapters.")
    grad_clip_norm: float = Field(1.0, ge=0, description="Global L2 gradient clip per step (0 = none).")
    adam_eps: float = Field(
        1e-8,
        gt=0,
        description="AdamW's epsilon of live-loop steps (added to the root of the second moment before dividing).",
    )
    save_optimizer: bool = Field(
        True, description="Store AdamW state with each version (exact resume after a restart)."
    )
    device: str = Field("cpu", description="Torch device for training.")
    rater_max_events: int = Field(
        120,
        ge=0,
        description="Most events one rater (user, else API key) may send per "
        "lineage in rater_window_s; the rest is quarantined "
        "(kept, not trained). 0: no limit.",
    )
    rater_window_s: float = Field(3600.0, gt=0, description="Window of the per-rater limit (s).")
    quota_retry_s: float = Field(
        30.0,
        gt=0,
        description="A live-loop step held back by the tenant's "
        "max_adapter_versions or max_adapter_bytes (nothing could be freed) is tried "
        "again after this many seconds; its signals stay queued.",
    )
    rater_max_batch_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Largest share of one training batch from one rater while several raters are queued.",
    )
    rater_agreement: bool = Field(
        True,
        description="Weight each rater's KTO/DPO examples by its agreement with "
        "the other raters of the same completions (trainer/signal_governor.py).",
    )
    rater_agreement_window: int = Field(
        2000, ge=2, description="Newest labels per lineage the agreement weights are computed from."
    )
    lora_targets: Literal["all", "attn", "mlp"] = Field(
        "all", description="Module groups of new lineages' adapters: attention + MLP, attention only or MLP only."
    )
    lr_warmup_steps: int = Field(
        3,
        ge=0,
        le=1000,
        description="Live steps of a lineage over which its learning rate rises linearly to the full rate: "
        "step n (from 1) uses min(1, n / lr_warmup_steps) of it (0: the full rate from the first step).",
    )
    rehearsal_per_step: int = Field(
        4,
        ge=0,
        le=64,
        description="Prompts of the rehearsal pool (rotating) whose base-model greedy replies each live step "
        "also trains on (0: none); their tokens are not metered to the tenant.",
    )
    rehearsal_pool: Literal["capability", "general"] = Field(
        "capability",
        description="The rehearsal pool: questions of the capability check's kinds, disjoint from its items "
        "(trainer/rails/rehearsal_capability.jsonl), or everyday open prompts (rehearsal_prompts.jsonl).",
    )
    rehearsal_weight: float = Field(
        0.2,
        ge=0,
        description="Coefficient of the rehearsal cross-entropy on the base model's replies (mean nats per reply "
        "token; with the KL, the measured default: docs/live-loop.md).",
    )
    rehearsal_max_tokens: int = Field(48, ge=4, le=256, description="Longest base reply to a rehearsal prompt.")
    kl_coef: float = Field(
        0.5,
        ge=0,
        description="Coefficient of KL(base || new) per token over the vocabulary at the rehearsal replies' "
        "positions (0: none; needs rehearsal_per_step > 0; 0.5 measured, docs/live-loop.md).",
    )

    trained_kl_coef: float = Field(
        0.0,
        ge=0,
        description="Coefficient of KL(base || new) per token over the vocabulary at the positions a live step "
        "trains (the rated, preferred or demonstrated replies themselves; 0: none; single-process trainers only, as "
        "rehearsal; docs/live-loop.md).",
    )

    @model_validator(mode="after")
    def _kl_needs_prompts(self) -> TrainingSection:
        if self.kl_coef > 0 and self.rehearsal_per_step == 0:
            raise ValueError("kl_coef > 0 needs rehearsal_per_step > 0 (the KL is taken on the rehearsal prompts)")
        return self

    @property
    def lora(self) -> LoraConfig:
        """Shape of new lineages' adapters: ``lora_rank``/``lora_alpha`` on ``lora_targets`` (not the unembedding)."""
        t = self.lora_targets
        return LoraConfig(
            rank=self.lora_rank,
            alpha=self.lora_alpha,
            train_unembed=False,
            train_attn=t != "mlp",
            train_mlp=t != "attn",
        )


class GateSection(Section):
    """The evaluation gate of the live loop (``trainer/gate_measure.py``, docs/rails.md): whether the
    trainer evaluates each new version before gateways may serve it, and how. The pass/fail thresholds are per
    endpoint (:class:`livelora.core.rails.GateThresholds`, set with ``livelora endpoints gate``)."""

    gate_enabled: bool = Field(
        True,
        description="Evaluate every new live-loop version (probes, drift, "
        "degeneracy, held-out signal) before it may serve.",
    )
    gate_holdout_every: int = Field(
        10,
        ge=0,
        description="One in this many ratings/preference pairs (by event "
        "id hash) is held out from training for the signal "
        "check (0: none).",
    )
    gate_heldout_max: int = Field(
        8, ge=0, description="Newest held-out examples per lineage the signal check scores (each costs a forward pass)."
    )
    gate_gen_tokens: int = Field(
        24, ge=4, le=256, description="Greedy tokens generated per open prompt for the degeneracy check."
    )
    gate_freeform_items: int = Field(
        60,
        ge=0,
        le=10000,
        description="Most capability items (a stratified sample of trainer/rails/freeform_gate.jsonl) whose greedy "
        "free-form replies the gate judges per candidate, stopping earlier once the verdict is clear (0: no "
        "free-form check; docs/rails.md, 'Judging the replies users get').",
    )
    gate_freeform_chunk: int = Field(
        30, ge=1, description="Free-form items generated in one batch, between which the gate may stop early."
    )
    gate_min_step_scale: float = Field(
        0.125,
        gt=0,
        le=1,
        description="Smallest fraction of a rejected step the gate's line search tries: the step θ₁ − θ₀ is "
        "scaled by 1, 1/2, 1/4, ... down to this, and the largest that passes is published (1: no line search).",
    )


class GroupSection(Section):
    """A trainer group (``livelora trainer --nproc N``, docs/scaling-out.md) and which session models an op
    executor takes (every trainer reads the ``take_*`` fields; a group with large-model settings, single trainers
    with small-model ones)."""

    group_backend: str | None = Field(
        None, description="Backend of a trainer group: gloo or nccl (default nccl on CUDA, else gloo)."
    )
    group_timeout_s: float = Field(
        300.0,
        gt=0,
        description="A collective of a trainer group waits this long for a hung rank before the group fails (a dead "
        "rank fails it at once); rank 0 then gives its leases back.",
    )
    group_shard_base: bool = Field(
        False,
        description="A trainer group shards each training model's frozen base weights over its ranks with FSDP2 "
        "(fully_shard; the LoRA weights and AdamW state stay whole on every rank), for base models larger than one "
        "device.",
    )
    take_tenants: str = Field(
        "", description="Comma-separated tenants whose training-session models this trainer takes (empty: all)."
    )
    take_min_base_params: int = Field(
        0, ge=0, description="Take session models only when the base model has at least this many parameters."
    )
    take_max_base_params: int = Field(
        0, ge=0, description="Take session models only when the base model has at most this many parameters (0: any)."
    )
    take_memory_share: float = Field(
        0.8,
        gt=0,
        le=1,
        description="Take session models only when the base weights fit in this share of one rank's device memory "
        "(a GPU's, or the machine's RAM divided by the ranks on it).",
    )


class TrainerSettings(ProcessSettings):
    """The trainer process's settings: common fields plus ``training``, ``gate``, ``sessions``, ``observability``
    ``quotas`` and ``group`` sections."""

    training: TrainingSection = Field(default_factory=TrainingSection)
    gate: GateSection = Field(default_factory=GateSection)
    sessions: SessionSection = Field(default_factory=SessionSection)
    observability: ObservabilitySection = Field(default_factory=ObservabilitySection)
    quotas: QuotaSection = Field(default_factory=QuotaSection)
    group: GroupSection = Field(default_factory=GroupSection)
