"""What every part of the training-session services shares: Redis, the engine, the store, the base model."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aredis

from livelora.adapters.bus import redis_unavailable
from livelora.adapters.redis_keys import KeyLayout
from livelora.adapters.settings import SessionSection
from livelora.adapters.store import AdapterStore
from livelora.clients.errors import NotFoundError
from livelora.gateway.engines.base import Engine


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
        quotas: per-tenant limits (:class:`~livelora.gateway.services.quotas.QuotaService`; ``None``: none).
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

    def __post_init__(self) -> None:
        self.home = Path(self.home)
        self.store = AdapterStore(self.home)

    def ttl_ms(self) -> int:
        """A session's life without a heartbeat (milliseconds)."""
        return int(self.settings.session_ttl_s * 1000)

    def check_base(self, name: str | None) -> None:
        """Raises: NotFoundError when ``name`` is given and is not the served base model."""
        if name is not None and name not in self.base_names:
            raise NotFoundError(f"base model {name!r} is not served here; this server serves {self.base_model!r}",
                                param="base_model")

    async def require_session(self, session_id: str) -> None:
        """Raises: NotFoundError for an unknown or ended session; UnavailableError when Redis is down."""
        with redis_unavailable():
            if not await self.redis.exists(self.keys.session(session_id)):
                raise NotFoundError(f"session {session_id!r} does not exist or has ended; create a new session",
                                    param="session_id")

    def tokenizer_id(self) -> str:
        """The tokenizer's name (Tinker's ``tokenizer_id``): the base model's hub id when this machine's Hugging
        Face cache resolves it (``livelora hf-cache`` places it there; clients on this machine then load it by
        that id, as tinker-cookbook does), else the tokenizer's own local path (what livelora's SDK loads)."""
        from huggingface_hub import constants, try_to_load_from_cache

        for hub in sorted(n for n in self.base_names if n.count("/") == 1 and not n.startswith(("/", "."))):
            if isinstance(try_to_load_from_cache(hub, "tokenizer_config.json", cache_dir=constants.HF_HUB_CACHE), str):
                return hub
        return str(getattr(self.engine.tokenizer, "name_or_path", "") or self.base_model)
