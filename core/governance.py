"""Feedback governance records on disk, shared by the trainer (which enforces them) and the gateway's admin API.

``quarantine.jsonl`` and ``forgotten.jsonl`` under ``LIVELORA_HOME/data/signals`` record the events kept out of
training and the delete-by-user requests (:func:`forget_user` also removes the user's events from the dataset
of record); :func:`rater_of` names an event's rater (``user``, else ``caller``, else ``(anonymous)``), and
:func:`agreement_weights` turns the raters' labels into one weight per rater. Record formats and how the
trainer applies them: ``docs/internals/live-training.md``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from livelora.core.api_keys import DEFAULT_TENANT
from livelora.core.atomic import append_line, file_lock, private_dir

#: Folder of the dataset of record, relative to ``LIVELORA_HOME``.
DATASET_SUBDIR = ("data", "signals")
#: Lock file serialising writers of the dataset of record.
DATASET_LOCK = ".dataset.lock"
QUARANTINE_FILE = "quarantine.jsonl"
FORGOTTEN_FILE = "forgotten.jsonl"
ANONYMOUS = "(anonymous)"


def signals_dir(home: Path | str) -> Path:
    """``LIVELORA_HOME/data/signals``."""
    return Path(home).joinpath(*DATASET_SUBDIR)


def _reader(event: Any) -> Callable[[str], Any]:
    """``get(name)``: a field of an event object or of its JSON dict (``None`` when absent)."""
    return event.get if isinstance(event, dict) else (lambda k: getattr(event, k, None))


def rater_of(event: Any) -> str:
    """The rater an event counts against (``user``, else ``caller``, else ``(anonymous)``); works on an event
    object or its JSON dict."""
    get = _reader(event)
    return get("user") or get("caller") or ANONYMOUS


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line
    return out


def read_quarantine(home: Path | str, endpoints: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Quarantined events, oldest first (only those of ``endpoints`` when given)."""
    allowed = None if endpoints is None else set(endpoints)
    return [
        r for r in _read_jsonl(signals_dir(home) / QUARANTINE_FILE) if allowed is None or r.get("endpoint") in allowed
    ]


def record_quarantine(home: Path | str, records: list[dict[str, Any]]) -> None:
    """Append quarantine lines (durable on return)."""
    path = signals_dir(home) / QUARANTINE_FILE
    private_dir(path.parent)
    for r in records:
        append_line(path, json.dumps(r))


def forgotten(home: Path | str) -> dict[str, set[str | None]]:
    """user → tenants (``None``: all) whose endpoints must not train on that user's data any more."""
    out: dict[str, set[str | None]] = {}
    for r in _read_jsonl(signals_dir(home) / FORGOTTEN_FILE):
        out.setdefault(r["user"], set()).add(r.get("tenant"))
    return out


def forget_user(
    home: Path | str, user: str, tenant: str | None, owns: Callable[[str], bool], *, who: str
) -> dict[str, int]:
    """Delete ``user``'s events (sent by them, or rating or pairing their completions) on the endpoints
    ``owns(endpoint)`` accepts, sent through ``tenant``'s keys (its
    ``caller``; ``None``: any tenant's), from the dataset of record (every
    day file rewritten atomically under the dataset lock), after recording the request in ``forgotten.jsonl``,
    so that trainers drop the user's queued and later events even if this process dies midway.

    Returns:
        ``{endpoint: events removed}``.
    """
    folder = signals_dir(home)
    private_dir(folder)
    append_line(folder / FORGOTTEN_FILE, json.dumps({"user": user, "tenant": tenant, "time": time.time(), "who": who}))
    removed: dict[str, int] = {}
    with file_lock(folder / DATASET_LOCK):
        for path in sorted(folder.glob("[0-9]*.jsonl")):
            keep, changed = [], False
            for line in path.read_text().splitlines():
                try:
                    ev = json.loads(line).get("event")
                except json.JSONDecodeError:
                    keep.append(line)
                    continue
                if (
                    isinstance(ev, dict)
                    and (ev.get("user") == user or user in (ev.get("completion_users") or ()))
                    and (tenant is None or (ev.get("caller") or DEFAULT_TENANT) == tenant)
                    and owns(ev.get("endpoint", ""))
                ):
                    removed[ev["endpoint"]] = removed.get(ev["endpoint"], 0) + 1
                    changed = True
                    continue
                keep.append(line)
            if changed:
                tmp = path.with_name(f".{path.name}.tmp")
                with open(tmp, "w") as f:
                    f.write("".join(x + "\n" for x in keep))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
    return removed


# ---------------------------------------------------------------------------- rater agreement weighting

#: Pseudo-ratings of the prior (how many compared labels it is worth).
AGREEMENT_PRIOR_STRENGTH = 4.0
#: Prior agreement rate of a rater never compared with others (its weight is 1).
AGREEMENT_PRIOR = 0.9
#: Accuracy bounds in the log-odds (keeps a unanimous rater's log-odds finite).
_P_MIN, _P_MAX = 0.01, 0.99

# KEYS[1] labels hash, KEYS[2] order zset; ARGV[1] field, ARGV[2] label, ARGV[3] now, ARGV[4] window (fields kept)
RECORD_LABEL_SCRIPT = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[4])
if over > 0 then
  local old = redis.call('ZRANGE', KEYS[2], 0, over - 1)
  redis.call('HDEL', KEYS[1], unpack(old))
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, over - 1)
end
return over
"""


def agreement_item(event: Any) -> tuple[str, int] | None:
    """The item a signal labels and its binary label, for rater agreement: a rating labels its completion
    (``(completion_id, 1 = thumbs up)``); a preference pair labels the unordered pair of its served completions
    (``("pair:<a>|<b>", 1 if a was chosen)``, ``a < b``). ``None`` for demonstrations and inline preferences (no
    completion ids: nothing another rater could label too). Works on an event object or its JSON dict."""
    get = _reader(event)
    kind = get("type")
    if kind == "rating" and get("completion_id"):
        return get("completion_id"), 1 if get("rating") else 0
    if kind == "preference" and get("chosen_completion_id") and get("rejected_completion_id"):
        chosen, rejected = get("chosen_completion_id"), get("rejected_completion_id")
        a, b = sorted((chosen, rejected))
        return f"pair:{a}|{b}", 1 if chosen == a else 0
    return None


def label_field(item: str, rater: str) -> str:
    """The hash field of one rater's label of one item (``json([item, rater])``)."""
    return json.dumps([item, rater])


def labels_from_hash(raw: dict[Any, Any]) -> dict[str, dict[str, int]]:
    """``item → {rater: label}`` from the labels hash as Redis returns it (bytes or str; bad fields skipped)."""
    out: dict[str, dict[str, int]] = {}
    for k, v in raw.items():
        try:
            item, rater = json.loads(k.decode() if isinstance(k, bytes) else k)
            label = int(v.decode() if isinstance(v, bytes) else v)
        except (ValueError, TypeError):
            continue
        out.setdefault(item, {})[rater] = 1 if label else 0
    return out


def agreement_weights(
    labels: dict[str, dict[str, int]],
    *,
    prior_strength: float = AGREEMENT_PRIOR_STRENGTH,
    prior: float = AGREEMENT_PRIOR,
    iterations: int = 20,
) -> dict[str, dict[str, float]]:
    """Each rater's agreement with the others and the weight its training examples get.

    The "one-coin" model (Dawid & Skene 1979; Raykar et al. 2010, JMLR 11): rater r labels an item correctly with
    probability p_r. Leave-one-out agreement ``p_r = (k·p₀ + Σ_c P(z_c = y_rc | others)) / (k + n_r)`` (a Beta-prior
    posterior mean over the n_r items r shares with another rater), iterated to a fixed point from p₀; weight
    ``w_r = clip((2·p_r − 1) / (2·p₀ − 1), 0, 1)``, so an uncompared rater weighs 1 and a rater the others
    contradict falls to 0. Derivation, worked numbers and limits: docs/internals/live-training.md.

    Args:
        labels: ``item → {rater: label 0/1}``.
        prior_strength / prior: k > 0 and p₀ in (½, 1).
        iterations: passes of the fixed-point update (≥ 1).

    Returns:
        ``rater → {"weight", "agreement" (p_r), "compared" (n_r, items shared with another rater)}`` for every
        rater in ``labels``.

    Raises:
        ValueError: ``prior`` not in (½, 1) or ``prior_strength`` ≤ 0.
    """
    import math

    if not 0.5 < prior < 1 or prior_strength <= 0:
        raise ValueError("agreement prior must lie in (0.5, 1) and its strength be > 0")
    raters = sorted({r for by in labels.values() for r in by})
    shared = [by for by in labels.values() if len(by) >= 2]
    compared = {r: 0 for r in raters}
    for by in shared:
        for r in by:
            compared[r] += 1
    p = {r: prior for r in raters}
    for _ in range(max(1, iterations)):
        logit = {r: math.log(min(_P_MAX, max(_P_MIN, v)) / (1 - min(_P_MAX, max(_P_MIN, v)))) for r, v in p.items()}
        credit = {r: 0.0 for r in raters}
        for by in shared:
            for r, y in by.items():
                s = sum(logit[o] if yo == y else -logit[o] for o, yo in by.items() if o != r)
                credit[r] += 1 / (1 + math.exp(-s))
        new = {r: (prior_strength * prior + credit[r]) / (prior_strength + compared[r]) for r in raters}
        moved = max((abs(new[r] - p[r]) for r in raters), default=0.0)
        p = new
        if moved < 1e-6:
            break
    return {
        r: {
            "weight": min(1.0, max(0.0, (2 * p[r] - 1) / (2 * prior - 1))),
            "agreement": p[r],
            "compared": float(compared[r]),
        }
        for r in raters
    }


def held_out(event_id: str, every: int) -> bool:
    """Whether the event with this id is held out for the evaluation gate: sha256(id) mod ``every`` == 0 (never
    when ``every`` ≤ 0). The trainer keeps such events out of training; the feedback answer says so."""
    if every <= 0:
        return False
    return int.from_bytes(hashlib.sha256(event_id.encode()).digest()[:8], "big") % every == 0
