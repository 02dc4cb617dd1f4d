"""Endpoint bindings: which adapter lineage (and version) each served model name uses.

Stored at ``LIVELORA_HOME/endpoints.json`` (atomic writes under a file lock)::

    {"endpoints": {"<endpoint>": {"lineage": "<lineage>", "mode": "follow" | "pinned",
                                   "version": <n> | null}}}

* ``follow``: the endpoint serves the newest version of its lineage that passes
  the gateway's checks; the trainer writes new versions, the gateway moves.
* ``pinned``: the endpoint serves ``version`` until an operator changes it;
  feedback still trains the lineage, the gateway does not move.

An endpoint that is not in the file is *implicit*: a served model name whose
lineage is the same name (when that is a valid lineage name), mode ``follow``.
So the base model's served name learns from its own feedback with no
configuration; before the first version exists it serves the base model.

The file is the source of truth; Redis notices only make gateways move sooner.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from livelora.adapters.atomic import atomic_write_json, file_lock
from livelora.adapters.store import validate_lineage
from livelora.clients.errors import BadRequestError

ENDPOINTS_FILE = "endpoints.json"


class EndpointBinding(BaseModel):
    """One endpoint's binding."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lineage: str
    mode: Literal["follow", "pinned"] = "follow"
    version: int | None = Field(default=None, ge=1, description="Pinned version (mode 'pinned').")


def lineage_for_name(name: str) -> str:
    """The implicit lineage of an endpoint name: the name lower-cased, other characters than
    ``[a-z0-9._-]`` replaced by ``-`` (``SmolLM2/135M`` → ``smollm2-135m``).

    Raises:
        BadRequestError: nothing usable remains.
    """
    cleaned = "".join(c if (c.isascii() and (c.isalnum() or c in "._-")) else "-" for c in name.lower())
    cleaned = cleaned.strip("-._")[:64]
    return validate_lineage(cleaned)


class EndpointStore:
    """Read and change ``endpoints.json`` under ``home``."""

    def __init__(self, home: Path | str):
        self.path = Path(home) / ENDPOINTS_FILE

    def all(self) -> dict[str, EndpointBinding]:
        """Every explicit binding (empty when the file does not exist)."""
        if not self.path.is_file():
            return {}
        raw = json.loads(self.path.read_text())
        return {k: EndpointBinding.model_validate(v) for k, v in raw.get("endpoints", {}).items()}

    def get(self, endpoint: str) -> EndpointBinding:
        """The binding of ``endpoint``: explicit, else implicit (lineage from the name, mode follow)."""
        found = self.all().get(endpoint)
        return found if found is not None else EndpointBinding(lineage=lineage_for_name(endpoint))

    def set(self, endpoint: str, binding: EndpointBinding) -> None:
        """Create or replace an explicit binding (atomic, locked).

        Raises:
            BadRequestError: empty endpoint name, invalid lineage, or ``pinned`` without a version.
        """
        if not endpoint:
            raise BadRequestError("endpoint name must be non-empty", param="endpoint")
        validate_lineage(binding.lineage)
        if binding.mode == "pinned" and binding.version is None:
            raise BadRequestError("a pinned endpoint needs a version", param="version")
        with file_lock(self.path.with_suffix(".lock")):
            current = {k: v.model_dump() for k, v in self.all().items()}
            current[endpoint] = binding.model_dump()
            atomic_write_json(self.path, {"endpoints": current})
