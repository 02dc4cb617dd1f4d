"""Serving: which weights answer a request, and the one place where a served request begins.

* :func:`resolve_target` maps the request's ``model`` field to the engine adapter and the version label
  reported to the client (``system_fingerprint`` and the ``X-Livelora-Adapter-Version`` header): an endpoint
  name → its current adapter version (the live loop's :class:`~.registry.AdapterRegistry`), the base model's
  name, or (open mode) an adapter loaded in the engine under its version name.
* :meth:`Serving.begin` starts every generation the gateway serves (chat, legacy completions, Tinker
  sampling): resolve the target, run the caller's plan (its validation and the engine jobs), take the
  admission ticket (:mod:`.admission`), lease the version until the ticket is released, and make the
  completion-log recorder. It never awaits, so the leased version is the one that was resolved.
* :class:`ServedRequest` is what it returns: the target, the jobs, the ticket and the recorder, plus
  :meth:`ServedRequest.generate` to start the jobs in the engine batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from livelora.clients.errors import ModelNotFoundError
from livelora.clients.types.openai import Model
from livelora.core import metrics
from livelora.core.logs import annotate
from livelora.gateway.engines.base import Engine, TokenLogprob
from livelora.gateway.services.admission import Admission, Ticket
from livelora.gateway.services.completion_log import CompletionLog, CompletionRecorder
from livelora.gateway.services.drain import Drain
from livelora.gateway.services.generation import ChoiceStream, Job, new_id, now
from livelora.gateway.settings import GatewaySettings

if TYPE_CHECKING:
    from livelora.gateway.engines.base import GenerationChunk
    from livelora.gateway.services.registry import AdapterRegistry
    from livelora.gateway.services.usage import MeteringService

log = logging.getLogger(__name__)

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

    With the live loop's :class:`~livelora.gateway.services.registry.AdapterRegistry`, an endpoint name resolves to
    its current version (:meth:`Serving.begin` leases it once admitted).

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
        out += [
            Model(id=name, created=created, owned_by="livelora", root=base, parent=base)
            for name in engine.loaded_adapters()
            if name not in seen
        ]
    return out


_STARTED = time.time()


@dataclass(frozen=True)
class Recording:
    """Who asked for a served completion, as its completion-log records keep it.

    Attributes:
        caller: the tenant (key mode) or ``None`` (open mode).
        user: the request's OpenAI ``user`` field.
        messages: the chat prompt (``None`` for ``/v1/completions``).
    """

    caller: str | None = None
    user: str | None = None
    messages: list[dict] | None = None


@dataclass
class ServedRequest:
    """An admitted request (see :meth:`Serving.begin`); :meth:`release` gives its slots and lease back.

    Attributes:
        id: the response id (``chatcmpl-…``/``cmpl-…``; ``""`` when none was asked for).
        created: Unix time, seconds.
        target: the weights serving it.
        jobs: one engine generation per choice.
        ticket: its admission ticket (the version lease is released with it).
        engine: the engine that serves it.
        recorder: collects the choices for the completion log (``None``: not logged).
        drain: the gateway's drain state (``None``: never drained); a running request calls
            ``drain.check_running()`` between chunks.
        payer: ``(tenant, API key id)`` the request's tokens are metered for.
        metering: the gateway's token counters (``None``: not metered).
        kind: ``chat`` / ``completion`` / ``sample``: the label of its latency and token metrics.
    """

    id: str
    created: int
    target: ServingTarget
    jobs: list[Job]
    ticket: Ticket
    engine: Engine
    recorder: CompletionRecorder | None = field(default=None)
    drain: Drain | None = field(default=None)
    payer: tuple[str, str | None] = ("default", None)
    metering: MeteringService | None = field(default=None)
    kind: str = "chat"
    started: float = field(default_factory=time.monotonic)
    _last: dict[int, float] = field(default_factory=dict)
    _accounted: bool = False

    @property
    def headers(self) -> dict[str, str]:
        """Response headers naming the weights that answer."""
        return self.target.headers

    def generate(self) -> ChoiceStream:
        """Start every job in the engine batch (each once it holds a batch slot, :meth:`Ticket.run_slot`);
        chunks come out interleaved as ``(choice index, chunk)``."""
        return ChoiceStream(self.engine, self.jobs, self.target.adapter, self.id, gate=self.ticket.run_slot)

    async def score(self, token_ids: Sequence[int], top_logprobs: int = 0) -> list[TokenLogprob | None]:
        """Prompt logprobs of ``token_ids`` under the request's weights (:meth:`Engine.score`)."""
        return await self.engine.score(token_ids, self.target.adapter, top_logprobs=top_logprobs)

    def release(self) -> None:
        """Give the admission slots and the version lease back (idempotent)."""
        self.ticket.release()

    def observe(self, index: int, chunk: GenerationChunk) -> None:
        """Latency metrics of one engine chunk of choice ``index``: time to first token (first chunk of the
        request), inter-token latency (a chunk of k tokens counts its gap / k, k times), generated tokens."""
        n = len(chunk.token_ids)
        if not n:
            return
        t = time.monotonic()
        if not self._last:
            metrics.TTFT.labels(self.kind).observe(t - self.started)
        prev = self._last.get(index)
        if prev is not None:
            gap = (t - prev) / n
            for _ in range(n):
                metrics.INTER_TOKEN.labels(self.kind).observe(gap)
        self._last[index] = t
        metrics.GENERATED_TOKENS.labels(self.kind).inc(n)

    async def account(self, tokens: dict[str, int], subject: str | None = None) -> None:
        """Meter the request's ``tokens`` (``{kind: n}``, :data:`~livelora.core.metering.KINDS`) once for
        :attr:`payer` and ``subject`` (default: the endpoint, else the model name); later calls do nothing."""
        if self._accounted:
            return
        self._accounted = True
        if "prompt" in tokens:
            metrics.PROMPT_TOKENS.labels(self.kind).inc(tokens["prompt"])
        done = tokens.get("completion", tokens.get("sampled", 0))
        elapsed = time.monotonic() - self.started
        if done and elapsed > 0:
            metrics.TOKENS_PER_SECOND.labels(self.kind).observe(done / elapsed)
        log.info(
            "served %s %s: %s",
            self.kind,
            self.id or "-",
            tokens,
            extra={
                "completion_id": self.id or None,
                "tenant": self.payer[0],
                "version": self.target.version,
                "endpoint": subject or self.target.endpoint or self.target.model,
            },
        )
        if self.metering is not None:
            await self.metering.record(
                self.payer[0], self.payer[1], subject or self.target.endpoint or self.target.model, tokens
            )

    def account_later(self, tokens: dict[str, int], subject: str | None = None) -> None:
        """:meth:`account` from synchronous code (an aborted request): scheduled on the running loop."""
        if not self._accounted:
            task = asyncio.get_running_loop().create_task(self.account(tokens, subject))
            _PENDING.add(task)
            task.add_done_callback(_PENDING.discard)


_PENDING: set[asyncio.Task] = set()


class Serving:
    """The gateway's serving service: model names, the context window, and :meth:`begin`.

    Args:
        engine: the started engine.
        settings: the gateway settings.
        admission: the gateway's sequence bound.
        registry: the live loop's adapter registry (``None``: base model and loaded adapters only).
        completions: the completion log recorders write to (``None``: completions are not logged).
        drain: the gateway's drain state (``/health`` says ``draining``; requests end at its deadline).
        metering: the gateway's token counters (``None``: nothing is metered).
    """

    def __init__(
        self,
        engine: Engine,
        settings: GatewaySettings,
        admission: Admission,
        registry: AdapterRegistry | None = None,
        completions: CompletionLog | None = None,
        drain: Drain | None = None,
        metering: MeteringService | None = None,
    ):
        self.engine = engine
        self.settings = settings
        self.admission = admission
        self.registry = registry
        self.completions = completions
        self.drain = drain
        self.metering = metering

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer."""
        return self.engine.tokenizer

    def resolve(self, model: str) -> ServingTarget:
        """See :func:`resolve_target`. Raises: ModelNotFoundError (404)."""
        return resolve_target(model, self.engine, self.settings, self.registry)

    async def load_on_demand(self, model: str) -> None:
        """Load a stored ``<lineage>@<n>`` that ``model`` names and the caller may use, if it is not loaded
        (:meth:`~livelora.gateway.services.on_demand.OnDemandVersions.ensure`); call it before :meth:`begin`,
        with no ``await`` in between. Other names: nothing to do (:meth:`resolve` answers them).

        Raises:
            ModelNotFoundError: the caller's version was deleted (404). ConflictError: the gate rejected the version
            or it failed its load checks (409). RateLimitError: every version held on demand is in use (429).
        """
        if self.registry is not None:
            await self.registry.on_demand.ensure(model)

    def context_length(self) -> int:
        """See :func:`context_length` (tokens)."""
        return context_length(self.engine, self.settings)

    async def check_quota(self, kinds: tuple[str, ...]) -> None:
        """Refuse (429) a request of the current caller's tenant that would use ``kinds`` over a daily limit
        (:meth:`~livelora.gateway.services.limits.QuotaService.check_tokens`). Raises: RateLimitError."""
        if self.metering is not None:
            from livelora.gateway.services.usage import payer

            await self.metering.quotas.check_tokens(payer()[0], kinds)

    def list_models(self) -> list[Model]:
        """See :func:`list_models`."""
        return list_models(self.engine, self.settings, self.registry)

    def get_model(self, model_id: str) -> Model:
        """One ``/v1/models`` entry by id: a listed one, or a stored ``<lineage>@<n>`` the caller may name
        (not listed: :mod:`~livelora.gateway.services.on_demand` loads it when a request names it).

        Raises:
            ModelNotFoundError: unknown id (404 ``model_not_found``).
        """
        for model in self.list_models():
            if model.id == model_id:
                return model
        manifest = self.registry.on_demand.stored(model_id) if self.registry is not None else None
        if manifest is not None:  # a stored version the caller may name (loaded on demand)
            from livelora.gateway.auth import caller_tenant

            return Model(
                id=model_id,
                created=int(manifest.created),
                owned_by=caller_tenant(),
                root=self.settings.model_id,
                parent=self.settings.model_id,
            )
        raise ModelNotFoundError(f"model {model_id!r} does not exist", param="model")

    def health(self) -> dict[str, Any]:
        """``{"status": "ok"|"draining", "model", "engine", "sequences", "max_sequences", "adapters_loaded"}``.

        ``sequences`` counts sequences admitted by the gateway (running or waiting). ``/health`` needs no key, so
        this gives the number of loaded adapter versions, never their names (which name tenants' lineages).
        """
        status = "draining" if self.drain is not None and self.drain.draining else "ok"
        return {
            "status": status,
            "model": self.settings.model_id,
            "engine": self.settings.inference.engine,
            "sequences": self.admission.active,
            "max_sequences": self.admission.limit,
            "adapters_loaded": len(self.engine.loaded_adapters()),
        }

    def begin(
        self,
        model: str | ServingTarget,
        plan: Callable[[], Sequence[Job]],
        *,
        param: str = "n",
        id_prefix: str | None = None,
        recording: Recording | None = None,
        kind: str | None = None,
    ) -> ServedRequest:
        """Begin a served request: resolve ``model``, run ``plan``, admit its jobs, lease the version, make
        the recorder. Synchronous (no ``await``), so the version leased is the one resolved.

        Args:
            model: the request's ``model`` field, or an already known target (a sampling session's weights).
            plan: the request's validation and engine jobs (one per choice); it runs after the target is
                resolved, so an unknown model is reported before bad parameters.
            param: the field named when the request asks for more sequences than the gateway admits.
            id_prefix: ``chatcmpl`` / ``cmpl``: a new response id ``<prefix>-<32 hex>`` (``None``: no id).
            recording: log the choices in the completion log on behalf of this caller (``None``: not logged).
            kind: metrics label (default: ``chat`` for ``chatcmpl`` ids, ``completion`` for ``cmpl``, else
                ``sample``).

        Raises:
            ModelNotFoundError: unknown ``model`` (404).
            LiveloraError: whatever ``plan`` raises (400s).
            BadRequestError: more sequences than the gateway ever admits. RateLimitError: busy now (429).
        """
        target = model if isinstance(model, ServingTarget) else self.resolve(model)
        jobs = list(plan())
        ticket = self.admission.acquire(len(jobs), param=param, tokens=sum(j.params.max_tokens for j in jobs))
        if self.registry is not None and target.endpoint is not None and target.adapter is not None:
            ticket.also_release(self.registry.hold(target.endpoint, target.adapter).release)
        request_id = new_id(id_prefix) if id_prefix else ""
        created = now()
        recorder = None
        if recording is not None:
            recorder = CompletionRecorder(
                self.completions,
                completion_id=request_id,
                created=created,
                target=target,
                n=len(jobs),
                caller=recording.caller,
                user=recording.user,
                messages=recording.messages,
                choice_prompts=[(list(job.prompt_ids), job.prompt_text) for job in jobs],
            )
        from livelora.gateway.services.usage import payer

        kind = kind or {"chatcmpl": "chat", "cmpl": "completion"}.get(id_prefix or "", "sample")
        tenant_key = payer()
        annotate(
            completion_id=request_id or None,
            tenant=tenant_key[0],
            endpoint=target.endpoint or target.model,
            version=target.version,
        )
        return ServedRequest(
            request_id,
            created,
            target,
            jobs,
            ticket,
            self.engine,
            recorder,
            self.drain,
            payer=tenant_key,
            metering=self.metering,
            kind=kind,
        )
