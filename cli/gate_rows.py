"""Rows of ``livelora adapters show`` for the gate: its checks and its free-form capability check (docs/rails.md)."""

from __future__ import annotations

from typing import Any

from livelora.core.rails import wilson_interval


def num(v: float | None) -> str:
    """A measure for a table cell: 4 significant digits, ``-`` when not measured."""
    return "-" if v is None else f"{v:.4g}"


def check_rows(table: Any, gate: dict) -> None:
    """A version's gate checks, one row each: its value, the current version's (and the base model's for the
    ``*_base`` checks), the bound and ok/FAILED; skipped and unmeasured checks say so."""
    measures = gate.get("measures") or {}
    bases = {
        "probes_base": measures.get("probe_accuracy_base"),
        "freeform_base": (measures.get("freeform") or {}).get("base"),
    }
    for c in gate["checks"]:
        if c.get("skipped"):  # an earlier, cheaper check failed: the gate measured no further
            table.add_row(f"  {c['name']}", "skipped (an earlier check failed)")
            continue
        if c["value"] is None:  # e.g. the signal check before enough held-out ratings: it did not count
            table.add_row(f"  {c['name']}", "not measured (passes)")
            continue
        base = bases.get(c["name"])
        extra = f", base model {num(base)}" if base is not None else ""
        table.add_row(
            f"  {c['name']}",
            f"{num(c['value'])} (current {num(c['current'])}{extra}, "
            f"bound {num(c['bound'])}) {'ok' if c['passed'] else 'FAILED'}",
        )


def freeform_rows(table: Any, ff: dict | None) -> None:
    """The gate's free-form capability check of a version: overall, per category (with the 95 % Wilson interval of
    the version's share) and the items lost and gained against the current version."""
    if not ff:
        return
    n = ff["items"]
    early = ff.get("of", n) > n
    table.add_row(
        "free-form",
        f"{right(ff['score'], n)} of {n} items right (current version {right(ff['current'], n)}, base model "
        f"{right(ff['base'], n)})",
    )
    if early:
        table.add_row("  sample", f"the first {n} of {ff['of']} items: the gate's sequential test had decided there")
    if "lost_count" in ff:  # a summary written before the counts were has none
        table.add_row("  changes", f"{ff['lost_count']} lost, {ff['gained_count']} gained against the current version")
    for cat, c in ff.get("categories", {}).items():
        lo, hi = wilson_interval(c["new"], c["n"]) or (0.0, 1.0)
        table.add_row(
            f"  {cat}", f"{c['new']}/{c['n']} [{lo:.2f}, {hi:.2f}] (current {c['current']}, base model {c['base']})"
        )
    for kind in ("lost", "gained"):
        for ex in ff.get(kind, []):
            table.add_row(f"  {kind}", f"{ex['prompt']!r} -> {clip(ex['reply'])!r} (was {clip(ex['was'])!r})")


def right(share: float | None, n: int) -> str:
    """Items right of ``n`` from their ``share`` (``-``: not measured)."""
    return "-" if share is None else str(round(share * n))


def clip(text: str | None, n: int = 60) -> str | None:
    """``text`` cut to ``n`` characters with an ellipsis (a lost example's replies, which run to 200 tokens)."""
    return text if text is None or len(text) <= n else text[: n - 1] + "…"
