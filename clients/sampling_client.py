"""``SamplingClient``: sample from, and score with, one set of weights on the server (Tinker's client shape).

Sampling requests are not ordered; each returns an :class:`~livelora.clients.futures.APIFuture` at once.

Logprobs (both ``SampledSequence.logprobs`` and :meth:`SamplingClient.compute_logprobs`) are of the **raw
model distribution** of these weights: log_softmax of the logits before temperature, top-k and top-p,
in nats. At temperature 1 with no top-k/top-p they are the sampling distribution's, and the logprob of
a sampled token equals ``compute_logprobs`` of the same sequence at that position (up to float noise).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from livelora.clients.futures import APIFuture, SeqCounter
from livelora.clients.types.tinker import ModelInput, SampleResponse, SamplingParams

if TYPE_CHECKING:
    from livelora.clients.service_client import ServiceClient


class SamplingClient:
    """A sampling session (``sampling_session_id``) on a sampler checkpoint, a snapshot, or the base model.

    Attributes:
        adapter: the engine adapter serving these weights (None = base model). It is also a ``model`` name
            for ``/v1/chat/completions`` while the session lives.
    """

    def __init__(
        self,
        service: ServiceClient,
        sampling_session_id: str,
        *,
        base_model: str | None,
        adapter: str | None,
        tokenizer_id: str | None = None,
    ):
        self.service = service
        self.sampling_session_id = sampling_session_id
        self.base_model = base_model
        self.adapter = adapter
        self._tokenizer_id = tokenizer_id
        self._seq = SeqCounter(0)
        self._lock = threading.Lock()

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
    ) -> APIFuture[SampleResponse]:
        """Draw ``num_samples`` completions of ``prompt``.

        Each ``SampledSequence`` has ``tokens`` (the stop token included when one ended it), ``logprobs`` (one
        per token, raw distribution: see the module docstring), ``stop_reason`` and ``sequence_id``.
        ``include_prompt_logprobs`` adds ``prompt_logprobs`` (len(prompt), None at 0);
        ``topk_prompt_logprobs=k`` adds the k most likely ``(token_id, logprob)`` per prompt position.

        Raises (at once): BadRequestError for invalid parameters, NotFoundError if the session ended,
        RateLimitError when the server is full.
        """
        params = sampling_params or SamplingParams()
        body = {
            "num_samples": num_samples,
            "prompt": prompt.model_dump(mode="json"),
            "sampling_params": params.model_dump(mode="json", exclude_none=True),
            "sampling_session_id": self.sampling_session_id,
            "seq_id": self._seq.take(),
            "prompt_logprobs": include_prompt_logprobs,
            "topk_prompt_logprobs": topk_prompt_logprobs,
            "type": "sample",
        }
        answer = self.service.transport.asample(body)
        ids = answer.get("sample_sequence_ids")

        def parse(record: dict) -> SampleResponse:
            res = SampleResponse.model_validate(record)
            if ids and len(ids) == len(res.sequences):
                res = res.model_copy(
                    update={"sequences": [s.model_copy(update={"sequence_id": i}) for s, i in zip(res.sequences, ids)]}
                )
            return res

        return APIFuture.polling(self.service.transport, answer["request_id"], parse)

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        """``log p(token_i | tokens_<i)`` for every token of ``prompt`` (nats; entry 0 is None).

        Implemented as Tinker does: one ``sample`` of 1 token with prompt logprobs.
        """
        fut = self.sample(prompt, 1, SamplingParams(max_tokens=1), include_prompt_logprobs=True)
        return fut.map(lambda res: list(res.prompt_logprobs or []))

    def get_tokenizer(self):
        """The base model's tokenizer (see :meth:`TrainingClient.get_tokenizer`)."""
        from livelora.clients.service_client import load_tokenizer

        if self._tokenizer_id is None:
            self._tokenizer_id = self.service._tokenizer_id()
        return load_tokenizer(self._tokenizer_id, self.service.transport)

    def get_base_model(self) -> str | None:
        return self.base_model
