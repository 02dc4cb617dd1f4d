"""The trainer's op executor on its own: seq order, buffering, dedupe, failed ops, session expiry (real Redis)."""

from __future__ import annotations

import uuid

import pytest
from harness.bus import future, run_until, send
from harness.server import MODEL

from livelora.core.session_protocol import Op, model_id_for
from livelora.core.settings import SessionSection
from livelora.trainer.executor import OpExecutor


@pytest.fixture()
def setup(bus, livelora_home):
    r, keys = bus
    ex = OpExecutor(r, keys, livelora_home, MODEL, SessionSection(session_ttl_s=2, gap_timeout_s=3), device="cpu")
    yield r, keys, ex
    for model_id in list(ex.slots):
        ex.free(model_id, "test over")


def test_executor_orders_buffers_dedupes_and_expires(setup, tokenizer):
    r, keys, ex = setup
    sid = uuid.uuid4().hex
    r.set(keys.session(sid), "{}", px=60_000)
    model_id = model_id_for(sid, 0)
    ids = tokenizer.encode("Hello there, general Kenobi.")
    datum = {
        "model_input": {"chunks": [{"tokens": ids[:-1], "type": "encoded_text"}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": ids[1:], "dtype": "int64"},
            "weights": {"data": [1.0] * (len(ids) - 1), "dtype": "float32"},
        },
    }
    fb = {"input": {"data": [datum], "loss_fn": "cross_entropy"}}
    # arrival order: optim (2), the gateway-failed marker (3), create (0), fb (1), a duplicate optim (2)
    send(r, keys, model_id, Op("optim_step", 2, "opt2", {"adam_params": {"learning_rate": 1e-3}}))
    send(r, keys, model_id, Op("failed", 3, "bad3"))
    send(
        r,
        keys,
        model_id,
        Op(
            "create_model",
            0,
            "create",
            {"session_id": sid, "model_seq_id": 0, "base_model": MODEL, "lora_config": {"rank": 2}},
        ),
    )
    send(r, keys, model_id, Op("forward_backward", 1, "fb1", fb))
    send(r, keys, model_id, Op("optim_step", 2, "opt2-dup", {"adam_params": {"learning_rate": 1e-3}}))
    run_until(ex, lambda: future(r, keys, "opt2")["state"] != "pending")
    assert future(r, keys, "create")["result"]["model_id"] == model_id
    assert future(r, keys, "fb1")["result"]["metrics"]["loss:sum"] > 0
    assert future(r, keys, "opt2")["result"]["metrics"]["step:max"] == 1.0
    dup = future(r, keys, "opt2-dup")  # dropped (seq 2 was queued already), and its future says so: never pending
    assert dup["state"] == "failed" and dup["code"] == "seq_conflict" and "is queued" in dup["error"], dup
    assert ex.slots[model_id].model.step == 1
    # seq 4 never arrives: fb5 waits, then fails gap_timeout_s after it arrived; nothing stays pending
    send(r, keys, model_id, Op("forward_backward", 5, "fb5", fb))
    ex.poll(block_ms=10)
    assert future(r, keys, "fb5")["state"] == "pending"
    run_until(ex, lambda: future(r, keys, "fb5")["state"] != "pending", timeout_s=15)
    gap = future(r, keys, "fb5")
    assert gap["state"] == "failed" and gap["category"] == "user" and "seq_id 4" in gap["error"]
    # a failed op consumed its seq: seq 6 runs next
    send(r, keys, model_id, Op("optim_step", 6, "opt6", {"adam_params": {}}))
    run_until(ex, lambda: future(r, keys, "opt6")["state"] != "pending")
    assert "no gradients" in future(r, keys, "opt6")["error"]
    # the session expires (no heartbeat): the model is freed and buffered ops fail
    send(r, keys, model_id, Op("forward", 9, "fwd9", fb))
    r.pexpire(keys.session(sid), 200)
    run_until(ex, lambda: model_id not in ex.slots, timeout_s=15)
    expired = future(r, keys, "fwd9")
    assert expired["state"] == "failed" and "ended" in expired["error"]
    assert not r.exists(keys.model(model_id)) and not r.sismember(keys.models, model_id)
