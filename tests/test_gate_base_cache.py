"""The evaluation gate's base-model measurement is taken once per store: at trainer start-up, in the background,
kept in ``models/gate-base/`` keyed by the probe set and the base weights; a second start reads it, a changed
probe set measures again (real SmolLM2 model)."""

from __future__ import annotations

import torch

from livelora.core.base_models import base_identity, resolve_base_model
from livelora.core.settings import DEFAULT_MODEL
from livelora.trainer.gate import EvaluationGate
from livelora.trainer.gate_base import BASE_CACHE_DIR
from livelora.trainer.gate_measure import ProbeSuite, load_probes
from livelora.trainer.online import OnlineTrainer
from livelora.trainer.settings import GateSection, TrainingSection

#: Free-form items of the cached measurement: enough for the whole sample to be part of it and to compare replies
#: item by item (a stratified prefix, in one batch); the base model's replies run to each item's max_tokens, so
#: every item is paid for twice here (the first start, and the changed probe set).
FREEFORM_ITEMS = 10
#: ... measured in two chunks of 5 (one batch each), the progress reported after the first
FREEFORM_CHUNK = 5


def _store(tmp_path, livelora_home):
    """A fresh store whose converted base model is the test store's (linked, not converted again)."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / DEFAULT_MODEL).symlink_to(livelora_home / "models" / DEFAULT_MODEL)
    return tmp_path, resolve_base_model(DEFAULT_MODEL, tmp_path)


def _start(ref, home) -> tuple[OnlineTrainer, list[dict]]:
    """A trainer start: warm_up builds the model and starts the base measurement; wait for it. Returns the trainer
    and what its base measurement reported (``GET /v1/learning`` shows it)."""
    gate = GateSection(gate_enabled=True, gate_freeform_items=FREEFORM_ITEMS, gate_freeform_chunk=FREEFORM_CHUNK)
    trainer, reports = OnlineTrainer(ref, home, TrainingSection(), gate=gate), []
    trainer._report = lambda lineage, stage, **fields: reports.append({"lineage": lineage, "stage": stage, **fields})
    trainer.warm_up()
    trainer._base_thread.join()
    return trainer, reports


def test_a_second_start_reads_the_measurement_and_new_probes_measure_again(tmp_path, livelora_home, monkeypatch):
    import livelora.trainer.gate_base as gate_base

    monkeypatch.setattr(gate_base, "TOKEN_REPORT_S", 0.0)  # every decoding step of a chunk reports
    home, ref = _store(tmp_path, livelora_home)
    first, reports = _start(ref, home)
    assert first.gate.base_measure.source == "measured" and first.gate.base_measure.seconds > 0
    assert first.gate.suite.freeform.on_token is None  # a candidate's measurement reports nothing of the kind
    # inside a chunk's batch: its replies' tokens so far, the time left counting down
    tokens = [(r["check"], r["left_s"]) for r in reports if "reply tokens" in (r.get("check") or "")]
    first_chunk = [c for c, _ in tokens if c.startswith("pass 3 of 3, free-form answers: 0 of 10 items (")]
    second_chunk = [(c, left) for c, left in tokens if c.startswith("pass 3 of 3, free-form answers: 5 of 10 items (")]
    assert first_chunk and second_chunk and len(first_chunk) + len(second_chunk) == len(tokens)
    seen = [int(c.split("reply tokens: ")[1].split()[0]) for c in first_chunk]
    most = max(it.max_tokens for it in first.gate.suite.freeform.items[:FREEFORM_CHUNK])
    assert seen == sorted(seen) and first_chunk[-1].endswith(f"of at most {most})")
    lefts = [left for _, left in second_chunk]
    assert all(left is not None for left in lefts) and lefts == sorted(lefts, reverse=True)
    # its progress: each pass as it starts, then the free-form items chunk by chunk with the time left
    progress = [(r["check"], r["left_s"]) for r in reports if r.get("check") and "reply tokens" not in r["check"]]
    assert [c for c, _ in progress] == [
        "pass 1 of 3, probes (answers with a forced start)",
        "pass 2 of 3, replies to open prompts (length, repetition)",
        "pass 3 of 3, free-form answers: 0 of 10 items",
        "pass 3 of 3, free-form answers: 5 of 10 items",
    ]
    assert progress[-1][1] > 0 and all(left is None for _, left in progress[:-1])
    assert {r["lineage"] for r in reports} == {None} and reports[-1]["state"] == "ready"
    [path] = sorted((home / BASE_CACHE_DIR).glob("*.pt"))
    assert path == first.gate.base_measure.cache_path(first._fresh)

    second, reports = _start(ref, home)
    assert second.gate.base_measure.source == "cache" and [r["state"] for r in reports] == ["measuring", "ready"]
    assert (
        second.gate.base_measure.seconds == first.gate.base_measure.seconds
    )  # the original measurement's time, read back
    a, b = first.gate.base_measure.measurement, second.gate.base_measure.measurement
    assert torch.equal(a.logp_M_V, b.logp_M_V) and a.logp_M_V.shape[1] == first._fresh.vocab_size
    assert (a.probe_right, a.replies, a.degenerate, a.mean_len) == (b.probe_right, b.replies, b.degenerate, b.mean_len)
    # the free-form replies to the whole sample are part of it
    assert len(a.freeform) == len(first.gate.suite.freeform) and (a.freeform, a.freeform_texts) == (
        b.freeform,
        b.freeform_texts,
    )

    # another base model (its weights' identity) is another file
    other = EvaluationGate(first.tokenizer, home, first.chat_pair, base_id="sha256:other")
    assert other.base_measure.cache_path(first._fresh) != path

    # a changed probe set: measured again, and the old probe set's file of this base model removed
    changed = EvaluationGate(first.tokenizer, home, first.chat_pair, base_id=base_identity(ref))
    changed.suite = changed.base_measure.suite = ProbeSuite(
        first.tokenizer, load_probes()[:-1], freeform_items=FREEFORM_ITEMS, freeform_chunk=FREEFORM_CHUNK
    )
    new_path = changed.base_measure.cache_path(second._fresh)
    assert new_path != path
    m = changed.base(second._fresh)
    assert changed.base_measure.source == "measured"
    assert m.probe_right == a.probe_right[:-1] and m.replies == a.replies
    # the first FREEFORM_ITEMS items of the stratified order, generated in the same batch: the same replies
    assert m.freeform_texts == {it.id: a.freeform_texts[it.id] for it in changed.suite.freeform.items}
    assert sorted((home / BASE_CACHE_DIR).glob("*.pt")) == [new_path]
