"""What every part of the training-session services shares: Redis, the engine, the store, the base model."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aredis

from livelora.adapters.store import AdapterStore
from livelora.clients.errors import NotFoundError
from livelora.core.bus import redis_unavailable
from livelora.core.redis_keys import KeyLayout
from livelora.core.settings import SessionSection
from livelora.gateway.engines.base import Engine

log = logging.getLogger(__name__)


@dataclass
class SessionContext:
    """Shared state of the session services.

    Attributes:
        redis: ``redis.asyncio.Redis`` with ``decode_responses=True``.
        keys: key layout (prefix).
        engine: the serving engine (sampling, adapters, vocabulary size).
        home: ``LIVELORA_HOME``.
        base_model: the served base-model name; ``base_names`` holds it and the other accepted names.
        settings: session timings.
        max_seq_len: cap on a training sequence (tokens; ``None``: the engine's context window).
        quotas: per-tenant limits (:class:`~livelora.gateway.services.tenants.limits.QuotaService`; ``None``: none).
    """

    redis: aredis.Redis
    keys: KeyLayout
    engine: Engine
    home: Path
    base_model: str
    base_names: set[str]
    settings: SessionSection
    max_seq_len: int | None = None
    quotas: Any = None
    store: AdapterStore = field(init=False)
    _tokenizer_id: str | None = field(default=None, init=False, repr=False)
    _tokenizer_body: tuple[str, bytes] | None = field(default=None, init=False, repr=False)
    _tokenizer_dir: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.home = Path(self.home)
        self.store = AdapterStore(self.home)

    def ttl_ms(self) -> int:
        """A session's life without a heartbeat (milliseconds)."""
        return int(self.settings.session_ttl_s * 1000)

    def check_base(self, name: str | None) -> None:
        """Raises: NotFoundError when ``name`` is given and is not the served base model."""
        if name is not None and name not in self.base_names:
            raise NotFoundError(
                f"base model {name!r} is not served here; this server serves {self.base_model!r}", param="base_model"
            )

    async def require_session(self, session_id: str) -> None:
        """Raises: NotFoundError for an unknown or ended session; UnavailableError when Redis is down."""
        with redis_unavailable():
            if not await self.redis.exists(self.keys.session(session_id)):
                raise NotFoundError(
                    f"session {session_id!r} does not exist or has ended; create a new session", param="session_id"
                )

    def tokenizer_id(self) -> str:
        """The tokenizer's name (Tinker's ``tokenizer_id``; a caller on this machine gets :meth:`local_tokenizer_dir`
        from ``get_info`` instead), never a server path: the base model's canonical hub
        id when one is known (a built-in model's, or the hub id it was loaded from), else the served base-model
        name (:func:`~livelora.core.base_models.canonical_tokenizer_id`). Clients load it by that id from their
        Hugging Face cache or the hub, and otherwise fetch the files from ``GET /api/v1/tokenizer``
        (:meth:`tokenizer_files`)."""
        from livelora.core.base_models import canonical_tokenizer_id

        if self._tokenizer_id is None:
            source = str(getattr(self.engine.tokenizer, "name_or_path", "") or "")
            self._tokenizer_id = canonical_tokenizer_id(self.base_names, source, self.base_model)
        return self._tokenizer_id

    async def tokenizer_files(self) -> tuple[str, bytes]:
        """The base model's tokenizer files as ``GET /api/v1/tokenizer`` answers them: ``(revision, JSON body of a
        TokenizerFilesResponse)``; read once (in a thread) and kept, since the served base model does not change.

        Raises:
            BadRequestError: the tokenizer's source holds no tokenizer files.
        """
        if self._tokenizer_body is None:
            self._tokenizer_body = await asyncio.to_thread(self._read_tokenizer_files)
        return self._tokenizer_body

    async def local_tokenizer_dir(self) -> str | None:
        """The folder holding the base model's tokenizer files for a client on this machine: placed once (in a
        thread) in livelora's tokenizer cache (:func:`~livelora.clients.tokenizer_files.store_tokenizer`, the
        folder livelora's SDK fetches into; ``LIVELORA_TOKENIZER_CACHE`` moves it), never the store. An id the
        official tinker SDK and ``AutoTokenizer.from_pretrained`` load with no hub request. ``None`` when the files
        could not be placed (no tokenizer files at the source, an unwritable cache; logged once)."""
        if self._tokenizer_dir is None:
            self._tokenizer_dir = await asyncio.to_thread(self._place_tokenizer)
        return self._tokenizer_dir or None

    def _place_tokenizer(self) -> str:
        from livelora.clients.errors import BadRequestError
        from livelora.clients.tokenizer_files import store_tokenizer
        from livelora.core.base_models import tokenizer_files

        source = str(getattr(self.engine.tokenizer, "name_or_path", "") or self.base_model)
        try:
            return str(store_tokenizer(self.tokenizer_id(), tokenizer_files(source)))
        except (BadRequestError, OSError) as exc:
            log.warning("tokenizer files not placed for local clients (get_info names the hub id): %s", exc)
            return ""

    def _read_tokenizer_files(self) -> tuple[str, bytes]:
        from livelora.core.base_models import tokenizer_files
        from livelora.core.served_tokenizer import to_response

        source = str(getattr(self.engine.tokenizer, "name_or_path", "") or self.base_model)
        aliases = sorted({self.base_model} - {self.tokenizer_id()})
        res = to_response(self.tokenizer_id(), tokenizer_files(source), aliases)
        return res.revision, res.model_dump_json().encode()
