"""The adapter versions a tenant may see in the store: :class:`VersionAdmin` lists, shows, deletes and exports
them (part of :class:`~livelora.gateway.services.tenants.store_admin.StoreAdmin`)."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any, Literal

from livelora.adapters.endpoints import EndpointStore
from livelora.adapters.store import (
    CONFIG_FILE,
    MANIFEST_FILE,
    WEIGHTS_FILE,
    AdapterStore,
    Manifest,
    parse_version_name,
    validate_lineage,
)
from livelora.clients.errors import BadRequestError, ConflictError, NotFoundError
from livelora.core.atomic import atomic_dir
from livelora.core.owners import OwnerStore

ExportFormat = Literal["peft", "merged", "gguf"]
EXPORT_FORMATS = ("peft", "merged", "gguf")
EXPORTS_DIR = "exports"


def version_rows(
    home: Path, versions: list[Manifest], targets: dict[str, list[str]], endpoints: list[str]
) -> list[dict[str, Any]]:
    """One lineage's versions as ``list_adapters`` rows: the manifest plus ``serving`` (endpoints serving it now),
    ``endpoints`` (bound to its lineage) and, for a training run's lineage, ``training_run`` (its model id) and
    ``checkpoints`` (the names that map to the version, ``sampler_weights/<name>``...; empty for an unnamed
    sampler save, deleted when its session ends)."""
    run: dict[str, Any] = {}
    if versions:
        with contextlib.suppress(FileNotFoundError, ValueError):  # the training run's checkpoint index
            run = json.loads((Path(home) / "sessions" / f"{versions[0].lineage}.json").read_text())
    named = run.get("checkpoints", {})
    return [
        {
            **m.model_dump(mode="json"),
            "serving": sorted(targets.get(m.name, [])),
            "endpoints": endpoints,
            "training_run": run.get("model_id"),
            "checkpoints": sorted(k for k, e in named.items() if e.get("version") == m.version),
        }
        for m in versions
    ]


class VersionAdmin:
    """The stored versions of the lineages ``tenant`` owns (by recorded owner, :mod:`livelora.core.owners`); any
    other version answers 404 exactly like a missing one.

    Args:
        home: ``LIVELORA_HOME``.
        tenant: the caller's tenant; ``None`` = every tenant (local store access).
        store, endpoints, owners: the store's parts, shared with the endpoint administration.
    """

    def __init__(
        self, home: Path, tenant: str | None, store: AdapterStore, endpoints: EndpointStore, owners: OwnerStore
    ):
        self.home, self.tenant = Path(home), tenant
        self.store, self.endpoints, self.owners = store, endpoints, owners

    def sees_lineage(self, lineage: str) -> bool:
        """Whether the caller's tenant owns ``lineage`` by its recorded owner (no record: nobody but local store
        access)."""
        return self.owners.owns("lineage", lineage, self.tenant)

    def manifest(self, name: str) -> Manifest:
        """The manifest of ``<lineage>@<n>`` if this tenant may see it.

        Raises:
            BadRequestError: malformed name. NotFoundError: missing or not visible.
        """
        lineage, n = parse_version_name(name)
        if not self.sees_lineage(lineage):
            raise NotFoundError(f"adapter version {name} does not exist", param="adapter")
        return self.store.get(lineage, n)

    def list_adapters(self, lineage: str | None = None) -> list[dict[str, Any]]:
        """Visible versions (oldest first per lineage), each with the endpoints serving it (:func:`version_rows`)."""
        lineages = [validate_lineage(lineage)] if lineage else self.store.lineages()
        if lineage and not self.sees_lineage(lineage):
            raise NotFoundError(f"adapter lineage {lineage!r} does not exist", param="lineage")
        targets, bound = self.endpoints.targets(self.store), {}
        for endpoint, binding in self.endpoints.bindings().items():
            bound.setdefault(binding.lineage, []).append(endpoint)
        rows = []
        for name in (n for n in lineages if self.sees_lineage(n)):
            rows += version_rows(self.home, self.store.list(name), targets, sorted(bound.get(name, [])))
        return rows

    def show_adapter(self, name: str) -> dict[str, Any]:
        """One version's manifest, files, integrity and serving endpoints. Raises: NotFoundError."""
        m = self.manifest(name)
        vdir = self.store.version_dir(m.lineage, m.version)
        files = {p.name: p.stat().st_size for p in sorted(vdir.iterdir()) if p.is_file()}
        return {
            **m.model_dump(mode="json"),
            "files": files,
            "verified": self.store.verify(m.lineage, m.version),
            "serving": sorted(self.endpoints.targets(self.store).get(m.name, [])),
        }

    def delete_adapter(self, name: str) -> None:
        """Delete a version unless an endpoint targets it.

        Raises:
            NotFoundError: missing or not visible. ConflictError: an endpoint serves it (409).
        """
        m = self.manifest(name)
        serving = self.endpoints.targets(self.store).get(m.name, [])
        if serving:
            raise ConflictError(
                f"{m.name} is the current target of endpoint(s) {', '.join(sorted(serving))}; "
                "promote another version there first",
                param="adapter",
                code="version_in_use",
            )
        self.store.delete(m.lineage, m.version)

    def export(self, name: str, fmt: ExportFormat = "peft", out: Path | str | None = None) -> Path:
        """Export a version as a PEFT adapter directory or a merged full model.

        Args:
            out: destination (must not exist); ``None`` = ``<home>/exports/<name>.<fmt>`` (reused if there).

        Returns:
            The directory written.

        Raises:
            NotFoundError: missing or not visible. BadRequestError: unknown format, bad weights.
            ConflictError: ``out`` exists.
        """
        if fmt not in EXPORT_FORMATS:
            raise BadRequestError(f"export format must be 'peft', 'merged' or 'gguf', not {fmt!r}", param="format")
        m = self.manifest(name)
        if out is None:
            dest = self.export_dir(name, fmt)
            if dest.is_dir():
                return dest
        else:
            dest = Path(out)
            if dest.exists():
                raise ConflictError(f"export destination {dest} already exists", param="out")
        if fmt == "merged":
            from livelora.adapters.export import export_merged
            from livelora.core.base_models import resolve_base_model

            return export_merged(self.store, m.lineage, m.version, resolve_base_model(m.base_model, self.home), dest)
        if fmt == "gguf":
            from livelora.adapters.gguf_export import export_gguf
            from livelora.core.base_models import resolve_base_model

            return export_gguf(self.store, m.lineage, m.version, resolve_base_model(m.base_model, self.home), dest)
        if not self.store.verify(m.lineage, m.version):
            raise BadRequestError(f"{m.name}: weights file does not match its sha256", param="adapter")
        from livelora.adapters.export import write_export_manifest

        vdir = self.store.version_dir(m.lineage, m.version)
        with atomic_dir(dest) as tmp:
            for f in (WEIGHTS_FILE, CONFIG_FILE):
                shutil.copy2(vdir / f, tmp / f)
            shutil.copy2(vdir / MANIFEST_FILE, tmp / "livelora_manifest.json")
            write_export_manifest(tmp, m, format="peft")
        return dest

    def export_dir(self, name: str, fmt: str) -> Path:
        """``<home>/exports/<lineage>@<n>.<fmt>`` (validated name)."""
        lineage, n = parse_version_name(name)
        if fmt not in EXPORT_FORMATS:
            raise BadRequestError(f"export format must be 'peft', 'merged' or 'gguf', not {fmt!r}", param="format")
        return self.home / EXPORTS_DIR / f"{lineage}@{n}.{fmt}"
