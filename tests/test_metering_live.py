"""Live-loop metering: a trainer worker's steps count their ``model_input`` tokens (kind ``live_trained``) for the
endpoint of each event and that endpoint's tenant, exactly (real SmolLM2 step, real Redis)."""

from __future__ import annotations

import logging
import time

from livelora.adapters.endpoints import EndpointStore
from livelora.clients.types.signals import PreferenceEvent, RatingEvent
from livelora.core.metering import Meter, UsageStore
from livelora.trainer.online import OnlineTrainer
from livelora.trainer.scheduler import BatchScheduler
from livelora.trainer.settings import TrainingSection
from livelora.trainer.worker import TrainerWorker


def chat_ids(tokenizer, q: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def test_live_loop_steps_are_metered_per_endpoint_and_tenant(bus, base_ref, tokenizer, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="livelora.trainer.online")
    client, keys = bus
    EndpointStore(tmp_path).create("acme-bot", "acme-lineage", tenant="acme", who="test")
    p1, p2 = chat_ids(tokenizer, "What is 2+2?"), chat_ids(tokenizer, "Name a colour.")
    c1, c2 = tokenizer.encode(" 4.", add_special_tokens=False), tokenizer.encode(" Blue", add_special_tokens=False)
    ratings = [
        RatingEvent(
            id=f"feedback-{i}",
            endpoint="acme-bot",
            created=int(time.time()),
            completion_id=f"c{i}",
            prompt_token_ids=p,
            completion_token_ids=c,
            rating=i == 0,
            rating_key=f"c{i}:/u",
            user="u",
            finish_reason="length",
        )
        for i, (p, c) in enumerate([(p1, c1), (p2, c2)])
    ]
    pref = PreferenceEvent(
        id="preference-1",
        endpoint="public-bot",
        created=0,
        prompt_token_ids=p1,
        chosen_token_ids=c1,
        rejected_token_ids=c2,
    )
    for ev in [*ratings, pref]:
        client.xadd(keys.signals, {"event": ev.model_dump_json(), "replaces": ""})
    backend = OnlineTrainer(base_ref, tmp_path, TrainingSection(kto_lr=1e-3), meter=Meter(keys), redis=client)
    worker = TrainerWorker(
        client,
        keys,
        tmp_path,
        backend,
        BatchScheduler(TrainingSection(kto_min_batch=2, dpo_min_batch=1)),
        consumer="w",
        block_ms=100,
    )
    notices = worker.poll()
    assert sorted(n.kind for n in notices) == ["dpo", "kto"]
    rows = {
        (r.dims["tenant"], r.dims["key"], r.dims["subject"], r.dims["kind"]): r.tokens
        for r in UsageStore(tmp_path, keys).query_sync(client)
    }
    # a datum of prompt P and completion C runs on P + C - 1 tokens (inputs tokens[:-1]); DPO: chosen and rejected
    kto = (len(p1) + len(c1) - 1) + (len(p2) + len(c2) - 1)
    dpo = (len(p1) + len(c1) - 1) + (len(p1) + len(c2) - 1)
    assert rows == {("acme", "-", "acme-bot", "live_trained"): kto, ("default", "-", "public-bot", "live_trained"): dpo}
    assert kto == sum(d.model_input.length for ev in ratings for d in backend.event_datums(ev))
    # the trainer's log line links the ratings' completions to the version they trained (traceable logs)
    trained = {r.version: r for r in caplog.records if getattr(r, "version", None)}
    kto_version = next(n.name for n in notices if n.kind == "kto")
    assert trained[kto_version].completion_ids == ["c0", "c1"]
    assert trained[kto_version].event_ids == ["feedback-0", "feedback-1"]
