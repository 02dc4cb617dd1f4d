"""Engines by composition: each CPU backend implements the whole :class:`ModelBackend` interface with its signatures,
and none inherits from the loop or from another backend (docs/internals/engines.md#the-worker-loop)."""

from __future__ import annotations

import inspect

import pytest

from livelora.gateway.engines.batching import BatchingLoop, ModelBackend
from livelora.gateway.engines.llama_cpp.backend import LlamaBackend
from livelora.gateway.engines.residency import Residency
from livelora.gateway.engines.transformers.backend import TransformersBackend

pytestmark = pytest.mark.unit

BACKENDS = [TransformersBackend, LlamaBackend]


def _interface() -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(fn)
        for name, fn in vars(ModelBackend).items()
        if inspect.isfunction(fn) and not name.startswith("_")
    }


def test_the_interface_names_the_steps_the_loop_calls():
    assert set(_interface()) == {
        "set_threads",
        "prefill",
        "admit",
        "decode",
        "decoded",
        "drop",
        "reset",
        "score",
        "read_adapter",
        "install",
        "uninstall",
        "evict",
        "restore",
        "version_bytes",
        "close",
    }
    source = inspect.getsource(BatchingLoop) + inspect.getsource(Residency)  # (hot and cold versions)
    for name in _interface():  # every method is called by the loop (read_adapter: by the engine, off the thread)
        assert f"backend.{name}" in source or name == "read_adapter", name


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.__name__)
def test_a_backend_implements_every_method_with_the_interfaces_parameters(backend):
    for name, signature in _interface().items():
        method = getattr(backend, name, None)
        assert callable(method), f"{backend.__name__} lacks {name}"
        assert list(inspect.signature(method).parameters) == list(signature.parameters), name
    assert "threads" in inspect.getsource(backend.__init__)  # the attribute the loop reads to share the cores


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.__name__)
def test_a_backend_is_composed_not_derived(backend):
    assert backend.__mro__ == (backend, object)
    assert not issubclass(backend, BatchingLoop)
