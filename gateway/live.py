"""Wires the live loop into a gateway process: Redis bus, completion log, signal routes, adapter registry.

:func:`start_live_loop` is called from the app's lifespan. It never blocks
serving on Redis: if Redis is unreachable at start, inference still works
(endpoints catch up from the store by polling), completions are not logged and
the signal routes answer 503 with ``Retry-After`` until Redis is back.

:func:`record_completion` is what the OpenAI routes call when a completion is
done; a Redis failure there is logged, never turned into a failed response.

"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from livelora.adapters.bus import connect_async, ensure_group_async
from livelora.adapters.redis_keys import KeyLayout
from livelora.clients.errors import InternalError, UnavailableError
from livelora.clients.types.signals import CompletionRecord
from livelora.gateway.api.signals import SignalService
from livelora.gateway.completion_log import CompletionLog
from livelora.gateway.registry import AdapterRegistry

log = logging.getLogger(__name__)


@dataclass
class LiveLoop:
    """The gateway's live-loop objects (on ``app.state``: ``signals``, ``registry``, ``completion_log``)."""

    keys: KeyLayout
    client: Any
    completions: CompletionLog
    signals: SignalService
    registry: AdapterRegistry
    extra: dict[str, Any] = field(default_factory=dict)

    async def close(self) -> None:
        await self.registry.close()
        await self.client.aclose()


async def start_live_loop(app, settings, engine) -> LiveLoop:
    """Create the live loop for ``app`` and put its parts on ``app.state``.

    Args:
        settings: the gateway settings (``redis_url``, ``redis_prefix``, ``home``, ``model_id``, ``live``).
        engine: the started engine.
    """
    live = settings.live
    keys = KeyLayout(settings.redis_prefix)
    client = connect_async(settings.redis_url)
    completions = CompletionLog(client, keys, retention_s=live.completion_retention_s)
    registry = AdapterRegistry(engine, settings.home, settings.model_id, client=client, keys=keys,
                               resync_s=live.resync_s)
    signals = SignalService(client, keys, completions, resolve_endpoint=registry.endpoint_for,
                            idempotency_ttl_s=live.idempotency_ttl_s, check_trainable=registry.check_trainable,
                            check_event=signal_checker(settings))
    try:
        await ensure_group_async(client, keys)
    except UnavailableError as exc:
        log.warning("Redis at %s is unreachable (%s): serving without the completion log and signal routes "
                    "until it is back", settings.redis_url, exc)
    await registry.start()
    app.state.registry, app.state.signals, app.state.completion_log = registry, signals, completions
    return LiveLoop(keys, client, completions, signals, registry)


def signal_checker(settings):
    """The door check of signals (:class:`~livelora.gateway.signal_checks.SignalChecker`): a tokenizer of its own
    (loaded as the trainer loads it) and the trainer's context length for ``settings.model``."""
    from livelora.adapters.chat_tokens import model_context_length
    from livelora.adapters.models import load_tokenizer, resolve_base_model
    from livelora.gateway.signal_checks import SignalChecker

    ref = resolve_base_model(settings.model, settings.home)
    return SignalChecker(load_tokenizer(ref), model_context_length(ref)).check


async def record_completion(app, record: CompletionRecord) -> bool:
    """Put a served completion in the completion log; returns whether it was recorded.

    A gateway without the live loop, or with Redis down, serves the completion anyway (it just cannot
    be rated later); the failure is logged.
    """
    completions = getattr(app.state, "completion_log", None)
    if completions is None:
        return False
    try:
        await completions.record(record)
        return True
    except (UnavailableError, InternalError) as exc:
        log.warning("completion %s not logged: %s", record.id, exc)
        return False


def hold_version(app, target, ticket) -> None:
    """Lease the version a request was resolved to until its admission ``ticket`` is released.

    Call right after the ticket is acquired, with no ``await`` since :func:`resolve_target`, so the
    resolved version is still the endpoint's current one.
    """
    registry = getattr(app.state, "registry", None)
    endpoint = getattr(target, "endpoint", None)
    if registry is not None and endpoint is not None and target.adapter is not None:
        ticket.also_release(registry.hold(endpoint, target.adapter).release)


class CompletionRecorder:
    """Collects one request's choices as they stream and logs them as :class:`CompletionRecord` s.

    Used by chat (all choices share one prompt) and the legacy ``/v1/completions`` route (choice ``k`` is
    ``prompt_index * choices_per_prompt + i`` and has its own prompt: pass ``choice_prompts``).
    With one choice the record's id is the response id; with more, choice ``k`` is logged as ``{id}-{k}``
    (rate it under that id).

    Args:
        request: the FastAPI request (its app holds the completion log; ``request.state.caller``, if any,
            becomes the record's ``caller``).
        completion_id: the response id.
        created: Unix time, seconds.
        target: the :class:`~livelora.gateway.api.serving.ServingTarget` (endpoint, model, adapter).
        prompt_ids: shape ``(P,)``, the prompt every choice shares (with ``prompt``, its text).
        n: number of choices.
        messages: the chat prompt (``None`` for ``/v1/completions``).
        prompt: the text prompt shared by every choice (``None`` for chat).
        user: the request's OpenAI ``user`` field.
        choice_prompts: instead of ``prompt_ids``/``prompt``: one ``(prompt_ids, prompt_text)`` per choice.

    Raises:
        InternalError: neither ``prompt_ids`` nor ``choice_prompts``, or ``len(choice_prompts) != n``.
    """

    def __init__(self, request, *, completion_id: str, created: int, target, prompt_ids: list[int] | None = None,
                 n: int = 1, messages: list[dict] | None = None, prompt: str | None = None, user: str | None = None,
                 choice_prompts: list[tuple[list[int], str | None]] | None = None):
        if choice_prompts is None:
            if prompt_ids is None:
                raise InternalError("CompletionRecorder needs prompt_ids or choice_prompts")
            choice_prompts = [(list(prompt_ids), prompt)] * n
        if len(choice_prompts) != n:
            raise InternalError(f"CompletionRecorder got {len(choice_prompts)} choice prompts for {n} choices")
        self.app = request.app
        self.caller = getattr(request.state, "caller", None)
        self.id, self.created, self.target, self.n = completion_id, created, target, n
        self.prompts = [(list(ids), text) for ids, text in choice_prompts]
        self.messages, self.user = messages, user
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n

    def add(self, index: int, chunk) -> None:
        """Add one engine chunk of choice ``index`` (generated tokens only: never an echoed prompt)."""
        self.tokens[index] += chunk.token_ids
        if chunk.logprobs:
            self.logprobs[index] += [t.logprob for t in chunk.logprobs]
        self.texts[index].append(chunk.text)
        if chunk.finish_reason is not None:
            self.finish[index] = chunk.finish_reason

    def record_id(self, index: int) -> str:
        """The completion-log id of choice ``index``: the response id alone, else ``{id}-{index}``."""
        return self.id if self.n == 1 else f"{self.id}-{index}"

    async def save(self) -> None:
        """Log every choice (errors are logged, never raised)."""
        endpoint = getattr(self.target, "endpoint", None) or self.target.model
        for i in range(self.n):
            lps = self.logprobs[i] if len(self.logprobs[i]) == len(self.tokens[i]) else None
            prompt_ids, prompt = self.prompts[i]
            await record_completion(self.app, CompletionRecord(
                id=self.record_id(i), endpoint=endpoint, model=self.target.model,
                adapter=self.target.adapter, messages=self.messages, prompt=prompt,
                prompt_token_ids=prompt_ids, completion_token_ids=self.tokens[i], logprobs=lps,
                completion="".join(self.texts[i]), finish_reason=self.finish[i] or "stop", created=self.created,
                caller=self.caller, user=self.user))
