"""The training-session protocol shared by the gateway (routes) and the op executor (trainer): ids, ``tinker://``
paths, queued ops (:class:`Op`), future records (:func:`future_done`, :func:`future_failed`) and the checkpoint
index (:class:`CheckpointIndex`, fenced by the owner's lease token: :class:`StaleOwnerError`). Redis key names
are in :class:`~livelora.core.redis_keys.KeyLayout`. Torch-free.

Ids: a training model is ``{session_id}:train:{model_seq_id}`` (:func:`model_id_for`); its checkpoints are
adapter-store versions of the lineage :func:`lineage_for` the model. The flow of one op, ownership and the
checkpoint paths: ``docs/internals/training-sessions.md``.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from livelora.clients.errors import (
    BadRequestError,
    ConflictError,
    InternalError,
    LiveloraError,
    NotFoundError,
    error_to_dict,
)
from livelora.core.atomic import atomic_write_json, file_lock, private_dir

TINKER_SCHEME = "tinker://"
#: checkpoint kind in a tinker path → the checkpoint type the Tinker API reports
CHECKPOINT_KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
#: the accepted path spellings, for error messages
PATH_FORMS = (
    "tinker://<model_id>/weights/<name>, tinker://<model_id>/sampler_weights/<name> or "
    "tinker://<model_id>/external_weights/<name>"
)
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


# ============================================================================================ ids and paths
def model_id_for(session_id: str, model_seq_id: int) -> str:
    """``{session_id}:train:{model_seq_id}`` (the id the tinker SDK computes for create-via-load)."""
    return f"{session_id}:train:{model_seq_id}"


def session_of(model_id: str) -> str:
    """The session id part of a model id (everything before ``:train:``)."""
    return model_id.split(":train:", 1)[0]


def lineage_for(model_id: str) -> str:
    """The adapter-store lineage of a model: its id lower-cased, characters outside ``[a-z0-9._-]`` → ``-``,
    plus an 8-hex digest of the id when that was lossy or long (so two ids never share a lineage)."""
    base = re.sub(r"[^a-z0-9._-]", "-", model_id.lower()).lstrip("._-") or "m"
    if base == model_id.replace(":", "-") and len(base) <= 64:
        return base
    return f"{base[:55]}-{hashlib.sha256(model_id.encode()).hexdigest()[:8]}"


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"{TINKER_SCHEME}{model_id}/{kind}/{name}"


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """Split ``tinker://<model_id>/<kind>/<name>`` into ``(model_id, kind, name)``.

    Raises:
        BadRequestError: not a tinker path, or a kind other than ``weights`` / ``sampler_weights`` /
            ``external_weights``.
    """
    if not isinstance(path, str) or not path.startswith(TINKER_SCHEME):
        raise BadRequestError(f"invalid checkpoint path {path!r}: expected {PATH_FORMS}", param="path")
    parts = path[len(TINKER_SCHEME) :].split("/")
    if len(parts) != 3 or not all(parts) or parts[1] not in CHECKPOINT_KINDS:
        raise BadRequestError(f"invalid checkpoint path {path!r}: expected {PATH_FORMS}", param="path")
    return parts[0], parts[1], parts[2]


def check_checkpoint_name(name: str | None) -> str:
    """A checkpoint name: 1-128 of ``[A-Za-z0-9._-]``, starting with a letter or digit.

    Raises:
        BadRequestError: anything else (also ``None``).
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise BadRequestError(
            f"invalid checkpoint name {name!r}: use 1-128 characters of A-Z, a-z, 0-9, '.', "
            "'_', '-', starting with a letter or digit",
            param="path",
        )
    return name


def now_iso() -> str:
    return datetime.now(UTC).isoformat()


def expires_at(ttl_seconds: int | None) -> str | None:
    """ISO time ``ttl_seconds`` from now (UTC), or None (no TTL: kept until deleted)."""
    if ttl_seconds is None:
        return None
    return (datetime.now(UTC) + timedelta(seconds=int(ttl_seconds))).isoformat()


def is_expired(entry: dict[str, Any], now: datetime | None = None) -> bool:
    """Whether a checkpoint-index entry's ``expires_at`` has passed."""
    at = entry.get("expires_at")
    return at is not None and datetime.fromisoformat(at) <= (now or datetime.now(UTC))


# ============================================================================================ checkpoint index
class StaleOwnerError(ConflictError):
    """A write by an executor whose lease was taken over (its fencing token is lower than the index's)."""

    default_code = "stale_owner"


class CheckpointIndex:
    """Name → adapter version map of one training run, in ``<home>/sessions/<lineage>.json``.

    Layout: ``{"model_id", "base_model", "lora": {...}, "user_metadata", "created", "fence", "recovery":
    {"file", "seq", "fence"}, "checkpoints": {"weights/<name>": {"version", "time", "adapter", "request_id"},
    ...}}``. Updates hold ``<file>.lock``; an update with a ``fence`` token is refused when the index already
    holds a higher one, and raises the index's token to its own otherwise.
    """

    def __init__(self, home: Path | str, model_id: str):
        self.model_id = model_id
        self.lineage = lineage_for(model_id)
        self.path = Path(home) / "sessions" / f"{self.lineage}.json"

    def read(self) -> dict[str, Any]:
        """The index (NotFoundError if the run has never been created)."""
        if not self.path.is_file():
            raise NotFoundError(f"training run {self.model_id!r} does not exist", param="model_id")
        return json.loads(self.path.read_text())

    def update(self, fn, *, fence: int | None = None) -> dict[str, Any]:
        """Apply ``fn(index_dict)`` (which mutates it) under the lock and write it atomically.

        Args:
            fence: the writer's fencing token (training-model owners pass theirs; user actions such as
                deleting a checkpoint pass none).

        Raises:
            StaleOwnerError: ``fence`` is lower than the token recorded in the index (nothing is written).
        """
        private_dir(self.path.parent)
        with file_lock(self.path.with_suffix(".lock")):
            data = json.loads(self.path.read_text()) if self.path.is_file() else {"checkpoints": {}}
            if fence is not None:
                recorded = int(data.get("fence") or 0)
                if fence < recorded:
                    raise StaleOwnerError(
                        f"training model {self.model_id}: write with fencing token {fence} "
                        f"refused, the model is owned under token {recorded}"
                    )
                data["fence"] = fence
            fn(data)
            atomic_write_json(self.path, data)
        return data

    def fence(self) -> int:
        """The highest fencing token that wrote the index (0 when none or no index)."""
        try:
            return int(self.read().get("fence") or 0)
        except NotFoundError:
            return 0

    def resolve(self, kind: str, name: str) -> int:
        """Version number of checkpoint ``kind/name``.

        Raises:
            NotFoundError: unknown run or checkpoint.
        """
        entry = self.read().get("checkpoints", {}).get(f"{kind}/{name}")
        if entry is None:
            raise NotFoundError(f"checkpoint {tinker_path(self.model_id, kind, name)} does not exist", param="path")
        return int(entry["version"])


def resolve_checkpoint(home: Path | str, path: str, *, want: str | None = None) -> tuple[CheckpointIndex, str, int]:
    """``(index, kind, version)`` of a tinker path; ``want`` = required kind (``weights``/``sampler_weights``).

    Raises:
        BadRequestError: malformed path, or the wrong kind (the message says which kind is needed).
        NotFoundError: no such run or checkpoint.
    """
    model_id, kind, name = parse_tinker_path(path)
    if want is not None and kind != want:
        what = {
            "weights": "a training checkpoint",
            "sampler_weights": "a sampler checkpoint (weights only, no optimizer state)",
            "external_weights": "an external-weights export (for download only)",
        }[kind]
        if want == "weights":
            raise BadRequestError(
                f"{path} is {what}; training clients load training checkpoints saved with "
                "save_state (tinker://<model_id>/weights/<name>)",
                param="path",
            )
        raise BadRequestError(
            f"{path} is {what}; sampling clients take sampler checkpoints saved with "
            "save_weights_for_sampler (tinker://<model_id>/sampler_weights/<name>)",
            param="path",
        )
    index = CheckpointIndex(home, model_id)
    return index, kind, index.resolve(kind, name)


# ============================================================================================ futures and ops
def future_done(result: dict[str, Any]) -> str:
    return json.dumps({"state": "done", "result": result})


def future_failed(err: BaseException) -> str:
    """The future record of a failed op: ``{"error", "category", "class", "code", "param"}``."""
    if not isinstance(err, LiveloraError):
        err = InternalError(f"internal error: {type(err).__name__}: {err}")
    d = error_to_dict(err)
    return json.dumps(
        {
            "state": "failed",
            "error": d["message"],
            "category": d["category"],
            "class": d["class"],
            "code": d["code"],
            "param": d["param"],
        }
    )


# ============================================================================================ op order
def gap_expired(next_seq: int, arrived: dict[int, float], now: float, timeout_s: float) -> int | None:
    """The highest buffered seq whose op has waited ``timeout_s`` since it arrived (``arrived``: buffered seq →
    arrival time, s) for a seq before it that never came; ``None`` when none has. The executor fails the
    buffered ops up to it and gives up the missing seqs among them, so the model runs on from the seq after it.
    Its client's own later ops at a given-up seq fail at once (:func:`dropped_error`), never wait."""
    expired = [seq for seq, t in arrived.items() if seq > next_seq and now - t >= timeout_s]
    return max(expired) if expired else None


def gap_error(model_id: str, missing: int, timeout_s: float) -> BadRequestError:
    return BadRequestError(
        f"seq_id {missing} of model {model_id} never arrived within {timeout_s:g} s of this op; ops after it "
        "cannot run in order, so the seqs up to this op were given up (LIVELORA_GAP_TIMEOUT_S)",
        param="seq_id",
        code="seq_gap_timeout",
    )


def dropped_error(model_id: str, seq_id: int, next_seq: int, queued: bool = False) -> BadRequestError:
    """Why an op was not run: another op holds its seq (``queued``), or its seq is behind ``next_seq``."""
    if queued:
        return BadRequestError(
            f"op seq_id {seq_id} of model {model_id} was not run: another op under that seq is queued (seq ids "
            "are one per op, in call order)",
            param="seq_id",
            code="seq_conflict",
        )
    return BadRequestError(
        f"op seq_id {seq_id} of model {model_id} was not run: the model's next op is seq_id {next_seq} (that seq "
        "already ran, or was given up when an op before it never arrived)",
        param="seq_id",
        code="seq_behind",
    )


@dataclass
class Op:
    """One queued training op: ``kind`` (route name or ``failed``), ``seq_id``, ``request_id``, ``body`` (JSON)."""

    kind: str
    seq_id: int
    request_id: str
    body: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "seq_id": self.seq_id, "request_id": self.request_id, "body": self.body})

    @classmethod
    def from_json(cls, raw: str | bytes) -> Op:
        d = json.loads(raw)
        return cls(str(d["kind"]), int(d["seq_id"]), str(d["request_id"]), dict(d.get("body") or {}))


def new_request_id(scope: str) -> str:
    """A fresh request id ``{scope}:{12 hex}``."""
    return f"{scope}:{uuid.uuid4().hex[:12]}"
