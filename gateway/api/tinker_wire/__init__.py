"""The tinker SDK wire format (protobuf + zstd of SDK ≥0.25, JSON of older SDKs): codec for ``/api/v1``.

Which bodies are protobuf, when they are compressed, and every message's fields are in
``docs/internals/wire-types.md`` (read from the ``tinker`` 0.38.0 and 0.24.1 wheels).

Modules: :mod:`.schema` (descriptors), :mod:`.requests` (content negotiation, zstd, ``forward_backward``
decoding, id recovery), :mod:`.responses` (``SampleResponse`` / ``ForwardBackwardOutput`` encoding).
"""

from __future__ import annotations

from livelora.gateway.api.tinker_wire.requests import (
    DEFAULT_MAX_BODY_BYTES,
    PROTO_MEDIA_TYPES,
    WireDecodeError,
    body_kind,
    decode_content,
    decode_forward_backward,
    tensor_from_proto,
)
from livelora.gateway.api.tinker_wire.responses import (
    MASK_LOGPROB,
    PROTO_CONTENT_TYPE,
    encode_forward_backward_output,
    encode_future_result,
    encode_sample_response,
    proto_result_kind,
    tensor_to_proto,
    wants_proto,
)

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "MASK_LOGPROB",
    "PROTO_CONTENT_TYPE",
    "PROTO_MEDIA_TYPES",
    "WireDecodeError",
    "body_kind",
    "decode_content",
    "decode_forward_backward",
    "encode_forward_backward_output",
    "encode_future_result",
    "encode_sample_response",
    "proto_result_kind",
    "tensor_from_proto",
    "tensor_to_proto",
    "wants_proto",
]
