"""The console's figures, chart specs and SVG, without a server: liked share per time bucket, latency quantiles
from a Prometheus histogram, time ticks, the charts' JSON specs, the parent graph of a branching lineage, and that
every text is escaped."""

from __future__ import annotations

import itertools
import json
import re
import time
import xml.etree.ElementTree as ET

from prometheus_client import CollectorRegistry, Histogram

from livelora.gateway.console import charts
from livelora.gateway.console.charts import MAX_TICKS, time_ticks
from livelora.gateway.console.svg import lineage_graph
from livelora.gateway.services.console.reports import latency_by_route, seconds_for_people
from livelora.gateway.services.console.views import bucket_shares

NS = "{http://www.w3.org/2000/svg}"


def test_liked_share_per_bucket():
    ratings = [(100.0, "a@1", True), (104.0, "a@1", False), (106.0, "a@2", True), (110.0, "a@2", True)]
    buckets = bucket_shares(ratings, 2, 110.0)  # [100, 105) and [105, 110]: the last rating falls in the last one
    assert [(b["start"], b["end"], b["ratings"], b["up"], b["share"]) for b in buckets] == [
        (100.0, 105.0, 2, 1, 0.5),
        (105.0, 110.0, 2, 2, 1.0),
    ]
    assert bucket_shares([], 24, 0.0) == []
    empty = bucket_shares([(0.0, "a@1", False)], 4, 8.0)
    assert [b["share"] for b in empty] == [0.0, None, None, None]


def test_latency_quantiles_are_the_upper_bounds_of_their_buckets():
    h = Histogram(
        "t_seconds", "t", ["method", "route", "status"], buckets=(0.1, 0.5, 1.0), registry=CollectorRegistry()
    )
    for v in (0.05, 0.2, 0.3, 0.4, 2.0):
        h.labels("POST", "/v1/chat/completions", "200").observe(v)
    h.labels("GET", "/health", "200").observe(0.01)
    chat, health = latency_by_route(h)
    assert chat["route"] == "POST /v1/chat/completions" and chat["requests"] == 5
    assert abs(chat["mean_s"] - 2.95 / 5) < 1e-9
    assert chat["p50_s"] == 0.5  # 3rd of 5 observations lies in (0.1, 0.5]
    assert chat["p95_s"] == float("inf")  # the 5th (2.0 s) is above the last finite bound
    assert (health["requests"], health["p50_s"], health["p95_s"]) == (1, 0.1, 0.1)
    # as the page shows them: times in words, a quantile as its bucket's bound
    assert (chat["mean"], chat["p50"], chat["p95"]) == ("590 ms", "≤ 500 ms", "> 1.0 s")
    assert (health["mean"], health["p50"]) == ("10 ms", "≤ 100 ms")
    assert [seconds_for_people(s) for s in (0.0052, 0.0123, 0.9996, 2.345, 120.0)] == [
        "5.2 ms",
        "12 ms",
        "1.0 s",
        "2.3 s",
        "120 s",
    ]


def test_a_branch_starts_a_new_row_and_a_deleted_parent_is_dashed():
    versions = [
        {"version": 1, "name": "l@1", "parent": None},
        {"version": 2, "name": "l@2", "parent": 1, "serving": ["ep"]},
        {"version": 3, "name": "l@3", "parent": 1},
        {"version": 5, "name": "l@5", "parent": 4},
    ]
    svg = ET.fromstring(str(charts.graph(versions)))
    circles = {c.find(f"{NS}title").text: c for c in svg.iter(f"{NS}circle")}
    assert set(circles) == {"l@1", "l@2 (serving)", "l@3", "l@5"}
    assert circles["l@1"].get("cy") == circles["l@2 (serving)"].get("cy") != circles["l@3"].get("cy")
    assert circles["l@2 (serving)"].get("fill") != "#fff" and circles["l@3"].get("fill") == "#fff"
    lines = list(svg.iter(f"{NS}line"))
    assert len(lines) == 3 and sum(1 for line in lines if line.get("stroke-dasharray")) == 1
    links = [a.get("href") for a in svg.iter(f"{NS}a")]
    assert links == [
        "/console/versions/l%401",
        "/console/versions/l%402",
        "/console/versions/l%403",
        "/console/versions/l%405",
    ]
    assert lineage_graph([], serving=set(), href=str)  # an empty lineage draws a placeholder


def spec_of(markup) -> dict:
    """The JSON spec inside a chart's ``<script type="application/json">``."""
    return json.loads(
        re.search(r'<script type="application/json" class="chart-data">(.*?)</script>', str(markup)).group(1)
    )


def test_time_ticks_are_round_distinct_and_inside_the_span():
    t0 = time.mktime((2026, 12, 6, 9, 7, 13, 0, 0, -1))
    for span, step in ((50, 10), (40 * 60, 600), (5 * 3600, 3600), (30 * 3600, 6 * 3600), (6 * 86400, 86400)):
        ticks = time_ticks(t0, t0 + span)
        values, labels = [v for v, _ in ticks], [label for _, label in ticks]
        assert 2 <= len(ticks) <= MAX_TICKS and len(set(labels)) == len(labels), (span, labels)
        assert t0 <= values[0] and values[-1] <= t0 + span
        assert all(b - a == step for a, b in itertools.pairwise(values)), (span, values)
    assert [label for _, label in time_ticks(t0, t0 + 40 * 60)][:2] == ["09:10", "09:20"]


def test_the_requests_chart_labels_each_bar_with_its_version_and_counts_whole_requests():
    rows = [
        {"endpoint": "acme.live", "version": "base", "requests": 0, "ratings": 8},
        {"endpoint": "acme.live", "version": "acme.support@2", "requests": 3, "ratings": 1},
    ]
    spec = spec_of(charts.requests(rows))
    assert spec["x"]["labels"] == [["acme.live", "base"], ["acme.live", "@2"]]
    assert [d["data"] for d in spec["datasets"]] == [[0, 3], [8, 1]]
    assert spec["y"] == {"min": 0, "integer": True}


def test_the_liked_chart_marks_version_changes_with_the_version_served_from_then_on():
    buckets = bucket_shares([(100.0, "a@1", True), (150.0, "a@2", False), (190.0, "a@2", True)], 4, 200.0)
    marks = [(120.0, "published acme.support@2"), (160.0, "promote → base"), (900.0, "published acme.support@9")]
    spec = spec_of(charts.liked(buckets, marks, "liked share of acme.live"))
    assert [(m["x"], m["label"]) for m in spec["marks"]] == [(120.0, "@2"), (160.0, "base")]  # @9: after the span
    assert [(p["y"], p["n"]) for p in spec["datasets"][0]["data"]] == [(1.0, 1), (0.0, 1), (1.0, 1)]
    assert spec["y"] == {"min": 0, "max": 1, "percent": True}


def test_every_text_is_escaped_and_no_chart_has_a_script():
    evil = '<script>alert(1)</script>"'
    bars = charts.requests([{"endpoint": evil, "version": evil, "requests": 1, "ratings": 0}])
    line = charts.loss([(1, 2.0)], evil)
    for markup in (bars, line):
        assert "<script>" not in str(markup) and str(markup).count("</script>") == 1
    assert spec_of(bars)["x"]["labels"] == [[evil, evil]] and spec_of(line)["title"] == evil  # read back intact
    tree = ET.fromstring(str(lineage_graph([{"version": 1, "name": evil, "parent": None}], serving=set(), href=str)))
    assert not list(tree.iter(f"{NS}script")) and any(evil in (t.text or "") for t in tree.iter(f"{NS}title"))


def test_the_learning_cell_names_its_stage_once():
    from livelora.clients.types.learning import LearningStatus
    from livelora.gateway.api.console_render import ENV

    cell = ENV.get_template("_macros.html").module.learning
    published = LearningStatus(endpoint="a", lineage="l", stage="published", version="l@2")
    waiting = LearningStatus(endpoint="a", lineage="l", stage="waiting", ratings_waiting=3, batch_size=8)
    for st, hint in ((published, "l@2"), (waiting, "3 of 8 ratings")):
        html = str(cell(st, False))
        assert html.count(st.stage) == 2 and f'<span class="hint">{hint}' in html, html  # class name + badge
