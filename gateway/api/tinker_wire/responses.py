"""Response side of the tinker wire: protobuf ``SampleResponse`` and ``ForwardBackwardOutput``.

SDK ≥0.25 accepts these two future results **only** as protobuf (a JSON body is a hard error) and asks for
them with ``Accept: application/x-protobuf`` on ``retrieve_future``; SDK 0.20–0.24 sends
``Accept: application/x-protobuf, application/json`` and reads either; older SDKs send ``application/json``
only. Every other result stays JSON. The SDK picks its decoder by ``"application/x-protobuf" in
Content-Type``; responses are not compressed.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np

from livelora.clients.types.tinker import ForwardBackwardOutput, SampleResponse, TensorData
from livelora.clients.types.tinker_ext import SampleResponseV2, TopkRow, WireTensorData
from livelora.gateway.api.tinker_wire import schema

__all__ = [
    "MASK_LOGPROB",
    "PROTO_CONTENT_TYPE",
    "encode_forward_backward_output",
    "encode_future_result",
    "encode_sample_response",
    "proto_result_kind",
    "tensor_to_proto",
    "wants_proto",
]

PROTO_CONTENT_TYPE = "application/x-protobuf"
#: Logprob of an empty top-k cell (token id 0); the SDK drops trailing empty cells and reads a row whose
#: first cell is empty as "not computed" (None).
MASK_LOGPROB = -99999.0

_NP = {"float32": ("<f4", schema.DTYPE_FLOAT32), "int64": ("<i8", schema.DTYPE_INT64)}


def wants_proto(accept: str | None) -> bool:
    """Whether an ``Accept`` header value admits ``application/x-protobuf`` (with a q-value above 0)."""
    for item in (accept or "").split(","):
        media, *params = [p.strip() for p in item.split(";")]
        if media.lower() != PROTO_CONTENT_TYPE:
            continue
        q = 1.0
        for p in params:
            name, _, value = p.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if q > 0:
            return True
    return False


def proto_result_kind(result: dict[str, Any]) -> Literal["sample", "forward_backward"] | None:
    """Which protobuf message a future result (its JSON dict) travels as, or None for a JSON-only result."""
    if "error" in result:
        return None
    if "sequences" in result:
        return "sample"
    if "loss_fn_outputs" in result:
        return "forward_backward"
    return None


def encode_future_result(result: dict[str, Any]) -> bytes | None:
    """The protobuf body of a ``SampleResponse``/``ForwardBackwardOutput`` result dict, else None (JSON)."""
    kind = proto_result_kind(result)
    if kind == "sample":
        return encode_sample_response(SampleResponseV2.model_validate(result))
    if kind == "forward_backward":
        return encode_forward_backward_output(ForwardBackwardOutput.model_validate(result))
    return None


# ------------------------------------------------------------------------------------------------ tensors
def tensor_to_proto(t: TensorData | WireTensorData, msg: Any = None) -> Any:
    """A tensor as a protobuf ``Tensor`` (``shape`` always written; CSR kept sparse). Fills ``msg`` if given."""
    msg = schema.Tensor() if msg is None else msg
    np_dtype, proto_dtype = _NP[t.dtype]
    msg.dtype = proto_dtype
    msg.shape.extend(t.resolved_shape())
    if isinstance(t, WireTensorData) and t.is_sparse:
        msg.sparse_csr.values = np.asarray(t.data, dtype=np_dtype).tobytes()
        msg.sparse_csr.crow_indices = np.asarray(t.sparse_crow_indices, dtype="<i8").tobytes()
        msg.sparse_csr.col_indices = np.asarray(t.sparse_col_indices, dtype="<i8").tobytes()
    else:
        msg.dense = np.asarray(t.data, dtype=np_dtype).tobytes()
    return msg


# ------------------------------------------------------------------------------------------------ forward_backward
def encode_forward_backward_output(out: ForwardBackwardOutput) -> bytes:
    """``ForwardBackwardOutput`` → protobuf bytes.

    Layout: consecutive datums whose outputs share dtypes and trailing shapes go into one ``ArrayRecord``
    (``num_datums`` = their count); per field, one ``BatchedTensor`` holds their arrays back to back with
    ``offsets`` = ``count + 1`` int64 **byte** offsets and ``trailing_shape`` = every dimension after the
    first (``[]`` for per-token ``[N]`` outputs, ``[K]`` for ``[N, K]``). One record for the usual case.

    Raises:
        ValueError: datums with different output field names (the SDK lines fields up by datum index).
    """
    msg = schema.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type)
    for key, value in out.metrics.items():
        msg.metrics[key] = float(value)
    outputs = out.loss_fn_outputs
    if outputs:
        names = set(outputs[0])
        for i, o in enumerate(outputs):
            if set(o) != names:
                raise ValueError(f"loss_fn_outputs[{i}] has fields {sorted(o)}, datum 0 has {sorted(names)}")
    start = 0
    while start < len(outputs):
        sig = _signature(outputs[start])
        end = start + 1
        while end < len(outputs) and _signature(outputs[end]) == sig:
            end += 1
        _record(msg.loss_fn_outputs.add(num_datums=end - start), outputs[start:end], sig)
        start = end
    return msg.SerializeToString()


def _signature(datum: dict[str, TensorData]) -> tuple:
    return tuple(sorted((name, t.dtype, tuple(t.resolved_shape()[1:])) for name, t in datum.items()))


def _record(record: Any, datums: list[dict[str, TensorData]], sig: tuple) -> None:
    for name, dtype, trailing in sig:
        np_dtype, proto_dtype = _NP[dtype]
        arrays = [np.asarray(d[name].data, dtype=np_dtype) for d in datums]
        offsets = np.zeros(len(arrays) + 1, dtype="<i8")
        offsets[1:] = np.cumsum([a.nbytes for a in arrays])
        bt = record.fields[name]
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = offsets.tobytes()
        bt.dtype = proto_dtype
        bt.trailing_shape.extend(trailing)


# ------------------------------------------------------------------------------------------------ sample
def encode_sample_response(
    resp: SampleResponse | SampleResponseV2, *, topk_prompt_k: int | None = None, topk_sample_k: int | None = None
) -> bytes:
    """``SampleResponse`` → protobuf bytes.

    * ``tokens`` int32 LE, ``logprobs`` float32 LE (omitted when None), ``stop_reason`` enum (stop 0,
      length 1). ``sequence_id`` is not on the wire: the SDK takes it from ``sample_sequence_ids`` of the
      ``asample`` answer, in order.
    * ``prompt_logprobs``: float32 LE, one per prompt token, NaN where None (position 0, and before
      ``prompt_logprobs_last_n``).
    * Top-k (prompt and per sample): ``[length, k]`` int32 ids and float32 logprobs, rows padded with
      ``(0, MASK_LOGPROB)``; a None row is all padding. ``k`` defaults to the longest row (pass the
      requested k to keep it exact when every row is shorter).
    * ``target_prompt_logprobs`` (dense or CSR as requested), ``prompt_alt_tokens``, ``prompt_cache_hit_tokens``.

    Raises:
        ValueError: a token id outside int32, or a top-k row longer than ``k``.
    """
    msg = schema.SampleResponse(prompt_cache_hit_tokens=int(getattr(resp, "prompt_cache_hit_tokens", 0) or 0))
    for seq in resp.sequences:
        s = msg.sequences.add(stop_reason=schema.STOP_REASON[seq.stop_reason], tokens=_int32_bytes(seq.tokens))
        if seq.logprobs is not None:
            s.logprobs = np.asarray(seq.logprobs, dtype="<f4").tobytes()
        topk = getattr(seq, "topk_logprobs", None)
        if topk is not None:
            _topk(topk, topk_sample_k, s.topk_sampled_logprobs)
    if resp.prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(
            [math.nan if v is None else v for v in resp.prompt_logprobs], dtype="<f4"
        ).tobytes()
    if resp.topk_prompt_logprobs is not None:
        _topk(resp.topk_prompt_logprobs, topk_prompt_k, msg.topk_prompt_logprobs)
    target = getattr(resp, "target_prompt_logprobs", None)
    if target is not None:
        tensor_to_proto(target, msg.target_prompt_logprobs)
    alt = getattr(resp, "prompt_alt_tokens", None)
    if alt is not None:
        tensor_to_proto(alt.tokens, msg.prompt_alt_tokens.tokens)
        tensor_to_proto(alt.logprobs, msg.prompt_alt_tokens.logprobs)
    return msg.SerializeToString()


def _int32_bytes(tokens: list[int]) -> bytes:
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < -(1 << 31) or arr.max() >= 1 << 31):
        raise ValueError("a token id does not fit in int32")
    return arr.astype("<i4").tobytes()


def _topk(rows: list[TopkRow], k: int | None, msg: Any) -> None:
    if k is None:
        k = max((len(r) for r in rows if r), default=0)
    ids = np.zeros((len(rows), k), dtype="<i4")
    lps = np.full((len(rows), k), MASK_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        if not row:
            continue
        if len(row) > k:
            raise ValueError(f"top-k row {i} has {len(row)} entries, more than k={k}")
        for j, (token, logprob) in enumerate(row):
            ids[i, j] = token
            lps[i, j] = logprob
    msg.token_ids = ids.tobytes()
    msg.logprobs = lps.tobytes()
    msg.k = k
    msg.length = len(rows)
