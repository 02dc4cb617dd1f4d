"""Which training-session models an executor takes (real Redis, the real SmolLM2 base model's config): by the
session's tenant, by the base model's size, and never one whose base weights do not fit a rank's memory."""

from __future__ import annotations

import json
import math

from safetensors import safe_open

from livelora.core.session_protocol import model_id_for
from livelora.core.settings import SessionSection
from livelora.trainer.model_slots import ModelSlots
from livelora.trainer.placement import Placement, base_parameters, rank_base_bytes


def test_the_base_model_is_counted_without_loading_it(base_ref):
    with safe_open(f"{base_ref.path}/model.safetensors", "pt") as f:  # the weights file's own shapes
        stored = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    # SmolLM2-135M ties its unembedding to the embedding: the file and the model count it once
    assert base_parameters(base_ref.path) == stored == 134_515_008


def test_takes_only_its_tenants_sizes_and_what_fits(bus, tmp_path):
    r, keys = bus
    models = {}
    for tenant in ("big-co", "small-co"):
        session = f"s-{tenant}"
        r.set(keys.session(session), json.dumps({"tenant": tenant}))
        models[tenant] = model_id_for(session, 0)
        r.sadd(keys.models, models[tenant])
    params = 134_515_008
    group = Placement(r, keys, tenants={"big-co"}, base_params=params, base_bytes=4 * params)
    assert group.refusal is None and group.accepts(models["big-co"]) and not group.accepts(models["small-co"])
    slots = ModelSlots(r, keys, tmp_path, None, SessionSection(), "group-0", lambda state: None, group)
    slots.claim()
    assert set(slots.slots) == {models["big-co"]}
    assert r.get(keys.model_lease(models["small-co"])) is None  # left for a trainer that takes it
    slots.leases.stop(release=True)
    # a group kept for large bases takes nothing on a 135M base; a single trainer capped at 1B takes everything
    big_only = Placement(r, keys, tenants=set(), base_params=params, base_bytes=4 * params, min_base_params=10**9)
    small_only = Placement(r, keys, tenants=set(), base_params=params, base_bytes=4 * params, max_base_params=10**9)
    assert "below take_min_base_params" in big_only.refusal and not big_only.accepts(models["big-co"])
    assert small_only.accepts(models["big-co"]) and small_only.accepts(models["small-co"])
    # 538 MB of fp32 weights do not fit 0.8 of a 512 MiB rank; they fit 0.8 of 1 GiB
    tight = Placement(r, keys, tenants=set(), base_params=params, base_bytes=4 * params, memory_bytes=2**29)
    roomy = Placement(r, keys, tenants=set(), base_params=params, base_bytes=4 * params, memory_bytes=2**30)
    assert "do not fit 0.8 of one rank's memory" in tight.refusal and not tight.accepts(models["small-co"])
    assert roomy.refusal is None and roomy.accepts(models["small-co"])


def test_a_group_that_shards_the_base_counts_a_ranks_share(bus, tmp_path):
    r, keys = bus
    params = 134_515_008  # SmolLM2-135M: 538 MB of fp32 weights, over 0.8 of 512 MiB whole, under it halved
    assert rank_base_bytes(params) == 4 * params and rank_base_bytes(params, 2) == 2 * params
    whole = Placement(
        r, keys, tenants=set(), base_params=params, base_bytes=rank_base_bytes(params), memory_bytes=2**29
    )
    halves = Placement(
        r, keys, tenants=set(), base_params=params, base_bytes=rank_base_bytes(params, 2), memory_bytes=2**29
    )
    assert whole.refusal and halves.refusal is None
