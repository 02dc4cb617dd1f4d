"""``livelora usage``: tokens used per tenant, API key, endpoint or session and kind (a rich table, or ``--json``).

Over HTTP (default) it reads the running gateway's ``GET /admin/usage`` with an admin key (only that key's
tenant; an operator key, or a gateway in open mode, sees every tenant); with ``--home`` it reads the store's
rolled-up counters plus Redis's live ones (``LIVELORA_REDIS_URL``, ``LIVELORA_REDIS_PREFIX``; the store alone when
Redis is unreachable), for every tenant.

Example::

    livelora usage --group-by tenant,kind --from 2026-12-01
    livelora usage --home /data/livelora --group-by day,tenant --json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from livelora.cli.admin_common import (
    DEFAULT_URL,
    Backend,
    CliConsole,
    HomeOption,
    KeyOption,
    UrlOption,
    run_or_exit,
)

out = CliConsole()
err = CliConsole(stderr=True)


def read_usage(url: str, api_key: str | None, home: Path | None, params: dict[str, str]) -> dict[str, Any]:
    """The ``/admin/usage`` answer over HTTP, or the same shape computed from the store (and Redis) with ``home``.

    Raises:
        LiveloraError: what the gateway answered (403 another tenant, 400 a bad filter, 503 Redis down).
    """
    if home is None:
        return Backend(url, api_key, None).http("GET", "/admin/usage", params=params)
    from livelora.core.bus import connect_sync
    from livelora.core.metering import GROUP_BY, UsageStore, parse_time
    from livelora.core.redis_keys import KeyLayout
    from livelora.core.settings import CommonSettings

    settings = CommonSettings()
    store = UsageStore(home, KeyLayout(settings.redis_prefix))
    client = connect_sync(settings.redis_url, timeout_s=1.0)
    try:
        client.ping()
    except Exception:
        err.print("[yellow]note[/]: Redis unreachable; showing the counters rolled up into the store only")
        client = None
    dims = [g.strip() for g in params["group_by"].split(",")] if params.get("group_by") else list(GROUP_BY[:4])
    lo, hi = parse_time(params.get("from"), "from"), parse_time(params.get("to"), "to")
    rows = store.query_sync(
        client,
        tenant=params.get("tenant"),
        key=params.get("key"),
        subject=params.get("subject"),
        kind=params.get("kind"),
        start=lo,
        end=hi,
        group_by=dims,
    )
    if not rows:
        _explain_empty(client, home, settings.redis_prefix, settings.redis_url)
    return {"data": [r.to_dict() for r in rows], "group_by": dims, "from": lo, "to": hi}


def _explain_empty(client, home: Path, prefix: str, redis_url: str) -> None:
    """A note on stderr for an empty ``--home`` answer: which Redis prefix was read and, when that prefix is bound to
    another store or to none, that it is probably not the one the gateway used (``LIVELORA_REDIS_PREFIX``)."""
    from redis.exceptions import RedisError

    from livelora.core.install import STORE_ID_FILE
    from livelora.core.redis_keys import KeyLayout

    where = f"in the store {home}" + (f" and under Redis prefix {prefix!r} at {redis_url}" if client else "")
    note = f"[yellow]note[/]: no usage found {where}"
    if client is not None:
        id_file = Path(home) / STORE_ID_FILE
        mine = id_file.read_text().strip() if id_file.is_file() else None
        try:
            bound = client.get(KeyLayout(prefix).store_id)
        except (OSError, RedisError):  # Redis went away since the query: say what was read, nothing more
            bound = None
        if isinstance(bound, bytes):
            bound = bound.decode()
        if bound != mine or mine is None:
            owner = "no store" if bound is None else "another store"
            note += (
                f"; that prefix belongs to {owner}, not this one: set LIVELORA_REDIS_PREFIX to the prefix the "
                "gateway ran with (its start-up line names it)"
            )
        else:
            note += " (LIVELORA_REDIS_PREFIX)"
    err.print(note, soft_wrap=True)


def usage(
    tenant: Annotated[
        str | None,
        typer.Option(
            help="Only this tenant (default: every tenant the key may read: its own, or all with an operator key)."
        ),
    ] = None,
    key: Annotated[str | None, typer.Option(help="Only this API key id.")] = None,
    subject: Annotated[str | None, typer.Option(help="Only this endpoint, model or session id.")] = None,
    kind: Annotated[
        str | None,
        typer.Option(
            help="Only this kind (prompt, completion, forward, trained, sample_prompt, sampled, scored, live_trained)."
        ),
    ] = None,
    start: Annotated[str | None, typer.Option("--from", help="From (Unix s or ISO 8601, UTC).")] = None,
    end: Annotated[str | None, typer.Option("--to", help="To, exclusive (Unix s or ISO 8601, UTC).")] = None,
    group_by: Annotated[
        str, typer.Option(help="Comma-separated: tenant, key, subject, kind, hour, day.")
    ] = "tenant,key,subject,kind",
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON answer instead of a table.")] = False,
    url: UrlOption = DEFAULT_URL,
    api_key: KeyOption = None,
    home: HomeOption = None,
) -> None:
    """Tokens used per tenant, API key, endpoint or session and kind.

    A tenant's admin key reads its own tenant; an operator key (or a gateway in open mode, or --home) reads every
    tenant, one row per tenant with --group-by tenant.
    """
    params = {
        k: v
        for k, v in {
            "tenant": tenant,
            "key": key,
            "subject": subject,
            "kind": kind,
            "from": start,
            "to": end,
            "group_by": group_by,
        }.items()
        if v is not None
    }
    answer = run_or_exit(lambda: read_usage(url, api_key, home, params))
    if as_json:
        typer.echo(json.dumps(answer, indent=2))
        return
    table = Table(title="token usage")
    for col in answer["group_by"]:
        table.add_column(col)
    table.add_column("tokens", justify="right")
    for row in answer["data"]:
        table.add_row(*[str(row[c]) for c in answer["group_by"]], str(row["tokens"]))
    out.print(table)
