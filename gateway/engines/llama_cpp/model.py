"""llama.cpp through ``llama-cpp-python``'s C API: :class:`LlamaModel` (a GGUF model and one context) and
:func:`served_gguf` (the GGUF file in the served format)."""

from __future__ import annotations

import ctypes
import logging
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from livelora.clients.errors import BadRequestError, InternalError

log = logging.getLogger(__name__)

#: Tokens per ``llama_decode`` call (llama.cpp's ``n_batch`` and ``n_ubatch``); also bounds the float32 logits
#: buffer of a scoring chunk (``512 × vocab``).
DECODE_CHUNK = 512
#: Served weight formats (``LIVELORA_ENGINE_WEIGHTS``): the file's own types, or every tensor converted to
#: float16 (llama.cpp's ``LLAMA_FTYPE_MOSTLY_F16``); measured side by side in ``docs/serving.md``.
GGUF_FORMATS = {"gguf": None, "f16": 1}
#: Test hook: ``canary`` or ``engine`` makes the first ``llama_decode`` of the start-up canary
#: (:mod:`livelora.gateway.engines.llama_cpp.canary`) or of a serving engine segfault in native code; unset in normal
# use.
CRASH_ENV = "LIVELORA_NATIVE_CRASH_AT"
#: Test hook: a serving engine's ``llama_decode`` segfaults while the file this names exists (a crash on demand).
CRASH_FILE_ENV = "LIVELORA_NATIVE_CRASH_FILE"


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
        n_ctx_seq: KV cells per sequence. n_threads: llama.cpp threads. role: ``engine`` or ``canary``
        (for the :data:`CRASH_ENV` test hook).

    Raises:
        BadRequestError: llama.cpp cannot load ``gguf`` or create the context.
    """

    def __init__(self, gguf: Path, *, n_seq: int, n_ctx_seq: int, n_threads: int, role: str = "engine"):
        import llama_cpp as lc

        self.crash = os.environ.get(CRASH_ENV) == role
        self.crash_file = os.environ.get(CRASH_FILE_ENV) if role == "engine" else None

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
        self.n_threads, self.n_seq, self.n_ctx_seq = n_threads, n_seq, n_ctx_seq
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
        if self.crash or (self.crash_file and os.path.exists(self.crash_file)):  # the test hooks:
            # a read of address 0 in native code, as a crashing kernel would
            ctypes.string_at(0)
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


_LOG: list[Any] = []  # the installed callback, kept alive while llama.cpp may call it
_last_level = [0]
_seen: set[str] = set()  # messages logged, names and numbers blanked (:func:`_log_callback`)
#: A quoted name with a dot or a digit in it (a tensor's, a file's): blanked when comparing messages.
_NAME = re.compile(r"'[^']*[.\d][^']*'")


def _log_callback():
    """llama.cpp's log callback: its warnings and errors (ggml levels 3, 4 and their continuation lines, 5) go
    to this module's logger, each warning once per process (one that differs from a logged one only in a quoted
    name or a number is dropped: a LoRA on an AMX build warns once per tensor); its information lines are dropped."""
    import llama_cpp as lc

    if not _LOG:

        def emit(level: int, text: bytes, _user) -> None:
            if level != 5:
                _last_level[0] = level
            if _last_level[0] < 3:
                return
            line = text.decode("utf-8", "replace").rstrip()
            key = re.sub(r"\d+", "#", _NAME.sub("'*'", line))
            if _last_level[0] == 3:
                if key in _seen or len(_seen) >= 10_000:
                    return
                _seen.add(key)
            log.warning("llama.cpp: %s", line)

        _LOG.append(lc.llama_log_callback(emit))
    return _LOG[0]
