"""Preference objectives as client-side custom losses (``forward_backward_custom``), so they run on any
Tinker-compatible server (the built-in loss types are only ``cross_entropy`` / ``importance_sampling`` /
``ppo`` / ``cispo`` / ``dro``).

Reference model: the policy before the first step (a fresh LoRA adapter has B = 0, so it equals the base
model, as TRL's ``disable_adapter`` reference). Its sequence logprobs are computed once with ``forward`` at the
start of a fresh run and kept in ``<log_dir>/reference_logprobs.json``, so a resumed run uses the same numbers.

torch is imported inside the loss functions only (the client package does not need it at import time;
``forward_backward_custom`` needs it in both SDKs).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from livelora.clients.recipes.checkpoints import write_json_atomic
from livelora.clients.recipes.evaluation import completion_logprobs

REFERENCE = "reference_logprobs.json"

Seq = tuple[Sequence[int], Sequence[int]]  # (prompt, completion) token ids


def reference_logprobs(run: Any, groups: dict[str, Sequence[Seq]]) -> dict[str, list[float]]:
    """Sequence logprobs (nats, completion tokens summed) of the reference for each named list of sequences.

    Fresh run: computed with the untrained policy and saved; resumed run: read back.
    Raises: RuntimeError if a resumed run has no saved reference (its first start died before saving it).
    """
    path = Path(run.log_dir) / REFERENCE
    if run.start_step > 0 or path.is_file():
        if not path.is_file():
            raise RuntimeError(f"{path} is missing: the reference of this resumed run cannot be rebuilt")
        saved = json.loads(path.read_text())
        if {k: len(v) for k, v in saved.items()} != {k: len(v) for k, v in groups.items()}:
            raise RuntimeError(f"{path} does not match the data (did the data change since the run started?)")
        return saved
    out = {name: completion_logprobs(run.tc, run.sdk, seqs) for name, seqs in groups.items()}
    write_json_atomic(path, out)
    return out


def _seq_sums(logprobs_D: list[Any], prompt_lens: Sequence[int]) -> Any:
    import torch

    return torch.stack([lp[p - 1 :].sum() for lp, p in zip(logprobs_D, prompt_lens)])


def dpo_loss_fn(prompt_lens: Sequence[int], ref_chosen: Sequence[float], ref_rejected: Sequence[float], beta: float):
    """Custom loss for datums laid out ``[chosen_0, rejected_0, chosen_1, rejected_1, ...]``.

    ``h = (lp_c − ref_c) − (lp_r − ref_r)`` with sequence sums over completion tokens;
    loss = mean over pairs of ``−log σ(β·h)`` (Rafailov et al. 2023, arXiv 2305.18290, Eq. 7; TRL
    ``dpo_loss`` sigmoid; docs/internals/losses.md §2.3, vector §3.3: 0.663797). Metrics: loss, margin (mean h, nats),
    accuracy (share of h > 0), chosen/rejected rewards β·(lp − ref).
    """

    def loss_fn(data: Any, logprobs_D: list[Any]):
        import torch
        import torch.nn.functional as F

        seq = _seq_sums(logprobs_D, prompt_lens)
        rc = seq[0::2] - torch.tensor(ref_chosen, dtype=seq.dtype)
        rr = seq[1::2] - torch.tensor(ref_rejected, dtype=seq.dtype)
        h = rc - rr
        loss = -F.logsigmoid(beta * h).mean()
        hd = h.detach()
        return loss, {
            "dpo/loss": float(loss.detach()),
            "dpo/margin": float(hd.mean()),
            "dpo/accuracy": float((hd > 0).float().mean()),
            "dpo/reward_chosen": float(beta * rc.detach().mean()),
            "dpo/reward_rejected": float(beta * rr.detach().mean()),
        }

    return loss_fn


def kto_loss_fn(
    prompt_lens: Sequence[int],
    ref: Sequence[float],
    desirable: Sequence[bool],
    z0: float,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
):
    """Custom loss for one datum per rated example.

    ``r_i = lp_i − ref_i`` (sequence sums over completion tokens); ``z0`` = the detached reference point
    ``max(0, mean KL-pair log-ratio)``; loss = mean over examples of ``λ_D·(1 − σ(β(r − z0)))`` (desirable) or
    ``λ_U·(1 − σ(β(z0 − r)))`` (undesirable) (Ethayarajh et al. 2024, arXiv 2402.01306, Eq. 7–8; TRL
    ``kto_loss``; docs/internals/losses.md §2.2, vector §3.2: 0.479398). Metrics: loss, rewards, margin, z0.
    """

    def loss_fn(data: Any, logprobs_D: list[Any]):
        import torch

        seq = _seq_sums(logprobs_D, prompt_lens)
        r = seq - torch.tensor(ref, dtype=seq.dtype)
        d = torch.tensor(list(desirable))
        per = torch.where(
            d,
            desirable_weight * (1 - torch.sigmoid(beta * (r - z0))),
            undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r))),
        )
        loss = per.mean()
        metrics = {"kto/loss": float(loss.detach()), "kto/z0": z0}
        if d.any():
            metrics["kto/reward_desirable"] = float(beta * r.detach()[d].mean())
        if (~d).any():
            metrics["kto/reward_undesirable"] = float(beta * r.detach()[~d].mean())
        return loss, metrics

    return loss_fn


def kto_reference_point(kl_logprobs: Sequence[float], kl_ref_logprobs: Sequence[float]) -> float:
    """KTO's z0 = ``max(0, mean_i(lp(y_j|x_i) − ref(y_j|x_i)))`` over the mismatched pairs (a constant: no
    gradient flows through it). Empty input gives 0. Source: TRL ``kto_trainer.py`` (``kl.clamp(min=0)``);
    docs/internals/losses.md §3.2 (ratios [0.4, 0.1, −0.5, 0.3] → 0.075)."""
    if not kl_logprobs:
        return 0.0
    return max(0.0, sum(lp - rf for lp, rf in zip(kl_logprobs, kl_ref_logprobs)) / len(kl_logprobs))


def kl_partner(prompts: Sequence[Sequence[int]], seed_offset: int = 1) -> list[int]:
    """For each example i, the index of a completion from a *different* prompt (the mismatched pair (x_i, y_j)
    of KTO's KL estimate): the next example in order whose prompt differs (a derangement even with duplicate
    prompts, unlike reversing a batch: TRL issue #1911). Examples whose prompts are all equal get -1.
    """
    n = len(prompts)
    out = []
    for i in range(n):
        j = next(
            (
                ((i + k) % n)
                for k in range(seed_offset, n + seed_offset)
                if tuple(prompts[(i + k) % n]) != tuple(prompts[i])
            ),
            -1,
        )
        out.append(j)
    return out


def balanced_weights(n_desirable: int, n_undesirable: int) -> tuple[float, float]:
    """``(λ_D, λ_U)`` with ``λ_D·n_D = λ_U·n_U`` (KTO paper Eq. 8 recommends a ratio in [1, 4/3]); (1, 1) when
    a class is empty."""
    if not n_desirable or not n_undesirable:
        return 1.0, 1.0
    n = n_desirable + n_undesirable
    return n / (2 * n_desirable), n / (2 * n_undesirable)
