"""A trainer group on a live server: a ``livelora gateway``, a ``livelora trainer --nproc 2`` (torchrun, gloo) and a
standby single ``livelora trainer`` on the real Redis. The group owns a training session's model; rank 1 is
SIGKILLed in the middle of a ``forward_backward``; the group fails, rank 0 gives its leases back (before their
10 s TTL lapses), the standby takes the model over from the recovery snapshot and runs the uncommitted ops. Every
loss and the weights after the last ``optim_step`` equal a run of the same ops in this process (one process, no
kill) within 1e-6, and every op is committed exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import redis
import torch
from harness.cluster import MODEL, cluster_on_new_store
from harness.group_cases import STEP_EPS, _datum, _ids, sft

from livelora.clients import AdamParams, ServiceClient
from livelora.clients.types.tinker import LoraConfig
from livelora.core.session_protocol import CheckpointIndex
from livelora.trainer.model import TrainingModel
from livelora.trainer.recovery import read_snapshot

pytestmark = pytest.mark.slow

URL = "redis://127.0.0.1:6379/0"
ENV = {
    "LIVELORA_LEASE_TTL_S": "10",
    "LIVELORA_SESSION_TTL_S": "300",
    "LIVELORA_GROUP_TIMEOUT_S": "30",
    "LIVELORA_GATE_ENABLED": "false",
}
STEP = AdamParams(learning_rate=1e-3, grad_clip_norm=1.0, eps=STEP_EPS)
TOL = 1e-6


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (``/proc/<pid>/stat``, clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ops(small, big) -> list[tuple]:
    """The session: a step on 3 datums, a step on 4 longer ones (rank 1 dies in its forward_backward), a last step."""
    return [("fb", small), ("step",), ("fb", big), ("step",), ("fb", small), ("step",)]


@pytest.fixture(scope="module")
def cluster(livelora_home, base_ref, tmp_path_factory):
    with cluster_on_new_store(livelora_home, tmp_path_factory, "group-live", ENV, URL) as c:
        c.add_gateway()
        c.add_trainer(nproc=2)
        c.wait_ready()
        yield c


def test_rank_1_killed_mid_step_the_standby_finishes_the_session_with_the_same_results(cluster, base_ref):
    gateway, group = cluster.gateways[0], cluster.trainers[0]
    service = ServiceClient(gateway.url)
    training = service.create_lora_training_client(base_model=MODEL, rank=2)
    model_id = training.model_id
    assert cluster.owner_of(model_id) is group
    standby = cluster.add_trainer()  # after the group took the model: it waits for the lease
    rank1 = cluster.ranks(group)[1]
    small = [sft(i) for i in range(3)]
    big = [_datum(_ids(120, 50 + i), 1, weights=[1.0] * 120) for i in range(4)]  # a second or more per rank
    results: list = []
    run = ops(small, big)
    for op in run[:2]:
        fut = training.forward_backward(op[1], "cross_entropy") if op[0] == "fb" else training.optim_step(STEP)
        results.append(fut.result(timeout=300))
    cluster.wait_ready(procs=[standby])
    # the big step: kill rank 1 once it is computing its half of the forward_backward
    before = cpu_seconds(rank1)
    fb, opt = training.forward_backward(big, "cross_entropy"), training.optim_step(STEP)
    deadline = time.monotonic() + 300
    while cpu_seconds(rank1) - before < 0.3 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(rank1, signal.SIGKILL)
    results += [fb.result(timeout=300), opt.result(timeout=300)]
    for op in run[4:]:
        fut = training.forward_backward(op[1], "cross_entropy") if op[0] == "fb" else training.optim_step(STEP)
        results.append(fut.result(timeout=300))
    assert group.popen.wait(timeout=300) != 0  # the group failed as a whole
    assert "trainer group failed" in group.tail(200_000)
    assert f"gave back the leases of {model_id}" in group.tail(200_000)  # rank 0 released them (TTL 10 s)
    assert cluster.owner_of(model_id) is standby
    assert "took over training model" in standby.tail(200_000)
    r = redis.Redis.from_url(URL, decode_responses=True)
    try:
        runs = r.hgetall(f"{cluster.prefix}opruns:{model_id}")
        lora = LoraConfig.model_validate(json.loads(r.get(f"{cluster.prefix}model:{model_id}"))["lora"])
    finally:
        r.close()
    seqs = {int(k): int(v) for k, v in runs.items() if k != "applied"}
    assert set(seqs) == set(range(len(run) + 1)) and set(seqs.values()) == {1}, runs  # create + 6 ops, once each
    state = read_snapshot(CheckpointIndex(cluster.home, model_id))
    assert state["seq"] == len(run) and state["step"] == 3
    # the same ops in this process, one process, no kill (one torch thread, as each trainer: cores are shared)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = TrainingModel(base_ref, lora)
        want = [
            model.forward_backward(op[1], "cross_entropy") if op[0] == "fb" else model.optim_step(STEP) for op in run
        ]
    finally:
        torch.set_num_threads(threads)
    for op, got, ref in zip(run, results, want):
        if op[0] == "fb":
            loss = ref.metrics["loss:sum"]
            assert abs(got.metrics["loss:sum"] - loss) <= TOL * max(1.0, abs(loss)), (got.metrics, loss)
        else:
            assert got.metrics["step:max"] == ref["step:max"]
    for k, w in model.adapter_state().items():
        assert float((state["tensors"][k] - w).abs().max()) <= TOL, k
    service.close()
