"""Prompt key/value reuse between sequences that start with the same tokens (KTO's KL pairs).

KTO's reference point ``z0`` (Ethayarajh et al. 2024, arXiv 2402.01306, §4.1; TRL ``KTOTrainer``) needs the
policy and reference log-ratios of *mismatched* pairs ``(x_i, y_perm(i))``. Pair ``i`` starts with exactly the
prompt tokens of datum ``i``, whose forward pass (policy, and reference with the adapter disabled) runs anyway
for the matched pair ``(x_i, y_i)``. With a causal decoder the keys and values of those prompt positions are the
same in both sequences, so the mismatched pair only has to run its completion: the prompt's K/V are taken from
the matched pass (:meth:`PromptKV.capture`) and the completion continues from them (:meth:`PromptKV.continuation`),
at its true positions (RoPE ``position_ids`` = prompt length + offset). The values equal a full recompute up to
float rounding (tests: within 1e-4 nats); the saved work is the prompt share of two forward passes.

The K/V of a right-padded batch are kept up to the longest shared prefix ``L``; row ``b`` uses its first
``P_b`` positions (the attention mask hides positions ``P_b … L−1``, which hold row ``b``'s own completion).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

#: Largest K/V a full pass may keep to share its prompt (bytes); a larger batch recomputes the prompts instead.
PROMPT_KV_MAX_BYTES = 1 << 30


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
    of a batch (detached), and per row the number of leading positions ``prefix[b]`` it shares."""

    layers: list[tuple[Tensor, Tensor]]
    prefix: list[int]

    @classmethod
    def capture(cls, cache: Any, prefix: list[int]) -> PromptKV:
        """The first ``max(prefix)`` positions of a forward pass's ``past_key_values`` (a transformers
        ``Cache``), detached from any autograd graph.

        Raises:
            ValueError: the cache holds fewer positions than ``max(prefix)``, or a row shares no position.
        """
        if min(prefix) < 1:
            raise ValueError("every row must share at least one position")
        length = max(prefix)
        layers = []
        per_layer = ([(layer.keys, layer.values) for layer in cache.layers] if hasattr(cache, "layers")
                     else list(zip(cache.key_cache, cache.value_cache)))  # transformers < 4.56
        for k, v in per_layer:
            if k.shape[-2] < length:
                raise ValueError(f"the cache holds {k.shape[-2]} positions, {length} are shared")
            layers.append((k[..., :length, :].detach(), v[..., :length, :].detach()))
        return cls(layers, list(prefix))

    def continuation(self, lengths: list[int], device: torch.device, config: Any) -> dict[str, Any]:
        """Keyword arguments for the decoder's forward over right-padded continuations of ``lengths[b]`` tokens
        (row ``b`` continues its own prefix): ``past_key_values`` (a fresh ``DynamicCache``; the forward appends
        to it), ``attention_mask`` (B, L + T) and ``position_ids`` (B, T)."""
        from transformers import DynamicCache

        b_n, t_max, length = len(lengths), max(lengths), max(self.prefix)
        mask = torch.zeros((b_n, length + t_max), dtype=torch.long)
        for b, (p, n) in enumerate(zip(self.prefix, lengths)):
            mask[b, :p] = 1
            mask[b, length:length + n] = 1
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

