"""Which inference engines the engine tests run on, and with which settings."""

from __future__ import annotations

import importlib.util
import os

import torch

from livelora.gateway.engines import ENGINE_KINDS

#: keyword arguments of :func:`~livelora.gateway.engines.create_engine` per kind
ENGINE_KWARGS = {
    "transformers": {"device": "cpu", "max_batch_size": 8},
    "vllm": {"device": "cuda" if torch.cuda.is_available() else "cpu", "max_batch_size": 8, "max_model_len": 1024},
}


def engine_kinds_under_test() -> list[str]:
    """``$LIVELORA_TEST_ENGINES`` (comma-separated kinds), else transformers plus vllm when it is installed."""
    env = os.environ.get("LIVELORA_TEST_ENGINES", "").strip()
    if env:
        return [k.strip() for k in env.split(",") if k.strip()]
    return [k for k in ENGINE_KINDS if k != "vllm" or importlib.util.find_spec("vllm") is not None]
