"""Prompt key/value reuse between sequences that start with the same tokens.

With a causal decoder the keys and values (K/V) of a sequence's first positions depend only on those tokens, so
sequences that start alike run their common start once: :meth:`PromptKV.capture` takes the K/V from one pass and
:meth:`PromptKV.continuation` runs the rest of each sequence from them at its true positions (RoPE
``position_ids`` = prefix length + offset); values equal a full pass within 2e-4 nats (``tests/test_prompt_kv.py``).
Uses: KTO's mismatched KL pairs (:func:`kl_pairs`; Ethayarajh et al. 2024, arXiv 2402.01306, §4.1), whose prompts
already ran for the matched pairs, so each pair runs only its completion; a prefix the whole batch shares
(:func:`common_prefix`, run once at batch 1 and expanded with :meth:`PromptKV.expand`, captured with
``detach=False`` so gradients flow back through it once); and the evaluation gate's probes, which share their
template and system message.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from livelora.trainer.losses import kl_pair_order

#: Largest K/V a full pass may keep to share its prompt (bytes); a larger batch recomputes the prompts instead.
PROMPT_KV_MAX_BYTES = 1 << 30
#: Fewest leading tokens that every sequence of a batch must share for the batch to run them once
#: (:func:`common_prefix`); shorter shared prefixes save less than the extra pass costs.
MIN_COMMON_PREFIX = 16


def kv_bytes(config: Any, batch: int, tokens: int, itemsize: int = 4) -> int:
    """Bytes of the keys and values of ``batch`` sequences of ``tokens`` positions for a decoder ``config``
    (``num_hidden_layers`` × 2 × batch × ``num_key_value_heads`` × tokens × head dim × ``itemsize``)."""
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return int(config.num_hidden_layers) * 2 * batch * kv_heads * tokens * head_dim * itemsize


@dataclass
class PromptKV:
    """Per layer the keys and values ``(B, kv_heads, L, head_dim)`` of the first ``L = max(prefix)`` positions
    of a batch (detached unless captured with ``detach=False``), and per row the number of leading positions
    ``prefix[b]`` it shares."""

    layers: list[tuple[Tensor, Tensor]]
    prefix: list[int]

    @classmethod
    def capture(cls, cache: Any, prefix: list[int], *, detach: bool = True) -> PromptKV:
        """The first ``max(prefix)`` positions of a forward pass's ``past_key_values`` (a transformers
        ``Cache``), detached from any autograd graph unless ``detach`` is False (then gradients flow back through
        the continuation into the pass that made them).

        Raises:
            ValueError: the cache holds fewer positions than ``max(prefix)``, or a row shares no position.
        """
        if min(prefix) < 1:
            raise ValueError("every row must share at least one position")
        length = max(prefix)
        layers = []
        per_layer = (
            [(layer.keys, layer.values) for layer in cache.layers]
            if hasattr(cache, "layers")
            else list(zip(cache.key_cache, cache.value_cache))
        )  # transformers < 4.56
        for k, v in per_layer:
            if k.shape[-2] < length:
                raise ValueError(f"the cache holds {k.shape[-2]} positions, {length} are shared")
            k, v = k[..., :length, :], v[..., :length, :]
            layers.append((k.detach(), v.detach()) if detach else (k, v))
        return cls(layers, list(prefix))

    def expand(self, batch: int) -> PromptKV:
        """A one-row prefix shared by ``batch`` rows (views, no copy)."""
        if len(self.prefix) != 1:
            raise ValueError("only a one-row prefix can be expanded")
        layers = [(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)) for k, v in self.layers]
        return PromptKV(layers, self.prefix * batch)

    def continuation(
        self, lengths: list[int], device: torch.device, config: Any, width: int | None = None
    ) -> dict[str, Any]:
        """Keyword arguments for the decoder's forward over right-padded continuations of ``lengths[b]`` tokens
        (row ``b`` continues its own prefix): the K/V cache under the decoder's keyword (``cache`` or
        ``past_key_values``: a fresh ``DynamicCache``; the forward appends to it), ``attention_mask`` (B, L + T)
        and ``position_ids`` (B, T). ``width``: T (default ``max(lengths)``; a group rank pads as the whole batch)."""
        from transformers import DynamicCache

        b_n, t_max, length = len(lengths), width or max(lengths), max(self.prefix)
        mask = torch.zeros((b_n, length + t_max), dtype=torch.long)
        for b, (p, n) in enumerate(zip(self.prefix, lengths)):
            mask[b, :p] = 1
            mask[b, length : length + n] = 1
        positions = torch.tensor(self.prefix, dtype=torch.long)[:, None] + torch.arange(t_max)[None, :]
        if hasattr(DynamicCache, "from_legacy_cache"):  # transformers < 4.56
            cache = DynamicCache.from_legacy_cache(tuple(self.layers))
        else:
            cache = DynamicCache(ddp_cache_data=list(self.layers), config=config)
        return {_cache_arg(): cache, "attention_mask": mask.to(device), "position_ids": positions.to(device)}


@functools.cache
def _cache_arg() -> str:
    """The decoder forward's keyword for a K/V cache: ``cache`` (transformers ≥ 5.2x) or ``past_key_values``."""
    import inspect

    from transformers.models.llama.modeling_llama import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def cache_of(output: Any) -> Any:
    """The K/V cache a forward returned (``cache``, formerly ``past_key_values``)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def kl_pairs(
    data: list[Any], inputs_D: list[dict[str, Tensor]], max_seq_len: int, *, shared: bool
) -> tuple[list[list[int]], list[Tensor], list[Tensor] | None]:
    """KTO's mismatched pairs ``(x_i, y_perm(i))`` of a batch as ``(inputs, targets, keep)`` for the trainer's
    logprob pass (TRL ``KTOTrainer``'s KL dataset; ``perm`` from :func:`livelora.trainer.losses.kl_pair_order`,
    a derangement).

    Prompt of datum i = its tokens up to the first non-zero weight's position (inclusive); completion = its targets
    from there to the last non-zero weight. Pairs longer than ``max_seq_len + 1`` tokens are cut at the end.
    ``shared``: the pairs continue from the keys/values of datum i's first ``len(prompt) − 1`` positions, so
    ``inputs[i]`` starts at the prompt's last token and every target is a completion token (``keep`` is None);
    otherwise ``inputs[i]`` is the whole pair and ``keep[i]`` (bool, N_i) marks its completion targets.
    """
    prompts, completions = [], []
    for datum, x in zip(data, inputs_D):
        tokens = datum.model_input.to_ints()
        targets = x["target_tokens"].tolist()
        nz = [j for j, w in enumerate(x["weights"].tolist()) if w != 0]
        prompts.append(tokens[: nz[0] + 1])
        completions.append(targets[nz[0] : nz[-1] + 1])
    perm = kl_pair_order([tuple(p) for p in prompts])
    seqs = [(prompts[i] + completions[j])[: max_seq_len + 1] for i, j in enumerate(perm)]
    skip = [len(p) - 1 for p in prompts]  # positions before the first completion target
    if shared:
        return (
            [s[k:-1] for s, k in zip(seqs, skip)],
            [torch.tensor(s[k + 1 :], dtype=torch.long) for s, k in zip(seqs, skip)],
            None,
        )
    ins = [s[:-1] for s in seqs]
    return (
        ins,
        [torch.tensor(s[1:], dtype=torch.long) for s in seqs],
        [torch.arange(len(x)) >= k for x, k in zip(ins, skip)],
    )


def common_prefix(inputs: list[list[int]], minimum: int = MIN_COMMON_PREFIX) -> int:
    """How many leading tokens every one of ``inputs`` (two or more) shares, leaving each at least one token
    of its own; 0 when that is fewer than ``minimum`` (e.g. a chat template's system message, shared by every
    prompt of a live-loop batch, or an RL group's prompt, runs once at batch 1 and the rows continue from its
    keys/values: :meth:`PromptKV.expand`)."""
    if len(inputs) < 2:
        return 0
    limit, first, n = min(len(x) for x in inputs) - 1, inputs[0], 0
    while n < limit and all(x[n] == first[n] for x in inputs):
        n += 1
    return n if n >= minimum else 0
