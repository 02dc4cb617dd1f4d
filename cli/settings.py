"""The settings object of ``livelora serve`` (gateway and trainer in one process) and the list of every
process kind's settings class (what ``docker-compose.yml``'s variables are checked against)."""

from __future__ import annotations

from pydantic import Field

from livelora.gateway.settings import GatewaySettings
from livelora.trainer.settings import GateSection, TrainerSettings, TrainingSection


class ServeSettings(GatewaySettings):
    """``livelora serve``: the gateway's sections plus the trainer's ``training`` and ``gate`` sections (same
    variables)."""

    training: TrainingSection = Field(default_factory=TrainingSection)
    gate: GateSection = Field(default_factory=GateSection)

    def trainer_settings(self) -> TrainerSettings:
        """The settings of the in-process trainer worker: the same store, model, Redis and sections."""
        return TrainerSettings(home=self.home, model=self.model, redis_url=self.redis_url,
                               redis_prefix=self.redis_prefix, training=self.training, gate=self.gate,
                               sessions=self.sessions.model_copy(update={"served_model_name": self.model_id}))


#: One settings class per process kind.
PROCESS_SETTINGS = (GatewaySettings, TrainerSettings, ServeSettings)
