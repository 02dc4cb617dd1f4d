"""Data sources of the recipes, normalised to token ids with the chat renderer.

* chat SFT: messages-format JSONL (the schema of ``allenai/tulu-3-sft-mixture`` and
  ``HuggingFaceH4/ultrachat_200k``: ``{"messages": [{"role", "content"}, ...]}``), or a Hugging Face dataset
  name when a hub is reachable;
* GSM8K (``openai/gsm8k``, ``main``): a local folder with ``train.jsonl`` / ``test.jsonl`` or the hub name;
  as chat (question -> worked solution) or as problems with a numeric answer;
* a synthetic arithmetic split (two-number sums and differences), easy enough for a 135M model to move on;
* binary ratings: the live loop's dataset of record (``LIVELORA_HOME/data/signals/*.jsonl``, read as is:
  ``{"stream_id", "received", "event": {"type": "rating", ...}}``; a re-rate replaces the earlier rating of
  the same ``rating_key``), or TRL's unpaired format ``{"prompt" | "messages", "completion", "label"}``;
* preference pairs: the live loop's preference events (token-id or inline form), or JSONL of
  ``{"prompt" | "messages", "chosen", "rejected"}`` (texts or TRL message lists) or
  ``{"prompt_token_ids", "chosen_token_ids", "rejected_token_ids"}``.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from livelora.clients.recipes.renderers import ChatRenderer


class DataError(ValueError):
    """A data source is missing, unreachable or malformed (the message names the file and line)."""


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file. A torn last line (a writer killed mid-line) is skipped; any other bad line raises.

    Raises: DataError naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    lines = path.read_text().splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:
                continue
            raise DataError(f"{path}:{i + 1}: not JSON ({exc.msg})") from None
    return rows


def _hub(name: str, split: str, config: str | None = None) -> list[dict[str, Any]]:
    if name.startswith(("/", "./", "../", "~")) or Path(name).suffix in (".jsonl", ".json"):
        raise DataError(f"{name!r}: no such file or folder (a local path; hub data set names look like 'org/name')")
    try:
        import datasets
    except ImportError as exc:
        raise DataError(f"{name!r} is not a local file and the `datasets` package is not installed") from exc
    try:
        return list(datasets.load_dataset(name, config, split=split))
    except Exception as exc:  # offline, unknown name, gated, ...
        raise DataError(
            f"{name!r} is not a local path and could not be loaded from the Hugging Face hub "
            f"({type(exc).__name__}: {str(exc)[:200]}); pass a local JSONL file instead"
        ) from None


def load_chat(source: str, split: str = "train") -> list[list[dict[str, str]]]:
    """Conversations from a messages-format JSONL file or a hub dataset (``split``).

    Raises: DataError when the source is unreachable or a row has no ``messages`` list.
    """
    rows = read_jsonl(source) if Path(source).exists() else _hub(source, split)
    out = []
    for i, row in enumerate(rows):
        msgs = row.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{source}: row {i + 1} has no 'messages' list")
        out.append([{"role": m["role"], "content": m["content"]} for m in msgs])
    return out


# ---------------------------------------------------------------------------------------------- GSM8K
@dataclass(frozen=True)
class Problem:
    """A question with a numeric answer (``answer``: the canonical number as text, e.g. ``"18"``)."""

    question: str
    answer: str
    solution: str = ""


_CALC = re.compile(r"<<[^>]*>>")


def gsm8k(source: str, split: str) -> list[Problem]:
    """GSM8K problems from a folder holding ``{split}.jsonl`` or from the hub (``openai/gsm8k``, ``main``).

    The answer is the text after the last ``####`` with commas removed; the solution keeps the worked steps
    without the ``<<calculator>>`` annotations and ends with ``The answer is N.``.
    """
    folder = Path(source)
    rows = read_jsonl(folder / f"{split}.jsonl") if folder.is_dir() else _hub(source, split, "main")
    out = []
    for i, row in enumerate(rows):
        text = row.get("answer", "")
        if "####" not in text:
            raise DataError(f"{source} {split} row {i + 1}: answer has no '#### N' line")
        steps, _, final = text.rpartition("####")
        number = final.strip().replace(",", "")
        solution = _CALC.sub("", steps).strip() + f"\nThe answer is {number}."
        out.append(Problem(row["question"], number, solution))
    return out


def arithmetic(n: int, seed: int, max_value: int = 50) -> list[Problem]:
    """``n`` seeded problems "What is a + b?" / "What is a - b?" with 0 <= a, b < ``max_value``."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(max_value), rng.randrange(max_value)
        if rng.random() < 0.5:
            out.append(Problem(f"What is {a} + {b}?", str(a + b)))
        else:
            out.append(Problem(f"What is {a} - {b}?", str(a - b)))
    return out


# ---------------------------------------------------------------------------------------------- feedback
@dataclass(frozen=True)
class Rated:
    """One rated completion: ``prompt`` and ``completion`` token ids, ``desirable`` = thumbs up."""

    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    desirable: bool


@dataclass(frozen=True)
class Pair:
    """One preference pair on a shared prompt (token ids)."""

    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]


def _records(source: str | Path) -> list[dict[str, Any]]:
    path = Path(source)
    if path.is_dir():  # the dataset of record: dated files, oldest first (trained.jsonl/rejected.jsonl excluded)
        files = sorted(path.glob("[0-9]*.jsonl"))
        if not files:
            raise DataError(f"{path}: no dated *.jsonl files (expected LIVELORA_HOME/data/signals)")
        return [row for f in files for row in read_jsonl(f)]
    return read_jsonl(path)


def _prompt(row: dict[str, Any], renderer: ChatRenderer, where: str) -> tuple[int, ...]:
    if row.get("prompt_token_ids"):
        return tuple(row["prompt_token_ids"])
    if row.get("messages"):
        return tuple(renderer.prompt_tokens(row["messages"]))
    if isinstance(row.get("prompt"), str):
        return tuple(renderer.prompt_tokens([{"role": "user", "content": row["prompt"]}]))
    if isinstance(row.get("prompt"), list):
        return tuple(renderer.prompt_tokens(row["prompt"]))
    raise DataError(f"{where}: no prompt (prompt_token_ids, messages or prompt)")


def _reply(value: Any, renderer: ChatRenderer, where: str) -> tuple[int, ...]:
    if isinstance(value, list) and value and isinstance(value[-1], dict):  # TRL conversational form
        value = value[-1].get("content")
    if not isinstance(value, str):
        raise DataError(f"{where}: a reply must be a string or a list of messages")
    return tuple(renderer.completion_tokens(value))


def load_ratings(source: str | Path, renderer: ChatRenderer) -> list[Rated]:
    """Binary ratings from the dataset of record (file or folder) or a TRL-style unpaired JSONL.

    Live-loop rating events keep their exact served token ids; a completion that ended on a stop gets the
    end-of-turn token appended (the engine does not report it; the online trainer does the same). Only the
    latest rating per ``rating_key`` counts. Other event types and invalid records are ignored.

    Raises: DataError when the source holds no rating at all.
    """
    latest: dict[str, Rated] = {}
    stop = renderer.stop_token_ids
    for i, row in enumerate(_records(source)):
        ev = row.get("event") if isinstance(row.get("event"), dict) else None
        if ev is not None:
            if ev.get("type") != "rating":
                continue
            completion = list(ev["completion_token_ids"])
            if ev.get("finish_reason") == "stop" and stop and completion[-1:] != stop[-1:]:
                completion += stop
            latest[ev.get("rating_key") or ev["id"]] = Rated(
                tuple(ev["prompt_token_ids"]), tuple(completion), bool(ev["rating"])
            )
        elif "label" in row and "completion" in row:
            where = f"{source} row {i + 1}"
            latest[f"row{i}"] = Rated(
                _prompt(row, renderer, where), _reply(row["completion"], renderer, where), bool(row["label"])
            )
    if not latest:
        raise DataError(f"{source}: no ratings found (rating events or rows with prompt/completion/label)")
    return list(latest.values())


def pairs_from_ratings(rated: list[Rated], seed: int = 0) -> list[Pair]:
    """Preference pairs from ratings of the same prompt: each thumbs-down reply paired with a thumbs-up reply of
    that prompt (cycling through the liked ones, seeded order); prompts without both labels give none."""
    by_prompt: dict[tuple[int, ...], tuple[list, list]] = {}
    for x in rated:
        by_prompt.setdefault(x.prompt, ([], []))[0 if x.desirable else 1].append(x.completion)
    rng, out = random.Random(seed), []
    for prompt, (good, bad) in by_prompt.items():
        if good and bad:
            rng.shuffle(good)
            out += [Pair(prompt, good[i % len(good)], b) for i, b in enumerate(bad)]
    return out


def load_preferences(source: str | Path, renderer: ChatRenderer) -> list[Pair]:
    """Preference pairs from the dataset of record (preference events) or a chosen/rejected JSONL.

    Pairs given by completion ids without token ids (not resolvable offline) are skipped.
    Raises: DataError when the source holds no usable pair.
    """
    out = []
    for i, row in enumerate(_records(source)):
        event = row.get("event")
        rec: dict[str, Any] = event if isinstance(event, dict) else row
        if row is not rec and rec.get("type") != "preference":
            continue
        where = f"{source} row {i + 1}"
        if rec.get("chosen_token_ids") and rec.get("rejected_token_ids"):
            out.append(
                Pair(_prompt(rec, renderer, where), tuple(rec["chosen_token_ids"]), tuple(rec["rejected_token_ids"]))
            )
        elif rec.get("chosen") is not None and rec.get("rejected") is not None:
            out.append(
                Pair(
                    _prompt(rec, renderer, where),
                    _reply(rec["chosen"], renderer, where),
                    _reply(rec["rejected"], renderer, where),
                )
            )
    if not out:
        raise DataError(f"{source}: no preference pairs found")
    return out
