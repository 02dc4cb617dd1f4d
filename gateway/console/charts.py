"""The console's charts: what :mod:`~livelora.gateway.services.console_views` and
:mod:`~livelora.gateway.services.console_reports` return, drawn with :mod:`.svg` (templates call these)."""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import quote

from markupsafe import Markup

from livelora.gateway.console.svg import Series, bar_chart, clock, line_chart, lineage_graph


def _pct(v: float) -> str:
    return f"{100 * v:.0f} %"


def liked(buckets: list[dict[str, Any]], marks: list[tuple[float, str]], title: str) -> Markup:
    """Liked share per time bucket (a point at each bucket's middle), version changes as dashed lines."""
    points = [((b["start"] + b["end"]) / 2, b["share"]) for b in buckets]
    return line_chart(
        [Series("liked share", points)], title=title, x_label=clock, y_label=_pct, y_range=(0, 1), marks=marks
    )


def loss(points: list[tuple[int, float]], title: str) -> Markup:
    """Training loss (``loss:sum`` of each step's version) by optimizer step."""
    return line_chart([Series("loss", [(float(s), v) for s, v in sorted(points)])], title=title)


def requests(rows: list[dict[str, Any]]) -> Markup:
    """Requests served per endpoint and version (live statistics)."""

    def short(version: str) -> str:
        return "@" + version.rsplit("@", 1)[1] if "@" in version else version

    return bar_chart(
        [(f"{r['endpoint']} {short(r['version'])}", r["requests"]) for r in rows],
        title="requests per endpoint and version",
        y_label=lambda v: f"{v:.0f}",
    )


def tokens(per_kind: dict[str, list[tuple[str, int]]]) -> Markup:
    """Tokens per UTC hour, one line per kind."""

    def t(hour: str) -> float:
        return time.mktime(time.strptime(hour + "+0000", "%Y%m%d%H%z")) if len(hour) == 10 else 0.0

    series = [Series(kind, [(t(h), float(n)) for h, n in rows]) for kind, rows in sorted(per_kind.items())]
    return line_chart(series, title="tokens per hour", x_label=clock)


def updates(hour0: float, counts: list[int]) -> Markup:
    """New versions per hour (the last ``len(counts)`` hours)."""
    bars = [(time.strftime("%d %H:00", time.localtime(hour0 + i * 3600)), float(n)) for i, n in enumerate(counts)]
    return bar_chart(bars, title="new versions per hour", y_label=lambda v: f"{v:.0f}")


def latency(rows: list[dict[str, Any]]) -> Markup:
    """p95 latency per route (seconds, upper bucket bounds)."""
    return bar_chart(
        [(r["route"], r["p95_s"]) for r in rows if r["p95_s"] is not None][:12],
        title="p95 latency by route (s)",
        y_label=lambda v: f"{v:.3g}",
    )


def graph(versions: list[dict[str, Any]]) -> Markup:
    """A lineage's parent graph; each node links to its version page."""
    serving = {v["name"] for v in versions if v.get("serving")}
    return lineage_graph(versions, serving=serving, href=lambda name: f"/console/versions/{quote(name)}")
