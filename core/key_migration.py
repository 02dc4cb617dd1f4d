"""Renames the keys of the layout before user text was hashed (``rating:{completion}:{rater}``,
``idem:{scope}:{Idempotency-Key}``) to their digest form (:meth:`KeyLayout.rating`, :meth:`KeyLayout.idem`),
keeping their value and TTL, so a re-rate or a retry across an upgrade still finds its record. The gateway runs
:func:`migrate_user_text_keys` at start; it scans once per prefix (then ``layout`` is ``2``) and is idempotent
(``docs/internals/redis-keys.md``).
"""

from __future__ import annotations

import redis

from livelora.core.redis_keys import KeyLayout

#: The layout whose names hold digests of user text (the value of ``keys.layout_version``).
LAYOUT = "2"
#: The stems of the legacy keys; a tail splits at its first colon into the new builder's two arguments.
_LEGACY = ("rating:", "idem:")


async def migrate_user_text_keys(client, keys: KeyLayout) -> int:
    """Rename every legacy key under ``keys.prefix`` (async Redis client, ``decode_responses=True``); a legacy key
    whose new name already exists (written since the upgrade) is dropped, the newer record wins.

    Returns:
        The number of legacy keys found (renamed or dropped); 0 without a scan once ``keys.layout_version`` is set.
    """
    if await client.get(keys.layout_version) == LAYOUT:
        return 0
    n = 0
    for stem in _LEGACY:
        start = keys.prefix + stem
        async for key in client.scan_iter(match=_glob_escape(start) + "*", count=500):
            head, sep, tail = key[len(start) :].partition(":")
            if not sep:
                continue
            target = keys.rating(head, tail) if stem == "rating:" else keys.idem(head, tail)
            try:
                if not await client.renamenx(key, target):
                    await client.delete(key)
            except redis.ResponseError as exc:  # expired since the scan
                if "no such key" not in str(exc).lower():
                    raise
                continue
            n += 1
    await client.set(keys.layout_version, LAYOUT)
    return n


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
