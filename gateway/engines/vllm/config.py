"""What the vLLM engine asks vLLM to run (:class:`VLLMConfig`): its settings, checked before vLLM is imported, and
the ``AsyncEngineArgs`` fields they become (:meth:`VLLMConfig.engine_kwargs`)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from livelora.clients.errors import BadRequestError
from livelora.gateway.engines.base import MAX_TOP_LOGPROBS
from livelora.gateway.settings import VLLM_LORA_RANKS, VLLMSection


class VLLMConfig:
    """The settings of one :class:`~livelora.gateway.engines.vllm.engine.VLLMEngine`.

    Args:
        device: ``"cuda"`` (or ``"cuda:0"``) or ``"cpu"``; must match the installed vLLM build
            (vLLM picks its platform itself; a mismatch is a :class:`BadRequestError` at start).
        dtype: weights dtype; default ``float32`` on CPU, ``bfloat16`` on CUDA.
        max_batch_size: vLLM ``max_num_seqs`` (sequences decoded together).
        max_waiting: unfinished requests beyond ``max_batch_size`` allowed; more get :class:`RateLimitError`.
        max_model_len: prompt + completion limit in tokens (default 1024 on CPU, the model's on GPU).
        max_loras, max_cpu_loras, max_lora_rank, gpu_memory_utilization, tensor_parallel_size, enforce_eager,
            enable_prefix_caching, snapshot_dir: see :class:`~livelora.gateway.settings.VLLMSection`
            (``None`` = from ``settings``).
        settings: the gateway's vLLM section (default: from the environment).
        kv_cache_space_gib: CPU only: ``VLLM_CPU_KVCACHE_SPACE`` if not already set (default 1).
        engine_args: extra ``AsyncEngineArgs`` fields (advanced; override everything above).

    Raises:
        BadRequestError: invalid settings (e.g. ``max_loras < 2``, ``max_cpu_loras < max_loras``, a rank vLLM
            does not support).
    """

    def __init__(
        self,
        *,
        device: str | None = None,
        dtype: str | None = None,
        max_batch_size: int = 64,
        max_waiting: int = 1024,
        max_model_len: int | None = None,
        max_loras: int | None = None,
        max_cpu_loras: int | None = None,
        max_lora_rank: int | None = None,
        gpu_memory_utilization: float | None = None,
        tensor_parallel_size: int | None = None,
        enforce_eager: bool | None = None,
        enable_prefix_caching: bool | None = None,
        snapshot_dir: str | Path | None = None,
        kv_cache_space_gib: int = 1,
        engine_args: dict[str, Any] | None = None,
        settings: VLLMSection | None = None,
    ):
        vs = settings or VLLMSection()
        self.device = device or "cuda"
        if self.device not in ("cpu", "cuda", "cuda:0"):
            raise BadRequestError(
                f"the vllm engine runs on 'cpu' or 'cuda' (all visible GPUs via "
                f"tensor_parallel_size), not {self.device!r}; select GPUs with "
                f"CUDA_VISIBLE_DEVICES",
                param="device",
            )
        self.on_cpu = self.device == "cpu"
        self.dtype = dtype or ("float32" if self.on_cpu else "bfloat16")
        if max_batch_size < 1:
            raise BadRequestError("max_batch_size must be >= 1", param="max_batch_size")
        self.max_batch_size = max_batch_size
        self.max_waiting = max_waiting
        self.max_model_len = max_model_len or (1024 if self.on_cpu else None)  # None: the model's
        self.max_loras = max_loras if max_loras is not None else vs.max_loras
        if self.max_loras < 2:
            raise BadRequestError(
                "max_loras must be >= 2 (the old and the new version run side by side during a swap)", param="max_loras"
            )
        cpu_loras = max_cpu_loras if max_cpu_loras is not None else vs.max_cpu_loras
        self.max_cpu_loras = cpu_loras if cpu_loras is not None else self.max_loras + 1
        if self.max_cpu_loras < self.max_loras:
            raise BadRequestError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})",
                param="max_cpu_loras",
            )
        self.max_lora_rank = max_lora_rank if max_lora_rank is not None else vs.max_lora_rank
        if self.max_lora_rank not in VLLM_LORA_RANKS:
            raise BadRequestError(
                f"max_lora_rank must be one of {VLLM_LORA_RANKS}, got {self.max_lora_rank}", param="max_lora_rank"
            )
        self.gpu_memory_utilization = gpu_memory_utilization or vs.gpu_memory_utilization
        self.tensor_parallel_size = tensor_parallel_size or vs.tensor_parallel_size
        eager = enforce_eager if enforce_eager is not None else vs.enforce_eager
        self.enforce_eager = self.on_cpu if eager is None else eager
        self.enable_prefix_caching = (
            enable_prefix_caching if enable_prefix_caching is not None else vs.enable_prefix_caching
        )
        snap = snapshot_dir or vs.snapshot_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        self.snapshot_dir = Path(snap)
        self.kv_cache_space_gib = kv_cache_space_gib
        self.engine_args = dict(engine_args or {})

    def model_len(self, limit: int) -> int:
        """The ``max_model_len`` to run with for a model of ``max_position_embeddings`` ``limit``.

        Raises:
            BadRequestError: the configured ``max_model_len`` exceeds ``limit``.
        """
        if self.max_model_len and self.max_model_len > limit:
            raise BadRequestError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings {limit}",
                param="max_model_len",
            )
        return self.max_model_len or limit

    def engine_kwargs(self, path: str, served_name: str, max_model_len: int) -> dict[str, Any]:
        """``AsyncEngineArgs`` fields for the model directory ``path`` (multi-LoRA on, raw logprobs, seed 0);
        :attr:`engine_args` override them."""
        kwargs: dict[str, Any] = dict(
            model=path,
            tokenizer=path,
            served_model_name=served_name,
            dtype=self.dtype,
            max_model_len=max_model_len,
            max_num_seqs=self.max_batch_size,
            enforce_eager=self.enforce_eager,
            enable_prefix_caching=self.enable_prefix_caching,
            enable_lora=True,
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras,
            max_logprobs=MAX_TOP_LOGPROBS,
            logprobs_mode="raw_logprobs",
            tensor_parallel_size=self.tensor_parallel_size,
            disable_log_stats=True,
            seed=0,
        )
        if not self.on_cpu:
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        kwargs.update(self.engine_args)
        return kwargs
