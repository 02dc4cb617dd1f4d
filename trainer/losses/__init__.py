"""Built-in training losses as pure tensor functions, plus the registry the trainer dispatches on.

Two layers, each keyed by the name of a :class:`~livelora.core.losses.LossSpec`: **tensor functions**
(``cross_entropy``, ``importance_sampling``, ``ppo``, ``cispo``, ``dro``, ``gspo``, ``kto``, ``dpo``) with
shape-suffixed arguments that return a :class:`LossOutput` (0-d loss with grad + flat metrics, ``loss:sum`` always
present), and **datum functions** (``LOSS_FUNCTIONS[name]`` / :func:`compute_loss`), the Tinker shape: one
``target_logprobs_D[i]`` (``(N_i,)``, or ``(N_i, K)`` for 2-D cross-entropy) and one ``loss_fn_inputs_D[i]`` per
datum, ragged, no padding. Token losses are nats summed over tokens; KTO/DPO are means over examples/pairs.

What each loss reads and accepts is its spec in :mod:`livelora.core.losses` (one validation, shared with the
gateway). Adding a loss: its spec in ``core/losses/builtin.py``, its tensor function here, registered with
``@register("<name>")`` in ``_registry.py``. Notation, formulas, sources and test vectors:
``docs/internals/losses.md``.
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
