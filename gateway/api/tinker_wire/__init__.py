"""The tinker SDK wire format (protobuf + zstd of SDK ≥0.25, JSON of older SDKs): codec for ``/api/v1``.

Facts below were read from the ``tinker`` 0.38.0 and 0.24.1 wheels; the schema is declared in
:mod:`.schema` (our own declaration, checked field by field against the SDK's by the tests).

Content types
=============

* Every request body is JSON (``Content-Type: application/json``) except ``POST /api/v1/forward_backward``
  of SDK ≥0.25, which is a protobuf ``ForwardBackwardRequest`` (``Content-Type: application/x-protobuf``),
  zstd-compressed (``Content-Encoding: zstd``, one zstd frame with its content size) only when the server's
  ``client/config`` answered ``proto_compress_fwdbwd: true``. SDK 0.20–0.24 sends that same protobuf only
  when ``client/config`` sets ``proto_write_fwdbwd: true`` (else the JSON body of ≤0.24), and then routes
  ``forward`` through it too when ``fwd_via_fwdbwd: true``. SDK 0.38 has no ``/forward`` route: a forward
  pass is ``forward_only: true``.
* Responses are JSON except two future results of ``POST /api/v1/retrieve_future``: ``SampleResponse`` and
  ``ForwardBackwardOutput``, protobuf with ``Content-Type: application/x-protobuf`` (the SDK checks for that
  substring). SDK ≥0.25 asks with ``Accept: application/x-protobuf`` and **rejects JSON** for these two;
  SDK 0.20–0.24 asks with ``Accept: application/x-protobuf, application/json`` and reads either. Failures,
  ``try_again`` and every other result stay JSON. Nothing in a response is compressed.

Messages (proto3; scalars little-endian inside ``bytes``)
=========================================================

``ForwardBackwardRequest``: 1 ``model_id`` string; 2 ``seq_id`` int32 (≥1; 0 means unset); 3 ``data``
repeated ``Datum``; 4 ``loss_fn`` string; 5 ``loss_fn_config`` map<string, double> (legacy, numbers only:
the SDK writes every numeric value here too); 6 ``forward_only`` bool; 7 ``loss_fn_config_v2``
map<string, ``LossConfigValue``> (SDK ≥0.26; strings only here; wins over 5 key by key).

``LossConfigValue``: oneof ``value`` { 1 ``number`` double; 2 ``text`` string }.

``Datum``: 1 ``model_input`` repeated ``Chunk``; 2 ``loss_fn_inputs`` map<string, ``Tensor``>;
3 ``model_input_spans`` / 4 ``loss_fn_input_spans`` repeated ``ProvenanceSpan`` (SDK ≥0.26; present only
with ``Datum.with_provenance``; runs tile ``model_input`` and ``target_tokens`` in order).

``ProvenanceSpan``: oneof ``span`` { 1 ``prompt_tokens`` / 2 ``sampled_tokens``: each { 1 ``sequence_id``
string; 2 ``offset`` int64; 3 ``length`` int64 } }.

``Chunk``: oneof ``chunk`` { 1 ``encoded_text`` { 1 ``tokens`` bytes = int32[] }; 2 ``image`` { 1 ``data``
bytes; 2 ``format`` string "png"|"jpeg"; 3 optional ``expected_tokens`` int32; 4 optional
``override_dimensions`` { 1 ``width``, 2 ``height`` uint32 } }; 3 ``dmel`` { 1 ``dmel`` bytes } }.

``Tensor``: oneof ``encoding`` { 1 ``dense`` bytes (row-major values); 2 ``sparse_csr`` { 1 ``values`` bytes
(listed values, tensor dtype); 2 ``crow_indices`` bytes = int64[rows+1]; 3 ``col_indices`` bytes =
int64[nnz] } }; 3 ``dtype`` ``DType``; 4 ``shape`` repeated int64 (empty = 1-D). The SDK writes float32 and
int64 only, and sparsifies 2-D ``target_tokens``/``weights`` (pad 0) when CSR is smaller; a sparse
``target_prompt_logprobs`` pads with -1.

``DType`` enum: 0 UNSPECIFIED, 1 FLOAT32, 2 INT64, 3 INT32 (read as int64), 4 BFLOAT16 (upper half of a
float32; read as float32).

``ForwardBackwardOutput``: 1 ``loss_fn_output_type`` string (the SDK keeps the text after the last ``:``);
2 ``loss_fn_outputs`` repeated ``ArrayRecord``; 3 ``metrics`` map<string, double> (keys ``name:reduction``).
``ArrayRecord``: 1 ``type_tag`` string; 2 ``fields`` map<string, ``BatchedTensor``>; 3 ``num_datums`` int64
(authoritative datum count, also when ``fields`` is empty). ``BatchedTensor``: 1 ``data`` bytes (all datums'
arrays back to back); 2 ``offsets`` bytes = int64[num_datums + 1] **byte** offsets into ``data``; 3 ``dtype``;
4 ``trailing_shape`` repeated int64 (dimensions after the first; each datum's first dimension is
size / prod(trailing)). Records concatenate in datum order and must carry the same field names.

``SampleResponse``: 1 ``sequences`` repeated ``SampledSequence``; 2 optional ``prompt_logprobs`` bytes =
float32[len(prompt)] with NaN where not computed (empty = not requested); 3 optional
``topk_prompt_logprobs`` ``TopkLogprobs``; 4 ``prompt_cache_hit_tokens`` int32; 5 optional
``target_prompt_logprobs`` ``Tensor`` (float32, the request's shape and layout); 6 optional
``prompt_alt_tokens`` { 1 ``tokens`` ``Tensor`` int64 [len(prompt)-1, k]; 2 ``logprobs`` ``Tensor`` float32 }.
``SampledSequence``: 1 ``stop_reason`` enum (0 stop, 1 length); 2 ``tokens`` bytes = int32[]; 3 optional
``logprobs`` bytes = float32[] (empty reads as None); 4 optional ``topk_sampled_logprobs`` ``TopkLogprobs``.
No ``sequence_id``: the SDK assigns the ``sample_sequence_ids`` of the ``asample`` answer, in order.
``TopkLogprobs``: 1 ``token_ids`` bytes = int32[length, k]; 2 ``logprobs`` bytes = float32[length, k];
3 ``k`` uint32; 4 ``length`` uint32 (0.25 named it ``prompt_length``); empty cells are (0, -99999.0), a row
starting with one is "not computed"; ``length`` or ``k`` 0 reads as None.

``SamplingParams`` / ``StopStrings`` / ``StopTokens`` are declared by the SDK but not sent by it (sampling
requests are JSON).

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
