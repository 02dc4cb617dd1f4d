"""Request side of the tinker wire: content types, ``Content-Encoding``, and the protobuf ``forward_backward``.

Every function here is pure (bytes and header values in, typed values out) so the routes stay thin and the
codec is tested without a server. Errors are :mod:`livelora.clients.errors` classes:

* :class:`WireDecodeError` (HTTP 400): the body cannot be understood. It carries the ``model_id`` and
  ``seq_id`` recovered from the body when its top-level framing was intact (:func:`peek_ids`), so the caller
  can resolve that op's future with the error and consume its ``seq_id`` instead of leaving the model's
  later ops waiting for it;
* ``BadRequestError`` with code ``unsupported_content_type`` / ``unsupported_content_encoding``;
* ``PayloadTooLargeError`` (HTTP 413) when the decompressed body exceeds the limit.
"""

from __future__ import annotations

import io
import zlib
from typing import Any, Literal

import numpy as np
import zstandard
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
    "peek_body_ids",
    "peek_ids",
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
            return zstandard.ZstdDecompressor().decompress(body)
        d = zstandard.ZstdDecompressor().decompressobj()
        parts, total = [], 0
        for i in range(0, len(body), 256):  # a 256-byte slice expands to at most ~11 MB
            parts.append(d.decompress(body[i : i + 256]))
            total += len(parts[-1])
            if total > max_bytes:
                raise too_large
        if not getattr(d, "eof", True):
            raise zstandard.ZstdError("the frame is truncated")
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
    return data


# ------------------------------------------------------------------------------------------------ ids
def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def peek_ids(raw: bytes) -> tuple[str | None, int | None]:
    """``(model_id, seq_id)`` read from the top-level fields 1 and 2 of a ``ForwardBackwardRequest`` body,
    scanning only as far as the framing is valid (a damaged datum later in the body does not hide them)."""
    model_id: str | None = None
    seq_id: int | None = None
    pos = 0
    try:
        while pos < len(raw) and (model_id is None or seq_id is None):
            key, pos = _varint(raw, pos)
            field, wire = key >> 3, key & 7
            if wire == 0:
                value, pos = _varint(raw, pos)
                if field == 2:
                    value &= 0xFFFFFFFF  # int32: negative values are 10-byte varints
                    seq_id = value - (1 << 32) if value >= 1 << 31 else value
            elif wire == 2:
                size, pos = _varint(raw, pos)
                if pos + size > len(raw):
                    break
                if field == 1:
                    model_id = raw[pos : pos + size].decode("utf-8")
                pos += size
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            else:
                break
    except (ValueError, UnicodeDecodeError):
        pass
    return model_id or None, seq_id or None


def peek_body_ids(
    body: bytes, content_encoding: str | None, *, head_bytes: int = 4096
) -> tuple[str | None, int | None]:
    """:func:`peek_ids` of a raw (possibly zstd/gzip-compressed) ``forward_backward`` body, decoding only its
    first ``head_bytes``: the SDK writes fields in number order, so ``model_id`` and ``seq_id`` open the
    message. For a body rejected as a whole (too large, corrupt after the head) this still names the op,
    so its ``seq_id`` can be consumed. ``(None, None)`` when even the head cannot be read."""
    try:
        head = decode_content(body, content_encoding, max_bytes=head_bytes)
    except (PayloadTooLargeError, WireDecodeError):  # too large, or damaged after the head
        head = _head(body, content_encoding, head_bytes)
    except BadRequestError:  # an encoding we do not know
        return None, None
    return peek_ids(head)


def _head(body: bytes, content_encoding: str | None, n: int) -> bytes:
    coding = (content_encoding or "identity").split(",")[-1].strip().lower()
    try:
        if coding == "zstd":
            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
                return reader.read(n)
        if coding in ("gzip", "x-gzip", "deflate"):
            return zlib.decompressobj(31 if coding != "deflate" else 15).decompress(body, n)
    except (zstandard.ZstdError, zlib.error):
        return b""
    return body[:n]


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
    msg = schema.ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except DecodeError as exc:
        model_id, seq_id = peek_ids(raw)
        raise WireDecodeError(
            f"forward_backward body is not a valid protobuf ForwardBackwardRequest: {exc}",
            model_id=model_id,
            seq_id=seq_id,
            param="body",
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
