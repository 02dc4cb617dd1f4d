"""Settings of a trainer process (``LIVELORA_`` environment prefix; CLI flags override).

Example::

    settings = TrainerSettings(kto_min_batch=4, max_wait_s=10)
    worker = build_worker(settings)
"""

from __future__ import annotations

from pydantic import Field

from livelora.adapters.settings import BaseSettings


class TrainerSettings(BaseSettings):
    """Fields of the online trainer. Environment: ``LIVELORA_KTO_MIN_BATCH``, ``LIVELORA_MAX_WAIT_S``, ..."""

    consumer: str | None = Field(None, description="Consumer name in the 'trainers' group (default host-pid); "
                                                   "reuse it after a restart to resume this worker's pending events.")
    kto_min_batch: int = Field(8, ge=2, description="Ratings that trigger a KTO step.")
    sft_min_batch: int = Field(4, ge=1, description="Demonstrations that trigger an SFT step.")
    dpo_min_batch: int = Field(4, ge=1, description="Preference pairs that trigger a DPO step.")
    max_batch: int = Field(32, ge=2, description="Most events in one step.")
    max_wait_s: float = Field(30.0, ge=0, description="Seconds the oldest queued event waits before a smaller "
                                                      "batch is trained (KTO needs at least 2).")
    claim_idle_s: float = Field(120.0, gt=0, description="Events pending this long in a dead worker are reclaimed.")
    kto_lr: float = Field(1e-3, gt=0, description="KTO learning rate (LoRA); 1e-3 found by experiment on SmolLM2 (bench/live_loop.py, README live loop).")
    sft_lr: float = Field(1e-4, gt=0, description="SFT learning rate (LoRA).")
    dpo_lr: float = Field(1e-5, gt=0, description="DPO learning rate (LoRA).")
    beta: float = Field(0.1, gt=0, description="KTO/DPO beta.")
    lora_rank: int = Field(8, ge=1, le=512, description="Rank of new lineages' adapters.")
    lora_alpha: float = Field(32.0, gt=0, description="LoRA alpha of new lineages' adapters.")
    device: str = Field("cpu", description="Torch device for training.")
