"""Validation of a training batch, done before any trainer state (grads, optimizer, step) is touched.

Every problem raises :class:`~livelora.clients.errors.BadRequestError` whose
message names the datum index and the field (``data[3].loss_fn_inputs.weights:
...``), so a client can fix its request; nothing in the model changes.

Per-loss inputs (``loss_fn_inputs`` keys; "token" tensors have shape ``(N,)``
with ``N = model_input.length``, "datum" tensors shape ``(1,)``):

================== ================================================ =====================================
loss               required keys (dtype, shape)                     ``loss_fn_config`` keys
================== ================================================ =====================================
cross_entropy      target_tokens (int64, token), weights (float32); (none)
                   or both (N, K) for top-K soft targets
importance_sampling target_tokens, logprobs, advantages (float32);  (none)
                   optional mask (float32, token) for RL losses
ppo, cispo         target_tokens, logprobs, advantages              clip_low_threshold, clip_high_threshold
dro                target_tokens, logprobs, advantages              beta
kto                target_tokens, weights (completion mask),        beta, desirable_weight,
                   label (float32, datum: 1 desirable, 0 undes.)    undesirable_weight
dpo                target_tokens, weights (completion mask);        beta
                   datums in (chosen, rejected) pairs: 0/1, 2/3...
================== ================================================ =====================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from livelora.clients.errors import BadRequestError, ContextLengthExceededError, UnsupportedParameterError
from livelora.clients.types.tinker import Datum
from livelora.trainer.losses import LOSSES, validate_loss_request


#: Inputs the trainer computes itself (clients must not send them).
TRAINER_INPUTS = frozenset({"ref_logprobs", "kl_logratio"})
#: Inputs holding one number per datum (shape ``(1,)``); every other input is per token.
DATUM_INPUTS = frozenset({"label"})
#: Tinker loss names livelora refuses, with the reason given to the client.
UNSUPPORTED_LOSSES = {
    "gspo": "gspo is not implemented by livelora; use ppo or cispo",
    "stable_reinforce": "stable_reinforce's objective is unpublished; use importance_sampling",
    "custom": "server-side custom losses are not supported; use forward_backward_custom on the client",
}


@dataclass(frozen=True)
class BatchSpec:
    """What a client must send for one loss (derived from :data:`livelora.trainer.losses.LOSSES`).

    Attributes:
        required / optional: client-side ``loss_fn_inputs`` keys.
        config: ``loss_fn_config`` resolved with the loss's defaults.
        needs_reference: the trainer adds reference logprobs (adapter disabled) before the loss.
    """

    loss_fn: str
    required: tuple[str, ...]
    optional: tuple[str, ...]
    config: dict[str, float]
    needs_reference: bool


def _dtype_for(key: str) -> str:
    return "int64" if key == "target_tokens" else "float32"


def validate_loss(loss_fn: str, loss_fn_config: dict[str, Any] | None) -> BatchSpec:
    """Check the loss name and its config (keys, finiteness, ranges: delegated to the losses registry).

    Raises:
        UnsupportedParameterError: a known Tinker loss livelora does not implement.
        BadRequestError: unknown loss, unknown or invalid config value.
    """
    if loss_fn in UNSUPPORTED_LOSSES:
        raise UnsupportedParameterError(UNSUPPORTED_LOSSES[loss_fn], param="loss_fn")
    spec = LOSSES.get(loss_fn)
    if spec is None:
        raise BadRequestError(f"unknown loss_fn {loss_fn!r}; supported: {', '.join(LOSSES)}", param="loss_fn")
    # The registry checks config keys and values; give it one well-formed placeholder datum.
    placeholder = {k: torch.zeros(1) for k in (*spec.required_inputs,)}
    placeholder["target_tokens"] = torch.zeros(1, dtype=torch.int64)
    n = 2 if loss_fn in ("kto", "dpo") else 1
    config = validate_loss_request(loss_fn, [placeholder] * n, loss_fn_config)
    required = tuple(k for k in spec.required_inputs if k not in TRAINER_INPUTS)
    return BatchSpec(loss_fn, required, tuple(spec.optional_inputs), config,
                     needs_reference="ref_logprobs" in spec.required_inputs)


def validate_batch(data: list[Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None, *,
                   vocab_size: int, max_seq_len: int) -> BatchSpec:
    """Validate a whole batch for ``loss_fn``; return its :class:`BatchSpec` (config resolved).

    Args:
        data: the datums.
        vocab_size: number of rows of the model's embedding (valid token ids are ``0..vocab_size-1``).
        max_seq_len: longest accepted ``model_input`` (tokens).

    Raises:
        BadRequestError: empty batch; unknown/missing keys; dtype, shape, NaN/inf, token range problems;
            a DPO batch of odd size; a KTO batch of fewer than 2 datums (mismatched pairs need two);
            a KTO/DPO datum without completion tokens.
        ContextLengthExceededError: a sequence longer than ``max_seq_len``.
        UnsupportedParameterError: see :func:`validate_loss`.
    """
    spec = validate_loss(loss_fn, loss_fn_config)
    if not data:
        raise BadRequestError("data: the batch is empty", param="data")
    if loss_fn == "dpo" and len(data) % 2:
        raise BadRequestError(f"data: dpo needs (chosen, rejected) pairs, got an odd number of datums ({len(data)})",
                              param="data")
    if loss_fn == "kto" and len(data) < 2:
        raise BadRequestError("data: kto needs at least 2 datums (the KL term pairs each prompt with another "
                              "datum's completion)", param="data")
    for i, datum in enumerate(data):
        _validate_datum(i, datum, spec, vocab_size, max_seq_len)
    return spec


def _validate_datum(i: int, datum: Datum, spec: BatchSpec, vocab_size: int, max_seq_len: int) -> None:
    where = f"data[{i}]"
    loss_fn = spec.loss_fn
    tokens = datum.model_input.to_ints()
    n = len(tokens)
    if n == 0:
        raise BadRequestError(f"{where}.model_input: no tokens", param=f"{where}.model_input")
    if n > max_seq_len:
        raise ContextLengthExceededError(
            f"{where}.model_input: {n} tokens exceed the context length of {max_seq_len}",
            param=f"{where}.model_input")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise BadRequestError(f"{where}.model_input: token id {bad} is outside the vocabulary [0, {vocab_size})",
                              param=f"{where}.model_input")
    keys = set(datum.loss_fn_inputs)
    missing = [k for k in spec.required if k not in keys]
    if missing:
        raise BadRequestError(f"{where}.loss_fn_inputs: missing {', '.join(missing)} (required by {loss_fn})",
                              param=f"{where}.loss_fn_inputs.{missing[0]}")
    allowed = (*spec.required, *spec.optional)
    unknown = sorted(keys - set(allowed))
    if unknown:
        raise BadRequestError(
            f"{where}.loss_fn_inputs.{unknown[0]}: not an input of {loss_fn} (expected: {', '.join(allowed)})",
            param=f"{where}.loss_fn_inputs.{unknown[0]}")
    tt_shape = datum.loss_fn_inputs["target_tokens"].resolved_shape()
    two_d = loss_fn == "cross_entropy" and len(tt_shape) == 2 and tt_shape[0] == n and tt_shape[1] >= 1
    token_shape = tt_shape if two_d else [n]
    for key in sorted(keys):
        td = datum.loss_fn_inputs[key]
        field_name = f"{where}.loss_fn_inputs.{key}"
        dtype = _dtype_for(key)
        if td.dtype != dtype:
            raise BadRequestError(f"{field_name}: dtype must be {dtype}, got {td.dtype}", param=field_name)
        want = [1] if key in DATUM_INPUTS else token_shape
        shape = td.resolved_shape()
        if shape != want:
            raise BadRequestError(f"{field_name}: shape must be {want} (model_input has {n} tokens), got {shape}",
                                  param=field_name)
        if len(td.data) != math.prod(want):
            raise BadRequestError(f"{field_name}: {len(td.data)} values for shape {shape}", param=field_name)
        if dtype == "int64":
            if any(isinstance(v, float) and not v.is_integer() for v in td.data):
                raise BadRequestError(f"{field_name}: int64 tensor holds non-integer values", param=field_name)
            bad = next((v for v in td.data if not 0 <= v < vocab_size), None)
            if bad is not None:
                raise BadRequestError(f"{field_name}: token id {bad} is outside the vocabulary [0, {vocab_size})",
                                      param=field_name)
        else:
            bad = next((v for v in td.data if not math.isfinite(v)), None)
            if bad is not None:
                raise BadRequestError(f"{field_name}: non-finite value {bad}", param=field_name)
    if spec.needs_reference and not any(w != 0 for w in datum.loss_fn_inputs["weights"].data):
        raise BadRequestError(f"{where}.loss_fn_inputs.weights: {loss_fn} needs at least one completion "
                              "token (non-zero weight)", param=f"{where}.loss_fn_inputs.weights")
    if loss_fn == "kto" and datum.loss_fn_inputs["label"].data[0] not in (0, 1):
        raise BadRequestError(f"{where}.loss_fn_inputs.label: must be 1 (desirable) or 0 (undesirable)",
                              param=f"{where}.loss_fn_inputs.label")
