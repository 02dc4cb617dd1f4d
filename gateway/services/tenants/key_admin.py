"""API keys administered by a tenant: :class:`KeyAdmin` creates, lists and revokes them (part of
:class:`~livelora.gateway.services.tenants.store_admin.StoreAdmin`); a key's hash is never shown."""

from __future__ import annotations

from pathlib import Path

from livelora.clients.errors import BadRequestError, PermissionDeniedError
from livelora.core.api_keys import DEFAULT_TENANT, KeyStore


class KeyAdmin:
    """The keys of ``tenant`` (``None``: every tenant, local store access).

    Args:
        home: ``LIVELORA_HOME``.
        tenant: the caller's tenant.
    """

    def __init__(self, home: Path | str, tenant: str | None):
        self.keys = KeyStore(home)
        self.tenant = tenant

    def create_key(self, roles: list[str], *, tenant: str | None = None, name: str = "") -> tuple[dict, str]:
        """A new key for the caller's tenant (local access: any ``tenant``). Returns ``(record, key)``."""
        if self.tenant is not None and tenant not in (None, self.tenant):
            raise BadRequestError(
                f"this admin key belongs to tenant {self.tenant}: it creates keys in that tenant "
                "only (a key of another tenant is made on the store: livelora keys create --home "
                "<store> --tenant <tenant>)",
                param="tenant",
            )
        if self.tenant is not None and "operator" in roles:
            raise PermissionDeniedError(
                "an operator key is created on the store only: livelora keys create "
                "--home <store> --roles admin,operator",
                param="roles",
            )
        record, key = self.keys.create(self.tenant or tenant or DEFAULT_TENANT, roles, name)
        return _key_info(record), key

    def list_keys(self) -> list[dict]:
        """The tenant's keys (hash never shown)."""
        return [
            _key_info(r)
            for r in sorted(self.keys.all().values(), key=lambda r: r.created)
            if self.tenant is None or r.tenant == self.tenant
        ]

    def revoke_key(self, key_id: str) -> dict:
        """Revoke a key. Raises: NotFoundError (missing or another tenant's)."""
        return _key_info(self.keys.revoke(key_id, tenant=self.tenant))


def _key_info(record) -> dict:
    return {
        "id": record.id,
        "name": record.name,
        "tenant": record.tenant,
        "roles": list(record.roles),
        "created": record.created,
        "revoked": record.revoked,
    }
