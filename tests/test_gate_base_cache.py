"""The evaluation gate's base-model measurement is taken once per store: at trainer start-up, in the background,
kept in ``models/gate-base/`` keyed by the probe set and the base weights; a second start reads it, a changed
probe set measures again (real SmolLM2 model)."""

from __future__ import annotations

import torch

from livelora.core.base_models import base_identity, resolve_base_model
from livelora.core.settings import DEFAULT_MODEL
from livelora.trainer.gate import BASE_CACHE_DIR, EvaluationGate
from livelora.trainer.gate_measure import ProbeSuite, load_probes
from livelora.trainer.online import OnlineTrainer
from livelora.trainer.settings import GateSection, TrainingSection

#: Free-form items of the cached measurement: enough for the whole sample to be part of it and to compare replies
#: item by item (a stratified prefix, in one batch); the base model's replies run to each item's max_tokens, so
#: every item is paid for twice here (the first start, and the changed probe set).
FREEFORM_ITEMS = 10


def _store(tmp_path, livelora_home):
    """A fresh store whose converted base model is the test store's (linked, not converted again)."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / DEFAULT_MODEL).symlink_to(livelora_home / "models" / DEFAULT_MODEL)
    return tmp_path, resolve_base_model(DEFAULT_MODEL, tmp_path)


def _start(ref, home) -> OnlineTrainer:
    """A trainer start: warm_up builds the model and starts the base measurement; wait for it."""
    gate = GateSection(gate_enabled=True, gate_freeform_items=FREEFORM_ITEMS)
    trainer = OnlineTrainer(ref, home, TrainingSection(), gate=gate)
    trainer.warm_up()
    trainer._base_thread.join()
    return trainer


def test_a_second_start_reads_the_measurement_and_new_probes_measure_again(tmp_path, livelora_home):
    home, ref = _store(tmp_path, livelora_home)
    first = _start(ref, home)
    assert first.gate.base_source == "measured" and first.gate.base_seconds > 0
    [path] = sorted((home / BASE_CACHE_DIR).glob("*.pt"))
    assert path == first.gate.base_cache_path(first._fresh)

    second = _start(ref, home)
    assert second.gate.base_source == "cache"
    assert second.gate.base_seconds == first.gate.base_seconds  # the original measurement's time, read back
    a, b = first.gate._base, second.gate._base
    assert torch.equal(a.logp_M_V, b.logp_M_V) and a.logp_M_V.shape[1] == first._fresh.vocab_size
    assert (a.probe_right, a.replies, a.degenerate, a.mean_len) == (b.probe_right, b.replies, b.degenerate, b.mean_len)
    # the free-form replies to the whole sample are part of it
    assert len(a.freeform) == len(first.gate.suite.freeform) and (a.freeform, a.freeform_texts) == (
        b.freeform,
        b.freeform_texts,
    )

    # another base model (its weights' identity) is another file
    other = EvaluationGate(first.tokenizer, home, first.chat_pair, base_id="sha256:other")
    assert other.base_cache_path(first._fresh) != path

    # a changed probe set: measured again, and the old probe set's file of this base model removed
    changed = EvaluationGate(first.tokenizer, home, first.chat_pair, base_id=base_identity(ref))
    changed.suite = ProbeSuite(first.tokenizer, load_probes()[:-1], freeform_items=FREEFORM_ITEMS)
    new_path = changed.base_cache_path(second._fresh)
    assert new_path != path
    m = changed.base(second._fresh)
    assert changed.base_source == "measured"
    assert m.probe_right == a.probe_right[:-1] and m.replies == a.replies
    # the first FREEFORM_ITEMS items of the stratified order, generated in the same batch: the same replies
    assert m.freeform_texts == {it.id: a.freeform_texts[it.id] for it in changed.suite.freeform.items}
    assert sorted((home / BASE_CACHE_DIR).glob("*.pt")) == [new_path]
