"""The online training backend: turns a scheduled batch into one optimizer step and one new adapter version.

:class:`OnlineTrainer` keeps one :class:`~livelora.trainer.model.TrainingModel` per lineage, started from the
lineage's newest stored version (or a fresh adapter with ``lora_B = 0``); :meth:`OnlineTrainer.train` runs
``forward_backward`` + ``optim_step`` + ``save_state`` as named phases (:mod:`livelora.trainer.live_step`), so
every update is a new immutable version ``<lineage>@<n+1>`` whose manifest names its parent. Datums are built per
event from the exact served token ids or the chat template (:mod:`livelora.core.chat_tokens`): a rating →
``kto``, a demonstration → ``cross_entropy``, a preference → two ``dpo`` datums; :meth:`OnlineTrainer.screen`
names the events that cannot be trained. The datum layouts: ``docs/internals/live-training.md``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from livelora.adapters.store import AdapterStore, Manifest
from livelora.clients.errors import BadRequestError
from livelora.clients.types.signals import ChatMessage, DemonstrationEvent, PreferenceEvent, RatingEvent
from livelora.clients.types.tinker import Datum
from livelora.core.base_models import BaseModelRef, base_identity
from livelora.core.cpu_share import TrainingFlag
from livelora.core.metering import Meter
from livelora.trainer.event_datums import EventDatums
from livelora.trainer.judge import StepJudge
from livelora.trainer.live_step import LiveStep, StepData, StepReport, Unjudged
from livelora.trainer.scheduler import Batch
from livelora.trainer.settings import GateSection, TrainingSection


class OnlineTrainer:
    """Implements :class:`~livelora.trainer.worker.TrainingBackend` with real TrainingModels.

    Args:
        base_ref: the base model every lineage is trained on.
        home: ``LIVELORA_HOME`` (adapter store).
        config: hyperparameters (``lora``, ``kto_lr``, ``sft_lr``, ``dpo_lr``, ``beta``, ``grad_clip_norm``,
            ``adam_eps``, ``save_optimizer``, ``device``); default: the environment's.
        meter, redis: count each step's ``model_input`` tokens (kind ``live_trained``) per endpoint of its events
            for the endpoint's tenant (``None``: not metered).
        gate: the evaluation gate's settings (:mod:`livelora.trainer.gate`); ``None`` or ``gate_enabled``
            false: no gate, every version is published unjudged.
    """

    def __init__(
        self,
        base_ref: BaseModelRef,
        home: Path | str,
        config: TrainingSection | None = None,
        gate: GateSection | None = None,
        *,
        meter: Meter | None = None,
        redis: Any = None,
    ):
        self.base_ref = base_ref
        self.home = Path(home)
        self.meter, self.redis = meter, redis
        self.report = StepReport(self.home, meter, redis)  # the step's metrics, metering and logs
        self.store = AdapterStore(home)
        self.busy = TrainingFlag(home)
        self.config = config or TrainingSection()
        self.examples = EventDatums(base_ref, self.config)
        self.rehearsal = None  # the base model's replies to general prompts, trained along (trainer/rehearsal.py)
        if self.config.rehearsal_per_step:
            from livelora.trainer.rehearsal import Rehearsal

            self.rehearsal = Rehearsal(base_ref, self.home, self.examples, self.config, base_identity(base_ref))
        self.gate_config = gate if gate is not None and gate.gate_enabled else None
        self._gate = None
        self._models: dict[str, Any] = {}
        self._fresh = None  # a TrainingModel built ahead by warm_up(), taken by the next lineage model_for() needs
        self._base_thread: threading.Thread | None = None
        self.progress: Any = None  # (lineage | None, stage, **fields) → the learning status (learning_status.py)

    def warm_up(self) -> None:
        """Load the tokenizer and build one TrainingModel (base weights, LoRA layers of ``config.lora``) ahead of
        time, so that the first update of a lineage does not pay for them (about 2 s of a first KTO step of
        ~10 s on the 2-core CPU). :meth:`model_for` takes it for a new lineage, or loads a stored version
        into it when the shapes agree. Idempotent."""
        from livelora.trainer.model import TrainingModel

        _ = self.tokenizer
        if self._fresh is None:
            self._fresh = TrainingModel(self.base_ref, self.config.lora, device=self.config.device)
        if self.rehearsal is not None:
            self.rehearsal.in_background()
        if self.gate is not None and self._base_thread is None:  # the gate's base measurement, in the background
            self._base_thread = self.gate.base_measure.in_background(self._fresh, self.busy, self._report)

    def _report(self, lineage: str | None, stage: str, **fields: Any) -> None:
        if self.progress is not None:
            self.progress(lineage, stage, **fields)

    @property
    def gate(self):
        """The :class:`~livelora.trainer.gate.EvaluationGate` (built on first use), or ``None`` without one."""
        if self.gate_config is None:
            return None
        if self._gate is None:
            from livelora.trainer.gate import EvaluationGate

            g = self.gate_config
            self._gate = EvaluationGate(
                self.tokenizer,
                self.home,
                self.examples.chat_pair,
                holdout_every=g.gate_holdout_every,
                heldout_max=g.gate_heldout_max,
                gen_tokens=g.gate_gen_tokens,
                freeform_items=g.gate_freeform_items,
                freeform_chunk=g.gate_freeform_chunk,
                base_id=base_identity(self.base_ref),
            )
        return self._gate

    def hold_out(self, lineage: str, event: RatingEvent | DemonstrationEvent | PreferenceEvent) -> bool:
        """Whether the worker should keep ``event`` out of training for the gate's signal check (the gate keeps
        it; the worker acknowledges it, it is already in the dataset of record)."""
        gate = self.gate
        return gate is not None and gate.hold_out(lineage, event)

    def trains_from(self, lineage: str) -> int | None:
        """The stored version the lineage's in-memory model was last saved as or loaded from (``None``: none yet);
        the worker never prunes it."""
        model = self._models.get(lineage)
        return getattr(model, "parent", None) if model is not None and model.lineage == lineage else None

    def model_for(self, lineage: str):
        """The lineage's TrainingModel, resumed from its newest version that the gate did not reject (the
        newest version if none was judged; AdamW's first moment zeroed when a held-back version followed it)."""
        from livelora.trainer.model import TrainingModel

        model = self._models.get(lineage)
        if model is None:
            stored = self.store.list(lineage)
            versions = [m for m in stored if not (m.gate or {}).get("continued_from")]
            if self._base_thread is not None and self._fresh is not None:
                waited = self._base_thread.is_alive()
                if waited:
                    self._report(lineage, "training", check="waiting for the gate's base measurement (once per store)")
                self._base_thread.join()  # the start-up base measurement runs on the model built ahead
                if waited:
                    self._report(lineage, "training")
            fresh, self._fresh = self._fresh, None
            if versions:
                latest = versions[-1]
                if fresh is not None:
                    try:  # load_state checks everything before it changes the model
                        fresh.load_state(self.store, lineage, latest.version, with_optimizer=latest.has_optimizer)
                        model = fresh
                    except BadRequestError:  # another LoRA shape: build one like the version below
                        pass
                if model is None:
                    model = TrainingModel.from_version(
                        self.base_ref,
                        self.store,
                        lineage,
                        latest.version,
                        with_optimizer=latest.has_optimizer,
                        device=self.config.device,
                    )
                if stored[-1].version != latest.version:  # held back after it: as after a hold-back in this process
                    from livelora.trainer.gate import forget_direction

                    forget_direction(model.optimizer)
            else:
                model = fresh or TrainingModel(self.base_ref, self.config.lora, device=self.config.device)
            self._models[lineage] = model
        return model

    # ------------------------------------------------------------------ events → datums (:class:`EventDatums`)

    @property
    def tokenizer(self):
        return self.examples.tokenizer

    def chat_pair(self, prompt: list[ChatMessage], reply: str) -> tuple[list[int], list[int]]:
        return self.examples.chat_pair(prompt, reply)

    def rated_completion(self, ev: RatingEvent) -> list[int]:
        return self.examples.rated_completion(ev)

    def event_datums(self, ev: RatingEvent | DemonstrationEvent | PreferenceEvent) -> list[Datum]:
        return self.examples.event_datums(ev)

    def datums(self, batch: Batch) -> tuple[list[Datum], str, dict[str, float], float]:
        return self.examples.datums(batch)

    def screen(self, batch: Batch) -> dict[int, str]:
        """The events of ``batch`` the lineage's model cannot train (:meth:`EventDatums.screen`)."""
        model = self.model_for(batch.lineage)
        return self.examples.screen(batch, model.max_seq_len, model.vocab_size)

    # ------------------------------------------------------------------ one step

    def train(self, batch: Batch) -> Manifest:
        """One optimizer step on ``batch`` and one new version of ``batch.lineage``, in named phases
        (:mod:`livelora.trainer.live_step`): datums → step → judge → save → report, the judge (the evaluation
        gate's one entry, or none) driving the step and the save.

        Returns:
            The new version's manifest (``parent`` = the version trained from, ``metrics`` = the step's
            loss metrics, ``grad_norm``, ``update_norm``, the class weights and the event count).

        Raises:
            BadRequestError: bad data (nothing changes in the model: validation runs before the step).
        """
        data = StepData(*self.datums(batch))
        started = time.monotonic()
        run = LiveStep(
            self.model_for(batch.lineage),
            batch,
            data,
            self.config,
            rehearsal=self.rehearsal,
            busy=self.busy,
            store=self.store,
            progress=self._report,
        )
        judged = self.judge(run)
        self.report(run, judged, time.monotonic() - started)
        return judged.manifest

    @property
    def judge(self) -> StepJudge | Unjudged:
        """The step's judge: the evaluation gate's :class:`~livelora.trainer.judge.StepJudge`, or
        :class:`~livelora.trainer.live_step.Unjudged` without a gate."""
        gate = self.gate
        if gate is None:
            return Unjudged()
        return StepJudge(gate, self.gate_config.gate_min_step_scale, self._report)

    def path_of(self, manifest: Manifest) -> Path:
        """Directory of a version."""
        return self.store.version_dir(manifest.lineage, manifest.version)
