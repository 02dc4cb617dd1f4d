"""The completion log: every served completion, kept in Redis for a retention period.

Each record is one JSON string at ``{prefix}completion:{id}`` with a TTL of ``retention_s`` (default 7 days,
:data:`~livelora.gateway.settings.DEFAULT_RETENTION_S`). Feedback on a completion looks its record up here; an
expired or unknown id is a 404. Records hold the exact prompt and completion token ids, so training uses the
tokens that were served, never a re-tokenization.

A response with several choices keeps its prompt(s) once: a **prompt record** (``"kind": "prompt"``) under the
response id holds the distinct prompts, and each choice record ``{id}-{k}`` names its entry (``prompt_of``,
``prompt_index``); :meth:`CompletionLog.get` puts the prompt back. Every tenant's record bytes are counted per
UTC day (``complog:bytes:{tenant}:{day}``) so that ``max_completion_log_bytes`` can be checked before serving.

:class:`CompletionRecorder` collects one served request's choices as they stream and logs them when it is
done; a Redis failure there is logged, never turned into a failed response (:func:`record_completion`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import TYPE_CHECKING, Any

import redis.asyncio as aredis

from livelora.clients.errors import BadRequestError, InternalError, NotFoundError, RateLimitError, UnavailableError
from livelora.clients.types.signals import CompletionRecord
from livelora.core.api_keys import DEFAULT_TENANT
from livelora.core.bus import dumps, redis_unavailable
from livelora.core.durations import in_words
from livelora.core.redis_keys import KeyLayout
from livelora.gateway.engines.base import GenerationChunk
from livelora.gateway.settings import DEFAULT_RETENTION_S

if TYPE_CHECKING:
    from livelora.gateway.services.serving.serve import ServingTarget

log = logging.getLogger(__name__)

#: Choice records checked per Redis round trip when a miss counts a response's choices
#: (:meth:`CompletionLog.choices_of`).
CHOICE_BATCH = 128


class CompletionLog:
    """Record and fetch :class:`CompletionRecord` values.

    Args:
        client: asyncio Redis client (``decode_responses=True``).
        keys: the key layout (prefix).
        retention_s: seconds a record is kept (> 0).
    """

    def __init__(self, client: aredis.Redis, keys: KeyLayout, retention_s: int = DEFAULT_RETENTION_S):
        if retention_s <= 0:
            raise BadRequestError(f"completion retention must be > 0 seconds, got {retention_s}", param="retention_s")
        self.client = client
        self.keys = keys
        self.retention_s = int(retention_s)

    async def record(self, rec: CompletionRecord) -> None:
        """Store ``rec`` under its id with TTL = retention. Ids are unique: an existing id is not overwritten.

        Raises:
            UnavailableError: Redis unreachable (the caller decides whether serving goes on).
            InternalError: the id is already recorded (ids must be unique per completion).
        """
        await self._write(rec.id, rec.model_dump(mode="json"), rec.caller)

    async def record_prompt(self, response_id: str, choices: int, prompts: list[dict[str, Any]], **fields) -> None:
        """Store the prompt record of a response with ``choices`` choices (``prompts``: ``[{"prompt",
        "prompt_token_ids"}]``; ``fields``: ``endpoint``, ``messages``, ``caller``, ``user``, ``created``).

        Raises:
            UnavailableError: Redis unreachable. InternalError: the id is already recorded.
        """
        record = {"kind": "prompt", "id": response_id, "choices": choices, "prompts": prompts, **fields}
        await self._write(response_id, record, fields.get("caller"))

    async def _write(self, record_id: str, record: dict[str, Any], caller: str | None) -> None:
        raw = dumps(record)
        day_key = self.keys.completion_bytes(caller or DEFAULT_TENANT, time.strftime("%Y%m%d", time.gmtime()))
        with redis_unavailable():
            ok = await self.client.set(self.keys.completion(record_id), raw, ex=self.retention_s, nx=True)
            if ok:
                async with self.client.pipeline(transaction=False) as pipe:
                    pipe.incrby(day_key, len(raw))
                    pipe.expire(day_key, self.retention_s + 86400)
                    await pipe.execute()
        if not ok:
            raise InternalError(f"completion id {record_id!r} is already recorded")

    async def held_bytes(self, tenant: str) -> int:
        """Bytes of records ``tenant`` wrote on the UTC days the retention period reaches (an upper bound of
        what Redis still holds). Raises: UnavailableError."""
        days = math.ceil(self.retention_s / 86400) + 1
        now = time.time()
        keys = [
            self.keys.completion_bytes(tenant, time.strftime("%Y%m%d", time.gmtime(now - d * 86400)))
            for d in range(days)
        ]
        with redis_unavailable():
            values = await self.client.mget(keys)
        return sum(int(v or 0) for v in values)

    async def check_room(self, tenant: str, limit: int | None) -> None:
        """Refuse (429) a request to be logged when ``tenant``'s records reached ``limit`` bytes (``None``:
        unlimited; Redis unreachable: not checked, the record would not be written either).

        Raises:
            RateLimitError: ``max_completion_log_bytes`` reached (``param`` names it).
        """
        if limit is None:
            return
        try:
            held = await self.held_bytes(tenant)
        except UnavailableError:
            return
        if held >= limit:
            raise RateLimitError(
                f"tenant {tenant!r}'s completion log holds {held} bytes of its {limit} (limit "
                "max_completion_log_bytes: LIVELORA_QUOTA_MAX_COMPLETION_LOG_BYTES or PUT /admin/quotas); records "
                f"expire after {in_words(self.retention_s)}",
                param="max_completion_log_bytes",
                code="quota_exceeded",
                retry_after=3600.0,
            )

    async def get(self, completion_id: str, *, caller: str | None = None) -> CompletionRecord:
        """The record of ``completion_id``.

        Args:
            completion_id: a record id: a response id, or ``{id}-{k}`` for choice ``k`` of a response with
                several choices.
            caller: the asking tenant (``None``: open mode or local access). Only used for the message of a
                miss: when ``completion_id`` is the bare id of a response with several choices that ``caller``
                may see, the 404 says how many and which ids to use.

        Raises:
            NotFoundError: unknown or expired id (``param='completion_id'``).
            UnavailableError: Redis unreachable.
        """
        with redis_unavailable():
            raw = await self.client.get(self.keys.completion(completion_id))
        data = _loads(raw)
        if data is not None and data.get("kind") == "prompt":  # a response with several choices: name them
            if (data.get("caller") or DEFAULT_TENANT) != (caller or DEFAULT_TENANT):
                raise self.missing(completion_id)
            raise _choices_missing(completion_id, int(data.get("choices") or 0))
        if raw is not None:
            rec = CompletionRecord.model_validate_json(raw)
            return rec if rec.prompt_of is None else await self._with_prompt(rec)
        if raw is None:
            choices = await self.choices_of(completion_id, caller=caller)
            if choices:
                raise _choices_missing(completion_id, choices)
            raise self.missing(completion_id)
        return CompletionRecord.model_validate_json(raw)

    async def _with_prompt(self, rec: CompletionRecord) -> CompletionRecord:
        """``rec`` with its prompt from the response's prompt record. Raises: NotFoundError (it expired)."""
        with redis_unavailable():
            data = _loads(await self.client.get(self.keys.completion(rec.prompt_of)))
        try:
            entry = data["prompts"][rec.prompt_index or 0]
        except (TypeError, KeyError, IndexError):
            raise self.missing(rec.id) from None
        return rec.model_copy(
            update={
                "messages": data.get("messages"),
                "prompt": entry.get("prompt"),
                "prompt_token_ids": list(entry["prompt_token_ids"]),
                "prompt_of": None,
                "prompt_index": None,
            }
        )

    def missing(self, completion_id: str, param: str = "completion_id") -> NotFoundError:
        """The one 404 for a completion id this caller cannot use: unknown, expired, or another tenant's."""
        return NotFoundError(
            f"No completion {completion_id!r}: unknown id, or older than the retention period "
            f"({in_words(self.retention_s)})",
            param=param,
        )

    async def choices_of(self, response_id: str, *, caller: str | None = None) -> int:
        """How many choice records ``{response_id}-0``, ``-1``, ... are logged (consecutive from 0), or 0 when
        there are none or choice 0 belongs to another tenant than ``caller`` (``None`` and a record without a
        caller are tenant ``default``, as for rating; so a miss reveals nothing of other tenants). Reads Redis in
        batches of :data:`CHOICE_BATCH` ``EXISTS`` calls.

        Raises:
            UnavailableError: Redis unreachable.
        """
        with redis_unavailable():
            first = await self.client.get(self.keys.completion(f"{response_id}-0"))
        if first is None:
            return 0
        if (CompletionRecord.model_validate_json(first).caller or DEFAULT_TENANT) != (caller or DEFAULT_TENANT):
            return 0
        count = 1
        while True:
            with redis_unavailable():
                async with self.client.pipeline(transaction=False) as pipe:
                    for k in range(count, count + CHOICE_BATCH):
                        pipe.exists(self.keys.completion(f"{response_id}-{k}"))
                    found = await pipe.execute()
            for hit in found:
                if not hit:
                    return count
                count += 1


def _loads(raw: str | None) -> dict[str, Any] | None:
    try:
        data = json.loads(raw) if raw else None
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _choices_missing(completion_id: str, choices: int) -> NotFoundError:
    return NotFoundError(
        f"No completion {completion_id!r}: that response had {choices} choices, each "
        f"rated by its own id: '{completion_id}-0' to '{completion_id}-{choices - 1}'",
        param="completion_id",
    )


async def record_completion(completions: CompletionLog | None, record: CompletionRecord) -> bool:
    """Put a served completion in the completion log; returns whether it was recorded.

    A gateway without the live loop (``completions`` is ``None``), or with Redis down, serves the completion
    anyway (it just cannot be rated later); the failure is logged.
    """
    if completions is None:
        return False
    try:
        await completions.record(record)
        return True
    except (UnavailableError, InternalError) as exc:
        log.warning("completion %s not logged: %s", record.id, exc)
        return False


class CompletionRecorder:
    """Collects one request's choices as they stream and logs them as :class:`CompletionRecord` s.

    Used by chat (all choices share one prompt) and the legacy ``/v1/completions`` route (choice ``k`` is
    ``prompt_index * choices_per_prompt + i`` and has its own prompt: pass ``choice_prompts``).
    With one choice the record's id is the response id; with more, choice ``k`` is logged as ``{id}-{k}``
    (rate it under that id). :meth:`~livelora.gateway.services.serving.serve.Serving.begin` makes one per request.

    Args:
        completions: the completion log (``None``: nothing is logged).
        completion_id: the response id.
        created: Unix time, seconds.
        target: the :class:`~livelora.gateway.services.serving.serve.ServingTarget` (endpoint, model, adapter).
        caller: the tenant in key mode (becomes the record's ``caller``), ``None`` in open mode.
        prompt_ids: shape ``(P,)``, the prompt every choice shares (with ``prompt``, its text).
        n: number of choices.
        messages: the chat prompt (``None`` for ``/v1/completions``).
        prompt: the text prompt shared by every choice (``None`` for chat).
        user: the request's OpenAI ``user`` field.
        choice_prompts: instead of ``prompt_ids``/``prompt``: one ``(prompt_ids, prompt_text)`` per choice.

    Raises:
        InternalError: neither ``prompt_ids`` nor ``choice_prompts``, or ``len(choice_prompts) != n``.
    """

    def __init__(
        self,
        completions: CompletionLog | None,
        *,
        completion_id: str,
        created: int,
        target: ServingTarget,
        caller: str | None = None,
        prompt_ids: list[int] | None = None,
        n: int = 1,
        messages: list[dict] | None = None,
        prompt: str | None = None,
        user: str | None = None,
        choice_prompts: list[tuple[list[int], str | None]] | None = None,
    ):
        if choice_prompts is None:
            if prompt_ids is None:
                raise InternalError("CompletionRecorder needs prompt_ids or choice_prompts")
            choice_prompts = [(list(prompt_ids), prompt)] * n
        if len(choice_prompts) != n:
            raise InternalError(f"CompletionRecorder got {len(choice_prompts)} choice prompts for {n} choices")
        self.completions = completions
        self.caller = caller
        self.id, self.created, self.target, self.n = completion_id, created, target, n
        self.prompts = [(list(ids), text) for ids, text in choice_prompts]
        self.messages, self.user = messages, user
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n

    def add(self, index: int, chunk: GenerationChunk) -> None:
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

    async def _save_prompts(self, endpoint: str) -> list[int] | None:
        """With several choices, the prompt record (each distinct prompt once); returns each choice's entry, or
        ``None`` when there is one choice or the record could not be written (then every choice keeps its own)."""
        if self.n == 1 or self.completions is None:
            return None
        distinct: dict[tuple[tuple[int, ...], str | None], int] = {}
        index = [distinct.setdefault((tuple(ids), text), len(distinct)) for ids, text in self.prompts]
        prompts = [{"prompt": text, "prompt_token_ids": list(ids)} for ids, text in distinct]
        try:
            await self.completions.record_prompt(
                self.id,
                self.n,
                prompts,
                endpoint=endpoint,
                messages=self.messages,
                caller=self.caller,
                user=self.user,
                created=self.created,
            )
        except (UnavailableError, InternalError) as exc:
            log.warning("prompt of %s not logged once: %s", self.id, exc)
            return None
        return index

    async def save(self) -> None:
        """Log every choice (errors are logged, never raised)."""
        endpoint = getattr(self.target, "endpoint", None) or self.target.model
        shared = await self._save_prompts(endpoint)
        for i in range(self.n):
            lps = self.logprobs[i] if len(self.logprobs[i]) == len(self.tokens[i]) else None
            prompt_ids, prompt = self.prompts[i]
            kept = {"messages": self.messages, "prompt": prompt, "prompt_token_ids": prompt_ids}
            if shared is not None:
                kept = {"prompt_token_ids": [], "prompt_of": self.id, "prompt_index": shared[i]}
            await record_completion(
                self.completions,
                CompletionRecord(
                    id=self.record_id(i),
                    endpoint=endpoint,
                    model=self.target.model,
                    adapter=self.target.adapter,
                    **kept,
                    completion_token_ids=self.tokens[i],
                    logprobs=lps,
                    completion="".join(self.texts[i]),
                    finish_reason=self.finish[i] or "stop",
                    created=self.created,
                    caller=self.caller,
                    user=self.user,
                ),
            )
