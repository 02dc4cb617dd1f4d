"""The checks a version passes before it serves: loaded into the engine under its never-reused name, the sha256
of its weights as loaded equals the manifest's, and a forward pass on a few canary tokens gives finite logprobs
≤ 0 (:meth:`VersionChecks.load`). A version failing them is unloaded and remembered as refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from pathlib import Path

from livelora.adapters.store import WEIGHTS_FILE, Manifest, sha256_file
from livelora.clients.errors import BadRequestError, LiveloraError
from livelora.gateway.engines.base import AdapterCheck, Engine

#: Text whose first :data:`CANARY_TOKENS` tokens form the canary forward pass of every installed version.
CANARY_TEXT = "The quick brown fox jumps over the lazy dog. 1 2 3"
#: Canary length in tokens: enough to run every layer (attention included) on a few positions; each token
#: adds about 10 ms of CPU forward time to a swap on SmolLM2-135M, so it is kept short.
CANARY_TOKENS = 4


def check_version(manifest: Manifest, result: AdapterCheck) -> None:
    """The checks a loaded version must pass before it serves (:meth:`VersionChecks.load`).

    Args:
        result: what :meth:`Engine.load_and_check` found (sha256 of the weights as loaded, canary logprobs).

    Raises:
        BadRequestError: sha256 differs from the manifest's, or canary logprobs that are missing,
            non-finite or positive.
    """
    if result.sha256 != manifest.sha256:
        raise BadRequestError(
            f"{manifest.name}: weights sha256 {result.sha256[:12]}… does not match the "
            f"manifest's {manifest.sha256[:12]}…",
            param="adapter",
        )
    values = [t.logprob for t in result.canary if t is not None]
    if not values or not all(math.isfinite(v) and v <= 1e-6 for v in values):
        raise BadRequestError(
            f"{manifest.name}: canary forward pass gave invalid logprobs {values[:4]}", param="adapter"
        )


class VersionChecks:
    """Checked loads into one engine.

    Attributes:
        refused: adapter name → reason, for versions that failed their checks (never retried).
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.refused: dict[str, str] = {}
        self._canary: list[int] | None = None

    def canary_tokens(self) -> list[int]:
        """Token ids of :data:`CANARY_TEXT` under the engine's tokenizer (≥ 2 tokens)."""
        if self._canary is None:
            ids = list(self.engine.tokenizer.encode(CANARY_TEXT, add_special_tokens=False))
            self._canary = ids[:CANARY_TOKENS]
        return self._canary

    async def load(self, manifest: Manifest, path: Path) -> None:
        """Load ``manifest``'s version from ``path`` (its directory) and check it (:func:`check_version`); a
        version already in the engine is checked as it is.

        Raises:
            BadRequestError: it failed a check or the engine refused it (it is unloaded and recorded in
                :attr:`refused`).
        """
        name = manifest.name
        try:
            if name in self.engine.loaded_adapters():  # loaded by someone else: check it as it is
                digest = await asyncio.to_thread(sha256_file, path / WEIGHTS_FILE)
                result = AdapterCheck(digest, await self.engine.score(self.canary_tokens(), adapter=name))
            else:
                result = await self.engine.load_and_check(name, str(path), self.canary_tokens())
            check_version(manifest, result)
        except BaseException as exc:
            if name in self.engine.loaded_adapters():
                with contextlib.suppress(LiveloraError):
                    await self.engine.unload_adapter(name)
            if isinstance(exc, BadRequestError):
                self.refused[name] = str(exc)
                raise
            if isinstance(exc, (LiveloraError, OSError)):
                self.refused[name] = f"engine refused it: {exc}"
                raise BadRequestError(f"{name}: the engine refused it: {exc}", param="adapter") from exc
            raise
