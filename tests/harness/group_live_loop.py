"""Live-loop steps on a trainer group as in a group process (:func:`steps_on`, run by ``harness.group_cases``).

Rank 0 runs :func:`steps` (the live loop's :class:`~livelora.trainer.online.OnlineTrainer`) with a
:class:`~livelora.trainer.group_mirror.GroupLeader`; the other ranks mirror its models (``follow``) as in
``livelora trainer --nproc 2``. :func:`steps` without a group is the one-process run they are compared with.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def steps(base_ref, home: Path) -> dict[str, Any]:
    """Two KTO steps of one lineage, with the weights halved in place between them as the evaluation gate's line
    search moves them (rank 0 alone; the group must send the new state). Returns each step's metrics and the
    LoRA tensors of the second version."""
    from safetensors.torch import load_file

    from harness.group_cases import STEP_EPS, live_kto_batch
    from livelora.adapters.store import AdapterStore
    from livelora.trainer.online import OnlineTrainer
    from livelora.trainer.settings import TrainingSection

    # Adam's ε as in the other cases (group_cases.STEP_EPS; the live loop's default 1e-8 lets rounding-level
    # gradient elements move their weight by up to lr under another summation order)
    trainer = OnlineTrainer(base_ref, home, TrainingSection(adam_eps=STEP_EPS), gate=None)
    batch = live_kto_batch(trainer.examples)
    first = trainer.train(batch)
    model = trainer.model_for(batch.lineage)
    with torch.no_grad():
        for p in model.lora_params.values():
            p.mul_(0.5)
    second = trainer.train(batch)
    tensors = load_file(AdapterStore(home).version_dir(second.lineage, second.version) / "adapter_model.safetensors")
    return {"metrics": [first.metrics, second.metrics], "tensors": tensors}


def led(group, base_ref, run: Callable[[], Any]) -> Any:
    """``run()`` on rank 0 with a :class:`~livelora.trainer.group_mirror.GroupLeader` (its result), while every
    other rank mirrors rank 0's models (``follow``, replicas restored from ``base_ref``; None there)."""
    from livelora.trainer.group_mirror import GroupLeader, follow
    from livelora.trainer.recovery import restore_model

    if not group.leader:
        follow(group, lambda state, spec: restore_model(state, base_ref, max_seq_len=spec["max_seq_len"]))
        return None
    leader = GroupLeader(group, lambda: None, heartbeat_s=30)
    leader.start()
    try:
        return run()
    finally:
        leader.close()
        group.leader_of_group = None


def steps_on(group, base_ref, home: Path) -> dict[str, Any] | None:
    """:func:`steps` on a joined group as in a group process: rank 0 leads, the others mirror; rank 0's results."""
    return led(group, base_ref, lambda: steps(base_ref, home))


def gate_measure(model) -> dict[str, Any]:
    """The evaluation gate's measurement of ``model`` (adapter on): every pass, with two held-out items."""
    from livelora.core.base_models import load_tokenizer
    from livelora.trainer.gate_measure import HeldOut, ProbeSuite

    suite = ProbeSuite(load_tokenizer(model.base_ref))
    heldout = [HeldOut("a", [1, 504, 3287], [314, 2], 1), HeldOut("b", [1, 1073], [338, 28, 2], -1)]
    m = suite.measure(model, heldout=heldout)
    return {"right": m.probe_right, "logp": m.logp_M_V, "replies": m.replies, "signal": m.signal}


def gate_on_sharded(group, base_ref, new_model) -> dict[str, Any] | None:
    """:func:`gate_measure` on ``new_model(base_ref, group)`` with the base weights sharded over ``group``
    (``shard_base``): rank 0 leads, the others build their replicas sharded too and make every pass."""
    from livelora.trainer import distributed

    previous, distributed._CURRENT = distributed._CURRENT, group  # replicas are built on the sharded group
    try:
        return led(group, base_ref, lambda: gate_measure(new_model(base_ref, group)))
    finally:
        distributed._CURRENT = previous
