"""A trainer killed in the middle of a session's ``save_weights_for_sampler``, and ops left behind when a model is
freed: every future resolves and the session's next ops run.

The first test runs real ``livelora gateway`` / ``livelora trainer`` processes (:mod:`harness.cluster`): the owner's
save stops after writing its weights file (``LIVELORA_TEST_PAUSE_SAVES_IN``, :mod:`livelora.trainer.checkpoints`) and
the test SIGKILLs it there, with more ops queued behind the save. The second drives two op executors by hand: the owner
dies, the session ends, and the executor that takes the model over frees it with ops still unread in its stream.
"""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest
import redis
from harness.cluster import MODEL, Cluster, corrupt_versions, new_store

from livelora.clients import AdamParams, ServiceClient
from livelora.clients.types.tinker import Datum, ModelInput, SamplingParams, TensorData
from livelora.core.redis_keys import KeyLayout
from livelora.core.session_protocol import CheckpointIndex, Op, lineage_for, model_id_for, new_request_id
from livelora.core.settings import SessionSection
from livelora.trainer.checkpoints import PAUSE_SAVES_ENV
from livelora.trainer.executor import OpExecutor

URL = "redis://127.0.0.1:6379/0"


def datums(tokenizer, texts: list[str]) -> list[Datum]:
    out = []
    for text in texts:
        ids = tokenizer.encode(text)
        out.append(
            Datum(
                model_input=ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={
                    "target_tokens": TensorData.from_list(ids[1:], "int64"),
                    "weights": TensorData.from_list([1.0] * (len(ids) - 1), "float32"),
                },
            )
        )
    return out


@pytest.fixture(scope="module")
def cluster(livelora_home, base_ref, tmp_path_factory):
    home = new_store(tmp_path_factory.mktemp("kill-save-home"), livelora_home)
    env = {
        "LIVELORA_LEASE_TTL_S": "2",
        "LIVELORA_SESSION_TTL_S": "120",
        "LIVELORA_LORA_RANK": "2",
        PAUSE_SAVES_ENV: str(home / "pause-saves"),
    }
    c = Cluster(home, f"{os.environ['LIVELORA_REDIS_PREFIX']}killsave-{uuid.uuid4().hex[:8]}:", env, URL)
    try:
        c.start(gateways=1, trainers=2)
        yield c
    finally:
        c.stop()


def test_owner_killed_mid_save_for_sampler_the_save_and_the_ops_behind_it_complete(cluster, tokenizer):
    (gateway,) = cluster.gateways
    r = redis.Redis.from_url(URL, decode_responses=True)
    service = ServiceClient(gateway.url)
    training = service.create_lora_training_client(base_model=MODEL, rank=2)
    model_id = training.model_id
    small = datums(tokenizer, ["The sky is blue.", "Grass is green."])
    training.forward_backward(small, "cross_entropy").result(timeout=300)
    training.optim_step(AdamParams(learning_rate=1e-3)).result(timeout=300)
    # the owner's next save of this model's lineage stops after writing its weights file, until killed
    pause = cluster.home / "pause-saves"
    pause.mkdir(exist_ok=True)
    (pause / lineage_for(model_id)).write_text("")
    save = training.save_weights_for_sampler("during-kill")
    fb = training.forward_backward(small, "cross_entropy")  # queued behind the save
    opt = training.optim_step(AdamParams(learning_rate=1e-3))
    deadline = time.monotonic() + 300
    while not (paused := list(pause.glob(f"{lineage_for(model_id)}.paused-*"))):
        assert time.monotonic() < deadline, "the save never reached its pause point"
        time.sleep(0.2)
    pid = int(paused[0].name.rsplit("-", 1)[1])
    owner = cluster.owner_of(model_id)
    assert owner is not None and owner.pid == pid
    cluster.kill(owner)
    survivor = next(t for t in cluster.trainers if t.alive())
    path = save.result(timeout=300).path
    assert path == f"tinker://{model_id}/sampler_weights/during-kill"
    assert fb.result(timeout=300).metrics["loss:sum"] > 0
    assert opt.result(timeout=300).metrics["step:max"] == 2.0
    assert cluster.owner_of(model_id) is survivor
    # the checkpoint is whole and serves samples
    entry = CheckpointIndex(cluster.home, model_id).read()["checkpoints"]["sampler_weights/during-kill"]
    assert entry["version"] >= 1 and corrupt_versions(cluster.home)[1] == []
    prompt = ModelInput.from_ints(tokenizer.encode("The sky is"))
    with ServiceClient(gateway.url) as sampling:
        sampler = sampling.create_sampling_client(model_path=path)
        assert sampler.sample(prompt, 1, SamplingParams(max_tokens=4)).result(timeout=300).sequences[0].tokens
    # the session goes on: another save and step, every op committed exactly once
    assert training.save_weights_for_sampler("after-kill").result(timeout=300).path.endswith("/after-kill")
    training.forward_backward(small, "cross_entropy").result(timeout=300)
    assert training.optim_step(AdamParams(learning_rate=1e-3)).result(timeout=300).metrics["step:max"] == 3.0
    runs = r.hgetall(f"{cluster.prefix}opruns:{model_id}")
    seqs = {int(k): int(v) for k, v in runs.items() if k != "applied"}
    assert set(seqs) == set(range(9)) and set(seqs.values()) == {1}, runs
    service.close()
    r.close()


def _send(r, keys: KeyLayout, model_id: str, kind: str, seq: int, body: dict) -> str:
    """Queue an op the way the gateway does (future pending, then XADD); returns its request id."""
    rid = new_request_id(f"{model_id}:{seq}")
    r.set(keys.future(rid), json.dumps({"state": "pending"}))
    r.sadd(keys.models, model_id)
    ids = {} if kind == "create_model" else {"model_id": model_id, "seq_id": seq}
    r.xadd(keys.ops(model_id), {"op": Op(kind, seq, rid, {**body, **ids}).to_json()})
    return rid


def test_a_model_freed_with_ops_still_unread_fails_their_futures(livelora_home, tokenizer):
    prefix = f"{os.environ['LIVELORA_REDIS_PREFIX']}freed-{uuid.uuid4().hex[:8]}:"
    r = redis.Redis.from_url(URL, decode_responses=True)
    keys = KeyLayout(prefix)
    settings = SessionSection(session_ttl_s=600, lease_ttl_s=1.0)
    first = OpExecutor(r, keys, livelora_home, MODEL, settings, owner="first")
    second = OpExecutor(r, keys, livelora_home, MODEL, settings, owner="second")
    try:
        sid = uuid.uuid4().hex
        r.set(keys.session(sid), "{}", px=600_000)
        model_id = model_id_for(sid, 0)
        create = {"session_id": sid, "model_seq_id": 0, "base_model": MODEL, "lora_config": {"rank": 2}}
        rid = _send(r, keys, model_id, "create_model", 0, create)
        deadline = time.monotonic() + 300
        while json.loads(r.get(keys.future(rid)))["state"] == "pending":
            assert time.monotonic() < deadline
            first.poll(block_ms=50)
        assert json.loads(r.get(keys.future(rid)))["state"] == "done"
        # the owner dies (no more polls, its lease lapses); the session ends; ops were queued meanwhile
        first.leases.stop(release=False)
        ids = tokenizer.encode("Hello there, general Kenobi.")
        datum = {
            "model_input": {"chunks": [{"tokens": ids[:-1], "type": "encoded_text"}]},
            "loss_fn_inputs": {
                "target_tokens": {"data": ids[1:], "dtype": "int64"},
                "weights": {"data": [1.0] * (len(ids) - 1), "dtype": "float32"},
            },
        }
        queued = [
            _send(r, keys, model_id, "forward_backward", 1, {"input": {"data": [datum], "loss_fn": "cross_entropy"}}),
            _send(r, keys, model_id, "save_weights_for_sampler", 2, {"path": "s1"}),
        ]
        r.delete(keys.session(sid), keys.model_lease(model_id))
        second.poll(block_ms=50)  # takes the model over, finds its session gone and frees it
        assert model_id not in second.slots and not r.sismember(keys.models, model_id)
        for rid in queued:
            record = json.loads(r.get(keys.future(rid)))
            assert record["state"] == "failed" and record["class"] == "NotFoundError", record
            assert "was freed" in record["error"]
    finally:
        for ex in (first, second):
            ex.leases.stop(release=True)
        for key in r.scan_iter(match=prefix + "*", count=1000):
            r.delete(key)
        r.close()
