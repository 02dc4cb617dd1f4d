"""One owner per training model (real Redis, the real SmolLM2 model, two executors in this process): leases
with fencing tokens, fenced writes refused for a stale owner, take-over from the recovery snapshot, lost
gradients refused, every op committed exactly once; and the install binding of a store to a prefix."""

from __future__ import annotations

import json
import uuid

import pytest
import torch
from harness.bus import future, run_until, send
from harness.server import MODEL

from livelora.core.install import InstallMismatchError, bind_install, store_id
from livelora.core.redis_keys import KeyLayout
from livelora.core.session_protocol import CheckpointIndex, Op, StaleOwnerError, model_id_for
from livelora.core.settings import SessionSection
from livelora.trainer.executor import OpExecutor
from livelora.trainer.ownership import Leases

URL = "redis://127.0.0.1:6379/0"


def test_lease_fencing_refuses_a_stale_owner(bus, tmp_path):
    r, keys = bus
    a = Leases(r, keys, ttl_s=5, owner="a")
    b = Leases(r, keys, ttl_s=5, owner="b")
    assert a.acquire("m") == 1 and b.acquire("m") is None  # one owner at a time
    assert r.get(keys.model_lease("m")) == "1:a"
    assert a.resolve("m", "rid-1", json.dumps({"state": "done", "result": {}}), 1, 60, keys.futures_channel)
    r.delete(keys.model_lease("m"))  # a's lease expired (its process froze)
    assert b.acquire("m") == 2  # a new, higher token
    # a's writes are refused: no future, no count, no trim; the index refuses its fence too
    assert not a.resolve("m", "rid-2", json.dumps({"state": "done", "result": {}}), 2, 60, keys.futures_channel)
    assert r.get(keys.future("rid-2")) is None and r.hgetall(keys.op_runs("m")) == {"1": "1", "applied": "1"}
    r.xadd(keys.ops("m"), {"op": "x"})
    assert not a.trim("m", [r.xrange(keys.ops("m"))[0][0]]) and r.xlen(keys.ops("m")) == 1
    index = CheckpointIndex(tmp_path, "m")
    index.update(lambda d: d.update(note="b"), fence=2)
    with pytest.raises(StaleOwnerError):
        index.update(lambda d: d.update(note="a"), fence=1)
    assert index.read()["note"] == "b" and index.fence() == 2
    # the renewal of a lost lease reports it; a release by the stale owner leaves b's lease alone
    assert a.renew_all() == ["m"] and "m" not in a.held and b.renew_all() == []
    a.held["m"] = "1:a"
    a.release("m")
    assert r.get(keys.model_lease("m")) == "2:b"


def test_take_over_restores_the_snapshot_and_refuses_lost_gradients(bus, livelora_home, tokenizer):
    r, keys = bus
    settings = SessionSection(session_ttl_s=120, lease_ttl_s=30)
    a = OpExecutor(r, keys, livelora_home, MODEL, settings, owner="exec-a")
    sid = uuid.uuid4().hex
    r.set(keys.session(sid), "{}", px=120_000)
    model_id = model_id_for(sid, 0)
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    datum = {
        "model_input": {"chunks": [{"tokens": ids[:-1], "type": "encoded_text"}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": ids[1:], "dtype": "int64"},
            "weights": {"data": [1.0] * (len(ids) - 1), "dtype": "float32"},
        },
    }
    fb = {"input": {"data": [datum], "loss_fn": "cross_entropy"}}
    adam = {"adam_params": {"learning_rate": 1e-2}}
    send(
        r,
        keys,
        model_id,
        Op(
            "create_model",
            0,
            "c0",
            {"session_id": sid, "model_seq_id": 0, "base_model": MODEL, "lora_config": {"rank": 2}},
        ),
    )
    send(r, keys, model_id, Op("forward_backward", 1, "fb1", fb))
    send(r, keys, model_id, Op("optim_step", 2, "opt2", adam))
    send(r, keys, model_id, Op("forward_backward", 3, "fb3", fb))  # committed by a, then a dies
    run_until(a, lambda: future(r, keys, "fb3")["state"] != "pending")
    saved = {k: v.detach().clone() for k, v in a.slots[model_id].model.lora_params.items()}
    saved_exp_avg = [s["exp_avg"].clone() for s in a.slots[model_id].model.optimizer.state.values()]
    # the stream keeps only what the snapshot (after seq 2) does not cover: fb3
    assert [json.loads(f["op"])["seq_id"] for _, f in r.xrange(keys.ops(model_id))] == [3]
    a.leases.stop(release=False)  # a dies: no renewal, no release ...
    r.delete(keys.model_lease(model_id))  # ... and its lease runs out
    b = OpExecutor(r, keys, livelora_home, MODEL, settings, owner="exec-b")
    send(r, keys, model_id, Op("optim_step", 4, "opt4", adam))
    run_until(b, lambda: future(r, keys, "opt4")["state"] != "pending")
    assert r.get(keys.model_lease(model_id)).endswith(":exec-b")
    restored = b.slots[model_id].model
    assert restored.step == 1
    assert all(torch.equal(restored.lora_params[k].detach(), v) for k, v in saved.items())
    assert all(torch.equal(s["exp_avg"], e) for s, e in zip(restored.optimizer.state.values(), saved_exp_avg))
    lost = future(r, keys, "opt4")
    assert lost["state"] == "failed" and lost["code"] == "trainer_lost" and "forward_backward seq 3" in lost["error"]
    assert not restored.has_gradients() and restored.step == 1  # no step on lost gradients
    # the client repeats its forward_backward and steps: the session goes on on b
    send(r, keys, model_id, Op("forward_backward", 5, "fb5", fb))
    send(r, keys, model_id, Op("optim_step", 6, "opt6", adam))
    run_until(b, lambda: future(r, keys, "opt6")["state"] != "pending")
    assert future(r, keys, "opt6")["result"]["metrics"]["step:max"] == 2.0
    # a, still running somewhere, learns at its next renewal that it lost the model and drops it unwritten
    send(r, keys, model_id, Op("forward", 7, "f7", fb))
    assert a.leases.renew_all() == [model_id]
    a.poll(block_ms=10)
    assert model_id not in a.slots
    run_until(b, lambda: future(r, keys, "f7")["state"] != "pending")
    runs = r.hgetall(keys.op_runs(model_id))
    assert {k: v for k, v in runs.items() if k != "applied"} == {str(s): "1" for s in range(8)}
    b.free(model_id, "test over")
    assert not (livelora_home / "sessions" / f"{CheckpointIndex(livelora_home, model_id).lineage}.recovery").exists()
    b.leases.stop()


def test_a_store_binds_one_prefix(bus, tmp_path):
    r, keys = bus
    first, second = tmp_path / "a", tmp_path / "b"
    sid = bind_install(r, keys, first)
    assert store_id(first) == sid and r.get(keys.store_id) == sid and bind_install(r, keys, first) == sid
    with pytest.raises(InstallMismatchError) as err:
        bind_install(r, keys, second, URL)
    assert "LIVELORA_REDIS_PREFIX" in str(err.value) and "LIVELORA_HOME" in str(err.value)
    other = KeyLayout(keys.prefix + "other:")
    assert bind_install(r, other, second) == store_id(second) != sid
