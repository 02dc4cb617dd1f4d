"""A left-padded batch of KV caches that sequences can join and leave between steps.

:class:`KVBatch` is one transformers ``DynamicCache`` (per layer keys/values ``(B, H_kv, T, D)``) plus a 2-D
attention mask ``(B, T)`` (1 = real token, 0 = padding). Rows are right-aligned so every decode step appends
one column for all rows; :meth:`KVBatch.merge` adds prefilled rows (left-padding the shorter cache), and
:meth:`KVBatch.select` keeps a subset of rows and drops columns that are padding in all of them. Position ids
are ``mask.sum(-1) - 1``, so padding never shifts a sequence's rotary positions.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def _left_pad(t: torch.Tensor, cols: int, dim: int) -> torch.Tensor:
    if cols == 0:
        return t
    shape = list(t.shape)
    shape[dim] = cols
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class KVBatch:
    """Batched KV cache plus attention mask of the running sequences (see module doc)."""

    def __init__(self):
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # (B, T) long

    @property
    def size(self) -> int:
        """Number of rows ``B``."""
        return 0 if self.mask is None else self.mask.shape[0]

    @property
    def length(self) -> int:
        """Number of columns ``T`` (the longest row including padding)."""
        return 0 if self.mask is None else self.mask.shape[1]

    def merge(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        """Append the rows of a prefilled ``cache`` (mask ``(b, t)``) after the current rows."""
        if self.mask is None:
            self.cache, self.mask = cache, mask
            return
        t_old, t_new = self.mask.shape[1], mask.shape[1]
        t = max(t_old, t_new)
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, t - t_old, 2), _left_pad(theirs.keys, t - t_new, 2)], 0)
            mine.values = torch.cat([_left_pad(mine.values, t - t_old, 2), _left_pad(theirs.values, t - t_new, 2)], 0)
        self.mask = torch.cat([_left_pad(self.mask, t - t_old, 1), _left_pad(mask, t - t_new, 1)], 0)

    def select(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order) and trim all-padding leading columns."""
        if not rows:
            self.cache = self.mask = None
            return
        if rows == list(range(self.size)):
            return
        idx = torch.tensor(rows, device=self.mask.device)
        mask = self.mask.index_select(0, idx)
        first = int(mask.any(dim=0).nonzero()[0, 0])
        self.mask = mask[:, first:]
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, idx)[:, :, first:]
            layer.values = layer.values.index_select(0, idx)[:, :, first:]

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Extend the mask by one real column for the tokens about to be fed.

        Returns:
            ``(attention_mask (B, T+1), position_ids (B, 1))``.
        """
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.size, 1)], dim=1)
        positions = self.mask.sum(dim=1, keepdim=True) - 1
        return self.mask, positions


def left_padded(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stack prompts left-padded.

    Returns:
        ``(input_ids (B, T), attention_mask (B, T), position_ids (B, T))``; padded
        positions get position 0 and token ``pad_id``.
    """
    t = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), t), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, t - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, t - len(p) :] = 1
    pos = (mask.cumsum(dim=1) - 1).clamp_(min=0)
    return ids.to(device), mask.to(device), pos.to(device)
