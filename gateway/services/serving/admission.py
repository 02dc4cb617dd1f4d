"""How many sequences the gateway admits at once, and each tenant's (and each key's) share of them.

:class:`Admission` bounds the sequences in the gateway at two levels, both :class:`SharePool` s:

* **admitted** (``max_batch_size + max_waiting``): a request that would exceed its share gets 429 with
  ``Retry-After``. Every generation (chat, legacy completions, Tinker sampling) is admitted by
  :meth:`livelora.gateway.services.serving.serve.Serving.begin`;
* **running** (``max_batch_size``): an admitted sequence waits in the gateway for a batch slot
  (:meth:`Ticket.run_slot`), so one tenant's queued sequences never stand in front of another's in the engine.

A tenant may hold ``tenant_share`` of a pool and each key ``key_share`` of that, and borrow idle slots only while
``share_reserve`` stays free (the share rule and why: docs/tenants.md). :meth:`Admission.check_request` enforces
the per-tenant ``max_n`` / ``max_n_tokens`` ceilings (:mod:`livelora.core.quotas`) as 400, before any work.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
from collections import Counter
from collections.abc import AsyncIterator, Callable

from livelora.clients.errors import BadRequestError, RateLimitError
from livelora.core import metrics
from livelora.core.quotas import Limits, QuotaStore
from livelora.gateway.settings import GatewaySettings


class SharePool:
    """``capacity`` slots shared by tenants and their keys by the share rule of the module docstring.

    Args:
        capacity: slots (> 0). tenant_share, key_share, reserve: fractions in (0, 1].
    """

    def __init__(self, capacity: int, tenant_share: float, key_share: float, reserve: float):
        self.capacity = capacity
        self.tenant_cap = max(1, math.ceil(capacity * tenant_share))
        self.key_cap = max(1, math.ceil(self.tenant_cap * key_share))
        self.borrow_floor = capacity - math.ceil(capacity * reserve)  # most held in all while anyone borrows
        self.total = 0
        self.tenants: Counter[str] = Counter()
        self.keys: Counter[tuple[str, str | None]] = Counter()

    def largest(self, key: str | None) -> int:
        """The most slots one request may ever hold (open mode, ``key`` ``None``: the whole pool)."""
        if key is None:
            return self.capacity
        return max(min(self.tenant_cap, self.key_cap), self.borrow_floor)

    def allows(self, tenant: str, key: str | None, n: int) -> bool:
        """Whether ``tenant``'s ``key`` may take ``n`` more slots now."""
        if self.total + n > self.capacity:
            return False
        if key is None:
            return True
        if self.tenants[tenant] + n <= self.tenant_cap and self.keys[tenant, key] + n <= self.key_cap:
            return True
        return self.total + n <= self.borrow_floor

    def take(self, tenant: str, key: str | None, n: int) -> None:
        self.total += n
        self.tenants[tenant] += n
        self.keys[tenant, key] += n

    def give(self, tenant: str, key: str | None, n: int) -> None:
        self.total -= n
        self.tenants[tenant] -= n
        self.keys[tenant, key] -= n
        if self.tenants[tenant] <= 0:
            del self.tenants[tenant]
        if self.keys[tenant, key] <= 0:
            del self.keys[tenant, key]


class _RunSlots:
    """Batch slots (a :class:`SharePool` of ``max_batch_size``) and the sequences waiting for one."""

    def __init__(self, pool: SharePool):
        self.pool = pool
        self.waiters: list[tuple[int, str, str | None, asyncio.Future]] = []
        self._order = itertools.count()

    async def acquire(self, tenant: str, key: str | None) -> None:
        if not self.waiters and self.pool.allows(tenant, key, 1):
            self.pool.take(tenant, key, 1)
            return
        fut = asyncio.get_running_loop().create_future()
        entry = (next(self._order), tenant, key, fut)
        self.waiters.append(entry)
        self.dispatch()
        try:
            await fut
        except BaseException:
            if entry in self.waiters:
                self.waiters.remove(entry)
            elif fut.done() and not fut.cancelled():  # granted as it was cancelled: give it back
                self.release(tenant, key)
            raise

    def release(self, tenant: str, key: str | None) -> None:
        self.pool.give(tenant, key, 1)
        self.dispatch()

    def dispatch(self) -> None:
        """Grant free slots: each to the allowed waiter whose tenant runs the fewest, then the oldest."""
        while self.waiters:
            # a waiter cancelled before its task resumed still stands here with a cancelled future: drop it
            self.waiters = [w for w in self.waiters if not w[3].done()]
            allowed = [w for w in self.waiters if self.pool.allows(w[1], w[2], 1)]
            if not allowed:
                return
            best = min(allowed, key=lambda w: (self.pool.tenants[w[1]], w[0]))
            self.waiters.remove(best)
            self.pool.take(best[1], best[2], 1)
            best[3].set_result(None)


class Admission:
    """Counts sequences admitted by the gateway (running + waiting) and hands out batch slots. Event-loop
    confined.

    Args:
        settings: ``inference`` (batch, waiting, shares), ``quotas`` and ``home`` (per-tenant ceilings).
    """

    def __init__(self, settings: GatewaySettings):
        inf = settings.inference
        self.limit = inf.max_sequences
        self.retry_after = inf.retry_after_s
        shares = (inf.tenant_share, inf.key_share, inf.share_reserve)
        self.admitted = SharePool(self.limit, *shares)
        self.running = _RunSlots(SharePool(inf.max_batch_size, *shares))
        self._quotas = QuotaStore(settings.home)
        self._defaults = Limits.from_settings(settings.quotas)

    @property
    def active(self) -> int:
        """Sequences admitted now (running or waiting)."""
        return self.admitted.total

    def limits(self, tenant: str) -> Limits:
        """``tenant``'s effective ceilings (settings, then ``quotas.json``)."""
        return self._quotas.get(tenant, self._defaults)

    def check_request(
        self,
        n: int,
        max_tokens: int | None,
        payer: tuple[str, str | None],
        *,
        param: str = "n",
        tokens_param: str = "max_tokens",
        total: int | None = None,
    ) -> int | None:
        """Refuse a request of ``payer`` (tenant, key id) whose shape passes a per-tenant ceiling (before any work).

        Args:
            n: sequences it asks for. max_tokens: each one's ``max_tokens`` (``None``: unset).
            total: instead of ``n × max_tokens``, the request's completion-token budget in all.

        Returns:
            The largest default budget per sequence when no budget is given (``max_n_tokens // n``), else
            ``None``.

        Raises:
            BadRequestError: ``n`` above ``max_n`` (code ``integer_above_max_value``, ``param``), or
                ``n × max_tokens`` above ``max_n_tokens`` (``tokens_param``).
        """
        tenant = payer[0]
        limits = self.limits(tenant)
        max_n, max_total = limits.max_n, limits.max_n_tokens
        if max_n is not None and n > max_n:
            raise BadRequestError(
                f"this request asks for {n} sequences; tenant {tenant!r} may ask for at most {max_n} per request "
                f"(limit max_n: LIVELORA_QUOTA_MAX_N or PUT /admin/quotas); lower {param}",
                param=param,
                code="integer_above_max_value",
            )
        if total is None and max_tokens is not None:
            total = n * max_tokens
        if max_total is None:
            return None
        if total is None:
            return max(1, max_total // max(n, 1))
        if total > max_total:
            raise BadRequestError(
                f"this request asks for {total} completion tokens ({n} sequences); tenant {tenant!r} may ask "
                f"for at most {max_total} per request, n × max_tokens (limit max_n_tokens: "
                f"LIVELORA_QUOTA_MAX_N_TOKENS or PUT /admin/quotas); lower {tokens_param} or {param}",
                param=tokens_param,
                code="integer_above_max_value",
            )
        return None

    def acquire(
        self, sequences: int, payer: tuple[str, str | None], param: str = "n", tokens: int | None = None
    ) -> Ticket:
        """Reserve ``sequences`` admitted slots for ``payer`` (tenant, key id) until the ticket is released.

        Args:
            tokens: the request's completion-token budget in all (``n × max_tokens``), checked against
                ``max_n_tokens`` (``None``: not checked).

        Raises:
            BadRequestError: more sequences than one request of this caller is ever admitted, or a ceiling of
                :meth:`check_request`.
            RateLimitError: the caller's share (or the server) is full now (429, ``Retry-After``).
        """
        tenant, key = payer
        self.check_request(sequences, None, payer, param=param, total=tokens)
        largest = self.admitted.largest(key)
        if sequences > largest:
            raise BadRequestError(
                f"this request needs {sequences} sequences but the server admits at most {largest} at once for "
                f"one caller; lower {param}",
                param=param,
                code="integer_above_max_value",
            )
        pool = self.admitted
        if not pool.allows(tenant, key, sequences):
            if pool.total + sequences > pool.capacity:
                metrics.REJECTIONS.labels("busy").inc()
                message = f"the server is busy ({pool.total} of {pool.capacity} sequences queued or running)"
            else:
                metrics.REJECTIONS.labels("share").inc()
                message = (
                    f"tenant {tenant!r} holds {pool.tenants[tenant]} sequences (this key {pool.keys[tenant, key]}) "
                    f"of the server's {pool.capacity}; beyond its share ({pool.tenant_cap} per tenant, "
                    f"{pool.key_cap} per key) it may only use idle capacity, and the rest is kept for others"
                )
            raise RateLimitError(f"{message}; retry later", retry_after=self.retry_after)
        pool.take(tenant, key, sequences)
        metrics.QUEUE_DEPTH.set(pool.total)
        return Ticket(self, sequences, tenant, key)


class Ticket:
    """Admitted slots; :meth:`release` is idempotent."""

    def __init__(self, admission: Admission, sequences: int, tenant: str = "default", key: str | None = None):
        self._admission = admission
        self._sequences = sequences
        self.tenant, self.key = tenant, key
        self._also: list[Callable[[], None]] = []

    def also_release(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` when the ticket is released (e.g. an adapter-version lease)."""
        self._also.append(fn)

    @contextlib.asynccontextmanager
    async def run_slot(self) -> AsyncIterator[None]:
        """Hold one batch slot while the body runs one of the ticket's sequences in the engine (waits for it
        by the share rule)."""
        slots = self._admission.running
        await slots.acquire(self.tenant, self.key)
        try:
            yield
        finally:
            slots.release(self.tenant, self.key)

    def release(self) -> None:
        if self._sequences:
            self._admission.admitted.give(self.tenant, self.key, self._sequences)
            metrics.QUEUE_DEPTH.set(self._admission.admitted.total)
        self._sequences = 0
        also, self._also = self._also, []
        for fn in also:
            fn()
