"""The tinker wire codec on its own (no SDK needed): protobuf forward_backward bodies, zstd/gzip, content
negotiation, id recovery from damaged bodies, and the protobuf SampleResponse / ForwardBackwardOutput.

Bodies are built with our schema's message classes; the same values are checked against the official SDK's
encoders and decoders in ``test_tinker_wire_sdk.py``.
"""

from __future__ import annotations

import gzip
import math

import numpy as np
import pytest
import zstandard

from livelora.clients.errors import BadRequestError, PayloadTooLargeError
from livelora.clients.types.tinker import ForwardBackwardOutput, TensorData
from livelora.clients.types.tinker_ext import PromptAltTokens, SampledSequenceV2, SampleResponseV2, WireTensorData
from livelora.gateway.api import tinker_wire as wire
from livelora.gateway.api.tinker_wire import schema


def _fb(model_id="s1:train:0", seq_id=3, loss_fn="ppo", **kw):
    msg = schema.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=loss_fn, **kw)
    return msg


def _text(datum, tokens):
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype="<i4").tobytes()


def _sampled_span(spans, length, sequence_id="seq-0"):
    span = spans.add().sampled_tokens
    span.sequence_id, span.length = sequence_id, length


def _dense(datum, name, values, dtype, shape=None):
    t = datum.loss_fn_inputs[name]
    np_dtype = {"float32": "<f4", "int64": "<i8", "int32": "<i4"}[dtype]
    t.dtype = {"float32": 1, "int64": 2, "int32": 3}[dtype]
    arr = np.asarray(values, dtype=np_dtype)
    t.shape.extend(shape if shape is not None else list(arr.shape))
    t.dense = arr.tobytes()


def test_decode_forward_backward_full_message():
    msg = _fb(forward_only=True)
    d = msg.data.add()
    _text(d, [5, 6])
    _text(d, [7])
    _dense(d, "target_tokens", [6, 7, 8], "int64")
    _dense(d, "logprobs", [-0.5, -1.25, -2.0], "float32")
    _dense(d, "advantages", [0.0, 1.0, 1.0], "float32")
    msg.loss_fn_config["clip_low_threshold"] = 0.8
    msg.loss_fn_config["clip_high_threshold"] = 1.2
    msg.loss_fn_config_v2["clip_high_threshold"].number = 1.5  # v2 wins key by key
    msg.loss_fn_config_v2["mode"].text = "token"
    for field, kind in (("model_input_spans", "prompt_tokens"), ("loss_fn_input_spans", "sampled_tokens")):
        span = getattr(d, field).add()
        getattr(span, kind).sequence_id = "seq-1"
        getattr(span, kind).offset = 2
        getattr(span, kind).length = 3
    req = wire.decode_forward_backward(msg.SerializeToString())
    assert (req.model_id, req.seq_id, req.forward_only) == ("s1:train:0", 3, True)
    fb = req.forward_backward_input
    assert fb.loss_fn == "ppo"
    assert fb.loss_fn_config == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.5, "mode": "token"}
    datum = fb.data[0]
    assert datum.model_input.to_ints() == [5, 6, 7] and len(datum.model_input.chunks) == 2
    assert datum.loss_fn_inputs["target_tokens"] == TensorData(data=[6, 7, 8], dtype="int64", shape=[3])
    assert datum.loss_fn_inputs["logprobs"].data == [-0.5, -1.25, -2.0]
    assert [(s.kind, s.sequence_id, s.offset, s.length) for s in datum.model_input_spans] == [("prompt", "seq-1", 2, 3)]
    assert datum.loss_fn_input_spans[0].kind == "sampled"


def test_sparse_and_narrow_tensors_are_densified_and_widened():
    msg = _fb(loss_fn="cross_entropy")
    d = msg.data.add()
    _text(d, [1, 2])
    t = d.loss_fn_inputs["target_tokens"]  # [[0, 9], [4, 0]] as CSR (pad 0)
    t.dtype, t.sparse_csr.values = 2, np.asarray([9, 4], "<i8").tobytes()
    t.shape.extend([2, 2])
    t.sparse_csr.crow_indices = np.asarray([0, 1, 2], "<i8").tobytes()
    t.sparse_csr.col_indices = np.asarray([1, 0], "<i8").tobytes()
    _dense(d, "weights", [[0.0, 1.0], [0.5, 0.0]], "float32")
    _dense(d, "extra_int32", [3, 4], "int32")
    bf16 = d.loss_fn_inputs["extra_bf16"]  # bfloat16 = the upper half of a float32
    bf16.dtype = 4
    bf16.shape.append(2)
    bf16.dense = (np.asarray([1.5, -2.0], "<f4").view("<u4") >> 16).astype("<u2").tobytes()
    datum = wire.decode_forward_backward(msg.SerializeToString()).forward_backward_input.data[0]
    assert datum.loss_fn_inputs["target_tokens"] == TensorData(data=[0, 9, 4, 0], dtype="int64", shape=[2, 2])
    assert datum.loss_fn_inputs["weights"].shape == [2, 2]
    assert datum.loss_fn_inputs["extra_int32"] == TensorData(data=[3, 4], dtype="int64", shape=[2])
    assert datum.loss_fn_inputs["extra_bf16"].data == [1.5, -2.0]


def test_undecodable_body_fails_with_no_ids():
    with pytest.raises(wire.WireDecodeError) as err:
        wire.decode_forward_backward(b"\xff\xff\xff\xff not protobuf")
    assert (err.value.model_id, err.value.seq_id, err.value.status) == (None, None, 400)


def test_damaged_body_still_names_its_op():
    msg = _fb(seq_id=7)
    d = msg.data.add()
    _text(d, list(range(100)))
    raw = msg.SerializeToString()[:-40]  # cut inside the datum
    with pytest.raises(wire.WireDecodeError) as err:
        wire.decode_forward_backward(raw)
    assert (err.value.model_id, err.value.seq_id) == ("s1:train:0", 7)  # read by the strict decoder before the cut


@pytest.mark.parametrize(
    "mutate, code, needle",
    [
        (lambda d: setattr(d.model_input.add().image, "format", "png"), "unsupported_parameter", "image chunk"),
        (lambda d: d.model_input.add().dmel.SetInParent(), "unsupported_parameter", "audio"),
        (lambda d: d.model_input.add(), "invalid_body", "empty chunk"),
        (lambda d: setattr(d.loss_fn_inputs["weights"], "dense", b"\x00" * 5), "invalid_body", "multiple of 4"),
        (lambda d: d.loss_fn_inputs["weights"].shape.extend([7]), "invalid_body", "needs 7 values"),
        (lambda d: setattr(d.loss_fn_inputs["weights"], "dtype", 0), "invalid_body", "unsupported dtype"),
        (lambda d: _sampled_span(d.model_input_spans, 2), "invalid_body", "pair"),
        (lambda d: d.model_input_spans.add().sampled_tokens.SetInParent(), "invalid_body", "at least 1 character"),
    ],
)
def test_bad_datums_fail_with_the_ops_ids(mutate, code, needle):
    msg = _fb(seq_id=4)
    d = msg.data.add()
    _text(d, [1, 2])
    _dense(d, "target_tokens", [2, 3], "int64")
    d.loss_fn_inputs["weights"].dtype = 1
    d.loss_fn_inputs["weights"].dense = np.asarray([1.0, 1.0], "<f4").tobytes()
    mutate(d)
    with pytest.raises(wire.WireDecodeError) as err:
        wire.decode_forward_backward(msg.SerializeToString())
    assert (err.value.model_id, err.value.seq_id, err.value.code) == ("s1:train:0", 4, code)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"seq_id": 0}, "seq_id"),
        ({"model_id": ""}, "model_id"),
    ],
)
def test_request_fields_are_validated(fields, needle):
    msg = _fb(**fields)
    with pytest.raises(wire.WireDecodeError, match=needle):
        wire.decode_forward_backward(msg.SerializeToString())


def test_an_unknown_loss_decodes_and_the_shared_loss_specs_refuse_it_naming_loss_fn():
    """The wire type leaves ``loss_fn`` a string; the server's one validation (the gateway calls it on every
    decoded forward_backward) answers 400 naming ``loss_fn``."""
    from livelora.core.losses import validate_batch

    msg = _fb(loss_fn="not_a_loss")
    d = msg.data.add()
    _text(d, [1, 2, 3])
    _dense(d, "target_tokens", [2, 3, 4], "int64")
    req = wire.decode_forward_backward(msg.SerializeToString())
    fb = req.forward_backward_input
    assert fb.loss_fn == "not_a_loss"
    with pytest.raises(BadRequestError, match="unknown loss_fn 'not_a_loss'") as err:
        validate_batch(fb.data, fb.loss_fn, fb.loss_fn_config, vocab_size=100, max_seq_len=16)
    assert (err.value.param, err.value.status) == ("loss_fn", 400)


def test_provenance_must_tile_the_datum():
    msg = _fb(loss_fn="stable_reinforce")
    d = msg.data.add()
    _text(d, [1, 2, 3])
    _dense(d, "target_tokens", [2, 3, 4], "int64")
    _sampled_span(d.model_input_spans, 2)
    _sampled_span(d.loss_fn_input_spans, 3)
    with pytest.raises(wire.WireDecodeError, match="cover 2 positions but model_input has 3 tokens"):
        wire.decode_forward_backward(msg.SerializeToString())


# ------------------------------------------------------------------------------------------------ headers
def test_content_encodings_round_trip_and_are_bounded():
    body = b"tinker" * 1000
    assert wire.decode_content(zstandard.ZstdCompressor().compress(body), "zstd") == body
    assert wire.decode_content(gzip.compress(body), "gzip") == body
    assert wire.decode_content(body, None) == body == wire.decode_content(body, "identity")
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (4 << 20))
    assert len(bomb) < 1000
    with pytest.raises(PayloadTooLargeError):
        wire.decode_content(bomb, "zstd", max_bytes=1 << 20)
    with pytest.raises(wire.WireDecodeError, match="not valid zstd"):
        wire.decode_content(b"definitely not zstd", "zstd")
    unsized = zstandard.ZstdCompressor(write_content_size=False)
    assert wire.decode_content(unsized.compress(body), "zstd") == body
    with pytest.raises(PayloadTooLargeError):
        wire.decode_content(unsized.compress(b"\0" * (4 << 20)), "zstd", max_bytes=1 << 20)
    for coding, packed in (
        ("zstd", zstandard.ZstdCompressor().compress(body)),
        ("gzip", gzip.compress(body)),
        ("zstd", unsized.compress(body)),
    ):
        with pytest.raises(wire.WireDecodeError, match="not valid"):  # truncated in transit
            wire.decode_content(packed[: len(packed) // 2], coding)
    with pytest.raises(BadRequestError) as err:
        wire.decode_content(body, "br")
    assert err.value.code == "unsupported_content_encoding"


def test_body_kind_and_accept_negotiation():
    assert wire.body_kind("application/x-protobuf") == "proto"
    assert wire.body_kind("application/json; charset=utf-8") == "json"
    assert wire.body_kind(None) == "json"
    with pytest.raises(BadRequestError) as err:
        wire.body_kind("text/plain")
    assert err.value.code == "unsupported_content_type"
    assert wire.wants_proto("application/x-protobuf")
    assert wire.wants_proto("application/x-protobuf, application/json")
    assert not wire.wants_proto("application/json")
    assert not wire.wants_proto("application/x-protobuf;q=0, application/json")
    assert not wire.wants_proto(None)


# ------------------------------------------------------------------------------------------------ responses
def test_sample_response_encoding():
    resp = SampleResponseV2(
        sequences=[
            SampledSequenceV2(
                stop_reason="stop",
                tokens=[11, 2],
                logprobs=[-0.25, -1.5],
                topk_logprobs=[[(11, -0.25), (12, -2.0)], [(2, -1.5)]],
            ),
            SampledSequenceV2(stop_reason="length", tokens=[13], logprobs=None),
        ],
        prompt_logprobs=[None, -3.0, -0.5],
        topk_prompt_logprobs=[None, [(7, -3.0)], [(8, -0.5), (9, -1.0)]],
        target_prompt_logprobs=WireTensorData(
            data=[-1.0, -2.0], dtype="float32", shape=[2, 3], sparse_crow_indices=[0, 1, 2], sparse_col_indices=[0, 2]
        ),
        prompt_alt_tokens=PromptAltTokens(
            tokens=TensorData(data=[4, 5], dtype="int64", shape=[2, 1]),
            logprobs=TensorData(data=[-0.1, -0.2], dtype="float32", shape=[2, 1]),
        ),
        prompt_cache_hit_tokens=2,
    )
    msg = schema.SampleResponse()
    msg.ParseFromString(wire.encode_future_result(resp.model_dump(mode="json")))
    s0, s1 = msg.sequences
    assert (s0.stop_reason, s1.stop_reason) == (0, 1)
    assert np.frombuffer(s0.tokens, "<i4").tolist() == [11, 2]
    assert np.frombuffer(s0.logprobs, "<f4").tolist() == [-0.25, -1.5]
    assert not s1.HasField("logprobs") and not s1.HasField("topk_sampled_logprobs")
    topk = s0.topk_sampled_logprobs
    assert (topk.k, topk.length) == (2, 2)
    assert np.frombuffer(topk.token_ids, "<i4").tolist() == [11, 12, 2, 0]
    assert np.frombuffer(topk.logprobs, "<f4").tolist() == [-0.25, -2.0, -1.5, wire.MASK_LOGPROB]
    prompt = np.frombuffer(msg.prompt_logprobs, "<f4")
    assert math.isnan(prompt[0]) and prompt[1:].tolist() == [-3.0, -0.5]
    assert np.frombuffer(msg.topk_prompt_logprobs.logprobs, "<f4")[:2].tolist() == [wire.MASK_LOGPROB] * 2
    tgt = msg.target_prompt_logprobs
    assert tgt.WhichOneof("encoding") == "sparse_csr" and list(tgt.shape) == [2, 3]
    assert np.frombuffer(tgt.sparse_csr.col_indices, "<i8").tolist() == [0, 2]
    assert np.frombuffer(msg.prompt_alt_tokens.tokens.dense, "<i8").tolist() == [4, 5]
    assert msg.prompt_cache_hit_tokens == 2
    with pytest.raises(ValueError, match="more than k=1"):
        wire.encode_sample_response(resp, topk_sample_k=1)


def test_forward_backward_output_encoding_groups_rectangular_runs():
    out = ForwardBackwardOutput(
        loss_fn_outputs=[
            {"logprobs": TensorData(data=[-1.0, -2.0], dtype="float32", shape=[2])},
            {"logprobs": TensorData(data=[-3.0], dtype="float32", shape=[1])},
            {"logprobs": TensorData(data=[-1.0, -2.0, -3.0, -4.0], dtype="float32", shape=[2, 2])},
        ],
        metrics={"loss:sum": 6.5},
    )
    msg = schema.ForwardBackwardOutput()
    msg.ParseFromString(wire.encode_forward_backward_output(out))
    assert msg.loss_fn_output_type == "ArrayRecord" and dict(msg.metrics) == {"loss:sum": 6.5}
    first, second = msg.loss_fn_outputs
    assert (first.num_datums, second.num_datums) == (2, 1)
    bt = first.fields["logprobs"]
    assert np.frombuffer(bt.offsets, "<i8").tolist() == [0, 8, 12]
    assert list(bt.trailing_shape) == [] and list(second.fields["logprobs"].trailing_shape) == [2]
    assert wire.proto_result_kind({"error": "x", "category": "user"}) is None
    assert wire.proto_result_kind({"metrics": {}}) is None
    with pytest.raises(ValueError, match="fields"):
        wire.encode_forward_backward_output(
            ForwardBackwardOutput(loss_fn_outputs=[{"logprobs": TensorData.from_list([1.0], "float32")}, {}])
        )


def test_a_compressed_body_is_bounded_and_nothing_may_follow_its_stream():
    """Too large after zstd: 413 before the message is read; bytes after the zstd frame or gzip stream: 400."""
    msg = _fb(seq_id=12)
    d = msg.data.add()
    _text(d, list(range(50_000)))
    raw = msg.SerializeToString()
    packed = zstandard.ZstdCompressor().compress(raw)
    with pytest.raises(PayloadTooLargeError):
        wire.decode_content(packed, "zstd", max_bytes=10_000)
    assert wire.decode_content(packed, "zstd") == raw
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    for body, coding in ((packed + packed, "zstd"), (unsized + b"x", "zstd"), (gzip.compress(raw) + b"x", "gzip")):
        with pytest.raises(wire.WireDecodeError, match=r"follow|unused data"):
            wire.decode_content(body, coding)
