"""The online training backend: turns a scheduled batch into one optimizer step and one new adapter version.

:class:`OnlineTrainer` keeps one :class:`~livelora.trainer.model.TrainingModel` per lineage, started from the
lineage's newest stored version (or a fresh adapter with ``lora_B = 0``); :meth:`OnlineTrainer.train` runs
``forward_backward`` + ``optim_step`` + ``save_state``, so every update is a new immutable version
``<lineage>@<n+1>`` whose manifest names its parent. Datums are built per event from the exact served token ids
or the chat template (:mod:`livelora.core.chat_tokens`): a rating → ``kto``, a demonstration → ``cross_entropy``,
a preference → two ``dpo`` datums; :meth:`OnlineTrainer.screen` names the events that cannot be trained. The
datum layouts: ``docs/internals/live-training.md``.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from livelora.adapters.endpoints import EndpointStore
from livelora.adapters.store import AdapterStore, Manifest
from livelora.clients.errors import BadRequestError
from livelora.clients.types.signals import ChatMessage, DemonstrationEvent, PreferenceEvent, RatingEvent
from livelora.clients.types.tinker import AdamParams, Datum
from livelora.core import metrics as prom
from livelora.core.api_keys import DEFAULT_TENANT
from livelora.core.base_models import BaseModelRef, base_identity
from livelora.core.cpu_share import TrainingFlag, training_step
from livelora.core.metering import Meter, Usage
from livelora.trainer.event_datums import EventDatums
from livelora.trainer.gate import record_verdicts
from livelora.trainer.line_search import line_search, step_scales
from livelora.trainer.scheduler import Batch
from livelora.trainer.settings import GateSection, TrainingSection

log = logging.getLogger(__name__)


class OnlineTrainer:
    """Implements :class:`~livelora.trainer.worker.TrainingBackend` with real TrainingModels.

    Args:
        base_ref: the base model every lineage is trained on.
        home: ``LIVELORA_HOME`` (adapter store).
        config: hyperparameters (``lora``, ``kto_lr``, ``sft_lr``, ``dpo_lr``, ``beta``, ``grad_clip_norm``,
            ``save_optimizer``, ``device``); default: the environment's.
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
            self._base_thread = self.gate.base_in_background(self._fresh, self.busy, self._report)

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
                self._base_thread.join()  # the start-up base measurement runs on the model built ahead
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
        """One optimizer step on ``batch`` and one new version of ``batch.lineage``.

        Returns:
            The new version's manifest (``parent`` = the version trained from, ``metrics`` = the step's
            loss metrics, ``grad_norm``, ``update_norm``, the class weights and the event count).

        Raises:
            BadRequestError: bad data (nothing changes in the model: validation runs before the step).
        """
        data, loss_fn, cfg, lr = self.datums(batch)
        started = time.monotonic()
        model = self.model_for(batch.lineage)
        gate = self.gate
        if gate is not None:
            gate.distrusted = {r for r, a in (getattr(batch, "rater_weights", None) or {}).items() if a < 0.5}
            label = f"{batch.lineage}@{model.parent}" if model.parent else "base"
            tell = lambda c: self._report(batch.lineage, "training", detail=f"measuring {c} for the gate")  # noqa: E731
            gate.before_step(model, batch.lineage, label, on_check=tell)
        # a trainer process: its duty while serving, all cores while nothing is served (cpu_share); the engine on
        # this machine leaves a core to the step while the flag is held
        with training_step(), self.busy.held():
            stepped = False
            try:
                self._report(batch.lineage, "training", detail="forward/backward and optimizer step")
                # rehearsal + KL gradients add to the batch's before the one optimizer step (not metered: _observe)
                extra = self.rehearsal.add_gradients(model) if self.rehearsal and model.group is None else {}
                out = model.forward_backward(data, loss_fn, cfg, loss_positions_only=True)  # only metrics are read
                opt = model.optim_step(
                    AdamParams(learning_rate=lr, grad_clip_norm=self.config.grad_clip_norm, eps=1e-8)
                )
                stepped = True
                result = new = None
                if gate is not None:  # the largest fraction of the step that passes (trainer/line_search.py)
                    tell = lambda c, a: self._report(batch.lineage, "gate", check=c, step_scale=a)  # noqa: E731
                    scales = step_scales(self.gate_config.gate_min_step_scale)
                    result, new, passed = line_search(gate, model, batch.lineage, batch.endpoint, scales, tell)
                    opt["update_norm:mean"] *= result.step_scale  # θ_α − θ₀ = α·(θ₁ − θ₀)
                    if not passed:
                        result.continued_from = result.against
            except BaseException:
                model.zero_grad()
                if gate is not None and stepped:
                    gate.settle(model, batch.lineage, False, "", None)  # undo a step whose judging failed
                raise
        metrics = {**out.metrics, **opt, **extra, "events:sum": float(len(batch.events))}
        if loss_fn == "kto":
            metrics.update(
                {"desirable_weight:mean": batch.desirable_weight, "undesirable_weight:mean": batch.undesirable_weight}
            )
        if getattr(batch, "example_weights", None) is not None:
            metrics["example_weight:mean"] = sum(batch.example_weights) / max(len(batch.example_weights), 1)
        save = model.save_state if self.config.save_optimizer else model.save_weights
        gate_dict = result.model_dump(mode="json") if result is not None else None
        manifest = save(self.store, batch.lineage, metrics=metrics, gate=gate_dict)
        self._observe(batch, data, time.monotonic() - started, metrics.get("loss:sum"))
        completions = [
            c
            for ev in batch.events
            for c in (
                getattr(ev, "completion_id", None),
                getattr(ev, "chosen_completion_id", None),
                getattr(ev, "rejected_completion_id", None),
            )
            if c
        ]
        log.info(
            "trained %s on %d %s event(s)",
            manifest.name,
            len(batch.events),
            loss_fn,
            extra={
                "version": manifest.name,
                "endpoint": batch.endpoint,
                "event_ids": [e.id for e in batch.events],
                "completion_ids": completions or None,
            },
        )
        log.info(
            "%s: %s step on %d events, loss %.4f",
            manifest.name,
            loss_fn,
            len(batch.events),
            metrics.get("loss:sum", float("nan")),
        )
        if gate is not None:
            passed = result.continued_from is None
            gate.settle(model, batch.lineage, passed, manifest.name, new)
            record_verdicts(gate.endpoints, result, manifest.name)
            tries = result.line_search
            prom.GATE_CANDIDATES.labels(batch.endpoint, "passed").inc(sum(t.passed for t in tries))
            prom.GATE_CANDIDATES.labels(batch.endpoint, "rejected").inc(sum(not t.passed for t in tries))
            if passed:
                prom.STEP_SCALE.labels(batch.endpoint).set(result.step_scale)
            log.info(
                "%s: evaluation gate %s in %.2f s (%s)%s",
                manifest.name,
                f"passed at step scale {result.step_scale:g}" if passed else "REJECTED",
                result.seconds,
                ", ".join(
                    f"α {t.step_scale:g} " + ("passed" if t.passed else "failed " + "+".join(t.failed)) for t in tries
                ),
                "" if passed else f"; training continues from {result.continued_from}",
            )
        return manifest

    def _observe(self, batch: Batch, data: list[Datum], seconds: float, loss: float | None) -> None:
        """Metrics of a published step and its metered tokens: datum ``i`` (KTO, SFT) or ``2i, 2i+1`` (DPO)
        belong to event ``i``, whose endpoint (and that endpoint's tenant) they are counted for."""
        per = len(data) // max(len(batch.events), 1)
        tokens: dict[str, int] = {}
        for i, ev in enumerate(batch.events):
            tokens[ev.endpoint] = tokens.get(ev.endpoint, 0) + sum(
                d.model_input.length for d in data[i * per : (i + 1) * per]
            )
            prom.SIGNALS.labels("trained", ev.type).inc()
        prom.TRAIN_STEP.labels(batch.endpoint).observe(seconds)
        if loss is not None:
            prom.TRAIN_LOSS.labels(batch.endpoint).set(loss)
        if self.meter is None or self.redis is None:
            return
        endpoints = EndpointStore(self.home)
        for endpoint, n in tokens.items():
            try:
                tenant = endpoints.get(endpoint).tenant or DEFAULT_TENANT
                self.meter.record_sync(self.redis, Usage(tenant, None, endpoint, {"live_trained": n}))
            except Exception as exc:
                prom.REDIS_ERRORS.labels("metering").inc()
                log.warning("could not meter %d live-loop tokens of %s: %s", n, endpoint, exc)

    def path_of(self, manifest: Manifest) -> Path:
        """Directory of a version."""
        return self.store.version_dir(manifest.lineage, manifest.version)
