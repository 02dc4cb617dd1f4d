"""The free-form capability check: its judges on hand-written replies, the loader, the stratified order, the
fingerprint, and the shipped sets (sizes, category shares, disjoint from each other and from every prompt the
project trains or demonstrates on)."""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from livelora.trainer.capability import (
    BENCH_FILE,
    CATEGORIES,
    GATE_FILE,
    CapabilityItem,
    fingerprint,
    fold,
    language_shares,
    load_items,
    numbers,
    stratified,
)

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parent.parent


def right(check: dict, reply: str, prompt: str = "") -> bool:
    return CapabilityItem("x", "fact", prompt or "q", check).right(reply)


CONTAINS = {"kind": "contains", "accept": ["rome"]}


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("Rome", True),
        ("The capital of Italy is **Rome**.", True),
        ("ROME!", True),
        ("It's rome, of course", True),
        ("A chromosome is a molecule.", False),
        ("Romeo and Juliet", False),
        ("", False),
    ],
)
def test_contains_folds_case_markdown_and_punctuation_on_word_boundaries(reply, expected):
    assert right(CONTAINS, reply) is expected


def test_contains_multiword_accents_and_rejects():
    assert right({"kind": "contains", "accept": ["buenos aires"]}, "It is Buenos-Aires.")
    assert not right({"kind": "contains", "accept": ["buenos aires"]}, "Buenos is a word, Aires another.")
    assert right({"kind": "contains", "accept": ["reykjavik"]}, "Reykjavík is the capital.")
    assert right({"kind": "contains", "accept": ["saint exupery"]}, "Antoine de Saint-Exupéry")
    yes = {"kind": "contains", "accept": ["yes"], "reject": ["no"]}
    assert right(yes, "Yes, it is.")
    assert not right(yes, "Yes and no.")
    assert not right(yes, "No.")
    assert right(yes, "Yes, nobody doubts it.")  # "nobody" is not "no"
    chef = {"kind": "contains", "accept": ["chef"], "reject": ["baker"]}
    assert right(chef, "Adam is a chef, not a baker.")  # a negated distractor does not count
    assert right(chef, "A chef rather than a baker.") and right(chef, "Chef, instead of baker")
    assert not right(chef, "Adam is a chef. His friend is a baker.")
    assert not right(chef, "Not a chef but a baker.")


def test_numbers_are_parsed_from_digits_and_from_words_when_there_are_no_digits():
    assert numbers("1,200 people paid 3.5 each, -4 left, 2+3=5.") == [1200, 3.5, -4, 2, 3, 5]
    assert numbers("9-5") == [9, 5]
    assert numbers("Twenty-one apples and seven pears") == [21, 7]
    assert numbers("There are eleven players.") == [11]
    assert numbers("The answer is 7, not one.") == [7]  # words count only when no digits were written
    assert numbers("none at all") == []


@pytest.mark.parametrize(
    ("prompt", "reply", "value", "expected"),
    [
        ("What is 12 + 30?", "12 + 30 = 42", 42, True),
        ("What is 12 + 30?", "The answer is 42.", 42, True),
        ("What is 12 + 30?", "**42**", 42, True),
        ("What is 12 + 30?", "Forty-two.", 42, True),
        ("What is 12 + 30?", "12 + 30 = 43", 42, False),
        ("What is 10 × 4?", "10 × 4 = 40\n\nThat is, adding 1 ten four times.", 40, True),  # the result after =
        ("What is 3 × 12?", "Multiply 3 by itself, which is 9. So, 3 × 12 = 36.", 36, True),
        ("What is 3 × 12?", "3 × 12 = 36, which is 9.", 9, False),
        ("What is 108 / 9?", "108 divided by 9 equals 12.", 12, True),
        ("What is 12 + 30?", "42. Then 42 + 1 = 43", 42, False),  # the reply goes on to another result
        ("Tom had 8 apples and gave 3 away. How many are left?", "5 apples. He had 8 and gave 3.", 5, True),
        ("Tom had 8 apples and gave 3 away. How many are left?", "8 - 3 = 5", 5, True),
        ("Tom had 8 apples and gave 3 away. How many are left?", "Tom has 8 apples.", 5, False),
        ("How many grams are in a kilogram?", "There are 1,000 grams in a kilogram.", 1000, True),
        ("How many grams are in a kilogram?", "There are 100 grams.", 1000, False),
        ("What is 7 divided by 2?", "It is 3.5", 3.5, True),
        ("How many wheels?", "No idea.", 2, False),
    ],
)
def test_number_check_judges_the_answer_not_the_restated_operands(prompt, reply, value, expected):
    assert right({"kind": "number", "value": value}, reply, prompt) is expected


def test_one_word_strips_markdown_and_punctuation():
    one = {"kind": "one_word"}
    assert right(one, "Apple.") and right(one, "**Banana**") and right(one, " Kiwi!\n")
    assert not right(one, "An apple.") and not right(one, "") and not right(one, "Apple, banana")
    assert right({"kind": "one_word", "accept": ["green"]}, "Green!")
    assert not right({"kind": "one_word", "accept": ["green"]}, "Blue")


def test_bullets_count_bullet_lines_only():
    three = {"kind": "bullets", "n": 3}
    assert right(three, "Here you go:\n- one\n- two\n- three")
    assert right(three, "* a\n* b\n• c\nThat is all.")
    assert right(three, "1. a\n2. b\n3) c")
    assert not right({"kind": "bullets", "n": 3, "numbered": False}, "1. a\n2. b\n3. c")
    assert not right(three, "- a\n- b")
    assert not right(three, "- a\n- b\n- c\n- d")
    assert not right(three, "**Bold** intro\n-no space\n- a")


def test_language_by_stop_word_share():
    fr = "La mer est très belle et je vais à la plage avec mes amis."
    es = "El mar es muy bonito y me gusta nadar en la playa con mis amigos."
    de = "Das Meer ist sehr schön und ich gehe mit meinen Freunden an den Strand."
    en = "The sea is very beautiful and I go to the beach with my friends."
    for text, lang in ((fr, "fr"), (es, "es"), (de, "de")):
        assert right({"kind": "language", "lang": lang}, text), (lang, language_shares(text))
        assert not right({"kind": "language", "lang": lang}, en)
    assert not right({"kind": "language", "lang": "fr"}, es)
    assert not right({"kind": "language", "lang": "de"}, "")


def test_json_parses_the_reply_or_its_single_fenced_block():
    keys = {"kind": "json", "keys": ["name", "colour"]}
    assert right(keys, '{"name": "sea", "colour": "blue"}')
    assert right(keys, 'Sure:\n```json\n{"name": "sea", "colour": "blue"}\n```')
    assert not right(keys, '{"name": "sea"}')
    assert not right(keys, '["name", "colour"]')
    assert not right(keys, "{name: sea}")
    assert right({"kind": "json"}, '["a", "b", "c"]')
    assert right({"kind": "json", "type": "array"}, '["a", "b", "c"]')
    assert not right({"kind": "json", "type": "array"}, '{"a": 1}')
    assert right({"kind": "json", "type": "object"}, '{"a": 1}')
    assert not right({"kind": "json"}, "```\n[1]\n```\n```\n[2]\n```")  # two blocks: which one?


def test_word_length_start_and_case_checks():
    assert right({"kind": "required_word", "word": "blue"}, "The sky was Blue.")
    assert not right({"kind": "required_word", "word": "blue"}, "Bluebells grow here.")
    assert right({"kind": "max_words", "n": 5}, "A calm, blue sea.")
    assert not right({"kind": "max_words", "n": 3}, "A calm blue sea.")
    assert not right({"kind": "max_words", "n": 3}, "  ")
    assert right({"kind": "starts_with", "text": "Today"}, "**Today** the sun shines.")
    assert not right({"kind": "starts_with", "text": "Today"}, "Todays are long.")
    assert right({"kind": "all_caps"}, "THE SEA IS BLUE!") and not right({"kind": "all_caps"}, "THE SEA Is BLUE")
    assert not right({"kind": "all_caps"}, "123")
    assert right({"kind": "lowercase"}, "the sea is blue.") and not right({"kind": "lowercase"}, "The sea.")
    both = {"kind": "all_of", "checks": [{"kind": "lowercase"}, {"kind": "max_words", "n": 4}]}
    assert right(both, "a calm sea") and not right(both, "a calm sea at night") and not right(both, "A calm sea")


def test_fold():
    assert fold("  **Élan**, vital!  ") == "elan vital"
    assert fold("snake_case") == "snake case"
    assert fold("don't") == "dont"


def test_load_items_refuses_bad_lines(tmp_path):
    good = {"id": "a", "category": "fact", "prompt": "Q?", "check": {"kind": "contains", "accept": ["x"]}}
    cases = {
        "not json": "{",
        "category 'poetry'": {**good, "category": "poetry"},
        "unknown check": {**good, "check": {"kind": "vibes"}},
        "needs accept": {**good, "check": {"kind": "contains"}},
        "language 'xx'": {**good, "check": {"kind": "language", "lang": "xx"}},
        "type is array or object": {**good, "check": {"kind": "json", "type": "list"}},
        "checks[0]": {**good, "check": {"kind": "all_of", "checks": [{"kind": "nope"}]}},
        "unexpected keyword": {**good, "colour": "red"},
        "empty prompt": {**good, "prompt": " "},
    }
    for words, row in cases.items():
        path = tmp_path / "set.jsonl"
        path.write_text(row if isinstance(row, str) else json.dumps(row))
        with pytest.raises(ValueError, match=re.escape(words) if words != "not json" else ":1:"):
            load_items(path)
    path.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(ValueError, match="repeated"):
        load_items(path)
    path.write_text(json.dumps(good) + "\n\n")
    assert load_items(path) == [CapabilityItem("a", "fact", "Q?", {"kind": "contains", "accept": ["x"]})]


def test_stratified_prefixes_are_balanced_and_the_order_is_fixed_by_the_seed():
    items = load_items(GATE_FILE)
    order = stratified(items)
    assert sorted(i.id for i in order) == sorted(i.id for i in items)
    smallest = min(Counter(i.category for i in items).values())
    for k in range(1, smallest * len(CATEGORIES) + 1):
        counts = Counter(i.category for i in order[:k])
        assert max(counts.values()) - min(counts.get(c, 0) for c in CATEGORIES) <= 1, k
    assert [i.id for i in stratified(list(reversed(items)))] == [i.id for i in order]
    assert [i.id for i in stratified(items, seed=1)] != [i.id for i in order]


def test_fingerprint_names_what_a_measurement_depends_on():
    items = load_items(GATE_FILE)[:20]
    fp = fingerprint(items)
    assert fp == fingerprint(load_items(GATE_FILE)[:20]) and len(fp) == 64
    changed = [
        CapabilityItem(**{**i.__dict__, "max_tokens": i.max_tokens + 1}) if n == 3 else i for n, i in enumerate(items)
    ]
    assert fingerprint(changed) != fp
    assert fingerprint(items[::-1]) != fp
    relabelled = [CapabilityItem(**{**i.__dict__, "source": "other"}) for i in items]
    assert fingerprint(relabelled) == fp  # provenance does not change what is measured


def norm(prompt: str) -> str:
    return " ".join(re.sub(r"[^\w]+", " ", prompt.lower()).split())


def trained_or_shown_prompts() -> set[str]:
    """The probes, bench/live_loop.py's PROMPTS, and every quoted question in README.md and docs/."""
    out = {norm(json.loads(line)["prompt"]) for line in (REPO / "trainer/rails/probes.jsonl").read_text().splitlines()}
    module = ast.parse((REPO / "bench/live_loop.py").read_text())
    [prompts] = [n.value for n in module.body if isinstance(n, ast.Assign) and "PROMPTS" in ast.unparse(n.targets[0])]
    out |= {norm(p) for p in ast.literal_eval(prompts)}
    for page in [REPO / "README.md", *(REPO / "docs").rglob("*.md")]:
        out |= {norm(q) for q in re.findall(r"[\"'`]([^\"'`\n]*\?)[\"'`]", page.read_text())}
    assert len(out) > 80
    return out


def test_the_sets_are_disjoint_balanced_and_hold_no_trained_or_shown_prompt():
    gate, bench = load_items(GATE_FILE), load_items(BENCH_FILE)
    assert len(gate) >= 320 and len(bench) >= 200
    shares = {"fact": (0.33, 0.47), "arithmetic": (0.18, 0.32), "instruction": (0.14, 0.26), "reading": (0.10, 0.20)}
    for items in (gate, bench):
        counts = Counter(i.category for i in items)
        for category, (lo, hi) in shares.items():
            assert lo <= counts[category] / len(items) <= hi, (category, counts)
        assert len({norm(i.prompt) for i in items}) == len(items)
        assert all(8 <= i.max_tokens <= 128 and i.source for i in items)
        assert all(i.check["value"] >= 0 for i in items if i.category == "arithmetic")  # no "gave 9 of 7 away"
    assert not {norm(i.prompt) for i in gate} & {norm(i.prompt) for i in bench}
    assert not {i.id for i in gate} & {i.id for i in bench}
    forbidden = trained_or_shown_prompts()
    assert not {norm(i.prompt) for i in gate + bench} & forbidden
    # no fact is asked in both sets, however worded: their accepted answers differ
    answers = [{json.dumps(i.check, sort_keys=True) for i in s if i.category == "fact"} for s in (gate, bench)]
    assert not answers[0] & answers[1] - {json.dumps({"kind": "number", "value": v}) for v in range(2000)}


def test_the_sets_are_what_the_committed_script_writes(tmp_path):
    import subprocess
    import sys

    subprocess.run([sys.executable, str(REPO / "bench/make_freeform_sets.py"), "--out", str(tmp_path)], check=True)
    for name, path in (("gate", GATE_FILE), ("bench", BENCH_FILE)):
        made = {i.id: i for i in load_items(tmp_path / f"freeform_{name}.jsonl")}
        shipped = load_items(path)
        for i in shipped:  # the calibration may drop items and shorten max_tokens; the rest is the script's
            assert made[i.id].prompt == i.prompt and made[i.id].check == i.check, i.id
