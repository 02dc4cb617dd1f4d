"""The console's charts: each function returns a ``<figure>`` holding a canvas and its data as JSON, which
``static/console-charts.js`` draws with the vendored Chart.js (templates call these). The lineage graph stays
SVG (:mod:`.svg`).

Spec (the JSON): ``{"type": "line"|"bar", "title", "datasets": [{"label", "data": [{"x", "y"}]}], "x": {"kind":
"time"|"category"|"linear", "ticks": [[value, label]], "labels": [...]}, "y": {"min", "max", "percent",
"integer"}, "marks": [{"x", "label", "title"}], "horizontal"}``; times are Unix seconds.
"""

from __future__ import annotations

import calendar
import json
import math
import time
from typing import Any
from urllib.parse import quote

from markupsafe import Markup, escape

from livelora.gateway.console.svg import lineage_graph

#: Steps of time ticks (s): the first that keeps at most ``MAX_TICKS`` ticks is used.
TIME_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800)
MAX_TICKS = 7


def time_ticks(lo: float, hi: float, max_ticks: int = MAX_TICKS) -> list[tuple[float, str]]:
    """Round local-time ticks in ``[lo, hi]`` (Unix s), labels distinct: ``HH:MM:SS`` under a minute's step,
    ``HH:MM`` within a day (``MM-DD HH:MM`` when the span crosses midnight), ``MM-DD`` for day steps."""
    span = max(hi - lo, 1.0)
    step = next((s for s in TIME_STEPS if span / s <= max_ticks), TIME_STEPS[-1] * math.ceil(span / 86400 / 7))
    offset = -time.localtime(lo).tm_gmtoff  # round in local time
    first = math.ceil((lo - offset) / step) * step + offset
    one_day = time.localtime(lo)[:3] == time.localtime(hi)[:3]
    fmt = "%H:%M:%S" if step < 60 else ("%H:%M" if one_day else "%m-%d %H:%M") if step < 86400 else "%m-%d"
    ticks, t = [], first
    while t <= hi + 1e-6:
        ticks.append((t, time.strftime(fmt, time.localtime(t))))
        t += step
    return ticks


def short_version(version: str) -> str:
    """``lineage@3`` → ``@3`` (``base`` stays)."""
    return "@" + version.rsplit("@", 1)[1] if "@" in version else version


def figure(spec: dict[str, Any]) -> Markup:
    """A ``<figure class="chart">`` with a canvas and ``spec`` as JSON (``<``, ``>``, ``&`` escaped so no text can
    close the script element); the canvas's text alternative is the title."""
    data = json.dumps(spec, allow_nan=False).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return Markup(
        f'<figure class="chart" data-title="{escape(spec["title"])}"><div class="chart-box">'
        f'<canvas role="img" aria-label="{escape(spec["title"])}"></canvas></div>'
        f'<script type="application/json" class="chart-data">{data}</script></figure>'
    )


def _time_x(xs: list[float]) -> dict[str, Any]:
    return {"kind": "time", "ticks": time_ticks(min(xs), max(xs))} if xs else {"kind": "time", "ticks": []}


def liked(buckets: list[dict[str, Any]], marks: list[tuple[float, str]], title: str) -> Markup:
    """Liked share per time bucket (a point at each bucket's middle, its ratings in the tooltip), version
    changes as dashed lines labelled with the version served from then on."""
    points = [{"x": (b["start"] + b["end"]) / 2, "y": b["share"], "n": b["ratings"]} for b in buckets if b["ratings"]]
    shown = [(t, label) for t, label in marks if buckets and buckets[0]["start"] <= t <= buckets[-1]["end"]]
    xs = [p["x"] for p in points] + [t for t, _ in shown]
    return figure(
        {
            "type": "line",
            "title": title,
            "datasets": [{"label": "liked share", "data": points}],
            "x": _time_x(xs),
            "y": {"min": 0, "max": 1, "percent": True},
            "marks": [{"x": t, "label": short_version(label.split()[-1]), "title": label} for t, label in shown],
        }
    )


def loss(points: list[tuple[int, float]], title: str) -> Markup:
    """Training loss (``loss:sum`` of each step's version) by optimizer step."""
    data = [{"x": s, "y": v} for s, v in sorted(points) if math.isfinite(v)]
    return figure(
        {"type": "line", "title": title, "datasets": [{"label": "loss", "data": data}], "x": {"kind": "step"}}
    )


def requests(rows: list[dict[str, Any]]) -> Markup:
    """Requests and ratings per endpoint and version (live statistics): one pair of bars per version."""
    labels = [[r["endpoint"], short_version(r["version"])] for r in rows]
    return figure(
        {
            "type": "bar",
            "title": "requests and ratings per endpoint and version",
            "datasets": [
                {"label": "requests", "data": [r["requests"] for r in rows]},
                {"label": "ratings", "data": [r["ratings"] for r in rows]},
            ],
            "x": {"kind": "category", "labels": labels},
            "y": {"min": 0, "integer": True},
        }
    )


def tokens(per_kind: dict[str, list[tuple[str, int]]]) -> Markup:
    """Tokens per UTC hour (``YYYYMMDDHH``), one bar series per kind, stacked."""

    def t(hour: str) -> float:
        return calendar.timegm(time.strptime(hour, "%Y%m%d%H"))

    hours = sorted({h for rows in per_kind.values() for h, _ in rows if len(h) == 10})
    labels = [time.strftime("%m-%d %H:00", time.localtime(t(h))) for h in hours]
    datasets = []
    for kind, rows in sorted(per_kind.items()):
        by_hour = dict(rows)
        datasets.append({"label": kind, "data": [by_hour.get(h, 0) for h in hours]})
    return figure(
        {
            "type": "bar",
            "title": "tokens per hour",
            "datasets": datasets,
            "x": {"kind": "category", "labels": labels},
            "y": {"min": 0, "integer": True},
            "stacked": True,
        }
    )


def updates(hour0: float, counts: list[int]) -> Markup:
    """New versions per hour (the last ``len(counts)`` hours, labelled by local hour)."""
    labels = [time.strftime("%m-%d %H:00", time.localtime(hour0 + i * 3600)) for i in range(len(counts))]
    return figure(
        {
            "type": "bar",
            "title": "new versions per hour",
            "datasets": [{"label": "new versions", "data": counts}],
            "x": {"kind": "category", "labels": labels},
            "y": {"min": 0, "integer": True},
        }
    )


def latency(rows: list[dict[str, Any]]) -> Markup:
    """p50 and p95 latency per route (s, upper bucket bounds; above the last bound is left out), one row per
    route (horizontal bars, so route names never overlap)."""
    rows = [r for r in rows if r["p95_s"] is not None and math.isfinite(r["p95_s"])][:12]
    return figure(
        {
            "type": "bar",
            "title": "latency by route (s, upper bucket bounds)",
            "datasets": [
                {"label": "p50", "data": [r["p50_s"] for r in rows]},
                {"label": "p95", "data": [r["p95_s"] for r in rows]},
            ],
            "x": {"kind": "category", "labels": [r["route"] for r in rows]},
            "y": {"min": 0},
            "horizontal": True,
        }
    )


def graph(versions: list[dict[str, Any]]) -> Markup:
    """A lineage's parent graph; each node links to its version page."""
    serving = {v["name"] for v in versions if v.get("serving")}
    return lineage_graph(versions, serving=serving, href=lambda name: f"/console/versions/{quote(name)}")
