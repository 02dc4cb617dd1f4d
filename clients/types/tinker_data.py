"""Tinker wire types of a training example: the request/response bases, token chunks, tensors and :class:`Datum`."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from livelora.clients.types.nulls import NullMeansOmitted

#: Longest string any field of a request model may hold (characters): ids, names, paths, tokens.
MAX_TEXT_CHARS = 4096
#: Largest ``user_metadata`` (its JSON, UTF-8 bytes) and most of its pairs; the server keeps it in Redis.
MAX_METADATA_BYTES = 16 * 1024
MAX_METADATA_PAIRS = 64
#: Most tags of a session.
MAX_TAGS = 64


def _metadata_bound(value: dict[str, str] | None) -> dict[str, str] | None:
    if value is None:
        return value
    if len(value) > MAX_METADATA_PAIRS:
        raise ValueError(f"at most {MAX_METADATA_PAIRS} pairs allowed, got {len(value)}")
    size = len(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"at most {MAX_METADATA_BYTES} bytes of JSON allowed, got {size}")
    return value


#: ``user_metadata`` of a request: at most :data:`MAX_METADATA_PAIRS` pairs and :data:`MAX_METADATA_BYTES` of JSON.
UserMetadata = Annotated[dict[str, str], AfterValidator(_metadata_bound)]


class StrictModel(NullMeansOmitted):
    """Base of request models: unknown fields are an error; ``null`` for an optional field means "not given"
    (:mod:`.nulls`); no string longer than :data:`MAX_TEXT_CHARS`."""

    model_config = ConfigDict(extra="forbid", frozen=True, str_max_length=MAX_TEXT_CHARS)


class LenientModel(BaseModel):
    """Base of response models: unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class EncodedTextChunk(StrictModel):
    """A run of token ids (``{"type": "encoded_text", "tokens": [...]}``)."""

    tokens: list[int] = Field(description="Token ids of the base model's tokenizer.")
    type: Literal["encoded_text"] = "encoded_text"


class ModelInput(StrictModel):
    """The tokens fed to the model: a list of chunks (only ``encoded_text`` chunks are supported)."""

    chunks: list[EncodedTextChunk] = Field(default_factory=list)

    @classmethod
    def from_ints(cls, tokens: list[int]) -> ModelInput:
        """One ``encoded_text`` chunk holding ``tokens``."""
        return cls(chunks=[EncodedTextChunk(tokens=list(tokens))])

    def to_ints(self) -> list[int]:
        """All token ids, chunks concatenated."""
        return [t for c in self.chunks for t in c.tokens]

    @property
    def length(self) -> int:
        """Number of tokens (``N``)."""
        return sum(len(c.tokens) for c in self.chunks)


class TensorData(StrictModel):
    """A dense tensor on the wire: ``{"data": [flat values], "dtype": "int64"|"float32", "shape": [dims]}``.

    ``shape`` may be omitted for a 1-D tensor (then it is ``[len(data)]``). Sparse CSR forms are not supported.
    """

    data: list[float] | list[int] = Field(description="Values in row-major order.")
    dtype: Literal["int64", "float32"]
    shape: list[int] | None = Field(default=None, description="Dimensions; None means 1-D.")

    @classmethod
    def from_list(cls, values: list[float] | list[int], dtype: Literal["int64", "float32"]) -> TensorData:
        """A 1-D tensor of ``values``."""
        return cls(data=list(values), dtype=dtype, shape=[len(values)])

    @classmethod
    def from_torch(cls, t: Any) -> TensorData:
        """From a torch tensor (int tensors become int64, floating ones float32)."""
        import torch

        dtype: Literal["int64", "float32"] = "int64" if not torch.is_floating_point(t) else "float32"
        flat = t.detach().cpu().reshape(-1)
        return cls(data=flat.tolist(), dtype=dtype, shape=list(t.shape))

    def to_torch(self) -> Any:
        """As a torch tensor of the declared dtype and shape (raises ValueError if sizes disagree)."""
        import torch

        t = torch.tensor(self.data, dtype=torch.int64 if self.dtype == "int64" else torch.float32)
        return t.reshape(self.resolved_shape())

    def resolved_shape(self) -> list[int]:
        """``shape``, or ``[len(data)]`` when omitted."""
        return list(self.shape) if self.shape is not None else [len(self.data)]

    def tolist(self) -> list[Any]:
        """The flat values."""
        return list(self.data)


class Datum(StrictModel):
    """One training example: the model input and the per-token tensors the loss reads.

    ``loss_fn_inputs`` keys by loss: ``cross_entropy``: ``target_tokens`` (int64 [N]), ``weights`` (float32 [N]);
    ``importance_sampling``/``ppo``/``cispo``/``dro``: ``target_tokens``, ``logprobs``, ``advantages``
    (optional ``mask``); ``kto``: ``target_tokens``, ``weights`` (completion mask), ``label`` (float32 [1]);
    ``dpo``: ``target_tokens``, ``weights``, datums in (chosen, rejected) pairs. The server's loss
    specifications (``livelora.core.losses``) are the authority and name any missing or extra key.
    """

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = Field(default_factory=dict)
