"""Admin sub-commands of ``livelora``: ``endpoints``, ``adapters`` and ``keys``.

By default a command calls the running gateway's ``/admin`` API at ``--url`` (``LIVELORA_URL``) with
``--api-key`` (``LIVELORA_API_KEY``, a key with the ``admin`` role; none when the server runs open). With
``--home DIR`` it works on the store directly, with no server, for every tenant: this is how the first key is
made; endpoint changes then also publish a Redis notice when Redis is reachable, so running gateways move at
once (otherwise at their next resync).

Example::

    livelora keys create --home /data/livelora --tenant default --roles inference,feedback,train,admin
    livelora endpoints promote prod 4 --reason "win-rate +6 %"
    livelora endpoints gate prod --set probe_margin=0.05 --set max_kl_current=0.3
    livelora adapters export support@4 --format merged --out ./support-4
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from livelora.cli.admin_common import (
    DEFAULT_URL,
    Backend,
    HelpGroup,
    HomeOption,
    KeyOption,
    ReasonOption,
    UrlOption,
    out,
    run_or_exit,
    when,
)
from livelora.cli.gate_rows import check_rows, freeform_rows

endpoints_app = typer.Typer(
    help="Named serving targets: list, create, promote, roll back, audit history.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
adapters_app = typer.Typer(
    help="Stored adapter versions: list, show, export, delete.", no_args_is_help=True, rich_markup_mode=None
)


# ====================================================================================== endpoints
@endpoints_app.command("list")
def endpoints_list(url: UrlOption = DEFAULT_URL, api_key: KeyOption = None, home: HomeOption = None) -> None:
    """Endpoints with the version each serves now."""
    rows = run_or_exit(lambda: Backend(url, api_key, home).list_endpoints())
    table = Table(title="endpoints")
    for col in ("endpoint", "lineage", "mode", "serving", "rollback to", "tenant"):
        table.add_column(col, overflow="fold")  # names wrap, never cut: they tell the rows apart
    for e in rows:
        table.add_row(
            e["name"], e["lineage"], e["mode"], e["serving"], e["rollback_to"] or "-", e["tenant"] or "(public)"
        )
    out.print(table)


@endpoints_app.command("show")
def endpoints_show(name: str, url: UrlOption = DEFAULT_URL, api_key: KeyOption = None, home: HomeOption = None) -> None:
    """One endpoint: its binding, the version it serves, and where its next version stands (learning)."""
    from livelora.clients.types.learning import LearningStatus

    backend = Backend(url, api_key, home)
    e = run_or_exit(lambda: backend.list_endpoints_one(name))
    table = Table(title=e["name"], show_header=False)
    for key in ("lineage", "mode", "serving", "rollback_to", "tenant"):
        table.add_row(key.replace("_", " "), str(e.get(key) or "-"))
    table.add_row("learning paused", "yes" if e.get("learning_paused") else "no")
    learning = run_or_exit(lambda: backend.learning(name))
    table.add_row(
        "learning", LearningStatus.model_validate(learning).summary() if learning else "- (Redis unreachable)"
    )
    out.print(table)


@endpoints_app.command("create")
def endpoints_create(
    name: str,
    lineage: Annotated[str, typer.Option(help="Adapter lineage served (and trained).")],
    mode: Annotated[str, typer.Option(help="follow (newest version) or pinned.")] = "follow",
    version: Annotated[str | None, typer.Option(help="Pinned version: <n>, <lineage>@<n> or base.")] = None,
    reason: ReasonOption = "",
    tenant: Annotated[str | None, typer.Option(help="Owner (--home only).")] = None,
    url: UrlOption = DEFAULT_URL,
    api_key: KeyOption = None,
    home: HomeOption = None,
) -> None:
    """Create an endpoint bound to a lineage."""
    body: dict[str, Any] = {"name": name, "lineage": lineage, "mode": mode, "version": version, "reason": reason}
    if tenant is not None:
        if home is None:
            raise typer.BadParameter("--tenant works with --home only")
        body["tenant"] = tenant
    e = run_or_exit(lambda: Backend(url, api_key, home).create_endpoint(**body))
    out.print(f"created endpoint [bold]{e['name']}[/] → {e['lineage']} ({e['mode']}), serving {e['serving']}")


def _print_change(entry: dict) -> None:
    out.print(
        f"[bold]{entry['endpoint']}[/]: {entry['from']} → [green]{entry['to']}[/] "
        f"({entry['action']} by {entry['who']}{', ' + repr(entry['reason']) if entry['reason'] else ''})"
    )


@endpoints_app.command("promote")
def endpoints_promote(
    name: str,
    version: Annotated[str | None, typer.Argument(help="<n>, <lineage>@<n> or base.")] = None,
    follow: Annotated[bool, typer.Option(help="Follow the lineage's newest version instead.")] = False,
    reason: ReasonOption = "",
    url: UrlOption = DEFAULT_URL,
    api_key: KeyOption = None,
    home: HomeOption = None,
) -> None:
    """Point an endpoint at a stored version (takes effect without restart or failed requests)."""
    if version is None and not follow:
        raise typer.BadParameter("give a VERSION (or --follow)")
    _print_change(run_or_exit(lambda: Backend(url, api_key, home).promote(name, version, follow, reason)))


@endpoints_app.command("rollback")
def endpoints_rollback(
    name: str,
    reason: ReasonOption = "",
    url: UrlOption = DEFAULT_URL,
    api_key: KeyOption = None,
    home: HomeOption = None,
) -> None:
    """Return an endpoint to the version it served before its last promotion."""
    _print_change(run_or_exit(lambda: Backend(url, api_key, home).rollback(name, reason)))


@endpoints_app.command("pause")
def endpoints_pause(
    name: str,
    reason: ReasonOption = "",
    url: UrlOption = DEFAULT_URL,
    api_key: KeyOption = None,
    home: HomeOption = None,
) -> None:
    """Stop training the endpoint's lineage (its signals stay queued; serving is unchanged) until resume."""
    _set_learning(Backend(url, api_key, home), name, True, reason)


@endpoints_app.command("resume")
def endpoints_resume(
    name: str,
    reason: ReasonOption = "",
    url: UrlOption = DEFAULT_URL,
    api_key: KeyOption = None,
    home: HomeOption = None,
) -> None:
    """Train the endpoint's lineage again (the queued signals first)."""
    _set_learning(Backend(url, api_key, home), name, False, reason)


def _set_learning(backend: Backend, name: str, paused: bool, reason: str) -> None:
    entry = run_or_exit(lambda: backend.set_learning(name, paused, reason))
    out.print(
        f"[bold]{entry['endpoint']}[/]: learning {'paused' if paused else 'resumed'} by {entry['who']}" + _why(entry)
    )


def _why(entry: dict) -> str:
    return f" ({entry['reason']!r})" if entry["reason"] else ""


@endpoints_app.command("history")
def endpoints_history(
    name: Annotated[str | None, typer.Argument(help="One endpoint (default: all).")] = None,
    url: UrlOption = DEFAULT_URL,
    api_key: KeyOption = None,
    home: HomeOption = None,
) -> None:
    """The audit log: who changed which endpoint, when, from what to what, and why."""
    rows = run_or_exit(lambda: Backend(url, api_key, home).history(name))
    table = Table(title="history")
    for col in ("when", "who", "endpoint", "action", "from", "to", "reason"):
        table.add_column(col)
    for h in rows:
        table.add_row(when(h["time"]), h["who"], h["endpoint"], h["action"], h["from"] or "-", h["to"], h["reason"])
    out.print(table)


@endpoints_app.command("gate")
def endpoints_gate(
    name: str,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="NAME=VALUE of a threshold (repeatable): "
            "enabled, probe_margin, probe_base_margin, "
            "max_kl_current, max_kl_base, max_degenerate, "
            "min_length_ratio, signal_tolerance, "
            "min_signal_examples.",
        ),
    ] = None,
    reset: Annotated[bool, typer.Option(help="Back to the default thresholds.")] = False,
    reason: ReasonOption = "",
    url: UrlOption = DEFAULT_URL,
    api_key: KeyOption = None,
    home: HomeOption = None,
) -> None:
    """Show or set an endpoint's evaluation-gate thresholds (docs/rails.md)."""
    backend = Backend(url, api_key, home)
    if set_ or reset:
        current = {} if reset else dict(run_or_exit(lambda: backend.list_endpoints_one(name))["gate"])
        for item in set_ or []:
            key, sep, value = item.partition("=")
            if not sep:
                raise typer.BadParameter(f"--set takes NAME=VALUE, not {item!r}")
            current[key.strip()] = (
                value.strip().lower() in ("1", "true", "yes", "on") if key.strip() == "enabled" else float(value)
            )
        run_or_exit(lambda: backend.set_gate(name, current or None, reason))
    e = run_or_exit(lambda: backend.list_endpoints_one(name))
    table = Table(title=f"gate thresholds of {name}", show_header=False)
    for key, value in e["gate"].items():
        table.add_row(key, str(value))
    out.print(table)


# ====================================================================================== adapters
@adapters_app.command("list")
def adapters_list(
    lineage: Annotated[str | None, typer.Option(help="Only this lineage.")] = None,
    url: UrlOption = DEFAULT_URL,
    api_key: KeyOption = None,
    home: HomeOption = None,
) -> None:
    """Every stored version the caller's tenant owns (with --home: every tenant's), one table per lineage: the
    live loop's versions of an endpoint's lineage and the versions of training runs (sessions, recipes) with the
    checkpoints naming them. A re-saved checkpoint name replaces its version, and an unnamed sampler save is
    deleted when its session ends, so a parent can be gone (shown as 'N (deleted)')."""
    rows = run_or_exit(lambda: Backend(url, api_key, home).list_adapters(lineage))
    if not rows:
        whose = "in this store" if home else "that this key's tenant owns"
        where = f" in lineage {lineage}" if lineage else ""
        out.print(
            f"no adapter versions {whose}{where}: the live loop stores one when an endpoint learns from ratings, "
            "a training session when it saves weights (livelora adapters list --help)",
            soft_wrap=True,
        )
        return
    groups: dict[str, list[dict]] = {}
    for m in rows:
        groups.setdefault(m["lineage"], []).append(m)
    for name, versions in groups.items():
        out.print(_lineage_table(name, versions, out.width))
    out.print(f"{len(rows)} version(s) in {len(groups)} lineage(s)")


#: Columns of ``adapters list`` a narrow terminal shortens (cut with "…", never wrapped); the others never shrink.
_CUT = ("data", "checkpoint", "serving")


def _fit(natural: dict[str, int], width: int) -> dict[str, int] | None:
    """Widths of the :data:`_CUT` columns so that a table of columns with ``natural`` widths (cell text, no
    padding) fits ``width`` terminal columns; None when it cannot, even with those cut to their headers."""
    room = width - (3 * len(natural) + 1) - sum(w for c, w in natural.items() if c not in _CUT)
    cut = sorted((w, c) for c, w in natural.items() if c in _CUT)
    if room < sum(len(c) for _, c in cut):
        return None
    out = {}
    for i, (w, c) in enumerate(cut):  # the narrowest first: each gets its width or a fair share of what is left
        out[c] = max(len(c), min(w, room // (len(cut) - i)))
        room -= out[c]
    return out


def _lineage_table(name: str, versions: list[dict], width: int) -> Table:
    """One lineage's versions for ``adapters list``, fitting ``width`` terminal columns: ids and times never wrap
    nor shrink (data, checkpoints and serving endpoints are cut with "…" instead); the version column holds the
    full ``<lineage>@<n>`` where it fits, else ``@<n>`` (the title names the lineage)."""
    first = versions[0]
    what = [f"endpoints {', '.join(first.get('endpoints') or [])}"] if first.get("endpoints") else []
    if first.get("training_run"):
        what.append(f"training run {first['training_run']}")
    kept = {m["version"] for m in versions}
    run = bool(first.get("training_run"))  # a checkpoint column for a training run's lineage only
    rows = []
    for m in versions:
        parent = m["parent"]
        row = {
            "version": m["name"],
            "parent": "-" if parent is None else str(parent) + ("" if parent in kept else " (deleted)"),
            "step": str(m["step"]),
            "created": when(m["created"], seconds=False),
            "data": ", ".join(f"{k}={v}" for k, v in (m.get("data_counts") or {}).items()) or "-",
            "checkpoint": ", ".join(m.get("checkpoints") or []) or "unnamed sampler save",
            "serving": ", ".join(m["serving"]) or "-",
        }
        rows.append({c: v for c, v in row.items() if run or c != "checkpoint"})
    natural = {c: max(len(c), *(len(r[c]) for r in rows)) for c in rows[0]}
    widths = _fit(natural, width)
    if widths is None:  # the full names do not fit: the rows' @<n>
        for r, m in zip(rows, versions):
            r["version"] = f"@{m['version']}"
        at_n = {**natural, "version": max(7, *(len(r["version"]) for r in rows))}
        widths = _fit(at_n, width) or {c: len(c) for c in at_n if c in _CUT}  # narrower still: rich shrinks all
    # Text, not str: rich would read ":train:" in a model id as an emoji code
    table = Table(title=Text(f"lineage {name}: {len(versions)} version(s)" + (f" ({'; '.join(what)})" if what else "")))
    for c in rows[0]:
        table.add_column(c, no_wrap=True, overflow="ellipsis", max_width=widths.get(c))
    for r in rows:
        table.add_row(*map(Text, r.values()))
    return table


@adapters_app.command("show")
def adapters_show(name: str, url: UrlOption = DEFAULT_URL, api_key: KeyOption = None, home: HomeOption = None) -> None:
    """One version: manifest, files, sha256 check, serving endpoints."""
    m = run_or_exit(lambda: Backend(url, api_key, home).show_adapter(name))
    table = Table(title=m["name"], show_header=False)
    shown = {k: m.get(k) for k in ("lineage", "version", "base_model", "parent", "step", "rank", "alpha", "sha256")}
    shown |= {"parent": m.get("parent") or "none: trained from the base model", "verified": m.get("verified")}
    for key, value in shown.items():
        table.add_row(key.replace("_", " "), "-" if value is None else str(value))
    table.add_row("created", when(m["created"]))
    table.add_row("metrics", "-" if not m["metrics"] else "")
    for k, v in m["metrics"].items():  # one per line: loss:mean, rehearsal_kl:mean, ...
        table.add_row(f"  {k}", f"{v:.4g}")
    table.add_row("files", ", ".join(f"{k} ({v:,} B)" for k, v in m["files"].items()))
    table.add_row("serving", ", ".join(m["serving"]) or "-")
    gate = m.get("gate")
    if gate:
        verdicts = ", ".join(
            f"{'other endpoints (default thresholds)' if ep == '*' else ep}: "
            f"{'passed' if v['passed'] else 'rejected (' + ', '.join(v['failed'] or ['not measured']) + ')'}"
            for ep, v in gate["verdicts"].items()
        )
        table.add_row(
            "gate",
            f"against {gate['against']} in {gate['seconds']:.1f} s; {verdicts}"
            + (f"; training continues from {gate['continued_from']}" if gate.get("continued_from") else ""),
        )
        tries = gate.get("line_search") or []
        table.add_row(
            "step scale",
            f"{gate.get('step_scale', 1.0):g} of the trained step"
            + (
                " (line search: "
                + ", ".join(
                    f"{t['step_scale']:g} " + ("passed" if t["passed"] else "failed " + ", ".join(t["failed"]))
                    for t in tries
                )
                + ")"
                if len(tries) > 1 or (tries and not tries[0]["passed"])
                else ""
            ),
        )
        check_rows(table, gate)
        freeform_rows(table, (gate.get("measures") or {}).get("freeform"))
    else:
        table.add_row("gate", "not evaluated")
    out.print(table)


@adapters_app.command("export")
def adapters_export(
    name: str,
    out_dir: Annotated[Path, typer.Option("--out", help="Destination directory (must not exist).")],
    format: Annotated[
        str, typer.Option(help="peft (adapter directory), merged (full HF model) or gguf (llama.cpp LoRA adapter).")
    ] = "peft",
    url: UrlOption = DEFAULT_URL,
    api_key: KeyOption = None,
    home: HomeOption = None,
) -> None:
    """Export a version as a PEFT adapter directory, a merged Hugging Face model or a llama.cpp LoRA (GGUF)."""
    from livelora.gateway.services.tenants.version_admin import EXPORT_FORMATS

    if format not in EXPORT_FORMATS:  # before any spinner or request
        raise typer.BadParameter(f"{format!r} is not one of {', '.join(EXPORT_FORMATS)}", param_hint="--format")
    path = run_or_exit(lambda: Backend(url, api_key, home).export(name, format, out_dir))
    size = sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())
    out.print(f"exported {name} ({format}) to [bold]{path}[/] ({size / 1e6:.1f} MB)")


@adapters_app.command("delete")
def adapters_delete(
    name: str, url: UrlOption = DEFAULT_URL, api_key: KeyOption = None, home: HomeOption = None
) -> None:
    """Delete a version (refused while an endpoint serves it)."""
    run_or_exit(lambda: Backend(url, api_key, home).delete_adapter(name))
    out.print(f"deleted {name}")


def register(app: typer.Typer) -> None:
    """Add ``endpoints``, ``adapters`` and ``keys`` to the root ``livelora`` app."""
    from livelora.cli.admin_segments import segments_app

    endpoints_app.add_typer(segments_app, name="segments", cls=HelpGroup)
    app.add_typer(endpoints_app, name="endpoints", cls=HelpGroup)
    app.add_typer(adapters_app, name="adapters", cls=HelpGroup)
    from livelora.cli.admin_keys import keys_app

    app.add_typer(keys_app, name="keys", cls=HelpGroup)
