"""The model behind :class:`~livelora.gateway.engines.llama_cpp.engine.LlamaCppEngine`'s continuous-batching loop
(:mod:`livelora.gateway.engines.batching`): :class:`LlamaBackend`, llama.cpp (``llama-cpp-python``'s C API) doing the
forward passes.

Each running sequence owns one llama.cpp sequence id of a :class:`~livelora.gateway.engines.llama_cpp.lane.Lane` (its
own KV cells). In the base lane llama.cpp applies LoRA adapters per context, not per row, so a step runs one
``llama_decode`` per version among its rows, switching the context's adapter between them. A version that has served
every row for ``MERGE_AFTER_STEPS`` steps gets a merged lane of its own (built off this thread), which its new rows
take. Logits come back as float32 ``(rows, vocab)`` and are sampled by :mod:`.sampling`, as in the transformers
engine. A version is a GGUF LoRA written from the PEFT weights when it loads
(:func:`~livelora.adapters.gguf_export.gguf_lora_from_state`) and freed when it unloads.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from livelora.clients.errors import BadRequestError
from livelora.core.cpu_share import pid_alive
from livelora.gateway.engines.base import TokenLogprob
from livelora.gateway.engines.batching import Forward, Schedule, Sequence
from livelora.gateway.engines.llama_cpp.lane import Lane, merge_gguf_lora
from livelora.gateway.engines.llama_cpp.model import DECODE_CHUNK, LlamaModel
from livelora.gateway.engines.lora_slots import MERGE_AFTER_STEPS
from livelora.gateway.engines.sampling import prompt_logprobs

log = logging.getLogger(__name__)
logging.getLogger("gguf.gguf_writer").setLevel(logging.WARNING)  # three INFO lines for every GGUF LoRA written

#: Name of a worker's directory for its GGUF LoRAs and merged files: ``<prefix><pid>-<random>`` in the temp dir.
TMP_PREFIX = "livelora-gguf-lora-"


class LlamaBackend:
    """A :class:`~livelora.gateway.engines.batching.ModelBackend` over a :class:`LlamaModel` (the base lane) and at
    most one merged lane.

    Args:
        llama: the base lane's model.
        base_config: the base model's transformers config (for the GGUF LoRA tensors' layout).
        schedule: runs a callable on the loop's thread between two steps (wakes it when a merged lane is built).
        gguf: the served file when a version may take a merged lane (float16 weights), else ``None`` (other
            formats serve every version as a LoRA).
        merge: build merged lanes.
    """

    def __init__(
        self, llama: LlamaModel, base_config, schedule: Schedule, *, gguf: Path | None = None, merge: bool = True
    ):
        self.base = Lane(llama)
        self.hot: Lane | None = None  # the merged lane, serving its version's new rows
        self.gguf = gguf
        self.base_config = base_config
        self.seq_ids: dict[int, tuple[Lane, int]] = {}  # id(Sequence) -> its lane and llama.cpp sequence id
        self.prefix_tokens_reused = 0  # prompt tokens taken from kept cells or a prefix cache instead of computed
        sweep_stale_dirs(Path(tempfile.gettempdir()))
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-"))
        self.lora_files: dict[str, Path] = {}  # version -> its GGUF LoRA (kept for a merge)
        self.alone: tuple[str | None, int] = (None, 0)  # the version every running row used, for how many steps
        self.building: threading.Thread | None = None
        self.ready: tuple[str, Path, LlamaModel] | None = None  # a merged lane built, not yet serving
        self.lock = threading.Lock()
        self.schedule = schedule
        self.merge = merge
        self.threads = llama.n_threads

    @property
    def llama(self) -> LlamaModel:
        """The base lane's model (every version's LoRA, scoring)."""
        return self.base.llama

    def set_threads(self, n: int) -> None:
        for lane in self._lanes():
            lane.llama.set_threads(n)
        self.threads = n

    def _lanes(self) -> list[Lane]:
        return [self.base] + ([self.hot] if self.hot is not None else [])

    def close(self, stepping: bool) -> None:
        """Wait for a merged lane being built; free llama.cpp's models unless ``stepping``; remove the GGUF files."""
        if self.building is not None:
            self.building.join(timeout=30)
        if not stepping:  # a step still running after the loop's join timed out keeps llama.cpp's memory
            with self.lock:
                ready, self.ready = self.ready, None
            for llama in ([ready[2]] if ready else []) + [lane.llama for lane in self._lanes()]:
                llama.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # ----- steps (ModelBackend) ---------------------------------------------------------
    def _lane_for(self, adapter: str | None) -> Lane:
        """The merged lane for its version's new rows, unless a newer one waits for it to drain."""
        hot = self.hot
        return hot if hot is not None and hot.version == adapter and self.ready is None else self.base

    def prefill(self, group: list[Sequence]) -> Iterator[Forward]:
        """One pass per adapter version among the group's rows (a lane applies one version at a time), each on
        the rows' sequence ids; a prompt prefix kept from an earlier row is not computed again."""
        self._take_ready()
        for adapter in dict.fromkeys(s.adapter for s in group):
            rows = [s for s in group if s.adapter == adapter]
            lane = self._lane_for(adapter)
            lane.use(adapter)
            tokens = []
            for s in rows:
                sid, start = lane.take(adapter, s.prompt)
                self.seq_ids[id(s)] = (lane, sid)
                self.prefix_tokens_reused += start
                n = len(s.prompt)
                tokens += [(s.prompt[pos], pos, sid, pos == n - 1) for pos in range(start, n)]
            logits = [lane.llama.decode(tokens[i : i + DECODE_CHUNK]) for i in range(0, len(tokens), DECODE_CHUNK)]
            for s in rows:
                lane.keep_prefix(adapter, s.prompt, self.seq_ids[id(s)][1])
            yield rows, torch.from_numpy(np.concatenate(logits))

    def admit(self, rows: list[Sequence], keep: list[int]) -> None:
        kept = set(keep)
        self._release([s for i, s in enumerate(rows) if i not in kept])

    def decode(self, running: list[Sequence]) -> Iterator[Forward]:
        """One pass per (lane, adapter version) among the running rows."""
        groups: dict[tuple[int, str | None], list[Sequence]] = {}
        for s in running:
            groups.setdefault((id(self.seq_ids[id(s)][0]), s.adapter), []).append(s)
        for (_, adapter), rows in groups.items():
            lane = self.seq_ids[id(rows[0])][0]
            lane.use(adapter)
            tokens = [(s.next_token, len(s.prompt) + s.num_generated - 1, self.seq_ids[id(s)][1], True) for s in rows]
            yield rows, torch.from_numpy(lane.llama.decode(tokens))

    def drop(self, running: list[Sequence], keep: list[int]) -> None:
        kept = set(keep)
        self._release([s for i, s in enumerate(running) if i not in kept])

    def _release(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            lane_sid = self.seq_ids.pop(id(s), None)
            if lane_sid is not None:  # its prompt's cells stay until the id is taken again (Lane.take)
                lane_sid[0].release(lane_sid[1], s.adapter, s.prompt)

    def reset(self) -> None:
        for lane in self._lanes():
            lane.reset()
        self.seq_ids.clear()

    # ----- merged lanes ---------------------------------------------------------------
    def decoded(self, running: list[Sequence]) -> None:
        """After a decode step: once one version has served every running row for :data:`MERGE_AFTER_STEPS`
        steps and has no merged lane, build one off this thread (float16 served weights only)."""
        versions = {s.adapter for s in running}
        version = next(iter(versions)) if len(versions) == 1 else None
        steps = self.alone[1] + 1 if version is not None and version == self.alone[0] else 1
        self.alone = (version, steps)
        if (
            version is None
            or steps < MERGE_AFTER_STEPS
            or not self.merge
            or self.gguf is None
            or (self.hot is not None and self.hot.version == version)
            or self.building is not None
            or self.ready is not None
            or version not in self.lora_files
        ):
            return
        lora = self.lora_files[version]
        log.info("building a merged lane for version %s", version)
        self.building = threading.Thread(
            target=self._build, args=(version, lora), name="livelora-llama-merge", daemon=True
        )
        self.building.start()

    def _build(self, version: str, lora: Path) -> None:
        """(Its own thread.) Write ``version``'s merged GGUF and load it with a context shaped as the base lane's."""
        base = self.base.llama
        out = self.tmp / f"merged-{lora.stem}.gguf"
        llama, start = None, time.monotonic()
        try:
            merge_gguf_lora(self.gguf, lora, out)
            llama = LlamaModel(out, n_seq=base.n_seq, n_ctx_seq=base.n_ctx_seq, n_threads=self.threads)
        except Exception:
            if self.lora_files.get(version) == lora:  # (not just unloaded meanwhile, its file gone)
                log.exception("could not build a merged lane for %s; versions stay served as LoRAs", version)
                self.merge = False  # a file that cannot take a merge cannot take the next one either
        finally:
            out.unlink(missing_ok=True)  # llama.cpp maps it: the pages stay while the model lives
            with self.lock:
                if llama is not None:
                    self.ready = (version, lora, llama)
                    log.info("merged lane for version %s built in %.1f s", version, time.monotonic() - start)
                self.building = None
        self.schedule(lambda: None)  # wake the loop (the next prefill takes the lane)

    def _take_ready(self) -> None:
        """Serve a built merged lane once the previous one has no rows (or drop it if its version has gone)."""
        if self.ready is None or (self.hot is not None and self.hot.busy):
            return
        with self.lock:
            (version, lora, llama), self.ready = self.ready, None
        if self.lora_files.get(version) != lora:  # unloaded (and maybe loaded again) while it was built
            llama.close()
            return
        if self.hot is not None:
            self.hot.llama.close()
        llama.set_threads(self.threads)
        self.hot = Lane(llama, version)
        log.info("serving version %s from merged float16 weights", version)

    # ----- commands (run on this thread between steps) ----------------------------------
    def logits(self, token_ids: list[int], adapter: str | None) -> torch.Tensor:
        """Float32 logits ``(T, vocab)`` of ``token_ids`` on ``adapter`` (for fidelity checks; :meth:`score` keeps
        one chunk at a time)."""
        return torch.cat(list(self._chunks(token_ids, adapter)))

    def _chunks(self, token_ids: list[int], adapter: str | None):
        """Logits of ``token_ids`` on ``adapter``, :data:`DECODE_CHUNK` positions at a time, in the scoring
        sequence (freed afterwards)."""
        lane = self.base  # every version as its LoRA, merged lane or not
        lane.use(adapter)
        try:
            for start in range(0, len(token_ids), DECODE_CHUNK):
                chunk = token_ids[start : start + DECODE_CHUNK]
                yield torch.from_numpy(
                    lane.llama.decode([(t, start + i, lane.score_id, True) for i, t in enumerate(chunk)])
                )
        finally:
            lane.llama.forget(lane.score_id)

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

    def install(self, name: str, config, weights: Path, source: str) -> None:
        """Load the GGUF LoRA ``weights`` (:meth:`read_adapter`) into llama.cpp as version ``name`` (the file is
        kept for a merged lane until the version unloads).

        Raises:
            BadRequestError: llama.cpp cannot apply the file to this base; nothing changes.
        """
        try:
            self.llama.load_adapter(name, weights)
        except BaseException:
            weights.unlink(missing_ok=True)
            raise
        self.lora_files[name] = weights

    def uninstall(self, name: str) -> None:
        """Free its LoRA in llama.cpp (unless it is cold), its merged lane, its prompt-prefix cells and its GGUF
        file."""
        if name in self.llama.adapters:
            self.evict(name)
        lora = self.lora_files.pop(name, None)
        if lora is not None:
            lora.unlink(missing_ok=True)

    def evict(self, name: str) -> None:
        """Free its LoRA in llama.cpp, its merged lane and its prompt-prefix cells; its GGUF file stays (the cold
        copy)."""
        self.base.drop_version(name)
        if self.hot is not None and self.hot.version == name:
            self.hot.llama.close()
            self.hot = None
        self.llama.free_adapter(name)

    def restore(self, name: str) -> None:
        """Load its GGUF LoRA into llama.cpp again."""
        self.llama.load_adapter(name, self.lora_files[name])

    def version_bytes(self, name: str) -> int:
        """The GGUF LoRA's size (llama.cpp holds its tensors as the file stores them)."""
        return self.lora_files[name].stat().st_size


def sweep_stale_dirs(tmp: Path) -> None:
    """Remove the GGUF directories of workers whose process is gone (killed before :meth:`LlamaBackend.close`)."""
    for path in tmp.glob(f"{TMP_PREFIX}*-*"):
        pid = path.name[len(TMP_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
