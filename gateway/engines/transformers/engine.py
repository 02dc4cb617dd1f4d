"""transformers + peft inference engine with continuous batching (CPU or one GPU).

:class:`TransformersEngine` is the asyncio face; the model lives on one worker thread
(:class:`~livelora.gateway.engines.batching.BatchingLoop` over a
:class:`~livelora.gateway.engines.transformers.backend.TransformersBackend`) that steps every running sequence
together, reached through :mod:`livelora.gateway.engines.transformers.calls`; the adapter names it serves are held by
:class:`~livelora.gateway.engines.transformers.adapters.LoadedAdapters`. Requests that arrive while others run join
the batch between decode steps, a sequence's tokens do not depend on its batch companions, and one batch may mix the
base model and several adapter versions (``tests/test_engine_contract.py``). Validation errors are raised by
:meth:`TransformersEngine.generate` itself, before iteration. The guarantees in full: ``docs/internals/engines.md``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from livelora.clients.errors import BadRequestError, RateLimitError, UnavailableError
from livelora.gateway.engines.base import (
    AdapterCheck,
    Engine,
    GenerationChunk,
    SamplingParams,
    TokenLogprob,
    check_sampling_params,
    check_score_request,
    check_token_ids,
    resolve_stop_strings,
)
from livelora.gateway.engines.detokenize import IncrementalDetokenizer, StopStringMatcher
from livelora.gateway.engines.sampling import Penalties, RowSampling, make_generator
from livelora.gateway.engines.transformers.adapters import LoadedAdapters
from livelora.gateway.engines.transformers.calls import no_consumer, on_worker, stream


class TransformersEngine(Engine):
    """Serve one base model (plus LoRA adapters) with transformers + peft.

    Args:
        model: base-model name (built-in, local directory or HF id), resolved by
            :func:`livelora.core.base_models.resolve_base_model`.
        home: ``LIVELORA_HOME`` (default: from the environment / settings).
        device: ``"cpu"`` or ``"cuda"``/``"cuda:N"``.
        dtype: torch dtype name; default ``float32`` on CPU, ``bfloat16`` on CUDA.
        max_batch_size: sequences decoded together; further requests wait.
        max_waiting: queued requests at most; beyond it :class:`RateLimitError`.
        max_model_len: prompt + completion limit in tokens (default: the model
            config's ``max_position_embeddings``; never above it).
        max_prefill_tokens: padded prompt tokens per prefill forward pass.
        num_threads: ``torch.set_num_threads`` value (process-wide); ``None`` keeps torch's default.
        share_cores: share the cores with training steps on this machine (:mod:`livelora.core.cpu_share`):
            while a step runs the engine uses ``threads_while_training`` threads (``None``: half of its threads,
            at least 1), all of them otherwise. On the CPU the engine also beats the machine's
            :class:`~livelora.core.cpu_share.ServingFlag` while it serves (a trainer process then keeps to its
            thread budget).
        merge_lora: serve an adapter version that every row of a batch uses from merged weights
            (:class:`~.lora_slots.MergedVersion`; ``LIVELORA_ENGINE_MERGE_LORA``).
        weights: served weight format, ``fp32``, ``bf16``, ``int8`` or ``int4`` (:mod:`.quantized`;
            ``LIVELORA_ENGINE_WEIGHTS``); ``bf16`` loads the model in bfloat16 whatever ``dtype`` says.
        max_loaded_versions: adapter versions whose weights stay in memory at most; the others loaded are cold
            and loaded back on demand (:mod:`~livelora.gateway.engines.residency`;
            ``LIVELORA_ENGINE_MAX_LOADED_VERSIONS``; ``None``: derived from the device's memory).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        home: str | Path | None = None,
        device: str = "cpu",
        dtype: str | None = None,
        max_batch_size: int = 16,
        max_waiting: int = 1024,
        max_model_len: int | None = None,
        max_prefill_tokens: int = 8192,
        num_threads: int | None = None,
        share_cores: bool = False,
        threads_while_training: int | None = None,
        merge_lora: bool = True,
        weights: str = "fp32",
        max_loaded_versions: int | None = None,
    ):
        from livelora.core.settings import CommonSettings
        from livelora.gateway.engines.quantized import WEIGHT_FORMATS

        if weights not in WEIGHT_FORMATS:
            raise BadRequestError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}", param="weights")
        if max_batch_size < 1:
            raise BadRequestError("max_batch_size must be >= 1", param="max_batch_size")
        if max_loaded_versions is not None and max_loaded_versions < 1:
            raise BadRequestError("max_loaded_versions must be >= 1", param="max_loaded_versions")
        self.max_loaded_versions = max_loaded_versions
        settings = CommonSettings()
        self.model_name = model or settings.model
        self._home = Path(home) if home is not None else settings.home
        self.device = device
        self.dtype = "bfloat16" if weights == "bf16" else dtype or ("float32" if device == "cpu" else "bfloat16")
        self.weights = weights
        self.max_batch_size = max_batch_size
        self.max_waiting = max_waiting
        self._max_model_len_arg = max_model_len
        self.max_model_len = max_model_len or 0  # set by start() from the model config
        self.max_prefill_tokens = max_prefill_tokens
        self.num_threads = num_threads
        self.share_cores, self.threads_while_training = share_cores, threads_while_training
        self.merge_lora = merge_lora
        self._tokenizer = None
        self._worker = None
        self._adapters = LoadedAdapters()  # names loaded and loading; loads and unloads on the worker
        self.vocab_size = 0

    # ----- lifecycle -----------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            raise UnavailableError("the engine is not started")
        return self._tokenizer

    async def start(self) -> None:
        """Load tokenizer and weights (in a thread) and start the worker. Idempotent."""
        if self._worker is not None:
            return
        await asyncio.to_thread(self.start_sync)

    def start_sync(self) -> None:
        """Blocking version of :meth:`start` (for scripts and fixtures)."""
        if self._worker is not None:
            return
        import torch

        from livelora.core.base_models import load_model, load_tokenizer, resolve_base_model
        from livelora.gateway.engines.batching import BatchingLoop
        from livelora.gateway.engines.residency import memory_bytes
        from livelora.gateway.engines.transformers.backend import TransformersBackend

        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        ref = resolve_base_model(self.model_name, self._home)
        tokenizer = load_tokenizer(ref)
        model = load_model(ref, dtype=self.dtype, device=self.device)
        from livelora.gateway.engines.quantized import serve_weights

        serve_weights(model, self.weights)
        limit = int(getattr(model.config, "max_position_embeddings", 0) or 0) or 2048
        if self._max_model_len_arg and self._max_model_len_arg > limit:
            raise BadRequestError(
                f"max_model_len {self._max_model_len_arg} exceeds the model's max_position_embeddings {limit}",
                param="max_model_len",
            )
        self.max_model_len = self._max_model_len_arg or limit
        self.vocab_size = int(model.config.vocab_size)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos_ids)
        from livelora.core.cpu_share import ServingFlag, TrainingFlag

        share = None
        if self.share_cores:
            full = torch.get_num_threads()
            share = (TrainingFlag(self._home), full, self.threads_while_training or max(1, full // 2))
        # beaten whenever the engine runs on the CPU, so that a trainer process on this machine keeps to its
        # thread budget while requests are served (also when the engine never changes its own thread count)
        serving = ServingFlag(self._home) if self.device == "cpu" else None
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        worker = BatchingLoop(
            lambda schedule: TransformersBackend(
                model,
                pad_id,
                self.device,
                schedule,
                merge=self.merge_lora and self.weights != "int4",  # a merge would leave the int4 grid
                quantize=self.weights == "int8",
            ),
            eos_ids=set(eos_ids),
            max_batch_size=self.max_batch_size,
            max_prefill_tokens=self.max_prefill_tokens,
            share=share,
            serving=serving,
            max_resident=self.max_loaded_versions,
            memory=memory_bytes(self.device),
        )
        worker.thread.start()
        self._tokenizer, self._worker = tokenizer, worker

    async def close(self) -> None:
        """Abort every running or queued sequence and stop the worker thread."""
        worker, self._worker = self._worker, None
        if worker is not None:
            await asyncio.to_thread(worker.stop)

    def _require_worker(self):
        if self._worker is None:
            raise UnavailableError("the engine is not started")
        return self._worker

    def num_unfinished_requests(self) -> int:
        return 0 if self._worker is None else self._worker.num_unfinished()

    @property
    def decode_steps(self) -> int:
        """Decode steps run so far (all sequences together count one per step)."""
        return 0 if self._worker is None else self._worker.steps

    # ----- validation ----------------------------------------------------------------
    def _check_tokens(self, token_ids: Sequence[int], param: str) -> list[int]:
        return check_token_ids(token_ids, self.vocab_size, param)

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
            UnavailableError: the engine is not started.
            BadRequestError: invalid parameters or token ids.
            ContextLengthExceededError: ``len(prompt) + max_tokens > max_model_len``.
            ModelNotFoundError: ``adapter`` is not loaded.
            RateLimitError: ``max_waiting`` requests are already queued.
        """
        from livelora.gateway.engines.batching import Sequence as _Seq

        worker = self._require_worker()
        prompt = self._check_tokens(prompt_token_ids, "prompt")
        params = self._check_params(params, len(prompt))
        self._adapters.check(adapter)
        if len(worker.waiting) >= self.max_waiting:
            raise RateLimitError(f"{len(worker.waiting)} requests are queued; retry later", retry_after=1.0)
        sampling = RowSampling(
            float(params.temperature),
            float(params.top_p),
            int(params.top_k),
            make_generator(params.seed),
            int(params.top_logprobs),
            min_p=float(params.min_p),
        )
        if (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) != (1, 0, 0):
            sampling.penalties = Penalties(
                params.repetition_penalty, params.presence_penalty, params.frequency_penalty, tuple(prompt)
            )
        if params.min_tokens:
            ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            sampling.banned = tuple(sorted(ends))
        seq = _Seq(
            request_id or uuid.uuid4().hex,
            prompt,
            params,
            adapter,
            sampling,
            IncrementalDetokenizer(self._tokenizer, skip_special_tokens=params.skip_special_tokens),
            StopStringMatcher(params.stop, params.include_stop_str_in_output),
            deliver=no_consumer,
        )
        return stream(worker, seq)

    async def score(
        self, token_ids: Sequence[int], adapter: str | None = None, top_logprobs: int = 0
    ) -> list[TokenLogprob | None]:
        """See :meth:`Engine.score`. Runs on the worker between decode steps.

        Raises:
            BadRequestError: empty or out-of-vocabulary ``token_ids``; ``top_logprobs`` outside 0..20.
            ContextLengthExceededError: more than :attr:`max_model_len` tokens.
            ModelNotFoundError: ``adapter`` is not loaded.
        """
        worker = self._require_worker()
        ids = check_score_request(token_ids, top_logprobs, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        self._adapters.check(adapter)
        return await on_worker(worker, lambda: worker.score(ids, adapter, top_logprobs))

    # ----- adapters ------------------------------------------------------------------
    async def load_adapter(self, name: str, path: str) -> None:
        """See :meth:`Engine.load_adapter`. The files are read on a thread; the weights are installed on the
        worker between decode steps (a copy into a free LoRA slot, see :mod:`.lora_slots`).

        Raises:
            BadRequestError: empty name, missing directory, not LoRA, or weights that do not fit.
            ConflictError: ``name`` is loaded (names are never reloaded in place).
        """
        await self._adapters.load(self._require_worker(), name, path, None)

    async def load_and_check(self, name: str, path: str, canary_token_ids: Sequence[int]) -> AdapterCheck:
        """See :meth:`Engine.load_and_check`: the weights file is read once, and its sha256 is that of
        exactly the bytes loaded; install and canary forward run in one pause of the decode loop.

        Raises:
            The errors of :meth:`load_adapter` and :meth:`score` (nothing stays loaded if the canary
            request itself is invalid).
        """
        worker = self._require_worker()
        ids = check_score_request(canary_token_ids, 0, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        digest, canary = await self._adapters.load(worker, name, path, ids)
        return AdapterCheck(sha256=digest, canary=canary)

    async def unload_adapter(self, name: str) -> None:
        """See :meth:`Engine.unload_adapter`.

        Raises:
            ModelNotFoundError: ``name`` is not loaded.
            ConflictError: a queued or running sequence still uses it (nothing changes).
        """
        await self._adapters.unload(self._require_worker(), name)

    def loaded_adapters(self) -> list[str]:
        return self._adapters.names()
