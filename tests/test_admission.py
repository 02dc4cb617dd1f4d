"""Batch slots of the admission (``_RunSlots``): a waiter cancelled while a slot is being handed out.

A streaming client that disconnects cancels its queued choices; the slots freed at the same moment must go to
the waiters still there, and none may be lost (a lost slot leaves every later request waiting for ever).
"""

from __future__ import annotations

import asyncio

from livelora.gateway.services.serving.admission import SharePool, _RunSlots


def test_a_waiter_cancelled_before_it_resumes_gets_no_slot_and_loses_none():
    async def scenario():
        slots = _RunSlots(SharePool(2, 1.0, 1.0, 0.0))
        await slots.acquire("t", None)
        await slots.acquire("t", None)
        first = asyncio.create_task(slots.acquire("t", None))
        second = asyncio.create_task(slots.acquire("t", None))
        await asyncio.sleep(0)  # both wait
        assert len(slots.waiters) == 2 and slots.pool.total == 2
        first.cancel()  # its future is cancelled now; the task resumes only at the next turn of the loop
        slots.release("t", None)  # the freed slot must skip the cancelled waiter
        await asyncio.gather(first, second, return_exceptions=True)
        assert first.cancelled() and second.done() and not second.cancelled()
        assert slots.pool.total == 2 and not slots.waiters
        slots.release("t", None)
        slots.release("t", None)
        assert slots.pool.total == 0 and not slots.pool.tenants

    asyncio.run(scenario())


def test_a_slot_granted_to_a_waiter_cancelled_after_the_grant_is_given_back():
    async def scenario():
        slots = _RunSlots(SharePool(1, 1.0, 1.0, 0.0))
        await slots.acquire("t", None)
        waiter = asyncio.create_task(slots.acquire("t", None))
        await asyncio.sleep(0)
        slots.release("t", None)  # granted: its future has a result
        waiter.cancel()  # cancelled before it resumed
        await asyncio.gather(waiter, return_exceptions=True)
        assert waiter.cancelled() and slots.pool.total == 0

    asyncio.run(scenario())
