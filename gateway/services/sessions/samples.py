"""Tinker samples (``asample``) on the gateway's engine, delivered through the same Redis futures as training ops.

Every sample is admitted through :meth:`livelora.gateway.services.serving.serve.Serving.begin` (429 beyond the gateway's
sequence bound), metered for the caller's tenant, and may be cancelled while it runs (``cancel_future``).

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

from livelora.clients.errors import BadRequestError, LiveloraError, UnsupportedParameterError
from livelora.clients.types.tinker import SampledSequence, SampleRequest, SampleResponse, UntypedAPIFuture
from livelora.clients.types.tinker_ext import SampledSequenceV2, SampleRequestV2, SampleResponseV2
from livelora.core.api_keys import Principal
from livelora.core.session_protocol import future_failed, new_request_id
from livelora.gateway.engines.base import SamplingParams as EngineParams
from livelora.gateway.services.serving.generation import Job
from livelora.gateway.services.serving.serve import BASE_VERSION, Serving, ServingTarget
from livelora.gateway.services.serving.served import ServedRequest
from livelora.gateway.services.sessions.context import SessionContext
from livelora.gateway.services.sessions.futures import Futures
from livelora.gateway.services.sessions.sampling import SamplingSessions

log = logging.getLogger(__name__)


class Samples:
    """Runs the samples of sampling sessions (and ad-hoc ones) on the gateway's engine.

    Args:
        ctx: the session services' shared context.
        futures: where samples are delivered.
        serving: admits every sample (:meth:`~livelora.gateway.services.serving.serve.Serving.begin`).
        sessions: the sampling sessions (records and adapters) samples run on.
    """

    def __init__(self, ctx: SessionContext, futures: Futures, serving: Serving, sessions: SamplingSessions):
        self.ctx = ctx
        self.futures = futures
        self.serving = serving
        self.sessions = sessions
        self.redis = ctx.redis
        self.keys = ctx.keys
        self.settings = ctx.settings
        self.engine = ctx.engine
        self._tasks: set[asyncio.Task] = set()
        self._running: dict[str, asyncio.Task] = {}  # request id → its sampling task (cancel_future)

    async def close(self) -> None:
        """Stop every sampling task."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

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

    async def asample(self, req: SampleRequest, principal: Principal) -> UntypedAPIFuture:
        """Start sampling for ``principal`` (its tenant's quotas and meters); the :class:`SampleResponse` arrives
        through ``retrieve_future``.

        Raises:
            NotFoundError: unknown sampling session / checkpoint. BadRequestError: invalid parameters.
            RateLimitError: the gateway's sequence limit is reached (429, the SDK backs off and resubmits).
        """
        if req.sampling_session_id is not None:
            record = await self.sessions.record(req.sampling_session_id)
            scope = req.sampling_session_id
        else:
            self.ctx.check_base(req.base_model)
            record = await self.sessions.record_for_path(req.model_path, req.base_model, None, "adhoc")
            scope = "sample"
        _refuse_unsupported(req)
        await self.sessions.ensure_loaded(record)
        prompt = req.prompt.to_ints()
        if not prompt:
            raise BadRequestError("prompt has no tokens", param="prompt")
        params = self._engine_params(req, len(prompt))
        await self.serving.check_quota(("sample_prompt", "sampled", "scored"), principal)
        adapter = record.get("adapter")
        served = self.serving.begin(
            ServingTarget(scope, adapter, adapter or BASE_VERSION),
            [Job(prompt, params)] * req.num_samples,
            param="num_samples",
            principal=principal,
        )
        request_id = new_request_id(f"{scope}:{req.seq_id if req.seq_id is not None else 'x'}")
        seq_ids = [f"{request_id}:{i}" for i in range(req.num_samples)]
        try:
            await self.futures.create(request_id)
            if req.sampling_session_id is None:  # an ad-hoc sample's future is owned by its own record
                await self.redis.set(
                    self.keys.request_owner(request_id), principal.tenant, ex=self.settings.future_ttl_s
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
