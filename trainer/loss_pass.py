"""One loss over a validated batch on a training model (:func:`run_loss`), in its phases: the batch's inputs
(:class:`LossBatch`), the reference pass with the adapter off, the policy pass, the loss and its backward, the
per-datum outputs. :meth:`TrainingModel._run <livelora.trainer.model.TrainingModel._run>` validates the batch and
calls it. In a trainer group each rank runs its slice's passes, the per-datum results are all-gathered and every
rank computes the whole batch's loss, its own logprobs carrying gradient (trainer/distributed.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from livelora.clients.types.tinker import Datum, ForwardBackwardOutput, TensorData
from livelora.core.cpu_share import step_yield
from livelora.core.losses import LossSpec, ResolvedLoss
from livelora.trainer.logprobs import datum_inputs, grad_positions
from livelora.trainer.losses import LOSS_FUNCTIONS, LossOutput
from livelora.trainer.prompt_kv import PROMPT_KV_MAX_BYTES, PromptKV, kv_bytes


@dataclass
class LossBatch:
    """A batch's tensors for one loss run.

    Attributes:
        data: the datums; ``inputs_D`` their ``loss_fn_inputs`` as tensors (the trainer-filled ``ref_logprobs``
            and ``kl_logratio`` are added to them); ``tokens_D`` their input ids; ``targets_D`` their targets.
        kl: the loss takes KTO's mismatched-pair log-ratios (against the reference).
        share: per datum, the prompt positions whose keys/values the KL pairs continue from (None: the pairs run
            whole: no KL, a datum without prompt, or keys/values over :data:`PROMPT_KV_MAX_BYTES`).
        grad_pos: per datum, the positions the loss does not multiply by exactly 0; ``keep``: the positions run
            through the head at all (None: every one).
        rows: this rank's datums in a group (None: alone); ``gather``: per-datum results of every rank, in order.
    """

    data: list[Datum]
    inputs_D: list[dict[str, Tensor]]
    tokens_D: list[list[int]]
    targets_D: list[Tensor]
    kl: bool
    share: list[int] | None
    grad_pos: list[Tensor]
    keep: list[Tensor] | None
    rows: range | None
    gather: Callable[[Any], list]

    @classmethod
    def of(cls, model: Any, data: list[Datum], spec: LossSpec, loss_positions_only: bool) -> LossBatch:
        """The tensors of ``data`` for ``spec`` on ``model``; ``loss_positions_only``: run only ``grad_pos``."""
        inputs_D = [datum_inputs(d) for d in data]
        tokens_D = [d.model_input.to_ints() for d in data]
        kl = "kl_logratio" in spec.trainer_inputs and spec.needs_reference  # the KL pairs' reference side too
        share = [int(torch.nonzero(x["weights"])[0]) for x in inputs_D] if kl else None
        config = model.peft_model.get_base_model().config
        if share and (min(share) < 1 or kv_bytes(config, len(data), max(map(len, tokens_D))) > PROMPT_KV_MAX_BYTES):
            share = None
        grad_pos = [grad_positions(spec, x) for x in inputs_D]
        group, n = model.group, len(data)
        rows = group.shard(n) if group is not None else None
        gather = (lambda xs: group.gather(n, list(xs))) if group is not None else (lambda xs: xs)
        keep = grad_pos if loss_positions_only else None  # the loss multiplies every other position by 0
        targets_D = [x["target_tokens"] for x in inputs_D]
        return cls(data, inputs_D, tokens_D, targets_D, kl, share, grad_pos, keep, rows, gather)

    def add_kl(self, logratios: Tensor) -> None:
        """Each datum's ``kl_logratio`` input from this rank's log-ratios (gathered over the group)."""
        for x, k in zip(self.inputs_D, self.gather(logratios)):
            x["kl_logratio"] = k.reshape(1)


def reference_pass(model: Any, b: LossBatch) -> tuple[list[Tensor], PromptKV | None]:
    """The base model's logprobs (adapter off; no gradient) as each datum's ``ref_logprobs``, the KL pairs'
    log-ratios when they run whole; returns them (gathered) and the prompts' keys/values ``b.share`` keeps."""
    lp = model.logprobs
    ref_D = lp(b.tokens_D, b.targets_D, adapter=False, share_prefix=b.share, keep_pos=b.keep, rows=b.rows)
    ref_kv = None
    if b.share:
        ref_D, ref_kv = ref_D
    ref_D = b.gather([r.detach() for r in ref_D])
    for x, r in zip(b.inputs_D, ref_D):
        x["ref_logprobs"] = r
    if b.kl and not b.share:
        b.add_kl(lp.kl_logratios(b.data, b.inputs_D, rows=b.rows))
    return ref_D, ref_kv


def policy_pass(model: Any, b: LossBatch, grad: bool, ref_kv: PromptKV | None) -> list[Tensor]:
    """The adapter's logprobs (with autograd when ``grad``), gathered; the KL pairs' log-ratios continuing from
    the prompts' keys/values when ``b.share``."""
    lp = model.logprobs
    lp_D = lp(
        b.tokens_D, b.targets_D, grad=grad, share_prefix=b.share, grad_pos=b.grad_pos, keep_pos=b.keep, rows=b.rows
    )
    if b.share:
        lp_D, policy_kv = lp_D
        b.add_kl(lp.kl_logratios(b.data, b.inputs_D, (policy_kv, ref_kv), b.rows))
    return b.gather(lp_D)


def backward(model: Any, b: LossBatch, loss: Tensor) -> None:
    """Accumulate ``loss``'s gradients into the LoRA parameters (zero ones when no position carries weight) and
    count the batch's datums and tokens."""
    loss = model.logprobs.tied(loss)  # sharded: every rank's backward runs through every layer
    if loss.requires_grad:
        step_yield()
        loss.backward()
    else:  # every position has weight exactly 0 (e.g. a GRPO group with equal rewards): zero gradient
        for p in model.lora_params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    model.data_counts["datums"] += len(b.data)
    model.data_counts["tokens"] += sum(len(t) for t in b.tokens_D)


def run_loss(
    model: Any, data: list[Datum], resolved: ResolvedLoss, grad: bool, loss_positions_only: bool = False
) -> ForwardBackwardOutput:
    """Per-datum ``logprobs`` (and ``ref_logprobs`` when the loss takes them; float32 [N_i], nats) and the
    loss's metrics of a validated batch; with ``grad`` the gradients accumulate (:func:`backward`)."""
    b = LossBatch.of(model, data, resolved.spec, loss_positions_only)
    ref_D, ref_kv = reference_pass(model, b) if resolved.spec.needs_reference else ([], None)
    lp_D = policy_pass(model, b, grad, ref_kv)
    with torch.set_grad_enabled(grad):  # inputs validated by the caller; the trainer-filled ones are built here
        out: LossOutput = LOSS_FUNCTIONS[resolved.spec.name](lp_D, b.inputs_D, resolved.config)
    if grad:
        backward(model, b, out.loss)
    outputs = []
    for i, lp in enumerate(lp_D):
        record = {"logprobs": TensorData.from_torch(lp.detach().float())}
        if ref_D:
            record["ref_logprobs"] = TensorData.from_torch(ref_D[i].float())
        outputs.append(record)
    n_tokens = float(sum(len(t) for t in b.tokens_D))
    metrics = {**out.metrics, "num_sequences:sum": float(len(data)), "num_tokens:sum": n_tokens}
    return ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs, metrics=metrics)
