"""Sampling sessions of Tinker clients: served by the gateway's engine, never by the trainer.

A sampling session runs on a sampler checkpoint's adapter version, loaded into the engine under its version name
(``<lineage>@<n>``, never reused). That name is also a served ``model`` for ``/v1/chat/completions``, because
the OpenAI routes resolve any loaded adapter by name. Results are written to the same Redis futures as training
ops. Every sample is admitted through :meth:`livelora.gateway.services.serving.Serving.begin` (429 beyond the
gateway's sequence bound). Adapters of ended sessions are unloaded by a janitor.

**Sampled logprobs** are those of the raw model distribution of the sampling weights (log_softmax of the logits
before temperature / top-k / top-p; :mod:`livelora.gateway.engines.base`). At temperature 1 with no top-k/top-p
they are the sampling distribution's and agree with ``compute_logprobs``; otherwise they are not the tempered
probabilities. The stop token (EOS or a stop token id) is part of ``tokens`` and its logprob is scored with the
same weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path
from typing import Any

from livelora.clients.errors import (
    BadRequestError,
    ConflictError,
    LiveloraError,
    NotFoundError,
    UnsupportedParameterError,
)
from livelora.clients.types.tinker import (
    CreateSamplingSessionRequest,
    CreateSamplingSessionResponse,
    GetSamplerResponse,
    SampledSequence,
    SampleRequest,
    SampleResponse,
    UntypedAPIFuture,
)
from livelora.clients.types.tinker_ext import SampledSequenceV2, SampleRequestV2, SampleResponseV2
from livelora.core.bus import redis_unavailable
from livelora.core.session_protocol import future_failed, new_request_id, resolve_checkpoint
from livelora.gateway.auth import caller_tenant
from livelora.gateway.engines.base import SamplingParams as EngineParams
from livelora.gateway.services.generation import Job
from livelora.gateway.services.serving import BASE_VERSION, ServedRequest, Serving, ServingTarget
from livelora.gateway.services.sessions.context import SessionContext
from livelora.gateway.services.sessions.futures import Futures

log = logging.getLogger(__name__)


class SamplingSessions:
    """Sampling sessions and ``asample`` on the gateway's engine.

    Args:
        ctx: the session services' shared context.
        futures: where samples are delivered.
        serving: admits every sample (:meth:`~livelora.gateway.services.serving.Serving.begin`).
    """

    def __init__(self, ctx: SessionContext, futures: Futures, serving: Serving):
        self.ctx = ctx
        self.futures = futures
        self.serving = serving
        self.redis = ctx.redis
        self.keys = ctx.keys
        self.settings = ctx.settings
        self.engine = ctx.engine
        self.home = ctx.home
        self.store = ctx.store
        self.base_model = ctx.base_model
        self._tasks: set[asyncio.Task] = set()
        self._running: dict[str, asyncio.Task] = {}  # request id → its sampling task (cancel_future)
        self._loads: dict[str, asyncio.Lock] = {}
        #: engine adapter name → session that loaded it (unloaded when the session ends)
        self.adapters: dict[str, str] = {}
        self._janitor: asyncio.Task | None = None

    async def start(self) -> None:
        """Start the janitor (unloads ended sessions' adapters)."""
        self._janitor = asyncio.create_task(self._janitor_loop())

    async def close(self) -> None:
        """Stop the janitor and every sampling task."""
        tasks = [t for t in [self._janitor, *self._tasks] if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    async def _janitor_loop(self) -> None:
        while True:
            await asyncio.sleep(min(2.0, self.settings.session_ttl_s / 2))
            try:
                await self.unload_ended_sessions()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("session janitor: %s", exc)

    async def unload_ended_sessions(self) -> None:
        """Unload engine adapters whose session key is gone (finished or expired); retried while in use."""
        for name, sid in list(self.adapters.items()):
            if await self.redis.exists(self.keys.session(sid)):
                continue
            try:
                if name in self.engine.loaded_adapters():
                    await self.engine.unload_adapter(name)
                self.adapters.pop(name, None)
            except ConflictError:
                pass  # still sampling; next round

    async def create_sampling_session(self, req: CreateSamplingSessionRequest) -> CreateSamplingSessionResponse:
        """A sampling session on a sampler checkpoint (``model_path``) or on the base model.

        Raises:
            NotFoundError: unknown session, base model or checkpoint. BadRequestError: a training checkpoint
            path, or neither ``model_path`` nor ``base_model``.
        """
        await self.ctx.require_session(req.session_id)
        self.ctx.check_base(req.base_model)
        sampling_id = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        record = await self._sampler_record_for_path(req.model_path, req.base_model, req.session_id, sampling_id)
        with redis_unavailable():
            await self.redis.set(self.keys.sampler(sampling_id), json.dumps(record), ex=self.settings.future_ttl_s)
        await self._ensure_loaded(record)
        return CreateSamplingSessionResponse(sampling_session_id=sampling_id)

    async def _sampler_record_for_path(
        self, model_path: str | None, base_model: str | None, session_id: str | None, sampling_id: str
    ) -> dict[str, Any]:
        record = {
            "sampler_id": sampling_id,
            "session_id": session_id,
            "base_model": self.base_model,
            "model_path": model_path,
            "adapter": None,
            "adapter_path": None,
        }
        if model_path is None:
            if base_model is None:
                raise BadRequestError("give model_path (a sampler checkpoint) or base_model", param="model_path")
            return record
        index, _, version = resolve_checkpoint(self.home, model_path, want="sampler_weights")
        manifest = self.store.get(index.lineage, version)
        record.update(adapter=manifest.name, adapter_path=str(self.store.version_dir(index.lineage, version)))
        return record

    async def _sampler_record(self, sampling_id: str) -> dict[str, Any]:
        with redis_unavailable():
            raw = await self.redis.get(self.keys.sampler(sampling_id))
        if raw is None:
            raise NotFoundError(
                f"sampling session {sampling_id!r} does not exist or has expired", param="sampling_session_id"
            )
        return json.loads(raw)

    async def get_sampler(self, sampling_id: str) -> GetSamplerResponse:
        record = await self._sampler_record(sampling_id)
        return GetSamplerResponse(
            sampler_id=sampling_id,
            base_model=record["base_model"],
            model_path=record.get("model_path"),
            adapter=record.get("adapter"),
        )

    async def ensure_sampler_loaded(self, sampling_id: str) -> None:
        await self._ensure_loaded(await self._sampler_record(sampling_id))

    async def _ensure_loaded(self, record: dict[str, Any]) -> None:
        """Load the record's adapter version into the engine once (concurrent callers wait for one load)."""
        name = record.get("adapter")
        if name is None or name in self.engine.loaded_adapters():
            return
        lock = self._loads.setdefault(name, asyncio.Lock())
        async with lock:
            if name not in self.engine.loaded_adapters():
                path = record.get("adapter_path")
                if not path or not Path(path).is_dir():
                    raise NotFoundError(
                        f"the weights of adapter {name} were deleted (their session ended)", param="sampling_session_id"
                    )
                await self.engine.load_adapter(name, path)
            if record.get("session_id"):
                self.adapters[name] = record["session_id"]

    async def join_sampling_session(self, sampling_id: str) -> int:
        """A new clone number of a sampling session (1, 2, ...; 0 is the original client): an unpickled
        SamplingClient numbers its sample ``seq_id`` from ``n * 10**9``, so clones never collide.

        Raises: NotFoundError for an unknown or expired sampling session.
        """
        await self._sampler_record(sampling_id)
        with redis_unavailable():
            n = int(await self.redis.incr(self.keys.sampler_clients(sampling_id)))
            await self.redis.expire(self.keys.sampler_clients(sampling_id), self.settings.future_ttl_s)
        return n

    async def retrieve_futures(
        self, sampling_id: str, clone: int, prev_cursor: int, timeout: float | None
    ) -> tuple[list[dict[str, Any]], int]:
        """Completions of a sampling session's samples after ``prev_cursor`` (a position in its completion list),
        those of clone ``clone`` only (sample ``seq_id // 10**9``); waits up to ``timeout`` (at most
        ``long_poll_s``) for one. Returns ``(completions, cursor)``.

        Raises: NotFoundError for an unknown or expired sampling session.
        """
        await self._sampler_record(sampling_id)
        key = self.keys.sampler_completions(sampling_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(self.settings.long_poll_s, timeout if timeout is not None else 30.0)
        while True:
            with redis_unavailable():
                rows = [json.loads(x) for x in await self.redis.lrange(key, max(0, prev_cursor), -1)]
            cursor = max(0, prev_cursor) + len(rows)
            mine = [
                {k: v for k, v in r.items() if k != "seq_id"}
                for r in rows
                if ((r.get("seq_id") or 0) // 10**9) == clone
            ]
            if mine or loop.time() >= deadline:
                return mine, cursor
            await asyncio.sleep(0.25)

    async def cancel_future(self, request_id: str) -> bool:
        """Cancel a running sample of this gateway: its future fails with ``cancelled`` (category user) and
        its engine sequences stop. Returns whether a running sample was cancelled (False: already done, or not
        a sample of this gateway). Training ops are never cancelled (their seq order is a contract).

        Raises:
            BadRequestError: ``request_id`` names a training op.
        """
        if ":train:" in request_id:
            raise BadRequestError(
                "training ops cannot be cancelled: every seq_id of a model runs in order", param="request_id"
            )
        task = self._running.get(request_id)
        if task is None or task.done():
            return False
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        await self.futures.resolve(
            request_id,
            future_failed(BadRequestError("the sample was cancelled by the client (cancel_future)", code="cancelled")),
        )
        return True

    def _engine_params(self, req: SampleRequest, prompt_len: int) -> EngineParams:
        sp = req.sampling_params
        eos = tuple(sorted(getattr(self.engine, "eos_token_ids", None) or {int(self.engine.tokenizer.eos_token_id)}))
        stop_strings: tuple[str, ...] = ()
        stop_ids: tuple[int, ...] = eos
        if isinstance(sp.stop, str):
            stop_strings = (sp.stop,)
        elif sp.stop is not None and len(sp.stop) == 0:
            stop_ids = ()
        elif sp.stop is not None and all(isinstance(s, str) for s in sp.stop):
            stop_strings = tuple(sp.stop)
        elif sp.stop is not None:
            stop_ids = tuple(sorted({*eos, *(int(t) for t in sp.stop)}))
        limit = int(self.engine.max_model_len)
        max_tokens = sp.max_tokens if sp.max_tokens is not None else limit - prompt_len
        if max_tokens < 1:
            raise BadRequestError(
                f"the prompt ({prompt_len} tokens) leaves no room to sample in the context of {limit} tokens",
                param="prompt",
            )
        return EngineParams(
            max_tokens=max_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=0 if sp.top_k in (-1, 0) else sp.top_k,
            seed=sp.seed,
            stop=stop_strings,
            stop_token_ids=stop_ids,
            ignore_eos=True,
            logprobs=True,
        )

    async def asample(self, req: SampleRequest) -> UntypedAPIFuture:
        """Start sampling; the :class:`SampleResponse` arrives through ``retrieve_future``.

        Raises:
            NotFoundError: unknown sampling session / checkpoint. BadRequestError: invalid parameters.
            RateLimitError: the gateway's sequence limit is reached (429, the SDK backs off and resubmits).
        """
        if req.sampling_session_id is not None:
            record = await self._sampler_record(req.sampling_session_id)
            scope = req.sampling_session_id
        else:
            self.ctx.check_base(req.base_model)
            record = await self._sampler_record_for_path(req.model_path, req.base_model, None, "adhoc")
            scope = "sample"
        _refuse_unsupported(req)
        await self._ensure_loaded(record)
        prompt = req.prompt.to_ints()
        if not prompt:
            raise BadRequestError("prompt has no tokens", param="prompt")
        params = self._engine_params(req, len(prompt))
        await self.serving.check_quota(("sample_prompt", "sampled", "scored"))
        adapter = record.get("adapter")
        served = self.serving.begin(
            ServingTarget(scope, adapter, adapter or BASE_VERSION),
            lambda: [Job(prompt, params)] * req.num_samples,
            param="num_samples",
        )
        request_id = new_request_id(f"{scope}:{req.seq_id if req.seq_id is not None else 'x'}")
        seq_ids = [f"{request_id}:{i}" for i in range(req.num_samples)]
        try:
            await self.futures.create(request_id)
            if req.sampling_session_id is None:  # an ad-hoc sample's future is owned by its own record
                await self.redis.set(
                    self.keys.request_owner(request_id), caller_tenant(), ex=self.settings.future_ttl_s
                )
        except BaseException:
            served.release()
            raise
        task = asyncio.create_task(self._sample(request_id, req, prompt, params, adapter, seq_ids, served))
        self._tasks.add(task)
        self._running[request_id] = task
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _t: self._running.pop(request_id, None))
        return UntypedAPIFuture(request_id=request_id, sample_sequence_ids=seq_ids)

    async def _sample(
        self,
        request_id: str,
        req: SampleRequest,
        prompt: list[int],
        params: EngineParams,
        adapter: str | None,
        seq_ids: list[str],
        served: ServedRequest,
    ) -> None:
        try:
            want_prompt_lp = bool(req.prompt_logprobs) or req.topk_prompt_logprobs > 0
            scored = self.engine.score(prompt, adapter, req.topk_prompt_logprobs) if want_prompt_lp else None
            topk_k = getattr(req, "topk_sample_logprobs", 0)
            samples = [
                self._one_sample(prompt, params, adapter, i, sid, f"{request_id}:{i}", served, topk_k)
                for i, sid in enumerate(seq_ids)
            ]
            results = await asyncio.gather(*(samples if scored is None else [scored, *samples]))
            seqs = results if scored is None else results[1:]
            out = SampleResponseV2(sequences=seqs) if topk_k else SampleResponse(sequences=seqs)
            if scored is not None:
                lps = results[0]
                last_n = getattr(req, "prompt_logprobs_last_n", None)
                if last_n is not None:  # only the last N positions are scored; earlier entries are None
                    lps = [None] * (len(lps) - last_n) + list(lps[len(lps) - last_n :])
                if req.prompt_logprobs:
                    out = out.model_copy(update={"prompt_logprobs": [None if t is None else t.logprob for t in lps]})
                if req.topk_prompt_logprobs:
                    out = out.model_copy(
                        update={
                            "topk_prompt_logprobs": [
                                None if t is None else [(int(a), float(b)) for a, b in t.top] for t in lps
                            ]
                        }
                    )
            record = json.dumps({"state": "done", "result": out.model_dump(mode="json", exclude_none=True)})
            subject = req.sampling_session_id.split(":", 1)[0] if req.sampling_session_id else "adhoc"
            await served.account(
                {
                    "sample_prompt": len(prompt),
                    "sampled": sum(len(q.tokens) for q in seqs),
                    "scored": len(prompt) if scored is not None else 0,
                },
                subject=subject,
            )
        except Exception as exc:
            if not isinstance(exc, LiveloraError):
                log.exception("sampling %s failed", request_id)
            record = future_failed(exc)
        finally:
            served.release()
        with contextlib.suppress(Exception):
            await self.futures.resolve(request_id, record)
            if req.sampling_session_id is not None:
                done = {
                    "state": "failed" if '"state": "failed"' in record else "finished",
                    "request_id": request_id,
                    "seq_id": req.seq_id,
                    "response_payload_uncompressed_size": len(record),
                }
                key = self.keys.sampler_completions(req.sampling_session_id)
                await self.redis.rpush(key, json.dumps(done))
                await self.redis.expire(key, self.settings.future_ttl_s)

    async def _one_sample(
        self,
        prompt: list[int],
        params: EngineParams,
        adapter: str | None,
        index: int,
        sequence_id: str,
        engine_request_id: str,
        served: ServedRequest | None = None,
        topk: int = 0,
    ) -> SampledSequence:
        """One sample; with ``topk`` > 0 also the ``topk`` most likely tokens (and their raw-model logprobs,
        nats) at every sampled position, from one scoring pass over prompt + sample with the same weights."""
        if params.seed is not None and index:
            from dataclasses import replace

            params = replace(params, seed=params.seed + index)  # distinct, reproducible samples
        tokens: list[int] = []
        logprobs: list[float] = []
        finish, stop_reason = "length", None
        async with served.ticket.run_slot() if served is not None else contextlib.nullcontext():  # a batch slot
            async for chunk in self.engine.generate(prompt, params, adapter=adapter, request_id=engine_request_id):
                if served is not None:
                    served.observe(index, chunk)
                tokens += chunk.token_ids
                logprobs += [lp.logprob for lp in chunk.logprobs or []]
                if chunk.finish_reason is not None:
                    finish, stop_reason = chunk.finish_reason, chunk.stop_reason
        if finish == "stop" and isinstance(stop_reason, int):  # the stop token: part of the sample, scored
            tokens.append(stop_reason)
            scored = await self.engine.score([*prompt, *tokens], adapter)
            logprobs.append(float(scored[-1].logprob))
        stop = "stop" if finish == "stop" else "length"
        if topk and tokens:
            rows = await self.engine.score([*prompt, *tokens], adapter, topk)
            top = [None if r is None else [(int(a), float(b)) for a, b in r.top] for r in rows[len(prompt) :]]
            return SampledSequenceV2(
                stop_reason=stop, tokens=tokens, logprobs=logprobs, sequence_id=sequence_id, topk_logprobs=top
            )
        return SampledSequence(stop_reason=stop, tokens=tokens, logprobs=logprobs, sequence_id=sequence_id)


def _refuse_unsupported(req: SampleRequest) -> None:
    """Refuse the SDK 0.38 sample fields livelora does not compute (never silently ignored).

    Raises:
        UnsupportedParameterError: ``target_prompt_logprobs`` (the engine scores the top-k, not arbitrary ids),
            ``prompt_alt_tokens_k`` > 0 (no draws at prompt positions), ``record_stability_info`` (only for
            ``stable_reinforce``, whose objective is unpublished and refused).
    """
    if not isinstance(req, SampleRequestV2):
        return
    if req.target_prompt_logprobs is not None:
        raise UnsupportedParameterError(
            "target_prompt_logprobs is not supported: livelora scores the top-k prompt "
            "tokens (topk_prompt_logprobs), not arbitrary token ids",
            param="target_prompt_logprobs",
        )
    if req.prompt_alt_tokens_k:
        raise UnsupportedParameterError(
            "prompt_alt_tokens_k is not supported: livelora does not draw alternative "
            "tokens at prompt positions; send 0",
            param="prompt_alt_tokens_k",
        )
    if req.record_stability_info:
        raise UnsupportedParameterError(
            "record_stability_info is not supported: it only feeds the stable_reinforce "
            "loss, whose objective is unpublished and which livelora refuses; use "
            "importance_sampling, ppo, cispo or gspo",
            param="record_stability_info",
        )
