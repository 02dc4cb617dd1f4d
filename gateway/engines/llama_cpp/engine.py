"""llama.cpp inference engine on the CPU (``LIVELORA_ENGINE=llama_cpp``; needs ``llama-cpp-python``).

:class:`LlamaCppEngine` serves a built-in model's GGUF file with continuous batching (the loop of
:mod:`livelora.gateway.engines.batching` over a :class:`~livelora.gateway.engines.llama_cpp.backend.LlamaBackend`): by
default its weights converted to float16 (``weights="f16"``; as close to the fp32 weights training uses as float16
rounding allows), or the file's own quantized types (``weights="gguf"``). Tokenization, sampling, stop handling,
logprobs and the adapter table are the transformers engine's, so both refuse and return the same things. Each
adapter version is converted to a GGUF LoRA when it loads and applied by llama.cpp; a version serving alone is merged
into a float16 copy of its own (:mod:`livelora.gateway.engines.llama_cpp.lane`). Logprobs are those of the weights
served. Measurements and fidelity: ``docs/serving.md``.
"""

from __future__ import annotations

import os

from livelora.clients.errors import BadRequestError
from livelora.gateway.engines.llama_cpp.model import GGUF_FORMATS
from livelora.gateway.engines.transformers.engine import TransformersEngine
from livelora.gateway.settings import LLAMA_CPP_MISSING

#: Default prompt + completion limit: llama.cpp keeps KV cells for ``max_batch_size + 3`` sequences of this many
#: tokens (running rows, scoring, prompt-prefix caches).
DEFAULT_MAX_MODEL_LEN = 4096


class LlamaCppEngine(TransformersEngine):
    """Serve a built-in GGUF base model (plus LoRA adapter versions) with llama.cpp.

    Args: as :class:`~livelora.gateway.engines.transformers.engine.TransformersEngine` but ``device`` must be ``cpu``,
    ``dtype`` unset, ``weights`` ``f16`` (default) or ``gguf``
    (:data:`~livelora.gateway.engines.llama_cpp.model.GGUF_FORMATS`); ``merge_lora``: a version that serves every row
    for a few steps gets a merged float16 copy of the model and a context of its own (f16 weights only; +258 MB and a
    KV cache as large as the base's for SmolLM2-135M); ``num_threads`` is llama.cpp's thread count (default: all
    cores; torch, which only samples here, gets one thread in this process); ``max_model_len`` defaults to
    :data:`DEFAULT_MAX_MODEL_LEN` (at most the model's training context).

    Raises:
        BadRequestError: a device other than the CPU, a dtype, weights other than f16 and gguf, or (from
            :meth:`start`) a base model that is not a built-in GGUF, or llama-cpp-python missing.
    """

    def __init__(
        self, model: str | None = None, *, device: str = "cpu", dtype: str | None = None, weights: str = "f16", **kw
    ):
        if device != "cpu":
            raise BadRequestError("the llama_cpp engine runs on the CPU", param="device")
        if dtype is not None:
            raise BadRequestError(
                "the llama_cpp engine serves the GGUF file's own types; leave dtype unset", param="dtype"
            )
        if weights not in GGUF_FORMATS:
            raise BadRequestError(
                f"the llama_cpp engine serves weights 'f16' (the GGUF's weights in float16) or 'gguf' (the file's "
                f"own types), not {weights!r}",
                param="weights",
            )
        super().__init__(model, device=device, **kw)
        self.weights = weights

    def start_sync(self) -> None:
        """Blocking version of :meth:`start`: the tokenizer and config of the transformers copy, the GGUF file in
        llama.cpp, and the batching loop over a :class:`~livelora.gateway.engines.llama_cpp.backend.LlamaBackend`.

        Raises:
            BadRequestError: llama-cpp-python missing, a model that is not a built-in GGUF, or ``max_model_len``
                above the model's context.
        """
        if self._worker is not None:
            return
        import torch

        config = self._load_tokenizer()
        threads = self.num_threads or os.cpu_count() or 1
        # torch only samples here; its OpenMP workers, spinning after each sampling op, would take the cores
        # llama.cpp's own OpenMP team needs next (8 streams: 102-106 tok/s with torch's default threads, 118-123
        # with one, docs/serving.md)
        torch.set_num_threads(1)
        worker = self._batching_loop(config, threads)
        worker.thread.start()
        self._worker = worker

    def _load_tokenizer(self):
        """Check the model is servable; load the tokenizer and set :attr:`max_model_len` and ``eos_token_ids``;
        returns the base model's transformers config.

        Raises:
            BadRequestError: see :meth:`start_sync`.
        """
        from transformers import AutoConfig

        from livelora.core.base_models import load_tokenizer, resolve_base_model

        self._check_servable()
        ref = resolve_base_model(self.model_name, self._home)  # the transformers copy: tokenizer and config
        tokenizer = load_tokenizer(ref)
        config = AutoConfig.from_pretrained(ref.path)
        limit = int(getattr(config, "max_position_embeddings", 0) or 0) or 2048
        if self._max_model_len_arg and self._max_model_len_arg > limit:
            raise BadRequestError(
                f"max_model_len {self._max_model_len_arg} exceeds the model's max_position_embeddings {limit}",
                param="max_model_len",
            )
        self.max_model_len = self._max_model_len_arg or min(limit, DEFAULT_MAX_MODEL_LEN)
        self.eos_token_ids = frozenset(_eos_ids(ref.path, tokenizer))
        self._tokenizer = tokenizer
        return config

    def _check_servable(self) -> None:
        """Raises :class:`BadRequestError` without llama-cpp-python or for a model that is not a built-in GGUF."""
        import importlib.util

        from livelora.core.base_models import BUILTIN_GGUF

        if importlib.util.find_spec("llama_cpp") is None:
            raise BadRequestError(LLAMA_CPP_MISSING, param="engine")
        if self.model_name not in BUILTIN_GGUF:
            raise BadRequestError(
                f"the llama_cpp engine serves the built-in GGUF models ({', '.join(BUILTIN_GGUF)}), "
                f"not {self.model_name!r}",
                param="model",
            )

    def _batching_loop(self, config, threads: int):
        """Open the served GGUF (:attr:`weights`) in llama.cpp and build the (not yet started) batching loop over
        it; ``config`` is the base model's transformers config, ``threads`` llama.cpp's thread count."""
        from livelora.core.base_models import gguf_location
        from livelora.core.cpu_share import ServingFlag, TrainingFlag
        from livelora.gateway.engines.batching import BatchingLoop
        from livelora.gateway.engines.llama_cpp.backend import LlamaBackend
        from livelora.gateway.engines.llama_cpp.lane import PREFIX_CACHES
        from livelora.gateway.engines.llama_cpp.model import LlamaModel, served_gguf
        from livelora.gateway.engines.residency import memory_bytes

        gguf = served_gguf(gguf_location(self.model_name), self.weights, self._home / "models" / "gguf")
        llama = LlamaModel(
            gguf,
            n_seq=self.max_batch_size + 1 + PREFIX_CACHES,
            n_ctx_seq=self.max_model_len,
            n_threads=threads,
        )
        self.vocab_size = llama.vocab_size
        share = None
        if self.share_cores:
            share = (TrainingFlag(self._home), threads, self.threads_while_training or max(1, threads // 2))
        return BatchingLoop(
            lambda schedule: LlamaBackend(
                llama,
                config,
                schedule,
                gguf=gguf if self.weights == "f16" else None,  # a quantized file cannot take a merged version
                merge=self.merge_lora,
            ),
            eos_ids=set(self.eos_token_ids),
            max_batch_size=self.max_batch_size,
            max_prefill_tokens=self.max_prefill_tokens,
            share=share,
            serving=ServingFlag(self._home),
            max_resident=self.max_loaded_versions,
            memory=memory_bytes("cpu"),
        )


def _eos_ids(path, tokenizer) -> set[int]:
    """The token ids that end a reply: the generation config's ``eos_token_id`` (where the model directory ``path``
    has one) and the tokenizer's."""
    from transformers import GenerationConfig

    eos_ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
        eos_ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:  # no generation_config.json
        pass
    if tokenizer.eos_token_id is not None:
        eos_ids.add(int(tokenizer.eos_token_id))
    return eos_ids
