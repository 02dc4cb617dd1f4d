"""Built-in training losses as pure tensor functions, plus the registry the trainer dispatches on.

Two layers, each keyed by the name of a :class:`~livelora.core.losses.LossSpec`:

* **Tensor functions** (``cross_entropy``, ``importance_sampling``, ``ppo``, ``cispo``, ``dro``, ``gspo``, ``kto``,
  ``dpo``): pure functions of tensors with shape-suffixed arguments, the paper equation and a pinned
  reference implementation in each docstring; they return :class:`LossOutput` (a 0-d loss with grad + flat
  metrics). Token losses accept any shape (concatenated ``(T,)`` tokens or padded ``(D, T)``) plus an
  optional ``mask_T``; masked positions are zeroed *before* any arithmetic, so garbage (NaN, ``-inf``) in
  padding can leak into neither the value nor the gradient.
* **Datum functions** (``LOSS_FUNCTIONS[name]`` / :func:`compute_loss`): the Tinker shape. One entry per
  datum: ``target_logprobs_D[i]`` = log p_θ(target_tokens) of datum i (shape ``(N_i,)``, or ``(N_i, K)``
  for 2-D cross-entropy), computed by the trainer with grad; ``loss_fn_inputs_D[i]`` = that datum's
  ``loss_fn_inputs`` as torch tensors. Ragged lengths, no padding.

What each loss reads and accepts (inputs, config defaults and ranges, minimum batch, pairing, gradient
positions) is its spec in :mod:`livelora.core.losses`, and the one validation is the shared
``validate_batch`` / ``validate_loss_inputs`` there. Adding a loss: its spec in
``core/losses/builtin.py``, its tensor function here, registered with ``@register("<name>")`` in
``_registry.py``.

Notation (tinker-cookbook ``CONTRIBUTING.md``): ``_T`` tokens, ``_B`` sequences/examples, ``_D`` datums,
``_G`` group members, ``_P`` groups. ``lp`` = trainer logprob, ``q`` = sampler logprob, ``A`` = advantage,
``r = exp(lp - q)``, ``sg`` = stop-gradient. Units: logprobs in nats; token losses are nats summed over
tokens (``loss:sum``, no normalisation, like Tinker); KTO/DPO are means over examples/pairs.

Reference: ``../shared/reference/losses.md`` (semantics, test vectors §3, regressions §7) and
``tinker_protocol.md`` §3. Every metric key is ``name:reduction``; ``loss:sum`` is always present.
"""

from __future__ import annotations

from ._advantages import group_advantages
from ._custom import CustomLossResult, run_custom_loss, surrogate_weights
from ._preference import dpo, kl_pair_order, kto, sequence_logprobs
from ._registry import LOSS_FUNCTIONS, DatumLossFn, compute_loss, register, validate_loss_request
from ._token import LossOutput, cispo, cross_entropy, dro, gspo, importance_sampling, ppo

__all__ = [
    "LOSS_FUNCTIONS",
    "CustomLossResult",
    "DatumLossFn",
    "LossOutput",
    "cispo",
    "compute_loss",
    "cross_entropy",
    "dpo",
    "dro",
    "group_advantages",
    "gspo",
    "importance_sampling",
    "kl_pair_order",
    "kto",
    "ppo",
    "register",
    "run_custom_loss",
    "sequence_logprobs",
    "surrogate_weights",
    "validate_loss_request",
]
