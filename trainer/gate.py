"""The evaluation gate's bookkeeping in the online trainer: held-out examples, cached measurements, snapshots.

One :class:`EvaluationGate` per :class:`~livelora.trainer.online.OnlineTrainer`, entered once per live-loop step
through :class:`~livelora.trainer.judge.StepJudge`. Around the step,
:meth:`EvaluationGate.before_step` snapshots the lineage model and makes sure the current version's measurement
exists, and :meth:`EvaluationGate.judge` measures candidate weights pass by pass, cheapest first, stopping at the
first failing check, and judges them per endpoint (:mod:`livelora.core.rails`; the candidates come from
:mod:`livelora.trainer.line_search`). After a rejection the model is restored from the snapshot, so training
continues from the last version that passed, with AdamW's first moment zeroed (:func:`forget_direction`). One
rating or preference pair in ``holdout_every`` (:func:`held_out`, by the sha256 of its event id) is kept for the
signal check instead of trained. The base model's measurement is taken once per store
(:mod:`livelora.trainer.gate_base`). The steps in full: ``docs/internals/rails.md``.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections import deque
from typing import Any

import torch

from livelora.adapters.endpoints import EndpointStore
from livelora.core.cpu_share import step_yield
from livelora.core.governance import held_out
from livelora.core.rails import GateCheck, GateResult, GateThresholds, bound_of, judge
from livelora.trainer.gate_base import BaseMeasure
from livelora.trainer.gate_freeform import FreeformGate
from livelora.trainer.gate_measure import (
    CHECKS,
    PASSES,
    HeldOut,
    Measurement,
    ProbeSuite,
    compare,
    heldout_items,
    signal_countable,
)

log = logging.getLogger(__name__)


def forget_direction(optimizer: torch.optim.Optimizer) -> None:
    """Zero AdamW's first moment (``exp_avg``) of every parameter, keeping the second moment and the step count:
    after a held-back step the next one moves along its own batch's gradient, not the direction just rejected
    (with β₁ = 0.9 nine tenths of a step are the first moment's). Why: docs/rails.md, "After a hold-back"."""
    for state in optimizer.state.values():
        if "exp_avg" in state:
            state["exp_avg"].zero_()


class EvaluationGate:
    """Measures, judges and remembers the gate results of one lineage model (docs/internals/rails.md).

    Args:
        tokenizer: the base model's tokenizer.
        home: ``LIVELORA_HOME`` (endpoint thresholds and history).
        chat_pair: ``(messages, reply) -> (prompt_ids, completion_ids)`` for inline preference pairs.
        holdout_every / heldout_max / gen_tokens / freeform_items / freeform_chunk:
            :class:`~livelora.trainer.settings.GateSection`.
    """

    def __init__(
        self,
        tokenizer: Any,
        home: Any,
        chat_pair: Any,
        *,
        holdout_every: int = 10,
        heldout_max: int = 8,
        gen_tokens: int = 24,
        freeform_items: int = 0,
        freeform_chunk: int = 30,
        base_id: str | None = None,
    ):
        self.tokenizer = tokenizer
        self.endpoints = EndpointStore(home)
        self.chat_pair = chat_pair
        self.holdout_every = holdout_every
        self.suite = ProbeSuite(
            tokenizer, gen_tokens=gen_tokens, freeform_items=freeform_items, freeform_chunk=freeform_chunk
        )
        self.freeform = FreeformGate(self.suite)
        self.base_measure = BaseMeasure(self.suite, self.endpoints.home, base_id)
        self.heldout: dict[str, deque[HeldOut]] = {}
        self.heldout_max = heldout_max
        self._current: dict[str, tuple[str, Measurement]] = {}  # lineage → (version label, measurement)
        self._snapshot: dict[str, Any] | None = None
        #: raters whose agreement weight is below ½ for the step being judged (their held-out labels are left out
        #: of the signal check: a contradicting rater's inverted labels would veto the honest raters' steps)
        self.distrusted: set[str] = set()

    # ------------------------------------------------------------------ held-out examples
    def hold_out(self, lineage: str, event: Any) -> bool:
        """Keep ``event`` for the signal check instead of training it? (ratings and preferences, 1 in N)."""
        if event.type not in ("rating", "preference") or not held_out(event.id, self.holdout_every):
            return False
        try:
            items = heldout_items(event, self.tokenizer, self.chat_pair)
        except Exception as exc:  # an event we cannot score is trained normally (and screened there)
            log.warning("held-out event %s cannot be scored: %s", event.id, exc)
            return False
        if lineage not in self.heldout:
            self.reload(lineage)  # the event is in the dataset of record already: _add skips it then
        self._add(self.heldout[lineage], items)
        return True

    @staticmethod
    def _add(q: deque[HeldOut], items: list[HeldOut]) -> None:
        have = {i.key for i in q}
        q.extend(i for i in items if i.key not in have)

    def items(self, lineage: str) -> list[HeldOut]:
        """The held-out examples the signal check scores (newest ``heldout_max`` events' items); after a restart
        they are first read back from the dataset of record (:meth:`reload`)."""
        if lineage not in self.heldout:
            self.reload(lineage)
        trusted = [i for i in self.heldout.get(lineage, ()) if i.rater not in self.distrusted]
        return trusted[-2 * self.heldout_max :] if self.heldout_max else []

    def reload(self, lineage: str) -> int:
        """Refill ``lineage``'s held-out examples from the dataset of record (the same id hash picks the same
        events in every process); returns how many events were taken."""

        from livelora.clients.types.signals import parse_stream_event
        from livelora.trainer.dataset import read_dataset

        q = self.heldout.setdefault(lineage, deque(maxlen=2 * max(1, self.heldout_max)))
        n = 0
        for rec in read_dataset(self.endpoints.home):
            raw = rec.get("event")
            if not isinstance(raw, dict) or raw.get("type") not in ("rating", "preference"):
                continue
            if not held_out(raw["id"], self.holdout_every) or self.endpoints.get(raw["endpoint"]).lineage != lineage:
                continue
            try:
                self._add(
                    q, heldout_items(parse_stream_event({"event": json.dumps(raw)}), self.tokenizer, self.chat_pair)
                )
                n += 1
            except Exception as exc:  # an event that cannot be scored is skipped
                log.warning("held-out event %s not reloaded: %s", raw.get("id"), exc)
        return n

    # ------------------------------------------------------------------ around a step
    def base(self, model: Any, on_check: Any = None) -> Measurement:
        """The base model's measurement (:meth:`BaseMeasure.get <livelora.trainer.gate_base.BaseMeasure.get>`)."""
        return self.base_measure.get(model, on_check)

    def before_step(self, model: Any, lineage: str, label: str, on_check: Any = None) -> None:
        """Snapshot ``model`` and make sure the current weights (``label``) are measured, held-out items too;
        ``on_check(name)`` as each measuring pass starts (``base model: probes``, ``current version: replies``...)."""
        self._snapshot = {
            "params": {k: p.detach().clone() for k, p in model.lora_params.items()},
            "optimizer": copy.deepcopy(model.optimizer.state_dict()),
            "step": model.step,
            "parent": model.parent,
            "lineage": model.lineage,
            "data_counts": dict(model.data_counts),
        }
        tell = on_check or (lambda name: None)
        self.base(model, on_check=lambda c: tell(f"base model: {c}"))
        have = self._current.get(lineage)
        items = self.items(lineage)
        if have is None or have[0] != label:
            if label == "base":  # a new lineage's adapter is zero (lora_B = 0): its measures are the base model's
                b = self.base_measure.measurement
                have = (label, Measurement(b.probe_right, b.logp_M_V, b.degenerate, b.mean_len, b.replies, {}))
                have[1].freeform, have[1].freeform_texts = dict(b.freeform), dict(b.freeform_texts)
            else:
                have = (label, self.suite.measure(model, heldout=items, on_check=lambda c: tell(f"{label}: {c}")))
            self._current[lineage] = have
        missing = [i for i in items if i.key not in have[1].signal]
        if missing:
            tell(f"{label}: signal")
            have[1].signal.update(self.suite.score(model, missing))

    @property
    def start_params(self) -> dict[str, torch.Tensor]:
        """The LoRA tensors :meth:`before_step` saw (the current version's weights θ₀)."""
        return self._snapshot["params"]

    def judge(self, model: Any, lineage: str, endpoint: str, on_check: Any = None) -> tuple[GateResult, Measurement]:
        """Measure the stepped ``model`` pass by pass (:data:`PASSES`, cheapest first) and judge it for every follow
        endpoint of ``lineage`` (plus ``endpoint`` and the defaults, key ``"*"``). After the first pass with a check
        that fails for ``endpoint`` nothing more is measured: the remaining checks are ``skipped`` and the version
        passes for no endpoint (bar those with the gate disabled). ``on_check(name)`` as each pass starts
        (``probes``, ``signal`` when enough held-out examples count, ``replies``), then ``verdict``."""
        t0 = time.perf_counter()
        tell = on_check or (lambda name: None)
        label, current = self._current[lineage]
        items = self.items(lineage)
        judged: dict[str, GateThresholds] = {"*": GateThresholds(), endpoint: self.endpoints.get(endpoint).thresholds}
        for name, b in self.endpoints.all().items():
            if b.lineage == lineage and b.mode == "follow":
                judged[name] = b.thresholds
        mine = judged[endpoint]
        # too few held-out examples for any endpoint: the signal check is decided (not measurable) unmeasured
        countable = signal_countable(items, min(t.min_signal_examples for t in judged.values()))
        unmeasured = {p for p, off in (("signal", not countable), ("freeform", self.suite.freeform is None)) if off}
        new, done = Measurement(), [c for p in unmeasured for c in PASSES[p]]
        for i, name in enumerate(n for n in PASSES if n not in unmeasured):
            if i:
                step_yield()  # serving may go first between the gate's passes (core/cpu_share.py)
            tell(name)
            if name == "freeform":
                self.freeform.judge(
                    model, new, current, self.base_measure.measurement, self._snapshot["params"], mine, tell
                )
            else:
                self.suite.run_pass(name, model, new, heldout=items)
            done += PASSES[name]
            if not judge(self._compare(new, current, items, mine.min_signal_examples, done), mine).passed:
                break  # a cheaper check failed already: the candidate is rejected, nothing more is measured
        tell("verdict")
        skipped = [c for c in CHECKS if c not in done]
        verdicts = {
            name: judge(self._compare(new, current, items, t.min_signal_examples, done), t, skipped)
            for name, t in judged.items()
        }
        values = self._compare(new, current, items, mine.min_signal_examples, done)
        checks = [
            GateCheck(
                name=k,
                value=v["value"],
                current=v["current"],
                bound=bound_of(k, v["current"], mine, v.get("base")),
                passed=k not in verdicts[endpoint].failed,
            )
            for k, v in values.items()
        ] + [GateCheck(name=k, value=None, passed=False, skipped=True) for k in skipped]
        measures = {
            "probe_accuracy": new.accuracy,
            "probe_accuracy_current": current.accuracy,
            "probe_accuracy_base": self.base_measure.measurement.accuracy,
            "mean_reply_tokens": new.mean_len,
            "heldout_examples": len(items),
            "replies": new.replies,
        }
        if new.freeform_upto:
            measures["freeform"] = self.freeform.summary(new, current, self.base_measure.measurement)
        result = GateResult(
            against=label, measures=measures, checks=checks, verdicts=verdicts, seconds=time.perf_counter() - t0
        )
        return result, new

    def _compare(self, new: Measurement, current: Measurement, items: list[HeldOut], min_examples: int, done: list):
        ff = self.suite.freeform
        ids = [it.id for it in ff.items[: new.freeform_upto]] if ff is not None else []
        return compare(new, current, self.base_measure.measurement, items, min_examples, done, freeform_ids=ids)

    def settle(self, model: Any, lineage: str, passed: bool, name: str, new: Measurement) -> None:
        """After the version is written: a passed one becomes current; a rejected step is undone."""
        snap, self._snapshot = self._snapshot, None
        if passed:
            self._current[lineage] = (name, new)
            return
        if snap is None:
            return
        with torch.no_grad():
            for k, p in model.lora_params.items():
                p.copy_(snap["params"][k])
        model.optimizer.load_state_dict(snap["optimizer"])
        forget_direction(model.optimizer)
        model.step, model.parent, model.lineage = snap["step"], snap["parent"], snap["lineage"]
        model.data_counts = snap["data_counts"]


def record_verdicts(endpoints: EndpointStore, result: GateResult, name: str) -> None:
    """One ``gate`` history line of version ``name`` per endpoint ``result`` judged (not the ``"*"`` default)."""
    for endpoint, verdict in result.verdicts.items():
        if endpoint == "*":
            continue
        b = endpoints.get(endpoint)
        reason = (
            "passed"
            if verdict.passed
            else "rejected: " + (", ".join(verdict.failed) or "not measured (" + ", ".join(verdict.skipped) + ")")
        )
        checks = {c.name: {"value": c.value, "current": c.current, "bound": c.bound} for c in result.checks}
        endpoints.record(
            endpoint,
            "gate",
            who="trainer",
            from_=result.against,
            to=name,
            reason=reason,
            details={
                "passed": verdict.passed,
                "failed": verdict.failed,
                "checks": checks,
                "continued_from": result.continued_from,
                "step_scale": result.step_scale,
                "line_search": [t.model_dump(mode="json") for t in result.line_search],
            },
            tenant=b.tenant,
        )
