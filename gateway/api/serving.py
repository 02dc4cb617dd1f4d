"""Which weights serve a request, and how many sequences the gateway admits.

:func:`resolve_target` is the **one place** that maps the request's ``model``
field to the engine adapter and the version label reported to the client
(``system_fingerprint`` and the ``X-Livelora-Adapter-Version`` header). Today
it knows the base model and adapters loaded in the engine by name; the live
loop extends it to endpoints (an endpoint name → its current adapter version,
with a lease held for the request's lifetime).

:class:`Admission` bounds the sequences in the gateway: up to
``max_batch_size`` run in the engine batch and ``max_waiting`` more wait; a
request that would exceed that gets 429 with ``Retry-After`` (contract §1.4:
the SDK retries 429 and honours the header).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from livelora.clients.errors import BadRequestError, ModelNotFoundError, RateLimitError
from livelora.clients.types.openai import Model
from livelora.gateway.engines.base import Engine
from livelora.gateway.settings import GatewaySettings

#: Version label of the base model's weights.
BASE_VERSION = "base"
VERSION_HEADER = "X-Livelora-Adapter-Version"


@dataclass(frozen=True)
class ServingTarget:
    """Resolved ``model`` field.

    Attributes:
        model: the name the client passed (echoed in responses).
        adapter: engine adapter name, or ``None`` for the base model.
        version: version label of the serving weights (``"base"`` or the adapter version name).
        endpoint: the live-loop endpoint the model name resolved to (``None`` outside the registry).
    """

    model: str
    adapter: str | None
    version: str
    endpoint: str | None = None

    @property
    def fingerprint(self) -> str:
        """``system_fingerprint``: names the weights that produced the answer."""
        return f"livelora-{self.version}"

    @property
    def headers(self) -> dict[str, str]:
        return {VERSION_HEADER: self.version}


def resolve_target(model: str, engine: Engine, settings: GatewaySettings, registry=None) -> ServingTarget:
    """Map a request's ``model`` to the weights that serve it.

    With the live loop's :class:`~livelora.gateway.registry.AdapterRegistry`, an endpoint name resolves to
    its current version (lease it with :func:`livelora.gateway.live.hold_version` once admitted).

    Raises:
        ModelNotFoundError: no base model or loaded adapter has that name (404 ``model_not_found``).
    """
    if registry is not None:
        try:
            endpoint, adapter = registry.resolve(model)
        except ModelNotFoundError:
            if tenant_scoped():  # with API keys only the registry's (tenant-checked) names serve
                raise
        else:
            return ServingTarget(model, adapter, adapter or BASE_VERSION, endpoint)
    if model == settings.model_id:
        return ServingTarget(model, None, BASE_VERSION)
    if model in engine.loaded_adapters():
        return ServingTarget(model, model, model)
    known = ", ".join(m.id for m in list_models(engine, settings, registry))
    raise ModelNotFoundError(f"model {model!r} does not exist; served models: {known}", param="model")


def context_length(engine: Engine, settings: GatewaySettings) -> int:
    """Prompt + completion tokens allowed: the engine's window, capped by ``settings.inference.max_model_len``."""
    limit = int(engine.max_model_len)
    cap = settings.inference.max_model_len
    return min(limit, cap) if cap else limit


def tenant_scoped() -> bool:
    """Whether the current request comes with an API key (key mode): names are then tenant-checked."""
    from livelora.gateway.auth import current_principal

    principal = current_principal.get()
    return principal is not None and principal.key_id is not None


def list_models(engine: Engine, settings: GatewaySettings, registry=None) -> list[Model]:
    """The ``/v1/models`` entries: the base model, then the endpoints the caller may use (``owned_by`` =
    their tenant), then (open mode only) adapters loaded in the engine under their version names."""
    created = int(getattr(engine, "created", None) or _STARTED)
    base = settings.model_id
    out = [Model(id=base, created=created, owned_by="livelora", root=base)]
    seen = {base}
    if registry is not None:
        for endpoint in registry.endpoints():
            if endpoint in seen or not registry.visible(endpoint):
                continue
            seen.add(endpoint)
            tenant = getattr(registry.bindings.get(endpoint), "tenant", None)
            out.append(Model(id=endpoint, created=created, owned_by=tenant or "livelora", root=base, parent=base))
    if not tenant_scoped():
        out += [Model(id=name, created=created, owned_by="livelora", root=base, parent=base)
                for name in engine.loaded_adapters() if name not in seen]
    return out


_STARTED = time.time()


class Admission:
    """Counts sequences admitted by the gateway (running + waiting). Event-loop confined."""

    def __init__(self, settings: GatewaySettings):
        self.limit = settings.inference.max_sequences
        self.retry_after = settings.inference.retry_after_s
        self.active = 0

    def acquire(self, sequences: int, param: str = "n") -> Ticket:
        """Reserve ``sequences`` slots until the returned ticket is released.

        Raises:
            BadRequestError: one request asks for more sequences than the gateway ever admits.
            RateLimitError: not enough free slots now (429, ``Retry-After``).
        """
        if sequences > self.limit:
            raise BadRequestError(f"this request needs {sequences} sequences but the server admits at most "
                                  f"{self.limit} at once; lower {param}", param=param)
        if self.active + sequences > self.limit:
            raise RateLimitError(f"the server is busy ({self.active} of {self.limit} sequences queued or "
                                 "running); retry later", retry_after=self.retry_after)
        self.active += sequences
        return Ticket(self, sequences)


class Ticket:
    """Admitted slots; :meth:`release` is idempotent."""

    def __init__(self, admission: Admission, sequences: int):
        self._admission = admission
        self._sequences = sequences
        self._also: list = []

    def also_release(self, fn) -> None:
        """Call ``fn()`` when the ticket is released (e.g. an adapter-version lease)."""
        self._also.append(fn)

    def release(self) -> None:
        self._admission.active -= self._sequences
        self._sequences = 0
        also, self._also = self._also, []
        for fn in also:
            fn()
