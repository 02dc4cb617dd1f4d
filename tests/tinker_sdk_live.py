"""Drive a live livelora gateway with the **official tinker SDK** of the running venv (0.38.x or 0.24.1).

Run as ``<sdk venv>/bin/python tests/tinker_sdk_live.py`` with ``TINKER_BASE_URL`` / ``TINKER_API_KEY`` set and
``{"base_model", "texts": [[token ids], ...], "prompt": [token ids]}`` (JSON) on stdin; prints one JSON object
of what each public call returned (or the error it raised). Nothing here imports livelora: the SDK is used
exactly as a user would. :mod:`tests.test_tinker_sdk_live` asserts on the output.
"""

from __future__ import annotations

import asyncio
import json
import sys
import traceback
from typing import Any


def _err(exc: BaseException) -> dict[str, Any]:
    return {"error": f"{type(exc).__name__}: {exc}"[:2000]}


def main() -> dict[str, Any]:
    import tinker
    from tinker import types

    spec = json.load(sys.stdin)
    out: dict[str, Any] = {"version": tinker.__version__}
    v038 = not tinker.__version__.startswith("0.24")
    service = tinker.ServiceClient()
    tc = service.create_lora_training_client(base_model=spec["base_model"], rank=4)
    out["hub_id_accepted"] = service.create_lora_training_client(base_model=spec["hub_id"], rank=2).model_id
    out["model_id"] = tc.model_id
    info = tc.get_info()
    out["info"] = {"model_name": info.model_data.model_name, "tokenizer_id": info.model_data.tokenizer_id}
    try:  # resolved by the tokenizer_id the server reports (livelora hf-cache placed it in HF_HUB_CACHE)
        out["sdk_tokenizer"] = tc.get_tokenizer().encode("The sky is blue.")
    except Exception as exc:
        out["sdk_tokenizer"] = _err(exc)
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
        )
        for ids in spec["texts"]
    ]

    # pipelined forward_backward + optim_step (protobuf + zstd on 0.38), loss must fall
    losses = []
    for _ in range(4):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=2e-3))
        res = fb.result()
        opt.result()
        losses.append(res.metrics["loss:sum"])
        out["fb_logprob_lens"] = [len(o["logprobs"].tolist()) for o in res.loss_fn_outputs]
    out["losses"] = losses
    out["forward_loss"] = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]

    # an importance_sampling batch: proto tensors of three dtypes
    ids = spec["texts"][0]
    n = len(ids) - 1
    rl = [
        types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "logprobs": [-1.0] * n, "advantages": [0.5] * n},
        )
    ]
    out["is_metrics"] = tc.forward_backward(rl, "importance_sampling").result().metrics
    if v038:  # gspo with the cookbook rl_loop's sequence_ratio_mask (1 on the sampled tokens)
        gs = [
            types.Datum(
                model_input=rl[0].model_input,
                loss_fn_inputs={**rl[0].loss_fn_inputs, "sequence_ratio_mask": [0.0] + [1.0] * (n - 1)},
            )
        ]
        try:
            out["gspo_metrics"] = (
                tc.forward_backward(gs, "gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
                .result()
                .metrics
            )
        except Exception as exc:
            out["gspo_metrics"] = _err(exc)
    if v038:  # a refused loss fails its future; the next op still runs (its seq is consumed)
        try:
            tc.forward_backward(rl, "stable_reinforce").result()
            out["stable_reinforce"] = "accepted"
        except Exception as exc:
            out["stable_reinforce"] = _err(exc)
    out["optim_after_refused"] = tc.optim_step(types.AdamParams(learning_rate=1e-4)).result().metrics is not None

    # save with ttl, resume with optimizer: same forward loss
    try:
        path = tc.save_state("live-ckpt", ttl_seconds=7200).result().path
        out["save_state"] = path
        resumed = service.create_training_client_from_state_with_optimizer(path)
        out["resumed_forward_loss"] = resumed.forward(data, "cross_entropy").result().metrics["loss:sum"]
        out["forward_loss_again"] = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    except Exception as exc:
        out["save_state"] = _err(exc)

    # RestClient
    try:
        rest = service.create_rest_client()
        run = rest.get_training_run(tc.model_id).result()
        out["rest_run"] = {
            "id": run.training_run_id,
            "last_request_time": str(run.last_request_time),
            "last_checkpoint": run.last_checkpoint.checkpoint_id if run.last_checkpoint else None,
        }
        ck = rest.list_checkpoints(tc.model_id).result().checkpoints
        out["rest_checkpoints"] = [[c.checkpoint_id, str(c.expires_at)] for c in ck]
        out["rest_user_checkpoints"] = len(rest.list_user_checkpoints().result().checkpoints)
        out["rest_runs"] = [r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs]
    except Exception as exc:
        out["rest_run"] = _err(exc)

    # sampling: ephemeral sampler, sample_sequence_ids, top-k of the samples, prompt logprobs
    sampler = tc.save_weights_and_get_sampling_client()
    # the sampler's tokenizer, by the base-model name the server reports, and by the served name a user gives
    named = lambda: service.create_sampling_client(base_model=spec["base_model"])  # noqa: E731
    for key, make in (("sampler_tokenizer", lambda: sampler), ("named_sampler_tokenizer", named)):
        try:
            out[key] = make().get_tokenizer().encode("The sky is blue.")
        except Exception as exc:
            out[key] = _err(exc)
    prompt = types.ModelInput.from_ints(spec["prompt"])
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=0)
    kw = {"topk_sample_logprobs": 3} if v038 else {}
    res = sampler.sample(
        prompt=prompt, num_samples=2, sampling_params=params, include_prompt_logprobs=True, **kw
    ).result()
    out["samples"] = [
        {
            "tokens": list(s.tokens),
            "logprobs": list(s.logprobs),
            "stop_reason": s.stop_reason,
            "sequence_id": getattr(s, "sequence_id", None),
            "topk": [None if r is None else [list(p) for p in r] for r in (getattr(s, "topk_logprobs", None) or [])],
        }
        for s in res.sequences
    ]
    out["prompt_logprobs"] = res.prompt_logprobs
    out["compute_logprobs"] = sampler.compute_logprobs(prompt).result()
    if v038:
        for field, value in (
            ("target_prompt_logprobs", [[1] for _ in range(prompt.length - 1)]),
            ("prompt_alt_tokens_k", 2),
            ("record_stability_info", True),
        ):
            try:
                if field == "record_stability_info":
                    s2 = tc.save_weights_and_get_sampling_client(record_stability_info=True)
                    s2.sample(prompt=prompt, num_samples=1, sampling_params=params).result()
                else:
                    arg = (
                        types.TensorData.from_numpy(__import__("numpy").asarray(value, dtype="int64"))
                        if field == "target_prompt_logprobs"
                        else value
                    )
                    sampler.sample(prompt=prompt, num_samples=1, sampling_params=params, **{field: arg}).result()
                out[f"refused:{field}"] = "accepted"
            except Exception as exc:
                out[f"refused:{field}"] = _err(exc)

    # async variants
    async def run_async() -> dict[str, Any]:
        fut = await tc.forward_backward_async(data, "cross_entropy")
        r1 = await fut
        r2 = await tc.optim_step(types.AdamParams(learning_rate=1e-4))
        s = await sampler.sample_async(prompt=prompt, num_samples=1, sampling_params=params)
        return {"fb": r1.metrics["loss:sum"], "optim": r2.metrics is not None, "sample": len(s.sequences)}

    try:
        out["async"] = asyncio.run(run_async())
    except Exception as exc:
        out["async"] = _err(exc)
    return out


if __name__ == "__main__":
    try:
        result = main()
    except Exception as exc:
        result = {"fatal": _err(exc), "traceback": traceback.format_exc()[-4000:]}
    print(json.dumps(result, default=str))
