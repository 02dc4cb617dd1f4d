"""The ``livelora keys`` sub-commands: create, list and revoke API keys (over HTTP with an admin key, or on the
store with ``--home``: the first key of an install is made that way)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from livelora.cli.admin_common import (
    DEFAULT_URL,
    Backend,
    HomeOption,
    KeyOption,
    UrlOption,
    err,
    out,
    run_or_exit,
    when,
)
from livelora.core.api_keys import ROLES

keys_app = typer.Typer(
    help="API keys (stored hashed; each has a tenant and roles).", no_args_is_help=True, rich_markup_mode=None
)


@keys_app.command("create")
def keys_create(
    roles: Annotated[
        str, typer.Option(help=f"Comma list of {', '.join(ROLES)} (operator: with --home only).")
    ] = "inference,feedback",
    tenant: Annotated[
        str | None,
        typer.Option(
            help="Tenant (with --home any, default 'default'; over HTTP the admin key's own tenant, the default)."
        ),
    ] = None,
    name: Annotated[str, typer.Option(help="Label for lists and audit logs.")] = "",
    url: UrlOption = DEFAULT_URL,
    api_key: KeyOption = None,
    home: HomeOption = None,
) -> None:
    """Create a key; it is printed once and only its sha256 is stored."""
    role_list = [r.strip() for r in roles.split(",") if r.strip()]
    k = run_or_exit(lambda: Backend(url, api_key, home).create_key(role_list, tenant, name))
    err.print(
        f"key [bold]{k['id']}[/] for tenant [cyan]{k['tenant']}[/], roles {', '.join(k['roles'])}. "
        "Store it now: it cannot be shown again.",
        soft_wrap=True,
    )
    typer.echo(k["key"])


@keys_app.command("list")
def keys_list(url: UrlOption = DEFAULT_URL, api_key: KeyOption = None, home: HomeOption = None) -> None:
    """Keys (ids, tenants, roles; never the keys themselves)."""
    rows = run_or_exit(lambda: Backend(url, api_key, home).list_keys())
    table = Table(title="API keys")
    for col in ("id", "name", "tenant", "roles", "created", "revoked"):
        table.add_column(col)
    for k in rows:
        table.add_row(
            k["id"], k["name"] or "-", k["tenant"], ",".join(k["roles"]), when(k["created"]), when(k["revoked"])
        )
    out.print(table)


@keys_app.command("revoke")
def keys_revoke(key_id: str, url: UrlOption = DEFAULT_URL, api_key: KeyOption = None, home: HomeOption = None) -> None:
    """Revoke a key (every gateway refuses it from its next request)."""
    k = run_or_exit(lambda: Backend(url, api_key, home).revoke_key(key_id))
    out.print(f"revoked {k['id']} (tenant {k['tenant']})")
