"""``null`` for an optional field means "not given", in every request schema.

OpenAI's SDKs and many clients send ``"n": null``, ``"temperature": null``, ... for parameters the user left
unset (``Optional[...] = None`` in Python), and OpenAI reads them as absent. A pydantic field declared
``n: int = 1`` would refuse that ``null``; a field declared ``int | None = 1`` would keep ``None`` where the
code expects the default. :class:`NullMeansOmitted`, the base of every request model (OpenAI routes, signal
routes, admin routes, Tinker bodies), removes each key whose value is ``null`` when its field is optional
(has a default) before validation, so the default applies. A ``null`` for a *required* field stays an error.

Every request model inherits the rule, so a field added later is covered (``tests/test_request_nulls.py``
generates its cases from the schemas).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, model_validator

_OPTIONAL: dict[type, frozenset[str]] = {}


def optional_keys(model: type[BaseModel]) -> frozenset[str]:
    """The body keys (field names and string aliases) of ``model``'s optional fields (those with a default)."""
    keys = _OPTIONAL.get(model)
    if keys is None:
        names: set[str] = set()
        for name, info in model.model_fields.items():
            if info.is_required():
                continue
            names.add(name)
            for alias in (info.alias, info.validation_alias):
                if isinstance(alias, str):
                    names.add(alias)
        keys = _OPTIONAL[model] = frozenset(names)
    return keys


class NullMeansOmitted(BaseModel):
    """Base of request models: an explicit ``null`` for an optional field is the same as leaving it out."""

    @model_validator(mode="before")
    @classmethod
    def _null_means_omitted(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        optional = optional_keys(cls)
        if not any(value is None and key in optional for key, value in data.items()):
            return data
        return {key: value for key, value in data.items() if not (value is None and key in optional)}
