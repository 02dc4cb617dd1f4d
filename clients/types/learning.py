"""Wire type of ``GET /v1/learning/{endpoint}``: where the next version of an endpoint's lineage stands.

Stages, in order: ``waiting`` (ratings queued, n of the batch size), ``training`` (forward/backward and the
optimizer step; ``detail`` says whether a full batch or ``max_wait_s`` started it), ``gate`` (the evaluation
gate, ``check`` names the pass running, ``step_scale`` the fraction of the step judged), then ``published`` (the
version and its ``step_scale``; ``loading`` until the gateway serves it) or ``rejected`` (why). ``idle``: no
step reported since the trainer started, nothing queued. ``deferred``: the step waits for serving (a trainer
process with a duty while serving below 1: deferred before it starts, or paused between its passes). Times are Unix
seconds.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

Stage = Literal["idle", "waiting", "training", "gate", "published", "rejected"]

#: The gate's measuring passes (the values of ``check``, cheapest first) in words for people.
PASS_WORDS: dict[str, str] = {
    "probes": "probes (answers with a forced start)",
    "signal": "held-out ratings",
    "replies": "replies to open prompts (length, repetition)",
    "freeform": "free-form answers",
}


def pass_words(check: str) -> str:
    """``check`` with its leading pass name in words (``freeform (60 of 120 items)`` → ``free-form answers (60 of
    120 items)``); other text unchanged."""
    name, sep, rest = check.partition(" ")
    return PASS_WORDS[name] + sep + rest if name in PASS_WORDS else check


class StageMark(BaseModel):
    """One stage change of a step: when it began and what it concerned."""

    stage: Stage
    at: float
    check: str | None = None
    detail: str | None = None
    version: str | None = None
    reason: str | None = None
    step_scale: float | None = Field(
        default=None,
        description="Gate: the fraction α of the step being judged (line search: 1, 0.5, 0.25, ...); published: "
        "the α of the version.",
    )
    freeform: dict[str, Any] | None = Field(
        default=None,
        description="Published or rejected: the gate's free-form capability check of the version (``score``, "
        "``current``, ``base``: shares right of the ``items`` judged; ``passed``; ``categories``: per category "
        "``n`` and the items right for the version (``new``), the current version and the base model).",
    )
    serving_wait_s: float | None = Field(
        default=None,
        description="Published or rejected: seconds the step waited for serving (deferred before it started, "
        "paused between its passes); None: it never waited.",
    )


class SegmentStatus(BaseModel):
    """One segment of an endpoint in its learning status: its lineage, versions and liked share."""

    name: str
    binding: str = Field(description="The segment's binding name `<endpoint>::<segment>` (admin routes take it).")
    lineage: str
    origin: str = Field(description="The shared version the segment's lineage started from.")
    serving: str | None = Field(default=None, description="The version serving its users now (None: base).")
    versions: int = Field(description="Versions of its lineage in the store.")
    stage: Stage | None = Field(default=None, description="Its lineage's learning stage (None: not reported).")
    deferred: str | None = Field(
        default=None, description="Why its lineage's step waits for serving now (None: it does not)."
    )
    members: int = Field(description="Users, API keys and header values assigned.")
    ratings: int = Field(default=0, description="Ratings counted in the live statistics, all its versions.")
    liked: float | None = Field(default=None, description="Thumbs-up share of those ratings (None: none yet).")
    liked_ci95: list[float] | None = Field(default=None, description="Wilson 95 % interval of `liked`.")


class LearningStatus(BaseModel):
    """Answer to ``GET /v1/learning/{endpoint}``."""

    object: Literal["learning.status"] = "learning.status"
    endpoint: str
    lineage: str
    stage: Stage
    since: float | None = Field(default=None, description="When the current stage began.")
    check: str | None = Field(default=None, description="Gate stage: the pass running (probes, replies, signal...).")
    detail: str | None = Field(default=None, description="Training stage: what runs now.")
    version: str | None = Field(default=None, description="Published or rejected: the version written.")
    reason: str | None = Field(default=None, description="Rejected: the failed checks.")
    step_scale: float | None = Field(
        default=None,
        description="Gate: the fraction α of the step being judged (1, then 0.5, 0.25, ... after a rejection); "
        "published: the fraction the version holds.",
    )
    ratings_waiting: int = Field(default=0, description="Ratings queued for the next KTO step.")
    demonstrations_waiting: int = 0
    preferences_waiting: int = 0
    batch_size: int | None = Field(default=None, description="Ratings that start a KTO step (kto_min_batch).")
    ratings_to_step: int | None = Field(default=None, description="More ratings that start a step now.")
    max_wait_s: float | None = Field(
        default=None, description="A smaller batch (≥ 2 ratings) starts once its oldest has waited this long."
    )
    oldest_waiting_at: float | None = None
    stages: list[StageMark] = Field(default_factory=list, description="This step's stage changes, oldest first.")
    last: StageMark | None = Field(default=None, description="The last step's outcome (published or rejected).")
    step_seconds: float | None = Field(
        default=None,
        description="Estimate of one step (training start to outcome), seconds: the median of `step_times`, or "
        "while that is empty the trainer's first step (with its warm-up work).",
    )
    step_times: list[float] = Field(
        default_factory=list,
        description="The last (up to 5) steps' times, seconds, oldest first; a trainer process's first step is "
        "left out (it also loads the model and builds the optimizer).",
    )
    eta_s: float | None = Field(
        default=None,
        description="Estimated seconds to the next version (None: more ratings are needed first, or the running "
        "step takes longer than usual: `eta_basis` says which).",
    )
    eta_basis: str | None = Field(default=None, description="How eta_s was estimated.")
    updated: float | None = Field(default=None, description="When the trainer last reported.")
    recovered_signals: int = Field(
        default=0,
        description="Accepted signals the running trainer re-queued from the accepted-signal log after Redis lost "
        "them (a restart without persistence, a flush, a failover).",
    )
    recovered_at: float | None = Field(default=None, description="When it last re-queued some.")
    deferred: str | None = Field(
        default=None,
        description="Why the step waits for serving now: deferred before it starts (stage waiting, a batch ready) "
        "or paused between its passes (training, gate), e.g. 'serving is busy: training uses at most 50% of the "
        "time while requests are served'; None: it does not wait for serving.",
    )
    deferred_since: float | None = Field(default=None, description="When this wait for serving began.")
    deferred_s: float | None = Field(
        default=None, description="Seconds since deferred_since, when the status was read (None: not deferred)."
    )
    deferred_until: float | None = Field(
        default=None,
        description="Deferred before it starts: when the step starts at the latest while requests go on being "
        "served (at once when serving stops).",
    )
    serving_wait_s: float = Field(
        default=0.0,
        description="Seconds this step has waited for serving in waits that ended (deferred, paused); the wait "
        "now running is deferred_s.",
    )
    paused: bool = Field(
        default=False, description="An admin paused the lineage's learning: signals stay queued, no step starts."
    )
    ratings_held_out: int = Field(
        default=0,
        description="Ratings the evaluation gate kept to judge new versions (one in gate_holdout_every, by the "
        "rating id's hash), never trained on; counted since the trainer started.",
    )
    ratings_quarantined: int = Field(
        default=0,
        description="Ratings over their rater's rate limit, kept out of training (since the trainer started).",
    )
    serving: str | None = Field(
        default=None, description="The version this endpoint serves now (None: the base model or unknown)."
    )
    loading: str | None = Field(
        default=None,
        description="A published version the gateway does not serve yet (it swaps it in within seconds; a pinned "
        "endpoint moves only on promote).",
    )

    segments: list[SegmentStatus] = Field(
        default_factory=list, description="The endpoint's segments (each learns on a lineage of its own)."
    )

    def summary(self) -> str:
        """One line for people, e.g. ``waiting: 3 of 8 ratings (5 more start a step)``."""
        if self.stage == "idle":
            return "idle: nothing queued, no step since the trainer started"
        if self.stage == "waiting":
            s = f"waiting: {self.ratings_waiting} of {self.batch_size} ratings"
            if self.ratings_to_step:
                s += f" ({self.ratings_to_step} more start a step"
                if self.max_wait_s is not None and self.ratings_waiting >= 2:
                    s += f"; once the oldest has waited {self.max_wait_s:g} s, these start a partial batch"
                s += ")"
            if self.deferred:
                s += "; step deferred" + self._deferred_for()
        elif self.stage == "training":
            s = "training" + (f" ({self.detail})" if self.detail else "")
        elif self.stage == "gate":
            s = "evaluation gate" + (f": {pass_words(self.check)}" if self.check else "")
            if self.step_scale is not None and self.step_scale != 1:
                s += f" (step scaled by {self.step_scale:g})"
        elif self.stage == "published":
            s = f"published {self.version}"  # without a gateway (livelora endpoints show --home) nothing more is known
            if self.loading == self.version:
                s = f"published, loading {self.version}"
            elif self.serving == self.version:
                s = f"serving {self.version}"
            if self.step_scale is not None and self.step_scale != 1:
                s += f" (step scaled by {self.step_scale:g})"
            if self.detail:
                s += f"; trained: {self.detail}"
            ff = self.last.freeform if self.last is not None else None
            if ff and ff.get("score") is not None and ff.get("base") is not None:
                s += f"; free-form capability {ff['score']:.0%} (base model {ff['base']:.0%}, {ff['items']} items)"
        else:
            s = f"rejected {self.version}: {self.reason}"
        if self.stage in ("training", "gate") and self.deferred:
            s += "; paused" + self._deferred_for()
        waited = self.last.serving_wait_s if self.last is not None else None
        if self.stage in ("published", "rejected") and waited:
            s += f"; the step waited {_seconds(waited)} for serving"
        if self.loading and not (self.stage == "published" and self.version == self.loading):
            s += f"; published, loading {self.loading}"
        elif self.serving and self.stage != "published":
            s += f"; serving {self.serving}"
        left = [
            f"{n} {what}"
            for n, what in ((self.ratings_held_out, "held out by the gate"), (self.ratings_quarantined, "quarantined"))
            if n
        ]
        if left:
            s += f"; not trained on: {', '.join(left)}"
        if self.paused:
            return s + "; learning paused by an admin (signals stay queued)"
        if self.eta_s is not None:
            s += f"; next version in about {self.eta_s:.0f} s"
        elif self.stage in ("training", "gate") and self.eta_basis and self.eta_basis.startswith("taking longer"):
            s += f"; {self.eta_basis}"
        return s

    def _deferred_for(self) -> str:
        """`` for 12 s: <why>`` (without a duration when it is not known)."""
        took = f" for {_seconds(self.deferred_s)}" if self.deferred_s is not None else ""
        return f"{took}: {self.deferred}"


def _seconds(s: float) -> str:
    """``42 s``, ``3.5 s`` (a tenth of a second below 10 s)."""
    return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"
