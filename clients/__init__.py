"""livelora's client side: the training-session SDK, wire types, errors and the recipes (the `livelora` command
itself is the composition root, :mod:`livelora.cli`). Names are imported lazily, so
``import livelora.clients.errors`` stays light.

Example (against ``livelora serve``)::

    from livelora.clients import AdamParams, Datum, ModelInput, ServiceClient

    with ServiceClient("http://127.0.0.1:8000") as service:
        tc = service.create_lora_training_client("smollm2-135m-instruct", rank=8)
        fb = tc.forward_backward(batch, "cross_entropy")       # returns a future at once
        opt = tc.optim_step(AdamParams(learning_rate=1e-4))    # pipelined: runs after fb, in seq order
        print(fb.result().metrics["loss:sum"])
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ServiceClient": "livelora.clients.service_client",
    "TrainingClient": "livelora.clients.training_client",
    "SamplingClient": "livelora.clients.sampling_client",
    "APIFuture": "livelora.clients.futures",
    "AdamParams": "livelora.clients.types.tinker",
    "Datum": "livelora.clients.types.tinker",
    "EncodedTextChunk": "livelora.clients.types.tinker",
    "ForwardBackwardOutput": "livelora.clients.types.tinker",
    "LoraConfig": "livelora.clients.types.tinker",
    "ModelInput": "livelora.clients.types.tinker",
    "OptimStepResponse": "livelora.clients.types.tinker",
    "SampledSequence": "livelora.clients.types.tinker",
    "SampleResponse": "livelora.clients.types.tinker",
    "SamplingParams": "livelora.clients.types.tinker",
    "TensorData": "livelora.clients.types.tinker",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'livelora.clients' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
