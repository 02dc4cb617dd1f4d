"""The training model: a PEFT LoRA adapter over a base model, driven by Tinker-style operations.

:class:`TrainingModel` does ``forward`` (logprobs + loss, no grad), ``forward_backward`` (same; gradients
**accumulate** until ``optim_step``), ``optim_step`` (AdamW) and versioned saves and loads through
:class:`~livelora.adapters.store.AdapterStore`. Tinker's alignment: position ``i`` of ``model_input`` predicts
token ``i+1``. Every batch is checked by :func:`livelora.core.losses.validate_batch` before anything runs; the
loss's tensor function comes from :mod:`livelora.trainer.losses`; reference logprobs for ``kto``/``dpo`` are the
base model's (the adapter disabled). Padding, the LoRA targets, the reference model and the optimizer:
``docs/internals/training-sessions.md``.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
from torch import Tensor

from livelora.adapters.store import CONFIG_FILE, AdapterStore, Manifest
from livelora.clients.errors import BadRequestError
from livelora.clients.types.tinker import AdamParams, Datum, ForwardBackwardOutput, LoraConfig
from livelora.core.base_models import BaseModelRef, import_model_libraries, load_model
from livelora.core.losses import ResolvedLoss, validate_batch
from livelora.trainer.checkpoints import read_version, write_version
from livelora.trainer.distributed import TrainerGroup, current_group, mirrored
from livelora.trainer.logprobs import LogprobPass
from livelora.trainer.lora_peft import lora_config_of, wrap_lora
from livelora.trainer.loss_pass import run_loss
from livelora.trainer.shard_base import shard_base

ADAPTER = "default"
DEFAULT_ALPHA = 32.0
#: Spec inputs with ``source="trainer"`` that :meth:`TrainingModel._run` computes (reference logprobs with the
#: adapter disabled; KTO's mismatched-pair log-ratios). A spec naming another one needs code in trainer/loss_pass.py.
TRAINER_FILLED_INPUTS = frozenset({"ref_logprobs", "kl_logratio"})


class TrainingModel:
    """A LoRA-adapted causal LM with Tinker semantics (see the module docstring).

    Args:
        base_ref: the resolved base model.
        lora: rank, alpha (None = 32), seed (None = 0), which module groups to train.
        device: torch device (``"cpu"`` or ``"cuda"``).
        dtype: parameter dtype (float32 on CPU).
        max_seq_len: longest accepted ``model_input`` in tokens (default: the model's
            ``max_position_embeddings``).
        base_model: an already loaded base model to wrap (it is modified in place by peft).
        group: the trainer group that runs this model with this process (every rank builds the same model and
            makes the same calls; ``docs/scaling-out.md``); None: :func:`current_group` (None: this process alone).

    Raises:
        BadRequestError: a target module group the architecture does not have.
    """

    def __init__(
        self,
        base_ref: BaseModelRef,
        lora: LoraConfig | None = None,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_seq_len: int | None = None,
        base_model: Any = None,
        group: TrainerGroup | None = None,
    ):
        import_model_libraries()
        self.base_ref = base_ref
        self.lora = lora or LoraConfig()
        self.alpha = float(self.lora.alpha if self.lora.alpha is not None else DEFAULT_ALPHA)
        self.seed = int(self.lora.seed if self.lora.seed is not None else 0)
        self.device = torch.device(device)
        self.group: TrainerGroup | None = group if group is not None else current_group()  # None: alone
        load_on = "cpu" if self.group is not None and self.group.shard_base else device  # sharded below
        model = base_model if base_model is not None else load_model(base_ref, dtype=dtype, device=load_on)
        self.peft_model, self.peft_config = wrap_lora(
            model, self.lora, alpha=self.alpha, seed=self.seed, base_name=base_ref.name
        )
        self.peft_model.eval()  # no dropout anywhere; gradients still flow
        sharded = shard_base(self.peft_model, self.group)  # the base weights over the group's ranks, if it says so
        config = self.peft_model.base_model.model.config
        self.vocab_size = int(self.peft_model.get_input_embeddings().num_embeddings)
        self.max_seq_len = int(max_seq_len or getattr(config, "max_position_embeddings", 2048))
        self.pad_id = int(getattr(config, "pad_token_id", None) or 0)
        #: the batched logprob pass (padding, shared prompt prefixes, where the unembedding runs)
        self.logprobs = LogprobPass(self.peft_model, self.pad_id, self.device, self.max_seq_len, sharded=sharded)
        #: LoRA parameters in a fixed order, keyed by their standard PEFT file key (no adapter-name infix).
        self.lora_params: dict[str, torch.nn.Parameter] = {
            n.replace(f".{ADAPTER}.", "."): p for n, p in self.peft_model.named_parameters() if p.requires_grad
        }
        self.optimizer = self.new_optimizer()
        self.step = 0
        self.lineage: str | None = None
        self.parent: int | None = None
        self.data_counts: dict[str, int] = {"datums": 0, "tokens": 0}

    # ------------------------------------------------------------------------------------------ internals
    def new_optimizer(self) -> torch.optim.AdamW:
        """A fresh AdamW over the LoRA parameters (its hyperparameters are set by each :meth:`optim_step`)."""
        return torch.optim.AdamW(list(self.lora_params.values()), lr=0.0, foreach=False)

    @mirrored
    def _run(
        self,
        data: list[Datum],
        loss_fn: str,
        loss_fn_config: dict[str, Any] | None,
        grad: bool,
        loss_positions_only: bool = False,
    ) -> ForwardBackwardOutput:
        """Validate the batch (the gateway's check, again here) and run its loss (reference pass, policy pass,
        loss, backward with ``grad``: :func:`~livelora.trainer.loss_pass.run_loss`)."""
        resolved: ResolvedLoss = validate_batch(
            data, loss_fn, loss_fn_config, vocab_size=self.vocab_size, max_seq_len=self.max_seq_len
        )
        return run_loss(self, data, resolved, grad, loss_positions_only)

    # ------------------------------------------------------------------------------------------ operations
    def forward(
        self, data: list[Datum], loss_fn: str = "cross_entropy", loss_fn_config: dict[str, Any] | None = None
    ) -> ForwardBackwardOutput:
        """Per-datum target ``logprobs`` (float32 [N_i], nats) and the loss's metrics; no gradient, no state change.

        Raises:
            BadRequestError: the batch is invalid (see :func:`livelora.core.losses.validate_batch`).
        """
        return self._run(data, loss_fn, loss_fn_config, grad=False)

    def forward_backward(
        self,
        data: list[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, Any] | None = None,
        *,
        loss_positions_only: bool = False,
    ) -> ForwardBackwardOutput:
        """Like :meth:`forward`, then backpropagate the loss; gradients add up across calls until
        :meth:`optim_step` (two calls on halves of a batch = one call on the whole batch for sum losses).
        ``loss_positions_only``: the returned logprobs are 0 wherever the loss multiplies them by exactly 0
        (e.g. prompt positions), which saves the unembedding there; loss and gradients are the same.

        Raises:
            BadRequestError: the batch is invalid; grads, optimizer and step are then unchanged.
        """
        return self._run(data, loss_fn, loss_fn_config, grad=True, loss_positions_only=loss_positions_only)

    def has_gradients(self) -> bool:
        """Whether any gradient has been accumulated since the last optimizer step."""
        return any(p.grad is not None for p in self.lora_params.values())

    @mirrored
    def optim_step(self, params: AdamParams | None = None) -> dict[str, float]:
        """Apply one AdamW step with the accumulated gradients, then zero them.

        Returns:
            ``{"grad_norm:mean"`` (global L2 norm before clipping), ``"update_norm:mean"`` (L2 norm of the
            parameter change), ``"learning_rate:mean"``, ``"step:max"`` (steps taken, after this one)}.

        Raises:
            BadRequestError: no gradients were accumulated (call forward_backward first); nothing changes.
        """
        params = params or AdamParams()
        if not self.has_gradients():
            raise BadRequestError(
                "optim_step: no gradients accumulated since the last step; call forward_backward first",
                param="adam_params",
            )
        plist = list(self.lora_params.values())
        for group in self.optimizer.param_groups:
            group.update(
                lr=params.learning_rate,
                betas=(params.beta1, params.beta2),
                eps=params.eps,
                weight_decay=params.weight_decay,
            )
        if self.group is not None:  # the whole batch's gradient: the sum of the ranks' (trainer/distributed.py)
            self.group.all_reduce_grads(plist)
        grads = [p.grad for p in plist if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if params.grad_clip_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(plist, params.grad_clip_norm, grad_norm)
        before = [p.detach().clone() for p in plist]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        update = math.sqrt(sum(float((p.detach() - b).double().pow(2).sum()) for p, b in zip(plist, before)))
        self.step += 1
        return {
            "grad_norm:mean": float(grad_norm),
            "update_norm:mean": update,
            "learning_rate:mean": params.learning_rate,
            "step:max": float(self.step),
        }

    def zero_grad(self) -> None:
        """Drop accumulated gradients."""
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------------------------------ checkpoints
    def adapter_state(self) -> dict[str, Tensor]:
        """LoRA tensors under their standard PEFT file keys (``base_model.model.<module>.lora_A.weight``)."""
        return {k: p.detach().to("cpu", copy=True).contiguous() for k, p in self.lora_params.items()}

    def save_weights(
        self,
        store: AdapterStore,
        lineage: str,
        *,
        metrics: dict[str, float] | None = None,
        with_optimizer: bool = False,
        gate: dict[str, Any] | None = None,
        base_model_name_or_path: str | None = None,
    ) -> Manifest:
        """Write the adapter as a new immutable version of ``lineage`` (PEFT format, loadable by
        ``PeftModel.from_pretrained`` and vLLM). With ``with_optimizer`` also ``optimizer.pt`` and
        ``trainer_state.json`` (step, RNG state), which :meth:`load_state` restores bit for bit. ``gate``: the
        evaluation gate's result for the manifest (:class:`livelora.core.rails.GateResult` as a dict).
        ``base_model_name_or_path``: the base named in ``adapter_config.json`` (default: the base model's name).
        (:func:`livelora.trainer.checkpoints.write_version`.)

        Raises:
            BadRequestError: invalid lineage name.
        """
        return write_version(
            self,
            store,
            lineage,
            metrics=metrics,
            with_optimizer=with_optimizer,
            gate=gate,
            base_model_name_or_path=base_model_name_or_path,
        )

    def save_state(
        self,
        store: AdapterStore,
        lineage: str,
        *,
        metrics: dict[str, float] | None = None,
        gate: dict[str, Any] | None = None,
    ) -> Manifest:
        """:meth:`save_weights` plus optimizer state, step and RNG state (Tinker ``save_state``)."""
        return self.save_weights(store, lineage, metrics=metrics, with_optimizer=True, gate=gate)

    def load_state(self, store: AdapterStore, lineage: str, version: int, *, with_optimizer: bool) -> Manifest:
        """Load a version's LoRA weights (and, with ``with_optimizer``, its AdamW state, step and RNG state).

        Everything is read and checked before the model changes: sha256, base model, rank/alpha/targets,
        tensor keys and shapes, optimizer state structure. Without the optimizer the optimizer is fresh
        and gradients are dropped; the step counter is the version's.
        (:func:`livelora.trainer.checkpoints.read_version`.)

        Raises:
            NotFoundError: no such version, or ``with_optimizer`` on a version saved without optimizer state.
            BadRequestError: checksum mismatch or an adapter that does not fit this model.
        """
        return read_version(self, store, lineage, version, with_optimizer=with_optimizer)

    @classmethod
    def from_version(
        cls,
        base_ref: BaseModelRef,
        store: AdapterStore,
        lineage: str,
        version: int,
        *,
        with_optimizer: bool,
        device: str = "cpu",
        **kw: Any,
    ) -> TrainingModel:
        """A new model shaped like a stored version (rank, alpha, targets), with its state loaded."""
        manifest = store.get(lineage, version)
        lora = lora_config_of(json.loads((store.version_dir(lineage, version) / CONFIG_FILE).read_text()))
        model = cls(base_ref, lora, device=device, **kw)
        model.load_state(store, lineage, manifest.version, with_optimizer=with_optimizer)
        return model
