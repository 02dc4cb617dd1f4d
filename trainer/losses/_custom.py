"""Custom losses: the two-pass linear surrogate of tinker ``forward_backward_custom`` (docs/internals/losses.md
§2.8)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from livelora.clients.errors import BadRequestError


def surrogate_weights(loss: Tensor, logprobs_D: Sequence[Tensor]) -> list[Tensor]:
    """Per-token weights ``w_i = −∂loss/∂logprobs_i`` for the cross-entropy surrogate of a custom loss.

    The trainer then runs ``cross_entropy`` with these ``weights``: ``L_s = −Σ w·lp``, so
    ``∂L_s/∂lp = −w = ∂loss/∂lp`` and, by the chain rule, ``∂L_s/∂θ = ∂loss/∂θ`` exactly (evaluated at
    the logprobs of pass 1; the surrogate's *value* differs from ``loss``).

    Args:
        loss: 0-d tensor computed from ``logprobs_D``.
        logprobs_D: per-datum logprob tensors (``(N_i,)`` or ``(N_i, K)``) that require grad.
    Returns: detached weights, one per datum, same shapes; zeros where the loss does not depend on a datum.
    Raises: BadRequestError if ``loss`` is not a finite scalar or does not depend on the logprobs.
    Source: tinker SDK ``training_client.py::forward_backward_custom``.
    """
    if loss.numel() != 1 or not bool(torch.isfinite(loss.detach()).all()):
        raise BadRequestError("a custom loss must return a finite scalar tensor", param="loss")
    if not loss.requires_grad:
        raise BadRequestError("the custom loss does not depend on the logprobs (no gradient)", param="loss")
    grads = torch.autograd.grad(loss.reshape(()), list(logprobs_D), allow_unused=True)
    return [(-g if g is not None else torch.zeros_like(lp)).detach() for g, lp in zip(grads, logprobs_D)]


@dataclass(frozen=True)
class CustomLossResult:
    """Outcome of pass 1 of a custom loss: its value, the user's metrics, and the surrogate weights."""

    loss: float
    metrics: dict[str, float]
    weights_D: list[Tensor]


def run_custom_loss(
    loss_fn: Callable[[Any, list[Tensor]], tuple[Tensor, Mapping[str, float]]], data: Any, logprobs_D: Sequence[Tensor]
) -> CustomLossResult:
    """Evaluate ``loss_fn(data, logprobs)`` on fresh leaves and return the surrogate weights.

    Mirrors tinker ``forward_backward_custom`` step 3: ``logprobs_D`` (from a forward pass) are detached,
    made leaves with grad, passed to the user function, and differentiated. Metrics returned to the
    client are the user's, plus ``loss:sum`` = the custom loss value.
    """
    leaves = [lp.detach().clone().requires_grad_(True) for lp in logprobs_D]
    loss, metrics = loss_fn(data, leaves)
    weights_D = surrogate_weights(loss, leaves)
    return CustomLossResult(float(loss.detach()), {**dict(metrics), "loss:sum": float(loss.detach())}, weights_D)
