"""Inference engines: the :class:`~.base.Engine` interface and its implementations.

Use :func:`create_engine` to build one by kind::

    from livelora.gateway.engines import SamplingParams, create_engine

    engine = create_engine("transformers", device="cpu", max_batch_size=16)
    await engine.start()
    async for chunk in engine.generate(prompt_ids, SamplingParams(max_tokens=32, temperature=0)):
        ...
"""

from __future__ import annotations

from typing import Any

from livelora.clients.errors import BadRequestError
from livelora.gateway.engines.base import Engine, FinishReason, GenerationChunk, SamplingParams, TokenLogprob

#: Engine kinds :func:`create_engine` knows.
ENGINE_KINDS = ("transformers", "vllm", "llama_cpp")


def create_engine(kind: str = "transformers", **kwargs: Any) -> Engine:
    """Build an (unstarted) engine of ``kind``; call ``await engine.start()`` before use.

    Args:
        kind: ``"transformers"`` (transformers + peft; CPU or one GPU) or ``"vllm"``
            (vLLM's AsyncLLM with multi-LoRA; needs vLLM installed, see
            :class:`~livelora.gateway.engines.vllm.engine.VLLMEngine`) or ``"llama_cpp"`` (a built-in GGUF model on
            the CPU; needs llama-cpp-python, see :class:`~livelora.gateway.engines.llama_cpp.engine.LlamaCppEngine`;
            with ``child_process=True`` llama.cpp runs in a supervised child process,
            :class:`~livelora.gateway.engines.llama_cpp.supervised.SupervisedLlamaCppEngine`).
        **kwargs: passed to the engine's constructor, e.g. for ``transformers``:
            ``model``, ``home``, ``device``, ``dtype``, ``max_batch_size``,
            ``max_model_len``, ``num_threads`` (see
            :class:`~livelora.gateway.engines.transformers.engine.TransformersEngine`).

    Raises:
        BadRequestError: unknown ``kind``.
    """
    if kind == "transformers":
        from livelora.gateway.engines.transformers.engine import TransformersEngine

        return TransformersEngine(**kwargs)
    if kind == "vllm":  # vLLM is imported by the engine's start(), never here
        from livelora.gateway.engines.vllm.engine import VLLMEngine

        return VLLMEngine(**kwargs)
    if kind == "llama_cpp":
        if kwargs.pop("child_process", False):  # the gateway's: llama.cpp in a supervised child process
            from livelora.gateway.engines.llama_cpp.supervised import SupervisedLlamaCppEngine

            return SupervisedLlamaCppEngine(**kwargs)
        from livelora.gateway.engines.llama_cpp.engine import LlamaCppEngine

        return LlamaCppEngine(**kwargs)
    raise BadRequestError(f"unknown engine kind {kind!r}; available: {', '.join(ENGINE_KINDS)}", param="engine")


__all__ = [
    "ENGINE_KINDS",
    "Engine",
    "FinishReason",
    "GenerationChunk",
    "SamplingParams",
    "TokenLogprob",
    "create_engine",
]
