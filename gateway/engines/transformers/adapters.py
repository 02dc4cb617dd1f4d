"""The transformers engine's adapter table: which names are loaded (and from which directory) or loading.

:class:`LoadedAdapters` checks names, reads a PEFT directory on a thread (:func:`read_adapter`) and installs or
removes the weights on the worker thread between decode steps (:mod:`.lora_slots`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from livelora.clients.errors import BadRequestError, ConflictError, ModelNotFoundError
from livelora.gateway.engines.transformers.calls import on_worker


class LoadedAdapters:
    """Adapter names of one :class:`~livelora.gateway.engines.transformers.engine.TransformersEngine` (its
    :class:`~livelora.gateway.engines.batching.BatchingLoop` reads and installs the weights: the backend's
    ``read_adapter`` on a thread, ``load_adapter`` between decode steps)."""

    def __init__(self):
        self.paths: dict[str, str] = {}  # name -> path, loaded and servable
        self.loading: set[str] = set()  # names whose load is in progress

    def check(self, adapter: str | None) -> None:
        """Raises :class:`ModelNotFoundError` unless ``adapter`` is ``None`` (the base model) or loaded."""
        if adapter is not None and adapter not in self.paths:
            raise ModelNotFoundError(f"adapter {adapter!r} is not loaded", param="model")

    def names(self) -> list[str]:
        return list(self.paths)

    async def load(self, worker, name: str, path: str, canary: list[int] | None) -> tuple[str, Any]:
        """Load ``path`` as ``name``: ``(sha256 of the weights file, canary scores or None)``.

        Raises:
            BadRequestError: empty name, missing directory, not LoRA, or weights that do not fit.
            ConflictError: ``name`` is loaded or loading.
        """

        async def install(p: Path) -> tuple[str, Any]:
            config, weights, digest = await asyncio.to_thread(worker.backend.read_adapter, p)
            return digest, await on_worker(worker, lambda: worker.load_adapter(name, config, weights, str(p), canary))

        return await self.load_with(name, path, install)

    async def load_with(
        self, name: str, path: str, install: Callable[[Path], Awaitable[tuple[str, Any]]]
    ) -> tuple[str, Any]:
        """Check ``name`` and ``path``, then ``await install(path)`` with the name reserved; the name serves once
        it returns (what it returns is returned). Raises as :meth:`load`, and what ``install`` raises."""
        if not isinstance(name, str) or not name.strip() or name == "__base__":
            raise BadRequestError(f"invalid adapter name {name!r}", param="name")
        if name in self.paths or name in self.loading:
            raise ConflictError(f"adapter {name!r} is already loaded; load new weights under a new name", param="name")
        p = Path(path)
        if not (p / "adapter_config.json").is_file():
            raise BadRequestError(f"{path} is not a PEFT adapter directory (no adapter_config.json)", param="path")
        self.loading.add(name)  # reserves the name; generate() rejects it until the load is done
        try:
            result = await install(p)
            self.paths[name] = str(p)
        finally:
            self.loading.discard(name)
        return result

    async def unload(self, worker, name: str) -> None:
        """Raises :class:`ModelNotFoundError` (not loaded) or the worker's :class:`ConflictError` (in use; the
        name then stays loaded)."""
        await self.unload_with(name, lambda: on_worker(worker, lambda: worker.unload_adapter(name)))

    async def unload_with(self, name: str, remove: Callable[[], Awaitable[Any]]) -> None:
        """:meth:`unload` with ``await remove()`` doing the removal."""
        if name not in self.paths:
            raise ModelNotFoundError(f"adapter {name!r} is not loaded", param="model")
        path = self.paths.pop(name)  # new requests for it fail from now on
        try:
            await remove()
        except BaseException:
            self.paths[name] = path
            raise


def read_adapter(path: Path, device: str) -> tuple[Any, dict[str, Any], str]:
    """Read a PEFT adapter directory: ``(LoraConfig, state dict on device, sha256 hex of the weights file)``.

    ``adapter_model.safetensors`` is read once; the digest is of exactly the bytes parsed. A directory with
    only ``adapter_model.bin`` is read by peft (digest of that file).

    Raises:
        BadRequestError: unreadable config or weights.
    """
    import hashlib

    from peft import PeftConfig
    from peft.utils import load_peft_weights

    try:
        config = PeftConfig.from_pretrained(str(path))
        st = path / "adapter_model.safetensors"
        if st.is_file():
            from safetensors.torch import load as load_safetensors

            data = st.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            weights = {k: v.to(device) for k, v in load_safetensors(data).items()}
        else:
            weights = load_peft_weights(str(path), device=device)
            digest = hashlib.sha256((path / "adapter_model.bin").read_bytes()).hexdigest()
    except Exception as exc:
        raise BadRequestError(f"cannot read adapter at {path}: {exc}", param="path") from exc
    return config, weights, digest
