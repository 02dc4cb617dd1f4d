"""The batched logprob pass of a training model (:class:`LogprobPass`): target logprobs of right-padded
sequences through a PEFT model, a prompt prefix every row shares run once, the unembedding with autograd only
where the loss needs gradients; and KTO's mismatched-pair log-ratios (:meth:`LogprobPass.kl_logratios`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from livelora.clients.types.tinker import Datum
from livelora.core.cpu_share import step_yield
from livelora.core.losses import LossSpec
from livelora.trainer.prompt_kv import PROMPT_KV_MAX_BYTES, PromptKV, cache_of, common_prefix, kl_pairs, kv_bytes

#: Causal-LM classes whose logits are exactly ``lm_head(model(...).last_hidden_state)``.
PLAIN_HEAD_CLASSES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})


def grad_positions(spec: LossSpec, x: dict[str, Tensor]) -> Tensor:
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


def datum_inputs(datum: Datum) -> dict[str, Tensor]:
    """A datum's ``loss_fn_inputs`` as torch tensors."""
    return {k: v.to_torch() for k, v in datum.loss_fn_inputs.items()}


def select_rows(rows: range | None, *per_sequence: list | None) -> tuple[list | None, ...]:
    """Each per-sequence list restricted to ``rows`` (a trainer group rank's slice; ``None`` lists stay None,
    ``rows`` None keeps them whole)."""
    if rows is None:
        return per_sequence
    return tuple(None if xs is None else [xs[i] for i in rows] for xs in per_sequence)


@dataclass
class PaddedBatch:
    """Sequences right-padded to the whole batch's width T, with their masks.

    Attributes:
        lengths: per sequence, its N_b.
        ids_B_T: input ids (pad: ``pad_id``); ``tgt_B_T_K``: target ids (K = the widest target, 0 beyond).
        valid_B_T: the sequences' own positions; ``grad_B_T``: kept positions whose logprob can carry gradient;
            ``rest_B_T``: kept positions without.
        padded: a sequence of the whole batch is shorter than T (the decoder needs an attention mask).
    """

    lengths: list[int]
    ids_B_T: Tensor
    tgt_B_T_K: Tensor
    valid_B_T: Tensor
    grad_B_T: Tensor
    rest_B_T: Tensor
    padded: bool

    @classmethod
    def of(
        cls,
        inputs: list[list[int]],
        targets: list[Tensor],
        grad_pos: list[Tensor] | None,
        keep_pos: list[Tensor] | None,
        whole: list[list[int]],
        pad_id: int,
    ) -> PaddedBatch:
        """Pad ``inputs`` (a slice of ``whole``, or all of it) to ``whole``'s longest sequence."""
        b_n, t_max = len(inputs), max(len(x) for x in whole)
        k_max = max(1 if t.ndim == 1 else t.shape[1] for t in targets)
        ids_B_T = torch.full((b_n, t_max), pad_id, dtype=torch.long)
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
        padded = any(len(x) != t_max for x in whole)
        lengths = [len(x) for x in inputs]
        return cls(lengths, ids_B_T, tgt_B_T_K, valid_B_T, grad_B_T, keep_B_T & ~grad_B_T, padded)


def unpack(lp_B_T_K: Tensor, lengths: list[int], targets: list[Tensor]) -> list[Tensor]:
    """Per sequence, its logprobs shaped like its targets ((N_b,) or (N_b, K_b)) out of the padded (B, T, K)."""
    out = []
    for b, (n, t) in enumerate(zip(lengths, targets)):
        lp = lp_B_T_K[b, :n]
        out.append(lp[:, 0] if t.ndim == 1 else lp[:, : t.shape[1]])
    return out


class LogprobPass:
    """Runs ``peft_model`` (its adapter on or off) over batches of token ids.

    Args:
        peft_model: the PEFT-wrapped causal LM.
        pad_id: token id right padding uses (masked out).
        device: torch device of the model.
        max_seq_len: longest sequence of a KL pair (tokens).
        sharded: the base weights are sharded over a trainer group (:mod:`livelora.trainer.shard_base`): every
            rank then makes every pass (a rank with no rows runs the batch's first datum and returns nothing), the
            head runs inside the model's forward, and a pass with ``grad`` leaves :attr:`tie`.
    """

    def __init__(self, peft_model: Any, pad_id: int, device: torch.device, max_seq_len: int, sharded: bool = False):
        self.peft_model = peft_model
        self.sharded = sharded
        #: after a sharded pass with ``grad``: 0 × the sum of its logits, which the caller adds to its loss so
        #: that every rank's backward reaches every layer (each layer's backward is a collective)
        self.tie: Tensor | None = None
        self.pad_id = pad_id
        self.device = device
        self.max_seq_len = max_seq_len
        causal_lm = peft_model.get_base_model()
        config = causal_lm.config
        #: Decoder + unembedding can be run separately (no logit scaling or soft-capping in these classes).
        self.plain_head = (
            not sharded
            and type(causal_lm).__name__ in PLAIN_HEAD_CLASSES
            and hasattr(causal_lm, "model")
            and not any(getattr(config, a, None) for a in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
        )

    def __call__(
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
        rows: range | None = None,
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
            rows: run only these sequences (a trainer group rank's slice; the other arguments still describe the
                whole batch, ``prefix_kv`` excepted, which holds these rows): the padded width, the attention mask
                and the shared prefix are the whole batch's, so each row's logprobs equal a one-process pass over
                the whole batch, mostly bit for bit (``docs/scaling-out.md``). No rows: nothing runs.

        Returns:
            per sequence, logprobs shaped like its targets; with ``share_prefix``, ``(logprobs, PromptKV)``.
        """
        step_yield()  # serving may go first between the passes of a step (core/cpu_share.py)
        whole, dummy = inputs, self.sharded and rows is not None and not rows
        rows = range(0, 1) if dummy else rows
        inputs, targets, grad_pos, keep_pos, share_prefix = select_rows(
            rows, inputs, targets, grad_pos, keep_pos, share_prefix
        )
        if rows is not None and not rows:
            return ([], None) if share_prefix is not None else []
        batch = PaddedBatch.of(inputs, targets, grad_pos, keep_pos, whole, self.pad_id)
        c, kw = self._prefix(whole, batch, share_prefix, prefix_kv)
        ctx = contextlib.nullcontext() if adapter else self.peft_model.disable_adapter()
        with ctx, torch.set_grad_enabled(grad):
            hidden_B_T_H, kv = self._decode(batch, c, kw, share_prefix)
            lp_B_T_K = self._head_logprobs(hidden_B_T_H, batch)
        if grad and self.sharded:
            self.tie = hidden_B_T_H.sum() * 0.0
        out = [] if dummy else unpack(lp_B_T_K, batch.lengths, targets)
        return (out, kv) if share_prefix is not None else out

    def _prefix(
        self, whole: list[list[int]], batch: PaddedBatch, share_prefix: list[int] | None, prefix_kv: PromptKV | None
    ) -> tuple[int, dict[str, Any] | None]:
        """``(c, kwargs)``: a prefix of ``c`` tokens every row shares runs once at batch 1 and the rows continue
        from its keys/values (prompt_kv.py; ``kwargs`` None, :meth:`_decode` builds them); ``c`` = 0: the
        decoder's keyword arguments (``prefix_kv``'s continuation, or the attention mask of a padded batch)."""
        config, width = self.peft_model.get_base_model().config, batch.ids_B_T.shape[1]
        if prefix_kv is not None:
            return 0, prefix_kv.continuation(batch.lengths, self.device, config, width=width)
        c = common_prefix(whole) if kv_bytes(config, len(whole), width) <= PROMPT_KV_MAX_BYTES else 0
        if c:
            return c, None
        mask = batch.valid_B_T.long().to(self.device) if batch.padded else None
        return 0, {"use_cache": share_prefix is not None, "attention_mask": mask}

    def _decode(
        self, batch: PaddedBatch, c: int, kw: dict[str, Any] | None, share_prefix: list[int] | None
    ) -> tuple[Tensor, PromptKV | None]:
        """The forward (decoder only when :attr:`plain_head`, else the whole model with its logits) over the
        padded batch, the shared prefix of ``c`` tokens first (:meth:`_prefix`).

        Returns:
            ``(hidden_B_T_H, kv)``: the last hidden states (B, T, H) (logits (B, T, V) without a plain head),
            and the keys/values ``share_prefix`` asks to keep (None without it).
        """
        causal_lm, dev = self.peft_model.get_base_model(), self.device
        decoder = causal_lm.model if self.plain_head else self.peft_model
        b_n, width = batch.ids_B_T.shape
        if c:
            pre = decoder(input_ids=batch.ids_B_T[:1, :c].to(dev), use_cache=True)
            kw = (
                PromptKV.capture(cache_of(pre), [c], detach=False)
                .expand(b_n)
                .continuation([n - c for n in batch.lengths], dev, causal_lm.config, width=width - c)
            )
        res = decoder(input_ids=batch.ids_B_T[:, c:].to(dev), **kw)
        hidden_B_T_H = res.last_hidden_state if self.plain_head else res.logits
        if c:
            first = pre.last_hidden_state if self.plain_head else pre.logits
            hidden_B_T_H = torch.cat([first.expand(b_n, -1, -1), hidden_B_T_H], 1)
        kv = PromptKV.capture(cache_of(res), share_prefix) if share_prefix is not None else None
        return hidden_B_T_H, kv

    def _head_logprobs(self, hidden_B_T_H: Tensor, batch: PaddedBatch) -> Tensor:
        """Float32 (B, T, K) target logprobs: the head with autograd at ``grad_B_T``, without at ``rest_B_T``,
        0 elsewhere."""
        dev = self.device
        head = self.peft_model.get_base_model().get_output_embeddings() if self.plain_head else torch.nn.Identity()
        tgt_B_T_K = batch.tgt_B_T_K.to(dev)

        def head_logprobs(sel_B_T: Tensor) -> Tensor:
            sel = sel_B_T.to(dev)
            logits_M_V = head(hidden_B_T_H[sel]).float()
            return logits_M_V.gather(-1, tgt_B_T_K[sel]) - torch.logsumexp(logits_M_V, -1, keepdim=True)

        lp_B_T_K = torch.zeros(tgt_B_T_K.shape, dtype=torch.float32, device=dev)
        if bool(batch.grad_B_T.any()):
            lp_B_T_K = lp_B_T_K.index_put((batch.grad_B_T.to(dev),), head_logprobs(batch.grad_B_T))
        if bool(batch.rest_B_T.any()):
            with torch.no_grad():
                rest_M_K = head_logprobs(batch.rest_B_T)
            lp_B_T_K = lp_B_T_K.index_put((batch.rest_B_T.to(dev),), rest_M_K)
        return lp_B_T_K

    def tied(self, loss: Tensor) -> Tensor:
        """``loss`` plus :attr:`tie` (then cleared), or ``loss`` as it is when there is none."""
        tie, self.tie = self.tie, None
        return loss if tie is None else loss + tie

    def kl_logratios(
        self,
        data: list[Datum],
        inputs_D: list[dict[str, Tensor]],
        kv: tuple[PromptKV, PromptKV] | None = None,
        rows: range | None = None,
    ) -> Tensor:
        """KTO's mismatched-pair log-ratios ``Σ_completion(lp − lp_ref)`` of ``(x_i, y_perm(i))`` (no grad;
        pairs from :func:`~livelora.trainer.prompt_kv.kl_pairs`). ``kv``: the (policy, reference) keys/values of
        the matched pairs' prompts; the pairs then run from each prompt's last token on. ``rows``: only the pairs
        ``i in rows`` (a trainer group rank's slice; ``kv`` then holds those rows' prompts)."""
        ins, tgts, keep = kl_pairs(data, inputs_D, self.max_seq_len, shared=kv is not None)
        if rows is not None and not rows and not self.sharded:
            return torch.zeros(0)
        policy = self(ins, tgts, adapter=True, keep_pos=keep, prefix_kv=kv[0] if kv else None, rows=rows)
        ref = self(ins, tgts, adapter=False, keep_pos=keep, prefix_kv=kv[1] if kv else None, rows=rows)
        if not policy:  # a sharded rank with no rows made the passes for the others
            return torch.zeros(0)
        return torch.stack([(p - r).sum() for p, r in zip(policy, ref)])
