"""kto-ratings: KTO from binary ratings (thumbs up = desirable, down = undesirable).

Data: the live loop's dataset of record (``LIVELORA_HOME/data/signals``, a folder or one of its dated files,
read as is: exact served token ids; the latest rating per rater and completion counts) or a TRL-style JSONL
``{"prompt" | "messages", "completion", "label"}``. A seeded ``eval_fraction`` is held out.

Each step: ``batch_size`` rated examples; a ``forward`` (no gradient) of each example's mismatched pair
(its prompt with another prompt's completion) gives the KL reference point z0; then
``forward_backward_custom`` with the KTO loss (preference.py), classes weighted to balance (Eq. 8).

Metric: held-out margin = mean log-ratio (policy − reference, nats per reply) of desirable replies minus that
of undesirable ones; 0 before training, higher is better. Defaults (SmolLM2-135M, CPU; docs/recipes.md): β 0.1,
lr 1e-4, batch 8, rank 8, 30 steps: on 240 live-loop ratings (48 held out) the margin goes 0 -> 51 nats per reply.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pydantic import Field

from livelora.clients.recipes.datasets import load_ratings
from livelora.clients.recipes.datums import batch_indices, check_length, completion_datum, split
from livelora.clients.recipes.evaluation import completion_logprobs
from livelora.clients.recipes.loop import RecipeConfig, Run, Summary
from livelora.clients.recipes.preference import (
    balanced_weights,
    kl_partner,
    kto_loss_fn,
    kto_reference_point,
    reference_logprobs,
)
from livelora.clients.recipes.renderers import ChatRenderer
from livelora.clients.recipes.sdk import Sdk


class Config(RecipeConfig):
    data: str = Field(
        ..., description="Ratings: LIVELORA_HOME/data/signals (folder or file) or a JSONL of prompt/completion/label."
    )
    eval_fraction: float = Field(0.2, gt=0, lt=1, description="Share of ratings held out.")
    batch_size: int = Field(8, ge=2, description="Rated examples per step.")
    beta: float = Field(0.1, gt=0, description="KTO beta.")
    desirable_weight: float | None = Field(None, gt=0, description="λ_D (default: balance the classes).")
    undesirable_weight: float | None = Field(None, gt=0, description="λ_U (default: balance the classes).")
    max_length: int = Field(1024, ge=8, description="Longest prompt + reply in tokens (longer ones are skipped).")
    learning_rate: float = Field(1e-4, gt=0, description="Adam learning rate.")
    steps: int = Field(30, ge=1, description="Optimizer steps.")


def run(
    cfg: Config, *, sdk: Sdk | None = None, on_step: Callable[[int, dict[str, float]], None] | None = None
) -> Summary:
    """Train ``cfg.steps`` KTO steps (resuming from ``cfg.log_dir`` if it holds a checkpoint)."""
    r = Run(cfg, "kto-ratings", sdk=sdk, on_step=on_step)
    try:
        renderer = ChatRenderer(r.tokenizer)
        rated = [
            x
            for i, x in enumerate(load_ratings(cfg.data, renderer))
            if check_length(x.prompt + x.completion, cfg.max_length, "skip", f"rating {i}")
        ]
        train, held = split(rated, cfg.eval_fraction, cfg.seed)
        partner = kl_partner([x.prompt for x in train])
        kl_pairs = [(x.prompt, train[j].completion) for x, j in zip(train, partner) if j >= 0]
        ref = reference_logprobs(
            r,
            {
                "train": [(x.prompt, x.completion) for x in train],
                "held": [(x.prompt, x.completion) for x in held],
                "kl": kl_pairs,
            },
        )
        kl_index = {i: k for k, i in enumerate(i for i, j in enumerate(partner) if j >= 0)}
        n_d = sum(x.desirable for x in train)
        lam_d, lam_u = balanced_weights(n_d, len(train) - n_d)
        lam_d, lam_u = cfg.desirable_weight or lam_d, cfg.undesirable_weight or lam_u

        def evaluate(step: int) -> dict[str, float]:
            lps = completion_logprobs(r.tc, r.sdk, [(x.prompt, x.completion) for x in held])
            ratios = [lp - rf for lp, rf in zip(lps, ref["held"])]
            d = [v for v, x in zip(ratios, held) if x.desirable]
            u = [v for v, x in zip(ratios, held) if not x.desirable]
            out = {
                "eval/logratio_desirable": sum(d) / len(d) if d else 0.0,
                "eval/logratio_undesirable": sum(u) / len(u) if u else 0.0,
            }
            out["eval/margin"] = out["eval/logratio_desirable"] - out["eval/logratio_undesirable"]
            return out

        r.evaluate_before(evaluate)
        adam = r.sdk.adam(cfg.learning_rate)
        for step in r.steps():
            t0 = time.monotonic()
            idx = batch_indices(len(train), cfg.batch_size, step, cfg.seed)
            kl_idx = [kl_index[i] for i in idx if i in kl_index]
            kl_lp = completion_logprobs(r.tc, r.sdk, [kl_pairs[k] for k in kl_idx])
            z0 = kto_reference_point(kl_lp, [ref["kl"][k] for k in kl_idx])
            batch = [train[i] for i in idx]
            data = [completion_datum(r.sdk, x.prompt, x.completion) for x in batch]
            loss_fn = kto_loss_fn(
                [len(x.prompt) for x in batch],
                [ref["train"][i] for i in idx],
                [x.desirable for x in batch],
                z0,
                cfg.beta,
                lam_d,
                lam_u,
            )
            fb = r.tc.forward_backward_custom(data, loss_fn)
            opt = r.tc.optim_step(adam)
            out = fb.result()
            opt.result()
            metrics = {
                "train/desirable": sum(x.desirable for x in batch),
                "train/tokens": sum(len(x.completion) for x in batch),
                "time/step_s": time.monotonic() - t0,
            }
            metrics.update({f"train/{k.split('/')[-1]}": v for k, v in out.metrics.items() if k.startswith("kto/")})
            r.end_step(step, metrics, evaluate)
        return r.finish(evaluate)
    except BaseException:
        r.abort()
        raise
