"""What the admin commands (``livelora endpoints``, ``adapters``, ``keys``, ``usage``) share: the :class:`Backend`
that runs each operation over HTTP or on the store (``--home``), the common options, the consoles and
:func:`run_or_exit` (a livelora error becomes one red line and exit code 1)."""

from __future__ import annotations

import getpass
import io
import json
import os
import tarfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, SpinnerColumn, TextColumn, TransferSpeedColumn
from typer import _click  # typer's own click: the types its TyperGroup is declared with
from typer.core import TyperGroup

#: The width of tables and lines written to a pipe or file when ``COLUMNS`` is not set (wide: nothing is cut).
PIPED_WIDTH = 400


class CliConsole(Console):
    """A console that does not cut tables at 80 columns when its output goes to a pipe or a file: without
    ``COLUMNS`` there, it is :data:`PIPED_WIDTH` wide (rich would take the terminal's width, or 80)."""

    @property
    def size(self) -> ConsoleDimensions:
        dims = super().size
        if self._width is None and not self.is_terminal and "COLUMNS" not in self._environ:
            return ConsoleDimensions(PIPED_WIDTH, dims.height)
        return dims

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self._width, self._height = new_size


out = CliConsole()
err = CliConsole(stderr=True)


UrlOption = Annotated[str, typer.Option(envvar="LIVELORA_URL", help="Gateway base URL (HTTP mode).")]
KeyOption = Annotated[str | None, typer.Option(envvar="LIVELORA_API_KEY", help="Admin API key (HTTP mode).")]
HomeOption = Annotated[Path | None, typer.Option(help="Work on this store directly (no server needed).")]
ReasonOption = Annotated[str, typer.Option(help="Why: written to the audit log.")]
DEFAULT_URL = "http://127.0.0.1:8000"


class HelpGroup(TyperGroup):
    """A command group whose ``--help`` lists each command's first sentence whole, wrapped to the terminal
    (click's own listing cuts it at the terminal's width with "...")."""

    def format_commands(self, ctx: _click.Context, formatter: _click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(limit=1000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


class Backend:
    """The admin operations, over HTTP or on the store; every method returns JSON-like data."""

    def __init__(self, url: str, api_key: str | None, home: Path | None):
        self.url, self.api_key, self.home = url.rstrip("/"), api_key, home
        if home is not None:
            from livelora.core.settings import CommonSettings
            from livelora.gateway.services.tenants.store_admin import StoreAdmin

            # the served base model's own endpoint (implicit unless changed) is shown like the explicit ones
            served = os.environ.get("LIVELORA_SERVED_MODEL_NAME") or CommonSettings().model
            self.local = StoreAdmin(home, tenant=None, base_endpoints=(served,))
            self.who = f"local:{getpass.getuser()}"

    # -------------------------------------------------------------- plumbing
    def http(self, method: str, path: str, **kw) -> Any:
        import httpx

        from livelora.clients.errors import error_for_status

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            r = httpx.request(method, self.url + path, headers=headers, timeout=600, **kw)
        except httpx.HTTPError as exc:
            raise unreachable(self.url, exc) from None
        if r.status_code >= 400:
            try:
                e = r.json()["error"]
            except Exception:
                e = {"message": r.text[:300]}
            raise error_for_status(r.status_code, e.get("message", ""), param=e.get("param"), code=e.get("code"))
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else r

    def notify(self, endpoint: str) -> None:
        """Tell running gateways (local mode) that ``endpoint`` changed; silent if Redis is unreachable."""
        from livelora.core.bus import connect_sync
        from livelora.core.redis_keys import KeyLayout
        from livelora.core.settings import CommonSettings
        from livelora.gateway.services.tenants.store_admin import endpoint_notice

        settings = CommonSettings()
        try:
            client = connect_sync(settings.redis_url, timeout_s=1.0)
            client.publish(KeyLayout(settings.redis_prefix).notices, endpoint_notice(endpoint))
            client.close()
        except Exception:
            err.print(
                "[yellow]note[/]: Redis unreachable; running gateways pick the change up at their next "
                "resync from the store"
            )

    # -------------------------------------------------------------- endpoints
    def list_endpoints(self) -> list[dict]:
        return self.local.list_endpoints() if self.home else self.http("GET", "/admin/endpoints")["data"]

    def list_endpoints_one(self, name: str) -> dict:
        return self.local.get_endpoint(name) if self.home else self.http("GET", f"/admin/endpoints/{name}")

    def learning(self, name: str) -> dict | None:
        """The learning status of ``name`` (``GET /v1/learning/{name}``; with ``--home``, read from Redis without
        the ratings the trainer has not read yet); None when Redis is unreachable in ``--home`` mode."""
        if not self.home:
            return self.http("GET", f"/v1/learning/{name}")
        from livelora.clients.types.learning import LearningStatus
        from livelora.core.bus import connect_sync
        from livelora.core.redis_keys import KeyLayout
        from livelora.core.settings import CommonSettings
        from livelora.gateway.services.live.learning import base_first, estimate, trainer_steps

        settings, lineage = CommonSettings(), self.local.get_endpoint(name)["lineage"]
        keys = KeyLayout(settings.redis_prefix)
        try:
            client = connect_sync(settings.redis_url, timeout_s=1.0)
            raw, trainer = client.mget(keys.learning(lineage), keys.learning_trainer)
            client.close()
        except Exception:
            return None
        t = json.loads(trainer) if trainer else {}
        st = (
            LearningStatus.model_validate_json(raw)
            if raw
            else LearningStatus(endpoint=name, lineage=lineage, stage="idle")
        )
        trainer_steps(st, t)
        now = time.time()
        estimate(st, now)
        base_first(st, t.get("base_measure") or {}, now)
        return st.model_dump(mode="json")

    def create_endpoint(self, **body) -> dict:
        if self.home:
            info = self.local.create_endpoint(body.pop("name"), body.pop("lineage"), who=self.who, **body)
            self.notify(info["name"])
            return info
        return self.http("POST", "/admin/endpoints", json=body)

    def promote(self, name: str, version: str | None, follow: bool, reason: str) -> dict:
        if self.home:
            entry = self.local.promote(name, version, who=self.who, reason=reason, follow=follow)
            self.notify(name)
            return entry.model_dump(mode="json", by_alias=True)
        return self.http(
            "POST", f"/admin/endpoints/{name}/promote", json={"version": version, "follow": follow, "reason": reason}
        )["history"]

    def rollback(self, name: str, reason: str) -> dict:
        if self.home:
            entry = self.local.rollback(name, who=self.who, reason=reason)
            self.notify(name)
            return entry.model_dump(mode="json", by_alias=True)
        return self.http("POST", f"/admin/endpoints/{name}/rollback", json={"reason": reason})["history"]

    def set_learning(self, name: str, paused: bool, reason: str) -> dict:
        if self.home:
            entry = self.local.set_learning(name, paused, who=self.who, reason=reason)
            self.notify(name)
            return entry.model_dump(mode="json", by_alias=True)
        action = "pause" if paused else "resume"
        return self.http("POST", f"/admin/endpoints/{name}/{action}", json={"reason": reason})["history"]

    def set_gate(self, name: str, thresholds: dict | None, reason: str) -> dict:
        if self.home:
            entry = self.local.set_gate(name, thresholds, who=self.who, reason=reason)
            self.notify(name)
            return {"history": entry.model_dump(mode="json", by_alias=True), "endpoint": self.local.get_endpoint(name)}
        body = {"thresholds": thresholds, "reason": reason} if thresholds else {"reset": True, "reason": reason}
        return self.http("PUT", f"/admin/endpoints/{name}/gate", json=body)

    def history(self, name: str | None) -> list[dict]:
        if self.home:
            return [e.model_dump(mode="json", by_alias=True) for e in self.local.history(name)]
        return self.http("GET", f"/admin/endpoints/{name}/history" if name else "/admin/history")["data"]

    # -------------------------------------------------------------- adapters
    def list_adapters(self, lineage: str | None) -> list[dict]:
        if self.home:
            return self.local.versions.list_adapters(lineage)
        return self.http("GET", "/admin/adapters", params={"lineage": lineage} if lineage else None)["data"]

    def show_adapter(self, name: str) -> dict:
        return self.local.versions.show_adapter(name) if self.home else self.http("GET", f"/admin/adapters/{name}")

    def delete_adapter(self, name: str) -> None:
        if self.home:
            self.local.versions.delete_adapter(name)
        else:
            self.http("DELETE", f"/admin/adapters/{name}")

    def export(self, name: str, fmt: str, dest: Path) -> Path:
        if dest.exists():
            raise typer.BadParameter(f"{dest} already exists")
        with Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=err,
        ) as progress:
            task = progress.add_task(f"exporting {name} ({fmt})", total=None)
            if self.home:
                path = self.local.versions.export(name, fmt, dest)
                progress.update(task, total=1, completed=1)
                return path
            self.http("POST", f"/admin/adapters/{name}/export", json={"format": fmt})
            progress.update(task, description=f"downloading {name} ({fmt})")
            import httpx

            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            buf = io.BytesIO()
            try:
                with httpx.stream("GET", f"{self.url}/admin/exports/{name}/{fmt}", headers=headers, timeout=600) as r:
                    if r.status_code >= 400:
                        r.read()
                        self._raise(r)
                    progress.update(task, total=int(r.headers.get("content-length") or 0) or None)
                    for chunk in r.iter_bytes():
                        buf.write(chunk)
                        progress.update(task, advance=len(chunk))
            except httpx.HTTPError as exc:  # the gateway went away between the export and its download
                raise unreachable(self.url, exc) from None
            buf.seek(0)
            tmp = dest.with_name(f".{dest.name}.partial")
            with tarfile.open(fileobj=buf, mode="r") as tar:
                tar.extractall(tmp, filter="data")  # 'data' filter: no absolute paths, links or '..'
            tmp.rename(dest)
            return dest

    def _raise(self, r) -> None:
        from livelora.clients.errors import error_for_status

        e = r.json().get("error", {})
        raise error_for_status(r.status_code, e.get("message", ""), param=e.get("param"), code=e.get("code"))

    # -------------------------------------------------------------- keys
    def create_key(self, roles: list[str], tenant: str | None, name: str) -> dict:
        if self.home:
            info, key = self.local.keys.create_key(roles, tenant=tenant, name=name)
            return {**info, "key": key}
        body: dict[str, Any] = {"roles": roles, "name": name}
        if tenant is not None:  # the server accepts the admin key's own tenant only
            body["tenant"] = tenant
        return self.http("POST", "/admin/keys", json=body)

    def list_keys(self) -> list[dict]:
        return self.local.keys.list_keys() if self.home else self.http("GET", "/admin/keys")["data"]

    def revoke_key(self, key_id: str) -> dict:
        return self.local.keys.revoke_key(key_id) if self.home else self.http("DELETE", f"/admin/keys/{key_id}")


def run_or_exit(fn):
    """Call ``fn()``; livelora errors become one red line and exit code 1."""
    from livelora.clients.errors import LiveloraError

    try:
        return fn()
    except LiveloraError as exc:
        err.print(f"[red]error[/] ({exc.status}): {escape(key_hint(exc))}", soft_wrap=True)
        raise typer.Exit(1) from None


def unreachable(url: str, exc: BaseException, hint: str = "") -> typer.Exit:
    """Print one line saying that no gateway answers at ``url`` (connection refused, unknown host, timeout: ``exc``)
    and what to do (``hint``; default: start one, give its address, or work on the store); returns the exit to
    raise, status 2 (the command cannot run as given, like a bad option value)."""
    hint = hint or "start `livelora serve`, give its address with --url (or $LIVELORA_URL), or use --home DIR"
    why = str(exc) or type(exc).__name__
    err.print(f"[red]error[/]: cannot reach {escape(url)} ({escape(why)}): {escape(hint)}", soft_wrap=True)
    return typer.Exit(2)


def key_hint(exc: Exception) -> str:
    """``exc``'s message; for a 401, plus how this CLI sends a key (``--api-key`` or ``LIVELORA_API_KEY``)."""
    text = str(exc)
    if getattr(exc, "status", None) == 401 and "--api-key" not in text:
        text += " (the CLI sends the key given by --api-key or $LIVELORA_API_KEY)"
    return text


def when(ts: float | None, seconds: bool = True) -> str:
    """Unix time ``ts`` as local ``YYYY-MM-DD HH:MM[:SS]``; ``-`` for none."""
    return time.strftime("%Y-%m-%d %H:%M" + (":%S" if seconds else ""), time.localtime(ts)) if ts else "-"
