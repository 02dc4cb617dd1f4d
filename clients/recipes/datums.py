"""Token sequences to training datums (Tinker's shifted layout), length limits and deterministic batching.

Layout (Tinker docs, losses page; docs/internals/losses.md §1): a sequence ``tokens_T`` with per-token weights
``w_T`` becomes ``model_input = tokens[:-1]``, ``target_tokens = tokens[1:]``, ``weights = w[1:]``: position i
predicts token i+1, so the first completion token's weight sits at index ``len(prompt) - 1``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any, Literal

TooLong = Literal["error", "skip", "truncate"]


class SequenceTooLongError(ValueError):
    """An example is longer than ``max_length`` tokens and the policy is ``"error"``."""


def check_length(tokens: Sequence[int], max_length: int, policy: TooLong, where: str) -> bool:
    """Apply the length limit to one example.

    Returns: True to keep the example (possibly truncated by the caller), False to skip it.
    Raises: SequenceTooLongError (policy ``"error"``) naming ``where``, the length and the limit.
    """
    if len(tokens) <= max_length:
        return True
    if policy == "error":
        raise SequenceTooLongError(
            f"{where}: {len(tokens)} tokens > max_length {max_length}; raise max_length "
            "or pass too_long='skip' / 'truncate'"
        )
    if policy not in ("skip", "truncate"):
        raise ValueError(f"too_long must be error, skip or truncate, got {policy!r}")
    return policy == "truncate"


def shifted(tokens: Sequence[int], per_token: dict[str, Sequence[float]]) -> tuple[list[int], dict[str, list]]:
    """``(tokens[:-1], {"target_tokens": tokens[1:], key: values[1:] ...})`` for values aligned with ``tokens``.

    Raises: ValueError if a sequence has fewer than 2 tokens or a value list's length differs from it.
    """
    if len(tokens) < 2:
        raise ValueError("a training sequence needs at least 2 tokens")
    out: dict[str, list] = {"target_tokens": list(tokens[1:])}
    for key, values in per_token.items():
        if len(values) != len(tokens):
            raise ValueError(f"{key}: {len(values)} values for {len(tokens)} tokens")
        out[key] = list(values[1:])
    return list(tokens[:-1]), out


def supervised_datum(sdk: Any, tokens: Sequence[int], weights: Sequence[float]) -> Any:
    """A ``cross_entropy`` datum: ``target_tokens`` (int64 [T-1]) and ``weights`` (float32 [T-1])."""
    inp, shifted_inputs = shifted(tokens, {"weights": weights})
    return sdk.datum(
        inp,
        {
            "target_tokens": (shifted_inputs["target_tokens"], "int64"),
            "weights": (shifted_inputs["weights"], "float32"),
        },
    )


def completion_datum(sdk: Any, prompt: Sequence[int], completion: Sequence[int]) -> Any:
    """A ``cross_entropy`` datum whose weights mark the completion tokens only (forward passes that score a
    completion: ``loss_fn_outputs[i]["logprobs"]`` at those positions are its token logprobs)."""
    tokens = list(prompt) + list(completion)
    return supervised_datum(sdk, tokens, [0.0] * len(prompt) + [1.0] * len(completion))


def rl_datum(
    sdk: Any,
    prompt: Sequence[int],
    completion: Sequence[int],
    sampling_logprobs: Sequence[float],
    advantages: float | Sequence[float],
) -> Any:
    """An ``importance_sampling`` / ``ppo`` / ``cispo`` datum (tinker-cookbook ``trajectory_to_data``).

    Args:
        prompt: prompt token ids (P).
        completion: sampled token ids (C), the stop token included.
        sampling_logprobs: the sampler's logprob of each completion token (C, nats).
        advantages: one value for every completion token, or C per-token values.

    Returns: a datum with ``target_tokens`` (int64 [P+C-1]), ``logprobs`` and ``advantages`` (float32 [P+C-1]),
    0 on prompt positions (so they carry no gradient).
    Raises: ValueError when lengths disagree or the completion is empty.
    """
    c = len(completion)
    if c == 0 or len(sampling_logprobs) != c:
        raise ValueError(f"completion of {c} tokens with {len(sampling_logprobs)} logprobs")
    adv = [float(advantages)] * c if isinstance(advantages, (int, float)) else [float(a) for a in advantages]
    if len(adv) != c:
        raise ValueError(f"{len(adv)} advantages for {c} completion tokens")
    zeros = [0.0] * len(prompt)
    inp, x = shifted(
        list(prompt) + list(completion), {"logprobs": zeros + list(sampling_logprobs), "advantages": zeros + adv}
    )
    return sdk.datum(
        inp,
        {
            "target_tokens": (x["target_tokens"], "int64"),
            "logprobs": (x["logprobs"], "float32"),
            "advantages": (x["advantages"], "float32"),
        },
    )


def batch_indices(n: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Indices of the examples of training step ``step`` (0-based): epochs are seeded shuffles of
    ``range(n)``, cut into consecutive batches; a step's batch depends only on (n, batch_size, step, seed),
    so a resumed run sees exactly the batches it would have seen.

    Raises: ValueError when ``n`` is 0 or ``batch_size`` < 1.
    """
    if n <= 0 or batch_size < 1:
        raise ValueError(f"cannot batch {n} examples in batches of {batch_size}")
    out: list[int] = []
    pos = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(pos, n)
        order = list(range(n))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        take = order[offset : offset + batch_size - len(out)]
        out += take
        pos += len(take)
    return out


def split(items: Sequence[Any], held_out: int | float, seed: int) -> tuple[list[Any], list[Any]]:
    """Seeded train / held-out split: ``held_out`` items (an int) or that fraction (a float < 1).

    Raises: ValueError if the held-out part or the train part would be empty.
    """
    n = len(items)
    k = round(held_out * n) if isinstance(held_out, float) and held_out < 1 else int(held_out)
    if not 0 < k < n:
        raise ValueError(f"cannot hold out {held_out} of {n} examples (both parts must be non-empty)")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    held = set(order[:k])
    return [x for i, x in enumerate(items) if i not in held], [items[i] for i in sorted(held)]


def chunks(seq: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(seq), size):
        yield seq[i : i + size]
