"""Usage metering: tokens each tenant used, counted in Redis, rolled up per hour into the store.

:class:`Meter` adds an operation's tokens to one counter per ``(tenant, key, subject, kind)`` (kinds:
:data:`KINDS`) and to the tenant's per-day totals that quotas read; :class:`UsageStore` moves the hourly
counters into ``<home>/usage/`` (:meth:`UsageStore.rollup`) and answers grouped queries from a consistent
snapshot (:meth:`UsageStore.query`). Key layout, rollup steps and why reads never count twice:
``docs/internals/metering.md``.

Example::

    meter = Meter(KeyLayout("livelora:"))
    meter.record_sync(redis_client, Usage("acme", "k1", "support", {"prompt": 12, "completion": 30}))
    rows = UsageStore(home, KeyLayout("livelora:")).query_sync(redis_client, group_by=["tenant", "kind"])
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from livelora.clients.errors import BadRequestError
from livelora.core.atomic import atomic_write_json
from livelora.core.redis_keys import KeyLayout

#: Every counter kind (what each counts: docs/internals/metering.md).
KINDS: tuple[str, ...] = (
    "prompt",  # prompt tokens of a served completion
    "completion",  # generated tokens of a served completion
    "forward",  # model_input tokens of a session forward op
    "trained",  # model_input tokens of a session forward_backward op
    "sample_prompt",  # prompt tokens of a session sample request (once per request)
    "sampled",  # tokens a session sample generated (every sequence)
    "scored",  # prompt tokens scored for prompt_logprobs
    "live_trained",  # model_input tokens of a live-loop training step
)
#: Dimensions a query may group by.
GROUP_BY: tuple[str, ...] = ("tenant", "key", "subject", "kind", "hour", "day")
#: ``key`` of usage made without an API key (open mode, live loop).
NO_KEY = "-"
USAGE_DIR = "usage"
#: Lifetime of the per-day counters quotas read (s): three days, so a day's total outlives the day.
DAY_TTL_S = 3 * 24 * 3600

_ROLL = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('SREM', KEYS[3], ARGV[1])
  return false
end
local t = redis.call('TIME')
local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('RENAME', KEYS[1], KEYS[2])
redis.call('SREM', KEYS[3], ARGV[1])
redis.call('HSET', KEYS[4], KEYS[2], ARGV[1] .. ' ' .. ms)
return ms
"""

_SNAPSHOT = """
local t = redis.call('TIME')
local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = {}
for _, h in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  table.insert(live, {h, redis.call('HGETALL', ARGV[1] .. h)})
end
local pending = {}
local p = redis.call('HGETALL', KEYS[2])
for i = 1, #p, 2 do
  table.insert(pending, {p[i], p[i + 1], redis.call('HGETALL', p[i])})
end
return {ms, live, pending}
"""


def hour_of(ts: float) -> str:
    """UTC hour label ``YYYYMMDDHH`` of Unix time ``ts`` (seconds)."""
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y%m%d%H")


def parse_time(value: str | float | int | None, param: str) -> float | None:
    """A ``from``/``to`` bound: Unix seconds, or an ISO 8601 date/time (UTC when no offset is given).

    Raises:
        BadRequestError: neither a number nor an ISO 8601 string.
    """
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(value)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(value)
    except ValueError:
        raise BadRequestError(f"{param} must be Unix seconds or an ISO 8601 time, got {value!r}", param=param) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


@dataclass(frozen=True)
class Usage:
    """Tokens one operation used.

    Attributes:
        tenant: who pays. key: API key id (:data:`NO_KEY` if none). subject: endpoint, model or session id.
        tokens: ``{kind: tokens}`` (kinds from :data:`KINDS`; zero counts are skipped).
    """

    tenant: str
    key: str | None
    subject: str
    tokens: Mapping[str, int] = field(default_factory=dict)

    def fields(self) -> list[tuple[str, int]]:
        """``[(hash field, n)]`` of the non-zero counts.

        Raises:
            ValueError: an unknown kind or a negative count (a bug in the caller).
        """
        out = []
        for kind, n in self.tokens.items():
            if kind not in KINDS:
                raise ValueError(f"unknown usage kind {kind!r}")
            if n < 0:
                raise ValueError(f"negative usage {n} for {kind!r}")
            if n:
                out.append((json.dumps([self.tenant, self.key or NO_KEY, self.subject, kind]), int(n)))
        return out


class Meter:
    """Adds :class:`Usage` to the Redis counters (one ``MULTI`` per operation).

    Args:
        keys: the key layout. enabled: ``False`` makes every record a no-op (``LIVELORA_METERING=false``).
        clock: Unix seconds (tests pass a fixed one).
    """

    def __init__(self, keys: KeyLayout, enabled: bool = True, clock=time.time):
        self.keys, self.enabled, self.clock = keys, enabled, clock

    def _queue(self, pipe, usage: Usage) -> bool:
        fields = usage.fields()
        if not fields:
            return False
        hour = hour_of(self.clock())
        day = self.keys.usage_day(hour[:8], usage.tenant)
        for name, n in fields:
            pipe.hincrby(self.keys.usage_hour(hour), name, n)
            pipe.hincrby(day, json.loads(name)[3], n)
        pipe.sadd(self.keys.usage_hours, hour)
        pipe.expire(day, DAY_TTL_S)
        return True

    def record_sync(self, client, usage: Usage) -> None:
        """Count ``usage`` with a synchronous ``redis.Redis`` (raises redis errors)."""
        if not self.enabled:
            return
        pipe = client.pipeline(transaction=True)
        if self._queue(pipe, usage):
            pipe.execute()

    async def record(self, client, usage: Usage) -> None:
        """Count ``usage`` with a ``redis.asyncio.Redis`` (raises redis errors)."""
        if not self.enabled:
            return
        pipe = client.pipeline(transaction=True)
        if self._queue(pipe, usage):
            await pipe.execute()


@dataclass
class UsageRow:
    """One row of a usage report: the grouped dimensions and the token count."""

    dims: dict[str, str]
    tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {**self.dims, "tokens": self.tokens}


class UsageStore:
    """Rollups into ``<home>/usage/`` and queries over the store and Redis.

    Args:
        home: the store root. keys: the key layout.
    """

    def __init__(self, home: Path | str, keys: KeyLayout):
        self.root = Path(home) / USAGE_DIR
        self.keys = keys

    # ------------------------------------------------------------------ rollup
    def _file(self, hour: str, stamp: int, rid: str) -> Path:
        return self.root / hour / f"{stamp}-{rid}.json"

    def rollup_sync(self, client) -> int:
        """Roll every hourly counter up into ``<home>/usage/`` (docs/internals/metering.md); returns files written.

        Safe to run from several processes at once and after a crash half-way (idempotent per rolled hash).
        """
        written = 0
        for hour in sorted(_s(h) for h in client.smembers(self.keys.usage_hours)):
            rolling = self.keys.usage_rolling(hour, uuid.uuid4().hex)
            client.eval(
                _ROLL, 4, self.keys.usage_hour(hour), rolling, self.keys.usage_hours, self.keys.usage_pending, hour
            )
        for rolling, note in client.hgetall(self.keys.usage_pending).items():
            rolling, note = _s(rolling), _s(note)
            hour, stamp = note.split(" ")
            counts = {_s(k): int(v) for k, v in client.hgetall(rolling).items()}
            path = self._file(hour, int(stamp), rolling.rsplit(":", 1)[-1])
            if counts and not path.exists():
                atomic_write_json(path, {"hour": hour, "stamp_ms": int(stamp), "counts": counts})
                written += 1
            pipe = client.pipeline(transaction=True)
            pipe.delete(rolling)
            pipe.hdel(self.keys.usage_pending, rolling)
            pipe.execute()
        return written

    # ------------------------------------------------------------------ query
    def _snapshot_sync(self, client) -> tuple[int, list, list]:
        ms, live, pending = client.eval(
            _SNAPSHOT, 2, self.keys.usage_hours, self.keys.usage_pending, self.keys.usage_hour("")
        )
        return int(ms), live, pending

    async def _snapshot(self, client) -> tuple[int, list, list]:
        ms, live, pending = await client.eval(
            _SNAPSHOT, 2, self.keys.usage_hours, self.keys.usage_pending, self.keys.usage_hour("")
        )
        return int(ms), live, pending

    def _counts(self, snapshot: tuple[int, list, list]) -> Iterable[tuple[str, str, int]]:
        """``(hour, field, n)`` of the snapshot plus the store's files not in it and stamped at most its time."""
        ms, live, pending = snapshot
        seen: set[str] = set()
        for hour, flat in live:
            yield from _pairs(_s(hour), flat)
        for rolling, note, flat in pending:
            seen.add(_s(rolling).rsplit(":", 1)[-1])
            yield from _pairs(_s(note).split(" ")[0], flat)
        if not self.root.is_dir():
            return
        for hour_dir in sorted(self.root.iterdir()):
            if not hour_dir.is_dir():
                continue
            for path in sorted(hour_dir.glob("*.json")):
                stamp, _, rid = path.stem.partition("-")
                if rid in seen or not stamp.isdigit() or int(stamp) > ms:
                    continue
                data = json.loads(path.read_text())
                for name, n in data.get("counts", {}).items():
                    yield hour_dir.name, name, int(n)

    def query_sync(self, client, **filters) -> list[UsageRow]:
        """:meth:`aggregate` of a snapshot taken with a synchronous client (``client=None``: the store only)."""
        snap = self._snapshot_sync(client) if client is not None else (2**62, [], [])
        return self.aggregate(self._counts(snap), **filters)

    async def query(self, client, **filters) -> list[UsageRow]:
        """:meth:`aggregate` of a snapshot taken with a ``redis.asyncio`` client."""
        return self.aggregate(self._counts(await self._snapshot(client)), **filters)

    @staticmethod
    def aggregate(
        counts: Iterable[tuple[str, str, int]],
        *,
        tenant: str | None = None,
        key: str | None = None,
        subject: str | None = None,
        kind: str | None = None,
        start: float | None = None,
        end: float | None = None,
        group_by: Sequence[str] = ("tenant", "key", "subject", "kind"),
    ) -> list[UsageRow]:
        """Sum ``counts`` over the hours that overlap ``[start, end)`` (Unix s; counts are kept per UTC hour),
        keeping the rows that match the filters, grouped by ``group_by`` (dimensions of :data:`GROUP_BY`).

        Returns: rows sorted by their dimensions.

        Raises:
            BadRequestError: an unknown ``group_by`` dimension or ``kind``.
        """
        bad = [g for g in group_by if g not in GROUP_BY]
        if bad:
            raise BadRequestError(
                f"cannot group by {', '.join(bad)}; choose from {', '.join(GROUP_BY)}", param="group_by"
            )
        if kind is not None and kind not in KINDS:
            raise BadRequestError(f"unknown kind {kind!r}; kinds: {', '.join(KINDS)}", param="kind")
        lo = hour_of(start) if start is not None else None
        hi_ts = end
        totals: dict[tuple[str, ...], int] = {}
        for hour, name, n in counts:
            if lo is not None and hour < lo:
                continue
            if hi_ts is not None and _hour_start(hour) >= hi_ts:
                continue
            t, k, s, kd = json.loads(name)
            if (
                (tenant is not None and t != tenant)
                or (key is not None and k != key)
                or (subject is not None and s != subject)
                or (kind is not None and kd != kind)
            ):
                continue
            dims = {"tenant": t, "key": k, "subject": s, "kind": kd, "hour": hour, "day": hour[:8]}
            group = tuple(dims[g] for g in group_by)
            totals[group] = totals.get(group, 0) + n
        return [UsageRow(dict(zip(group_by, g)), n) for g, n in sorted(totals.items())]


def _hour_start(hour: str) -> float:
    return datetime.strptime(hour, "%Y%m%d%H").replace(tzinfo=UTC).timestamp()


def _pairs(hour: str, flat: list) -> Iterable[tuple[str, str, int]]:
    for i in range(0, len(flat), 2):
        yield hour, _s(flat[i]), int(flat[i + 1])


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def datum_tokens(data: Iterable[Any]) -> int:
    """Tokens of a batch of Tinker ``Datum``s: the sum of their ``model_input`` lengths (what the model runs on)."""
    return sum(int(d.model_input.length) for d in data)
