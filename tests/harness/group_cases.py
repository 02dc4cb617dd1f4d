"""The trainer-group exactness cases: the same ops run by one process and by every rank of a group.

``python -m harness.group_cases OUT`` (with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set, e.g.
by :func:`launch_group`) joins a gloo group, runs :func:`cases` on the real model, :data:`SHARDED_CASES` on it with
the base weights sharded (``shard_base``), then the live-loop steps of
:mod:`harness.group_live_loop` with rank 0 leading, and rank 0 writes both results to ``OUT`` (``torch.save``);
:func:`run_cases` without a group is the one-process run they are compared with.
Each case starts from the same LoRA weights (B ≠ 0, so every LoRA gradient is non-zero) and a fresh optimizer.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from livelora.clients.types import AdamParams, Datum, LoraConfig, ModelInput, TensorData

#: the cases also run with the base weights sharded (cross entropy, an RL loss, a rank with no datum)
SHARDED_CASES = ("cross_entropy", "ppo", "one_datum_per_op")

#: sequence lengths (tokens of model_input) that differ a lot: padding runs to the longest row of each slice
LENGTHS = (4, 41, 15, 27, 7, 20)


#: Adam's ε in the cases' steps. Adam's first step moves each weight by lr·g/(|g| + ε): with a tiny ε that is
#: ±lr for any g above ε, so a gradient element at rounding level (|g| ~ 1e-7 of the largest) can move ±lr in
#: either direction under any change of summation order (a group, or one process with the batch reordered). With
#: the gradients clipped to norm 1 (elements ~1e-3), ε = 1e-3 keeps Adam's normalisation and makes the update a
#: smooth function of g, so the weights compare within 1e-6; the gradients themselves compare at every ε.
STEP_EPS = 1e-3


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(20, 40000, (n + 1,), generator=g).tolist()


def _datum(tokens: list[int], prompt: int, **extra: list[float]) -> Datum:
    n = len(tokens) - 1
    inputs = {"target_tokens": TensorData.from_list(tokens[1:], "int64")}
    inputs.update({k: TensorData.from_list(v, "float32") for k, v in extra.items()})
    assert all(len(v) in (1, n) for v in extra.values())
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def sft(i: int, prompt: int = 3) -> Datum:
    tokens = _ids(LENGTHS[i % len(LENGTHS)], i)
    n = len(tokens) - 1
    return _datum(tokens, prompt, weights=[0.0 if j + 1 < prompt else 1.0 + 0.1 * (j % 3) for j in range(n)])


def rl(i: int, loss: str, prompt: int = 3) -> Datum:
    tokens = _ids(LENGTHS[i % len(LENGTHS)], 100 + i)
    n = len(tokens) - 1
    done = [0.0 if j + 1 < prompt else 1.0 for j in range(n)]
    extra = {
        "logprobs": [-(1.0 + 0.37 * ((j * 7 + i) % 5)) * d for j, d in enumerate(done)],
        "advantages": [(0.8 if i % 2 else -0.6) * d for d in done],
    }
    if loss == "gspo":
        extra["sequence_ratio_mask"] = done
    if loss == "dro":  # its quadratic term restricted to the sampled tokens
        extra["mask"] = done
    return _datum(tokens, prompt, **extra)


def pref(i: int, label: float | None = None, prompt: int = 4) -> Datum:
    tokens = _ids(LENGTHS[i % len(LENGTHS)] + 2, 200 + i // 2 if label is None else 300 + i)
    if label is None:  # a DPO pair shares its prompt
        tokens[: prompt + 1] = _ids(prompt, 400 + i // 2)
    n = len(tokens) - 1
    extra = {"weights": [0.0 if j + 1 < prompt else 1.0 for j in range(n)]}
    if label is not None:
        extra["label"] = [label]
    return _datum(tokens, prompt, **extra)


def live_kto_step(base_ref) -> list[tuple]:
    """The live loop's KTO step: three rated chat replies through :class:`EventDatums` (the rater weights too),
    then ``forward_backward`` on the positions the loss reads and ``optim_step`` with the live loop's learning rate
    and clip, as ``OnlineTrainer.train`` (ε: :data:`STEP_EPS`)."""
    from livelora.trainer.event_datums import EventDatums
    from livelora.trainer.settings import TrainingSection

    config = TrainingSection()
    examples = EventDatums(base_ref, config)
    data, loss_fn, cfg, lr = examples.datums(live_kto_batch(examples))
    return [
        ("fb", data, loss_fn, cfg, {"loss_positions_only": True}),
        ("step", AdamParams(learning_rate=lr, grad_clip_norm=config.grad_clip_norm, eps=STEP_EPS)),
    ]


def live_kto_batch(examples):
    """A live-loop KTO batch (lineage ``lin``, endpoint ``ep``) of three rated chat replies, with rater weights;
    ``examples``: an :class:`EventDatums` (its chat template)."""
    from livelora.clients.types.signals import ChatMessage, RatingEvent
    from livelora.trainer.scheduler import Batch

    events = []
    for k, (q, a, liked) in enumerate(
        [
            ("What is 2 + 3?", "5.", True),
            ("Name a colour.", "Blue is a colour that many people like.", False),
            ("Say hi.", "Hello there, how can I help you today?", True),
        ]
    ):
        prompt, completion = examples.chat_pair([ChatMessage(role="user", content=q)], a)
        events.append(
            RatingEvent(
                id=f"e{k}",
                endpoint="ep",
                created=1,
                completion_id=f"c{k}",
                prompt_token_ids=prompt,
                completion_token_ids=completion,
                rating=liked,
                rating_key=f"c{k}:u",
                finish_reason="length",
            )
        )
    return Batch("lin", "kto", events, [f"{k}-0" for k in range(3)], 1.0, 1.5, example_weights=[1.0, 0.5, 0.8])


def cases(base_ref) -> dict[str, list[tuple]]:
    """name → ops: ``("fb", data, loss_fn, config, kwargs)`` and ``("step", AdamParams)``."""
    step = ("step", AdamParams(learning_rate=1e-3, grad_clip_norm=1.0, eps=STEP_EPS))
    out: dict[str, list[tuple]] = {
        "cross_entropy": [("fb", [sft(i) for i in range(3)], "cross_entropy", None, {}), step],
        "one_datum_per_op": [
            ("fb", [sft(4)], "cross_entropy", None, {}),
            ("fb", [sft(1)], "cross_entropy", None, {}),
            step,
        ],
    }
    for loss, cfg in [
        ("importance_sampling", None),
        ("ppo", None),
        ("cispo", None),
        ("dro", {"beta": 0.05}),
        ("gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}),
    ]:
        out[loss] = [("fb", [rl(i, loss) for i in range(3)], loss, cfg, {}), step]
    out["kto"] = [("fb", [pref(i, float(i % 2)) for i in range(3)], "kto", {"beta": 0.1}, {}), step]
    out["dpo"] = [("fb", [pref(i) for i in range(6)], "dpo", {"beta": 0.1}, {}), step]  # pair 1 spans both ranks
    out["live_kto_step"] = live_kto_step(base_ref)
    return out


def new_model(base_ref, group=None):
    """The cases' model: rank 4, the same LoRA weights on every process (B ≠ 0)."""
    from livelora.trainer.model import TrainingModel

    model = TrainingModel(base_ref, LoraConfig(rank=4, seed=0), group=group)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.lora_params.values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def run_cases(model, ops_by_case: dict[str, list[tuple]]) -> dict[str, dict[str, Any]]:
    """Per case: each ``fb``'s ``loss:sum``, metrics and logprobs; the whole batch's LoRA gradients (summed over
    the ranks in a group) and the ``optim_step`` metrics; the LoRA weights after the step."""
    import torch.distributed as dist

    start = {k: p.detach().clone() for k, p in model.lora_params.items()}
    results = {}
    for name, ops in ops_by_case.items():
        with torch.no_grad():
            for k, p in model.lora_params.items():
                p.copy_(start[k])
        model.optimizer, model.step = model.new_optimizer(), 0
        model.zero_grad()
        res: dict[str, Any] = {"fb": []}
        for op in ops:
            if op[0] == "fb":
                _, data, loss_fn, cfg, kw = op
                out = model.forward_backward(data, loss_fn, cfg, **kw)
                res["fb"].append((out.metrics, [r["logprobs"].to_torch() for r in out.loss_fn_outputs]))
            else:
                grads = {k: p.grad.detach().clone() for k, p in model.lora_params.items()}
                if model.group is not None:
                    for g in grads.values():
                        dist.all_reduce(g)
                res["grads"] = grads
                res["opt"] = model.optim_step(op[1])
        res["weights"] = {k: p.detach().clone() for k, p in model.lora_params.items()}
        results[name] = res
    return results


def start_group(module: str, args: list[str], world_size: int = 2) -> list[subprocess.Popen]:
    """Start ``python -m module *args`` as ``world_size`` ranks of one group on 127.0.0.1 (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` as torchrun sets them; one torch thread each)."""
    from harness.cluster import free_port

    port = str(free_port())
    tests = str(Path(__file__).resolve().parents[1])
    procs = []
    for rank in range(world_size):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(subprocess.Popen([sys.executable, "-m", module, *args], env=env))
    return procs


def launch_group(out: Path, world_size: int = 2, timeout_s: float = 600) -> list[int]:
    """Run :func:`main` as ``world_size`` ranks (rank 0 writes ``out``); returns their exit codes.

    Raises:
        subprocess.TimeoutExpired: the group did not finish in ``timeout_s``.
    """
    procs = start_group("harness.group_cases", [str(out)], world_size)
    try:
        return [p.wait(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def main() -> None:
    from livelora.core.base_models import resolve_base_model
    from livelora.core.settings import DEFAULT_MODEL
    from livelora.trainer.distributed import TrainerGroup

    torch.set_num_threads(1)
    group = TrainerGroup.join(backend="gloo", timeout_s=120, current=True)
    base_ref = resolve_base_model(DEFAULT_MODEL, os.environ["LIVELORA_HOME"])
    todo = cases(base_ref)
    if os.environ.get("GROUP_CASES"):  # a subset, by name (comma-separated)
        todo = {k: v for k, v in todo.items() if k in os.environ["GROUP_CASES"].split(",")}
    results = run_cases(new_model(base_ref, group), todo)
    # the same cases with the base weights sharded over the ranks (FSDP2, trainer/shard_base.py)
    from livelora.trainer.shard_base import base_bytes

    start = time.perf_counter()
    sharded_model = new_model(base_ref, dataclasses.replace(group, shard_base=True))
    sharded = run_cases(sharded_model, {k: v for k, v in todo.items() if k in SHARDED_CASES})
    sharded["base_bytes"] = base_bytes(sharded_model.peft_model)
    sharded["seconds"] = time.perf_counter() - start  # printed by the test (the cost of these cases)
    del sharded_model
    # the evaluation gate's passes on a sharded model: rank 0 leads, rank 1 makes every pass with it
    from harness.group_live_loop import gate_on_sharded

    sharded["gate"] = gate_on_sharded(dataclasses.replace(group, shard_base=True), base_ref, new_model)
    # then the live loop on the group as in a group process: rank 0 leads, rank 1 mirrors (harness/group_live_loop.py)
    from harness.group_live_loop import steps_on

    live = steps_on(group, base_ref, Path(sys.argv[1]).with_name("group-store"))
    if group.leader:
        torch.save({"cases": results, "live_loop": live, "sharded": sharded}, sys.argv[1])
    group.barrier()
    group.close()


if __name__ == "__main__":
    main()
