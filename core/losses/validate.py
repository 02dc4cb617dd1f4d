"""The one validation of a training batch against the loss specs. Torch-free: it reads wire types only.

The gateway calls :func:`validate_batch` when a ``forward``/``forward_backward`` arrives (a bad request is
refused at the door, and its future fails without reaching the trainer); the trainer calls the same
function at ``TrainingModel.forward``/``forward_backward``'s entry, before any trainer state changes;
:func:`validate_loss_inputs` is the same check for callers holding ``loss_fn_inputs`` without a
``model_input`` (the trainer's datum-level ``compute_loss``), including the inputs the trainer fills.

Every problem raises :class:`~livelora.clients.errors.BadRequestError` (400) whose message starts with the
field (``data[3].loss_fn_inputs.weights: ...``) and whose ``param`` names it: ``loss_fn`` for an unknown
or refused loss (refused Tinker losses are ``unsupported_parameter``), ``loss_fn_config.<key>``,
``data`` for batch-level problems, ``data[i].model_input`` and ``data[i].loss_fn_inputs.<key>``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from livelora.clients.errors import BadRequestError, ContextLengthExceededError, UnsupportedParameterError
from livelora.clients.types.tinker import Datum, TensorData
from livelora.core.losses.builtin import LOSS_SPECS, REFUSED_LOSSES
from livelora.core.losses.spec import LossInput, LossSpec

#: Which inputs a batch carries: what a client sends, or that plus what the trainer computed.
Stage = Literal["client", "trainer"]


@dataclass(frozen=True)
class ResolvedLoss:
    """A validated request's loss: its spec and ``loss_fn_config`` filled with the spec's defaults."""

    spec: LossSpec
    config: dict[str, float] = field(default_factory=dict)

    @property
    def loss_fn(self) -> str:
        return self.spec.name


def get_spec(loss_fn: Any) -> LossSpec:
    """The spec of ``loss_fn``.

    Raises:
        UnsupportedParameterError: a Tinker loss livelora refuses (``gspo``, ``stable_reinforce``, ``custom``).
        BadRequestError: any other unknown name (``param`` = ``loss_fn``, the built-in names listed).
    """
    if isinstance(loss_fn, str) and loss_fn in REFUSED_LOSSES:
        raise UnsupportedParameterError(f"loss_fn {loss_fn!r} is refused: {REFUSED_LOSSES[loss_fn]}", param="loss_fn")
    spec = LOSS_SPECS.get(loss_fn) if isinstance(loss_fn, str) else None
    if spec is None:
        raise BadRequestError(f"unknown loss_fn {loss_fn!r}; built-in losses: {', '.join(LOSS_SPECS)}", param="loss_fn")
    return spec


def resolve_config(spec: LossSpec, loss_fn_config: Mapping[str, Any] | None) -> dict[str, float]:
    """``loss_fn_config`` checked against ``spec.config`` and filled with defaults (values as floats).

    Raises:
        BadRequestError: a key the loss does not accept, a value that is not a finite number (booleans and
            text included) or out of the key's range; ``param`` = ``loss_fn_config.<key>``.
    """
    given = dict(loss_fn_config or {})
    keys = {c.name: c for c in spec.config}
    for key in given:
        if key not in keys:
            raise BadRequestError(
                f"loss_fn_config key {key!r} is not accepted by {spec.name} (accepted: {', '.join(keys) or 'none'})",
                param=f"loss_fn_config.{key}",
            )
    resolved: dict[str, float] = {}
    for key, ck in keys.items():
        value = given.get(key, ck.default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BadRequestError(
                f"loss_fn_config {key!r} must be a finite number, got {value!r}", param=f"loss_fn_config.{key}"
            )
        ck.check(float(value), spec.name)
        resolved[key] = float(value)
    return resolved


def check_batch_size(spec: LossSpec, n_datums: int) -> None:
    """Raise BadRequestError (``param`` = ``data``) for an empty batch, a broken pairing or too few datums."""
    if n_datums == 0:
        raise BadRequestError("data: the batch is empty", param="data")
    if spec.pairing == "chosen_rejected" and n_datums % 2:
        raise BadRequestError(
            f"data: {spec.name} needs (chosen, rejected) pairs (datums 2k, 2k+1), got an odd "
            f"number of datums ({n_datums})",
            param="data",
        )
    if n_datums < spec.min_batch:
        raise BadRequestError(
            f"data: {spec.name} needs at least {spec.min_batch} datums per call "
            f"({spec.min_batch_reason}), got {n_datums}",
            param="data",
        )


def validate_batch(
    data: Sequence[Datum], loss_fn: Any, loss_fn_config: Mapping[str, Any] | None, *, vocab_size: int, max_seq_len: int
) -> ResolvedLoss:
    """Validate a client's ``forward``/``forward_backward`` batch; return the loss and its resolved config.

    Checks, in order: the loss name, its config, the batch size (empty, pairing, minimum), then per datum
    ``model_input`` (non-empty, at most ``max_seq_len`` tokens, ids in ``[0, vocab_size)``) and its
    ``loss_fn_inputs`` (:func:`validate_loss_inputs` rules; inputs the trainer computes are refused).

    Args:
        data: the datums, as sent.
        vocab_size: rows of the model's embedding (tokens).
        max_seq_len: the longest accepted ``model_input`` (tokens).

    Raises:
        BadRequestError: see the module docstring.
        ContextLengthExceededError: a ``model_input`` longer than ``max_seq_len``.
        UnsupportedParameterError: a refused Tinker loss.
    """
    spec = get_spec(loss_fn)
    config = resolve_config(spec, loss_fn_config)
    check_batch_size(spec, len(data))
    for i, datum in enumerate(data):
        where = f"data[{i}].model_input"
        tokens = datum.model_input.to_ints()
        if not tokens:
            raise BadRequestError(f"{where}: no tokens", param=where)
        if len(tokens) > max_seq_len:
            raise ContextLengthExceededError(
                f"{where}: {len(tokens)} tokens exceed the context length of {max_seq_len}", param=where
            )
        bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise BadRequestError(f"{where}: token id {bad} is outside the vocabulary [0, {vocab_size})", param=where)
        _check_inputs(spec, i, datum.loss_fn_inputs, len(tokens), vocab_size, "client", True)
    return ResolvedLoss(spec, config)


def validate_loss_inputs(
    loss_fn: Any,
    loss_fn_inputs_D: Sequence[Mapping[str, TensorData]],
    loss_fn_config: Mapping[str, Any] | None = None,
    *,
    stage: Stage = "trainer",
    vocab_size: int | None = None,
    datum_params: bool = True,
) -> ResolvedLoss:
    """Validate per-datum ``loss_fn_inputs`` alone (no ``model_input``: N is ``target_tokens``' first dimension).

    Args:
        loss_fn_inputs_D: per datum, ``{key: TensorData}``.
        stage: ``"trainer"`` requires the trainer-filled inputs too (``ref_logprobs``, ``kl_logratio``);
            ``"client"`` refuses them.
        vocab_size: when given, ``int64`` inputs must lie in ``[0, vocab_size)``.
        datum_params: ``param`` is ``data[i].loss_fn_inputs.<key>`` (True) or ``loss_fn_inputs.<key>``.

    Raises: as :func:`validate_batch`.
    """
    spec = get_spec(loss_fn)
    config = resolve_config(spec, loss_fn_config)
    check_batch_size(spec, len(loss_fn_inputs_D))
    for i, inputs in enumerate(loss_fn_inputs_D):
        _check_inputs(spec, i, inputs, None, vocab_size, stage, datum_params)
    return ResolvedLoss(spec, config)


def _check_inputs(
    spec: LossSpec,
    i: int,
    inputs: Mapping[str, TensorData],
    n: int | None,
    vocab_size: int | None,
    stage: Stage,
    datum_params: bool,
) -> None:
    """One datum's ``loss_fn_inputs`` against ``spec`` (``n``: its ``model_input`` length, None if unknown)."""

    def fail(key: str, message: str) -> BadRequestError:
        name = f"data[{i}].loss_fn_inputs.{key}"
        return BadRequestError(f"{name}: {message}", param=name if datum_params else f"loss_fn_inputs.{key}")

    expected = [x for x in spec.inputs if stage == "trainer" or x.source == "client"]
    missing = [x.name for x in expected if x.required and x.name not in inputs]
    if missing:
        raise BadRequestError(
            f"data[{i}].loss_fn_inputs: missing {', '.join(missing)} (required by {spec.name})",
            param=f"data[{i}].loss_fn_inputs.{missing[0]}" if datum_params else f"loss_fn_inputs.{missing[0]}",
        )
    declared_inputs: dict[str, LossInput] = {}
    for key in sorted(inputs):
        declared = spec.input(key)
        if declared is not None and declared.source == "trainer" and stage == "client":
            raise fail(key, f"computed by the trainer for {spec.name} ({declared.doc}); do not send it")
        if declared is None:
            names = ", ".join(x.name for x in expected)
            raise fail(key, f"not an input of {spec.name} (expected: {names})")
        declared_inputs[key] = declared
    targets = inputs["target_tokens"].resolved_shape()
    n = n if n is not None else (targets[0] if targets else 0)
    two_d = spec.top_k_targets and len(targets) == 2 and targets[0] == n and targets[1] >= 1
    token_shape = targets if two_d else [n]
    for key, declared in declared_inputs.items():
        _check_tensor(
            declared,
            inputs[key],
            [1] if declared.shape == "datum" else token_shape,
            n,
            vocab_size,
            spec.name,
            lambda message, key=key: fail(key, message),
        )


def _check_tensor(
    decl: LossInput, td: TensorData, want: list[int], n: int, vocab_size: int | None, loss_fn: str, fail
) -> None:
    if td.dtype != decl.dtype:
        raise fail(f"dtype must be {decl.dtype}, got {td.dtype}")
    shape = td.resolved_shape()
    if shape != want:
        raise fail(f"shape must be {want} (model_input has {n} tokens), got {shape}")
    if len(td.data) != math.prod(want):
        raise fail(f"{len(td.data)} values for shape {shape}")
    if decl.dtype == "int64":
        if any(isinstance(v, float) and not v.is_integer() for v in td.data):
            raise fail("int64 tensor holds non-integer values")
        low, high = 0, vocab_size
        bad = next((v for v in td.data if v < low or (high is not None and v >= high)), None)
        if bad is not None:
            span = f"[0, {vocab_size})" if vocab_size is not None else "≥ 0"
            raise fail(f"token id {bad} is outside the vocabulary {span}")
    else:
        bad = next((v for v in td.data if not math.isfinite(v)), None)
        if bad is not None:
            raise fail(f"non-finite value {bad}")
    if decl.allowed_values and any(v not in decl.allowed_values for v in td.data):
        allowed = " or ".join(f"{v:g}" for v in decl.allowed_values)
        raise fail(f"must be {allowed} ({decl.doc}), got {next(v for v in td.data if v not in decl.allowed_values)}")
    if decl.nonzero_reason and not any(v != 0 for v in td.data):
        raise fail(f"{loss_fn} {decl.nonzero_reason}")
