"""Training and sampling types of the tinker SDK 0.25–0.38 surface, on top of :mod:`.tinker`.

:mod:`livelora.clients.types.tinker` holds the JSON forms of SDK ≤0.24; here are the 0.38 additions: provenance
spans and ``forward_only`` on ``forward_backward`` (:class:`DatumV2`, :class:`ProvenanceSpan`), the new sampling
options and results (:class:`SampleRequestV2`, :class:`SampleResponseV2`, sparse :class:`WireTensorData`), and
:class:`SaveWeightsExternalRequest`. The classes subclass the ≤0.24 ones; request models are strict, response
models lenient; field names are the SDK's. The list per op: ``docs/internals/wire-types.md``. These additions
live in their own module while :mod:`.tinker` is being restructured; merge them there later.
"""

from __future__ import annotations

import itertools
from typing import Literal

from pydantic import Field, model_validator

from livelora.clients.types.tinker import (
    Datum,
    ForwardBackwardInput,
    LenientModel,
    SampledSequence,
    SampleRequest,
    SampleResponse,
    StrictModel,
    TensorData,
)

__all__ = [
    "DatumV2",
    "ForwardBackwardInputV2",
    "ForwardBackwardRequestV2",
    "PromptAltTokens",
    "ProvenanceSpan",
    "SampleRequestV2",
    "SampleResponseV2",
    "SampledSequenceV2",
    "SaveWeightsExternalRequest",
    "SaveWeightsExternalResponse",
    "TokenizerFile",
    "TokenizerFilesResponse",
    "TopkRow",
    "WireTensorData",
]

#: One position's top-k: ``[(token_id, logprob), ...]`` best first, or None where nothing was computed.
TopkRow = list[tuple[int, float]] | None


class WireTensorData(StrictModel):
    """A tensor as the SDK sends it: dense (``data`` row-major) or sparse CSR.

    Sparse CSR (2-D only): ``data`` holds the listed values, ``sparse_crow_indices`` the row pointers
    (``rows + 1`` entries, first 0, last ``nnz``, non-decreasing) and ``sparse_col_indices`` the column of
    each listed value (``nnz`` entries). Unlisted cells take a pad value that depends on the field (0 for
    ``loss_fn_inputs``; -1, "no request", for ``target_prompt_logprobs``), so densifying needs it:
    :meth:`dense`.
    """

    data: list[float] | list[int] = Field(description="Values (all cells when dense; listed cells when CSR).")
    dtype: Literal["int64", "float32"]
    shape: list[int] | None = Field(default=None, description="Dense shape; None means 1-D. Required for CSR.")
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> WireTensorData:
        if any(d < 0 for d in self.shape or ()):
            raise ValueError(f"shape {self.shape} has a negative dimension")
        if (self.sparse_crow_indices is None) != (self.sparse_col_indices is None):
            raise ValueError("sparse_crow_indices and sparse_col_indices come together")
        if self.sparse_crow_indices is None or self.sparse_col_indices is None:  # both or neither (above)
            n = _prod(self.shape) if self.shape is not None else len(self.data)
            if n != len(self.data):
                raise ValueError(f"shape {self.shape} needs {n} values, got {len(self.data)}")
            return self
        if self.shape is None or len(self.shape) != 2:
            raise ValueError(f"a sparse CSR tensor needs a 2-D shape, got {self.shape}")
        rows, cols = self.shape
        crow, col = self.sparse_crow_indices, self.sparse_col_indices
        nnz = len(self.data)
        if len(crow) != rows + 1 or crow[0] != 0 or crow[-1] != nnz or len(col) != nnz:
            raise ValueError(
                f"sparse CSR indices do not match: {rows} rows need {rows + 1} row pointers from 0 "
                f"to {nnz} and {nnz} column indices; got {len(crow)} pointers "
                f"({crow[:1]}..{crow[-1:]}) and {len(col)} columns"
            )
        if any(b < a for a, b in itertools.pairwise(crow)):
            raise ValueError("sparse_crow_indices must be non-decreasing")
        if any(c < 0 or c >= cols for c in col):
            raise ValueError(f"a sparse column index is outside [0, {cols})")
        return self

    @property
    def is_sparse(self) -> bool:
        return self.sparse_crow_indices is not None

    def resolved_shape(self) -> list[int]:
        """``shape``, or ``[len(data)]`` when omitted."""
        return list(self.shape) if self.shape is not None else [len(self.data)]

    def dense(self, pad_value: float = 0) -> TensorData:
        """The dense :class:`~livelora.clients.types.tinker.TensorData` (unlisted CSR cells = ``pad_value``)."""
        if not self.is_sparse:
            return TensorData(data=list(self.data), dtype=self.dtype, shape=self.resolved_shape())
        rows, cols = self.shape  # type: ignore[misc]
        pad = int(pad_value) if self.dtype == "int64" else float(pad_value)
        out: list = [pad] * (rows * cols)
        crow, col = self.sparse_crow_indices, self.sparse_col_indices
        for r in range(rows):
            for i in range(crow[r], crow[r + 1]):  # type: ignore[index]
                out[r * cols + col[i]] = self.data[i]  # type: ignore[index]
        return TensorData(data=out, dtype=self.dtype, shape=[rows, cols])

    @classmethod
    def from_tensor(cls, t: TensorData) -> WireTensorData:
        return cls(data=list(t.data), dtype=t.dtype, shape=t.resolved_shape())


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ================================================================================================ training
class ProvenanceSpan(StrictModel):
    """A run of datum positions and where its tokens came from (tinker ``Prompt/SampledProvenanceSpan``).

    ``kind="prompt"``: positions ``[offset, offset + length)`` of the prompt of the sampling request that
    returned ``sequence_id``; ``kind="sampled"``: positions ``[offset, offset + length)`` of that sequence's
    sampled tokens. Runs tile the field they annotate in order (lengths sum to its length).
    """

    kind: Literal["prompt", "sampled"]
    sequence_id: str = Field(min_length=1, description="A SampledSequence.sequence_id of this session.")
    offset: int = Field(default=0, ge=0, description="First covered position in the named source (tokens).")
    length: int = Field(ge=0, description="Number of covered positions (tokens).")


class DatumV2(Datum):
    """A :class:`~livelora.clients.types.tinker.Datum` with optional provenance (set both or neither).

    ``model_input_spans`` tile ``model_input`` (lengths sum to ``N``); ``loss_fn_input_spans`` tile
    ``loss_fn_inputs["target_tokens"]`` (its first dimension). ``stable_reinforce`` needs them.
    """

    model_input_spans: list[ProvenanceSpan] | None = None
    loss_fn_input_spans: list[ProvenanceSpan] | None = None

    @model_validator(mode="after")
    def _tiling(self) -> DatumV2:
        if (self.model_input_spans is None) != (self.loss_fn_input_spans is None):
            raise ValueError(
                "provenance comes as a pair: set both model_input_spans and loss_fn_input_spans or neither"
            )
        if self.model_input_spans is None:
            return self
        covered = sum(s.length for s in self.model_input_spans)
        if covered != self.model_input.length:
            raise ValueError(
                f"model_input_spans cover {covered} positions but model_input has "
                f"{self.model_input.length} tokens; the runs must tile it exactly"
            )
        target = self.loss_fn_inputs.get("target_tokens")
        if target is not None and len(target.resolved_shape()) == 1:  # as the SDK: 2-D targets are not checked
            n = target.resolved_shape()[0]
            covered = sum(s.length for s in self.loss_fn_input_spans or ())
            if covered != n:
                raise ValueError(
                    f"loss_fn_input_spans cover {covered} positions but target_tokens has {n}; "
                    "the runs must tile it exactly"
                )
        return self


class ForwardBackwardInputV2(ForwardBackwardInput):
    """``{"data": [DatumV2], "loss_fn", "loss_fn_config"?}``; config values are numbers or strings."""

    data: list[DatumV2]  # type: ignore[assignment]  # a pydantic field narrowed: validated as DatumV2


class ForwardBackwardRequestV2(StrictModel):
    """A decoded ``POST /api/v1/forward_backward`` (protobuf body of SDK ≥0.25, or the JSON form).

    ``forward_only=True`` is a forward pass (no gradients), what SDK ≤0.24 sent to ``/api/v1/forward``.
    """

    forward_backward_input: ForwardBackwardInputV2
    model_id: str = Field(min_length=1)
    seq_id: int = Field(ge=1, description="Per-model op order; 1, 2, ... after create_model (seq 0).")
    forward_only: bool = False
    type: Literal["forward_backward"] = "forward_backward"


class SaveWeightsExternalRequest(StrictModel):
    """``POST /api/v1/save_weights_external`` (SDK ≥0.3x): the weights as a Hugging Face/PEFT export under
    ``tinker://<model_id>/external_weights/<path>``."""

    model_id: str
    path: str
    seq_id: int | None = None
    ttl_seconds: int | None = None
    age_encryption_recipients: list[str] | None = None
    type: Literal["save_weights_external"] = "save_weights_external"


class SaveWeightsExternalResponse(LenientModel):
    """Future result of ``save_weights_external``: ``path`` and the export's size (bytes)."""

    path: str
    size_bytes: int | None = None
    type: Literal["save_weights_external"] | None = "save_weights_external"


# ================================================================================================ sampling
class SampleRequestV2(SampleRequest):
    """``POST /api/v1/asample`` body of SDK 0.38 (JSON).

    * ``topk_sample_logprobs``: k most likely tokens at every sampled position (0 = none).
    * ``target_prompt_logprobs``: int64 ``[len(prompt) - 1, K]`` token ids to score; row ``i`` is scored at
      prompt position ``i + 1``; ``-1`` (or an unlisted CSR cell) requests nothing.
    * ``prompt_alt_tokens_k``: k tokens drawn (with replacement, at the request temperature) at every prompt
      position after the first.
    * ``prompt_logprobs_last_n``: score only the last N prompt tokens (needs ``prompt_logprobs``; 1 ≤ N ≤
      ``len(prompt) - 1``).
    * ``record_stability_info``: keep per-sequence data for ``stable_reinforce`` training.
    """

    topk_sample_logprobs: int = Field(default=0, ge=0, le=20)
    target_prompt_logprobs: WireTensorData | None = None
    prompt_alt_tokens_k: int = Field(default=0, ge=0)
    prompt_logprobs_last_n: int | None = Field(default=None, ge=1)
    record_stability_info: bool | None = None

    @model_validator(mode="after")
    def _prompt_fields(self) -> SampleRequestV2:
        n = self.prompt.length
        if self.prompt_logprobs_last_n is not None:
            if not self.prompt_logprobs:
                raise ValueError("prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs")
            if self.prompt_logprobs_last_n > n - 1:
                raise ValueError(
                    f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = {n - 1}, "
                    f"got {self.prompt_logprobs_last_n}"
                )
        t = self.target_prompt_logprobs
        if t is not None:
            shape = t.resolved_shape()
            if t.dtype != "int64" or len(shape) != 2 or shape[0] != n - 1:
                raise ValueError(
                    f"target_prompt_logprobs must be int64 of shape [len(prompt) - 1, K] = "
                    f"[{n - 1}, K], got {t.dtype} {shape}"
                )
        return self


class SampledSequenceV2(SampledSequence):
    """A sample plus, when ``topk_sample_logprobs`` was asked, ``topk_logprobs[i]`` = top-k at token ``i``."""

    topk_logprobs: list[TopkRow] | None = None


class PromptAltTokens(LenientModel):
    """``tokens`` int64 and ``logprobs`` float32, both ``[len(prompt) - 1, k]``: draws at positions 1, 2, ..."""

    tokens: TensorData
    logprobs: TensorData


class SampleResponseV2(SampleResponse):
    """Result of ``asample`` for SDK 0.38.

    ``target_prompt_logprobs``: float32, the shape and layout (dense or CSR) of the request's ids, 0.0 where
    nothing was requested. ``prompt_cache_hit_tokens``: prompt tokens served from the prefix cache.
    """

    sequences: list[SampledSequenceV2]  # type: ignore[assignment]  # a pydantic field narrowed (as above)
    target_prompt_logprobs: WireTensorData | None = None
    prompt_alt_tokens: PromptAltTokens | None = None
    prompt_cache_hit_tokens: int = 0


class TokenizerFile(LenientModel):
    """One tokenizer file of ``GET /api/v1/tokenizer`` (livelora extension).

    Attributes:
        name: the file's base name (``tokenizer.json``; never a directory or a server path).
        encoding: ``utf-8`` (``content`` is the file's text) or ``base64`` (a binary file, e.g. a
            sentencepiece ``tokenizer.model``).
        content: the file's bytes in that encoding.
    """

    name: str
    encoding: Literal["utf-8", "base64"] = "utf-8"
    content: str


class TokenizerFilesResponse(LenientModel):
    """Answer of ``GET /api/v1/tokenizer`` (livelora extension): the served base model's tokenizer files.

    Attributes:
        tokenizer_id: the id ``get_server_capabilities``/``get_info`` report (a hub id or the served name).
        revision: sha1 (40 hex digits) of the files' names and bytes; also the response's ``ETag``, and the
            snapshot name ``livelora hf-cache`` gives them in the Hugging Face cache.
        files: the files (tokenizer, chat template, vocabulary, the model config; never weights).
        aliases: the base model's other names (its served name), under which ``livelora hf-cache`` places the
            files too, so a client loading the tokenizer by the name it gave as ``base_model`` finds it offline.
    """

    type: Literal["tokenizer"] | None = "tokenizer"
    tokenizer_id: str
    revision: str
    files: list[TokenizerFile]
    aliases: list[str] = Field(default_factory=list)
