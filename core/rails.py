"""Update-safety rails shared by the trainer (which evaluates versions) and the gateway (which serves them).

Before a ``follow`` endpoint moves to a new version, the trainer measures it against the version it would
replace and stores a :class:`GateResult` in its manifest; :func:`judge` turns measures into a
:class:`GateVerdict` per endpoint under that endpoint's :class:`GateThresholds`, and the gateway never moves an
endpoint to a version :func:`gate_allows` rejects (a version without a result is allowed). The measures, why
the gate runs in the trainer and how the defaults were chosen: ``docs/internals/rails.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class GateThresholds(BaseModel):
    """One endpoint's gate thresholds (the defaults apply to endpoints that set none).

    All rates are fractions in [0, 1]; KL values are nats per token.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        True,
        description="Evaluate new versions for this endpoint (false: every version "
        "passes; the measures are still recorded).",
    )
    probe_margin: float = Field(
        0.10,
        ge=0,
        le=1,
        description="Largest allowed drop of capability-probe accuracy "
        "below the current version's (fraction of probes).",
    )
    probe_base_margin: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Largest allowed drop of capability-probe "
        "accuracy below the base model's (fraction of "
        "probes; 0.05 of 24 probes allows one lost): "
        "bounds what a chain of steps, each within "
        "probe_margin, may lose in total.",
    )
    freeform_margin: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Largest allowed drop of the free-form capability score (share of the capability items whose "
        "greedy free-form reply is right) below the current version's, on the same items. Applies only where "
        "the trainer runs the free-form check (LIVELORA_GATE_FREEFORM_ITEMS > 0, the default). 0.05 of 60 items "
        "allows a net loss of 3: a step's greedy replies flip a few items either way (docs/live-loop.md).",
    )
    freeform_base_margin: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Largest allowed drop of the free-form capability score below the base model's, on the same "
        "items; a lineage already below that bound may not lose more than it has (the bound is min(base − margin, "
        "current)).",
    )
    max_kl_current: float = Field(
        0.08,
        gt=0,
        description="Largest mean per-token KL(new ‖ current) on the probe "
        "replies (nats): the trust region of one update.",
    )
    max_kl_base: float = Field(
        1.5,
        gt=0,
        description="Largest mean per-token KL(new ‖ base model) on the probe "
        "replies (nats): how far the lineage may drift in total.",
    )
    max_degenerate: float = Field(
        0.25,
        ge=0,
        le=1,
        description="Largest share of free-generation replies that are empty, content-free or repetitive.",
    )
    min_length_ratio: float = Field(
        0.7,
        ge=0,
        le=1,
        description="Smallest mean reply length of the new version relative to the current one (length collapse).",
    )
    signal_tolerance: float = Field(
        0.05,
        ge=0,
        description="Largest allowed fall of the held-out signal margin "
        "(mean per-token logprob of desirable/chosen minus "
        "undesirable/rejected, nats) below the current "
        "version's.",
    )
    min_signal_examples: int = Field(
        4, ge=2, description="Held-out rated completions (both classes present) needed before the signal check counts."
    )


DEFAULT_THRESHOLDS = GateThresholds()


class GateCheck(BaseModel):
    """One measured check: its value for the new and the current version, the bound, and whether it passed."""

    model_config = ConfigDict(extra="ignore")

    name: str
    value: float | None = Field(
        description="The new version's measure (None: not measurable, e.g. too few held-out ratings)."
    )
    current: float | None = Field(default=None, description="The same measure for the current version.")
    bound: float | None = Field(default=None, description="The threshold it is compared with.")
    passed: bool
    skipped: bool = Field(
        default=False,
        description="Not measured: an earlier, cheaper check had already failed for the endpoint of the batch "
        "(the gate stops there); a skipped check does not pass.",
    )


class GateVerdict(BaseModel):
    """The decision for one endpoint."""

    model_config = ConfigDict(extra="ignore")

    passed: bool
    failed: list[str] = Field(default_factory=list, description="Names of the checks that failed.")
    skipped: list[str] = Field(
        default_factory=list, description="Checks not measured (an earlier one failed): the version does not pass."
    )
    thresholds: GateThresholds = Field(default_factory=GateThresholds)


class GateTry(BaseModel):
    """One candidate of the line search: the step scaled by ``step_scale`` and how the gate judged it for the
    endpoint of the batch."""

    model_config = ConfigDict(extra="ignore")

    step_scale: float = Field(description="α: the candidate is θ₀ + α·(θ₁ − θ₀) on the LoRA factors (docs/rails.md).")
    passed: bool
    failed: list[str] = Field(default_factory=list, description="The checks it failed.")
    skipped: list[str] = Field(default_factory=list, description="The checks not measured after the failure.")
    seconds: float = 0.0


class GateResult(BaseModel):
    """What the gate found for one version (``Manifest.gate``).

    Attributes:
        against: the version compared with (``<lineage>@<n>`` or ``base``).
        measures: raw measures of the new version (probe accuracy, KL values, degeneracy, lengths, margin).
        verdicts: endpoint → :class:`GateVerdict`; key ``"*"`` is the verdict under the default thresholds,
            used for endpoints created later.
        seconds: wall time of the evaluation (every candidate of the line search).
        step_scale: α of the weights written (1: the full step).
        line_search: every candidate judged, largest α first.
    """

    model_config = ConfigDict(extra="ignore")

    against: str
    measures: dict[str, Any] = Field(default_factory=dict)
    checks: list[GateCheck] = Field(default_factory=list)
    verdicts: dict[str, GateVerdict] = Field(default_factory=dict)
    seconds: float = 0.0
    continued_from: str | None = Field(
        default=None,
        description="Set when the version was rejected for the "
        "endpoint of the batch that trained it: the "
        "version training continues from instead (the "
        "one it was compared with). null: this one.",
    )
    step_scale: float = Field(
        default=1.0,
        description="The fraction α of the trained step this version holds: its LoRA factors are "
        "θ₀ + α·(θ₁ − θ₀), θ₀ the version compared with, θ₁ the step's result (docs/rails.md). 1: the full step; "
        "a version rejected at every α holds the full step.",
    )
    line_search: list[GateTry] = Field(
        default_factory=list, description="The candidates judged, largest α first; the last one that passed is this."
    )

    def verdict(self, endpoint: str) -> GateVerdict | None:
        """The verdict for ``endpoint`` (its own, else the default thresholds' one)."""
        return self.verdicts.get(endpoint) or self.verdicts.get("*")


def judge(checks: dict[str, dict[str, float | None]], t: GateThresholds, skipped: Sequence[str] = ()) -> GateVerdict:
    """Apply thresholds ``t`` to measured values.

    Args:
        checks: ``{"probes": {"value", "current"}, "probes_base": {"value", "current", "base"},
            "kl_current": {"value"}, "kl_base": {"value"}, "degenerate": {"value"}, "length_ratio": {"value"},
            "signal": {"value", "current"}, "freeform": {"value", "current"}, "freeform_base": {"value", "current",
            "base"}}`` (probe accuracies are fractions of the probes, ``base`` is the base
            model's); a ``None`` value (not measurable) passes, and so does a check whose bound needs a missing
            ``current`` or ``base``.
        skipped: checks that were not measured (an earlier check failed for the batch's endpoint).

    Returns:
        The verdict: each failed check's name; passed when none failed and none was skipped, or the gate is
        disabled.
    """
    failed = []
    for name, c in checks.items():
        if not _passes(name, c.get("value"), c.get("current"), t, c.get("base")):
            failed.append(name)
    skipped = [n for n in skipped if n not in checks]
    return GateVerdict(
        passed=(not failed and not skipped) or not t.enabled, failed=failed, skipped=skipped, thresholds=t
    )


def bound_of(name: str, current: float | None, t: GateThresholds, base: float | None = None) -> float | None:
    """The bound a check's value is compared with (None for an unknown check or a missing reference value).

    ``probes``, ``freeform`` and ``signal`` are relative to the current version's value ``current``;
    ``probes_base`` and ``freeform_base`` to the base model's ``base``: ``min(base − margin, current)``, so that a
    lineage whose current version is already below ``base − margin`` (trained before the check existed, or after
    the margin was tightened) is not stalled: its next version may not lose more, and may climb back; the others
    are absolute thresholds.
    """
    if name == "probes":
        return None if current is None else current - t.probe_margin
    if name == "probes_base":  # a lineage already below the bound may still step, if it loses nothing more
        return None if base is None else min(base - t.probe_base_margin, current if current is not None else 1.0)
    if name == "freeform":
        return None if current is None else current - t.freeform_margin
    if name == "freeform_base":
        return None if base is None else min(base - t.freeform_base_margin, current if current is not None else 1.0)
    if name == "signal":
        return None if current is None else current - t.signal_tolerance
    return {
        "kl_current": t.max_kl_current,
        "kl_base": t.max_kl_base,
        "degenerate": t.max_degenerate,
        "length_ratio": t.min_length_ratio,
    }.get(name)


def _passes(
    name: str, value: float | None, current: float | None, t: GateThresholds, base: float | None = None
) -> bool:
    bound = bound_of(name, current, t, base)
    if value is None or bound is None:
        return True
    if name in ("kl_current", "kl_base", "degenerate"):
        return value <= bound + 1e-12
    return value >= bound - 1e-12


def gate_allows(gate: dict[str, Any] | GateResult | None, endpoint: str) -> bool:
    """Whether a version with manifest gate result ``gate`` may serve ``endpoint`` (no result: yes)."""
    if gate is None:
        return True
    result = gate if isinstance(gate, GateResult) else GateResult.model_validate(gate)
    verdict = result.verdict(endpoint)
    return verdict is None or verdict.passed


# ---------------------------------------------------------------------------- live statistics and rollback


def wilson_interval(up: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """Wilson score interval of a thumbs-up rate (``z`` = 1.96: 95 %); None with no ratings.

    Source: E. B. Wilson (1927), "Probable inference, the law of succession, and statistical inference".
    """
    if n <= 0:
        return None
    p = up / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def sprt_thumbs(
    up: int, n: int, p0: float, *, delta: float = 0.2, alpha: float = 0.05, beta: float = 0.2
) -> tuple[str, float]:
    """Wald's sequential probability ratio test on the serving version's thumbs-up ratings.

    H0: its thumbs-up rate equals ``p0`` (the predecessor's observed rate, taken as known);
    H1: it is ``p0 − delta`` (worse). After ``n`` ratings with ``up`` thumbs up the log-likelihood ratio is
    ``LLR = up·ln(p1/p0) + (n − up)·ln((1 − p1)/(1 − p0))``; the test answers ``"rollback"`` once
    ``LLR ≥ ln((1 − β)/α)``, ``"keep"`` once ``LLR ≤ ln(β/(1 − α))``, else ``"continue"``.

    Error rates (Wald 1945, "Sequential tests of statistical hypotheses"): the chance of rolling back a version
    that is as good as its predecessor is at most about ``α`` (5 %; Wald's bound α/(1 − β) = 6.25 %), the chance
    of keeping one whose rate is ``delta`` (20 points) lower is at most about ``β`` (20 %). ``p0`` is clamped to
    [0.05, 0.95] so both hypotheses stay proper. Treating ``p0`` as known ignores its own sampling error: the
    predecessor must have ``min_ratings`` ratings before the test runs (the caller's rule).

    Returns:
        ``(decision, llr)``.
    """
    import math

    p0 = min(0.95, max(0.05, p0))
    p1 = max(0.01, p0 - delta)
    llr = up * math.log(p1 / p0) + (n - up) * math.log((1 - p1) / (1 - p0))
    if llr >= math.log((1 - beta) / alpha):
        return "rollback", llr
    if llr <= math.log(beta / (1 - alpha)):
        return "keep", llr
    return "continue", llr
