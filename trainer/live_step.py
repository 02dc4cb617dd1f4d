"""The live loop's training step in named phases: datums → step → judge → save → report.

:meth:`OnlineTrainer.train <livelora.trainer.online.OnlineTrainer.train>` calls three things in order: the batch's
datums (:class:`StepData`, built by :class:`~livelora.trainer.event_datums.EventDatums`), a judge given a
:class:`LiveStep` (one batch on its lineage's model), and :class:`StepReport` (metrics, metering, logs). The judge
is the evaluation gate's one entry per step (:class:`~livelora.trainer.judge.StepJudge`) or :class:`Unjudged`
without a gate; it holds the :func:`training_flags`, runs :meth:`LiveStep.step`, and ends with :func:`save`
(the gate measures the weights before the step and settles after the save). The phases:
``docs/internals/live-training.md``, "The training step".
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from livelora.adapters.endpoints import EndpointStore
from livelora.adapters.store import AdapterStore, Manifest
from livelora.clients.types.tinker import AdamParams, Datum
from livelora.core import metrics as prom
from livelora.core.api_keys import DEFAULT_TENANT
from livelora.core.cpu_share import TrainingFlag, training_step
from livelora.core.metering import Meter, Usage
from livelora.core.rails import GateResult
from livelora.trainer.rehearsal import trained_kl_gradients
from livelora.trainer.scheduler import Batch
from livelora.trainer.settings import TrainingSection

#: the step's log lines keep the logger they were written under before the phases had a module of their own
log = logging.getLogger("livelora.trainer.online")


@dataclass
class StepData:
    """The datums phase's output (:meth:`EventDatums.datums <livelora.trainer.event_datums.EventDatums.datums>`):
    the batch's datums, their loss, its config and the learning rate."""

    data: list[Datum]
    loss_fn: str
    cfg: dict[str, float]
    lr: float


@dataclass
class Judged:
    """What a judge returns: the version written, the step's metrics as in its manifest, and the gate's result
    (``None``: no gate)."""

    manifest: Manifest
    metrics: dict[str, float]
    result: GateResult | None = None


class LiveStep:
    """The step phase of one live-loop batch on its lineage's model (and what :func:`save` writes it with).

    Args:
        model: the lineage's :class:`~livelora.trainer.model.TrainingModel`.
        batch, data: the batch and its datums.
        config: the step's hyperparameters (``grad_clip_norm``, ``adam_eps``, ``save_optimizer``).
        rehearsal: a :class:`~livelora.trainer.rehearsal.Rehearsal` whose gradients are added, or ``None``.
        busy: the store's training flag, held while the step runs (:func:`training_flags`).
        store: where :func:`save` writes the version.
        progress: ``(lineage, stage, **fields)`` → the learning status.
    """

    def __init__(
        self,
        model: Any,
        batch: Batch,
        data: StepData,
        config: TrainingSection,
        *,
        rehearsal: Any,
        busy: TrainingFlag,
        store: AdapterStore,
        progress: Callable[..., None],
    ):
        self.model, self.batch, self.data, self.config = model, batch, data, config
        self.rehearsal, self.busy, self.store, self.progress = rehearsal, busy, store, progress

    def step(self) -> dict[str, float]:
        """``forward_backward`` (rehearsal and KL gradients added first, not metered; alone, not in a trainer group)
        and one AdamW step.

        Returns:
            The step's metrics: the loss's, ``grad_norm``, ``update_norm:mean``, ``events:sum`` and the class and
            example weights.
        """
        model, batch, d = self.model, self.batch, self.data
        self.progress(batch.lineage, "training", detail="forward/backward and optimizer step")
        alone = model.group is None
        extra = self.rehearsal.add_gradients(model) if self.rehearsal and alone else {}
        if self.config.trained_kl_coef > 0 and alone:
            extra |= trained_kl_gradients(model, d.data, self.config.trained_kl_coef)
        if not alone and (self.rehearsal or self.config.trained_kl_coef > 0):
            _warn_group_skips()
        out = model.forward_backward(d.data, d.loss_fn, d.cfg, loss_positions_only=True)  # only metrics are read
        warm = self.config.lr_warmup_steps
        lr = d.lr * min(1.0, (model.step + 1) / warm) if warm else d.lr
        adam = AdamParams(learning_rate=lr, grad_clip_norm=self.config.grad_clip_norm, eps=self.config.adam_eps)
        opt = model.optim_step(adam)
        metrics = {**out.metrics, **opt, **extra, "events:sum": float(len(batch.events))}
        if d.loss_fn == "kto":
            metrics["desirable_weight:mean"] = batch.desirable_weight
            metrics["undesirable_weight:mean"] = batch.undesirable_weight
        weights = getattr(batch, "example_weights", None)
        if weights is not None:
            metrics["example_weight:mean"] = sum(weights) / max(len(weights), 1)
        return metrics


@functools.cache
def _warn_group_skips() -> None:
    """Said once per process: a trainer group's live steps run without rehearsal and the KL terms."""
    log.warning(
        "a trainer group's live-loop steps run without rehearsal and the KL terms (rehearsal_per_step, kl_coef, "
        "trained_kl_coef: not built for groups; docs/scaling-out.md): run the live loop on single trainers to keep them"
    )


@contextlib.contextmanager
def training_flags(run: LiveStep) -> Iterator[None]:
    """Hold the training flags around ``run``'s step and what judges it: a trainer process gets its duty while
    serving, all cores while nothing is served, and the engine on this machine leaves a core to the step
    (core/cpu_share.py). When what runs inside fails, the gradients are dropped. A guard held by the judge, not a
    phase: the judge decides how long the step's work lasts."""
    with training_step(), run.busy.held():
        try:
            yield
        except BaseException:
            run.model.zero_grad()
            raise


def save(run: LiveStep, metrics: dict[str, float], result: GateResult | None) -> Manifest:
    """The save phase: write ``run``'s model as its lineage's next version (with AdamW state when
    ``save_optimizer``), the manifest holding ``metrics`` and the gate's ``result`` (``None``: no gate)."""
    model = run.model
    write = model.save_state if run.config.save_optimizer else model.save_weights
    gate = result.model_dump(mode="json") if result is not None else None
    return write(run.store, run.batch.lineage, metrics=metrics, gate=gate)


class Unjudged:
    """The judge without an evaluation gate: the step, then the save; every version is published unjudged."""

    def __call__(self, run: LiveStep) -> Judged:
        with training_flags(run):
            metrics = run.step()
        return Judged(save(run, metrics, None), metrics)


class StepReport:
    """The report phase: the step's Prometheus metrics, its metered tokens and its log lines, gate's included.

    Args:
        home: ``LIVELORA_HOME`` (endpoints, for the tenant of each metered endpoint).
        meter, redis: count each step's ``model_input`` tokens (kind ``live_trained``) per endpoint of its events
            for the endpoint's tenant (either ``None``: not metered).
    """

    def __init__(self, home: Path, meter: Meter | None, redis: Any):
        self.home, self.meter, self.redis = home, meter, redis

    def __call__(self, run: LiveStep, judged: Judged, seconds: float) -> None:
        """Report a written step that took ``seconds`` (datums excepted)."""
        self.observe(run.batch, run.data.data, seconds, judged.metrics.get("loss:sum"))
        self.log_step(run.batch, run.data.loss_fn, judged)
        if judged.result is not None:
            self.log_gate(run.batch.endpoint, judged.manifest.name, judged.result)

    def observe(self, batch: Batch, data: list[Datum], seconds: float, loss: float | None) -> None:
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

    @staticmethod
    def log_step(batch: Batch, loss_fn: str, judged: Judged) -> None:
        """The step's two log lines: its events and completions (structured), and its loss."""
        name, n = judged.manifest.name, len(batch.events)
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
        fields = {"version": name, "endpoint": batch.endpoint, "event_ids": [e.id for e in batch.events]}
        log.info(
            "trained %s on %d %s event(s)", name, n, loss_fn, extra={**fields, "completion_ids": completions or None}
        )
        loss = judged.metrics.get("loss:sum", float("nan"))
        log.info("%s: %s step on %d events, loss %.4f", name, loss_fn, n, loss)

    @staticmethod
    def log_gate(endpoint: str, name: str, result: GateResult) -> None:
        """The gate's metrics (candidates passed and rejected, the published step scale) and its log line."""
        passed, tries = result.continued_from is None, result.line_search
        prom.GATE_CANDIDATES.labels(endpoint, "passed").inc(sum(t.passed for t in tries))
        prom.GATE_CANDIDATES.labels(endpoint, "rejected").inc(sum(not t.passed for t in tries))
        if passed:
            prom.STEP_SCALE.labels(endpoint).set(result.step_scale)
        log.info(
            "%s: evaluation gate %s in %.2f s (%s)%s",
            name,
            f"passed at step scale {result.step_scale:g}" if passed else "REJECTED",
            result.seconds,
            ", ".join(
                f"α {t.step_scale:g} " + ("passed" if t.passed else "failed " + "+".join(t.failed)) for t in tries
            ),
            "" if passed else f"; training continues from {result.continued_from}",
        )
