"""The console's figures and SVG, without a server: liked share per time bucket, latency quantiles from a
Prometheus histogram, the parent graph of a branching lineage, and that every text is escaped."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from prometheus_client import CollectorRegistry, Histogram

from livelora.gateway.console import charts
from livelora.gateway.console.svg import Series, bar_chart, line_chart, lineage_graph, nice_top
from livelora.gateway.services.console_reports import latency_by_route
from livelora.gateway.services.console_views import bucket_shares

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


def test_every_text_is_escaped_and_no_chart_has_a_script():
    evil = '<script>alert(1)</script>"'
    for svg in (
        line_chart([Series(evil, [(0.0, 1.0), (1.0, 2.0)])], title=evil, marks=[(0.5, evil)]),
        bar_chart([(evil, 3.0)], title=evil),
        lineage_graph([{"version": 1, "name": evil, "parent": None}], serving=set(), href=lambda n: n),
    ):
        tree = ET.fromstring(str(svg))  # well-formed XML
        assert not list(tree.iter(f"{NS}script")) and "<script>" not in str(svg)
        assert any(evil in (t.text or "") for t in tree.iter(f"{NS}title"))


def test_round_axis_tops():
    assert [nice_top(x) for x in (0, 3, 4, 5, 9, 170, 0.3)] == [1.0, 4, 4, 8, 20, 200, 0.4]
