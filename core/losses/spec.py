"""The vocabulary of a loss specification: inputs, config keys, gradient positions, the spec itself. Torch-free.

A :class:`LossSpec` is plain data. The gateway reads it to validate a request at the door
(:mod:`livelora.core.losses.validate`); the trainer reads the same object to validate again at
``TrainingModel.forward_backward``'s entry, to decide which positions need gradients and to find the
tensor function registered under the spec's name (:mod:`livelora.trainer.losses`).

Shapes use Tinker's token alignment: ``N = model_input.length``, position ``i`` predicts token ``i+1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from livelora.clients.errors import BadRequestError

#: How an input's shape relates to the datum (``N`` = ``model_input`` tokens):
#: ``"targets"``: ``target_tokens`` itself, ``(N,)``, or ``(N, K)`` when the spec sets ``top_k_targets``;
#: ``"tokens"``: the shape of ``target_tokens``; ``"datum"``: one number per datum, ``(1,)``.
InputShape = Literal["targets", "tokens", "datum"]
#: Who fills an input: the client sends it, or the trainer computes it before the loss (never sent).
InputSource = Literal["client", "trainer"]
#: How datums form the loss's examples: each datum alone, or DPO's (chosen, rejected) pairs 2k, 2k+1.
Pairing = Literal["none", "chosen_rejected"]


@dataclass(frozen=True)
class LossInput:
    """One ``loss_fn_inputs`` key of a loss.

    Attributes:
        name: the key (``"weights"``).
        dtype: wire dtype, ``"int64"`` (token ids) or ``"float32"``.
        shape: see :data:`InputShape`.
        doc: meaning and unit, one line (shown in error messages and docs).
        required: a datum without it is refused (``False``: optional).
        source: ``"client"`` (sent) or ``"trainer"`` (computed by the trainer; a client sending it is refused).
        allowed_values: when set, every value must be one of these (KTO ``label``: 0 or 1).
        nonzero_reason: when set, the tensor needs at least one non-zero value; the text says why.
    """

    name: str
    dtype: Literal["int64", "float32"]
    shape: InputShape
    doc: str
    required: bool = True
    source: InputSource = "client"
    allowed_values: tuple[float, ...] = ()
    nonzero_reason: str = ""


@dataclass(frozen=True)
class ConfigKey:
    """One ``loss_fn_config`` key: a finite number with a default and an accepted range.

    Attributes:
        name: the key (``"clip_high_threshold"``).
        default: the value used when the request leaves it out.
        doc: meaning and unit.
        minimum / maximum: inclusive bounds (None: unbounded); ``exclusive_minimum`` makes the lower bound strict.
        hint: appended to the out-of-range message (e.g. how Tinker's thresholds relate to PPO's ε).
    """

    name: str
    default: float
    doc: str
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    hint: str = ""

    def check(self, value: float, loss_fn: str) -> None:
        """Raise BadRequestError (``param`` = ``loss_fn_config.<name>``) when ``value`` is out of range."""
        low_bad = self.minimum is not None and (
            value < self.minimum or (self.exclusive_minimum and value == self.minimum)
        )
        high_bad = self.maximum is not None and value > self.maximum
        if low_bad or high_bad:
            raise BadRequestError(
                f"loss_fn_config {self.name} of {loss_fn} must be {self.range_text()}, got {value}"
                f"{'; ' + self.hint if self.hint else ''}",
                param=f"loss_fn_config.{self.name}",
            )

    def range_text(self) -> str:
        """``"in [0, 1]"``, ``"≥ 1"``, ``"> 0"``, ... (``"any finite number"`` when unbounded)."""
        lo, hi = self.minimum, self.maximum
        if lo is not None and hi is not None:
            return f"in {'(' if self.exclusive_minimum else '['}{lo:g}, {hi:g}]"
        if lo is not None:
            return f"{'>' if self.exclusive_minimum else '≥'} {lo:g}"
        if hi is not None:
            return f"≤ {hi:g}"
        return "any finite number"


@dataclass(frozen=True)
class GradientPositions:
    """Which positions' logprobs the loss can differentiate; the loss multiplies every other one by exactly 0.

    The trainer builds the autograd graph of the unembedding only at these positions (same values,
    less backward work). Rule: start from the positions where input ``nonzero`` is non-zero (for a
    ``(N, K)`` input: any of the K), or from every position when ``nonzero`` is None; then drop the
    positions where an optional ``masks`` input is present and 0.

    Attributes:
        nonzero: the input whose non-zero entries mark the positions, or None for all positions.
        masks: optional inputs that remove positions where they are 0.
        why: the reason, from the loss's formula.
    """

    nonzero: str | None
    masks: tuple[str, ...] = ()
    why: str = ""


@dataclass(frozen=True)
class LossSpec:
    """Everything a loss declares besides its tensor code.

    Attributes:
        name: the ``loss_fn`` string.
        summary: the formula in one line (notation of ``trainer/losses``: ``lp`` trainer logprob, ``q`` sampler
            logprob, ``A`` advantage, ``r = exp(lp − q)``).
        inputs: ``loss_fn_inputs`` keys, client- and trainer-filled; any other key is refused.
        config: ``loss_fn_config`` keys with defaults and ranges; any other key is refused.
        reduction: ``"sum"`` over tokens and datums (Tinker's ``loss:sum``) or ``"mean"`` over examples/pairs.
        min_batch: fewest datums per call; ``min_batch_reason`` says why (shown in the error).
        pairing: see :data:`Pairing`; ``"chosen_rejected"`` needs an even number of datums.
        top_k_targets: ``target_tokens`` may be ``(N, K)`` (top-K soft targets), the other inputs following it.
        gradient: which positions get gradients (:class:`GradientPositions`).
        reference: paper and equation, and a version-pinned reference implementation.
        datum_layout: how datums map to examples, for callers.

    Micro-batching: ``"sum"`` losses add up exactly over chunks of datums. A ``"mean"`` loss is the mean over
    the datums of one call; to split a batch of B examples into chunks, scale each chunk's loss by
    ``chunk_size / B`` (DPO: whole pairs only) and, for KTO, give every datum the batch mean of the
    mismatched-pair log-ratios as ``kl_logratio`` (z0 is the mean of the values in the call).
    """

    name: str
    summary: str
    inputs: tuple[LossInput, ...]
    gradient: GradientPositions
    reference: str
    config: tuple[ConfigKey, ...] = ()
    reduction: Literal["sum", "mean"] = "sum"
    min_batch: int = 1
    min_batch_reason: str = ""
    pairing: Pairing = "none"
    top_k_targets: bool = False
    datum_layout: str = "one datum per sequence; per-token inputs have the shape of target_tokens"

    def __post_init__(self) -> None:
        names = [i.name for i in self.inputs]
        if len(set(names)) != len(names) or "target_tokens" not in names:
            raise ValueError(f"loss spec {self.name}: input names must be unique and include target_tokens")
        for ref in (self.gradient.nonzero, *self.gradient.masks):
            if ref is not None and ref not in names:
                raise ValueError(f"loss spec {self.name}: gradient rule names unknown input {ref!r}")
        if self.pairing == "chosen_rejected" and self.min_batch < 2:
            raise ValueError(f"loss spec {self.name}: a paired loss needs min_batch >= 2")

    def input(self, name: str) -> LossInput | None:
        """The input called ``name``, or None."""
        return next((i for i in self.inputs if i.name == name), None)

    @property
    def required_inputs(self) -> tuple[str, ...]:
        """Required keys, client- and trainer-filled (what the tensor function reads)."""
        return tuple(i.name for i in self.inputs if i.required)

    @property
    def optional_inputs(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs if not i.required)

    @property
    def client_inputs(self) -> tuple[str, ...]:
        """Keys a client may send (required first)."""
        return tuple(i.name for i in sorted(self.inputs, key=lambda i: not i.required) if i.source == "client")

    @property
    def trainer_inputs(self) -> tuple[str, ...]:
        """Keys the trainer computes before calling the loss (``ref_logprobs``, ``kl_logratio``)."""
        return tuple(i.name for i in self.inputs if i.source == "trainer")

    @property
    def needs_reference(self) -> bool:
        """The trainer adds the reference model's logprobs (adapter disabled) as ``ref_logprobs``."""
        return "ref_logprobs" in self.trainer_inputs

    @property
    def config_defaults(self) -> dict[str, float]:
        """``{key: default}`` of every accepted ``loss_fn_config`` key."""
        return {c.name: c.default for c in self.config}
