"""Server-rendered SVG for the admin console: line charts, bar charts and a lineage's parent graph.

Plain SVG 1.1 elements with presentation attributes only (no script, no inline ``style``: the console's
Content-Security-Policy allows neither), every text escaped. Each function returns :class:`markupsafe.Markup`
ready for a Jinja template.

Example::

    line_chart([Series("acme.live", [(t0, 0.5), (t1, 0.75)])], y_range=(0, 1), x_label=clock)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from markupsafe import Markup, escape

#: Series colours (colour-blind safe, Okabe & Ito 2008).
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")
W, H, LEFT, RIGHT, TOP, BOTTOM = 760, 260, 56, 24, 28, 40


@dataclass
class Series:
    """One line: ``points`` ``(x, y)`` in data units (``y`` None breaks the line)."""

    label: str
    points: list[tuple[float, float | None]] = field(default_factory=list)


def clock(t: float) -> str:
    """A Unix time as ``MM-DD HH:MM`` (local time)."""
    return time.strftime("%m-%d %H:%M", time.localtime(t))


def clock_for(lo: float, hi: float) -> Callable[[float], str]:
    """Time labels that tell ticks of the span ``[lo, hi]`` (seconds) apart: seconds under an hour, minutes under
    two days, else dates."""
    fmt = "%H:%M:%S" if hi - lo < 3600 else "%m-%d %H:%M" if hi - lo < 2 * 86400 else "%Y-%m-%d"
    return lambda t: time.strftime(fmt, time.localtime(t))


def nice_top(top: float) -> float:
    """The smallest 4 × (1, 2 or 5 × 10^k) ≥ ``top``: four gridlines at round values."""
    if top <= 0:
        return 1.0
    step = 10 ** math.floor(math.log10(top / 4))
    return 4 * next(m * step for m in (1, 2, 5, 10) if 4 * m * step >= top)


def number(v: float) -> str:
    return f"{v:.3g}"


def _span(lo: float, hi: float) -> tuple[float, float]:
    return (lo - 0.5, hi + 0.5) if hi - lo < 1e-12 else (lo, hi)


def _text(x: float, y: float, s: str, anchor: str = "middle", size: int = 11, fill: str = "#333") -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}" '
        f'font-family="sans-serif" fill="{fill}">{escape(s)}</text>'
    )


def _frame(title: str, body: list[str], legend: Sequence[str] = ()) -> Markup:
    items = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" '
        f'aria-label="{escape(title)}" class="chart">',
        f"<title>{escape(title)}</title>",
        _text(W - RIGHT, 15, title, "end", 12, "#1d232a"),
        *body,
    ]
    for i, label in enumerate(legend):
        x = LEFT + 8 + i * 150
        items.append(f'<rect x="{x}" y="6" width="10" height="10" fill="{PALETTE[i % len(PALETTE)]}"/>')
        items.append(_text(x + 14, 15, label[:20], "start", 10))
    return Markup("".join(items) + "</svg>")


def _axes(
    x_range: tuple[float, float], y_range: tuple[float, float], x_label: Callable[[float], str], y_label: Callable
) -> tuple[list[str], Callable[[float], float], Callable[[float], float]]:
    (x0, x1), (y0, y1) = _span(*x_range), _span(*y_range)
    px = lambda x: LEFT + (x - x0) / (x1 - x0) * (W - LEFT - RIGHT)  # noqa: E731
    py = lambda y: H - BOTTOM - (y - y0) / (y1 - y0) * (H - TOP - BOTTOM)  # noqa: E731
    out = [
        f'<line x1="{LEFT}" y1="{H - BOTTOM}" x2="{W - RIGHT}" y2="{H - BOTTOM}" stroke="#999"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{H - BOTTOM}" stroke="#999"/>',
    ]
    for i in range(5):
        y = y0 + (y1 - y0) * i / 4
        out.append(f'<line x1="{LEFT}" y1="{py(y):.1f}" x2="{W - RIGHT}" y2="{py(y):.1f}" stroke="#eee"/>')
        out.append(_text(LEFT - 4, py(y) + 4, y_label(y), "end", 10))
    for i in range(4):
        x = x0 + (x1 - x0) * i / 3
        out.append(_text(px(x), H - BOTTOM + 14, x_label(x), ("start", "middle", "middle", "end")[i], 10))
    return out, px, py


def line_chart(
    series: Sequence[Series],
    *,
    title: str,
    x_label: Callable[[float], str] = number,
    y_label: Callable[[float], str] = number,
    y_range: tuple[float, float] | None = None,
    marks: Sequence[tuple[float, str]] = (),
) -> Markup:
    """Lines with dots at each point, and dashed vertical ``marks`` ``(x, label)`` (e.g. version changes)."""
    xs = [x for s in series for x, y in s.points if y is not None] + [x for x, _ in marks]
    ys = [y for s in series for _, y in s.points if y is not None and math.isfinite(y)]
    if not ys:
        return _frame(title, [_text(W / 2, H / 2, "no data yet")])
    if x_label is clock:
        x_label = clock_for(min(xs), max(xs))
    body, px, py = _axes((min(xs), max(xs)), y_range or (min(ys), max(ys)), x_label, y_label)
    for i, (x, label) in enumerate(marks):
        body.append(
            f'<line x1="{px(x):.1f}" y1="{TOP}" x2="{px(x):.1f}" y2="{H - BOTTOM}" stroke="#888" '
            f'stroke-dasharray="4 3"><title>{escape(label)} ({escape(clock(x))})</title></line>'
        )
        right = px(x) > W / 2  # labels right of the middle end at their line, so none runs off the chart
        body.append(
            _text(
                px(x) + (-3 if right else 3),
                TOP + 10 + 11 * (i % 3),
                label[:32],
                "end" if right else "start",
                9,
                "#555",
            )
        )
    for i, s in enumerate(series):
        colour, run = PALETTE[i % len(PALETTE)], []
        for x, y in [*s.points, (None, None)]:
            if y is None or not math.isfinite(y):
                if len(run) > 1:
                    pts = " ".join(f"{px(a):.1f},{py(b):.1f}" for a, b in run)
                    body.append(f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="2"/>')
                run = []
                continue
            run.append((x, y))
            body.append(
                f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}">'
                f"<title>{escape(s.label)}: {escape(y_label(y))} at {escape(x_label(x))}</title></circle>"
            )
    return _frame(title, body, [s.label for s in series])


def bar_chart(bars: Sequence[tuple[str, float]], *, title: str, y_label: Callable[[float], str] = number) -> Markup:
    """One bar per ``(label, value)``, labels under the bars (every n-th when crowded)."""
    if not bars:
        return _frame(title, [_text(W / 2, H / 2, "no data yet")])
    top = nice_top(max(v for _, v in bars))
    body, _, py = _axes((0, len(bars)), (0, top), lambda x: "", y_label)
    slot = (W - LEFT - RIGHT) / len(bars)
    every = max(1, math.ceil(len(bars) / 12))
    for i, (label, v) in enumerate(bars):
        x = LEFT + i * slot + slot * 0.15
        body.append(
            f'<rect x="{x:.1f}" y="{py(v):.1f}" width="{slot * 0.7:.1f}" height="{py(0) - py(v):.1f}" '
            f'fill="{PALETTE[0]}"><title>{escape(label)}: {escape(y_label(v))}</title></rect>'
        )
        if i % every == 0:
            body.append(_text(x + slot * 0.35, H - BOTTOM + 14, label[:22], "middle", 9))
    return _frame(title, body)


def lineage_graph(versions: Sequence[dict], *, serving: set[str], href: Callable[[str], str]) -> Markup:
    """A lineage's versions as nodes, oldest left, each joined to its parent; a child continues its parent's
    row unless a sibling took it (a branch starts a new row). Served versions are filled, others outlined; a
    parent deleted since is drawn dashed."""
    if not versions:
        return _frame("versions", [_text(W / 2, H / 2, "no versions yet")])
    order = sorted(versions, key=lambda v: v["version"])
    col = {v["version"]: i for i, v in enumerate(order)}
    row: dict[int, int] = {}
    taken: set[int] = set()  # parents whose row a child continued already
    rows = 0
    for v in order:
        p = v.get("parent")
        if p in row and p not in taken:
            row[v["version"]] = row[p]
            taken.add(p)
        else:
            row[v["version"]] = rows
            rows += 1
    step = min(80.0, (W - 80) / max(1, len(order) - 1)) if len(order) > 1 else 0
    height = max(H // 2, 60 + rows * 50)
    x = lambda n: 40 + col[n] * step  # noqa: E731
    y = lambda n: 40 + row[n] * 50  # noqa: E731
    body = []
    for v in order:
        p, n = v.get("parent"), v["version"]
        if p in col:
            body.append(
                f'<line x1="{x(p):.1f}" y1="{y(p)}" x2="{x(n):.1f}" y2="{y(n)}" stroke="#777" stroke-width="2"/>'
            )
        elif p is not None:
            body.append(
                f'<line x1="{x(n) - 30:.1f}" y1="{y(n)}" x2="{x(n):.1f}" y2="{y(n)}" stroke="#bbb" '
                f'stroke-dasharray="3 3"><title>parent @{p} (deleted)</title></line>'
            )
    for v in order:
        n, served = v["version"], v["name"] in serving
        fill = PALETTE[2] if served else "#fff"
        body.append(
            f'<a href="{escape(href(v["name"]))}"><circle cx="{x(n):.1f}" cy="{y(n)}" r="14" fill="{fill}" '
            f'stroke="{PALETTE[0]}" stroke-width="2"><title>{escape(v["name"])}'
            f"{' (serving)' if served else ''}</title></circle>"
            + _text(x(n), y(n) + 4, f"@{n}", size=10, fill="#000")
            + "</a>"
        )
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {height}" width="{W}" height="{height}" '
        f'role="img" aria-label="version graph" class="chart"><title>parents of each version</title>'
    )
    return Markup(svg + "".join(body) + "</svg>")
