"""Sampling defaults for chat and legacy completion requests that omit them, taken as vLLM takes them.

A request that omits ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty`` or ``min_p`` gets, field by
field, the value the served model's ``generation_config.json`` sets (``LIVELORA_GENERATION_CONFIG=auto``, the
default, like vLLM's ``--generation-config auto``), else OpenAI's (temperature 1, top_p 1, the others off); a value
the request gives always wins. ``none`` ignores the file (vLLM's ``--generation-config vllm``); a directory reads
the ``generation_config.json`` in it instead. ``do_sample`` is not read (nor by vLLM): ``temperature: 0`` asks for
greedy decoding. ``max_new_tokens`` (which vLLM also reads) and values out of range are not applied, and
:meth:`SamplingDefaults.describe` (``GET /v1/models/{id}``) lists them.
The defaults change which tokens are drawn, not what a logprob is (:mod:`livelora.gateway.engines.base`).
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from livelora.clients.types.openai import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)

#: Fields a generation config may default, with OpenAI's value when it does not.
OPENAI_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
}
#: Fields vLLM also reads from a generation config that no engine here honours, with their neutral value.
NOT_HONOURED: dict[str, Any] = {"max_new_tokens": None}

Body = TypeVar("Body", ChatCompletionRequest, CompletionRequest)


@dataclass(frozen=True)
class SamplingDefaults:
    """What an omitted sampling field gets.

    Attributes:
        setting: ``auto``, ``none`` or ``directory`` (never the path: clients see it).
        values: the fields the generation config sets and the engines honour (``temperature`` >= 0,
            ``top_p`` in (0, 1], ``top_k`` >= 0 with 0 off, ``repetition_penalty`` > 0, ``min_p`` in [0, 1]).
        not_applied: fields of the file that were not applied, with the reason.
    """

    setting: str
    values: dict[str, float | int] = field(default_factory=dict)
    not_applied: dict[str, str] = field(default_factory=dict)

    def apply(self, body: Body) -> Body:
        """``body`` with each omitted field of :data:`OPENAI_DEFAULTS` set from :attr:`values` (as given otherwise)."""
        missing = {k: v for k, v in self.values.items() if getattr(body, k) is None}
        return body.model_copy(update=missing) if missing else body

    def describe(self) -> dict[str, Any]:
        """``{<each field of OPENAI_DEFAULTS>, "from_generation_config": [...], "generation_config": setting}``
        (plus ``"not_applied": {field: reason}`` when the file sets fields the server cannot honour)."""
        out: dict[str, Any] = {**OPENAI_DEFAULTS, **self.values}
        out["from_generation_config"] = sorted(self.values)
        out["generation_config"] = self.setting
        if self.not_applied:
            out["not_applied"] = dict(self.not_applied)
        return out


def read_defaults(config: dict[str, Any], setting: str) -> SamplingDefaults:
    """The defaults a parsed ``generation_config.json`` gives (values out of range are not applied, with why)."""
    values: dict[str, float | int] = {}
    skipped: dict[str, str] = {}
    for name in OPENAI_DEFAULTS:
        value = config.get(name)
        if value is None:
            continue
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if name == "top_k" and ok and value <= 0:
            value = 0  # Hugging Face and vLLM spell "off" as 0 or -1
        if ok and (
            (name == "temperature" and 0 <= value <= 2)
            or (name == "top_p" and 0 < value <= 1)
            or (name == "top_k" and float(value).is_integer())
            or (name == "repetition_penalty" and 0 < value < float("inf"))
            or (name == "min_p" and 0 <= value <= 1)
        ):
            values[name] = int(value) if name == "top_k" else float(value)
        else:
            skipped[name] = f"{value!r} is out of range"
    for name, neutral in NOT_HONOURED.items():
        if config.get(name) not in (None, neutral):
            skipped[name] = f"{config[name]!r}: not read (a request's max_tokens decides)"
    return SamplingDefaults(setting, values, skipped)


def _config_file(model: str, home: Path) -> Path | None:
    """The served model's ``generation_config.json``: in its directory, or in the Hugging Face cache for a hub id."""
    from livelora.core.base_models import GENERATION_CONFIG, resolve_base_model

    ref = resolve_base_model(model, home)
    if ref.is_local:
        return Path(ref.path) / GENERATION_CONFIG
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(ref.path, GENERATION_CONFIG)
    return Path(found) if isinstance(found, str) else None


@functools.lru_cache(maxsize=16)
def _resolve(model: str, home: str, setting: str) -> SamplingDefaults:
    if setting == "none":
        return SamplingDefaults("none")
    path = (
        _config_file(model, Path(home)) if setting == "auto" else Path(setting).expanduser() / "generation_config.json"
    )
    label = "auto" if setting == "auto" else "directory"
    if path is None or not path.is_file():
        if label == "directory":
            raise ValueError(f"LIVELORA_GENERATION_CONFIG={setting!r}: no generation_config.json there")
        defaults = SamplingDefaults(label)
    else:
        defaults = read_defaults(json.loads(path.read_text()), label)
    log.info("sampling defaults for requests that omit them: %s", defaults.describe())
    return defaults


def for_settings(settings: Any) -> SamplingDefaults:
    """The defaults of a gateway (``settings``: :class:`~livelora.gateway.settings.GatewaySettings`); read once.

    Raises:
        ValueError: ``generation_config`` names a directory without a ``generation_config.json``.
    """
    return _resolve(settings.model, str(settings.home), settings.inference.generation_config)
