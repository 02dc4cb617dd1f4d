"""Held-out evaluation through the public SDK: NLL, sequence logprobs, sampled accuracy, numeric grading.

Every function sends all its requests first and then waits (the server batches them).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from livelora.clients.recipes.datums import chunks, completion_datum
from livelora.clients.recipes.sdk import gather, tolist

#: Datums per ``forward`` request in evaluation.
EVAL_CHUNK = 16


def forward_logprobs(tc: Any, data: Sequence[Any]) -> list[list[float]]:
    """Per-datum target logprobs (nats, [N_i]) from ``tc.forward(..., "cross_entropy")`` (no gradient)."""
    futs = [tc.forward(list(part), "cross_entropy") for part in chunks(list(data), EVAL_CHUNK)]
    out: list[list[float]] = []
    for fut in futs:
        out += [tolist(o["logprobs"]) for o in fut.result().loss_fn_outputs]
    return out


def mean_nll(tc: Any, data: Sequence[Any], weights_D: Sequence[Sequence[float]]) -> float:
    """Weighted mean negative log-likelihood, nats per trained token: ``−Σ w·lp / Σ w`` (tinker-cookbook
    ``compute_mean_nll``). ``weights_D`` are the datums' (shifted) weights."""
    lps = forward_logprobs(tc, data)
    num = sum(w * lp for lp_T, w_T in zip(lps, weights_D) for lp, w in zip(lp_T, w_T))
    den = sum(sum(w_T) for w_T in weights_D)
    return -num / den if den else float("nan")


def completion_logprobs(tc: Any, sdk: Any, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[float]:
    """``log π(completion | prompt)`` summed over completion tokens (nats), one per ``(prompt, completion)``."""
    data = [completion_datum(sdk, p, c) for p, c in pairs]
    lps = forward_logprobs(tc, data)
    return [sum(lp_T[len(p) - 1 :]) for lp_T, (p, _) in zip(lps, pairs)]


# ---------------------------------------------------------------------------------------------- math answers
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_STRICT = re.compile(r"(?:answer is|####)\s*:?\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)


def _canon(text: str) -> str:
    text = text.replace(",", "").rstrip(".")
    try:
        value = float(text)
    except ValueError:
        return text
    return str(int(value)) if value == int(value) else str(value)


def extract_answer(text: str) -> tuple[str | None, bool]:
    """The final numeric answer of a reply and whether it was in the asked format.

    Strict: the last ``The answer is N`` / ``#### N``; lenient fallback: the last number in the text.
    Returns: ``(number or None, strict_format_found)``.
    """
    strict = _STRICT.findall(text)
    if strict:
        return _canon(strict[-1]), True
    nums = _NUMBER.findall(text)
    return (_canon(nums[-1]) if nums else None), False


def math_reward(text: str, answer: str, stopped: bool, format_coef: float = 0.1) -> tuple[float, bool, bool]:
    """GSM8K reward (tinker-cookbook ``ProblemEnv``: ``correct + format_coef·(format − 1)``).

    ``correct``: the extracted answer equals ``answer``; ``format``: the strict form was used and the reply
    ended on a stop token (not cut by max_tokens). Returns ``(reward, correct, format_ok)``; reward ∈
    {1, 1 − coef, 0, −coef}.
    """
    got, strict = extract_answer(text)
    correct = got is not None and got == _canon(answer)
    fmt = strict and stopped
    return float(correct) + format_coef * (float(fmt) - 1.0), correct, fmt


def sampled_accuracy(
    sampler: Any,
    sdk: Any,
    prompts: Sequence[Sequence[int]],
    answers: Sequence[str],
    decode: Callable[[Sequence[int]], str],
    max_tokens: int,
    stop: list[int],
) -> dict[str, float]:
    """Greedy (temperature 0) accuracy and format rate on held-out problems."""
    params = sdk.sampling_params(max_tokens=max_tokens, temperature=0.0, stop=stop or None)
    results = gather([partial(sampler.sample, sdk.model_input(p), 1, params) for p in prompts])
    correct = fmt = 0
    for res, ans in zip(results, answers):
        seq = res.sequences[0]
        _, ok, f = math_reward(decode(seq.tokens), ans, seq.stop_reason == "stop")
        correct += ok
        fmt += f
    n = max(len(prompts), 1)
    return {"eval/accuracy": correct / n, "eval/format": fmt / n}
