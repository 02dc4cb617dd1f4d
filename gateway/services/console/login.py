"""Browser sessions of the admin console (``/console``): log-in with an API key, a signed session token in a
cookie, a CSRF token per session, log-out.

The cookie holds ``<payload>.<hmac>``: the payload names the key (its id, never the key), a random session id
and the expiry; the HMAC-SHA256 is under the store's ``console_secret`` (:func:`~livelora.core.store_secret.
store_secret`), so every gateway of an install accepts it. Each request re-reads the key: a revoked key, or one
that lost the ``admin`` role, ends its sessions at once. Log-out records the session id under
``<home>/console/ended/`` until it would have expired. Why a cookie and which flags: ``docs/console.md``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from livelora.clients.errors import AuthenticationError, PermissionDeniedError
from livelora.core.api_keys import OPEN_PRINCIPAL, KeyStore, Principal
from livelora.core.atomic import private_dir
from livelora.core.store_secret import store_secret

#: Name of the session cookie.
COOKIE = "livelora_console"
#: Lifetime of a console session (seconds): a working day.
SESSION_TTL_S = 8 * 3600
#: Form field and header that carry the CSRF token of a POST.
CSRF_FIELD, CSRF_HEADER = "csrf_token", "x-csrf-token"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class ConsoleLogins:
    """Issues and checks console session tokens.

    Args:
        home: ``LIVELORA_HOME`` (the secret, the ended sessions).
        keys: the API key store (re-read on every check).
        is_open: whether the gateway runs open (no keys): then a session without a key is valid.
        ttl_s: session lifetime in seconds.
    """

    def __init__(self, home: Path | str, keys: KeyStore, is_open: Callable[[], bool], ttl_s: int = SESSION_TTL_S):
        self.home, self.keys, self.is_open, self.ttl_s = Path(home), keys, is_open, ttl_s
        self.ended_dir = self.home / "console" / "ended"

    def _mac(self, purpose: str, payload: str) -> str:
        return hmac.new(
            store_secret(self.home, "console_secret"), f"{purpose}:{payload}".encode(), "sha256"
        ).hexdigest()

    # ------------------------------------------------------------------ log-in / log-out
    def log_in(self, key: str | None) -> tuple[str, Principal]:
        """A session token for ``key`` (in open mode: for the open caller, no key needed).

        Raises:
            AuthenticationError: a missing, unknown or revoked key (401).
            PermissionDeniedError: a valid key without the ``admin`` role (403).
        """
        if self.is_open():
            principal = OPEN_PRINCIPAL
        else:
            principal = self.keys.verify((key or "").strip() or None)
            if principal is None:
                raise AuthenticationError("invalid or revoked API key" if key else "enter an API key", param="key")
            if "admin" not in principal.roles:
                raise PermissionDeniedError(
                    f"this key (tenant {principal.tenant!r}, roles {', '.join(sorted(principal.roles))}) lacks the "
                    "'admin' role the console needs",
                    param="key",
                )
        payload = _b64(
            json.dumps(
                {"sid": secrets.token_hex(16), "kid": principal.key_id, "exp": int(time.time()) + self.ttl_s}
            ).encode()
        )
        return f"{payload}.{self._mac('session', payload)}", principal

    def log_out(self, token: str | None) -> None:
        """End the session of ``token`` on every gateway (a bad token: nothing to end); old records are pruned."""
        doc = self._payload(token)
        if doc is None:
            return
        private_dir(self.ended_dir)
        (self.ended_dir / doc["sid"]).write_text(str(doc["exp"]))
        now = time.time()
        for p in self.ended_dir.iterdir():
            if now - p.stat().st_mtime > self.ttl_s:
                p.unlink(missing_ok=True)

    # ------------------------------------------------------------------ checks
    def _payload(self, token: str | None) -> dict | None:
        """The signed, unexpired, not ended payload of ``token`` (``None`` otherwise)."""
        payload, _, mac = (token or "").partition(".")
        if not payload or not hmac.compare_digest(mac, self._mac("session", payload)):
            return None
        try:
            doc = json.loads(_unb64(payload))
        except ValueError:
            return None
        sid = str(doc.get("sid", ""))
        if not sid.isalnum() or time.time() > doc.get("exp", 0) or os.path.exists(self.ended_dir / sid):
            return None
        return doc

    def principal(self, token: str | None) -> Principal | None:
        """The caller of a valid session token: its key's principal as the key store says now (``None``: no,
        bad, expired or ended session, a revoked key, or an open-mode session once keys exist)."""
        doc = self._payload(token)
        if doc is None:
            return None
        if doc.get("kid") is None:
            return OPEN_PRINCIPAL if self.is_open() else None
        record = self.keys.all().get(doc["kid"])
        return record.principal() if record is not None and record.revoked is None else None

    def csrf_token(self, token: str) -> str:
        """The CSRF token of a session (derived from its signed token: nothing to store)."""
        return self._mac("csrf", hashlib.sha256(token.encode()).hexdigest())

    def check_csrf(self, token: str | None, given: str | None) -> None:
        """Raises PermissionDeniedError (403) unless ``given`` is the CSRF token of the session ``token``."""
        if not token or not given or not hmac.compare_digest(given, self.csrf_token(token)):
            raise PermissionDeniedError(
                "missing or wrong CSRF token: reload the console page and try again", param=CSRF_FIELD, code="csrf"
            )
