"""The inference-engine interface the gateway talks to.

One engine instance serves one base model plus any number of loaded LoRA
adapter versions. Implementations: :mod:`livelora.gateway.engines.transformers.engine` (transformers +
peft, CPU or one GPU; used by the tests) and :mod:`livelora.gateway.engines.vllm.engine` (vLLM, GPU).
Anything engine-specific (batching, KV caches, stop handling, detokenization)
stays inside the implementation; the gateway only sees this module's types.

Logprob convention (all engines): every logprob returned is
``log_softmax(logits)`` of the **raw model distribution** of the serving
weights (base + adapter), before temperature, top-k and top-p are applied, in
nats. At temperature 1 with no top-k/top-p this is exactly the sampling
distribution, so it agrees with :meth:`Engine.score` on the same tokens.
"""

from __future__ import annotations

import abc
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from livelora.clients.errors import BadRequestError, ContextLengthExceededError
from livelora.clients.types.limits import MAX_STOP_CHARS, MAX_STOP_SEQUENCES
from livelora.core.control_tokens import split_stop_strings

#: Most alternatives per position ``top_logprobs`` may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation parameters.

    Attributes:
        max_tokens: completion-token budget (>= 1).
        temperature: 0 means greedy (never an error); otherwise logits are divided by it.
        top_p: nucleus mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens; 0 disables.
        seed: seeds this sequence's own generator; the same seed, prompt and
            weights give the same tokens whatever else is in the batch.
        stop: stop strings; generation ends at the first match and the match is
            not included in the returned text (finish_reason ``stop``). A string that is
            exactly one control token's text stops at that token (:func:`resolve_stop_strings`).
        stop_token_ids: token ids that end generation (not included in text).
        ignore_eos: keep generating past the model's EOS tokens.
        logprobs: return the logprob of each sampled token.
        top_logprobs: also return the k most likely alternatives per position (0..20).
        min_tokens: end-of-sequence and stop tokens cannot be sampled before this many tokens (vLLM's
            ``min_tokens``; stop strings still apply).
        include_stop_str_in_output: a matched stop string ends the text instead of being cut off.
        skip_special_tokens: leave special tokens out of the text (their logprob entries stay).
        repetition_penalty: > 0, 1 off; presence_penalty, frequency_penalty: in [-2, 2], 0 off; min_p: in [0, 1],
            0 off (vLLM's names and formulas: :class:`~.sampling.Penalties`; logprobs stay raw).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0


@dataclass
class TokenLogprob:
    """One generated (or scored) token with its logprob and optional alternatives.

    ``top`` lists ``(token_id, logprob)`` pairs, most likely first.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class GenerationChunk:
    """What one engine step adds to one sequence.

    Attributes:
        token_ids: tokens generated in this step (usually one; may be empty on
            the final chunk). Stop tokens are not included.
        text: newly decoded text; never contains half a UTF-8 character and
            never contains any part of a matched stop string.
        logprobs: one entry per ``token_ids`` item when ``SamplingParams.logprobs``.
        finish_reason: ``None`` until the final chunk of the sequence.
        stop_reason: the matched stop string or stop token id, if any.
        stop_token: on the final chunk of a sequence ended by an end-of-sequence or stop token, with
            ``SamplingParams.logprobs``: that token's entry (it is in neither ``token_ids`` nor ``text``).
    """

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    stop_token: TokenLogprob | None = None


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> list[int]:
    """Token ids as ints, each in ``[0, vocab_size)``.

    Raises:
        BadRequestError: not integers, empty, or outside the vocabulary (names ``param``).
    """
    try:
        ids = [int(t) for t in token_ids]
    except (TypeError, ValueError) as exc:
        raise BadRequestError(f"{param} must be a list of token ids", param=param) from exc
    if not ids:
        raise BadRequestError(f"{param} is empty", param=param)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param=param)
    return ids


def check_sampling_params(p: SamplingParams, prompt_len: int, *, vocab_size: int, max_model_len: int) -> None:
    """Validate ``p`` for a prompt of ``prompt_len`` tokens; shared by every engine so they refuse the same inputs.

    Raises:
        BadRequestError: a parameter out of range (names it).
        ContextLengthExceededError: ``prompt_len + max_tokens > max_model_len``.
    """
    if not isinstance(p.max_tokens, int) or p.max_tokens < 1:
        raise BadRequestError(
            f"max_tokens must be an integer >= 1, got {p.max_tokens!r}",
            param="max_tokens",
            code="integer_below_min_value",
        )
    if not (isinstance(p.temperature, (int, float)) and math.isfinite(p.temperature) and p.temperature >= 0):
        raise BadRequestError(
            f"temperature must be >= 0, got {p.temperature!r}", param="temperature", code="decimal_below_min_value"
        )
    if not (isinstance(p.top_p, (int, float)) and 0 < p.top_p <= 1):
        raise BadRequestError(f"top_p must be in (0, 1], got {p.top_p!r}", param="top_p")
    if not isinstance(p.min_tokens, int) or not 0 <= p.min_tokens <= p.max_tokens:
        raise BadRequestError(
            f"min_tokens must be an integer in 0..max_tokens ({p.max_tokens}), got {p.min_tokens!r}",
            param="min_tokens",
        )
    for name, low, high in (("presence_penalty", -2, 2), ("frequency_penalty", -2, 2), ("min_p", 0, 1)):
        value = getattr(p, name)
        if not (isinstance(value, (int, float)) and low <= value <= high):
            raise BadRequestError(f"{name} must be in [{low}, {high}], got {value!r}", param=name)
    rp = p.repetition_penalty
    if not (isinstance(rp, (int, float)) and math.isfinite(rp) and rp > 0):
        raise BadRequestError(f"repetition_penalty must be > 0 (1 disables), got {rp!r}", param="repetition_penalty")
    if not isinstance(p.top_k, int) or p.top_k < 0:
        raise BadRequestError(f"top_k must be an integer >= 0 (0 disables), got {p.top_k!r}", param="top_k")
    if not isinstance(p.top_logprobs, int) or not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
        raise BadRequestError(
            f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {p.top_logprobs!r}", param="top_logprobs"
        )
    if p.top_logprobs and not p.logprobs:
        raise BadRequestError(
            "top_logprobs requires logprobs to be true", param="top_logprobs", code="invalid_parameter_combination"
        )
    if p.seed is not None and not isinstance(p.seed, int):
        raise BadRequestError(f"seed must be an integer, got {p.seed!r}", param="seed")
    if isinstance(p.stop, str) or any(not isinstance(s, str) or not s for s in p.stop):
        raise BadRequestError("stop must be a sequence of non-empty strings", param="stop")
    if len(p.stop) > MAX_STOP_SEQUENCES or len(p.stop_token_ids) > MAX_STOP_SEQUENCES:
        raise BadRequestError(
            f"at most {MAX_STOP_SEQUENCES} stop strings and {MAX_STOP_SEQUENCES} stop token ids per request",
            param="stop" if len(p.stop) > MAX_STOP_SEQUENCES else "stop_token_ids",
            code="array_above_max_length",
        )
    if any(len(s) > MAX_STOP_CHARS for s in p.stop):
        raise BadRequestError(f"a stop string may have at most {MAX_STOP_CHARS} characters", param="stop")
    for t in p.stop_token_ids:
        if not isinstance(t, int) or not 0 <= t < vocab_size:
            raise BadRequestError(f"stop token id {t!r} is outside the vocabulary", param="stop_token_ids")
    if prompt_len + p.max_tokens > max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + p.max_tokens} tokens ({prompt_len} in the messages, {p.max_tokens} in the "
            f"completion). Please reduce the length of the messages or completion."
        )


def resolve_stop_strings(p: SamplingParams, tokenizer) -> SamplingParams:
    """``p`` with every stop string that is exactly one control token's text (``"<|im_end|>"``) moved to
    ``stop_token_ids``; shared by every engine, so a special-token stop ends generation the same way on every
    route (:func:`livelora.clients.tokens.split_stop_strings`). Generated text never contains control tokens,
    so such a string could never match as text.

    Raises:
        BadRequestError: a stop string mixing a control token with other text (param ``stop``).
    """
    texts, ids = split_stop_strings(tokenizer, p.stop)
    if not ids and texts == tuple(p.stop):
        return p
    return replace(p, stop=texts, stop_token_ids=tuple(dict.fromkeys((*p.stop_token_ids, *ids))))


def check_score_request(
    token_ids: Sequence[int], top_logprobs: int, *, vocab_size: int, max_model_len: int
) -> list[int]:
    """Validate a :meth:`Engine.score` call; shared by every engine. Returns the token ids as ints.

    Raises:
        BadRequestError: empty or out-of-vocabulary ``token_ids``; ``top_logprobs`` outside 0..20.
        ContextLengthExceededError: more than ``max_model_len`` tokens.
    """
    ids = check_token_ids(token_ids, vocab_size, "token_ids")
    if not isinstance(top_logprobs, int) or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise BadRequestError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}", param="top_logprobs")
    if len(ids) > max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens; {len(ids)} tokens were given to score."
        )
    return ids


@dataclass(frozen=True)
class AdapterCheck:
    """What :meth:`Engine.load_and_check` found for a freshly loaded adapter version.

    Attributes:
        sha256: hex digest of the weights file as read for loading.
        canary: :meth:`Engine.score` of the canary tokens on the new version (entry 0 is ``None``).
    """

    sha256: str
    canary: list[TokenLogprob | None]


class Engine(abc.ABC):
    """Async inference engine over one base model and its loaded adapters.

    Concurrent :meth:`generate` calls are batched together by the engine.
    Cancelling the consumer of :meth:`generate` (closing the async iterator or
    cancelling its task) aborts the sequence and frees its resources.
    """

    #: Name of the base model served.
    model_name: str
    #: Maximum prompt + completion length in tokens.
    max_model_len: int
    #: Vocabulary size: valid token ids are ``0 .. vocab_size - 1`` (set once started).
    vocab_size: int
    #: Why the engine can serve no more (``/health`` answers 503 with it), or ``None`` while it can.
    failure: str | None = None

    @property
    @abc.abstractmethod
    def tokenizer(self):
        """The Hugging Face tokenizer of the base model (with its chat template)."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Load weights and start the worker. Idempotent."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Abort every running sequence and stop the worker."""

    @abc.abstractmethod
    def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        adapter: str | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Generate one completion.

        Args:
            prompt_token_ids: the prompt, shape ``(T,)`` token ids.
            params: sampling parameters.
            adapter: name of a loaded adapter version, or ``None`` for the base model.
            request_id: for logs and aborts.

        Yields:
            :class:`GenerationChunk` items; the last has a ``finish_reason``.

        Raises:
            ContextLengthExceededError: prompt + max_tokens > :attr:`max_model_len`.
            ModelNotFoundError: ``adapter`` is not loaded.
            BadRequestError: invalid parameters (``max_tokens < 1``, ``top_logprobs > 20``, ...).

        Validation errors are raised no later than the first ``__anext__``
        (the transformers engine raises them from the call itself), so a
        streaming route should pull the first chunk before sending headers.
        """

    @abc.abstractmethod
    async def score(
        self, token_ids: Sequence[int], adapter: str | None = None, top_logprobs: int = 0
    ) -> list[TokenLogprob | None]:
        """Prompt logprobs: entry i is ``log p(token_i | tokens_<i)``; entry 0 is ``None``.

        Args:
            token_ids: shape ``(T,)``.
            top_logprobs: alternatives per position (0..20).

        Returns:
            A list of length ``T``.
        """

    @abc.abstractmethod
    async def load_adapter(self, name: str, path: str) -> None:
        """Load a PEFT-format adapter directory under ``name`` (a version name, never reused).

        Raises:
            ConflictError: ``name`` is already loaded.
            BadRequestError: the directory is not a valid adapter for this base model.
        """

    async def load_and_check(self, name: str, path: str, canary_token_ids: Sequence[int]) -> AdapterCheck:
        """Load an adapter version and run the checks it must pass before it serves.

        Hashes the weights file (sha256, to compare with the version's manifest), loads the directory
        under ``name`` (:meth:`load_adapter`) and scores ``canary_token_ids`` on it (:meth:`score`).
        Engines that can do better override it: the transformers engine hashes exactly the bytes it
        loads and runs load and canary in one pause of its decode loop.

        The adapter stays loaded whatever the returned values; the caller unloads it if a check fails.

        Args:
            path: a PEFT adapter directory holding ``adapter_model.safetensors``.
            canary_token_ids: shape ``(T,)``, ``T >= 2``.

        Raises:
            The errors of :meth:`load_adapter` and :meth:`score` (a failed score leaves the adapter
            loaded). ``OSError`` if the weights file cannot be read.
        """
        import asyncio
        from pathlib import Path

        from livelora.adapters.store import WEIGHTS_FILE, sha256_file

        digest = await asyncio.to_thread(sha256_file, Path(path) / WEIGHTS_FILE)
        await self.load_adapter(name, path)
        return AdapterCheck(sha256=digest, canary=await self.score(canary_token_ids, adapter=name))

    @abc.abstractmethod
    async def unload_adapter(self, name: str) -> None:
        """Unload an adapter. The caller ensures no running sequence uses it.

        Raises:
            ModelNotFoundError: ``name`` is not loaded.
        """

    @abc.abstractmethod
    def loaded_adapters(self) -> list[str]:
        """Names of the adapters currently loaded."""

    @abc.abstractmethod
    def num_unfinished_requests(self) -> int:
        """Sequences queued or running; an aborted one stops counting by the next engine step."""
