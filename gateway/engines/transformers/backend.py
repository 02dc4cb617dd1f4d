"""The transformers model behind :class:`~livelora.gateway.engines.batching.BatchingLoop`: :class:`TransformersBackend`.

Prompts are prefilled left-padded in one forward pass per group into a fresh cache that is then merged into the
running :class:`~livelora.gateway.engines.transformers.kv_batch.KVBatch`; a decode step is one forward pass over
every running row. Rows may use different adapter versions (:mod:`livelora.gateway.engines.lora_slots`, which also
serves a version every row uses from merged weights).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from livelora.gateway.engines.base import TokenLogprob
from livelora.gateway.engines.batching import Forward, Schedule, Sequence
from livelora.gateway.engines.lora_slots import LoraSlots
from livelora.gateway.engines.sampling import prompt_logprobs
from livelora.gateway.engines.transformers.kv_batch import KVBatch, left_padded


class TransformersBackend:
    """A :class:`~livelora.gateway.engines.batching.ModelBackend` over a transformers causal LM.

    Args:
        model: the transformers causal LM (eval mode, on ``device``; LoRA layers are injected into it when
            adapters load).
        pad_id: the token id that left-pads prompts of a prefill group.
        device: torch device of the model.
        schedule: runs a callable on the loop's thread between two steps (the LoRA slots make spare slots so).
        merge: serve a version that every row uses from merged weights (:class:`~.lora_slots.MergedVersion`).
        quantize: the model's linear layers serve int8 weights (:mod:`.quantized`); merged versions are re-quantized.
    """

    def __init__(
        self, model, pad_id: int, device: str, schedule: Schedule, *, merge: bool = True, quantize: bool = False
    ):
        self.model = model
        self.pad_id = pad_id
        self.device = device
        #: adapter versions in LoRA slots, and the forward pass that serves each row its own version
        self.slots = LoraSlots(model, schedule, merge=merge, quantize=quantize)
        self.batch = KVBatch()  # the running rows' cache, in the loop's order
        self.prefilled: KVBatch | None = None  # the cache of the group just prefilled, until :meth:`admit`
        self.threads = torch.get_num_threads()
        self.configs: dict[str, Any] = {}  # version -> its LoraConfig (resident or cold)
        self.cold: dict[str, Path] = {}  # version -> its cold copy (written when it is first evicted)
        self.cold_dir: Path | None = None

    def set_threads(self, n: int) -> None:
        torch.set_num_threads(n)  # the loop's thread runs the engine's kernels
        self.threads = torch.get_num_threads()

    def forward(self, adapters: list[str | None], **kw) -> torch.Tensor:
        """One forward pass; returns logits ``(B, T_kept, V)``. ``adapters`` has one entry per row
        (:meth:`~.lora_slots.LoraSlots.forward`)."""
        return self.slots.forward(adapters, **kw)

    # ----- steps (ModelBackend) ---------------------------------------------------------
    def prefill(self, group: list[Sequence]) -> Iterator[Forward]:
        """One left-padded forward pass over the whole group."""
        from transformers import DynamicCache

        ids, mask, pos = left_padded([s.prompt for s in group], self.pad_id, self.device)
        cache = DynamicCache(config=self.model.config)
        logits = self.forward(
            [s.adapter for s in group],
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.prefilled = KVBatch()
        self.prefilled.merge(cache, mask)
        yield group, logits[:, -1, :]

    def admit(self, rows: list[Sequence], keep: list[int]) -> None:
        new, self.prefilled = self.prefilled, None
        assert new is not None, "admit() without a prefill"
        new.select(keep)
        if keep:
            self.batch.merge(new.cache, new.mask)

    def decode(self, running: list[Sequence]) -> Iterator[Forward]:
        """One forward pass over every running row."""
        ids = torch.tensor([[s.next_token] for s in running], dtype=torch.long, device=self.device)
        mask, pos = self.batch.step_inputs()
        logits = self.forward(
            [s.adapter for s in running],
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            cache=self.batch.cache,
            use_cache=True,
        )
        yield running, logits[:, -1, :]

    def decoded(self, running: list[Sequence]) -> None:
        """Nothing: the LoRA slots count the passes a version serves alone in :meth:`forward`."""

    def drop(self, running: list[Sequence], keep: list[int]) -> None:
        self.batch.select(keep)

    def reset(self) -> None:
        self.batch, self.prefilled = KVBatch(), None

    # ----- scoring and adapters (ModelBackend) ------------------------------------------
    def score(self, token_ids: list[int], adapter: str | None, top_k: int) -> list[TokenLogprob | None]:
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        logits = self.forward([adapter], input_ids=ids, use_cache=False)
        chosen, tops = prompt_logprobs(logits[0], ids[0], top_k)
        return [None] + [TokenLogprob(t, lp, tp) for t, lp, tp in zip(token_ids[1:], chosen, tops)]

    def read_adapter(self, path: Path) -> tuple[Any, Any, str]:
        """``(peft LoraConfig, state dict on the device, sha256)``
        (:func:`~livelora.gateway.engines.transformers.adapters.read_adapter`)."""
        from livelora.gateway.engines.transformers.adapters import read_adapter

        return read_adapter(path, self.device)

    def install(self, name: str, config, weights: dict[str, torch.Tensor], source: str) -> None:
        """Copy the weights into a LoRA slot (:meth:`~.lora_slots.LoraSlots.install`)."""
        self.slots.install(name, config, weights, source)
        self.configs[name] = config

    def uninstall(self, name: str) -> None:
        """Its slot becomes free for the next version of the same shape (:meth:`~.lora_slots.LoraSlots.release`);
        a cold version's copy is deleted."""
        self.slots.release(name)
        self.configs.pop(name, None)
        cold = self.cold.pop(name, None)
        if cold is not None:
            cold.unlink(missing_ok=True)

    def evict(self, name: str) -> None:
        """Release its slot; its tensors are written to a safetensors file of this backend's the first time."""
        from safetensors.torch import save_file

        from livelora.gateway.engines.residency import cold_dir

        if name not in self.cold:
            if self.cold_dir is None:
                self.cold_dir = cold_dir()
            params = self.slots.versions[name].params or {}
            path = self.cold_dir / f"{len(self.cold)}-{abs(hash(name))}.safetensors"
            save_file({k: p.detach().cpu().contiguous() for k, p in params.items()}, str(path))
            self.cold[name] = path
        self.slots.release(name)

    def restore(self, name: str) -> None:
        """Copy the cold file back into a LoRA slot (a free one of its shape when there is one)."""
        from safetensors.torch import load_file

        self.slots.install(name, self.configs[name], load_file(str(self.cold[name]), device=self.device), "cold copy")

    def version_bytes(self, name: str) -> int:
        return sum(p.numel() * p.element_size() for p in (self.slots.versions[name].params or {}).values())

    def close(self, stepping: bool) -> None:
        """Remove the cold copies (the model goes with the engine)."""
        if self.cold_dir is not None:
            import shutil

            shutil.rmtree(self.cold_dir, ignore_errors=True)
