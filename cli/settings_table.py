"""``livelora settings``: every setting of a process kind as the environment variable a user sets, with its
default, its current value when set, and its description (read from the settings classes, so new settings are
listed without editing this file)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Annotated, Any

import typer
from rich.table import Table

from livelora.cli.admin_common import CliConsole

_KINDS = {"serve": "ServeSettings", "gateway": "GatewaySettings", "trainer": "TrainerSettings"}


def setting_rows(kind: str) -> Iterator[tuple[str, str, str, str]]:
    """``(variable, section, default, description)`` for every setting of process ``kind`` (serve, gateway or
    trainer), common fields first, then each section's.

    Raises:
        KeyError: unknown ``kind``.
    """
    from livelora.cli import settings as cli_settings
    from livelora.core.settings import CommonSettings

    cls = next(c for c in cli_settings.PROCESS_SETTINGS if c.__name__ == _KINDS[kind])
    groups: list[tuple[str, Any]] = [("common", CommonSettings)]
    groups += list(cls.section_types().items())
    seen: set[str] = set()
    for section, sec_cls in groups:
        prefix = sec_cls.model_config.get("env_prefix", "LIVELORA_")
        for name, field in sec_cls.model_fields.items():
            env = f"{prefix}{name}".upper()
            if env in seen:  # a field two sections declare (e.g. device) is one variable
                continue
            seen.add(env)
            if field.default_factory is not None:
                try:
                    default = field.default_factory()
                except Exception:
                    default = "(computed)"
            else:
                default = field.default
            yield env, section, "-" if default is None else str(default), field.description or ""


def settings(
    kind: Annotated[str, typer.Argument(help="Process kind: serve, gateway or trainer.")] = "serve",
    grep: Annotated[
        str | None,
        typer.Option("--grep", help="Only variables or descriptions containing this text (case-insensitive)."),
    ] = None,
) -> None:
    """List every setting of a process kind: its environment variable, section, default, the value set in this
    environment (if any) and what it does."""
    console = CliConsole()
    if kind not in _KINDS:
        console.print(f"[red]error[/]: unknown process kind {kind!r}; use one of {', '.join(_KINDS)}")
        raise typer.Exit(2)
    table = Table(title=f"livelora {kind} settings (environment variables)", show_lines=False)
    for col in ("variable", "section", "default", "set here", "description"):
        table.add_column(col, overflow="fold")
    for env, section, default, description in setting_rows(kind):
        if grep and grep.lower() not in f"{env} {description}".lower():
            continue
        table.add_row(env, section, default, os.environ.get(env, ""), description)
    console.print(table)
