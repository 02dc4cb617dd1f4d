"""``livelora endpoints segments``: an endpoint's segments (named sets of users with a lineage of their own),
over HTTP (``/admin/endpoints/{name}/segments``) or on the store (``--home``). Use: docs/endpoints-and-keys.md.

Example::

    livelora endpoints segments create support vip
    livelora endpoints segments assign support vip --user alice --key key_3f2a --header vip
    livelora endpoints segments list support
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from livelora.cli.admin_common import (
    DEFAULT_URL,
    Backend,
    HomeOption,
    KeyOption,
    ReasonOption,
    UrlOption,
    out,
    run_or_exit,
)

segments_app = typer.Typer(
    help="An endpoint's segments: users (by user field, API key or header) who get a lineage of their own.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
UserOption = Annotated[list[str] | None, typer.Option("--user", help="An OpenAI `user` value (repeatable).")]
KeyIdOption = Annotated[list[str] | None, typer.Option("--key", help="An API key id of the tenant (repeatable).")]
HeaderOption = Annotated[list[str] | None, typer.Option("--header", help="An X-Livelora-Segment value (repeatable).")]


def _local(backend: Backend):
    from livelora.gateway.services.tenants.segment_admin import SegmentAdmin

    return SegmentAdmin(backend.local.endpoints, None)


def _list(backend: Backend, name: str) -> list[dict[str, Any]]:
    if backend.home:
        return _local(backend).list(name)
    return backend.http("GET", f"/admin/endpoints/{name}/segments")["data"]


def _create(backend: Backend, name: str, segment: str, reason: str) -> dict[str, Any]:
    if backend.home:
        info = _local(backend).create(name, segment, who=backend.who, reason=reason)
        backend.notify(info["binding"])
        return info
    return backend.http("POST", f"/admin/endpoints/{name}/segments", json={"name": segment, "reason": reason})


def _assign(backend: Backend, name: str, segment: str, members: dict, remove: bool, reason: str) -> dict[str, Any]:
    if backend.home:
        info = _local(backend).assign(name, segment, members, who=backend.who, remove=remove, reason=reason)
        backend.notify(info["binding"])
        return info
    verb = "unassign" if remove else "assign"
    body = {**members, "reason": reason}
    return backend.http("POST", f"/admin/endpoints/{name}/segments/{segment}/{verb}", json=body)


def _print(info: dict[str, Any]) -> None:
    members = len(info["users"]) + len(info["keys"]) + len(info["headers"])
    out.print(f"[bold]{info['endpoint']}[/] segment {info['name']}: lineage {info['lineage']}, {members} member(s)")


@segments_app.command("list")
def segments_list(name: str, url: UrlOption = DEFAULT_URL, api_key: KeyOption = None, home: HomeOption = None) -> None:
    """The endpoint's segments: members, lineage, the version each serves."""
    rows = run_or_exit(lambda: _list(Backend(url, api_key, home), name))
    table = Table(title=f"segments of {name}")
    for col in ("segment", "lineage", "serving", "from", "users", "keys", "headers"):
        table.add_column(col)
    for s in rows:
        table.add_row(
            s["name"],
            s["lineage"],
            s["serving"],
            s["origin"],
            ", ".join(s["users"]) or "-",
            ", ".join(s["keys"]) or "-",
            ", ".join(s["headers"]) or "-",
        )
    out.print(table)


@segments_app.command("create")
def segments_create(
    name: str,
    segment: str,
    reason: ReasonOption = "",
    url: UrlOption = DEFAULT_URL,
    api_key: KeyOption = None,
    home: HomeOption = None,
) -> None:
    """Make a segment: its lineage starts from the version the endpoint serves now."""
    _print(run_or_exit(lambda: _create(Backend(url, api_key, home), name, segment, reason)))


@segments_app.command("assign")
def segments_assign(
    name: str,
    segment: str,
    user: UserOption = None,
    key: KeyIdOption = None,
    header: HeaderOption = None,
    reason: ReasonOption = "",
    url: UrlOption = DEFAULT_URL,
    api_key: KeyOption = None,
    home: HomeOption = None,
) -> None:
    """Add users, API keys or header values to a segment (each in one segment of the endpoint at most)."""
    _members_change(url, api_key, home, name, segment, (user, key, header), False, reason)


@segments_app.command("unassign")
def segments_unassign(
    name: str,
    segment: str,
    user: UserOption = None,
    key: KeyIdOption = None,
    header: HeaderOption = None,
    reason: ReasonOption = "",
    url: UrlOption = DEFAULT_URL,
    api_key: KeyOption = None,
    home: HomeOption = None,
) -> None:
    """Take members out of a segment: their requests go to the endpoint's shared version again."""
    _members_change(url, api_key, home, name, segment, (user, key, header), True, reason)


def _members_change(url, api_key, home, name: str, segment: str, given: tuple, remove: bool, reason: str) -> None:
    """``assign`` (``remove`` false) or ``unassign`` the ``(users, key ids, header values)`` given, and print."""
    members = {kind: list(values or []) for kind, values in zip(("users", "keys", "headers"), given)}
    _print(run_or_exit(lambda: _assign(Backend(url, api_key, home), name, segment, members, remove, reason)))
