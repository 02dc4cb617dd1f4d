"""Checkpoint paths as model names: ``tinker://<model_id>/sampler_weights/<name>`` and ``<base>;<path>``.

A sampler checkpoint is a stored version ``<lineage>@<n>`` of its training run's lineage, so a request naming its
path is served like one naming that version (:mod:`.on_demand`: the same owner check, the same load); the reply
echoes the path as ``model``. :func:`checkpoint_version` answers which version a path names. A path in another
spelling, a training-state or export path, and a base that is not the checkpoint's are 400s that depend on the
text alone; a missing checkpoint and another tenant's answer one 404. The forms: ``docs/clients.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from livelora.clients.errors import BadRequestError, ModelNotFoundError, NotFoundError
from livelora.core.api_keys import Principal
from livelora.core.object_ids import parse_ref
from livelora.core.session_protocol import CheckpointIndex, is_expired, lineage_for, parse_tinker_path

#: How a ``model`` that is a checkpoint path starts (any case: another spelling of the scheme is a 400, not a 404).
SCHEME = "tinker:"
_NOT_SERVABLE = {
    "weights": "a training checkpoint (weights and optimizer state, saved with save_state)",
    "external_weights": "an external-weights export (for download)",
}


def split_checkpoint_name(model: str) -> tuple[str | None, str] | None:
    """``(base or None, path)`` when ``model`` is spelled as a checkpoint path (``tinker:...`` or
    ``<base>;tinker:...``), else ``None``."""
    base, sep, rest = model.partition(";")
    path = rest if sep else model
    return (base if sep else None, path) if path.lower().startswith(SCHEME) else None


def checkpoint_version(
    model: str,
    principal: Principal | None,
    *,
    home: Path | str,
    base_names: Sequence[str],
    may_use: Callable[[str, Principal | None], bool],
) -> str | None:
    """The stored version ``<lineage>@<n>`` that ``model`` names when it is a sampler checkpoint path (or
    ``<base>;<path>``) of a run ``principal`` may use (``may_use(lineage, principal)``); ``None`` when ``model`` is
    not spelled as a checkpoint path. ``base_names``: the served base model's names, its served name first.

    Raises:
        BadRequestError: another spelling of a path (``invalid_id``), a training-state or export path, or a base
            that is not the served one / the checkpoint's (400, param ``model``).
        ModelNotFoundError: no such sampler checkpoint, an expired one, or another tenant's (one 404).
    """
    split = split_checkpoint_name(model)
    if split is None:
        return None
    base, path = split
    parse_ref("path", path, param="model")
    model_id, kind, name = parse_tinker_path(path)
    if kind in _NOT_SERVABLE:
        raise BadRequestError(
            f"model {model!r} names {_NOT_SERVABLE[kind]}, which cannot be served: save the weights for sampling "
            f"(save_weights_for_sampler) and name that path, tinker://{model_id}/sampler_weights/<name>",
            param="model",
            code="not_a_sampler_checkpoint",
        )
    if base is not None and base not in base_names:
        raise BadRequestError(
            f"model {model!r}: {base!r} is not the base model of the checkpoints served here; write "
            f"'{base_names[0]};{path}' or the path alone",
            param="model",
            code="base_model_mismatch",
        )
    missing = ModelNotFoundError(
        f"model {model!r} does not exist: no sampler checkpoint you may use has that path", param="model"
    )
    lineage = lineage_for(model_id)
    if not may_use(lineage, principal):
        raise missing
    try:
        index = CheckpointIndex(home, model_id).read()
    except NotFoundError:
        raise missing from None
    entry = index.get("checkpoints", {}).get(f"{kind}/{name}")
    if entry is None or is_expired(entry):
        raise missing
    if base is not None and index.get("base_model") not in base_names:
        raise BadRequestError(
            f"model {model!r}: the checkpoint was trained on {index.get('base_model')!r}, not {base!r}",
            param="model",
            code="base_model_mismatch",
        )
    return f"{lineage}@{int(entry['version'])}"
