"""Server-rendered SVG for the admin console: a lineage's parent graph (the charts are :mod:`.charts`).

Plain SVG 1.1 elements with presentation attributes only (no script, no inline ``style``: the console's
Content-Security-Policy allows neither), every text escaped; returns :class:`markupsafe.Markup` for a template.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from markupsafe import Markup, escape

#: Series colours (colour-blind safe, Okabe & Ito 2008).
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")
W, H = 760, 260


def _text(x: float, y: float, s: str, anchor: str = "middle", size: int = 11, fill: str = "#333") -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}" '
        f'font-family="sans-serif" fill="{fill}">{escape(s)}</text>'
    )


def _frame(title: str, body: list[str]) -> Markup:
    return Markup(
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" '
        f'aria-label="{escape(title)}" class="chart"><title>{escape(title)}</title>' + "".join(body) + "</svg>"
    )


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
