"""Loss specifications and the one batch validation, shared by the gateway and the trainer. Torch-free.

A loss is a :class:`LossSpec` here (inputs with dtype and shape rule, config keys with defaults and ranges,
minimum batch, pairing, gradient positions, reduction, sources) plus one tensor function registered under the
same name in :mod:`livelora.trainer.losses`. The gateway validates a request with :func:`validate_batch` without
importing torch; the trainer calls the same function on entry and dispatches on ``spec.name``. Custom losses
need neither (:data:`REFUSED_LOSSES`, ``docs/internals/losses.md`` §2.8).

Example::

    LOSS_SPECS["ppo"].config_defaults          # {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    resolved = validate_batch(data, "ppo", {"clip_high_threshold": 1.28}, vocab_size=49152, max_seq_len=8192)
    resolved.config                            # {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}
"""

from __future__ import annotations

from typing import Literal

from livelora.core.losses.builtin import LOSS_SPECS, REFUSED_LOSSES
from livelora.core.losses.spec import ConfigKey, GradientPositions, LossInput, LossSpec
from livelora.core.losses.validate import (
    ResolvedLoss,
    check_batch_size,
    get_spec,
    resolve_config,
    validate_batch,
    validate_loss_inputs,
)

#: The built-in loss names, in registry order.
SUPPORTED_LOSSES: tuple[str, ...] = tuple(LOSS_SPECS)
#: ``Literal[...]`` of the built-in names, built from the registry (for runtime checks; type checkers see it
#: as an opaque alias).
LossName = Literal[SUPPORTED_LOSSES]  # type: ignore[valid-type]

__all__ = [
    "LOSS_SPECS",
    "REFUSED_LOSSES",
    "SUPPORTED_LOSSES",
    "ConfigKey",
    "GradientPositions",
    "LossInput",
    "LossName",
    "LossSpec",
    "ResolvedLoss",
    "check_batch_size",
    "get_spec",
    "resolve_config",
    "validate_batch",
    "validate_loss_inputs",
]
