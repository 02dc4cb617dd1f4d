"""Datum-level entry points (Tinker ``forward_backward`` shape) and the registry of built-in losses."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from livelora.clients.errors import BadRequestError

from ._preference import dpo, kto, sequence_logprobs
from ._token import LossOutput, cispo, cross_entropy, dro, importance_sampling, ppo

LossName = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "kto", "dpo"]


DatumLossFn = Callable[[Sequence[Tensor], Sequence[Mapping[str, Tensor]], Mapping[str, float]], LossOutput]


def _cat(tensors: Sequence[Tensor], like: Tensor) -> Tensor:
    return torch.cat([t.reshape(-1).to(like) for t in tensors])


def _datum_cross_entropy(lp_D, inputs_D, cfg):
    return cross_entropy(_cat(lp_D, lp_D[0]), _cat([x["weights"] for x in inputs_D], lp_D[0]))


def _datum_rl(fn):
    def run(lp_D, inputs_D, cfg):
        like = lp_D[0]
        mask = None
        if any("mask" in x for x in inputs_D):
            mask = _cat([x.get("mask", torch.ones_like(lp)) for x, lp in zip(inputs_D, lp_D)], like)
        return fn(_cat(lp_D, like), _cat([x["logprobs"] for x in inputs_D], like),
                  _cat([x["advantages"] for x in inputs_D], like), mask_T=mask, **cfg)
    return run


def _datum_logratios(lp_D, inputs_D) -> Tensor:
    like = lp_D[0]
    return torch.stack([
        sequence_logprobs(lp, x["weights"]) - sequence_logprobs(x["ref_logprobs"].to(like), x["weights"])
        for lp, x in zip(lp_D, inputs_D)])


def _datum_kto(lp_D, inputs_D, cfg):
    labels = [float(x["label"].reshape(-1)[0]) for x in inputs_D]
    desirable_B = torch.tensor([lab == 1.0 for lab in labels])
    kl_B = torch.stack([x["kl_logratio"].reshape(-1)[0].to(lp_D[0]) for x in inputs_D])
    return kto(_datum_logratios(lp_D, inputs_D), desirable_B, kl_B, **cfg)


def _datum_dpo(lp_D, inputs_D, cfg):
    logratios = _datum_logratios(lp_D, inputs_D)
    return dpo(logratios[0::2], logratios[1::2], **cfg)


@dataclass(frozen=True)
class LossSpec:
    """A built-in loss as the trainer sees it.

    Attributes:
        name: the ``loss_fn`` string.
        fn: ``fn(target_logprobs_D, loss_fn_inputs_D, config) -> LossOutput`` (config already validated
            and filled with defaults).
        required_inputs / optional_inputs: ``loss_fn_inputs`` keys; any other key is rejected.
        config_defaults: accepted ``loss_fn_config`` keys and their defaults.
        reduction: ``"sum"`` over tokens (Tinker) or ``"mean"`` over examples/pairs (KTO/DPO).
        datum_layout: how datums map to examples (documentation for callers).

    Micro-batching: ``"sum"`` losses add up exactly over chunks of datums. A ``"mean"`` loss is the mean
    over the datums of one call; to split a batch of B examples into chunks, scale each chunk's loss by
    ``chunk_size / B`` (DPO: pairs, never split a pair) and, for KTO, give every datum the batch mean of
    the mismatched-pair log-ratios as ``kl_logratio`` (z0 is the mean of the values in the call).
    """

    name: LossName
    fn: DatumLossFn
    required_inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    config_defaults: Mapping[str, float] = field(default_factory=dict)
    reduction: Literal["sum", "mean"] = "sum"
    datum_layout: str = "one datum per sequence; per-token inputs have the shape of target_tokens"


_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
_PREF_INPUTS = ("target_tokens", "weights", "ref_logprobs")

LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec("cross_entropy", _datum_cross_entropy, ("target_tokens", "weights")),
    "importance_sampling": LossSpec("importance_sampling", _datum_rl(importance_sampling), _RL_INPUTS, ("mask",)),
    "ppo": LossSpec("ppo", _datum_rl(ppo), _RL_INPUTS, ("mask",),
                    {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": LossSpec("cispo", _datum_rl(cispo), _RL_INPUTS, ("mask",),
                      {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    "dro": LossSpec("dro", _datum_rl(dro), _RL_INPUTS, ("mask",), {"beta": 0.05}),
    "kto": LossSpec("kto", _datum_kto, _PREF_INPUTS + ("label", "kl_logratio"), (),
                    {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0}, "mean",
                    "one datum per example (prompt + completion); weights mark completion tokens; label 1 = "
                    "desirable, 0 = undesirable; kl_logratio = Σ_completion(lp − lp_ref) of (x_i, y_perm(i)), "
                    "perm = kl_pair_order(prompts), computed by the trainer without grad"),
    "dpo": LossSpec("dpo", _datum_dpo, _PREF_INPUTS, (), {"beta": 0.1}, "mean",
                    "datums alternate chosen, rejected (pair k = datums 2k, 2k+1, as tinker-cookbook "
                    "train_dpo); weights mark completion tokens"),
}

_SCALAR_INPUTS = ("label", "kl_logratio")


def _check_config(spec: LossSpec, config: Mapping[str, Any] | None) -> dict[str, float]:
    config = dict(config or {})
    for key in config:
        if key not in spec.config_defaults:
            accepted = ", ".join(spec.config_defaults) or "none"
            raise BadRequestError(f"loss_fn_config key {key!r} is not accepted by {spec.name} "
                                  f"(accepted: {accepted})", param=f"loss_fn_config.{key}")
    resolved = {**spec.config_defaults, **config}
    for key, value in resolved.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BadRequestError(f"loss_fn_config {key!r} must be a finite number, got {value!r}",
                                  param=f"loss_fn_config.{key}")
        resolved[key] = float(value)
    lo, hi = resolved.get("clip_low_threshold"), resolved.get("clip_high_threshold")
    if lo is not None and not 0.0 <= lo <= 1.0:
        raise BadRequestError(f"clip_low_threshold must be an absolute ratio bound in [0, 1] (e.g. 0.8 for "
                              f"ε=0.2), got {lo}", param="loss_fn_config.clip_low_threshold")
    if hi is not None and hi < 1.0:
        raise BadRequestError(f"clip_high_threshold must be an absolute ratio bound ≥ 1 (e.g. 1.2 for "
                              f"ε=0.2), got {hi}", param="loss_fn_config.clip_high_threshold")
    for key in ("desirable_weight", "undesirable_weight"):
        if key in resolved and resolved[key] < 0:
            raise BadRequestError(f"{key} must be ≥ 0, got {resolved[key]}", param=f"loss_fn_config.{key}")
    if "beta" in resolved and (resolved["beta"] < 0 or (spec.name != "dro" and resolved["beta"] == 0)):
        raise BadRequestError(f"beta must be {'≥' if spec.name == 'dro' else '>'} 0 for {spec.name}, "
                              f"got {resolved['beta']}", param="loss_fn_config.beta")
    return resolved


def validate_loss_request(loss_fn: str, loss_fn_inputs_D: Sequence[Mapping[str, Tensor]],
                          loss_fn_config: Mapping[str, Any] | None = None) -> dict[str, float]:
    """Check a forward_backward request before any compute; return the config filled with defaults.

    Checks: known ``loss_fn``; at least one datum; every required input present and no unknown input;
    per-token inputs shaped like ``target_tokens`` (1-D, or (N, K) ``weights`` for 2-D cross-entropy);
    KTO ``label`` ∈ {0, 1} and scalar ``kl_logratio``, ≥ 2 examples; DPO an even number of datums;
    ``loss_fn_config`` keys accepted and values valid.
    Raises: BadRequestError naming the offending key (``param`` = ``loss_fn``, ``loss_fn_inputs.<key>``
    or ``loss_fn_config.<key>``).
    """
    spec = LOSSES.get(loss_fn)
    if spec is None:
        raise BadRequestError(f"unknown loss_fn {loss_fn!r}; built-in losses: {', '.join(LOSSES)}",
                              param="loss_fn")
    if len(loss_fn_inputs_D) == 0:
        raise BadRequestError("forward_backward needs at least one datum", param="data")
    allowed = set(spec.required_inputs) | set(spec.optional_inputs)
    for i, inputs in enumerate(loss_fn_inputs_D):
        for key in spec.required_inputs:
            if key not in inputs:
                raise BadRequestError(f"datum {i}: {spec.name} needs loss_fn_inputs[{key!r}]",
                                      param=f"loss_fn_inputs.{key}")
        for key in inputs:
            if key not in allowed:
                raise BadRequestError(f"datum {i}: loss_fn_inputs key {key!r} is not used by {spec.name} "
                                      f"(accepted: {', '.join(sorted(allowed))})", param=f"loss_fn_inputs.{key}")
        tokens_shape = tuple(torch.as_tensor(inputs["target_tokens"]).shape)
        two_d_ok = spec.name == "cross_entropy"
        if len(tokens_shape) != 1 and not (two_d_ok and len(tokens_shape) == 2):
            raise BadRequestError(f"datum {i}: target_tokens must be 1-D (N,)"
                                  f"{' or 2-D (N, K)' if two_d_ok else ''}, got shape {list(tokens_shape)}",
                                  param="loss_fn_inputs.target_tokens")
        for key, value in inputs.items():
            shape = tuple(torch.as_tensor(value).shape)
            if key in _SCALAR_INPUTS:
                if int(torch.as_tensor(value).numel()) != 1:
                    raise BadRequestError(f"datum {i}: {key} must hold one number, got shape {list(shape)}",
                                          param=f"loss_fn_inputs.{key}")
            elif shape != tokens_shape:
                raise BadRequestError(f"datum {i}: {key} has shape {list(shape)} but target_tokens has "
                                      f"{list(tokens_shape)}", param=f"loss_fn_inputs.{key}")
            if key != "target_tokens" and not bool(torch.isfinite(torch.as_tensor(value, dtype=torch.float64)).all()):
                raise BadRequestError(f"datum {i}: {key} holds non-finite values", param=f"loss_fn_inputs.{key}")
        if spec.name == "kto" and float(torch.as_tensor(inputs["label"]).reshape(-1)[0]) not in (0.0, 1.0):
            raise BadRequestError(f"datum {i}: kto label must be 1 (desirable) or 0 (undesirable)",
                                  param="loss_fn_inputs.label")
    if spec.name == "kto" and len(loss_fn_inputs_D) < 2:
        raise BadRequestError("kto needs at least 2 examples per batch (mismatched KL pairs)", param="data")
    if spec.name == "dpo" and len(loss_fn_inputs_D) % 2:
        raise BadRequestError("dpo needs an even number of datums: chosen, rejected, chosen, ...", param="data")
    return _check_config(spec, loss_fn_config)


def compute_loss(loss_fn: str, target_logprobs_D: Sequence[Tensor],
                 loss_fn_inputs_D: Sequence[Mapping[str, Tensor]],
                 loss_fn_config: Mapping[str, Any] | None = None) -> LossOutput:
    """Validate, then compute built-in loss ``loss_fn`` over datums (the Tinker ``forward_backward`` loss).

    Args:
        loss_fn: a :data:`LossName`.
        target_logprobs_D: per datum, log p_θ(target_tokens) with grad, shaped like ``target_tokens``.
        loss_fn_inputs_D: per datum, ``loss_fn_inputs`` as tensors (see ``LOSSES[name]``).
        loss_fn_config: optional overrides of ``LOSSES[name].config_defaults``.
    Returns: :class:`LossOutput`; call ``.loss.backward()``.
    Raises: BadRequestError (see :func:`validate_loss_request`; also logprobs/target_tokens shape mismatch).
    """
    config = validate_loss_request(loss_fn, loss_fn_inputs_D, loss_fn_config)
    if len(target_logprobs_D) != len(loss_fn_inputs_D):
        raise BadRequestError(f"{len(target_logprobs_D)} logprob tensors for {len(loss_fn_inputs_D)} datums",
                              param="data")
    for i, (lp, inputs) in enumerate(zip(target_logprobs_D, loss_fn_inputs_D)):
        if tuple(lp.shape) != tuple(torch.as_tensor(inputs["target_tokens"]).shape):
            raise BadRequestError(f"datum {i}: logprobs shape {list(lp.shape)} != target_tokens shape",
                                  param="loss_fn_inputs.target_tokens")
    inputs_D = [{k: torch.as_tensor(v) for k, v in x.items()} for x in loss_fn_inputs_D]
    return LOSSES[loss_fn].fn(list(target_logprobs_D), inputs_D, config)
