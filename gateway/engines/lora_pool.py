"""The gathered LoRA product of the transformers engine: a batch mixing many adapter versions in one pass per layer
whose cost does not grow with the number of versions.

:class:`LoraPool` keeps, per LoRA ``Linear`` layer, every slot's factors stacked by a row number of the slot
(``A`` ``(P, r, d_in)``, ``s·Bᵀ`` ``(P, r, d_out)``, row 0 all zeros for base rows); a slot's rows are copied in
when a batch first uses it after its weights changed. :class:`GatheredRows` serves a batch: each row gathers its
own version's factors and two batched matmuls give ``y_b = W x_b + s_u B_u A_u x_b`` (Hu et al. 2021, eq. 3), the
idea of Punica's BGMV kernel in plain torch. Used from :data:`GATHER_FROM` versions in one batch on; below it the
rank-stacked pass of :class:`~.lora_slots.MixedRows` serves. Figures: ``docs/serving.md``.
"""

from __future__ import annotations

import torch

#: Distinct versions in one batch from which the gathered product serves it (the stacked pass's work grows with
#: the versions, the gathered one's with the rows; ``bench/many_versions.py --stacked`` compares them).
GATHER_FROM = 3


class LoraPool:
    """Every slot's LoRA factors, per layer, stacked by the slot's row (one pool per slot shape).

    Attributes:
        rows: slot name → its row (≥ 1); ``stale`` the slots whose rows must be copied again before use.
    """

    def __init__(self):
        self.rows: dict[str, int] = {}
        self.stale: set[str] = set()
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(LoRA module) -> (A, s·Bᵀ) pools
        self.signature: str | None = None

    def changed(self, name: str) -> None:
        """Slot ``name``'s weights changed (or it was deleted): its rows are copied again on next use."""
        self.stale.add(name)

    def dropped(self, name: str) -> None:
        """Slot ``name`` was deleted: its row is free."""
        self.rows.pop(name, None)
        self.stale.discard(name)

    def batch(self, peft, slots: list) -> GatheredRows | None:
        """The :class:`GatheredRows` of a batch (``slots``: per row its slot or ``None``), or ``None`` when its
        versions' shape differs from the pool's (the pool then starts over with that shape next time)."""
        used = {s.name: s for s in slots if s is not None}
        signature = next(iter(used.values())).signature
        if signature != self.signature:
            self.rows.clear()
            self.layers.clear()
            self.signature = signature
        for name in used:
            if name not in self.rows:
                self.rows[name] = next(i for i in range(1, len(self.rows) + 2) if i not in self.rows.values())
                self.stale.add(name)
        fresh = [name for name in used if name in self.stale]
        if fresh:
            self._copy(peft, fresh)
        index = torch.tensor([self.rows[s.name] if s is not None else 0 for s in slots], dtype=torch.long)
        return GatheredRows(self, index)

    def _copy(self, peft, names: list[str]) -> None:
        """Copy the factors of slots ``names`` into their rows of every layer's pools (grown as needed)."""
        from peft.tuners.lora.layer import Linear as LoraLinear

        top = max(self.rows.values()) + 1
        # in inference mode: the pools are inference tensors (built in a decode step or a scoring command alike),
        # and an inference tensor may only be written in place inside inference mode
        with torch.inference_mode():
            for module in peft.modules():
                if not isinstance(module, LoraLinear) or not all(n in module.lora_A for n in names):
                    continue
                a0 = module.lora_A[names[0]].weight
                pools = self.layers.get(id(module))
                if pools is None or pools[0].shape[0] < top:
                    size = max(top, 2 * pools[0].shape[0]) if pools is not None else top
                    grown = (
                        a0.new_zeros(size, a0.shape[0], a0.shape[1]),
                        a0.new_zeros(size, a0.shape[0], module.lora_B[names[0]].weight.shape[0]),
                    )
                    if pools is not None:
                        grown[0][: pools[0].shape[0]] = pools[0]
                        grown[1][: pools[1].shape[0]] = pools[1]
                    pools = self.layers[id(module)] = grown
                for name in names:
                    row = self.rows[name]
                    pools[0][row] = module.lora_A[name].weight
                    pools[1][row] = module.lora_B[name].weight.t() * module.scaling[name]
        self.stale.difference_update(names)


class GatheredRows:
    """One batch on the gathered product: ``index`` ``(rows,)`` holds each row's pool row (0: the base model)."""

    merged = None  # (the forward's merged-version check)

    def __init__(self, pool: LoraPool, index: torch.Tensor):
        self.pool, self.index = pool, index

    def update(self, module, x: torch.Tensor) -> torch.Tensor | None:
        """The LoRA update of one layer for every row, ``(rows, T, d_out)``, or ``None`` if no version adapts it.
        ``x`` is ``(rows, T, d_in)``."""
        pools = self.pool.layers.get(id(module))
        if pools is None:
            return None
        if self.index.device != pools[0].device:
            self.index = self.index.to(pools[0].device)
        a = pools[0].index_select(0, self.index)  # (rows, r, d_in)
        bt = pools[1].index_select(0, self.index)  # (rows, r, d_out)
        return torch.bmm(torch.bmm(x.to(a.dtype), a.transpose(1, 2)), bt)
