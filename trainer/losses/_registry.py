"""Datum-level loss functions (Tinker ``forward_backward`` shape), one per spec name, and :func:`compute_loss`.

What a loss reads and accepts is its :class:`~livelora.core.losses.LossSpec` (``LOSS_SPECS``); this
module holds only the tensor side: for each spec name, a function that turns ragged per-datum tensors into
the arguments of a pure tensor function (``_token.py``, ``_preference.py``) and calls it. Validation is the
shared :func:`~livelora.core.losses.validate_loss_inputs`, never repeated here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from livelora.clients.errors import BadRequestError
from livelora.clients.types.tinker import TensorData
from livelora.core.losses import LOSS_SPECS, validate_loss_inputs

from ._preference import dpo, kto, sequence_logprobs
from ._token import LossOutput, cispo, cross_entropy, dro, gspo, importance_sampling, ppo

#: ``fn(target_logprobs_D, loss_fn_inputs_D, config) -> LossOutput``: per datum, log p_θ(target_tokens) with
#: grad (shape of ``target_tokens``) and that datum's inputs as tensors (trainer-filled ones included);
#: ``config`` already resolved by the spec (defaults filled, ranges checked).
DatumLossFn = Callable[[Sequence[Tensor], Sequence[Mapping[str, Tensor]], Mapping[str, float]], LossOutput]

#: spec name → datum-level loss function; exactly the names of ``LOSS_SPECS`` (tests/test_loss_specs.py).
LOSS_FUNCTIONS: dict[str, DatumLossFn] = {}


def register(name: str) -> Callable[[DatumLossFn], DatumLossFn]:
    """Register ``fn`` as the tensor side of spec ``name`` (raises KeyError for a name without a spec)."""
    if name not in LOSS_SPECS:
        raise KeyError(f"no LossSpec named {name!r} in livelora.core.losses.LOSS_SPECS; add the spec first")

    def add(fn: DatumLossFn) -> DatumLossFn:
        LOSS_FUNCTIONS[name] = fn
        return fn

    return add


def _cat(tensors: Sequence[Tensor], like: Tensor) -> Tensor:
    return torch.cat([t.reshape(-1).to(like) for t in tensors])


@register("cross_entropy")
def _datum_cross_entropy(lp_D, inputs_D, cfg):
    return cross_entropy(_cat(lp_D, lp_D[0]), _cat([x["weights"] for x in inputs_D], lp_D[0]))


def _datum_rl(fn):
    def run(lp_D, inputs_D, cfg):
        like = lp_D[0]
        mask = None
        if any("mask" in x for x in inputs_D):
            mask = _cat([x.get("mask", torch.ones_like(lp)) for x, lp in zip(inputs_D, lp_D)], like)
        return fn(
            _cat(lp_D, like),
            _cat([x["logprobs"] for x in inputs_D], like),
            _cat([x["advantages"] for x in inputs_D], like),
            mask_T=mask,
            **cfg,
        )

    return run


for _fn in (importance_sampling, ppo, cispo, dro):
    register(_fn.__name__)(_datum_rl(_fn))


@register("gspo")
def _datum_gspo(lp_D, inputs_D, cfg):
    def col(key):
        return [x[key].reshape(-1) for x in inputs_D]

    mask = None
    if any("mask" in x for x in inputs_D):
        mask = [x["mask"].reshape(-1) if "mask" in x else torch.ones_like(lp) for x, lp in zip(inputs_D, lp_D)]
    return gspo(
        [lp.reshape(-1) for lp in lp_D],
        col("logprobs"),
        col("advantages"),
        col("sequence_ratio_mask"),
        mask_D=mask,
        **cfg,
    )


def _datum_logratios(lp_D, inputs_D) -> Tensor:
    like = lp_D[0]
    return torch.stack(
        [
            sequence_logprobs(lp, x["weights"]) - sequence_logprobs(x["ref_logprobs"].to(like), x["weights"])
            for lp, x in zip(lp_D, inputs_D)
        ]
    )


def _example_weights(inputs_D, like: Tensor) -> Tensor | None:
    """Per-datum ``example_weight`` (absent: 1) as a (D,) tensor; None when no datum has one."""
    if not any("example_weight" in x for x in inputs_D):
        return None
    return torch.stack(
        [
            x["example_weight"].reshape(-1)[0].to(like)
            if "example_weight" in x
            else torch.ones((), dtype=like.dtype, device=like.device)
            for x in inputs_D
        ]
    )


@register("kto")
def _datum_kto(lp_D, inputs_D, cfg):
    labels = [float(x["label"].reshape(-1)[0]) for x in inputs_D]
    desirable_B = torch.tensor([lab == 1.0 for lab in labels])
    kl_B = torch.stack([x["kl_logratio"].reshape(-1)[0].to(lp_D[0]) for x in inputs_D])
    return kto(
        _datum_logratios(lp_D, inputs_D),
        desirable_B,
        kl_B,
        example_weights_B=_example_weights(inputs_D, lp_D[0]),
        **cfg,
    )


@register("dpo")
def _datum_dpo(lp_D, inputs_D, cfg):
    logratios = _datum_logratios(lp_D, inputs_D)
    a = _example_weights(inputs_D, lp_D[0])
    return dpo(logratios[0::2], logratios[1::2], example_weights_B=None if a is None else a[0::2], **cfg)


def validate_loss_request(
    loss_fn: str, loss_fn_inputs_D: Sequence[Mapping[str, Any]], loss_fn_config: Mapping[str, Any] | None = None
) -> dict[str, float]:
    """Check datum-level tensors against the loss's spec (trainer-filled inputs included); return the config.

    A thin adapter: the tensors become wire :class:`TensorData` (int tensors int64, float ones float32)
    and go through the shared :func:`~livelora.core.losses.validate_loss_inputs`.
    Raises: BadRequestError naming ``loss_fn``, ``data``, ``loss_fn_inputs.<key>`` or ``loss_fn_config.<key>``.
    """
    wire_D = [{k: TensorData.from_torch(torch.as_tensor(v)) for k, v in x.items()} for x in loss_fn_inputs_D]
    return validate_loss_inputs(loss_fn, wire_D, loss_fn_config, stage="trainer", datum_params=False).config


def compute_loss(
    loss_fn: str,
    target_logprobs_D: Sequence[Tensor],
    loss_fn_inputs_D: Sequence[Mapping[str, Tensor]],
    loss_fn_config: Mapping[str, Any] | None = None,
) -> LossOutput:
    """Validate, then compute loss ``loss_fn`` over datums (the Tinker ``forward_backward`` loss).

    Args:
        loss_fn: a name of ``LOSS_SPECS``.
        target_logprobs_D: per datum, log p_θ(target_tokens) with grad, shaped like ``target_tokens``.
        loss_fn_inputs_D: per datum, ``loss_fn_inputs`` as tensors (the spec's inputs, trainer-filled ones too).
        loss_fn_config: optional overrides of the spec's ``config_defaults``.
    Returns: :class:`LossOutput`; call ``.loss.backward()``.
    Raises: BadRequestError (see :func:`validate_loss_request`; also logprobs/target_tokens shape mismatch).
    """
    config = validate_loss_request(loss_fn, loss_fn_inputs_D, loss_fn_config)
    if len(target_logprobs_D) != len(loss_fn_inputs_D):
        raise BadRequestError(
            f"{len(target_logprobs_D)} logprob tensors for {len(loss_fn_inputs_D)} datums", param="data"
        )
    for i, (lp, inputs) in enumerate(zip(target_logprobs_D, loss_fn_inputs_D)):
        if tuple(lp.shape) != tuple(torch.as_tensor(inputs["target_tokens"]).shape):
            raise BadRequestError(
                f"datum {i}: logprobs shape {list(lp.shape)} != target_tokens shape",
                param="loss_fn_inputs.target_tokens",
            )
    inputs_D = [{k: torch.as_tensor(v) for k, v in x.items()} for x in loss_fn_inputs_D]
    return LOSS_FUNCTIONS[loss_fn](list(target_logprobs_D), inputs_D, config)
