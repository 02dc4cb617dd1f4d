"""Per-tenant ceilings on training models, checked before a model is created (nothing is written when over).

* ``max_lora_rank``: the LoRA rank of one model (400);
* ``max_models_per_session`` / ``max_models``: live training models of the session / of the tenant (429);
* ``max_trainer_bytes``: the estimated trainer memory of the tenant's live models with the new one (429).

**Trainer memory of a LoRA model** (:func:`lora_bytes`): ``rank × Σ (in + out features)`` parameters over the
layers it adapts (per decoder layer: q, k, v, o when ``train_attn``; gate, up, down when ``train_mlp``; once the
unembedding when ``train_unembed``; shapes from the base model's ``config.json``), × 16 bytes: the float32
weight, its gradient and AdamW's two moments. SmolLM2-135M, every target: 355 008 parameters per rank, so rank
64 is 363 MB and rank 512 is 2.9 GB. A model's live set is ``trainer:models`` (freed models leave it); each
record names its tenant.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from livelora.clients.errors import BadRequestError, RateLimitError
from livelora.core import metrics
from livelora.core.owners import OwnerStore
from livelora.core.session_protocol import session_of

#: bytes per adapted parameter: float32 weight, gradient, AdamW first and second moment
BYTES_PER_PARAM = 16
_CONFIGS: dict[str, dict[str, Any]] = {}


def base_config(tokenizer) -> dict[str, Any]:
    """The base model's ``config.json`` (next to its tokenizer files; ``{}`` when there is none)."""
    source = str(getattr(tokenizer, "name_or_path", "") or "")
    if source not in _CONFIGS:
        path = Path(source) / "config.json"
        try:
            _CONFIGS[source] = json.loads(path.read_text()) if source and path.is_file() else {}
        except (OSError, ValueError):
            _CONFIGS[source] = {}
    return _CONFIGS[source]


def lora_bytes(config: dict[str, Any], lora: dict[str, Any]) -> int:
    """Estimated trainer memory of one LoRA model (bytes; see the module docstring); 0 when ``config`` lacks
    the shapes."""
    try:
        h, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        hd = int(config.get("head_dim") or h // heads)
        inter, vocab = int(config["intermediate_size"]), int(config["vocab_size"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0
    per_rank = 0
    if lora.get("train_attn", True):
        per_rank += layers * ((h + heads * hd) * 2 + (h + kv * hd) * 2)
    if lora.get("train_mlp", True):
        per_rank += layers * 3 * (h + inter)
    if lora.get("train_unembed", True):
        per_rank += h + vocab
    return int(lora.get("rank") or 32) * per_rank * BYTES_PER_PARAM


def lora_save_bytes(config: dict[str, Any], lora: dict[str, Any], with_optimizer: bool) -> int:
    """Bytes a save of the model writes: its LoRA parameters in float32, × 3 with AdamW's two moments
    (``save_weights`` / ``save_state``); 0 when ``config`` lacks the shapes."""
    return lora_bytes(config, lora) // BYTES_PER_PARAM * 4 * (3 if with_optimizer else 1)


async def check_new_model(ctx, model_id: str, lora: dict[str, Any] | None, tenant: str) -> None:
    """Refuse a new training model of ``tenant`` that would pass one of its ceilings.

    Args:
        ctx: the :class:`~livelora.gateway.services.sessions.context.SessionContext`.
        model_id: ``{session_id}:train:{n}``. lora: its LoRA config (``rank``, ``train_*``).

    Raises:
        BadRequestError: ``rank`` above ``max_lora_rank`` (param ``lora_config.rank``).
        RateLimitError: ``max_models_per_session``, ``max_models`` or ``max_trainer_bytes`` would be passed (429
            ``quota_exceeded``, ``param`` the limit).
    """
    if ctx.quotas is None:
        return
    limits = ctx.quotas.limits(tenant)
    lora = lora or {}
    rank = int(lora.get("rank") or 32)
    if limits.max_lora_rank is not None and rank > limits.max_lora_rank:
        raise BadRequestError(
            f"LoRA rank {rank} is above tenant {tenant!r}'s limit of {limits.max_lora_rank} (limit max_lora_rank: "
            "LIVELORA_QUOTA_MAX_LORA_RANK or PUT /admin/quotas); lower lora_config.rank",
            param="lora_config.rank",
            code="integer_above_max_value",
        )
    wanted = (limits.max_models_per_session, limits.max_models, limits.max_trainer_bytes)
    if all(w is None for w in wanted):
        return
    config = base_config(ctx.engine.tokenizer)
    session = session_of(model_id)
    in_session = of_tenant = held = 0
    for other, record in await _live_models(ctx):
        if (record.get("tenant") or OwnerStore(ctx.home).owner("model", other)) != tenant:
            continue
        of_tenant += 1
        in_session += session_of(other) == session
        held += lora_bytes(config, record.get("lora") or {})
    adding = lora_bytes(config, lora)
    for name, used, limit, unit in (
        ("max_models_per_session", in_session, limits.max_models_per_session, f"models in session {session!r}"),
        ("max_models", of_tenant, limits.max_models, "training models"),
    ):
        if limit is not None and used + 1 > limit:
            _refuse(f"tenant {tenant!r} has {used} live {unit}; the limit is {limit}", name)
    limit = limits.max_trainer_bytes
    if limit is not None and held + adding > limit:
        _refuse(
            f"a rank-{rank} model needs about {adding / 2**20:.0f} MiB of trainer memory and tenant {tenant!r}'s "
            f"live models hold {held / 2**20:.0f} MiB of its {limit / 2**20:.0f} MiB",
            "max_trainer_bytes",
        )


def _refuse(message: str, name: str) -> None:
    metrics.REJECTIONS.labels("quota_models").inc()
    raise RateLimitError(
        f"{message} (limit {name}: LIVELORA_QUOTA_{name.upper()} or PUT /admin/quotas); finish a session or "
        "free a model to make room",
        param=name,
        code="quota_exceeded",
        retry_after=60.0,
    )


async def _live_models(ctx) -> list[tuple[str, dict[str, Any]]]:
    ids = sorted(await ctx.redis.smembers(ctx.keys.models))
    if not ids:
        return []
    raws = await ctx.redis.mget([ctx.keys.model(i) for i in ids])
    out = []
    for model_id, raw in zip(ids, raws):
        try:
            out.append((model_id, json.loads(raw) if raw else {}))
        except ValueError:
            continue
    return out
