"""The gate's backtracking line search: after a live-loop step, publish the largest fraction of it that passes.

θ₀ are the LoRA factors before the step (the version the gate compares with), θ₁ after it. Candidate α is
θ₀ + α·(θ₁ − θ₀) for α = 1, ½, ¼, … down to the floor (``gate_min_step_scale``), each judged by
:meth:`~livelora.trainer.gate.EvaluationGate.judge` (cheapest pass first, stopping at the first failure; the
current version's measurement is measured once and reused). The first candidate that passes is published with
its α; when none does, the full step is written as rejected and training continues from θ₀, with AdamW's first
moment zeroed (:func:`~livelora.trainer.gate.forget_direction`). What the factor interpolation does to ΔW = B·A,
why AdamW's moments are kept after a scaled step and why the first moment is not after a hold-back: docs/rails.md.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from livelora.core.rails import GateResult, GateTry
from livelora.trainer.gate_measure import Measurement


def step_scales(floor: float) -> list[float]:
    """The α tried, largest first: 1, ½, ¼, … down to the smallest power of ½ that is ≥ ``floor``.

    Raises:
        ValueError: ``floor`` outside (0, 1].
    """
    if not 0 < floor <= 1:
        raise ValueError(f"the smallest step scale must be in (0, 1], not {floor!r}")
    out = [1.0]
    while out[-1] / 2 >= floor:
        out.append(out[-1] / 2)
    return out


def candidate_weights(
    start: dict[str, torch.Tensor], trained: dict[str, torch.Tensor], alpha: float
) -> dict[str, torch.Tensor]:
    """θ₀ + α·(θ₁ − θ₀) per tensor (``start`` θ₀, ``trained`` θ₁, same keys and shapes), computed in the tensors'
    dtype as written; at α = 1 exactly θ₁ (a copy)."""
    if alpha == 1.0:
        return {k: t.detach().clone() for k, t in trained.items()}
    return {k: start[k] + alpha * (trained[k] - start[k]) for k in trained}


def _load(model: Any, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, p in model.lora_params.items():
            p.copy_(weights[k])


def line_search(
    gate: Any, model: Any, lineage: str, endpoint: str, scales: list[float], on_check: Any = None
) -> tuple[GateResult, Measurement, bool]:
    """Judge ``model`` (stepped from :attr:`EvaluationGate.start_params`) at each α of ``scales`` until one passes
    for ``endpoint``; ``on_check(check, alpha)`` as each pass starts.

    Returns:
        ``(result, measurement, passed)``: the passing candidate's (the model then holds its weights), or, when
        none passed, the full step's (the model holds θ₁ again). ``result.step_scale`` is the α of those weights,
        ``result.line_search`` every candidate judged, ``result.seconds`` their total time.
    """
    t0 = time.perf_counter()
    start = gate.start_params
    trained = {k: p.detach().clone() for k, p in model.lora_params.items()}
    tell = on_check or (lambda check, alpha: None)
    tried: list[GateTry] = []
    first: tuple[GateResult, Measurement] | None = None
    for alpha in scales:
        if alpha != 1.0:
            _load(model, candidate_weights(start, trained, alpha))
        result, new = gate.judge(model, lineage, endpoint, on_check=lambda c, a=alpha: tell(c, a))
        v = result.verdicts[endpoint]
        tried.append(
            GateTry(step_scale=alpha, passed=v.passed, failed=v.failed, skipped=v.skipped, seconds=result.seconds)
        )
        if first is None:
            first = (result, new)
        if v.passed:
            break
    else:  # no α passed: the full step is what is written (rejected) and what an operator inspects
        if len(tried) > 1:
            _load(model, trained)
        (result, new), alpha = first, 1.0
    result.step_scale, result.line_search, result.seconds = alpha, tried, time.perf_counter() - t0
    return result, new, tried[-1].passed
