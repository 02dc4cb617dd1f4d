"""One llama.cpp context of the llama_cpp engine and what its sequence ids hold (:class:`Lane`), and the merged
float16 GGUF a version alone is served from (:func:`merge_gguf_lora`).

The base lane applies each row's version as a LoRA; a merged lane serves one version from ``W + B A`` rounded to
float16 with no LoRA in the graph (about 4 ms less per one-row step for a rank-16 version on every linear layer of
SmolLM2-135M: docs/serving.md).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from livelora.clients.errors import BadRequestError
from livelora.gateway.engines.llama_cpp.model import LlamaModel

#: Adapters (the base counts as one) whose last shared prompt prefix is kept, each in a sequence id of its own.
PREFIX_CACHES = 2
#: Shortest prefix worth keeping or reusing, in tokens.
MIN_PREFIX = 8


class Lane:
    """A :class:`LlamaModel` and its sequence ids: running rows take the lowest free ids (llama.cpp puts a run of
    consecutive ids into one micro-batch), the last row id scores, :data:`PREFIX_CACHES` ids hold prompt prefixes.

    Args:
        llama: the context. version: the adapter version merged into its weights (its rows run with no LoRA), or
            ``None``: the base model, which applies each row's version as a LoRA.
    """

    def __init__(self, llama: LlamaModel, version: str | None = None):
        self.llama = llama
        self.version = version
        rows = llama.n_seq - 1 - PREFIX_CACHES
        self.rows = rows
        self.free_ids = list(range(rows))
        #: free sequence id -> (adapter, prompt) whose cells it still holds (reused in place by the next prompt
        #: on that adapter that starts the same way; cheaper than a prefix cache's copy of a whole KV stream)
        self.kept: dict[int, tuple[str | None, list[int]]] = {}
        self.score_id = rows
        self.cache_ids = list(range(rows + 1, rows + 1 + PREFIX_CACHES))
        #: adapter -> (sequence id holding a prompt prefix's cells, its tokens), most recently used last
        self.prefixes: dict[str | None, tuple[int, list[int]]] = {}
        self.last_prompt: dict[str | None, list[int]] = {}  # adapter -> its last prompt prefilled

    @property
    def busy(self) -> bool:
        """Some row holds a sequence id here."""
        return len(self.free_ids) < self.rows

    def use(self, adapter: str | None) -> None:
        """Make the context apply ``adapter`` from the next decode on (a merged lane applies none)."""
        self.llama.use(None if self.version is not None else adapter)

    def take(self, adapter: str | None, prompt: list[int]) -> tuple[int, int]:
        """Give a new row on ``adapter`` the lowest free sequence id, with what it can reuse of ``prompt``;
        returns ``(id, first position left to compute)``."""
        sid = min(self.free_ids)
        self.free_ids.remove(sid)
        return sid, self._reuse_kept(adapter, prompt, sid) or self._reuse_prefix(adapter, prompt, sid)

    def release(self, sid: int, adapter: str | None, prompt: list[int]) -> None:
        """A row is done with ``sid``: its prompt's cells stay until the id is taken again."""
        self.kept[sid] = (adapter, prompt)
        self.free_ids.append(sid)

    def _reuse_kept(self, adapter: str | None, prompt: list[int], sid: int) -> int:
        """Keep the cells ``sid`` still holds of its last prompt as far as ``prompt`` starts the same way on the same
        adapter and at least as far as ``adapter``'s prefix cache would (free the rest); returns the first position
        left to compute (0: nothing kept)."""
        kept_adapter, kept = self.kept.pop(sid, (None, []))
        n = min(common_prefix(prompt, kept), len(prompt) - 1) if kept and kept_adapter == adapter else 0
        cached = common_prefix(prompt, self.prefixes[adapter][1]) if adapter in self.prefixes else 0
        if n < MIN_PREFIX or n < min(cached, len(prompt) - 1):
            self.llama.forget(sid)
            return 0
        self.llama.forget(sid, n)
        return n

    def _reuse_prefix(self, adapter: str | None, prompt: list[int], sid: int) -> int:
        """Share the cached prefix cells of ``adapter`` that ``prompt`` starts with into ``sid`` (at least
        :data:`MIN_PREFIX` tokens; the prompt's last token is always computed, for its logits); returns the
        first position left to compute."""
        if adapter not in self.prefixes:
            return 0
        cid, cached = self.prefixes.pop(adapter)
        self.prefixes[adapter] = (cid, cached)  # most recently used
        n = min(common_prefix(prompt, cached), len(prompt) - 1)
        if n < MIN_PREFIX:
            return 0
        self.llama.copy(cid, sid, n)
        return n

    def keep_prefix(self, adapter: str | None, prompt: list[int], sid: int) -> None:
        """Cache the prefix ``prompt`` shares with the previous prompt on ``adapter`` (a chat template's system
        turn, a few-shot header) when it is longer than what is cached; the least recently used adapter's cache
        makes room."""
        n = common_prefix(prompt, self.last_prompt.get(adapter, []))
        self.last_prompt[adapter] = prompt
        cid, cached = self.prefixes.get(adapter, (None, []))
        if n < MIN_PREFIX or common_prefix(prompt, cached) >= n:
            return
        if cid is None:
            if not self.cache_ids:
                self.drop_prefix(next(iter(self.prefixes)))
            cid = self.cache_ids.pop()
        else:
            self.llama.forget(cid)
        self.llama.copy(sid, cid, n)
        self.prefixes.pop(adapter, None)
        self.prefixes[adapter] = (cid, prompt[:n])

    def drop_prefix(self, adapter: str | None) -> None:
        self.last_prompt.pop(adapter, None)
        if adapter in self.prefixes:
            cid, _ = self.prefixes.pop(adapter)
            self.llama.forget(cid)
            self.cache_ids.append(cid)

    def drop_version(self, name: str) -> None:
        """Free every cell that holds ``name``'s prompts (its prefix cache, the kept cells of finished rows)."""
        self.drop_prefix(name)
        for sid in [sid for sid, (adapter, _) in self.kept.items() if adapter == name]:
            del self.kept[sid]
            self.llama.forget(sid)

    def reset(self) -> None:
        """Free every cell (the running rows are gone)."""
        for adapter in list(self.prefixes):
            self.drop_prefix(adapter)
        for sid in range(self.score_id + 1):  # the running rows' cells and any a failed prefill wrote
            self.llama.forget(sid)
        self.free_ids = list(range(self.rows))
        self.kept.clear()


def merge_gguf_lora(base: Path, lora: Path, out: Path) -> None:
    """Write ``out``: the GGUF ``base`` with each weight the GGUF LoRA ``lora`` adapts replaced by ``W + B A``
    (``lora_a`` ``(r, d_in)``, ``lora_b`` ``(d_out, r)`` with the scaling folded in) rounded to float16 (about 1 s
    for SmolLM2-135M: a copy of the file, then the adapted tensors rewritten in place).

    Raises:
        BadRequestError: an adapted weight of ``base`` is not float16 (a quantized file cannot take the update).
    """
    import gguf

    factors = {t.name: np.asarray(t.data, dtype=np.float32) for t in gguf.GGUFReader(lora).tensors}
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.copyfile(base, tmp)
    try:
        reader = gguf.GGUFReader(tmp, "r+")
        for t in reader.tensors:
            a = factors.get(f"{t.name}.lora_a")
            if a is None:
                continue
            if t.tensor_type != gguf.GGMLQuantizationType.F16:
                raise BadRequestError(f"{t.name} is {t.tensor_type.name}, not F16: cannot merge a LoRA into it")
            b = factors[f"{t.name}.lora_b"]
            w = t.data.reshape(b.shape[0], a.shape[1])
            w[...] = (w.astype(np.float32) + b @ a).astype(np.float16)
        reader.data.flush()
        del reader
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
