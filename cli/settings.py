"""The settings object of ``livelora serve`` (gateway and trainer started by one command) and the list of every
process kind's settings class (what ``docker-compose.yml``'s variables are checked against)."""

from __future__ import annotations

from pydantic import Field

from livelora.core.settings import Section
from livelora.gateway.settings import GatewaySettings
from livelora.trainer.settings import GateSection, TrainerSettings, TrainingSection


class PlacementSection(Section):
    """Where ``livelora serve`` runs its trainer, and with what share of the machine (serving first:
    :mod:`livelora.cli.trainer_process`). Environment ``LIVELORA_TRAINER_PROCESS``, ``LIVELORA_TRAINER_NICE``,
    ``LIVELORA_TRAINER_THREADS``, ``LIVELORA_TRAINER_THREADS_IDLE``, ``LIVELORA_TRAINER_DUTY_WHILE_SERVING``."""

    trainer_process: bool = Field(
        True,
        description="Run the trainer (signal worker + op executor) in a supervised "
        "child process with lower CPU priority; false runs it in "
        "threads of the serving process.",
    )
    trainer_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="Added to the trainer process's nice value (0-19): "
        "decode steps are scheduled before training steps.",
    )
    trainer_threads: int | None = Field(
        None, ge=1, description="Torch threads of the trainer process (default: half the cores, at least 1)."
    )
    trainer_threads_idle: int | None = Field(
        None,
        ge=0,
        description="Torch threads of the trainer process for a "
        "step that starts while no request has been "
        "served on this machine for 2 s (default: all "
        "cores; 0: always trainer_threads).",
    )
    trainer_duty_while_serving: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Largest share of wall time the trainer process spends in training steps while requests are "
        "served on this machine: it pauses between the passes of a step and defers the next step (of any "
        "lineage or segment) until the last one's share is paid; 1: never pauses. Why 0.5: "
        "docs/serving-while-training.md.",
    )


class ServeSettings(GatewaySettings):
    """``livelora serve``: the gateway's sections plus the trainer's ``training`` and ``gate`` sections (same
    variables) and ``placement`` (the trainer process)."""

    training: TrainingSection = Field(default_factory=TrainingSection)
    gate: GateSection = Field(default_factory=GateSection)
    placement: PlacementSection = Field(default_factory=PlacementSection)

    def trainer_settings(self) -> TrainerSettings:
        """The settings of the in-process trainer worker: the same store, model, Redis and sections."""
        return TrainerSettings(
            home=self.home,
            model=self.model,
            redis_url=self.redis_url,
            redis_prefix=self.redis_prefix,
            training=self.training,
            gate=self.gate,
            sessions=self.sessions.model_copy(update={"served_model_name": self.model_id}),
            observability=self.observability,
            quotas=self.quotas,
        )


#: One settings class per process kind.
PROCESS_SETTINGS = (GatewaySettings, TrainerSettings, ServeSettings)
