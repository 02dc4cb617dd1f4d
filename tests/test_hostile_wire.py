"""Hostile bodies and sequence numbers from a tenant with an ordinary key (issue 27, items 1 and 2).

* **Decode once, check what runs.** Protobuf ``forward_backward`` bodies built by ``hypothesis`` from the
  caller's own request, another tenant's, single fields of both, unknown fields, truncations, concatenations and
  compressed streams with bytes after them: each is decoded by the gateway's one decoder
  (:func:`livelora.gateway.api.tinker_wire.body.decode_body`) and owner-checked on what it returns; the op then
  either runs on the caller's own model or is refused, never anything else. A few of them go to a live gateway
  with two tenants' keys, after which the victim's model runs its next op as if nothing happened.
* **A sequence protocol that cannot wedge**, on the live gateway: a far-ahead ``seq_id`` is a 400 naming the
  bound; an op refused with 413 leaves its seq free; a buffered op's gap timer starts when it arrives; an op at a
  seq given up after a gap answers an error at once. After each, the model's next in-order op runs.
"""

from __future__ import annotations

import os
import time
import uuid

import httpx
import numpy as np
import pytest
import redis
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from livelora.clients.errors import BadRequestError, LiveloraError
from livelora.clients.types.tinker_ext import ForwardBackwardRequestV2
from livelora.core.api_keys import TENANT_ROLES
from livelora.core.redis_keys import KeyLayout
from livelora.gateway.api.tinker_wire import WireDecodeError, schema
from livelora.gateway.api.tinker_wire.body import decode_body, owner_fields

BASE = "smollm2-135m-instruct"
PREFIX = f"{os.environ['LIVELORA_REDIS_PREFIX']}hostile-{uuid.uuid4().hex[:8]}:"
FB = "/api/v1/forward_backward"
PROTO = {"content-type": "application/x-protobuf"}
GAP_S = 4.0

OWN = f"{'a' * 32}:train:0"
VICTIM = f"{'b' * 32}:train:0"


# ---------------------------------------------------------------------------------------------- protobuf pieces
def message(model_id: str, seq_id: int, n: int = 3) -> schema.ForwardBackwardRequest:
    """A valid cross-entropy ``forward_backward`` of one datum of ``n`` tokens."""
    msg = schema.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.arange(1, n + 1, dtype="<i4").tobytes()
    d.loss_fn_inputs["target_tokens"].dtype = schema.DTYPE_INT64
    d.loss_fn_inputs["target_tokens"].dense = np.arange(2, n + 2, dtype="<i8").tobytes()
    d.loss_fn_inputs["weights"].dtype = schema.DTYPE_FLOAT32
    d.loss_fn_inputs["weights"].dense = np.ones(n, dtype="<f4").tobytes()
    return msg


def field(number: int, payload: bytes | int) -> bytes:
    """One top-level field: length-delimited for bytes, a varint for an int."""
    if isinstance(payload, int):
        return _varint(number << 3) + _varint(payload)
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
        v >>= 7
        if not v:
            return bytes(out)


def model_ids_on_the_wire(raw: bytes) -> list[str]:
    """Every top-level field-1 value, read by a reader of its own (what a first-wins or a last-wins reader sees)."""
    out, pos = [], 0
    try:
        while pos < len(raw):
            key, pos = _read_varint(raw, pos)
            kind = key & 7
            if kind == 0:
                _, pos = _read_varint(raw, pos)
            elif kind == 2:
                size, pos = _read_varint(raw, pos)
                if key >> 3 == 1:
                    out.append(raw[pos : pos + size].decode("utf-8", "replace"))
                pos += size
            elif kind in (1, 5):
                pos += 8 if kind == 1 else 4
            else:
                break
    except IndexError:
        pass
    return out


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        v |= (b & 0x7F) << shift
        if not b & 0x80:
            return v, pos
        shift += 7


PIECES = {
    "own": message(OWN, 1).SerializeToString(),
    "victim": message(VICTIM, 1).SerializeToString(),
    "own_id": field(1, OWN.encode()),
    "victim_id": field(1, VICTIM.encode()),
    "seq1": field(2, 1),
    "seq999999": field(2, 999_999),
    "loss": field(4, b"cross_entropy"),
    "forward_only": field(6, 1),
    "datum": field(3, message(OWN, 1).data[0].SerializeToString()),
    "unknown": field(9, b"x"),
    "unknown_varint": field(15, 7),
    "empty_string_id": field(1, b""),
    "group_start": _varint(1 << 3 | 3),
    "zero_tag": b"\x00",
}


def hostile_bodies():
    """``(raw, content-encoding)``: 1-5 pieces in any order, duplicated or not, maybe cut, maybe compressed with
    something after the stream."""
    parts = st.lists(st.sampled_from(sorted(PIECES)), min_size=1, max_size=5)

    @st.composite
    def build(draw):
        raw = b"".join(PIECES[p] for p in draw(parts))
        if draw(st.booleans()):
            raw = raw[: draw(st.integers(0, len(raw)))]
        encoding = draw(st.sampled_from([None, "zstd", "gzip"]))
        if encoding == "zstd":
            raw = zstandard.ZstdCompressor(write_content_size=draw(st.booleans())).compress(raw)
        elif encoding == "gzip":
            import gzip

            raw = gzip.compress(raw)
        if encoding and draw(st.booleans()):
            raw += draw(st.sampled_from([PIECES["victim"], b"\x00", raw]))
        return raw, encoding

    return build()


def gate(raw: bytes, encoding: str | None, caller_models: set[str]):
    """What the gateway does with a body: ``("refused", status)`` or ``("run", model_id)``. The owner check
    reads :func:`owner_fields` of the one decoded object, and the op that runs is that same object."""
    try:
        decoded = decode_body(FB, raw, PROTO["content-type"], encoding, max_bytes=1 << 20)
    except LiveloraError as exc:
        return "refused", exc.status
    checked = owner_fields(decoded).get("model_id")
    if checked is None:  # an empty body: {} names no model, and the route answers 400 "model_id is required"
        return "refused", 400
    if checked not in caller_models:
        return "refused", 404
    if isinstance(decoded, WireDecodeError):  # the caller's own op, refused (its seq recorded as refused)
        return "refused", decoded.status
    assert isinstance(decoded, ForwardBackwardRequestV2)
    return "run", decoded.model_id


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_bodies())
def test_a_hostile_protobuf_body_runs_on_the_callers_model_or_is_refused(body):
    raw, encoding = body
    outcome = gate(raw, encoding, {OWN})
    assert outcome in (("run", OWN), ("refused", 400), ("refused", 404), ("refused", 413)), outcome
    if outcome[0] == "run":  # accepted: every reader of these bytes sees one model id, the caller's
        plain = raw if encoding is None else _inflate(raw, encoding)
        assert model_ids_on_the_wire(plain) == [OWN]
        assert schema.ForwardBackwardRequest.FromString(plain).model_id == OWN  # the permissive reader agrees


def _inflate(raw: bytes, encoding: str) -> bytes:
    import gzip

    return zstandard.ZstdDecompressor().decompressobj().decompress(raw) if encoding == "zstd" else gzip.decompress(raw)


@pytest.mark.parametrize(
    "raw, code_or_param",
    [
        (PIECES["own"] + PIECES["victim"], "model_id"),  # the body: two complete requests
        (PIECES["own"] + PIECES["victim_id"], "model_id"),
        (PIECES["own"] + PIECES["seq999999"], "seq_id"),
        (PIECES["own"] + PIECES["unknown"], "body"),
        (PIECES["own"] + PIECES["zero_tag"], "body"),
        (PIECES["own"] + field(4, b"importance_sampling"), "loss_fn"),
    ],
)
def test_repeated_unknown_and_trailing_fields_are_400_naming_the_field(raw, code_or_param):
    decoded = decode_body(FB, raw, PROTO["content-type"], None)
    assert isinstance(decoded, WireDecodeError) and decoded.status == 400
    assert decoded.param == code_or_param and decoded.model_id == OWN, (decoded.param, str(decoded))


def test_nested_repeats_oneofs_and_map_keys_are_400():
    head = schema.ForwardBackwardRequest(model_id=OWN, seq_id=1, loss_fn="cross_entropy").SerializeToString()
    tokens = field(1, b"\x01\x00\x00\x00")  # EncodedTextChunk.tokens
    datums = {  # Datum bodies: field 1 = a Chunk, field 2 = a loss_fn_inputs map entry
        "a singular field twice in a chunk": field(1, field(1, tokens + tokens)),
        "both members of a oneof": field(1, field(1, tokens) + field(2, field(2, b"png"))),
        "a map key twice": field(2, field(1, b"weights")) + field(2, field(1, b"weights")),
        "an unknown field in a tensor": field(2, field(1, b"weights") + field(2, field(9, 1))),
        "a wire type that is not the field's": field(2, field(1, b"weights") + field(2, field(3, b"x"))),
    }
    for what, datum in datums.items():
        decoded = decode_body(FB, head + field(3, datum), PROTO["content-type"], None)
        assert isinstance(decoded, WireDecodeError) and decoded.model_id == OWN, what
        assert decoded.param.startswith("data"), (what, decoded.param)


def test_a_json_body_that_repeats_a_key_is_400():
    raw = f'{{"model_id": "{OWN}", "seq_id": 1, "model_id": "{VICTIM}"}}'.encode()
    with pytest.raises(BadRequestError) as err:
        decode_body("/api/v1/optim_step", raw, "application/json", None)
    assert err.value.param == "model_id" and err.value.code == "invalid_json"
    assert decode_body(
        "/api/v1/optim_step", zstandard.ZstdCompressor().compress(b'{"a": 1}'), "application/json", "zstd"
    ) == {"a": 1}


def test_the_sdk_encoder_output_is_strict():
    """What the tinker SDK's own protobuf writer sends is accepted, field for field."""
    conv = pytest.importorskip("tinker.proto.request_conv")
    from tinker import types

    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 0.5]},
    )
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum, datum], loss_fn="cross_entropy"),
        model_id=OWN,
        seq_id=4,
    )
    raw = conv.forward_backward_request_to_proto(req).SerializeToString()
    decoded = decode_body(FB, raw, PROTO["content-type"], None)
    assert isinstance(decoded, ForwardBackwardRequestV2) and (decoded.model_id, decoded.seq_id) == (OWN, 4)
    assert decoded.forward_backward_input.data[1].loss_fn_inputs["weights"].data == [1.0, 1.0, 0.5]


# ---------------------------------------------------------------------------------------------- live gateway
#: the harness's ``keys`` and ``server`` fixtures (tests/harness/plugin.py): two tenants on a gateway of this module
KEYS = {t: (t, TENANT_ROLES) for t in ("acme", "beta")}
SERVER_SETTINGS = {
    "max_batch_size": 2,
    "max_waiting": 4,
    "redis_prefix": PREFIX,
    "executor_in_process": True,
    "max_datums_per_op": 2,
    "gap_timeout_s": GAP_S,
}


def http(server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=120, headers={"X-API-Key": key})


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, (str(r.request.url), r.status_code, r.text)
    return r.json()


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (str(r.request.url), r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def future(c: httpx.Client, request_id: str) -> dict:
    while True:
        r = c.post("/api/v1/retrieve_future", json={"request_id": request_id})
        if r.status_code != 408:
            return ok(r)


def new_model(c: httpx.Client) -> str:
    sid = ok(c.post("/api/v1/create_session", json={}))["session_id"]
    body = {"session_id": sid, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 2, "train_mlp": False}}
    created = ok(c.post("/api/v1/create_model", json=body))
    assert future(c, created["request_id"])["model_id"] == created["model_id"]
    return created["model_id"]


def fwd(c: httpx.Client, model_id: str, seq: int, n_datums: int = 1) -> httpx.Response:
    datum = {
        "model_input": {"chunks": [{"tokens": [1, 2, 3]}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": [2, 3, 4], "dtype": "int64"},
            "weights": {"data": [1.0, 1.0, 1.0], "dtype": "float32"},
        },
    }
    body = {
        "model_id": model_id,
        "seq_id": seq,
        "forward_input": {"data": [datum] * n_datums, "loss_fn": "cross_entropy"},
    }
    return c.post("/api/v1/forward", json=body)


def runs(c: httpx.Client, r: httpx.Response) -> dict:
    """The op was queued and ran: its future holds a loss."""
    res = future(c, ok(r)["request_id"])
    assert "error" not in res and res["loss_fn_outputs"], res
    return res


@pytest.fixture(scope="module")
def models(server, keys) -> dict[str, str]:
    with http(server, keys["acme"]) as a, http(server, keys["beta"]) as b:
        return {"victim": new_model(a), "attacker": new_model(b)}


def test_live_two_requests_in_one_body_are_refused_and_the_victim_is_untouched(server, keys, models):
    victim, mine = models["victim"], models["attacker"]
    with http(server, keys["beta"]) as b, http(server, keys["acme"]) as a:
        hostile = {
            "mine, then the victim's (the issue's body)": message(mine, 1).SerializeToString()
            + message(victim, 1).SerializeToString(),
            "the victim's, then mine": message(victim, 1).SerializeToString() + message(mine, 1).SerializeToString(),
            "mine, then the victim's id": message(mine, 1).SerializeToString() + field(1, victim.encode()),
            "mine, then the victim's, zstd": zstandard.ZstdCompressor().compress(
                message(mine, 1).SerializeToString() + message(victim, 1).SerializeToString()
            ),
            "two zstd frames": zstandard.ZstdCompressor().compress(message(mine, 1).SerializeToString())
            + zstandard.ZstdCompressor().compress(message(victim, 1).SerializeToString()),
        }
        for what, raw in hostile.items():
            headers = {**PROTO, **({"content-encoding": "zstd"} if "zstd" in what or "frames" in what else {})}
            r = b.post(FB, content=raw, headers=headers)
            assert r.status_code in (400, 404), (what, r.status_code, r.text)
            error_of(r, r.status_code)
        # the victim's seq 1 was never used: its own op runs, no seq_conflict, its model did one op
        runs(a, fwd(a, victim, 1))
        # the attacker's own refused seq 1 stayed free: a proper body under it runs
        res = ok(b.post(FB, content=message(mine, 1).SerializeToString(), headers=PROTO))
        assert future(b, res["request_id"])["metrics"]["loss:sum"] > 0


def test_live_far_ahead_seq_is_400_naming_the_bound_and_the_next_op_runs(server, keys, models):
    with http(server, keys["acme"]) as a:
        victim = models["victim"]
        err = error_of(fwd(a, victim, 999_999), 400)
        assert err["code"] == "seq_too_far_ahead" and err["param"] == "seq_id"
        assert "more than 64 ahead" in err["message"] and "LIVELORA_SESSION_MAX_SEQ_AHEAD" in err["message"]
        nxt = next_seq(victim)
        error_of(fwd(a, victim, nxt + 65), 400)
        raw = message(victim, 999_999).SerializeToString()
        assert error_of(a.post(FB, content=raw, headers=PROTO), 400)["code"] == "seq_too_far_ahead"
        runs(a, fwd(a, victim, nxt))


def next_seq(model_id: str) -> int:
    """The model's next seq: one past the highest committed (the count the gateway bounds ``seq_id`` by)."""
    applied = redis.Redis.from_url("redis://127.0.0.1:6379/0").hget(KeyLayout(PREFIX).op_runs(model_id), "applied")
    return int(applied) + 1


def test_live_an_op_refused_with_413_leaves_its_seq_free(server, keys, models):
    with http(server, keys["acme"]) as a:
        victim = models["victim"]
        n = next_seq(victim)
        assert error_of(fwd(a, victim, n, n_datums=3), 413)["code"] == "too_many_datums"
        runs(a, fwd(a, victim, n))  # a corrected retry under the same seq runs
        assert error_of(fwd(a, victim, n + 1, n_datums=3), 413)["code"] == "too_many_datums"
        runs(a, fwd(a, victim, n + 2))  # the client moved on: the refused seq is passed at once
        late = future(a, ok(fwd(a, victim, n + 1))["request_id"])  # too late: an error, never try_again
        assert late["category"] == "user" and late["code"] in ("seq_behind", "seq_conflict"), late


def test_live_gap_timer_starts_when_the_op_arrives_and_given_up_seqs_answer_errors(server, keys, models):
    with http(server, keys["acme"]) as a:
        victim = models["victim"]
        n = next_seq(victim)
        time.sleep(GAP_S + 1.5)  # the model idles longer than the gap timeout
        early = ok(fwd(a, victim, n + 1))  # arrives before its predecessor: must wait, not fail at once
        time.sleep(1.5)  # housekeeping runs about every second
        runs(a, fwd(a, victim, n))
        assert "error" not in future(a, early["request_id"])
        # seq n+3 arrives, n+2 never does: n+3 fails GAP_S after it arrived, and the model runs on
        gap = future(a, ok(fwd(a, victim, n + 3))["request_id"])
        assert gap["code"] == "seq_gap_timeout" and f"seq_id {n + 2} " in gap["error"], gap
        late = future(a, ok(fwd(a, victim, n + 2))["request_id"])  # the given-up seq: an error at once
        assert late["code"] == "seq_behind", late
        runs(a, fwd(a, victim, n + 4))
