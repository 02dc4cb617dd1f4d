"""The worker of :class:`~.llama_cpp_engine.LlamaCppEngine`: the continuous-batching loop of :mod:`.hf_worker`
with llama.cpp (``llama-cpp-python``'s C API) doing the forward passes.

Each running sequence owns one llama.cpp sequence id (its own KV cells, ``n_ctx / n_seq_max`` of them); the
last id is kept for :meth:`LlamaWorker.score`. llama.cpp applies LoRA adapters per context, not per row, so a
step runs one ``llama_decode`` per adapter version among the running rows (one in the steady state), switching
the context's adapter between them. Logits come back as float32 ``(rows, vocab)`` and are sampled by
:mod:`.sampling`, as in the transformers engine. An adapter version is a GGUF LoRA written from the PEFT weights
when it loads (:func:`~livelora.adapters.gguf_export.gguf_lora_from_state`) and freed when it unloads.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from livelora.clients.errors import BadRequestError, InternalError
from livelora.core import metrics
from livelora.gateway.engines.base import TokenLogprob
from livelora.gateway.engines.hf_worker import Sequence, Worker
from livelora.gateway.engines.sampling import prompt_logprobs

log = logging.getLogger(__name__)

#: Adapters (the base counts as one) whose last shared prompt prefix is kept, each in a sequence id of its own.
PREFIX_CACHES = 2
#: Shortest prefix worth keeping or reusing, in tokens.
MIN_PREFIX = 8
#: Tokens per ``llama_decode`` call (llama.cpp's ``n_batch`` and ``n_ubatch``); also bounds the float32 logits
#: buffer of a scoring chunk (``512 × vocab``).
DECODE_CHUNK = 512
#: Served weight formats (``LIVELORA_ENGINE_WEIGHTS``): the file's own types, or every tensor converted to
#: float16 (llama.cpp's ``LLAMA_FTYPE_MOSTLY_F16``); measured side by side in ``docs/serving.md``.
GGUF_FORMATS = {"gguf": None, "f16": 1}


def served_gguf(gguf: Path, weights: str, cache: Path) -> Path:
    """The GGUF file that serves ``gguf`` in format ``weights`` (:data:`GGUF_FORMATS`): ``gguf`` itself, or its
    conversion by llama.cpp's own quantizer, written once into ``cache`` (atomically, under a file lock; about 1 s
    for SmolLM2-135M).

    Raises:
        BadRequestError: an unknown format; InternalError: llama.cpp could not convert the file.
    """
    if weights not in GGUF_FORMATS:
        raise BadRequestError(f"weights must be one of {', '.join(GGUF_FORMATS)}", param="weights")
    ftype = GGUF_FORMATS[weights]
    if ftype is None:
        return gguf
    import llama_cpp as lc

    from livelora.core.atomic import file_lock, fsync_dir, private_dir

    out = cache / f"{gguf.stem}.{weights}.gguf"
    private_dir(cache)
    with file_lock(cache / f".{out.name}.lock"):
        if out.is_file():
            return out
        lc.llama_log_set(_log_callback(), None)
        lc.llama_backend_init()
        params = lc.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = ftype, True, os.cpu_count() or 1
        tmp = out.with_name(f".{out.name}.tmp")
        try:
            if lc.llama_model_quantize(str(gguf).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
                raise InternalError(f"llama.cpp could not convert {gguf.name} to {weights}")
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, out)
            fsync_dir(cache)
        finally:
            tmp.unlink(missing_ok=True)
    return out


class LlamaModel:
    """A GGUF base model and one llama.cpp context: ``n_seq`` sequence ids of ``n_ctx_seq`` KV cells each. Each
    sequence attends over its own cells only, so a row's logits do not depend on the other rows (llama.cpp's
    unified cache would change the order of the attention sums with them).

    Args:
        gguf: the base model's GGUF file. n_seq: sequence ids (running rows, one for scoring, the prefix caches).
        n_ctx_seq: KV cells per sequence. n_threads: llama.cpp threads.

    Raises:
        BadRequestError: llama.cpp cannot load ``gguf`` or create the context.
    """

    def __init__(self, gguf: Path, *, n_seq: int, n_ctx_seq: int, n_threads: int):
        import llama_cpp as lc

        lc.llama_log_set(_log_callback(), None)
        self.lc = lc
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self.model:
            raise BadRequestError(f"llama.cpp cannot load {gguf}", param="model")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_seq * n_ctx_seq
        cparams.n_batch = cparams.n_ubatch = DECODE_CHUNK
        cparams.n_seq_max = n_seq
        cparams.kv_unified = False
        cparams.n_threads = cparams.n_threads_batch = n_threads
        cparams.no_perf = True
        self.n_threads = n_threads
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise BadRequestError("llama.cpp cannot create a context of this size", param="max_model_len")
        self.memory = lc.llama_get_memory(self.ctx)
        self.vocab_size = int(lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model)))
        self.n_ctx_train = int(lc.llama_model_n_ctx_train(self.model))
        self.batch = lc.llama_batch_init(DECODE_CHUNK, 0, 1)
        self.adapters: dict[str, Any] = {}  # name -> llama_adapter_lora pointer
        self.active: str | None = None  # the adapter the context applies now (None: the base)

    def set_threads(self, n: int) -> None:
        self.lc.llama_set_n_threads(self.ctx, n, n)

    def use(self, adapter: str | None) -> None:
        """Make the context apply ``adapter`` (scale 1; ``None``: none) from the next decode on."""
        if adapter == self.active:
            return
        lc = self.lc
        if adapter is None:
            lc.llama_set_adapters_lora(self.ctx, None, 0, None)
        else:
            ptrs = (lc.llama_adapter_lora_p_ctypes * 1)(self.adapters[adapter])
            lc.llama_set_adapters_lora(self.ctx, ptrs, 1, (ctypes.c_float * 1)(1.0))
        self.active = adapter

    def decode(self, tokens: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """One ``llama_decode`` of ``(token, position, seq_id, want_logits)`` (at most :data:`DECODE_CHUNK`);
        returns float32 logits ``(wanted, vocab)`` in the order asked.

        Raises:
            InternalError: llama.cpp refused the batch (no KV cells left, or a failed computation).
        """
        lc, b = self.lc, self.batch
        # by sequence id: llama.cpp's per-sequence caches take a run of consecutive ids per micro-batch, so rows
        # out of id order would be split into several passes over the weights
        order = sorted(range(len(tokens)), key=lambda i: (tokens[i][2], tokens[i][1]))
        slot = {}
        for i, k in enumerate(order):
            tok, pos, sid, want = tokens[k]
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, want
            b.seq_id[i][0] = sid
            if want:
                slot[k] = i
        outs = [slot[k] for k in range(len(tokens)) if k in slot]
        b.n_tokens = len(tokens)
        rc = lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise InternalError(f"llama_decode failed (code {rc})")
        v = self.vocab_size
        return np.stack([np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, i), shape=(v,)) for i in outs])

    def forget(self, seq_id: int, start: int = -1) -> None:
        """Free the KV cells of ``seq_id`` from position ``start`` on (every one by default)."""
        self.lc.llama_memory_seq_rm(self.memory, seq_id, start, -1)

    def copy(self, src: int, dst: int, n: int) -> None:
        """Make ``dst``'s cells a copy of ``src``'s positions ``0 .. n - 1`` (llama.cpp copies a sequence's whole
        buffer between sequences, then the tail is dropped)."""
        self.lc.llama_memory_seq_cp(self.memory, src, dst, -1, -1)
        self.lc.llama_memory_seq_rm(self.memory, dst, n, -1)

    def load_adapter(self, name: str, path: Path) -> None:
        """Load the GGUF LoRA ``path`` as ``name``. Raises :class:`BadRequestError` if llama.cpp refuses it."""
        ptr = self.lc.llama_adapter_lora_init(self.model, str(path).encode())
        if not ptr:
            raise BadRequestError(f"llama.cpp cannot apply adapter {name!r} to this base model", param="path")
        self.adapters[name] = ptr

    def free_adapter(self, name: str) -> None:
        if self.active == name:
            self.use(None)
        self.lc.llama_adapter_lora_free(self.adapters.pop(name))

    def close(self) -> None:
        lc = self.lc
        for name in list(self.adapters):
            self.free_adapter(name)
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)


class LlamaWorker(Worker):
    """:class:`~.hf_worker.Worker` over a :class:`LlamaModel`; ``base_config`` is the base model's transformers
    config (for the GGUF LoRA tensors' layout). Other arguments as :class:`~.hf_worker.Worker`'s."""

    def __init__(self, llama: LlamaModel, tokenizer, base_config, **kw):
        self.llama = llama
        self.base_config = base_config
        rows = llama_rows(llama)
        self.free_ids = list(range(rows))
        #: free sequence id -> (adapter, prompt) whose cells it still holds (reused in place by the next prompt
        #: on that adapter that starts the same way; cheaper than a prefix cache's copy of a whole KV stream)
        self.kept: dict[int, tuple[str | None, list[int]]] = {}
        self.score_id = rows
        self.cache_ids = list(range(rows + 1, rows + 1 + PREFIX_CACHES))
        self.seq_ids: dict[int, int] = {}  # id(Sequence) -> llama.cpp sequence id
        #: adapter -> (sequence id holding a prompt prefix's cells, its tokens), most recently used last
        self.prefixes: dict[str | None, tuple[int, list[int]]] = {}
        self.last_prompt: dict[str | None, list[int]] = {}  # adapter -> its last prompt prefilled
        self.prefix_tokens_reused = 0  # prompt tokens taken from a prefix cache instead of computed
        self.tmp = Path(tempfile.mkdtemp(prefix="livelora-gguf-lora-"))
        super().__init__(None, tokenizer, device="cpu", **kw)
        self.threads = llama.n_threads

    def _new_slots(self, merge: bool, quantize: bool) -> None:
        return None

    def _share_cores(self) -> None:
        if self.share is None:
            return
        flag, idle, busy = self.share
        want = busy if flag.active() else idle
        if want != self.threads:
            self.llama.set_threads(want)
            self.threads = want

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.tmp, ignore_errors=True)
        if not self.thread.is_alive():  # a step still running after the join's timeout keeps llama.cpp's memory
            self.llama.close()

    # ----- forward passes -------------------------------------------------------------
    def _prefill(self, group: list[Sequence]) -> None:
        for adapter in dict.fromkeys(s.adapter for s in group):
            rows = [s for s in group if s.adapter == adapter]
            self.llama.use(adapter)
            tokens = []
            for s in rows:
                sid = self.seq_ids[id(s)] = min(self.free_ids)  # the lowest: running rows' ids stay a run
                self.free_ids.remove(sid)
                start = self._reuse_kept(adapter, s.prompt, sid) or self._reuse_prefix(adapter, s.prompt, sid)
                n = len(s.prompt)
                tokens += [(s.prompt[pos], pos, sid, pos == n - 1) for pos in range(start, n)]
            logits = [self.llama.decode(tokens[i : i + DECODE_CHUNK]) for i in range(0, len(tokens), DECODE_CHUNK)]
            for s in rows:
                self._keep_prefix(adapter, s.prompt, self.seq_ids[id(s)])
            self._sample_and_emit(rows, torch.from_numpy(np.concatenate(logits)))
            self.running.extend(s for s in rows if not s.finished)
            self._release([s for s in rows if s.finished])

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
        self.prefix_tokens_reused += n
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
        self.prefix_tokens_reused += n
        return n

    def _keep_prefix(self, adapter: str | None, prompt: list[int], sid: int) -> None:
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
                self._drop_prefix(next(iter(self.prefixes)))
            cid = self.cache_ids.pop()
        else:
            self.llama.forget(cid)
        self.llama.copy(sid, cid, n)
        self.prefixes.pop(adapter, None)
        self.prefixes[adapter] = (cid, prompt[:n])

    def _drop_prefix(self, adapter: str | None) -> None:
        self.last_prompt.pop(adapter, None)
        if adapter in self.prefixes:
            cid, _ = self.prefixes.pop(adapter)
            self.llama.forget(cid)
            self.cache_ids.append(cid)

    def _decode_step(self) -> None:
        for adapter in dict.fromkeys(s.adapter for s in self.running):
            rows = [s for s in self.running if s.adapter == adapter]
            self.llama.use(adapter)
            tokens = [(s.next_token, len(s.prompt) + s.num_generated - 1, self.seq_ids[id(s)], True) for s in rows]
            self._sample_and_emit(rows, torch.from_numpy(self.llama.decode(tokens)))
        self.steps += 1
        metrics.BATCH_SIZE.observe(len(self.running))
        self._drop([s for s in self.running if s.finished])

    def _drop(self, gone: list[Sequence]) -> None:
        if not gone:
            return
        gone_ids = {id(s) for s in gone}
        self.running = [s for s in self.running if id(s) not in gone_ids]
        self._release(gone)

    def _release(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            sid = self.seq_ids.pop(id(s), None)
            if sid is not None:  # its prompt's cells stay until the id is taken again (_reuse_kept)
                self.kept[sid] = (s.adapter, s.prompt)
                self.free_ids.append(sid)

    def _reset_batch(self) -> None:
        for adapter in list(self.prefixes):
            self._drop_prefix(adapter)
        for sid in range(self.score_id + 1):  # the running rows' cells and any a failed prefill wrote
            self.llama.forget(sid)
        self.running = []
        self.free_ids = list(range(self.score_id))
        self.seq_ids.clear()
        self.kept.clear()

    # ----- commands (run on this thread between steps) ----------------------------------
    def logits(self, token_ids: list[int], adapter: str | None) -> torch.Tensor:
        """Float32 logits ``(T, vocab)`` of ``token_ids`` on ``adapter`` (for fidelity checks; :meth:`score` keeps
        one chunk at a time)."""
        return torch.cat(list(self._chunks(token_ids, adapter)))

    def _chunks(self, token_ids: list[int], adapter: str | None):
        """Logits of ``token_ids`` on ``adapter``, :data:`DECODE_CHUNK` positions at a time, in the scoring
        sequence (freed afterwards)."""
        self.llama.use(adapter)
        try:
            for start in range(0, len(token_ids), DECODE_CHUNK):
                chunk = token_ids[start : start + DECODE_CHUNK]
                yield torch.from_numpy(
                    self.llama.decode([(t, start + i, self.score_id, True) for i, t in enumerate(chunk)])
                )
        finally:
            self.llama.forget(self.score_id)

    def score(self, token_ids: list[int], adapter: str | None, top_k: int) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None]
        prev, start = None, 0  # the last logits row of the previous chunk predicts this chunk's first token
        for logits in self._chunks(token_ids, adapter):
            ids = token_ids[start : start + len(logits)]
            if prev is not None:
                logits, ids = torch.cat([prev, logits]), [token_ids[start - 1], *ids]
            chosen, tops = prompt_logprobs(logits, torch.tensor(ids), top_k)
            out += [TokenLogprob(t, lp, tp) for t, lp, tp in zip(ids[1:], chosen, tops)]
            start += len(ids) - (prev is not None)
            prev = logits[-1:]
        return out

    def read_adapter(self, path: Path) -> tuple[Any, Path, str]:
        """Read a PEFT directory and write it as a GGUF LoRA (off the worker thread): ``(adapter config dict, the
        GGUF file, sha256 of the weights file)``.

        Raises:
            BadRequestError: unreadable files, or an adapter llama.cpp cannot apply (see
                :func:`~livelora.adapters.gguf_export.gguf_lora_from_state`).
        """
        import hashlib

        from safetensors.torch import load as load_safetensors

        from livelora.adapters.gguf_export import gguf_lora_from_state, write_gguf_lora

        try:
            cfg = json.loads((path / "adapter_config.json").read_text())
            data = (path / "adapter_model.safetensors").read_bytes()
            state = load_safetensors(data)
        except Exception as exc:
            raise BadRequestError(f"cannot read adapter at {path}: {exc}", param="path") from exc
        if cfg.get("peft_type", "LORA") != "LORA":
            raise BadRequestError(f"{path} is not a LoRA adapter", param="path")
        tensors = gguf_lora_from_state(cfg, state, self.base_config)
        out = Path(tempfile.mkstemp(suffix=".gguf", dir=self.tmp)[1])
        write_gguf_lora(out, tensors, path.name)
        return cfg, out, hashlib.sha256(data).hexdigest()

    def _install(self, name: str, config, weights: Path, source: str) -> None:
        """Load the GGUF LoRA ``weights`` (:meth:`read_adapter`) into llama.cpp as version ``name``.

        Raises:
            BadRequestError: llama.cpp cannot apply the file to this base; nothing changes.
        """
        try:
            self.llama.load_adapter(name, weights)  # llama.cpp copies the tensors: the file can go
        finally:
            weights.unlink(missing_ok=True)

    def unload_adapter(self, name: str) -> None:
        self._check_unused(name)
        self._drop_prefix(name)
        for sid in [sid for sid, (adapter, _) in self.kept.items() if adapter == name]:
            del self.kept[sid]
            self.llama.forget(sid)
        self.llama.free_adapter(name)


_LOG: list[Any] = []  # the installed callback, kept alive while llama.cpp may call it
_last_level = [0]


def _log_callback():
    """llama.cpp's log callback: its warnings and errors (ggml levels 3, 4 and their continuation lines, 5) go
    to this module's logger; its information lines are dropped."""
    import llama_cpp as lc

    if not _LOG:

        def emit(level: int, text: bytes, _user) -> None:
            if level != 5:
                _last_level[0] = level
            if _last_level[0] >= 3:
                log.warning("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())

        _LOG.append(lc.llama_log_callback(emit))
    return _LOG[0]


def llama_rows(llama: LlamaModel) -> int:
    """Sequence ids for running rows (all but the scoring one and the prefix caches)."""
    return int(llama.lc.llama_n_seq_max(llama.ctx)) - 1 - PREFIX_CACHES


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
