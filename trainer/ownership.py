"""Ownership of training models: one executor at a time, by a Redis lease with a fencing token.

:meth:`Leases.acquire` takes ``lease:model:{id}`` with a new fencing token (INCR, never reused) in one Lua
script; a thread (:meth:`Leases.start`) renews every held lease every ``lease_ttl_s / 3`` and marks a model lost
when its lease is gone or someone else's; every write of an owner (resolving a future, trimming its stream) is
checked against the lease in the same script; a clean stop releases the leases so a peer takes over at once.
The protocol and what ``opruns:{id}`` counts: ``docs/internals/leases.md``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable

from livelora.core.redis_keys import KeyLayout

log = logging.getLogger(__name__)

# KEYS[1] lease, KEYS[2] fence counter; ARGV[1] owner id, ARGV[2] ttl ms, ARGV[3] minimum token (exclusive)
_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
local t = redis.call('INCR', KEYS[2])
local floor = tonumber(ARGV[3])
if t <= floor then
  t = floor + 1
  redis.call('SET', KEYS[2], t)
end
redis.call('SET', KEYS[1], t .. ':' .. ARGV[1], 'PX', ARGV[2])
return t
"""
# KEYS[1] lease; ARGV[1] value, ARGV[2] ttl ms
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# KEYS[1] lease, KEYS[2] future, KEYS[3] opruns; ARGV[1] lease value, ARGV[2] record ('' = none),
# ARGV[3] ttl s, ARGV[4] seq, ARGV[5] request id, ARGV[6] futures channel
_RESOLVE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] ~= '' then redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3]) end
if ARGV[4] ~= '' then
  redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
  local applied = tonumber(redis.call('HGET', KEYS[3], 'applied') or '-1')
  if tonumber(ARGV[4]) > applied then redis.call('HSET', KEYS[3], 'applied', ARGV[4]) end
  redis.call('EXPIRE', KEYS[3], ARGV[3])
end
if ARGV[2] ~= '' then redis.call('PUBLISH', ARGV[6], ARGV[5]) end
return 1
"""
# KEYS[1] lease, KEYS[2] stream; ARGV[1] lease value, ARGV[2..] entry ids
_TRIM = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if #ARGV < 2 then return 0 end
return redis.call('XDEL', KEYS[2], unpack(ARGV, 2))
"""


def new_owner_id() -> str:
    """``{host}-{pid}-{4 hex}``: names this process's executor in leases (and logs)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


class Leases:
    """The model leases one executor holds, their renewal thread, and the fenced Redis writes.

    Args:
        redis_client: synchronous ``redis.Redis`` (``decode_responses=True``).
        keys: key layout.
        ttl_s: lease lifetime (seconds); renewed every ``ttl_s / 3``.
        owner: this executor's id (default :func:`new_owner_id`).
        on_lost: called (from the renewal thread) with a model id whose lease was lost.
    """

    def __init__(
        self,
        redis_client,
        keys: KeyLayout,
        ttl_s: float,
        owner: str | None = None,
        on_lost: Callable[[str], None] | None = None,
    ):
        self.redis = redis_client
        self.keys = keys
        self.ttl_ms = max(100, int(ttl_s * 1000))
        self.owner = owner or new_owner_id()
        self.on_lost = on_lost or (lambda model_id: None)
        self.held: dict[str, str] = {}  # model id → lease value "{token}:{owner}"
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._acquire = redis_client.register_script(_ACQUIRE)
        self._renew = redis_client.register_script(_RENEW)
        self._release = redis_client.register_script(_RELEASE)
        self._resolve = redis_client.register_script(_RESOLVE)
        self._trim = redis_client.register_script(_TRIM)

    # ------------------------------------------------------------------------------------ lease lifecycle
    def acquire(self, model_id: str, above: int = 0) -> int | None:
        """Take the model's lease if nobody holds it; returns the new fencing token (> ``above``) or None."""
        token = self._acquire(
            keys=[self.keys.model_lease(model_id), self.keys.model_fence(model_id)],
            args=[self.owner, self.ttl_ms, int(above)],
        )
        if token is None:
            return None
        with self._lock:
            self.held[model_id] = f"{int(token)}:{self.owner}"
        return int(token)

    def value(self, model_id: str) -> str | None:
        with self._lock:
            return self.held.get(model_id)

    def release(self, model_id: str) -> None:
        """Give the lease back (only if still ours) so another executor can take the model at once."""
        with self._lock:
            value = self.held.pop(model_id, None)
        if value is not None:
            try:
                self._release(keys=[self.keys.model_lease(model_id)], args=[value])
            except Exception as exc:  # it expires by itself
                log.warning("could not release the lease of %s: %s", model_id, exc)

    def forget(self, model_id: str) -> None:
        """Stop renewing a lease without touching it (it was lost)."""
        with self._lock:
            self.held.pop(model_id, None)

    def renew_all(self) -> list[str]:
        """Extend every held lease; returns (and forgets) the models whose lease was lost."""
        with self._lock:
            held = dict(self.held)
        lost = []
        for model_id, value in held.items():
            if not self._renew(keys=[self.keys.model_lease(model_id)], args=[value, self.ttl_ms]):
                lost.append(model_id)
        for model_id in lost:
            with self._lock:
                if self.held.get(model_id) == held[model_id]:
                    self.held.pop(model_id, None)
            log.warning("lost the lease of training model %s (another executor took it over)", model_id)
            self.on_lost(model_id)
        return lost

    def start(self) -> None:
        """Renew the held leases every ``ttl / 3`` in a daemon thread until :meth:`stop`."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="livelora-lease-renewal", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_ms / 3000):
            try:
                self.renew_all()
            except Exception as exc:  # Redis hiccup: try again next round (the TTL leaves two more)
                log.warning("lease renewal failed: %s", exc)

    def stop(self, release: bool = True) -> None:
        """Stop renewing; with ``release`` give every held lease back."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if release:
            for model_id in list(self.held):
                self.release(model_id)

    # ------------------------------------------------------------------------------------ fenced writes
    def resolve(
        self, model_id: str, request_id: str, record: str | None, seq: int | None, ttl_s: int, channel: str
    ) -> bool:
        """Write a future (``record``; None = only count the seq) and count ``seq`` as committed, if the lease
        is still ours. Returns False (nothing written) for a stale owner."""
        value = self.value(model_id)
        if value is None:
            return False
        done = self._resolve(
            keys=[self.keys.model_lease(model_id), self.keys.future(request_id), self.keys.op_runs(model_id)],
            args=[value, record or "", int(ttl_s), "" if seq is None else int(seq), request_id, channel],
        )
        return bool(done)

    def trim(self, model_id: str, entry_ids: list[str]) -> bool:
        """XDEL stream entries of the model's op stream if the lease is still ours (False: stale owner)."""
        value = self.value(model_id)
        if value is None:
            return False
        if not entry_ids:
            return True
        return (
            self._trim(keys=[self.keys.model_lease(model_id), self.keys.ops(model_id)], args=[value, *entry_ids]) >= 0
        )
