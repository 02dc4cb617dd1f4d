"""Request side of the tinker wire: content types, ``Content-Encoding``, and the protobuf ``forward_backward``.

Every function here is pure (bytes and header values in, typed values out) so the routes stay thin and the
codec is tested without a server. Errors are :mod:`livelora.clients.errors` classes:

* :class:`WireDecodeError` (HTTP 400): the body cannot be understood, or is not in strict form (an unknown
  field, a singular field or oneof twice, a repeated map key, bytes after the message or after the compressed
  stream: the parts a permissive reader would merge or drop, so that two readers could see two requests). It
  carries the ``model_id`` and ``seq_id`` the strict decoder read before the error, so the op can be named;
* ``BadRequestError`` with code ``unsupported_content_type`` / ``unsupported_content_encoding``;
* ``PayloadTooLargeError`` (HTTP 413) when the decompressed body exceeds the limit.
"""

from __future__ import annotations

import zlib
from typing import Any, Literal

import numpy as np
import zstandard
from google.protobuf import descriptor_pb2
from google.protobuf.message import DecodeError
from pydantic import ValidationError

from livelora.clients.errors import BadRequestError, PayloadTooLargeError
from livelora.clients.types.tinker_ext import ForwardBackwardRequestV2, WireTensorData
from livelora.gateway.api.tinker_wire import schema

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "PROTO_MEDIA_TYPES",
    "WireDecodeError",
    "body_kind",
    "decode_content",
    "decode_forward_backward",
    "tensor_from_proto",
]

#: Media types read as protobuf (the SDK sends the first).
PROTO_MEDIA_TYPES = frozenset({"application/x-protobuf", "application/protobuf", "application/vnd.google.protobuf"})
#: Largest request body after decompression (bytes). The SDK cuts forward_backward into chunks of at most
#: ``fwdbwd_max_chunk_bytes_count`` (5 MB by default, estimated before compression).
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024

#: proto DType → (numpy dtype of the bytes, public dtype after widening)
_DTYPES: dict[int, tuple[str, Literal["float32", "int64"]]] = {
    schema.DTYPE_FLOAT32: ("<f4", "float32"),
    schema.DTYPE_INT64: ("<i8", "int64"),
    schema.DTYPE_INT32: ("<i4", "int64"),
    schema.DTYPE_BFLOAT16: ("<u2", "float32"),
}


class WireDecodeError(BadRequestError):
    """A request body that cannot be decoded (HTTP 400, category ``user``).

    Attributes:
        model_id, seq_id: the op's ids when they could be read from the body, else None.
    """

    default_code = "invalid_body"

    def __init__(
        self,
        message: str,
        *,
        model_id: str | None = None,
        seq_id: int | None = None,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message, param=param, code=code)
        self.model_id = model_id
        self.seq_id = seq_id


# ------------------------------------------------------------------------------------------------ headers
def _media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def body_kind(content_type: str | None) -> Literal["proto", "json"]:
    """``"proto"`` or ``"json"`` for a ``Content-Type`` header value (absent = JSON, as old clients send).

    Raises:
        BadRequestError: any other media type (code ``unsupported_content_type``).
    """
    media = _media_type(content_type)
    if media in PROTO_MEDIA_TYPES:
        return "proto"
    if media in ("", "application/json") or (media.startswith("application/") and media.endswith("+json")):
        return "json"
    raise BadRequestError(
        f"unsupported Content-Type {content_type!r}: send 'content-type: application/json' or "
        "'content-type: application/x-protobuf'",
        code="unsupported_content_type",
    )


def decode_content(body: bytes, content_encoding: str | None, *, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> bytes:
    """Undo ``Content-Encoding`` (``zstd`` as the SDK sends with ``proto_compress_fwdbwd``; also ``gzip``,
    ``deflate``, ``identity``; a comma list is undone last-applied first).

    Args:
        body: the raw request body (bytes).
        max_bytes: limit on the decoded size (bytes); checked while decompressing, so a small compressed
            body cannot expand without bound.

    Raises:
        BadRequestError: an unknown encoding (code ``unsupported_content_encoding``).
        WireDecodeError: the body is not valid for its encoding.
        PayloadTooLargeError: the decoded body exceeds ``max_bytes``.
    """
    codings = [c.strip().lower() for c in (content_encoding or "").split(",") if c.strip()]
    for coding in reversed(codings):
        if coding == "identity":
            continue
        if coding == "zstd":
            body = _unzstd(body, max_bytes)
        elif coding in ("gzip", "x-gzip", "deflate"):
            wbits = 31 if coding != "deflate" else 15
            body = _inflate(body, wbits, max_bytes, coding)
        else:
            raise BadRequestError(
                f"unsupported Content-Encoding {coding!r}: send zstd, gzip or an uncompressed body",
                param="Content-Encoding",
                code="unsupported_content_encoding",
            )
    if len(body) > max_bytes:
        raise PayloadTooLargeError(f"request body is {len(body)} bytes; the limit is {max_bytes}", param="body")
    return body


def _unzstd(body: bytes, max_bytes: int) -> bytes:
    """Decompress zstd within ``max_bytes``. Frames that state their size (the SDK's do) are checked before
    any work; others are fed in small slices so the output check runs before much memory is used."""
    too_large = PayloadTooLargeError(f"decompressed request body exceeds {max_bytes} bytes", param="body")
    try:
        size = zstandard.frame_content_size(body)
        if size >= 0:
            if size > max_bytes:
                raise too_large
            return zstandard.ZstdDecompressor().decompress(body, allow_extra_data=False)
        d = zstandard.ZstdDecompressor().decompressobj()
        parts, total = [], 0
        for i in range(0, len(body), 256):  # a 256-byte slice expands to at most ~11 MB
            if d.eof:
                raise zstandard.ZstdError(f"{len(body) - i} bytes follow the frame")
            parts.append(d.decompress(body[i : i + 256]))
            total += len(parts[-1])
            if total > max_bytes:
                raise too_large
        if not d.eof:
            raise zstandard.ZstdError("the frame is truncated")
        if d.unused_data:
            raise zstandard.ZstdError(f"{len(d.unused_data)} bytes follow the frame")
        return b"".join(parts)
    except zstandard.ZstdError as exc:
        raise WireDecodeError(f"request body is not valid zstd: {exc}", param="body") from None


def _inflate(body: bytes, wbits: int, max_bytes: int, coding: str) -> bytes:
    d = zlib.decompressobj(wbits)
    try:
        data = d.decompress(body, max_bytes + 1)
    except zlib.error as exc:
        raise WireDecodeError(f"request body is not valid {coding}: {exc}", param="body") from None
    if len(data) > max_bytes:
        raise PayloadTooLargeError(f"decompressed request body exceeds {max_bytes} bytes", param="body")
    if not d.eof:
        raise WireDecodeError(f"request body is not valid {coding}: the stream is truncated", param="body")
    if d.unused_data or d.unconsumed_tail:
        raise WireDecodeError(f"request body is not valid {coding}: bytes follow the end of the stream", param="body")
    return data


# ------------------------------------------------------------------------------------------------ strict form
_F = descriptor_pb2.FieldDescriptorProto
_VARINT = {_F.TYPE_INT32, _F.TYPE_INT64, _F.TYPE_UINT32, _F.TYPE_UINT64, _F.TYPE_BOOL, _F.TYPE_ENUM}
_FIXED = {_F.TYPE_DOUBLE: 8, _F.TYPE_FLOAT: 4}
_LENGTH = {_F.TYPE_STRING, _F.TYPE_BYTES, _F.TYPE_MESSAGE}


class _NotStrict(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _NotStrict("a varint is truncated or longer than 10 bytes", "body")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _strict(buf: bytes, pos: int, end: int, desc: Any, where: str, ids: dict[str, Any] | None) -> bytes | None:
    """Check that ``buf[pos:end]`` is exactly one ``desc`` message in strict form: every field known, of its
    declared wire type, a singular field (or one member of a oneof) at most once, a map key at most once,
    every length inside the message and nothing after its last field. ``ids`` (top level only) collects
    ``model_id``/``seq_id`` as they are read, so an error can name the op. Returns a map entry's key bytes."""
    seen: set[int] = set()
    oneofs: dict[str, str] = {}
    map_keys: dict[int, set[bytes]] = {}
    key: bytes | None = None
    while pos < end:
        tag, pos = _varint(buf, pos, end)
        number, wire_type = tag >> 3, tag & 7
        field = desc.fields_by_number.get(number)
        if field is None:
            raise _NotStrict(f"{desc.name} has no field number {number} (an unknown field)", where or "body")
        name = f"{where}.{field.name}" if where else field.name
        repeated = field.is_repeated if hasattr(field, "is_repeated") else field.label == _F.LABEL_REPEATED
        if not repeated:
            _check_singular(field, desc, number in seen, oneofs, name)
        seen.add(number)
        packed = repeated and wire_type == 2 and field.type in _VARINT | set(_FIXED)
        if field.type in _LENGTH or packed:
            if wire_type != 2:
                raise _NotStrict(f"field {field.name} of {desc.name} has wire type {wire_type}, not 2", name)
            value, pos = _length_delimited(buf, pos, end, field, desc, name, packed, map_keys.setdefault(number, set()))
        elif field.type in _VARINT:
            if wire_type != 0:
                raise _NotStrict(f"field {field.name} of {desc.name} has wire type {wire_type}, not 0", name)
            number_value, pos = _varint(buf, pos, end)
            value = number_value.to_bytes(10, "little")
            if ids is not None and field.name == "seq_id":
                v = number_value & 0xFFFFFFFF
                ids["seq_id"] = v - (1 << 32) if v >= 1 << 31 else v
        else:
            width = _FIXED[field.type]
            if wire_type != (1 if width == 8 else 5):
                raise _NotStrict(f"field {field.name} of {desc.name} has wire type {wire_type}", name)
            if pos + width > end:
                raise _NotStrict(f"field {field.name} of {desc.name} is truncated", name)
            value, pos = buf[pos : pos + width], pos + width
        if ids is not None and field.name == "model_id":
            ids["model_id"] = value.decode("utf-8", "replace")
        if number == 1 and desc.GetOptions().map_entry:
            key = value
    return key


def _check_singular(field: Any, desc: Any, seen_before: bool, oneofs: dict[str, str], name: str) -> None:
    """Raises _NotStrict when a singular ``field`` of ``desc`` appears again (``seen_before``) or is a second member
    of a oneof (``oneofs``: oneof name → the member set first, updated here)."""
    if seen_before:
        raise _NotStrict(f"field {field.name} ({field.number}) of {desc.name} appears more than once", name)
    oneof = field.containing_oneof
    if oneof is not None and oneofs.setdefault(oneof.name, field.name) != field.name:
        raise _NotStrict(f"{desc.name} sets both {oneofs[oneof.name]} and {field.name} of one oneof", name)


def _length_delimited(
    buf: bytes, pos: int, end: int, field: Any, desc: Any, name: str, packed: bool, map_keys: set[bytes]
) -> tuple[bytes, int]:
    """``(value bytes, position after them)`` of a length-delimited ``field`` whose length varint starts at
    ``pos``: a nested message checked with :func:`_strict` (a map entry's key recorded in ``map_keys``, the keys
    seen for this map field), a packed array checked whole. Raises _NotStrict (truncated, a repeated map key)."""
    size, pos = _varint(buf, pos, end)
    if pos + size > end:
        raise _NotStrict(f"field {field.name} of {desc.name} is truncated", name)
    if field.type == _F.TYPE_MESSAGE:
        k = _strict(buf, pos, pos + size, field.message_type, name, None) or b""
        if field.message_type.GetOptions().map_entry:
            if k in map_keys:
                raise _NotStrict(f"map {field.name} of {desc.name} repeats the key {k!r}", name)
            map_keys.add(k)
    elif packed and field.type in _FIXED and size % _FIXED[field.type]:
        raise _NotStrict(f"packed field {field.name} of {desc.name} is truncated", name)
    elif packed and field.type in _VARINT:
        p = pos
        while p < pos + size:
            _, p = _varint(buf, p, pos + size)
    return buf[pos : pos + size], pos + size


# ------------------------------------------------------------------------------------------------ tensors
def _array(data: bytes, np_dtype: str, what: str) -> np.ndarray:
    itemsize = np.dtype(np_dtype).itemsize
    if len(data) % itemsize:
        raise ValueError(f"{what} holds {len(data)} bytes, not a multiple of {itemsize} ({np_dtype})")
    return np.frombuffer(data, dtype=np_dtype)


def _values(data: bytes, dtype: int, what: str) -> tuple[list, Literal["float32", "int64"]]:
    if dtype not in _DTYPES:
        raise ValueError(f"{what} has unsupported dtype {dtype} (expected float32 or int64)")
    np_dtype, public = _DTYPES[dtype]
    arr = _array(data, np_dtype, what)
    if dtype == schema.DTYPE_BFLOAT16:
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.tolist(), public


def tensor_from_proto(msg: Any, what: str) -> WireTensorData:
    """A protobuf ``Tensor`` as :class:`WireTensorData` (dense, or CSR kept sparse).

    Widening as the SDK's own reader: int32 → int64, bfloat16 → float32. An empty ``shape`` means 1-D.

    Raises:
        ValueError: bad dtype, byte counts or shape (message names ``what``).
    """
    encoding = msg.WhichOneof("encoding")
    shape = [int(d) for d in msg.shape]
    try:
        if encoding == "sparse_csr":
            values, public = _values(msg.sparse_csr.values, msg.dtype, what)
            crow = _array(msg.sparse_csr.crow_indices, "<i8", f"{what} crow_indices").tolist()
            col = _array(msg.sparse_csr.col_indices, "<i8", f"{what} col_indices").tolist()
            return WireTensorData(
                data=values, dtype=public, shape=shape, sparse_crow_indices=crow, sparse_col_indices=col
            )
        values, public = _values(msg.dense if encoding == "dense" else b"", msg.dtype, what)
        return WireTensorData(data=values, dtype=public, shape=shape or [len(values)])
    except ValidationError as exc:
        raise ValueError(f"{what}: {_first_error(exc)}") from None


# ------------------------------------------------------------------------------------------------ forward_backward
def decode_forward_backward(raw: bytes) -> ForwardBackwardRequestV2:
    """Decode a protobuf ``ForwardBackwardRequest`` body (already decompressed: :func:`decode_content`).

    ``loss_fn_config``: the ``loss_fn_config_v2`` map (numbers and strings, SDK ≥0.26) wins over the legacy
    float-only ``loss_fn_config`` map, key by key. Sparse CSR loss inputs are densified with 0 (the SDK's
    pad for ``target_tokens`` and ``weights``). Empty span lists mean "no provenance".

    Raises:
        WireDecodeError: not a valid message, an image/audio chunk (code ``unsupported_parameter``), a bad
            tensor, or a value the request model rejects (unknown loss, seq_id < 1, bad provenance tiling).
    """
    found: dict[str, Any] = {}
    msg = schema.ForwardBackwardRequest()
    try:
        _strict(raw, 0, len(raw), msg.DESCRIPTOR, "", found)
        msg.ParseFromString(raw)
    except (_NotStrict, DecodeError) as exc:
        model_id, seq_id = found.get("model_id") or None, found.get("seq_id") or None
        raise WireDecodeError(
            f"forward_backward body is not a valid protobuf ForwardBackwardRequest: {exc}",
            model_id=model_id,
            seq_id=seq_id,
            param=getattr(exc, "param", "body") if model_id else "model_id",
        ) from None
    ids = {"model_id": msg.model_id or None, "seq_id": msg.seq_id or None}
    try:
        data = [_datum(d, i) for i, d in enumerate(msg.data)]
        body = {
            "model_id": msg.model_id,
            "seq_id": msg.seq_id,
            "forward_only": msg.forward_only,
            "forward_backward_input": {
                "data": data,
                "loss_fn": msg.loss_fn,
                "loss_fn_config": _loss_config(msg) or None,
            },
        }
    except _Unsupported as exc:
        raise WireDecodeError(str(exc), param=exc.param, code="unsupported_parameter", **ids) from None
    except ValueError as exc:
        raise WireDecodeError(f"invalid forward_backward body: {exc}", param="data", **ids) from None
    try:
        return ForwardBackwardRequestV2.model_validate(body)
    except ValidationError as exc:
        param = _loc(tuple(exc.errors()[0].get("loc", ()))) or None
        raise WireDecodeError(f"invalid forward_backward request: {_first_error(exc)}", param=param, **ids) from None


class _Unsupported(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _loss_config(msg: Any) -> dict[str, float | str]:
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        which = value.WhichOneof("value")
        if which is None:
            raise ValueError(f"loss_fn_config[{key!r}] has neither a number nor a text value")
        config[key] = float(value.number) if which == "number" else str(value.text)
    return config


def _datum(d: Any, i: int) -> dict[str, Any]:
    chunks = []
    for j, chunk in enumerate(d.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind == "encoded_text":
            tokens = _array(chunk.encoded_text.tokens, "<i4", f"data[{i}].model_input[{j}]").tolist()
            chunks.append({"tokens": tokens, "type": "encoded_text"})
        elif kind in ("image", "dmel"):
            what = "image" if kind == "image" else "audio (dmel)"
            raise _Unsupported(
                f"data[{i}].model_input[{j}] is an {what} chunk; the served model reads text "
                "tokens only (encoded_text chunks)",
                param=f"data[{i}].model_input",
            )
        else:
            raise ValueError(f"data[{i}].model_input[{j}] is an empty chunk")
    inputs = {}
    for name, tensor in d.loss_fn_inputs.items():
        wire = tensor_from_proto(tensor, f"data[{i}].loss_fn_inputs[{name!r}]")
        inputs[name] = wire.dense(0).model_dump()
    out: dict[str, Any] = {"model_input": {"chunks": chunks}, "loss_fn_inputs": inputs}
    for field in ("model_input_spans", "loss_fn_input_spans"):  # an empty list is "not set" on the wire
        spans = getattr(d, field)
        if len(spans):
            out[field] = [_span(s, f"data[{i}].{field}") for s in spans]
    return out


def _span(span: Any, what: str) -> dict[str, Any]:
    which = span.WhichOneof("span")
    if which is None:
        raise ValueError(f"{what} has a span that is neither prompt_tokens nor sampled_tokens")
    s = getattr(span, which)
    return {
        "kind": "prompt" if which == "prompt_tokens" else "sampled",
        "sequence_id": s.sequence_id,
        "offset": int(s.offset),
        "length": int(s.length),
    }


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out.removeprefix("forward_backward_input.")


def _first_error(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors()[:3]:
        loc = _loc(tuple(e.get("loc", ())))
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts)
