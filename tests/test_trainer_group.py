"""A trainer group of 2 ranks (gloo, fp32, spawned processes) against one process on the same batches: the loss,
the logprobs, every LoRA gradient and the weights after ``optim_step`` agree within 1e-6, for every built-in loss,
a live-loop KTO step, an uneven split (3 datums on 2 ranks), a DPO pair split across the ranks, one datum per op
(a rank with no datum) and sequences of 4 to 41 tokens. fp32 sums in another order differ in the last bits: the
loss within 1e-6 of its size, every gradient element within 1e-6 of the gradient's L2 norm (or 1e-6 when that
is below 1), the weights within 1e-6 (Adam's ε in the steps: harness/group_cases.py), per-token logprobs within 1e-5
of the datum's largest |logprob|.
One group launch runs every case (harness/group_cases.py), three of them again with the base weights sharded
(FSDP2) and the evaluation gate's passes on that sharded model, then two live-loop steps with rank 0 leading and rank 1
mirroring its models as in ``livelora trainer --nproc 2`` (harness/group_live_loop.py).
"""

from __future__ import annotations

import json
import math
import signal
import time

import pytest
import torch
from harness.group_cases import SHARDED_CASES, cases, launch_group, new_model, run_cases, start_group
from harness.group_live_loop import gate_measure, steps

from livelora.core.losses import LOSS_SPECS
from livelora.trainer.distributed import shard

TOL = 1e-6
LP_TOL = 1e-5


def test_shard_splits_contiguously_and_evenly():
    assert [shard(3, r, 2) for r in range(2)] == [range(0, 2), range(2, 3)]
    assert [shard(1, r, 2) for r in range(2)] == [range(0, 1), range(1, 1)]
    assert [list(shard(7, r, 3)) for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]


@pytest.fixture(scope="module")
def runs(base_ref, tmp_path_factory):
    out = tmp_path_factory.mktemp("group") / "rank0.pt"
    assert launch_group(out, 2) == [0, 0]
    group = torch.load(out, weights_only=False)
    torch.set_num_threads(1)
    alone = run_cases(new_model(base_ref), cases(base_ref))
    return alone, group["cases"], steps(base_ref, out.with_name("one-store")), group["live_loop"], group["sharded"]


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


CASES = [
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
    "gspo",
    "kto",
    "dpo",
    "live_kto_step",
    "one_datum_per_op",
]


def test_every_builtin_loss_has_a_case():
    assert set(LOSS_SPECS) <= set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_a_group_of_two_equals_one_process(runs, case):
    _assert_equal(runs[0][case], runs[1][case])


@pytest.mark.parametrize("case", SHARDED_CASES)
def test_a_group_of_two_with_the_base_sharded_equals_one_process(runs, case):
    """The base weights sharded over the 2 ranks with FSDP2 (LoRA and AdamW state whole on each rank): the same
    loss, gradients and weights after ``optim_step`` as one process, a rank without datums included."""
    _assert_equal(runs[0][case], runs[4][case])


def test_each_rank_holds_half_of_the_sharded_base_weights(runs):
    held, whole = runs[4]["base_bytes"]
    assert whole > 500e6  # SmolLM2-135M in float32: 134.5M parameters, 538 MB
    assert abs(held - whole / 2) <= 0.001 * whole, (held, whole)  # even dims split in half, odd ones one row apart
    print(
        f"base weights held per rank: {held / 1e6:.1f} MB of {whole / 1e6:.1f} MB; sharded cases on the group: "
        f"{runs[4]['seconds']:.1f} s"
    )


def _assert_equal(alone, group):
    assert len(alone["fb"]) == len(group["fb"])
    for (m1, lp1), (m2, lp2) in zip(alone["fb"], group["fb"]):
        assert math.isfinite(m1["loss:sum"]) and m1["loss:sum"] != 0.0
        assert set(m1) == set(m2)
        for k in m1:  # the loss and counts within 1e-6 of their size; means of log-ratios (β·Σ(lp − ref), a
            # difference of two sums of ~-5 nat terms) within 10x that
            tol = TOL * max(1.0, abs(m1[k])) if k == "loss:sum" or k.startswith("num_") else 10 * TOL
            assert abs(m1[k] - m2[k]) <= tol, (k, m1[k], m2[k])
        assert [x.shape for x in lp1] == [x.shape for x in lp2]
        for a, b in zip(lp1, lp2):  # nats per token: often bit-equal (the slices pad as the whole batch); else the
            # last bits of a float32 log-sum-exp over 49,152 logits (|lp| up to ~25 nats, 1 ulp ~2e-6)
            assert _close(a, b) <= LP_TOL * max(1.0, float(a.abs().max()))
    # every element within 1e-6 of the gradient's L2 norm over all LoRA tensors (what clipping and the step see)
    nonzero, scale = 0, math.sqrt(sum(float(g.double().pow(2).sum()) for g in alone["grads"].values()))
    for k, g1 in alone["grads"].items():
        assert _close(g1, group["grads"][k]) <= TOL * max(1.0, scale), (k, _close(g1, group["grads"][k]), scale)
        nonzero += bool(g1.abs().max() > 0)
    assert nonzero == len(alone["grads"])  # every LoRA gradient took part
    for k in ("grad_norm:mean", "update_norm:mean", "step:max"):
        assert abs(alone["opt"][k] - group["opt"][k]) <= TOL * max(1.0, abs(alone["opt"][k]))
    for k, w1 in alone["weights"].items():
        assert _close(w1, group["weights"][k]) <= TOL


@pytest.mark.parametrize("mode", ["hang", "kill"])
def test_a_hung_or_dead_rank_makes_the_group_fail(tmp_path, mode):
    """Rank 1 stops taking part (sleeps, or is SIGKILLed): rank 0's next collective raises (the group's timeout,
    5 s here, or the closed connection) instead of waiting forever, so its trainer can give its leases back."""
    out = tmp_path / "rank0.json"
    procs = start_group("harness.group_fail", [mode, str(out)])
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "rank0.json.ready").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if mode == "kill":
            procs[1].send_signal(signal.SIGKILL)
        assert procs[0].wait(timeout=300) == 3
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    result = json.loads(out.read_text())
    assert result["error"] is not None and result["mode"] == mode
    if mode == "hang":  # waited for the timeout (5 s), not for ever
        assert result["after_s"] >= 4.0


def test_live_loop_steps_on_a_group_process_equal_one_process(runs):
    """Two live-loop KTO steps (``OnlineTrainer.train``) on the group with rank 0 leading and rank 1 mirroring its
    models, as in ``livelora trainer --nproc 2``, the weights halved in place on rank 0 between them (as the gate's
    line search moves them): the same losses (the second one only if rank 1 got the halved weights) and second
    version as one process."""
    alone, group = runs[2], runs[3]
    for m1, m2 in zip(alone["metrics"], group["metrics"]):
        assert abs(m1["loss:sum"] - m2["loss:sum"]) <= TOL * max(1.0, abs(m1["loss:sum"])), (m1, m2)
    for k, w in alone["tensors"].items():  # Adam's ε 1e-3 as in the other cases
        assert _close(w, group["tensors"][k]) <= TOL, (k, _close(w, group["tensors"][k]))


def test_the_gate_measures_a_sharded_model_on_every_rank_as_one_process_does(base_ref, runs):
    gate = runs[4]["gate"]  # rank 0 leading, rank 1 making every pass on its sharded replica
    torch.set_num_threads(1)
    alone = gate_measure(new_model(base_ref))
    assert gate["right"] == alone["right"] and gate["replies"] == alone["replies"]
    assert _close(gate["logp"], alone["logp"]) < LP_TOL
    assert gate["signal"].keys() == {"a", "b"}
    assert all(abs(gate["signal"][k] - alone["signal"][k]) < LP_TOL for k in "ab")
