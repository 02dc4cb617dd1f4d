"""The evaluation gate's one entry per live-loop step: :class:`StepJudge`.

A step is judged in one call that owns the gate's whole part of it: before the step, the lineage model is
snapshot and the current version measured (:meth:`EvaluationGate.before_step
<livelora.trainer.gate.EvaluationGate.before_step>`); after it, the backtracking line search finds the largest
fraction of the step that passes (:func:`~livelora.trainer.line_search.line_search`); the save
(:func:`~livelora.trainer.live_step.save`) is called with the result; after it, a passed version becomes the
current one or a rejected step is undone (:meth:`EvaluationGate.settle
<livelora.trainer.gate.EvaluationGate.settle>`), and each endpoint's verdict goes to its history
(:func:`~livelora.trainer.gate.record_verdicts`). The step itself is :meth:`LiveStep.step
<livelora.trainer.live_step.LiveStep.step>`. How the gate judges: ``docs/internals/rails.md``.
"""

from __future__ import annotations

from collections.abc import Callable

from livelora.core.rails import GateResult
from livelora.trainer.gate import EvaluationGate, record_verdicts
from livelora.trainer.gate_measure import Measurement
from livelora.trainer.line_search import line_search, step_scales
from livelora.trainer.live_step import Judged, LiveStep, save, training_flags


class StepJudge:
    """Judges one live-loop step with the evaluation gate (called once per step).

    Args:
        gate: the trainer's :class:`~livelora.trainer.gate.EvaluationGate`.
        min_step_scale: the line search's smallest α (``gate_min_step_scale``).
        progress: ``(lineage, stage, **fields)`` → the learning status (``training`` while the current version
            is measured, ``gate`` with ``check`` and ``step_scale`` as each candidate's pass starts).
    """

    def __init__(self, gate: EvaluationGate, min_step_scale: float, progress: Callable[..., None]):
        self.gate, self.scales, self.progress = gate, step_scales(min_step_scale), progress

    def __call__(self, run: LiveStep) -> Judged:
        """Snapshot and measure, step, search α, save, settle and record.

        Returns:
            The written version (its manifest's ``gate`` is the result; a rejected one has ``continued_from``),
            the step's metrics (``update_norm:mean`` scaled by the published α) and the result.

        Raises:
            Whatever the step, the measuring or the save raise; a step whose judging failed is undone first.
        """
        model, lineage, gate = run.model, run.batch.lineage, self.gate
        self.before(run)
        with training_flags(run):
            metrics = run.step()
            try:
                result, new = self.search(run)
            except BaseException:
                gate.settle(model, lineage, False, "", None)  # undo a step whose judging failed
                raise
        metrics["update_norm:mean"] *= result.step_scale  # θ_α − θ₀ = α·(θ₁ − θ₀)
        manifest = save(run, metrics, result)
        gate.settle(model, lineage, result.continued_from is None, manifest.name, new)
        record_verdicts(gate.endpoints, result, manifest.name)
        return Judged(manifest, metrics, result)

    def before(self, run: LiveStep) -> None:
        """Leave distrusted raters' held-out labels out, snapshot the model and measure its current version."""
        model, batch = run.model, run.batch
        self.gate.distrusted = {r for r, a in (getattr(batch, "rater_weights", None) or {}).items() if a < 0.5}
        label = f"{batch.lineage}@{model.parent}" if model.parent else "base"
        tell = lambda c: self.progress(batch.lineage, "training", detail=f"measuring {c} for the gate")  # noqa: E731
        self.gate.before_step(model, batch.lineage, label, on_check=tell)

    def search(self, run: LiveStep) -> tuple[GateResult, Measurement]:
        """The largest fraction of the step that passes (trainer/line_search.py); a rejected result names the
        version training continues from."""
        batch = run.batch
        tell = lambda c, a: self.progress(batch.lineage, "gate", check=c, step_scale=a)  # noqa: E731
        result, new, passed = line_search(self.gate, run.model, batch.lineage, batch.endpoint, self.scales, tell)
        if not passed:
            result.continued_from = result.against
        return result, new
