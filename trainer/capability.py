"""The free-form capability check: items with known answers and the judge of a greedy, free-form reply.

:func:`load_items` reads a set (:data:`GATE_FILE` for the evaluation gate, :data:`BENCH_FILE` for the benchmarks,
disjoint); :meth:`CapabilityItem.right` judges a reply on its content (answers folded for case, accents,
punctuation and markdown; numbers parsed; constraints checked); :func:`stratified` orders a set so that every
prefix is balanced over :data:`CATEGORIES`; :func:`fingerprint` names what a measurement depends on. The check
kinds, the sets and how they were made: ``docs/internals/rails.md``, "The free-form capability set".
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CATEGORIES: tuple[str, ...] = ("fact", "arithmetic", "instruction", "reading")
RAILS = Path(__file__).resolve().parent / "rails"
GATE_FILE = RAILS / "freeform_gate.jsonl"
BENCH_FILE = RAILS / "freeform_bench.jsonl"

_MARKDOWN = re.compile(r"```[a-zA-Z]*|[*_`#>]+")
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d])")
_UNITS = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen".split()
_TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90}
_WORDS = {w: i for i, w in enumerate(_UNITS)} | {"seventeen": 17, "eighteen": 18, "nineteen": 19} | _TENS
_NUMBER_WORD = re.compile(
    r"\b(" + "|".join(_TENS) + r")[- ](one|two|three|four|five|six|seven|eight|nine)\b|\b(" + "|".join(_WORDS) + r")\b"
)
_BULLET = re.compile(r"^\s*(?:[-*•]|(\d+)[.)])\s+\S")
#: Frequent function words of each language (accents folded), for :func:`language_shares`.
STOP_WORDS: dict[str, frozenset[str]] = {
    lang: frozenset(words.split())
    for lang, words in {
        "en": "the a an and or of to in on is are was it that this with for you i we they he she be have has not "
        "my your at as by from but do its their there what which",
        "fr": "le la les un une des et ou de du au aux en dans est sont etait il elle ils elles nous vous je tu "
        "ce cette ces que qui pour avec sur pas ne mon ma mes son sa ses leur tres plus c est",
        "es": "el la los las un una unos unas y o de del al en es son era esta estan que con por para su sus "
        "mi mis yo tu nosotros ellos ella lo se no muy mas como pero hay tiene",
        "de": "der die das den dem des ein eine einen einem und oder in im ist sind war ich du wir sie er es mit "
        "fur auf nicht zu von bei aus auch sehr mein meine hat haben wie aber",
    }.items()
}


def fold(text: str) -> str:
    """Lower case, accents dropped, markdown and punctuation turned to single spaces: ``"**Rome!**" -> "rome"``."""
    text = unicodedata.normalize("NFKD", text.replace("'", ""))
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    return " ".join(re.sub(r"[^\w]+|_", " ", text).split())


def has_phrase(reply: str, phrase: str) -> bool:
    """Whether folded ``phrase`` occurs in folded ``reply`` on word boundaries (``rome`` not in ``chromosome``)."""
    p = fold(phrase)
    return bool(p) and f" {p} " in f" {fold(reply)} "


def numbers(text: str) -> list[float]:
    """The numbers written in ``text``, in order: digits (``1,200``, ``3.5``, ``-4``) or, when there are no
    digits, number words (``zero`` to ``nineteen``, tens, ``twenty-one``)."""
    found = [float(m.group(0).replace(",", "")) for m in _NUMBER.finditer(text)]
    if found:
        return found
    out = []
    for m in _NUMBER_WORD.finditer(text.lower()):
        if m.group(1):
            out.append(float(_TENS[m.group(1)] + _WORDS[m.group(2)]))
        else:
            out.append(float(_WORDS[m.group(3)]))
    return out


def language_shares(text: str) -> dict[str, float]:
    """Share of the words of ``text`` that are stop words of each language of :data:`STOP_WORDS`."""
    words = fold(text).split()
    return {lang: sum(w in stop for w in words) / max(len(words), 1) for lang, stop in STOP_WORDS.items()}


def _strip_markdown(reply: str) -> str:
    return _MARKDOWN.sub("", reply).strip()


def _json_text(reply: str) -> str:
    blocks = re.findall(r"```[a-zA-Z]*\n?(.*?)```", reply, re.S)
    return blocks[0] if len(blocks) == 1 else reply


def asserts_phrase(reply: str, phrase: str) -> bool:
    """Whether ``reply`` names ``phrase`` (as :func:`has_phrase`) other than negated: an occurrence right after
    ``not``, ``not a/an/the``, ``rather than`` or ``instead of`` does not count (``"a chef, not a baker"``)."""
    text, p = f" {fold(reply)} ", f" {fold(phrase)} "
    start = text.find(p)
    while p.strip() and start >= 0:
        before = text[:start].split()
        before = before[:-1] if before[-1:] in (["a"], ["an"], ["the"]) else before
        if before[-1:] != ["not"] and before[-2:] not in (["rather", "than"], ["instead", "of"]):
            return True
        start = text.find(p, start + 1)
    return False


def _contains(reply: str, check: dict, prompt: str) -> bool:
    if any(asserts_phrase(reply, r) for r in check.get("reject", ())):
        return False
    return any(has_phrase(reply, a) for a in check["accept"])


def _number(reply: str, check: dict, prompt: str) -> bool:
    """Right when the reply's result is the expected number (the first number after its last ``=``, else its
    last number), or the expected number appears and every other one is a number the prompt gave (a restated
    operand: ``"5 apples: he had 8 and gave 3"``)."""
    want, found = float(check["value"]), numbers(reply)
    if want not in found:
        return False
    after = numbers(reply.rsplit("=", 1)[1]) if "=" in reply else []
    result = after[0] if after else found[-1]
    given = set(numbers(prompt))
    return result == want or all(n == want or n in given for n in found)


def _one_word(reply: str, check: dict, prompt: str) -> bool:
    words = fold(_strip_markdown(reply)).split()
    return len(words) == 1 and (not check.get("accept") or words[0] in {fold(a) for a in check["accept"]})


def _bullets(reply: str, check: dict, prompt: str) -> bool:
    marks = [m for line in reply.splitlines() if (m := _BULLET.match(line))]
    return len(marks) == check["n"] and (check.get("numbered", True) or not any(m.group(1) for m in marks))


def _language(reply: str, check: dict, prompt: str) -> bool:
    shares = language_shares(reply)
    lang = check["lang"]
    return shares[lang] >= check.get("min_share", 0.15) and all(
        s < shares[lang] for k, s in shares.items() if k != lang
    )


def _json(reply: str, check: dict, prompt: str) -> bool:
    try:
        value = json.loads(_json_text(reply).strip())
    except ValueError:
        return False
    keys, kind = check.get("keys", ()), check.get("type")
    if kind and not isinstance(value, {"array": list, "object": dict}[kind]):
        return False
    return not keys or (isinstance(value, dict) and all(k in value for k in keys))


def _required_word(reply: str, check: dict, prompt: str) -> bool:
    return has_phrase(reply, check["word"])


def _max_words(reply: str, check: dict, prompt: str) -> bool:
    return 0 < len(fold(reply).split()) <= check["n"]


def _starts_with(reply: str, check: dict, prompt: str) -> bool:
    return f"{fold(_strip_markdown(reply))} ".startswith(f"{fold(check['text'])} ")


def _all_caps(reply: str, check: dict, prompt: str) -> bool:
    return any(c.isalpha() for c in reply) and not any(c.islower() for c in reply)


def _lowercase(reply: str, check: dict, prompt: str) -> bool:
    return any(c.isalpha() for c in reply) and not any(c.isupper() for c in reply)


def _all_of(reply: str, check: dict, prompt: str) -> bool:
    return all(judge(reply, c, prompt) for c in check["checks"])


#: Check kind -> judge ``(reply, check, prompt) -> right``.
KINDS: dict[str, Callable[[str, dict, str], bool]] = {
    "contains": _contains,
    "number": _number,
    "one_word": _one_word,
    "bullets": _bullets,
    "language": _language,
    "json": _json,
    "required_word": _required_word,
    "max_words": _max_words,
    "starts_with": _starts_with,
    "all_caps": _all_caps,
    "lowercase": _lowercase,
    "all_of": _all_of,
}
#: Fields each kind needs (beyond ``kind``).
REQUIRED = {
    "contains": ("accept",),
    "number": ("value",),
    "bullets": ("n",),
    "language": ("lang",),
    "required_word": ("word",),
    "max_words": ("n",),
    "starts_with": ("text",),
    "all_of": ("checks",),
}


def judge(reply: str, check: dict, prompt: str = "") -> bool:
    """Whether ``reply`` passes ``check`` (``{"kind": ..., ...}``); ``prompt`` gives a number check its operands."""
    return KINDS[check["kind"]](reply, check, prompt)


def validate(check: Any, where: str = "check") -> None:
    """Raises:
    ValueError: an unknown kind, a missing field, or a language without stop words."""
    if not isinstance(check, dict) or check.get("kind") not in KINDS:
        raise ValueError(f"{where}: unknown check {check!r} (kinds: {', '.join(KINDS)})")
    missing = [f for f in REQUIRED.get(check["kind"], ()) if f not in check]
    if missing:
        raise ValueError(f"{where}: a {check['kind']!r} check needs {', '.join(missing)}")
    if check["kind"] == "json" and check.get("type", "array") not in ("array", "object"):
        raise ValueError(f"{where}: a json check's type is array or object, not {check['type']!r}")
    if check["kind"] == "language" and check["lang"] not in STOP_WORDS:
        raise ValueError(f"{where}: language {check['lang']!r} is not one of {', '.join(STOP_WORDS)}")
    for i, sub in enumerate(check.get("checks", ()) if check["kind"] == "all_of" else ()):
        validate(sub, f"{where}.checks[{i}]")


@dataclass(frozen=True)
class CapabilityItem:
    """One item: a user prompt and the check its greedy reply (at most ``max_tokens`` tokens) must pass."""

    id: str
    category: str
    prompt: str
    check: dict
    max_tokens: int = 32
    source: str = ""

    def right(self, reply: str) -> bool:
        """Whether ``reply`` answers the item (judged on content, not form)."""
        return judge(reply, self.check, self.prompt)


def load_items(path: Path = GATE_FILE) -> list[CapabilityItem]:
    """The items of a JSONL set, in file order.

    Raises:
        ValueError: a bad line, an unknown category or check kind, a missing field, or a repeated id.
    """
    items, seen = [], set()
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            d = json.loads(line)
            item = CapabilityItem(**d)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: {e}") from None
        if item.category not in CATEGORIES:
            raise ValueError(f"{where}: category {item.category!r} is not one of {', '.join(CATEGORIES)}")
        if item.id in seen:
            raise ValueError(f"{where}: id {item.id!r} repeated")
        if not item.prompt.strip() or item.max_tokens < 1:
            raise ValueError(f"{where}: an empty prompt or max_tokens < 1")
        validate(item.check, where)
        seen.add(item.id)
        items.append(item)
    return items


def stratified(items: Sequence[CapabilityItem], seed: int = 0) -> list[CapabilityItem]:
    """``items`` round-robin over :data:`CATEGORIES` (then any other category), each category shuffled with
    ``seed``: every prefix holds each category's items in near-equal numbers until a category runs out."""
    groups: dict[str, list[CapabilityItem]] = {}
    for item in sorted(items, key=lambda i: i.id):
        groups.setdefault(item.category, []).append(item)
    order = [c for c in CATEGORIES if c in groups] + sorted(set(groups) - set(CATEGORIES))
    for c in order:
        random.Random(f"{seed}:{c}").shuffle(groups[c])
    out = []
    for row in range(max((len(g) for g in groups.values()), default=0)):
        out.extend(groups[c][row] for c in order if row < len(groups[c]))
    return out


def fingerprint(items: Iterable[CapabilityItem]) -> str:
    """sha256 hex of the items' ids, prompts, checks and ``max_tokens``, in order."""
    rows = [[i.id, i.prompt, i.check, i.max_tokens] for i in items]
    return hashlib.sha256(json.dumps(rows, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
