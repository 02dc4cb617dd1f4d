"""Serving: which weights answer a request, and where every served request begins.

* :func:`resolve_target` maps a request's ``model`` to the engine adapter and the version label reported to the
  client (``system_fingerprint``, the ``X-Livelora-Adapter-Version`` header): an endpoint → its current version
  (:class:`~.registry.AdapterRegistry`), the base model's name, or (open mode) an adapter loaded under its name.
* :meth:`Serving.serve` is the one call of the chat and legacy completion routes (and of the Messages API, as the
  chat it asks for: :meth:`Serving.serve_messages`): load a stored version or sampler checkpoint the request names
  (:mod:`.checkpoint_names`), resolve it, plan the jobs (:mod:`.plans`), admit them, check the tenant's quota,
  score an echoed prompt and start the choices; the :class:`~.served.ServedRequest` it returns records and meters
  them as they run.
* :meth:`Serving.begin` (also under :meth:`serve`; Tinker samples call it directly) admits the jobs, leases the
  version until the ticket is released and makes the completion-log recorder. It never awaits, so the leased
  version is the one that was resolved.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from livelora.clients.errors import ModelNotFoundError
from livelora.clients.types.anthropic import CountTokensRequest, MessagesRequest
from livelora.clients.types.openai import ChatCompletionRequest, CompletionRequest, Model
from livelora.core.api_keys import DEFAULT_TENANT, Principal
from livelora.core.base_models import HUB_IDS
from livelora.core.logs import annotate
from livelora.gateway.engines.base import Engine
from livelora.gateway.middleware.drain import Drain
from livelora.gateway.services.live.completion_log import CompletionLog, CompletionRecorder
from livelora.gateway.services.serving.admission import Admission
from livelora.gateway.services.serving.checkpoint_names import checkpoint_version
from livelora.gateway.services.serving.generation import KINDS, Job, new_id, now
from livelora.gateway.services.serving.messages import chat_messages, chat_request
from livelora.gateway.services.serving.plans import (
    check_chat,
    check_completion,
    plan_chat,
    plan_completion,
    prompt_token_ids,
)
from livelora.gateway.services.serving.prompt_limits import chat_prompt, check_prompt_size, completion_prompts, off_loop
from livelora.gateway.services.serving.sampling_defaults import for_settings
from livelora.gateway.services.serving.served import ServedRequest
from livelora.gateway.services.serving.token_texts import TokenTexts
from livelora.gateway.services.tenants.usage import payer
from livelora.gateway.settings import GatewaySettings

if TYPE_CHECKING:
    from livelora.gateway.services.live.registry import AdapterRegistry
    from livelora.gateway.services.tenants.usage import MeteringService

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


def resolve_target(
    model: str, engine: Engine, settings: GatewaySettings, registry=None, principal: Principal | None = None
) -> ServingTarget:
    """Map the ``model`` of a request of ``principal`` (``None``: outside requests) to the weights that serve it.

    With the live loop's :class:`~livelora.gateway.services.live.registry.AdapterRegistry`, an endpoint name resolves to
    its current version (:meth:`Serving.begin` leases it once admitted).

    Raises:
        ModelNotFoundError: no base model or loaded adapter has that name (404 ``model_not_found``).
    """
    if registry is not None:
        try:
            endpoint, adapter = registry.resolve(model, principal)
        except ModelNotFoundError:
            if tenant_scoped(principal):  # with API keys only the registry's (tenant-checked) names serve
                raise
        else:
            return ServingTarget(model, adapter, adapter or BASE_VERSION, endpoint)
    if model == settings.model_id:
        return ServingTarget(model, None, BASE_VERSION)
    if model in engine.loaded_adapters():
        return ServingTarget(model, model, model)
    known = ", ".join(m.id for m in list_models(engine, settings, registry, principal))
    raise ModelNotFoundError(f"model {model!r} does not exist; served models: {known}", param="model")


def context_length(engine: Engine, settings: GatewaySettings) -> int:
    """Prompt + completion tokens allowed: the engine's window, capped by ``settings.inference.max_model_len``."""
    limit = int(engine.max_model_len)
    cap = settings.inference.max_model_len
    return min(limit, cap) if cap else limit


def tenant_scoped(principal: Principal | None) -> bool:
    """Whether ``principal`` comes with an API key (key mode): names are then tenant-checked."""
    return principal is not None and principal.key_id is not None


def list_models(
    engine: Engine, settings: GatewaySettings, registry=None, principal: Principal | None = None
) -> list[Model]:
    """The ``/v1/models`` entries: the base model, then the endpoints ``principal`` may use (``owned_by`` =
    their tenant), then (open mode only) adapters loaded in the engine under their version names."""
    created = int(getattr(engine, "created", None) or _STARTED)
    base = settings.model_id
    out = [Model(id=base, created=created, owned_by="livelora", root=base)]
    seen = {base}
    if registry is not None:
        for endpoint in registry.endpoints():
            if endpoint in seen or not registry.visible(endpoint, principal):
                continue
            seen.add(endpoint)
            tenant = getattr(registry.bindings.get(endpoint), "tenant", None)
            out.append(Model(id=endpoint, created=created, owned_by=tenant or "livelora", root=base, parent=base))
    if not tenant_scoped(principal):
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


class Serving:
    """The gateway's serving service: model names, the context window, :meth:`serve` and :meth:`begin`.

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
        self.texts = TokenTexts(engine.tokenizer)
        #: the base model's names a ``<base>;<checkpoint path>`` model may give, the served name first
        names = (settings.model_id, settings.model, HUB_IDS.get(settings.model))
        self.base_names: list[str] = [n for n in dict.fromkeys(names) if n]

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer."""
        return self.engine.tokenizer

    def resolve(self, model: str, principal: Principal | None) -> ServingTarget:
        """See :func:`resolve_target`. Raises: ModelNotFoundError (404)."""
        return resolve_target(model, self.engine, self.settings, self.registry, principal)

    def checkpoint_version(self, model: str, principal: Principal | None) -> str | None:
        """The stored version a sampler checkpoint path ``model`` names (``None``: not a path); see
        :func:`~.checkpoint_names.checkpoint_version`. Raises: BadRequestError (400), ModelNotFoundError (404)."""
        may_use = self.registry.on_demand.may_use if self.registry is not None else (lambda _l, _p: False)
        return checkpoint_version(
            model, principal, home=self.settings.home, base_names=self.base_names, may_use=may_use
        )

    async def target(self, model: str, principal: Principal | None, user: str | None = None) -> ServingTarget:
        """The weights serving a request of ``principal`` (OpenAI ``user``: ``user``) naming ``model``: a sampler
        checkpoint path's stored version, a stored ``<lineage>@<n>`` (loaded on demand), an endpoint (or the segment
        of it the request belongs to: :mod:`~livelora.gateway.services.live.segments`), the base model; ``model`` as
        asked.

        Raises:
            ModelNotFoundError (404), BadRequestError (400): see :meth:`checkpoint_version`, :meth:`resolve`.
            ConflictError, RateLimitError: see :meth:`load_on_demand`.
        """
        name = self.checkpoint_version(model, principal) or model
        await self.load_on_demand(name, principal)  # then no await until begin
        target = self.resolve(name, principal)
        if self.registry is not None and target.endpoint == name:  # an endpoint named: its segments may apply
            endpoint, adapter = self.registry.segments.route(name, target.adapter, principal, user)
            target = replace(target, endpoint=endpoint, adapter=adapter, version=adapter or BASE_VERSION)
        return target if name == model else replace(target, model=model)

    async def load_on_demand(self, model: str, principal: Principal | None) -> None:
        """Load a stored ``<lineage>@<n>`` that ``model`` names and ``principal`` may use, if it is not loaded
        (:meth:`~livelora.gateway.services.live.on_demand.OnDemandVersions.ensure`); call it before :meth:`begin`,
        with no ``await`` in between. Other names: nothing to do (:meth:`resolve` answers them).

        Raises:
            ModelNotFoundError: the caller's version was deleted (404). ConflictError: the gate rejected the version
            or it failed its load checks (409). RateLimitError: every version held on demand is in use (429).
        """
        if self.registry is not None:
            await self.registry.on_demand.ensure(model, principal)

    def context_length(self) -> int:
        """See :func:`context_length` (tokens)."""
        return context_length(self.engine, self.settings)

    async def check_quota(self, kinds: tuple[str, ...], principal: Principal | None) -> None:
        """Refuse (429) a request of ``principal``'s tenant that would use ``kinds`` over a daily limit
        (:meth:`~livelora.gateway.services.tenants.limits.QuotaService.check_tokens`). Raises: RateLimitError."""
        if self.metering is not None:
            await self.metering.quotas.check_tokens(payer(principal)[0], kinds)

    def list_models(self, principal: Principal | None) -> list[Model]:
        """See :func:`list_models`."""
        return list_models(self.engine, self.settings, self.registry, principal)

    def get_model(self, model_id: str, principal: Principal | None) -> Model:
        """One ``/v1/models`` entry by id: a listed one, or a stored ``<lineage>@<n>`` or sampler checkpoint path
        ``principal`` may name (not listed: :mod:`~livelora.gateway.services.live.on_demand` loads it when a request
        names it).

        Raises:
            ModelNotFoundError: unknown id (404 ``model_not_found``). BadRequestError: see
                :meth:`checkpoint_version` (400).
        """
        for model in self.list_models(principal):
            if model.id == model_id:
                return model
        name = self.checkpoint_version(model_id, principal) or model_id
        manifest = self.registry.on_demand.stored(name, principal) if self.registry is not None else None
        if manifest is not None:  # a stored version the caller may name (loaded on demand)
            return Model(
                id=model_id,
                created=int(manifest.created),
                owned_by=principal.tenant if principal is not None else DEFAULT_TENANT,
                root=self.settings.model_id,
                parent=self.settings.model_id,
            )
        raise ModelNotFoundError(f"model {model_id!r} does not exist", param="model")

    def health(self) -> dict[str, Any]:
        """``{"status": "ok"|"draining"|"unhealthy", "model", "engine", "sequences", "max_sequences",
        "adapters_loaded"}`` (and ``error``, the engine's :attr:`~livelora.gateway.engines.base.Engine.failure`, when
        unhealthy).

        ``sequences`` counts sequences admitted by the gateway (running or waiting). ``/health`` needs no key, so
        this gives the number of loaded adapter versions, never their names (which name tenants' lineages).
        """
        status = "draining" if self.drain is not None and self.drain.draining else "ok"
        failure = getattr(self.engine, "failure", None)
        figures = {
            "status": "unhealthy" if failure else status,
            "model": self.settings.model_id,
            "engine": self.settings.inference.engine,
            "sequences": self.admission.active,
            "max_sequences": self.admission.limit,
            "adapters_loaded": len(self.engine.loaded_adapters()),
        }
        if failure:
            figures["error"] = failure
        return figures

    async def serve(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        principal: Principal | None,
        *,
        caller: str | None,
        id_prefix: str | None = None,
    ) -> ServedRequest:
        """Serve a chat (``chatcmpl-…``; ``id_prefix`` another id form, :data:`~.generation.KINDS`) or legacy
        completion (``cmpl-…``) request of ``principal``: the choices run in the engine batch and are recorded (for
        ``caller``, the tenant in key mode) and metered as the returned request is iterated.

        Raises:
            ModelNotFoundError: unknown ``model`` (404). ConflictError, RateLimitError: see :meth:`load_on_demand`.
            BadRequestError, UnsupportedParameterError, ContextLengthExceededError: see :mod:`.plans`,
                :meth:`checkpoint_version` (400).
            RateLimitError: the gateway is busy or the tenant is over a daily token limit (429).
        """
        chat = isinstance(body, ChatCompletionRequest)
        target = await self.target(body.model, principal, body.user)  # unknown model: before bad parameters
        body = for_settings(self.settings).apply(body)  # omitted sampling fields: the model's generation_config
        who = payer(principal)
        ignore = self.settings.inference.unknown_fields == "ignore"
        if chat:  # cheap limits first, then the template off the event loop
            ignored = check_chat(body, ignore)
            prompt, cap = await chat_prompt(body, self, who)
            plan = plan_chat(body, self.tokenizer, self.context_length(), prompt, cap)
            messages = [m.model_dump(mode="json", exclude_none=True) for m in body.messages]
        else:
            ignored = check_completion(body, ignore)
            prompts, cap = await completion_prompts(body, self, prompt_token_ids, who)
            plan = plan_completion(body, self.tokenizer, self.context_length(), self.texts, prompts, cap)
            messages = None
        served = self.begin(
            target,
            plan.jobs,
            id_prefix=id_prefix or ("chatcmpl" if chat else "cmpl"),
            recording=Recording(caller=caller, user=body.user, messages=messages) if plan.generate else None,
            principal=principal,
            per_prompt=plan.per_prompt,
        )
        served.ignored = tuple(ignored)
        try:
            await self.check_quota(("prompt", "completion"), principal)  # over a daily token limit: 429, nothing runs
            if plan.score_prompts is not None:
                served.prompt_logprobs = [await served.score(ids, plan.score_prompts) for ids in served.prompts]
            if plan.generate:
                served.start()
        except BaseException:
            served.release()
            raise
        return served

    async def serve_messages(
        self, body: MessagesRequest, principal: Principal | None, *, caller: str | None
    ) -> ServedRequest:
        """Serve an Anthropic Messages request (``msg_…``) as the chat it asks for (:func:`.messages.chat_request`).

        Raises:
            UnsupportedParameterError, BadRequestError: what cannot be honoured (:mod:`.messages`); else as
                :meth:`serve`.
        """
        return await self.serve(chat_request(body), principal, caller=caller, id_prefix="msg")

    async def count_message_tokens(self, body: CountTokensRequest, principal: Principal | None) -> int:
        """The prompt tokens a Messages request with these messages would have (chat template included).

        Raises:
            ModelNotFoundError (404), BadRequestError (400): see :meth:`get_model`; what :mod:`.messages` refuses.
            ContextLengthExceededError: messages that cannot fit the context window, from their size alone.
        """
        from livelora.gateway.chat_template import message_text, render_messages

        self.get_model(body.model, principal)
        messages = chat_messages(body)
        texts = (message_text(m, i) for i, m in enumerate(messages))
        await check_prompt_size(self.tokenizer, texts, self.context_length(), None)  # cheap bound first
        return len(await off_loop(render_messages, self.tokenizer, messages))

    def begin(
        self,
        target: ServingTarget,
        jobs: Sequence[Job],
        *,
        param: str = "n",
        id_prefix: str | None = None,
        recording: Recording | None = None,
        kind: str | None = None,
        principal: Principal | None,
        per_prompt: int = 1,
    ) -> ServedRequest:
        """Begin a served request on ``target``: admit its ``jobs``, lease the version, make the recorder.
        Synchronous (no ``await``), so the version leased is the one resolved.

        Args:
            target: the weights (:meth:`resolve`, or a sampling session's).
            jobs: the engine jobs, one per choice (``per_prompt`` consecutive ones per prompt).
            param: the field named when the request asks for more sequences than the gateway admits.
            id_prefix: ``chatcmpl`` / ``cmpl`` / ``msg``: a new response id (:func:`~.generation.new_id`; ``None``:
                no id).
            recording: log the choices in the completion log on behalf of this caller (``None``: not logged).
            kind: metrics label (default: :data:`~.generation.KINDS` of ``id_prefix``, else ``sample``).
            principal: who asks; its tenant and key pay for the tokens.

        Raises:
            BadRequestError: more sequences than the gateway ever admits. RateLimitError: busy now (429).
        """
        jobs = list(jobs)
        tokens = sum(j.params.max_tokens for j in jobs)
        ticket = self.admission.acquire(len(jobs), payer(principal), param=param, tokens=tokens)
        if self.registry is not None and target.endpoint is not None:  # the base model too: its requests count
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
        kind = kind or KINDS.get(id_prefix or "", "sample")
        tenant_key = payer(principal)
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
            per_prompt=per_prompt,
        )
