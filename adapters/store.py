"""The adapter store: lineages of immutable, numbered LoRA adapter versions.

:class:`AdapterStore` writes, lists, reads and deletes versions under ``LIVELORA_HOME/adapters/<lineage>/<n>/``
(PEFT weights with standard keys, ``adapter_config.json``, a :class:`Manifest`, optionally the AdamW state);
:func:`parse_version_name` reads ``<lineage>@<n>``. A version is built in a hidden sibling and renamed into
place, and its number is allocated under the lineage's lock before the write, so a crashed save burns its
number: a name, its path and its vLLM ``lora_int_id`` (= n) are never reused for other weights. The layout in
full: ``docs/internals/store-layout.md``.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from livelora.clients.errors import BadRequestError, ConflictError, InternalError, NotFoundError
from livelora.core.atomic import atomic_dir, atomic_write_json, file_lock, private_dir

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
MANIFEST_FILE = "manifest.json"
OPTIMIZER_FILE = "optimizer.pt"
TRAINER_STATE_FILE = "trainer_state.json"

_LINEAGE_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


class Manifest(BaseModel):
    """What a version is: written once into ``manifest.json``, never changed."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    lineage: str
    version: int = Field(ge=1)
    name: str = Field(description="``<lineage>@<version>``: the engine-facing adapter name.")
    base_model: str = Field(description="Base-model name the adapter was trained on.")
    parent: int | None = Field(default=None, description="Version this one was trained from, if any.")
    step: int = Field(default=0, ge=0, description="Optimizer steps taken when saved.")
    created: float = Field(description="Unix time (seconds).")
    sha256: str = Field(description="sha256 of adapter_model.safetensors (hex).")
    metrics: dict[str, float] = Field(default_factory=dict)
    data_counts: dict[str, int] = Field(default_factory=dict, description="Examples/tokens trained on, by kind.")
    has_optimizer: bool = False
    rank: int | None = None
    alpha: float | None = None
    gate: dict[str, Any] | None = Field(
        default=None,
        description="The evaluation gate's result (:class:`livelora.core.rails.GateResult`); null: not evaluated.",
    )


def validate_lineage(name: str) -> str:
    """Return ``name`` if it is a valid lineage name (``[a-z0-9][a-z0-9._-]{0,63}``, not ``.``-only).

    Raises:
        BadRequestError: anything else (including path-traversal attempts such as ``..`` or ``a/b``).
    """
    if not isinstance(name, str) or not _LINEAGE_RE.fullmatch(name) or set(name) <= {"."}:
        raise BadRequestError(
            f"invalid adapter lineage name {name!r}: use 1-64 characters of a-z, 0-9, '.', '_', '-', "
            "starting with a letter or digit",
            param="lineage",
        )
    return name


_VERSION_RE = re.compile(r"[1-9][0-9]{0,17}")


def parse_version_name(name: str) -> tuple[str, int]:
    """Split ``<lineage>@<n>`` into ``(lineage, n)``.

    Raises:
        BadRequestError: malformed name.
    """
    lineage, sep, num = name.rpartition("@")
    if not sep or not _VERSION_RE.fullmatch(num):  # one spelling per version: no leading zeros, ASCII digits only
        raise BadRequestError(
            f"invalid adapter version name {name!r}: expected '<lineage>@<n>' with n >= 1 "
            "written without leading zeros",
            param="adapter",
        )
    return validate_lineage(lineage), int(num)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class AdapterStore:
    """Lineages and immutable versions under ``<home>/adapters`` (layout: docs/internals/store-layout.md).

    Args:
        home: ``LIVELORA_HOME``.
    """

    def __init__(self, home: Path | str):
        self.home = Path(home)
        self.root = self.home / "adapters"

    # -- paths ---------------------------------------------------------------------------------------------
    def lineage_dir(self, lineage: str) -> Path:
        """Directory of a lineage (validated name)."""
        return self.root / validate_lineage(lineage)

    def version_dir(self, lineage: str, version: int) -> Path:
        """Directory of version ``version`` (it may not exist)."""
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise BadRequestError(f"invalid adapter version {version!r}: must be an integer >= 1", param="version")
        return self.lineage_dir(lineage) / str(version)

    # -- writing -------------------------------------------------------------------------------------------
    def allocate_version(self, lineage: str) -> int:
        """Reserve the next version number of ``lineage`` (never reused, even if the save then fails)."""
        ldir = self.lineage_dir(lineage)
        private_dir(ldir)
        with file_lock(ldir / ".lock"):
            counter = ldir / ".next"
            n = json.loads(counter.read_text()) if counter.is_file() else 1
            existing = [int(p.name) for p in ldir.iterdir() if p.name.isdigit()]
            n = max([n, *(v + 1 for v in existing)])
            atomic_write_json(counter, n + 1)
        return n

    def write_version(
        self,
        lineage: str,
        write: Callable[[Path], None],
        *,
        base_model: str,
        parent: int | None = None,
        step: int = 0,
        metrics: dict[str, float] | None = None,
        data_counts: dict[str, int] | None = None,
        rank: int | None = None,
        alpha: float | None = None,
        gate: dict[str, Any] | None = None,
    ) -> Manifest:
        """Create a new version: allocate its number, let ``write(tmp_dir)`` fill a temporary directory with
        ``adapter_model.safetensors`` + ``adapter_config.json`` (+ optionally ``optimizer.pt`` and
        ``trainer_state.json``), add the manifest and rename it into place atomically.

        Returns:
            The new version's manifest.

        Raises:
            BadRequestError: invalid lineage name.
            InternalError: ``write`` did not produce the weights or config file.
            Any exception from ``write`` propagates; nothing becomes visible and the number is burnt.
        """
        version = self.allocate_version(lineage)
        final = self.version_dir(lineage, version)
        with atomic_dir(final) as tmp:
            write(tmp)
            for required in (WEIGHTS_FILE, CONFIG_FILE):
                if not (tmp / required).is_file():
                    raise InternalError(f"adapter save wrote no {required}")
            has_opt = (tmp / OPTIMIZER_FILE).is_file()
            manifest = Manifest(
                lineage=lineage,
                version=version,
                name=f"{lineage}@{version}",
                base_model=base_model,
                parent=parent,
                step=step,
                created=time.time(),
                sha256=sha256_file(tmp / WEIGHTS_FILE),
                metrics=dict(metrics or {}),
                data_counts=dict(data_counts or {}),
                has_optimizer=has_opt,
                rank=rank,
                alpha=alpha,
                gate=gate,
            )
            (tmp / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2))
        return manifest

    # -- reading -------------------------------------------------------------------------------------------
    def lineages(self) -> list[str]:
        """Names of lineages with at least one directory entry, sorted."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and _LINEAGE_RE.fullmatch(p.name))

    def list(self, lineage: str) -> list[Manifest]:
        """Visible versions of ``lineage``, oldest first (empty if the lineage does not exist)."""
        return [self.get(lineage, n) for n in self.version_numbers(lineage)]

    def version_numbers(self, lineage: str) -> builtins.list[int]:  # `list` here is the method above
        """Numbers of the visible versions of ``lineage``, ascending, without reading their manifests."""
        ldir = self.lineage_dir(lineage)
        if not ldir.is_dir():
            return []
        return sorted(int(p.name) for p in ldir.iterdir() if p.name.isdigit() and (p / MANIFEST_FILE).is_file())

    def get(self, lineage: str, version: int) -> Manifest:
        """The manifest of one version.

        Raises:
            NotFoundError: no such version.
        """
        path = self.version_dir(lineage, version) / MANIFEST_FILE
        if not path.is_file():
            raise NotFoundError(f"adapter version {lineage}@{version} does not exist", param="adapter")
        return Manifest.model_validate_json(path.read_text())

    def resolve(self, name: str) -> Manifest:
        """Manifest of ``<lineage>@<n>`` or, for a bare ``<lineage>``, of its latest version."""
        if "@" in name:
            return self.get(*parse_version_name(name))
        return self.latest(name)

    def latest(self, lineage: str) -> Manifest:
        """The highest visible version.

        Raises:
            NotFoundError: the lineage has no versions.
        """
        versions = self.list(lineage)
        if not versions:
            raise NotFoundError(f"adapter lineage {lineage!r} has no versions", param="adapter")
        return versions[-1]

    def was_allocated(self, lineage: str, version: int) -> bool:
        """Whether number ``version`` of ``lineage`` was ever handed out (``.next`` is past it). A number that
        was handed out but is not visible (:meth:`get` raises) belonged to a version that was deleted, or whose
        save never completed; numbers are never reused."""
        counter = self.lineage_dir(lineage) / ".next"
        try:
            return 1 <= version < int(json.loads(counter.read_text()))
        except (OSError, ValueError, TypeError):
            return False

    def verify(self, lineage: str, version: int) -> bool:
        """True if the weights file's sha256 equals the manifest's."""
        manifest = self.get(lineage, version)
        weights = self.version_dir(lineage, version) / WEIGHTS_FILE
        return weights.is_file() and sha256_file(weights) == manifest.sha256

    def load_trainer_state(self, lineage: str, version: int) -> dict[str, Any]:
        """``trainer_state.json`` of a version (``{}`` if absent)."""
        path = self.version_dir(lineage, version) / TRAINER_STATE_FILE
        self.get(lineage, version)
        return json.loads(path.read_text()) if path.is_file() else {}

    def load_optimizer(self, lineage: str, version: int) -> dict[str, Any]:
        """The saved optimizer state dict, read with ``torch.load(weights_only=True)``.

        Raises:
            NotFoundError: the version has no optimizer state.
        """
        import torch

        manifest = self.get(lineage, version)
        path = self.version_dir(lineage, version) / OPTIMIZER_FILE
        if not manifest.has_optimizer or not path.is_file():
            raise NotFoundError(f"adapter version {manifest.name} was saved without optimizer state", param="adapter")
        return torch.load(path, map_location="cpu", weights_only=True)

    # -- deleting ------------------------------------------------------------------------------------------
    def delete(self, lineage: str, version: int) -> None:
        """Remove a version (its number is not reused). The directory is first renamed to a hidden name so
        readers never see a half-deleted version.

        Raises:
            NotFoundError: no such version.
            ConflictError: the version could not be moved aside.
        """
        self.get(lineage, version)
        vdir = self.version_dir(lineage, version)
        trash = vdir.parent / f".{version}.deleted.{time.time_ns()}"
        try:
            vdir.rename(trash)
        except OSError as exc:
            raise ConflictError(f"cannot delete {lineage}@{version}: {exc}") from exc
        shutil.rmtree(trash, ignore_errors=True)
