"""The training model: a PEFT LoRA adapter over a base model, driven by Tinker-style operations.

``TrainingModel`` does ``forward`` (logprobs + loss, no grad), ``forward_backward``
(same, gradients **accumulate** across calls until ``optim_step``), ``optim_step``
(AdamW) and versioned saves/loads through :class:`~livelora.adapters.store.AdapterStore`.

Conventions (Tinker, ``shared/reference/tinker_protocol.md`` §3): position ``i`` of
``model_input`` predicts token ``i+1``; every per-token ``loss_fn_inputs`` tensor has
shape ``(N,)``; ``target_tokens[i]`` is the token after input ``i``. A batch is
right-padded with an attention mask; padded positions are sliced away before the
loss, so they contribute exactly nothing. Every batch is checked by the shared
:func:`livelora.core.losses.validate_batch` (the gateway's check) before anything runs; the loss's
spec says which positions need gradients and which inputs the trainer adds, and the tensor function comes
from :mod:`livelora.trainer.losses` (token losses are sums; KTO/DPO means over examples).

LoRA: rank ``r``, ``alpha`` (scale ``alpha/r``), dropout 0, peft's default init
(``lora_A`` Kaiming-uniform from ``seed``, ``lora_B`` = 0, so a fresh adapter equals the
base model). Targets: attention ``q,k,v,o_proj``, MLP ``gate,up,down_proj`` and the
unembedding ``lm_head``. SmolLM2 ties ``lm_head`` to ``embed_tokens``: the LoRA on
``lm_head`` changes only the output projection (the input embedding lookup is untouched);
:mod:`livelora.adapters.export` unties the two before merging.

Reference logprobs for ``kto``/``dpo`` come from the same weights with the adapter
disabled (``peft_model.disable_adapter()``, no grad), i.e. the base model (TRL's choice for
a LoRA policy; losses.md §1). Optimizer: ``torch.optim.AdamW`` (decoupled weight decay:
``p ← p·(1 − lr·wd)`` before the Adam update), hyperparameters taken from each
``optim_step``'s :class:`AdamParams`.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from typing import Any

import torch
from torch import Tensor

from livelora.adapters.store import CONFIG_FILE, AdapterStore, Manifest
from livelora.clients.errors import BadRequestError
from livelora.clients.types.tinker import AdamParams, Datum, ForwardBackwardOutput, LoraConfig, TensorData
from livelora.core.base_models import MODEL_BUILD_LOCK, BaseModelRef, import_model_libraries, load_model
from livelora.core.core_share import step_yield
from livelora.core.losses import LossSpec, ResolvedLoss, validate_batch
from livelora.trainer.checkpoints import read_version, write_version
from livelora.trainer.losses import LOSS_FUNCTIONS, LossOutput
from livelora.trainer.prompt_kv import PROMPT_KV_MAX_BYTES, PromptKV, cache_of, common_prefix, kl_pairs, kv_bytes

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
ADAPTER = "default"
#: Causal-LM classes whose logits are exactly ``lm_head(model(...).last_hidden_state)``.
PLAIN_HEAD_CLASSES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
DEFAULT_ALPHA = 32.0
#: Spec inputs with ``source="trainer"`` that :meth:`TrainingModel._run` computes (reference logprobs with the
#: adapter disabled; KTO's mismatched-pair log-ratios). A spec naming another one needs code here.
TRAINER_FILLED_INPUTS = frozenset({"ref_logprobs", "kl_logratio"})


def target_modules(lora: LoraConfig) -> list[str]:
    """Module names LoRA wraps for a :class:`LoraConfig` (attention, MLP, unembedding)."""
    return [
        *(ATTN_MODULES if lora.train_attn else ()),
        *(MLP_MODULES if lora.train_mlp else ()),
        *(UNEMBED_MODULES if lora.train_unembed else ()),
    ]


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
    ):
        import_model_libraries()
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        self.base_ref = base_ref
        self.lora = lora or LoraConfig()
        self.alpha = float(self.lora.alpha if self.lora.alpha is not None else DEFAULT_ALPHA)
        self.seed = int(self.lora.seed if self.lora.seed is not None else 0)
        self.device = torch.device(device)
        model = base_model if base_model is not None else load_model(base_ref, dtype=dtype, device=device)
        names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        targets = target_modules(self.lora)
        absent = [t for t in targets if t not in names]
        if absent:
            raise BadRequestError(
                f"base model {base_ref.name} has no linear modules named {absent}; "
                "turn off the corresponding train_* flag",
                param="lora_config",
            )
        self.peft_config = PeftLoraConfig(
            r=self.lora.rank,
            lora_alpha=self.alpha,
            lora_dropout=0.0,
            target_modules=targets,
            bias="none",
            task_type="CAUSAL_LM",
        )
        with MODEL_BUILD_LOCK, torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")  # handled, see module doc
            warnings.filterwarnings("ignore", message=".*tied layer.*")
            torch.manual_seed(self.seed)
            self.peft_model = get_peft_model(model, self.peft_config)
        self.peft_model.eval()  # no dropout anywhere; gradients still flow
        config = self.peft_model.base_model.model.config
        self.vocab_size = int(self.peft_model.get_input_embeddings().num_embeddings)
        self.max_seq_len = int(max_seq_len or getattr(config, "max_position_embeddings", 2048))
        self.pad_id = int(getattr(config, "pad_token_id", None) or 0)
        causal_lm = self.peft_model.get_base_model()
        #: Decoder + unembedding can be run separately (no logit scaling or soft-capping in these classes).
        self._plain_head = (
            type(causal_lm).__name__ in PLAIN_HEAD_CLASSES
            and hasattr(causal_lm, "model")
            and not any(getattr(config, a, None) for a in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
        )
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

    def _logprobs(
        self,
        inputs: list[list[int]],
        targets: list[Tensor],
        *,
        adapter: bool = True,
        grad: bool = False,
        grad_pos: list[Tensor] | None = None,
        keep_pos: list[Tensor] | None = None,
        share_prefix: list[int] | None = None,
        prefix_kv: PromptKV | None = None,
    ) -> Any:
        """Target logprobs of right-padded sequences (nats).

        Args:
            inputs: per sequence, its N_b input token ids.
            targets: per sequence, (N_b,) or (N_b, K) target ids.
            adapter: False runs the base model (``disable_adapter``).
            grad: build the autograd graph (only through ``grad_pos`` positions when given).
            grad_pos: per sequence, bool (N_b,): positions whose logprob can carry gradient (the loss
                multiplies every other position by exactly 0). The unembedding of the remaining positions
                runs without autograd, which saves its backward; values are identical either way.
            keep_pos: per sequence, bool (N_b,): positions needed at all; others are returned as 0.
            share_prefix: per sequence, how many leading positions' keys/values to keep
                (:meth:`PromptKV.capture <livelora.trainer.prompt_kv.PromptKV.capture>`).
            prefix_kv: continue from these keys/values: ``inputs[b]`` follows the first ``prefix_kv.prefix[b]``
                positions of row ``b`` of the pass that captured them. Without it, a prefix of 16+ tokens that
                every sequence shares (:func:`~livelora.trainer.prompt_kv.common_prefix`) runs once.

        Returns:
            per sequence, logprobs shaped like its targets; with ``share_prefix``, ``(logprobs, PromptKV)``.
        """
        step_yield()  # serving may go first between the passes of a step (core/core_share.py)
        lengths = [len(x) for x in inputs]
        b_n, t_max = len(inputs), max(lengths)
        k_max = max(1 if t.ndim == 1 else t.shape[1] for t in targets)
        ids_B_T = torch.full((b_n, t_max), self.pad_id, dtype=torch.long)
        tgt_B_T_K = torch.zeros((b_n, t_max, k_max), dtype=torch.long)
        valid_B_T = torch.zeros((b_n, t_max), dtype=torch.bool)
        grad_B_T = torch.zeros((b_n, t_max), dtype=torch.bool)
        keep_B_T = torch.zeros((b_n, t_max), dtype=torch.bool)
        for b, (x, t) in enumerate(zip(inputs, targets)):
            n = len(x)
            ids_B_T[b, :n] = torch.tensor(x, dtype=torch.long)
            tgt = t.reshape(n, -1)
            tgt_B_T_K[b, :n, : tgt.shape[1]] = tgt
            valid_B_T[b, :n] = True
            keep_B_T[b, :n] = True if keep_pos is None else keep_pos[b]
            grad_B_T[b, :n] = True if grad_pos is None else grad_pos[b]
        grad_B_T &= keep_B_T
        rest_B_T = keep_B_T & ~grad_B_T
        padded = any(n != t_max for n in lengths)
        dev = self.device
        causal_lm = self.peft_model.get_base_model()
        ctx = contextlib.nullcontext() if adapter else self.peft_model.disable_adapter()
        # a prefix every row shares runs once at batch 1, the rows continue from its keys/values (prompt_kv.py)
        c = (
            common_prefix(inputs)
            if prefix_kv is None and kv_bytes(causal_lm.config, b_n, t_max) <= PROMPT_KV_MAX_BYTES
            else 0
        )
        if prefix_kv is not None:
            kw = prefix_kv.continuation(lengths, dev, causal_lm.config)
        elif not c:
            kw = {"use_cache": share_prefix is not None, "attention_mask": valid_B_T.long().to(dev) if padded else None}
        # models with logit scaling / soft-capping use their own forward (logits), the others decoder + head
        decoder = causal_lm.model if self._plain_head else self.peft_model
        head = causal_lm.get_output_embeddings() if self._plain_head else torch.nn.Identity()
        with ctx, torch.set_grad_enabled(grad):
            if c:
                pre = decoder(input_ids=ids_B_T[:1, :c].to(dev), use_cache=True)
                kw = (
                    PromptKV.capture(cache_of(pre), [c], detach=False)
                    .expand(b_n)
                    .continuation([n - c for n in lengths], dev, causal_lm.config)
                )
            res = decoder(input_ids=ids_B_T[:, c:].to(dev), **kw)
            hidden_B_T_H = res.last_hidden_state if self._plain_head else res.logits
            if c:
                first = pre.last_hidden_state if self._plain_head else pre.logits
                hidden_B_T_H = torch.cat([first.expand(b_n, -1, -1), hidden_B_T_H], 1)
            kv = PromptKV.capture(cache_of(res), share_prefix) if share_prefix is not None else None
            tgt_B_T_K = tgt_B_T_K.to(dev)

            def head_logprobs(sel_B_T: Tensor) -> Tensor:
                sel = sel_B_T.to(dev)
                logits_M_V = head(hidden_B_T_H[sel]).float()
                return logits_M_V.gather(-1, tgt_B_T_K[sel]) - torch.logsumexp(logits_M_V, -1, keepdim=True)

            lp_B_T_K = torch.zeros((b_n, t_max, k_max), dtype=torch.float32, device=dev)
            if bool(grad_B_T.any()):
                lp_B_T_K = lp_B_T_K.index_put((grad_B_T.to(dev),), head_logprobs(grad_B_T))
            if bool(rest_B_T.any()):
                with torch.no_grad():
                    rest_M_K = head_logprobs(rest_B_T)
                lp_B_T_K = lp_B_T_K.index_put((rest_B_T.to(dev),), rest_M_K)
        out = []
        for b, (n, t) in enumerate(zip(lengths, targets)):
            lp = lp_B_T_K[b, :n]
            out.append(lp[:, 0] if t.ndim == 1 else lp[:, : t.shape[1]])
        return (out, kv) if share_prefix is not None else out

    @staticmethod
    def _grad_positions(spec: LossSpec, x: dict[str, Tensor]) -> Tensor:
        """Bool (N,): positions whose logprob the loss does not multiply by exactly 0 (``spec.gradient``)."""
        rule = spec.gradient
        if rule.nonzero is None:
            pos = torch.ones(x["target_tokens"].shape[0], dtype=torch.bool)
        else:
            v = x[rule.nonzero]
            pos = (v != 0) if v.ndim == 1 else (v != 0).any(-1)
        for mask in rule.masks:
            if mask in x:
                pos = pos & (x[mask] != 0)
        return pos

    @staticmethod
    def _inputs(datum: Datum) -> dict[str, Tensor]:
        return {k: v.to_torch() for k, v in datum.loss_fn_inputs.items()}

    def _kl_logratios(
        self, data: list[Datum], inputs_D: list[dict[str, Tensor]], kv: tuple[PromptKV, PromptKV] | None = None
    ) -> Tensor:
        """KTO's mismatched-pair log-ratios ``Σ_completion(lp − lp_ref)`` of ``(x_i, y_perm(i))`` (no grad;
        pairs from :func:`~livelora.trainer.prompt_kv.kl_pairs`). ``kv``: the (policy, reference) keys/values of
        the matched pairs' prompts; the pairs then run from each prompt's last token on."""
        ins, tgts, keep = kl_pairs(data, inputs_D, self.max_seq_len, shared=kv is not None)
        policy = self._logprobs(ins, tgts, adapter=True, keep_pos=keep, prefix_kv=kv[0] if kv else None)
        ref = self._logprobs(ins, tgts, adapter=False, keep_pos=keep, prefix_kv=kv[1] if kv else None)
        return torch.stack([(p - r).sum() for p, r in zip(policy, ref)])

    def _run(
        self,
        data: list[Datum],
        loss_fn: str,
        loss_fn_config: dict[str, Any] | None,
        grad: bool,
        loss_positions_only: bool = False,
    ) -> ForwardBackwardOutput:
        resolved: ResolvedLoss = validate_batch(
            data, loss_fn, loss_fn_config, vocab_size=self.vocab_size, max_seq_len=self.max_seq_len
        )  # the gateway's check, again here
        spec = resolved.spec
        inputs_D = [self._inputs(d) for d in data]
        tokens_D = [d.model_input.to_ints() for d in data]
        targets_D = [x["target_tokens"] for x in inputs_D]
        kl = "kl_logratio" in spec.trainer_inputs and spec.needs_reference  # the KL pairs' reference side too
        # KL pairs continue from the matched pairs' prompt keys/values when they fit (prompt_kv.py)
        share = [int(torch.nonzero(x["weights"])[0]) for x in inputs_D] if kl else None
        if share and (
            min(share) < 1
            or kv_bytes(self.peft_model.get_base_model().config, len(data), max(map(len, tokens_D)))
            > PROMPT_KV_MAX_BYTES
        ):
            share = None
        grad_pos = [self._grad_positions(spec, x) for x in inputs_D]
        keep = grad_pos if loss_positions_only else None  # the loss multiplies every other position by 0
        ref_D: list[Tensor] = []
        if spec.needs_reference:
            ref_D = self._logprobs(tokens_D, targets_D, adapter=False, share_prefix=share, keep_pos=keep)
            if share:
                ref_D, ref_kv = ref_D
            ref_D = [r.detach() for r in ref_D]
            for x, r in zip(inputs_D, ref_D):
                x["ref_logprobs"] = r
            if kl and not share:
                for x, k in zip(inputs_D, self._kl_logratios(data, inputs_D)):
                    x["kl_logratio"] = k.reshape(1)
        lp_D = self._logprobs(tokens_D, targets_D, grad=grad, share_prefix=share, grad_pos=grad_pos, keep_pos=keep)
        if share:
            lp_D, policy_kv = lp_D
            for x, k in zip(inputs_D, self._kl_logratios(data, inputs_D, (policy_kv, ref_kv))):
                x["kl_logratio"] = k.reshape(1)
        with torch.set_grad_enabled(grad):  # inputs validated above; the trainer-filled ones are built here
            out: LossOutput = LOSS_FUNCTIONS[spec.name](lp_D, inputs_D, resolved.config)
        if grad:
            if out.loss.requires_grad:
                step_yield()
                out.loss.backward()
            else:  # every position has weight exactly 0 (e.g. a GRPO group with equal rewards): zero gradient
                for p in self.lora_params.values():
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
            self.data_counts["datums"] += len(data)
            self.data_counts["tokens"] += sum(len(t) for t in tokens_D)
        outputs = []
        for i, lp in enumerate(lp_D):
            record = {"logprobs": TensorData.from_torch(lp.detach().float())}
            if ref_D:
                record["ref_logprobs"] = TensorData.from_torch(ref_D[i].float())
            outputs.append(record)
        metrics = {
            **out.metrics,
            "num_sequences:sum": float(len(data)),
            "num_tokens:sum": float(sum(len(t) for t in tokens_D)),
        }
        return ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs, metrics=metrics)

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
        cfg = json.loads((store.version_dir(lineage, version) / CONFIG_FILE).read_text())
        targets = set(cfg.get("target_modules") or [])
        lora = LoraConfig(
            rank=int(cfg["r"]),
            alpha=float(cfg["lora_alpha"]),
            train_attn=bool(targets & set(ATTN_MODULES)),
            train_mlp=bool(targets & set(MLP_MODULES)),
            train_unembed=bool(targets & set(UNEMBED_MODULES)),
        )
        model = cls(base_ref, lora, device=device, **kw)
        model.load_state(store, lineage, manifest.version, with_optimizer=with_optimizer)
        return model
