"""``TrainingClient``: one LoRA training model on the server, driven op by op (Tinker's client shape).

Every method sends its request before returning and returns an :class:`~livelora.clients.futures.APIFuture`
at once; the request carries a ``seq_id`` reserved at call time (1, 2, 3, ...), and the server runs the
model's ops strictly in that order, so ``fb = tc.forward_backward(...); opt = tc.optim_step(...)`` without
waiting in between is safe (and faster). Gradients of ``forward_backward`` calls add up until
``optim_step``. Built-in losses are token **sums** (see :mod:`livelora.trainer.losses`).

Example::

    tc = service.create_lora_training_client("smollm2-135m-instruct", rank=8)
    fb = tc.forward_backward(batch, "cross_entropy")
    opt = tc.optim_step(AdamParams(learning_rate=1e-4))
    print(fb.result().metrics["loss:sum"], opt.result().metrics)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from livelora.clients.errors import BadRequestError, ConflictError
from livelora.clients.futures import APIFuture, SeqCounter
from livelora.clients.types.tinker import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    GetInfoResponse,
    LoadWeightsResponse,
    OptimStepResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    TensorData,
)

if TYPE_CHECKING:
    from livelora.clients.sampling_client import SamplingClient
    from livelora.clients.service_client import ServiceClient

CustomLossFn = Callable[[list[Datum], list[Any]], tuple[Any, Mapping[str, float]]]


class TrainingClient:
    """A training model (``model_id`` = ``{session_id}:train:{n}``). Made by :class:`ServiceClient` factories."""

    def __init__(self, service: ServiceClient, model_id: str, info: GetInfoResponse, *, first_seq: int = 1):
        self.service = service
        self.model_id = model_id
        self._info = info
        self._seq = SeqCounter(first_seq)
        self._submit_lock = threading.RLock()
        self._poisoned: str | None = None

    # ------------------------------------------------------------------------------------------ plumbing
    def _submit(
        self, send: Callable[[dict[str, Any]], dict[str, Any]], body: dict[str, Any], parse, seq_id: int | None = None
    ) -> APIFuture:
        if self._poisoned:
            raise ConflictError(f"this TrainingClient can no longer send ops: {self._poisoned}")
        with self._submit_lock:
            seq = self._seq.take() if seq_id is None else seq_id
            answer = send({**body, "model_id": self.model_id, "seq_id": seq})
        return APIFuture.polling(self.service.transport, answer["request_id"], parse)

    @property
    def _t(self):
        return self.service.transport

    # ------------------------------------------------------------------------------------------ training
    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, float | str] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Per-datum ``loss_fn_outputs[i]["logprobs"]`` (float32 [N_i], nats) and the loss's metrics; no gradient.

        Errors (bad shapes, unknown loss, ...) surface from ``result()`` as BadRequestError.
        """
        return self._submit(
            self._t.forward,
            {"forward_input": _fb_input(data, loss_fn, loss_fn_config)},
            ForwardBackwardOutput.model_validate,
        )

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, float | str] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Like :meth:`forward`, then accumulate the loss's gradients (until :meth:`optim_step`).

        ``metrics["loss:sum"]`` is the loss (nats summed over tokens for the token losses).
        """
        return self._submit(
            self._t.forward_backward,
            {"forward_backward_input": _fb_input(data, loss_fn, loss_fn_config)},
            ForwardBackwardOutput.model_validate,
        )

    def forward_backward_custom(self, data: Sequence[Datum], loss_fn: CustomLossFn) -> APIFuture[ForwardBackwardOutput]:
        """Gradients of any differentiable ``loss_fn(data, logprobs_D) -> (loss, metrics)`` (client-side, 2 passes).

        Pass 1: ``forward`` with ``cross_entropy`` gives ``logprobs_D`` (one float tensor [N_i] per datum).
        Then ``loss_fn`` runs here, and pass 2 is ``forward_backward`` with ``cross_entropy`` and
        ``weights = -∂loss/∂logprobs``: its parameter gradient equals ∂loss/∂θ exactly (linear surrogate;
        tinker SDK ``forward_backward_custom``). Only ``target_tokens`` reach the server. The result's
        ``metrics`` are the user's plus ``loss:sum`` (the custom loss) and ``surrogate_loss:sum``.
        Both seq ids are reserved now; if ``loss_fn`` fails, this client is poisoned (its seq id can never
        be sent, so later ops could not run).
        """
        import torch

        if self._poisoned:
            raise ConflictError(f"this TrainingClient can no longer send ops: {self._poisoned}")
        data = [d if isinstance(d, Datum) else Datum.model_validate(d) for d in data]
        for i, d in enumerate(data):
            if "target_tokens" not in d.loss_fn_inputs:
                raise BadRequestError(f"data[{i}].loss_fn_inputs.target_tokens is required", param="data")
        pass1 = [
            _with_inputs(
                d,
                {
                    "target_tokens": d.loss_fn_inputs["target_tokens"],
                    "weights": TensorData(
                        data=[0.0] * d.model_input.length, dtype="float32", shape=[d.model_input.length]
                    ),
                },
            )
            for d in data
        ]
        with self._submit_lock:
            first = self._seq.take(2)
            fwd = self.forward_backward_at(self._t.forward, "forward_input", pass1, first)
        second = first + 1

        def run() -> ForwardBackwardOutput:
            try:
                out = fwd.result()
                leaves = [out_i["logprobs"].to_torch().detach().requires_grad_(True) for out_i in out.loss_fn_outputs]
                loss, metrics = loss_fn(data, leaves)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise BadRequestError("the custom loss must return a scalar tensor", param="loss_fn")
                grads = torch.autograd.grad(loss.reshape(()), leaves, allow_unused=True)
            except BaseException as exc:
                self._poisoned = f"forward_backward_custom failed before its second pass: {exc}"
                raise
            pass2 = [
                _with_inputs(
                    d,
                    {
                        "target_tokens": d.loss_fn_inputs["target_tokens"],
                        "weights": TensorData.from_torch(
                            (-g if g is not None else torch.zeros_like(lp)).detach().float()
                        ),
                    },
                )
                for d, g, lp in zip(data, grads, leaves)
            ]
            res = self.forward_backward_at(self._t.forward_backward, "forward_backward_input", pass2, second).result()
            metrics = {
                **dict(metrics),
                "loss:sum": float(loss.detach()),
                "surrogate_loss:sum": res.metrics.get("loss:sum", 0.0),
            }
            return res.model_copy(update={"metrics": metrics})

        return APIFuture.from_callable(run)

    def forward_backward_at(self, send, key: str, data: list[Datum], seq_id: int) -> APIFuture[ForwardBackwardOutput]:
        """Send a cross-entropy ``forward`` / ``forward_backward`` under an already reserved ``seq_id``."""
        return self._submit(
            send, {key: _fb_input(data, "cross_entropy", None)}, ForwardBackwardOutput.model_validate, seq_id=seq_id
        )

    def optim_step(self, adam_params: AdamParams | None = None) -> APIFuture[OptimStepResponse]:
        """One AdamW step with the accumulated gradients (then zeroed). ``metrics``: grad_norm, update_norm, ..."""
        params = adam_params or AdamParams()
        return self._submit(
            self._t.optim_step,
            {"adam_params": params.model_dump(), "type": "optim_step"},
            OptimStepResponse.model_validate,
        )

    # ------------------------------------------------------------------------------------------ checkpoints
    def save_state(self, name: str, overwrite: bool = False) -> APIFuture[SaveWeightsResponse]:
        """Save weights **and** optimizer state as ``tinker://<model_id>/weights/<name>`` (resume exactly with
        :meth:`ServiceClient.create_training_client_from_state_with_optimizer`).

        Errors: ConflictError if ``name`` exists and not ``overwrite``; BadRequestError for an invalid name.
        """
        return self._submit(
            self._t.save_weights,
            {"path": name, "overwrite": overwrite, "type": "save_weights"},
            SaveWeightsResponse.model_validate,
        )

    def load_state(self, path: str, *, with_optimizer: bool = False) -> APIFuture[LoadWeightsResponse]:
        """Load a training checkpoint into this model (weights; and Adam state, step, RNG when ``with_optimizer``).

        Without the optimizer, the optimizer restarts fresh and accumulated gradients are dropped.
        """
        return self._submit(
            self._t.load_weights,
            {"path": path, "optimizer": with_optimizer, "type": "load_weights"},
            LoadWeightsResponse.model_validate,
        )

    def save_weights_for_sampler(self, name: str) -> APIFuture[SaveWeightsForSamplerResponse]:
        """Save the adapter (no optimizer) as ``tinker://<model_id>/sampler_weights/<name>`` (overwrites).

        The result's ``adapter`` is also a ``model`` name for ``/v1/chat/completions`` once a sampling client
        for the path exists.
        """
        return self._submit(
            self._t.save_weights_for_sampler,
            {"path": name, "type": "save_weights_for_sampler"},
            SaveWeightsForSamplerResponse.model_validate,
        )

    def save_weights_and_get_sampling_client(self) -> SamplingClient:
        """Snapshot the current weights (ephemeral: deleted with the session) and return a sampling client
        on them (blocks until the snapshot is saved and loaded for serving)."""
        from livelora.clients.sampling_client import SamplingClient

        sampling_seq = self.service._sampling_seq.take()
        fut = self._submit(
            self._t.save_weights_for_sampler,
            {"sampling_session_seq_id": sampling_seq, "type": "save_weights_for_sampler"},
            SaveWeightsForSamplerResponse.model_validate,
        )
        res = fut.result()
        return SamplingClient(
            self.service,
            res.sampling_session_id,
            base_model=self._info.model_name,
            adapter=res.adapter,
            tokenizer_id=self._info.model_data.tokenizer_id,
        )

    # ------------------------------------------------------------------------------------------ info
    def get_info(self) -> GetInfoResponse:
        """Model info (base model, LoRA rank/alpha, tokenizer id), fetched from the server."""
        self._info = GetInfoResponse.model_validate(self._t.get_info(self.model_id))
        return self._info

    def get_tokenizer(self):
        """The base model's Hugging Face tokenizer, from the files the server serves (``GET /api/v1/tokenizer``,
        kept in ``~/.cache/livelora/tokenizers``): no request to the hub, so it works offline on any machine that
        reaches the server; by ``model_data.tokenizer_id`` from the hub only for a server without that route.

        Raises:
            UnavailableError: neither the server, the local cache nor the hub has it.
        """
        from livelora.clients.service_client import load_tokenizer

        return load_tokenizer(self._info.model_data.tokenizer_id or self._info.model_name, self.service.transport)


def _fb_input(data: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, Any] | None) -> dict[str, Any]:
    items = [d if isinstance(d, Datum) else Datum.model_validate(d) for d in data]
    body: dict[str, Any] = {"data": [d.model_dump(mode="json") for d in items], "loss_fn": loss_fn}
    if loss_fn_config is not None:
        body["loss_fn_config"] = dict(loss_fn_config)
    return body


def _with_inputs(datum: Datum, inputs: dict[str, TensorData]) -> Datum:
    return Datum(model_input=datum.model_input, loss_fn_inputs=inputs)
