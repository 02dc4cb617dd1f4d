"""The shared skeleton of every recipe: config base, run set-up/resume, step bookkeeping, sampling pipeline.

A recipe reads as::

    run = Run(cfg, "chat-sft", sdk=sdk, on_step=progress)       # config saved; fresh model or resumed state
    for step in run.steps():                                     # start_step .. cfg.steps-1
        ... forward_backward / optim_step ...
        run.end_step(step, {"train/loss": ...}, evaluate)        # metrics, checkpoint, periodic eval
    return run.finish(evaluate)                                  # final eval, final checkpoint, summary

Eval schedule: ``evaluate(step)`` runs before the first step of a fresh run (the "before" figure), after every
``eval_every`` steps, and after the last step ("after"). Checkpoints: every ``save_every`` steps and at the end.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from livelora.clients.recipes.checkpoints import last_checkpoint, save_config, save_state
from livelora.clients.recipes.metrics import MetricsLogger, read_metrics
from livelora.clients.recipes.sdk import Sdk, close_service, tolist

T = TypeVar("T")

#: Config fields that may change when a run is resumed.
RESUMABLE = frozenset(
    {"steps", "base_url", "sdk", "save_every", "eval_every", "mlflow", "mlflow_tracking_uri", "log_dir", "check_update"}
)


class RecipeConfig(BaseModel):
    """Settings every recipe shares (each field's description is its ``--help`` text)."""

    model_config = ConfigDict(extra="forbid")

    log_dir: Path = Field(
        description="Run directory: config.json, checkpoints.jsonl, metrics.jsonl, mlruns/. "
        "Running again with the same directory resumes from its last checkpoint."
    )
    base_model: str = Field("smollm2-135m-instruct", description="Base model name on the server.")
    sdk: Literal["livelora", "tinker"] = Field("livelora", description="Client SDK: livelora or the official tinker.")
    base_url: str | None = Field(None, description="Server URL (default $LIVELORA_BASE_URL or http://127.0.0.1:8000).")
    steps: int = Field(10, ge=1, description="Optimizer steps in all (a resumed run continues up to this).")
    learning_rate: float = Field(1e-4, gt=0, description="Adam learning rate (constant).")
    lora_rank: int = Field(8, ge=1, description="LoRA rank.")
    seed: int = Field(0, description="Seed of the LoRA init, data order and sampling.")
    save_every: int = Field(5, ge=0, description="Save a resumable checkpoint every N steps (0: only at the end).")
    eval_every: int = Field(0, ge=0, description="Evaluate every N steps (0: only before and after).")
    mlflow: bool | None = Field(None, description="Log to MLflow too (default: when installed).")
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow tracking URI (default: a file store in <log_dir>/mlruns)."
    )


class RLConfig(RecipeConfig):
    """Settings of the recipes that train on sampled tokens with advantages (gsm8k-rl, distill, code-rl)."""

    check_update: bool = Field(
        False,
        description="After each optimizer step, re-score the tokens it trained on (one forward) and log how far "
        "it moved their logprobs: train/update_gain > 0 when it made better-than-average tokens likelier.",
    )


@dataclass
class Summary:
    """What a recipe returns: evaluation before and after, steps, wall time (seconds, all sessions, up to the end of
    the final evaluation: :meth:`Run.elapsed`)."""

    recipe: str
    log_dir: Path
    steps: int
    wall_s: float
    before: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)
    last_train: dict[str, float] = field(default_factory=dict)


class Run:
    """One recipe run: run directory, metrics logger, service and training clients, resume point.

    Attributes:
        start_step: optimizer steps already done (0 for a fresh run; the checkpoint's step on resume).
        tc: the training client; ``service``: the service client; ``sdk``: the :class:`Sdk`.

    Raises: ConfigMismatchError if ``log_dir`` holds another config; SDK errors from the server.
    """

    def __init__(
        self,
        cfg: RecipeConfig,
        recipe: str,
        *,
        sdk: Sdk | None = None,
        on_step: Callable[[int, dict[str, float]], None] | None = None,
    ):
        self._t0 = time.monotonic()  # the run's one clock: set-up, steps and evaluations (Summary.wall_s)
        self.cfg, self.recipe, self.on_step = cfg, recipe, on_step
        self.sdk = sdk or Sdk.load(cfg.sdk, cfg.base_url)
        self.log_dir = Path(cfg.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        config = {"recipe": recipe, **cfg.model_dump(mode="json")}
        save_config(self.log_dir, config, RESUMABLE)
        self.logger = MetricsLogger(
            self.log_dir, recipe, config, use_mlflow=cfg.mlflow, tracking_uri=cfg.mlflow_tracking_uri
        )
        self.service = self.sdk.service()
        ckpt = last_checkpoint(self.log_dir)
        if ckpt is not None:
            self.tc = self.service.create_training_client_from_state_with_optimizer(ckpt["state_path"])
            self.start_step = int(ckpt["step"])
        else:
            self.tc = self.service.create_lora_training_client(
                base_model=cfg.base_model, rank=cfg.lora_rank, seed=cfg.seed
            )
            self.start_step = 0
        self.resumed = ckpt is not None
        self.tokenizer = self.sdk.tokenizer(self.tc)
        earlier = read_metrics(self.log_dir).get(self.start_step, {})
        self._elapsed0 = float(earlier.get("time/elapsed_s", 0.0)) if self.resumed else 0.0
        self._last_ckpt = self.start_step

    def elapsed(self) -> float:
        """Seconds of wall time so far (set-up, steps, evaluations), summed over the run's sessions: the
        ``time/elapsed_s`` of each step line and the summary's ``wall_s`` read this one clock."""
        return self._elapsed0 + time.monotonic() - self._t0

    def steps(self) -> Iterator[int]:
        """Step indices still to do: ``start_step`` .. ``cfg.steps - 1``."""
        return iter(range(self.start_step, self.cfg.steps))

    def evaluate_before(self, evaluate: Callable[[int], dict[str, float]] | None) -> None:
        """Run ``evaluate(0)`` and log it, unless resuming (the 'before' figure is in metrics.jsonl)."""
        if evaluate is not None and not self.resumed and self.start_step == 0:
            self.logger.log(0, evaluate(0))

    def end_step(
        self, step: int, metrics: dict[str, float], evaluate: Callable[[int], dict[str, float]] | None = None
    ) -> dict[str, float]:
        """Book-keep step ``step`` (0-based) once its optimizer step is done: periodic eval, checkpoint,
        metrics (logged at ``step + 1`` = optimizer steps done), progress callback."""
        done = step + 1
        out = dict(metrics)
        if evaluate is not None and self.cfg.eval_every and done % self.cfg.eval_every == 0 and done < self.cfg.steps:
            out.update(evaluate(done))
        if (self.cfg.save_every and done % self.cfg.save_every == 0) or done == self.cfg.steps:
            save_state(self.tc, self.log_dir, done)
            self._last_ckpt = done
        out["time/elapsed_s"] = self.elapsed()
        self.logger.log(done, out)
        if self.on_step is not None:
            self.on_step(done, out)
        return out

    def finish(self, evaluate: Callable[[int], dict[str, float]] | None = None) -> Summary:
        """Final evaluation (logged at ``cfg.steps``), final checkpoint if missing, close; returns the summary."""
        n = self.cfg.steps
        if self._last_ckpt < n:  # e.g. resumed at or past the end
            save_state(self.tc, self.log_dir, n)
        if evaluate is not None:
            self.logger.log(n, evaluate(n))
        self.logger.close()
        close_service(self.service)
        by_step = read_metrics(self.log_dir)
        evals = lambda s: {k: v for k, v in by_step.get(s, {}).items() if k.startswith("eval/")}  # noqa: E731
        train = {k: v for k, v in by_step.get(n, {}).items() if k.startswith("train/")}
        return Summary(
            self.recipe,
            self.log_dir,
            n,
            self.elapsed(),
            evals(0),
            evals(n),
            train,
        )

    def abort(self) -> None:
        self.logger.close("FAILED")
        close_service(self.service, "errored")


def sampled_batches(run: Run, sample: Callable[[int, Any], T], max_staleness: int = 0) -> Iterator[tuple[int, T, int]]:
    """Steps of an on-policy loop with optional overlap: yields ``(step, batch, staleness)``.

    ``sample(step, sampler)`` builds step ``step``'s batch from a sampling client. Before each step the current
    weights are snapshotted (``save_weights_and_get_sampling_client``). With ``max_staleness = 0`` the batch of
    step k is sampled from the weights after step k-1, then trained (synchronous). With ``max_staleness = s > 0``
    sampling for steps k+1..k+s runs in background threads while step k trains; a batch is never more than s
    optimizer steps older than the weights it trains (``staleness`` = steps between its sampler and now). The
    off-policy gap is what the importance ratio of ``importance_sampling`` / ``ppo`` / ``cispo`` corrects
    (tinker-cookbook ``rl/train.py`` ``max_steps_off_policy``).

    The caller trains step k before advancing the iterator (the next snapshot must see its update).
    """
    pending: deque[tuple[int, int, Any]] = deque()
    pool = ThreadPoolExecutor(max_workers=max_staleness + 1, thread_name_prefix="recipe-sampler")
    next_step = run.start_step
    try:
        for step in run.steps():
            sampler = run.tc.save_weights_and_get_sampling_client()
            while next_step < run.cfg.steps and next_step <= step + max_staleness:
                pending.append((next_step, step, pool.submit(sample, next_step, sampler)))
                next_step += 1
            batch_step, version, fut = pending.popleft()
            assert batch_step == step
            yield step, fut.result(), step - version
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def sampler_kl(
    sampling_logprobs_D: list[list[float]], train_logprobs_D: list[list[float]], masks_D: list[list[float]]
) -> dict[str, float]:
    """KL between the sampler and the trainer on the sampled tokens (tinker-cookbook ``compute_kl_sample_train``):
    ``kl_v1 = mean(q − lp)``, ``kl_v2 = ½·mean((q − lp)²)`` over positions with mask 1 (nats/token).
    Large values mean sampler and trainer disagree (numerics, or stale samples)."""
    diffs = [
        q - lp
        for qs, lps, ms in zip(sampling_logprobs_D, train_logprobs_D, masks_D)
        for q, lp, m in zip(qs, lps, ms)
        if m
    ]
    if not diffs:
        return {}
    n = len(diffs)
    return {"train/kl_sampler_v1": sum(diffs) / n, "train/kl_sampler_v2": 0.5 * sum(d * d for d in diffs) / n}


def update_shift(tc: Any, data: list[Any], loss: str, before_D: list[list[float]]) -> dict[str, float]:
    """How the optimizer step just taken moved the logprobs of the tokens it trained on: ``data`` re-scored with
    ``tc.forward(data, loss)`` against ``before_D``, the logprobs its ``forward_backward`` returned (same trainer,
    same numerics). Per position t with advantage A_t ≠ 0 (read from each datum's ``advantages``) and change
    Δ_t = lp_after − lp_before (nats):

    - ``train/update_gain``: Σ A_t·Δ_t / Σ |A_t|, nats per token; > 0 when the step made the better-than-average
      tokens likelier and the worse ones less likely (what the policy-gradient step promises to first order);
    - ``train/update_dlogprob_pos`` / ``_neg``: mean Δ_t over tokens with positive / negative advantage.

    Returns {} when no position carries an advantage.
    """
    after_D = []
    for part in [data[i : i + 16] for i in range(0, len(data), 16)]:
        after_D += [tolist(o["logprobs"]) for o in tc.forward(part, loss).result().loss_fn_outputs]
    pos: list[float] = []
    neg: list[float] = []
    gain, weight = 0.0, 0.0
    for datum, before, after in zip(data, before_D, after_D):
        for a, b, lp in zip(tolist(datum.loss_fn_inputs["advantages"]), before, after):
            if a:
                (pos if a > 0 else neg).append(lp - b)
                gain, weight = gain + a * (lp - b), weight + abs(a)
    if not weight:
        return {}
    out = {"train/update_gain": gain / weight}
    for key, shifts in (("pos", pos), ("neg", neg)):
        if shifts:
            out[f"train/update_dlogprob_{key}"] = sum(shifts) / len(shifts)
    return out
