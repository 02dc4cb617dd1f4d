"""Per-tenant namespaces for the names a tenant creates: endpoint names and lineage names.

The rule is purely syntactic, so applying it reveals nothing about which names exist: ``<t>.<rest>``, where
``<t>`` is a valid tenant name, lies in tenant ``<t>``'s namespace, every other name in tenant ``default``'s,
and training-run lineages (``<session>-train-<n>``, :func:`is_training_lineage`) in none.
:func:`require_own_namespace` answers 400 for a name outside the caller's namespace, with a message that
depends only on the caller's tenant and the field. Why: ``docs/internals/tenancy.md``.

Example::

    namespace_of("acme.support")       # 'acme'
    namespace_of("Acme.support")       # 'default' ('Acme' is not a tenant name)
    require_own_namespace("bot", "acme", kind="endpoint", param="name")        # BadRequestError (400)
"""

from __future__ import annotations

import re

from livelora.clients.errors import BadRequestError
from livelora.core.api_keys import DEFAULT_TENANT, is_tenant_name

#: A training run's lineage: ``<32 hex session id>-train-<n>`` (a long ``n`` ends in an 8-hex digest instead).
_TRAINING_LINEAGE_RE = re.compile(r"[0-9a-f]{32}-train-[0-9]")


def is_training_lineage(name: str) -> bool:
    """Whether ``name`` has the form of a training run's lineage (``<session>-train-<n>``)."""
    return bool(_TRAINING_LINEAGE_RE.match(name))


def namespace_of(name: str) -> str:
    """The tenant whose namespace ``name`` lies in: ``<t>`` for ``<t>.<rest>`` with ``<t>`` a valid tenant name,
    else ``default``. (Training-run lineages are in no namespace; see :func:`is_training_lineage`.)"""
    head, dot, _ = name.partition(".")
    return head if dot and is_tenant_name(head) else DEFAULT_TENANT


def namespace_rule(tenant: str, kind: str) -> str:
    """The rule for ``tenant``'s new ``kind`` names (``endpoint`` or ``lineage``): the one message of the 400."""
    if tenant == DEFAULT_TENANT:
        rule = (
            f"tenant {DEFAULT_TENANT}'s {kind} names do not have the form '<tenant>.<rest>' (<tenant>: 1-64 "
            "characters of a-z, 0-9, '_', '-'): such a name lies in that tenant's namespace"
        )
    else:
        rule = (
            f"tenant {tenant}'s {kind} names start with '{tenant}.': a name '<tenant>.<rest>' lies in that "
            f"tenant's namespace, every other name in tenant {DEFAULT_TENANT}'s"
        )
    if kind == "lineage":
        rule += (
            "; training runs' lineages '<session>-train-<n>' lie in no namespace; an endpoint may also bind a "
            "lineage its tenant already owns"
        )
    return rule


def require_own_namespace(name: str, tenant: str, *, kind: str, param: str) -> str:
    """Return ``name`` if ``tenant`` may create it: it lies in ``tenant``'s namespace.

    Args:
        name: a valid endpoint or lineage name (validated before).
        tenant: the tenant that will own the new object.
        kind: ``endpoint`` or ``lineage`` (named in the message).
        param: the request field, for the error's ``param``.

    Raises:
        BadRequestError: another namespace's name, or (``lineage``) a training run's lineage form; one message per
            ``tenant`` and ``kind`` (:func:`namespace_rule`), never depending on the name, on whether it exists or
            on who holds it, code ``name_not_in_namespace``.
    """
    if (kind == "lineage" and is_training_lineage(name)) or namespace_of(name) != tenant:
        raise BadRequestError(namespace_rule(tenant, kind), param=param, code="name_not_in_namespace")
    return name
