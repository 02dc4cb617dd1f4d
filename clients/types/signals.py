"""Wire types of the live loop: completion records, signal requests/responses, bus events.

Requests of ``POST /v1/feedback`` (a thumbs ``rating`` of one served completion, optional ``score`` and
``comment``; one per completion and user, a later one replaces it), ``POST /v1/preferences`` (a chosen/rejected
pair, as two completion ids or inline) and ``POST /v1/demonstrations`` (``messages`` ending with the ideal reply).
Accepted signals travel on the Redis signals stream as :data:`SignalEvent` values (JSON, discriminated by
``type``), self-contained: they copy the exact served token ids. Where the field names come from:
``docs/internals/wire-types.md``.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, Strict, StrictBool, TypeAdapter, field_validator

from livelora.clients.types.nulls import NullMeansOmitted


class _Strict(NullMeansOmitted):
    """Base of the live loop's models: unknown fields are an error; ``null`` for an optional field means "not
    given" (:mod:`.nulls`)."""

    model_config = ConfigDict(extra="forbid")


#: characters of one signal text: an inline ``chosen``/``rejected`` reply, one message's ``content`` (16 per token
#: of an 8,192-token context: text that fits the trainer's context meets the token check, not this bound)
MAX_SIGNAL_TEXT_CHARS = 131_072
#: messages of one preference prompt or demonstration
MAX_SIGNAL_MESSAGES = 256
#: characters of a signal's ``model`` (an endpoint name), ``user`` and ``completion_id``
MAX_SIGNAL_NAME_CHARS = 256
#: characters of a rating's ``comment``
MAX_COMMENT_CHARS = 10_000


class ChatMessage(_Strict):
    """A plain-text chat message (the only kind the trainer can learn from)."""

    role: Literal["system", "user", "assistant"]
    content: str


class SignalMessage(ChatMessage):
    """A chat message of a signal request: ``content`` at most :data:`MAX_SIGNAL_TEXT_CHARS`."""

    content: str = Field(max_length=MAX_SIGNAL_TEXT_CHARS)


# --------------------------------------------------------------------- records


class CompletionRecord(_Strict):
    """One served completion, as kept in the completion log (Redis, TTL = retention).

    Attributes:
        id: the completion id returned to the client (``chatcmpl-…`` / ``cmpl-…``), unique.
        endpoint: the endpoint that served it (its lineage learns from the feedback).
        model: the ``model`` string the client sent.
        adapter: the adapter version name that generated it (``<lineage>@<n>``), ``None`` for the base model.
        messages: the chat prompt (``None`` for ``/v1/completions``).
        prompt: the text prompt (``None`` for chat).
        prompt_token_ids: shape ``(P,)``, the exact tokens the engine saw.
        completion_token_ids: shape ``(C,)``, the exact tokens generated (stop tokens excluded).
        logprobs: shape ``(C,)``, sampler logprob of each completion token in nats, when recorded.
        completion: the completion text returned.
        finish_reason: ``stop`` or ``length``.
        created: Unix time, seconds.
        caller: the authenticated caller (API-key id) or ``None`` without auth.
        user: the OpenAI ``user`` field of the request, if any.
        prompt_of: as stored only: the prompt is kept once per request, in entry ``prompt_index`` of the
            prompt record under this response id (the completion log fills it back in when it reads a record).
    """

    id: str
    endpoint: str
    model: str
    adapter: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float] | None = None
    completion: str = ""
    finish_reason: str | None = None
    created: int
    caller: str | None = None
    user: str | None = None
    prompt_of: str | None = None
    prompt_index: int | None = None


# -------------------------------------------------------------------- requests

_User = Annotated[
    str | None,
    Field(
        default=None,
        min_length=1,
        max_length=MAX_SIGNAL_NAME_CHARS,
        description="End user giving the signal; defaults to the caller.",
    ),
]


class FeedbackRequest(_Strict):
    """Body of ``POST /v1/feedback``: one rating of one served completion."""

    completion_id: str = Field(min_length=1, max_length=MAX_SIGNAL_NAME_CHARS, description="Id of a served completion.")
    rating: StrictBool = Field(
        description="Thumbs label: JSON true = up (KTO desirable), false = down "
        '(undesirable); "yes", 1 and other look-alikes are refused.'
    )
    score: Annotated[float, Strict()] | None = Field(
        default=None,
        description="Optional numeric score (a finite JSON number; true/false and numeric strings are "
        "refused). Kept in the dataset of record; training uses `rating`.",
    )
    comment: str | None = Field(default=None, max_length=MAX_COMMENT_CHARS, description="Optional free-text comment.")
    user: _User = None

    @field_validator("score")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("score must be a finite number")
        return v


class PreferenceRequest(_Strict):
    """Body of ``POST /v1/preferences``: a chosen/rejected pair for the same prompt.

    Exactly one form:

    * ``chosen_completion_id`` + ``rejected_completion_id``: two completions served
      by the same endpoint for the same prompt tokens;
    * ``model`` + ``messages`` (the prompt, not ending with an assistant turn) +
      ``chosen`` + ``rejected`` (assistant reply texts).
    """

    chosen_completion_id: str | None = Field(default=None, min_length=1, max_length=MAX_SIGNAL_NAME_CHARS)
    rejected_completion_id: str | None = Field(default=None, min_length=1, max_length=MAX_SIGNAL_NAME_CHARS)
    model: str | None = Field(
        default=None, min_length=1, max_length=MAX_SIGNAL_NAME_CHARS, description="Endpoint (inline form)."
    )
    messages: list[SignalMessage] | None = Field(
        default=None, max_length=MAX_SIGNAL_MESSAGES, description="Prompt messages (inline form)."
    )
    chosen: str | None = Field(
        default=None, max_length=MAX_SIGNAL_TEXT_CHARS, description="Preferred assistant reply (inline form)."
    )
    rejected: str | None = Field(
        default=None, max_length=MAX_SIGNAL_TEXT_CHARS, description="Dispreferred assistant reply (inline form)."
    )
    user: _User = None


class DemonstrationRequest(_Strict):
    """Body of ``POST /v1/demonstrations``: a conversation ending with the ideal assistant reply."""

    model: str = Field(
        min_length=1,
        max_length=MAX_SIGNAL_NAME_CHARS,
        description="Endpoint whose adapter should learn the demonstration.",
    )
    messages: list[SignalMessage] = Field(min_length=2, max_length=MAX_SIGNAL_MESSAGES)
    user: _User = None


# ------------------------------------------------------------------- responses


class FeedbackResponse(_Strict):
    """Answer to ``POST /v1/feedback`` (2xx only once the event is in Redis)."""

    id: str
    object: Literal["feedback"] = "feedback"
    completion_id: str
    endpoint: str
    rating: bool
    score: float | None = None
    comment: str | None = None
    user: str | None = None
    replaces: str | None = Field(default=None, description="Id of this user's earlier rating it replaces.")
    created: int
    ratings_to_step: int | None = Field(
        default=None,
        description="More ratings of this endpoint that start a training step (0: one starts when the trainer is "
        "free; None: no trainer has reported). GET /v1/learning/{endpoint} follows the step.",
    )
    training: str | None = Field(
        default=None,
        description="What happens to this rating: queued (n of the batch; a step starts on a full batch, or on "
        "fewer once the oldest has waited max_wait_s), or held out by the evaluation gate and never trained on. "
        "None: no trainer has reported.",
    )


class PreferenceResponse(_Strict):
    """Answer to ``POST /v1/preferences``."""

    id: str
    object: Literal["preference"] = "preference"
    endpoint: str
    chosen_completion_id: str | None = None
    rejected_completion_id: str | None = None
    user: str | None = None
    created: int


class DemonstrationResponse(_Strict):
    """Answer to ``POST /v1/demonstrations``."""

    id: str
    object: Literal["demonstration"] = "demonstration"
    endpoint: str
    user: str | None = None
    created: int


# ---------------------------------------------------------------------- events


class _EventBase(_Strict):
    """``user``: the signal's sender (the request's ``user``); ``completion_users``: the ``user`` of each served
    completion it trains on, when another or none sent it (forgetting a user removes both kinds)."""

    id: str
    endpoint: str
    created: int
    caller: str | None = None
    user: str | None = None
    completion_users: list[str] = Field(default_factory=list, max_length=2)


class RatingEvent(_EventBase):
    """A thumbs rating on the bus. ``rating_key`` = ``{completion_id}:{user}``: the trainer keeps only the
    latest event per key among those not yet trained (``replaces`` names the one superseded).
    ``finish_reason`` is the served completion's (``stop``: the model ended its turn, whose end-of-turn token
    the completion ids exclude; the trainer appends it so the rating also covers where the reply stopped)."""

    type: Literal["rating"] = "rating"
    completion_id: str
    adapter: str | None = None
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    rating: bool
    score: float | None = None
    comment: str | None = None
    rating_key: str
    replaces: str | None = None


class PreferenceEvent(_EventBase):
    """A preference pair on the bus: token ids (completion-id form) or messages + texts (inline form)."""

    type: Literal["preference"] = "preference"
    chosen_completion_id: str | None = None
    rejected_completion_id: str | None = None
    prompt_token_ids: list[int] | None = None
    chosen_token_ids: list[int] | None = None
    rejected_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    chosen: str | None = None
    rejected: str | None = None


class DemonstrationEvent(_EventBase):
    """A demonstration on the bus: ``messages`` ending with the ideal assistant reply."""

    type: Literal["demonstration"] = "demonstration"
    messages: list[ChatMessage]


SignalEvent = Annotated[RatingEvent | PreferenceEvent | DemonstrationEvent, Field(discriminator="type")]
#: Parses any event JSON: ``SIGNAL_EVENT.validate_json(text)``.
SIGNAL_EVENT: TypeAdapter[RatingEvent | PreferenceEvent | DemonstrationEvent] = TypeAdapter(SignalEvent)


class VersionNotice(_Strict):
    """Published on the notices channel when the trainer writes a version.

    ``name`` is the engine name of the version (``<lineage>@<n>``), never reused
    for other weights; ``sha256`` is the digest recorded in its manifest.
    """

    type: Literal["version_published"] = "version_published"
    lineage: str
    version: int
    name: str
    path: str
    sha256: str
    endpoint: str | None = None
    parent: str | None = None
    kind: str | None = None
    created: int | None = None


def parse_stream_event(fields: dict[str, str]):
    """Decode one signals-stream entry (fields ``event`` and ``replaces``) into a :data:`SignalEvent`.

    Raises:
        pydantic.ValidationError: the entry is not a valid event.
    """
    ev = SIGNAL_EVENT.validate_json(fields["event"])
    if isinstance(ev, RatingEvent) and fields.get("replaces"):
        ev = ev.model_copy(update={"replaces": fields["replaces"]})
    return ev
