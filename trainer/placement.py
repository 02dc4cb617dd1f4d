"""Which training-session models an op executor takes (:class:`Placement`, the ``take_*`` settings).

Large base models go to trainer groups and small ones to single trainers by giving each its own base-size range
(``LIVELORA_TAKE_MIN_BASE_PARAMS`` / ``LIVELORA_TAKE_MAX_BASE_PARAMS``) or its own tenants
(``LIVELORA_TAKE_TENANTS``); and no executor takes a model whose base weights do not fit one of its ranks
(``LIVELORA_TAKE_MEMORY_SHARE`` of a GPU, or of the machine's RAM divided by the ranks on it). A model nobody
takes waits in its stream for an executor that does. docs/scaling-out.md.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from livelora.core.api_keys import DEFAULT_TENANT
from livelora.core.redis_keys import KeyLayout
from livelora.core.session_protocol import session_of

log = logging.getLogger(__name__)


def base_parameters(path: str) -> int:
    """Parameters of the causal LM at ``path`` (a local directory or hub id), counted on the meta device (no
    weights are read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def rank_memory_bytes(device: str, ranks_here: int) -> int:
    """Memory one rank may use: the GPU's for a CUDA ``device``, else the machine's RAM over ``ranks_here``."""
    import torch

    if torch.device(device).type == "cuda":
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, ranks_here))


class Placement:
    """The take rules of one executor.

    Args:
        redis_client, keys: where the session records are (their ``tenant``).
        tenants: tenants whose models it takes (empty: all).
        base_params: parameters of the base model it trains; ``base_bytes``: their size in its dtype.
        min_base_params, max_base_params: the base-size range it takes (``max`` 0: no upper bound).
        memory_bytes, memory_share: one rank's memory and the share the base weights may fill.
    """

    def __init__(
        self,
        redis_client: Any,
        keys: KeyLayout,
        *,
        tenants: set[str],
        base_params: int,
        base_bytes: int,
        min_base_params: int = 0,
        max_base_params: int = 0,
        memory_bytes: int | None = None,
        memory_share: float = 0.8,
    ):
        self.redis, self.keys, self.tenants = redis_client, keys, tenants
        #: why this executor takes no session model at all (None: it takes those of its tenants)
        self.refusal: str | None = None
        if base_params < min_base_params:
            self.refusal = f"the base model has {base_params:,} parameters, below take_min_base_params"
        elif max_base_params and base_params > max_base_params:
            self.refusal = f"the base model has {base_params:,} parameters, above take_max_base_params"
        elif memory_bytes is not None and base_bytes > memory_share * memory_bytes:
            self.refusal = (
                f"its base weights ({base_bytes / 2**30:.1f} GiB) do not fit {memory_share:g} of one rank's "
                f"memory ({memory_bytes / 2**30:.1f} GiB)"
            )
        if self.refusal:
            log.warning("this trainer takes no training-session model: %s", self.refusal)

    def accepts(self, model_id: str) -> bool:
        """Whether to take ``model_id`` (its session's tenant read from Redis when tenants are set)."""
        if self.refusal is not None:
            return False
        if not self.tenants:
            return True
        raw = self.redis.get(self.keys.session(session_of(model_id)))
        tenant = (json.loads(raw) if raw else {}).get("tenant") or DEFAULT_TENANT
        return tenant in self.tenants


def rank_base_bytes(params: int, shard_ranks: int = 1) -> int:
    """Bytes of fp32 base weights one rank holds: all of them, or ``1/shard_ranks`` when a group shards them
    (``LIVELORA_GROUP_SHARD_BASE``; :mod:`livelora.trainer.shard_base`)."""
    return -(-4 * params // max(1, shard_ranks))


def placement_of(settings: Any, redis_client: Any, keys: KeyLayout) -> Placement:
    """The placement of a trainer's :class:`~livelora.trainer.settings.TrainerSettings` (base model counted
    once; fp32 weights, a rank's share of them when the group shards them over its ``WORLD_SIZE`` ranks;
    ``LOCAL_WORLD_SIZE`` ranks on this machine, as torchrun sets it)."""
    import os

    from livelora.core.base_models import resolve_base_model

    g = settings.group
    params = base_parameters(resolve_base_model(settings.model, settings.home).path)
    return Placement(
        redis_client,
        keys,
        tenants={t.strip() for t in g.take_tenants.split(",") if t.strip()},
        base_params=params,
        base_bytes=rank_base_bytes(params, int(os.environ.get("WORLD_SIZE", "1")) if g.group_shard_base else 1),
        min_base_params=g.take_min_base_params,
        max_base_params=g.take_max_base_params,
        memory_bytes=rank_memory_bytes(settings.training.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))),
        memory_share=g.take_memory_share,
    )
