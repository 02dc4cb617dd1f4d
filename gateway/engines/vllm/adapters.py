"""Adapter versions of the vLLM engine: a never-reused integer id and an immutable snapshot per version name.

:class:`VLLMAdapters` loads every version under its own name, its own integer id (from a counter that only
grows) and its own immutable path, a private snapshot copy (``/dev/shm`` when present), and never reloads in
place or sets ``load_inplace``: vLLM caches adapters by id, compares requests by name, keys prefix-cache blocks
by ``(name, path)`` and reloads evicted adapters lazily from their path, so reusing any of them serves stale
weights (vllm #5105, #33791). A version is removed only when no unfinished request uses it
(:class:`AdapterLeases` counts its users). vLLM is imported only inside :meth:`VLLMAdapters.load`.
The rules and why: ``docs/internals/engines.md``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any

from livelora.clients.errors import BadRequestError, ConflictError, ModelNotFoundError

#: Adapter features vLLM refuses (vllm/lora/peft_helper.py); checked up front for a clear 400.
_UNSUPPORTED_ADAPTER_FIELDS = {"use_dora": "DoRA", "lora_bias": "lora_bias", "layer_replication": "layer_replication"}


class VLLMAdapters:
    """The adapter versions loaded in one vLLM engine (rules: docs/internals/engines.md).

    Args:
        max_lora_rank: the largest rank the engine was started with (bigger adapters are refused).
        snapshot_root: where the private snapshot directory is made (:meth:`open`).
    """

    def __init__(self, max_lora_rank: int, snapshot_root: Path):
        self.max_lora_rank = max_lora_rank
        self.snapshot_root = Path(snapshot_root)
        self.snapshots: Path | None = None
        self._next_lora_id = 1  # vLLM lora_int_id: > 0, never reused
        self.requests: dict[str, Any] = {}  # name -> vllm LoRARequest (loaded, servable)
        self._loading: set[str] = set()
        self._unloading: set[str] = set()

    def open(self) -> None:
        """Make this process's snapshot directory (``livelora-vllm-<pid>-*`` under ``snapshot_root``)."""
        self.snapshots = Path(tempfile.mkdtemp(prefix=f"livelora-vllm-{os.getpid()}-", dir=self.snapshot_root))

    def close(self) -> None:
        """Forget every version and delete the snapshots."""
        self.requests.clear()
        if self.snapshots is not None:
            shutil.rmtree(self.snapshots, ignore_errors=True, onerror=None)
            self.snapshots = None

    def check(self, adapter: str | None) -> None:
        """Raises: ModelNotFoundError when ``adapter`` is given and is not loaded (or is being unloaded)."""
        if adapter is not None and (adapter not in self.requests or adapter in self._unloading):
            raise ModelNotFoundError(f"adapter {adapter!r} is not loaded", param="model")

    def request(self, adapter: str | None) -> Any:
        """The ``LoRARequest`` of ``adapter`` (``None`` for the base model)."""
        return self.requests[adapter] if adapter is not None else None

    def loaded(self) -> list[str]:
        return [n for n in self.requests if n not in self._unloading]

    def lora_int_id(self, name: str) -> int:
        """The vLLM integer id of loaded adapter ``name``. Raises: ModelNotFoundError (not loaded)."""
        self.check(name)
        return self.requests[name].lora_int_id

    def _snapshot(self, name: str, src: Path, lora_id: int) -> Path:
        """Copy the adapter files into a private, read-only directory named by the integer id."""
        assert self.snapshots is not None
        dest = self.snapshots / f"{lora_id:08d}"
        tmp = self.snapshots / f".tmp-{lora_id:08d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for f in src.iterdir():
            if f.is_file() and (f.name == "adapter_config.json" or f.name.startswith("adapter_model")):
                shutil.copyfile(f, tmp / f.name)
                os.chmod(tmp / f.name, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        os.rename(tmp, dest)
        return dest

    def check_dir(self, path: Path) -> dict:
        """The adapter config of ``path`` if vLLM can serve it.

        Raises:
            BadRequestError: not a PEFT LoRA directory, a feature vLLM does not serve (DoRA, biases, ...), a rank
                above ``max_lora_rank``, or no weights file.
        """
        cfg_file = path / "adapter_config.json"
        if not cfg_file.is_file():
            raise BadRequestError(f"{path} is not a PEFT adapter directory (no adapter_config.json)", param="path")
        try:
            cfg = json.loads(cfg_file.read_text())
        except ValueError as exc:
            raise BadRequestError(f"cannot read adapter at {path}: {exc}", param="path") from exc
        if str(cfg.get("peft_type", "")).upper() != "LORA":
            raise BadRequestError(
                f"adapter at {path} is {cfg.get('peft_type')}; only LoRA adapters are served", param="path"
            )
        for key, what in _UNSUPPORTED_ADAPTER_FIELDS.items():
            if cfg.get(key):
                raise BadRequestError(f"adapter at {path} uses {what}, which vLLM does not serve", param="path")
        if cfg.get("bias", "none") != "none":
            raise BadRequestError(
                f"adapter at {path} trains biases (bias={cfg['bias']!r}); vLLM serves bias='none' only", param="path"
            )
        ranks = [int(cfg.get("r", 0))] + [int(v) for v in (cfg.get("rank_pattern") or {}).values()]
        if max(ranks) > self.max_lora_rank:
            raise BadRequestError(
                f"adapter at {path} has rank {max(ranks)} > max_lora_rank {self.max_lora_rank}", param="path"
            )
        if not any(f.name.startswith("adapter_model") for f in path.iterdir()):
            raise BadRequestError(f"adapter at {path} has no adapter_model.safetensors", param="path")
        return cfg

    async def load(self, llm, name: str, path: str) -> None:
        """Snapshot the directory, then vLLM ``add_lora`` under a new integer id (see
        :meth:`~livelora.gateway.engines.vllm.engine.VLLMEngine.load_adapter`).

        Raises:
            BadRequestError: empty name, missing directory, not servable, or vLLM rejects the weights.
            ConflictError: ``name`` is loaded (names are never reloaded in place).
        """
        from vllm.lora.request import LoRARequest

        if not isinstance(name, str) or not name.strip() or name == "__base__":
            raise BadRequestError(f"invalid adapter name {name!r}", param="name")
        if name in self.requests or name in self._loading:
            raise ConflictError(f"adapter {name!r} is already loaded; load new weights under a new name", param="name")
        src = Path(path)
        if not src.is_absolute() or not src.is_dir():
            raise BadRequestError(f"adapter path {path!r} is not an existing absolute directory", param="path")
        self._loading.add(name)
        lora_id = self._next_lora_id
        self._next_lora_id += 1
        snap: Path | None = None
        try:
            await asyncio.to_thread(self.check_dir, src)
            snap = await asyncio.to_thread(self._snapshot, name, src, lora_id)
            req = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=str(snap))
            try:
                await llm.add_lora(req)
            except Exception as exc:
                raise BadRequestError(f"vLLM could not load the adapter at {path}: {exc}", param="path") from exc
            self.requests[name] = req
            snap = None
        finally:
            self._loading.discard(name)
            if snap is not None:
                shutil.rmtree(snap, ignore_errors=True)

    async def unload(self, llm, name: str, users: int) -> None:
        """vLLM ``remove_lora``, then delete the snapshot.

        Args:
            users: unfinished requests that use ``name`` now (:meth:`AdapterLeases.users`).

        Raises:
            ModelNotFoundError: ``name`` is not loaded.
            ConflictError: ``users`` > 0 (nothing changes).
        """
        if name not in self.requests or name in self._unloading:
            raise ModelNotFoundError(f"adapter {name!r} is not loaded", param="model")
        if users:
            raise ConflictError(f"adapter {name!r} is in use by {users} unfinished requests", param="name")
        req = self.requests[name]
        self._unloading.add(name)  # new requests for it fail from now on
        try:
            await llm.remove_lora(req.lora_int_id)
        except BaseException:
            self._unloading.discard(name)
            raise
        del self.requests[name]
        self._unloading.discard(name)
        await asyncio.to_thread(shutil.rmtree, req.lora_path, True)


class AdapterLeases:
    """The unfinished requests of one engine, by request id, and the adapter each uses (``None``: the base model);
    thread-safe (the gateway counts them from other threads)."""

    def __init__(self) -> None:
        self._running: dict[str, str | None] = {}
        self._lock = threading.Lock()

    def lease(self, rid: str, adapter: str | None) -> None:
        """Record request ``rid`` as using ``adapter`` until :meth:`release`.

        Raises:
            ConflictError: ``rid`` is already running.
        """
        with self._lock:
            if rid in self._running:
                raise ConflictError(f"request id {rid!r} is already running", param="request_id")
            self._running[rid] = adapter

    def release(self, rid: str) -> None:
        """End request ``rid``'s lease (idempotent)."""
        with self._lock:
            self._running.pop(rid, None)

    def count(self) -> int:
        with self._lock:
            return len(self._running)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._running)

    def users(self, name: str) -> int:
        """Unfinished requests that use adapter ``name``."""
        with self._lock:
            return sum(1 for a in self._running.values() if a == name)

    async def wait_drained(self, name: str, timeout_s: float | None = None) -> None:
        """Wait until no unfinished request uses adapter ``name``.

        Raises:
            TimeoutError: still in use after ``timeout_s`` seconds.
        """

        async def _wait() -> None:
            while self.users(name):
                await asyncio.sleep(0.02)

        await asyncio.wait_for(_wait(), timeout_s)
