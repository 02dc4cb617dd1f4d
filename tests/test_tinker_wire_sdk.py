"""The tinker wire codec against the **official SDKs** (tinker 0.38.0 and 0.24.1), run in their own venvs.

Requests: the SDK's own resource methods build and send each body (captured by ``tinker_sdk_oracle.py``),
and our decoder / request models must read the right values. Responses: our encoders' bytes and our
response models' JSON go through the SDK's own decoders and pydantic models. The venvs come from
``.ci/setup-tinker-sdks`` (``.venv-tinker038``, ``.venv-tinker024``) or ``LIVELORA_TINKER038_PYTHON`` /
``LIVELORA_TINKER024_PYTHON``; without them these tests skip.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from livelora.clients.types import tinker as t
from livelora.clients.types import tinker_ext as x
from livelora.clients.types import tinker_rest as r
from livelora.gateway.api import tinker_wire as wire
from livelora.gateway.api.tinker_wire import schema

ROOT = Path(__file__).resolve().parent.parent
ORACLE = Path(__file__).resolve().parent / "tinker_sdk_oracle.py"
sys.path.insert(0, str(ORACLE.parent))
from harness.sdks import sdk_python  # noqa: E402
from tinker_sdk_oracle import descriptor_signature  # noqa: E402  (found through the sys.path entry above)


def run_oracle(version: str, ops: dict[str, dict]) -> dict[str, dict]:
    python = sdk_python(version)
    if python is None:
        pytest.skip(f"no tinker SDK venv for {version}: run .ci/setup-tinker-sdks")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINKER_")}
    env.update(TINKER_TELEMETRY="0", PYTHONPATH="")
    names = list(ops)
    proc = subprocess.run(
        [str(python), str(ORACLE)],
        input=json.dumps({"ops": [ops[n] for n in names]}),
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=str(ROOT),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(zip(names, json.loads(proc.stdout)["results"]))


def ok(result: dict) -> dict:
    assert "error" not in result, result.get("traceback", result)
    return result


# ================================================================================================ request specs
def _in(values, dtype, form="tensordata"):
    return {"values": values, "dtype": dtype, "form": form}


PROMPT_RL = {
    "chunks": [[5, 6], [7, 8]],
    "inputs": {
        "target_tokens": _in([6, 7, 8, 9], "int64", "numpy"),
        "logprobs": _in([0.0, 0.0, -0.5, -1.25], "float32", "list"),
        "advantages": _in([0.0, 0.0, 1.5, 1.5], "float32"),
    },
}
SFT = {
    "chunks": [[1, 2, 3]],
    "inputs": {"target_tokens": _in([2, 3, 4], "int64", "list"), "weights": _in([0.0, 1.0, 1.0], "float32", "list")},
}
GSPO = {**PROMPT_RL, "inputs": {**PROMPT_RL["inputs"], "sequence_ratio_mask": _in([0.0, 0.0, 1.0, 1.0], "float32")}}
STABLE = {
    **PROMPT_RL,
    "spans": {
        "model_input": [["prompt", "seq-a", 0, 3], ["sampled", "seq-a", 0, 1]],
        "loss_fn_inputs": [["prompt", "seq-a", 1, 2], ["sampled", "seq-a", 0, 2]],
    },
}
TOPK_2D = {
    "chunks": [[1, 2, 3]],
    "inputs": {  # mostly padding: the Datum sends CSR
        "target_tokens": _in([[2, 0, 0, 0, 0, 0], [3, 9, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0]], "int64", "torch"),
        "weights": _in([[1.0, 0, 0, 0, 0, 0], [0.75, 0.25, 0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0]], "float32", "torch"),
    },
}

FWDBWD = {  # name → (loss_fn, loss_fn_config, data, flags)
    "cross_entropy": ("cross_entropy", None, [SFT, SFT], {}),
    "forward_only": ("cross_entropy", None, [SFT], {"forward_only": True}),
    "importance_sampling": ("importance_sampling", None, [PROMPT_RL], {}),
    "ppo_zstd": ("ppo", {"clip_low_threshold": 0.75, "clip_high_threshold": 1.25}, [PROMPT_RL], {"compress": True}),
    "cispo": ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}, [PROMPT_RL], {}),
    "dro": ("dro", {"beta": 0.05}, [PROMPT_RL], {}),
    "gspo": ("gspo", None, [GSPO], {}),
    "stable_reinforce": ("stable_reinforce", {"kl_coeff": 0.5}, [STABLE], {}),
    "custom": ("custom", {"loss_id": "loss-7"}, [SFT], {}),
    "topk_2d": ("cross_entropy", None, [TOPK_2D], {}),
}
LOSSES_024 = ("cross_entropy", "forward_only", "importance_sampling", "ppo_zstd", "cispo", "dro", "topk_2d")


def fwdbwd_op(name: str, seq_id: int) -> dict:
    loss_fn, config, data, flags = FWDBWD[name]
    return {
        "op": "fwdbwd_body",
        "model_id": "sess-1:train:0",
        "seq_id": seq_id,
        "loss_fn": loss_fn,
        "loss_fn_config": config,
        "data": data,
        **flags,
    }


SPARSE_TARGET = [[-1] * 4 for _ in range(5)]
SPARSE_TARGET[1][0], SPARSE_TARGET[4][2] = 17, 23
SAMPLE_BODIES = {
    "all_fields": {
        "prompt": [1, 2, 3, 4],
        "num_samples": 3,
        "sampling_session_id": "sess-1:sample:0",
        "seq_id": 5,
        "sampling_params": {
            "max_tokens": 8,
            "temperature": 0.5,
            "top_k": 5,
            "top_p": 0.9,
            "seed": 11,
            "stop": ["\n\n"],
        },
        "prompt_logprobs": True,
        "topk_prompt_logprobs": 3,
        "topk_sample_logprobs": 2,
        "target_prompt_logprobs": _in([[5, -1], [6, 7], [-1, -1]], "int64"),
        "prompt_alt_tokens_k": 2,
        "prompt_logprobs_last_n": 2,
        "record_stability_info": True,
    },
    "sparse_target": {
        "prompt": [1, 2, 3, 4, 5, 6],
        "sampling_session_id": "s:sample:1",
        "seq_id": 0,
        "sampling_params": {"max_tokens": 1, "stop": [7, 8]},
        "target_prompt_logprobs": {**_in(SPARSE_TARGET, "int64", "sparse"), "pad": -1},
    },
    "compute_logprobs": {
        "prompt": [9, 8, 7],
        "sampling_session_id": "s:sample:2",
        "seq_id": 1,
        "sampling_params": {"max_tokens": 1},
        "prompt_logprobs": True,
    },
}

NOW = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
JSON_BODIES = {  # name → (op kwargs, our request model or None when it must be refused)
    "create_model": (
        {
            "session_id": "s",
            "model_seq_id": 0,
            "base_model": "b",
            "lora_config": {"rank": 8, "seed": 3},
            "user_metadata": {"k": "v"},
        },
        t.CreateModelRequest,
    ),
    "optim_step": (
        {"model_id": "m", "seq_id": 4, "params": {"learning_rate": 2e-4, "grad_clip_norm": 1.0}},
        t.OptimStepRequest,
    ),
    "optim_step_dimuon": ({"model_id": "m", "seq_id": 4, "params": {"type": "dimuon", "learning_rate": 0.01}}, None),
    "save_weights": (
        {
            "model_id": "m",
            "seq_id": 5,
            "path": "step-1",
            "ttl_seconds": 7200,
            "overwrite": True,
            "user_metadata": {"renderer_name": "role_colon"},
        },
        t.SaveWeightsRequest,
    ),
    "save_weights_for_sampler": (
        {"model_id": "m", "seq_id": 6, "path": "s-1", "ttl_seconds": 3600},
        t.SaveWeightsForSamplerRequest,
    ),
    "save_weights_for_sampler_inflight": (
        {"model_id": "m", "seq_id": 7, "sampling_session_seq_id": 2, "kind": "inflight"},
        t.SaveWeightsForSamplerRequest,
    ),
    "save_weights_external": (
        {"model_id": "m", "seq_id": 8, "path": "download", "ttl_seconds": 3600},
        x.SaveWeightsExternalRequest,
    ),
    "load_weights": (
        {
            "session_id": "s",
            "model_seq_id": 1,
            "path": "tinker://m/weights/step-1",
            "optimizer": True,
            "user_metadata": {"created_by": "cli"},
            "optimizer_config": {"type": "adamw"},
        },
        t.LoadWeightsRequest,
    ),
    "copy_weights": (
        {"source_path": "tinker://m/weights/step-1", "destination_project_id": "p", "ttl_seconds": 3600},
        r.CopyWeightsRequest,
    ),
    "join_sampling_session": ({"sampling_session_id": "s:sample:0"}, r.JoinSamplingSessionRequest),
    "retrieve_futures": (
        {
            "target": {"sampling_session_id": "s:sample:0", "cloned_sampler_id": 1},
            "prev_cursor": 4,
            "timeout": 30.0,
            "retrieved_request_ids": ["a"],
        },
        r.FuturesRetrieveRequest,
    ),
    "create_sampling_session": (
        {"session_id": "s", "sampling_session_seq_id": 3, "model_path": "tinker://m/sampler_weights/s-1"},
        t.CreateSamplingSessionRequest,
    ),
    "create_session": (
        {"tags": ["a"], "user_metadata": None, "sdk_version": "0.38.0", "display_name": "run"},
        t.CreateSessionRequest,
    ),
    "retrieve_future": ({"request_id": "r-1", "allow_metadata_only": True}, t.FutureRetrieveRequest),
}
JSON_BODIES_024 = (
    "create_model",
    "optim_step",
    "save_weights",
    "save_weights_for_sampler",
    "load_weights",
    "create_sampling_session",
    "create_session",
    "retrieve_future",
)


# ================================================================================================ response specs
def sample_response(full: bool = True) -> x.SampleResponseV2:
    """A result using every field (``full=False``: only what SDK 0.24 reads)."""
    resp = x.SampleResponseV2(
        sequences=[
            x.SampledSequenceV2(
                stop_reason="stop",
                tokens=[21, 2],
                logprobs=[-0.25, -1.5],
                topk_logprobs=[[(21, -0.25), (30, -2.5)], [(2, -1.5)]] if full else None,
            ),
            x.SampledSequenceV2(
                stop_reason="length",
                tokens=[22, 23, 24],
                logprobs=[-0.5, -0.75, -1.0],
                topk_logprobs=[None, [(23, -0.75)], [(24, -1.0), (25, -3.0)]] if full else None,
            ),
        ],
        prompt_logprobs=[None, None, -3.0, -0.5],
        topk_prompt_logprobs=[None, None, [(7, -3.0)], [(8, -0.5), (9, -1.0)]],
        target_prompt_logprobs=x.WireTensorData(
            data=[-1.5, -2.5],
            dtype="float32",
            shape=[5, 4],
            sparse_crow_indices=[0, 0, 1, 1, 1, 2],
            sparse_col_indices=[0, 2],
        ),
        prompt_alt_tokens=x.PromptAltTokens(
            tokens=t.TensorData(data=[4, 5, 6, 7, 8, 9], dtype="int64", shape=[3, 2]),
            logprobs=t.TensorData(data=[-0.125] * 6, dtype="float32", shape=[3, 2]),
        ),
        prompt_cache_hit_tokens=3,
    )
    return resp if full else resp.model_copy(update={"target_prompt_logprobs": None, "prompt_alt_tokens": None})


def fwdbwd_outputs() -> list[t.ForwardBackwardOutput]:
    lp = t.TensorData
    return [
        t.ForwardBackwardOutput(
            loss_fn_outputs=[
                {"logprobs": lp(data=[-1.0, -2.0], dtype="float32", shape=[2])},
                {"logprobs": lp(data=[-0.5], dtype="float32", shape=[1])},
            ],
            metrics={"loss:sum": 3.5, "tokens:sum": 3.0},
        ),
        t.ForwardBackwardOutput(
            loss_fn_outputs=[{"logprobs": lp(data=[-1.0, -2.0, -3.0, -4.0], dtype="float32", shape=[2, 2])}],
            metrics={"loss:sum": 10.0, "tokens:sum": 2.0},
        ),
    ]


def ckpt(kind="weights", name="step-1", **kw) -> r.CheckpointV2:
    ctype = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}[kind]
    return r.CheckpointV2(
        checkpoint_id=f"{kind}/{name}",
        checkpoint_type=ctype,
        time=NOW,
        tinker_path=f"tinker://sess-1:train:0/{kind}/{name}",
        size_bytes=1234,
        **kw,
    )


def rest_models(version: str) -> dict[str, tuple[str, object]]:
    run = r.TrainingRunV2(
        training_run_id="sess-1:train:0",
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        model_owner="local",
        is_lora=True,
        lora_rank=8,
        last_request_time=NOW,
        last_checkpoint=ckpt(expires_at=NOW + timedelta(days=7), user_metadata={"a": "b"}),
        last_sampler_checkpoint=ckpt("sampler_weights", "s-1"),
        user_metadata={"renderer_name": "x"},
    )
    cursor = t.Cursor(offset=0, limit=20, total_count=1)
    models = {
        "TrainingRun": ("TrainingRun", run),
        "TrainingRunsResponse": ("TrainingRunsResponse", r.TrainingRunsResponse(training_runs=[run], cursor=cursor)),
        "CheckpointsListResponse": (
            "CheckpointsListResponse",
            r.CheckpointsListResponseV2(
                checkpoints=[ckpt(), ckpt("sampler_weights", "s-1", public=True)], cursor=cursor
            ),
        ),
        "WeightsInfoResponse": (
            "WeightsInfoResponse",
            r.WeightsInfoResponseV2(base_model="b", is_lora=True, lora_rank=8, train_mlp=True),
        ),
        "GetSessionResponse": (
            "GetSessionResponse",
            r.GetSessionResponse(training_run_ids=["sess-1:train:0"], sampler_ids=["sess-1:sample:0"]),
        ),
        "ListSessionsResponse": ("ListSessionsResponse", r.ListSessionsResponse(sessions=["sess-1"])),
        "GetInfoResponse": (
            "GetInfoResponse",
            t.GetInfoResponse(
                model_id="sess-1:train:0",
                model_name="b",
                lora_rank=8,
                lora_alpha=16.0,
                model_data=t.ModelData(arch="LlamaForCausalLM", model_name="b", tokenizer_id="HuggingFaceTB/SmolLM2"),
            ),
        ),
    }
    if version == "038":
        models.update(
            {
                "CheckpointsListResponse_external": (
                    "CheckpointsListResponse",
                    r.CheckpointsListResponseV2(checkpoints=[ckpt("external_weights", "download")]),
                ),
                "ExternalWeightsUrlsResponse": (
                    "ExternalWeightsUrlsResponse",
                    r.ExternalWeightsUrlsResponse(urls={"adapter_model.safetensors": "http://h/x?sig=1"}, expires=NOW),
                ),
                "CopyWeightsResponse": (
                    "CopyWeightsResponse",
                    r.CopyWeightsResponse(tinker_path="tinker://c/weights/y"),
                ),
                "SessionSearchResponse": (
                    "SessionSearchResponse",
                    r.SessionSearchResponse(
                        sessions=[
                            r.SessionSummary(
                                session_id="sess-1",
                                created_at=NOW,
                                owner="local",
                                project_id="default",
                                checkpoints_count=2,
                                status={"type": "client_finished", "reason": {"type": "success"}, "detail": None},
                            )
                        ]
                    ),
                ),
                "JoinSamplingSessionResponse": (
                    "JoinSamplingSessionResponse",
                    r.JoinSamplingSessionResponse(client_counter=1),
                ),
                "FuturesRetrieveResponse": (
                    "FuturesRetrieveResponse",
                    r.FuturesRetrieveResponse(
                        completions=[
                            r.FutureFinished(request_id="a", response_payload_uncompressed_size=10),
                            r.FutureFailed(request_id="b"),
                        ],
                        cursor=3,
                    ),
                ),
                "ClientDynamicConfigResponse": ("ClientDynamicConfigResponse", r.ClientDynamicConfigResponse()),
                "SaveWeightsExternalResponse": (
                    "SaveWeightsExternalResponseInternal",
                    x.SaveWeightsExternalResponse(path="tinker://m/external_weights/download", size_bytes=99),
                ),
            }
        )
    return models


def dump(model) -> dict:
    return model.model_dump(mode="json", exclude_none=True, by_alias=True)


def all_ops(version: str) -> dict[str, dict]:
    ops: dict[str, dict] = {"version": {"op": "version"}, "schema": {"op": "schema"}}
    names = FWDBWD if version == "038" else LOSSES_024
    for name in names:
        ops[f"fb:{name}"] = fwdbwd_op(name, list(FWDBWD).index(name) + 1)
    for name, body in SAMPLE_BODIES.items():
        if version == "038" or name == "compute_logprobs":
            ops[f"sample:{name}"] = {"op": "sample_body", "request": body}
    for name, (kwargs, _) in JSON_BODIES.items():
        if version == "038" or name in JSON_BODIES_024:
            ops[f"json:{name}"] = {"op": name.removesuffix("_dimuon").removesuffix("_inflight"), "kwargs": kwargs}
    ops["decode:sample"] = {
        "op": "decode_sample",
        "body_b64": b64(wire.encode_sample_response(sample_response(version == "038"))),
        "sample_sequence_ids": ["sq-0", "sq-1"] if version == "038" else None,
    }
    ops["decode:fwdbwd"] = {
        "op": "decode_fwdbwd",
        "bodies_b64": [b64(wire.encode_forward_backward_output(o)) for o in fwdbwd_outputs()],
    }
    for name, (sdk_type, model) in rest_models(version).items():
        ops[f"rest:{name}"] = {"op": "validate", "type": sdk_type, "data": dump(model)}
    if version == "024":
        ops["fb_json"] = {**fwdbwd_op("ppo_zstd", 9), "json": True}
    ops["client"] = client_op(version)
    ops["rest:old_TrainingRun"] = {
        "op": "validate",
        "type": "TrainingRun",
        "data": dump(t.TrainingRun(training_run_id="m", base_model="b")),
    }
    return ops


CLIENT_SAMPLE = x.SampleResponseV2(
    sequences=[
        x.SampledSequenceV2(stop_reason="length", tokens=[4, 5, 6, 7], logprobs=[-0.5, -0.25, -1.0, -2.0]),
        x.SampledSequenceV2(stop_reason="stop", tokens=[8, 2], logprobs=[-0.75, -0.125]),
    ],
    prompt_logprobs=[None, -2.5, -3.5],
)


def client_op(version: str) -> dict:
    """The SDK's public clients against a fake server that answers with our encodings."""

    def js(value, status=200):
        return {"status": status, "json": value}

    def proto(body: bytes):
        return {"status": 200, "content_type": wire.PROTO_CONTENT_TYPE, "body_b64": b64(body)}

    config = {"use_pyqwest_transport": False, "proto_compress_fwdbwd": True, "proto_write_fwdbwd": True}
    info = t.GetInfoResponse(
        model_id="sess-1:train:0", model_name="b", lora_rank=4, model_data=t.ModelData(model_name="b", tokenizer_id="b")
    )
    routes = {
        "POST /api/v1/client/config": js(config),
        "POST /api/v1/client/dynamic_config": js({}),
        "POST /api/v1/create_session": js(dump(t.CreateSessionResponse(session_id="sess-1"))),
        "POST /api/v1/session_heartbeat": js(dump(t.SessionHeartbeatResponse())),
        "POST /api/v1/create_model": js(dump(t.UntypedAPIFuture(request_id="cm-1", model_id="sess-1:train:0"))),
        "POST /api/v1/get_info": js(dump(info)),
        "POST /api/v1/forward_backward": js(dump(t.UntypedAPIFuture(request_id="fb-1", model_id="sess-1:train:0"))),
        "POST /api/v1/create_sampling_session": js(
            dump(t.CreateSamplingSessionResponse(sampling_session_id="sess-1:sample:0"))
        ),
        "POST /api/v1/asample": js(dump(t.UntypedAPIFuture(request_id="smp-1", sample_sequence_ids=["sq-0", "sq-1"]))),
        "POST /api/v1/sessions/sess-1/finish": js({}),
    }
    futures = {
        "cm-1": [js({"model_id": "sess-1:train:0", "type": "create_model"})],
        "fb-1": [
            js(dump(t.TryAgainResponse(request_id="fb-1")), 408),
            proto(wire.encode_forward_backward_output(fwdbwd_outputs()[0])),
        ],
        "smp-1": [proto(wire.encode_sample_response(CLIENT_SAMPLE))],
    }
    return {
        "op": "client_roundtrip",
        "routes": routes,
        "futures": futures,
        "base_model": "b",
        "loss_fn": "cross_entropy",
        "data": [SFT, SFT],
        "prompt": [1, 2, 3],
    }


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module", params=["038", "024"])
def sdk(request):
    """(version, {op name: oracle result}): every op of one SDK, run in one subprocess."""
    return request.param, run_oracle(request.param, all_ops(request.param))


# ================================================================================================ tests
def test_sdk_versions(sdk):
    version, res = sdk
    assert ok(res["version"])["version"] == {"038": "0.38.0", "024": "0.24.1"}[version]


def test_schema_matches_the_sdks_field_by_field(sdk):
    """Our declaration equals the SDK 0.38 descriptor exactly (names, numbers, types, oneofs, presence);
    SDK 0.24's is a subset of it (same numbers and types; 0.24 named TopkLogprobs TopkPromptLogprobs)."""
    version, res = sdk
    theirs = ok(res["schema"])["messages"]
    ours = json.loads(json.dumps(descriptor_signature(schema.ForwardBackwardRequest.DESCRIPTOR.file)))
    if version == "038":
        assert theirs == ours
        return
    rename = {"TopkPromptLogprobs": "TopkLogprobs"}
    for message, fields in theirs.items():
        mine = ours[rename.get(message, message)]
        for number, (_, ftype, ref, repeated, _, _) in fields.items():
            if isinstance(ref, list):
                ref = [*ref[:3], rename.get(ref[3], ref[3])]
            got = mine[number]
            assert (got[1], got[2], got[3]) == (
                ftype,
                rename.get(ref, ref) if isinstance(ref, str) else ref,
                repeated,
            ), (message, number)


@pytest.mark.parametrize("name", list(FWDBWD))
def test_forward_backward_bodies_sent_by_the_sdk_decode(sdk, name):
    version, res = sdk
    if f"fb:{name}" not in res:
        pytest.skip(f"{name} does not exist in SDK {version}")
    cap = ok(res[f"fb:{name}"])
    loss_fn, config, data, flags = FWDBWD[name]
    assert (cap["method"], cap["path"], cap["content_type"]) == (
        "POST",
        "/api/v1/forward_backward",
        "application/x-protobuf",
    )
    assert cap["content_encoding"] == ("zstd" if flags.get("compress") else None)
    raw = wire.decode_content(base64.b64decode(cap["body_b64"]), cap["content_encoding"])
    req = wire.decode_forward_backward(raw)
    assert (req.model_id, req.seq_id) == ("sess-1:train:0", list(FWDBWD).index(name) + 1)
    assert req.forward_only is bool(flags.get("forward_only"))
    assert req.forward_backward_input.loss_fn == loss_fn
    assert req.forward_backward_input.loss_fn_config == config
    for got, spec in zip(req.forward_backward_input.data, data, strict=True):
        assert [c.tokens for c in got.model_input.chunks] == spec["chunks"]
        assert set(got.loss_fn_inputs) == set(spec["inputs"])
        for key, inp in spec["inputs"].items():
            want = np.asarray(inp["values"])
            tensor = got.loss_fn_inputs[key]
            assert (tensor.dtype, tensor.resolved_shape()) == (inp["dtype"], list(want.shape)), key
            assert tensor.data == want.reshape(-1).tolist(), key
        spans = spec.get("spans")
        if spans is None:
            assert got.model_input_spans is None and got.loss_fn_input_spans is None
        else:
            for field, key in (("model_input_spans", "model_input"), ("loss_fn_input_spans", "loss_fn_inputs")):
                assert [[s.kind, s.sequence_id, s.offset, s.length] for s in getattr(got, field)] == spans[key]
    if name == "topk_2d":  # the SDK really sent CSR, and we densified it
        msg = schema.ForwardBackwardRequest()
        msg.ParseFromString(raw)
        assert msg.data[0].loss_fn_inputs["target_tokens"].WhichOneof("encoding") == "sparse_csr"
    if name == "custom" or name == "stable_reinforce":  # text config values travel only in the v2 map
        msg = schema.ForwardBackwardRequest()
        msg.ParseFromString(raw)
        assert set(msg.loss_fn_config_v2) == set(config)


def test_sdk_024_json_forward_backward_stays_json(sdk):
    """Without ``proto_write_fwdbwd`` SDK 0.24 sends the JSON body the server reads today."""
    version, res = sdk
    if version != "024":
        pytest.skip("SDK 0.38 always sends protobuf")
    cap = ok(res["fb_json"])
    assert (cap["content_type"], cap["content_encoding"]) == ("application/json", None)
    req = t.ForwardBackwardRequest.model_validate(json.loads(base64.b64decode(cap["body_b64"])))
    assert (req.model_id, req.seq_id, req.forward_backward_input.loss_fn) == ("sess-1:train:0", 9, "ppo")
    assert req.forward_backward_input.data[0].loss_fn_inputs["logprobs"].data == [0.0, 0.0, -0.5, -1.25]


@pytest.mark.parametrize("name", list(SAMPLE_BODIES))
def test_sample_bodies_sent_by_the_sdk_validate(sdk, name):
    version, res = sdk
    if f"sample:{name}" not in res:
        pytest.skip(f"{name} uses fields SDK {version} does not have")
    cap = ok(res[f"sample:{name}"])
    assert (cap["path"], cap["content_type"]) == ("/api/v1/asample", "application/json")
    body = json.loads(base64.b64decode(cap["body_b64"]))
    spec = SAMPLE_BODIES[name]
    req = x.SampleRequestV2.model_validate(body)
    assert req.prompt.to_ints() == spec["prompt"]
    assert (req.sampling_session_id, req.seq_id, req.num_samples) == (
        spec["sampling_session_id"],
        spec["seq_id"],
        spec.get("num_samples", 1),
    )
    for key, value in spec["sampling_params"].items():
        assert getattr(req.sampling_params, key) == value, key
    for key in (
        "prompt_logprobs",
        "topk_prompt_logprobs",
        "topk_sample_logprobs",
        "prompt_alt_tokens_k",
        "prompt_logprobs_last_n",
        "record_stability_info",
    ):
        if key in spec:
            assert getattr(req, key) == spec[key], key
    if "target_prompt_logprobs" in spec:
        assert (
            req.target_prompt_logprobs.dense(-1).data
            == np.asarray(spec["target_prompt_logprobs"]["values"]).reshape(-1).tolist()
        )
        assert req.target_prompt_logprobs.is_sparse is (spec["target_prompt_logprobs"]["form"] == "sparse")
    if name != "compute_logprobs":  # what the server accepts today refuses the 0.38 fields
        with pytest.raises(ValidationError, match="Extra inputs"):
            t.SampleRequest.model_validate(body)


@pytest.mark.parametrize("name", list(JSON_BODIES))
def test_json_bodies_sent_by_the_sdk_validate(sdk, name):
    version, res = sdk
    if f"json:{name}" not in res:
        pytest.skip(f"{name} does not exist in SDK {version}")
    kwargs, model = JSON_BODIES[name]
    cap = ok(res[f"json:{name}"])
    kwargs = {k: v for k, v in kwargs.items() if k not in cap["dropped"]}  # fields the older SDK lacks
    body = json.loads(base64.b64decode(cap["body_b64"]))
    if model is None:  # the Dimuon optimizer: refused (phase B must name it in the error), never ignored
        assert body["optimizer_params"]["type"] == "dimuon"
        with pytest.raises(ValidationError):
            t.OptimStepRequest.model_validate(body)
        return
    parsed = model.model_validate(body).model_dump(mode="json", exclude_none=True)
    if "params" in kwargs:
        kwargs = {**{k: v for k, v in kwargs.items() if k != "params"}, "adam_params": kwargs["params"]}
    for key, value in kwargs.items():
        if isinstance(value, dict):
            assert {k: parsed[key][k] for k in value} == value, key
        elif value is not None:
            assert parsed[key] == value, key


def test_sample_response_read_by_the_sdk(sdk):
    version, res = sdk
    got = ok(res["decode:sample"])
    want = sample_response(version == "038")
    for i, (seq, exp) in enumerate(zip(got["sequences"], want.sequences, strict=True)):
        assert (seq["stop_reason"], seq["tokens"], seq["logprobs"]) == (exp.stop_reason, exp.tokens, exp.logprobs)
        if version == "038":
            assert seq["sequence_id"] == f"sq-{i}"
            assert seq["topk_logprobs"] == [None if r is None else [list(p) for p in r] for r in exp.topk_logprobs]
    assert got["prompt_logprobs"] == [None, None, -3.0, -0.5]
    assert got["topk_prompt_logprobs"] == [None, None, [[7, -3.0]], [[8, -0.5], [9, -1.0]]]
    if version == "038":
        assert got["target_prompt_logprobs"] == {
            "data": [-1.5, -2.5],
            "dtype": "float32",
            "shape": [5, 4],
            "crow": [0, 0, 1, 1, 1, 2],
            "col": [0, 2],
        }
        alt = got["prompt_alt_tokens"]
        assert (alt["tokens"]["data"], alt["tokens"]["shape"], alt["tokens"]["dtype"]) == (
            [4, 5, 6, 7, 8, 9],
            [3, 2],
            "int64",
        )
        assert alt["logprobs"]["data"] == [-0.125] * 6
        assert got["prompt_cache_hit_tokens"] == 3


def test_forward_backward_output_read_and_combined_by_the_sdk(sdk):
    _, res = sdk
    got = ok(res["decode:fwdbwd"])
    first, second = got["each"]
    assert first["loss_fn_output_type"] == "ArrayRecord"
    assert [o["logprobs"]["data"] for o in first["loss_fn_outputs"]] == [[-1.0, -2.0], [-0.5]]
    assert [o["logprobs"]["shape"] for o in first["loss_fn_outputs"]] == [[2], [1]]
    assert second["loss_fn_outputs"][0]["logprobs"]["shape"] == [2, 2]
    assert first["metrics"] == {"loss:sum": 3.5, "tokens:sum": 3.0}
    combined = got["combined"]  # the SDK's merge of chunked results: outputs in order, ":sum" metrics added
    assert [o["logprobs"]["shape"] for o in combined["loss_fn_outputs"]] == [[2], [1], [2, 2]]
    assert combined["metrics"] == {"loss:sum": 13.5, "tokens:sum": 5.0}


EXTENSIONS = {"lora_alpha", "adapter"}  # livelora fields the SDK ignores


def _same(ours, theirs, newer_fields_ok: bool) -> bool:
    """Our JSON as the SDK read it: every field kept with its value. An SDK dump lists every field the SDK
    knows, so a key missing there is one it does not know: allowed only for SDKs older than our types."""
    if isinstance(ours, dict):
        return isinstance(theirs, dict) and all(
            _same(v, theirs[k], newer_fields_ok)
            for k, v in ours.items()
            if k not in EXTENSIONS and not (newer_fields_ok and k not in theirs)
        )
    if isinstance(ours, list):
        return len(ours) == len(theirs) and all(_same(a, b, newer_fields_ok) for a, b in zip(ours, theirs))
    if isinstance(ours, str) and isinstance(theirs, str) and ours[:4].isdigit() and "T" in ours:
        return datetime.fromisoformat(ours) == datetime.fromisoformat(theirs)
    return ours == theirs


def test_rest_responses_validate_in_the_sdk(sdk):
    version, res = sdk
    for name, (_, model) in rest_models(version).items():
        value = ok(res[f"rest:{name}"])["value"]
        assert _same(dump(model), value, version == "024"), (name, dump(model), value)
    # the training-run answer of the server today lacks last_request_time, which the SDK requires
    assert "last_request_time" in res["rest:old_TrainingRun"]["error"]


def test_sdk_clients_end_to_end_with_our_encodings(sdk):
    """ServiceClient → TrainingClient.forward_backward → SamplingClient.sample → close, over real HTTP:
    the SDK re-polls on our 408 try_again, reads our protobuf results, and asks for protobuf exactly where
    ``wants_proto`` says so."""
    version, res = sdk
    got = ok(res["client"])
    fb = got["forward_backward"]
    assert [o["logprobs"]["data"] for o in fb["loss_fn_outputs"]] == [[-1.0, -2.0], [-0.5]]
    assert fb["metrics"] == {"loss:sum": 3.5, "tokens:sum": 3.0}
    seqs = got["sample"]["sequences"]
    assert [(q["tokens"], q["logprobs"], q["stop_reason"]) for q in seqs] == [
        (q.tokens, q.logprobs, q.stop_reason) for q in CLIENT_SAMPLE.sequences
    ]
    assert got["sample"]["prompt_logprobs"] == [None, -2.5, -3.5]
    if version == "038":
        assert [q["sequence_id"] for q in seqs] == ["sq-0", "sq-1"]
    reqs = got["requests"]
    polls = {}
    for req in reqs:
        if req["path"] == "/api/v1/retrieve_future":
            rid = json.loads(base64.b64decode(req["body_b64"]))["request_id"]
            polls.setdefault(rid, []).append(wire.wants_proto(req["headers"].get("Accept")))
    assert polls["cm-1"] == [False] and polls["fb-1"] == [True, True] and polls["smp-1"] == [True]
    fwd = next(q for q in reqs if q["path"] == "/api/v1/forward_backward")
    raw = wire.decode_content(base64.b64decode(fwd["body_b64"]), fwd["headers"].get("Content-Encoding"))
    decoded = wire.decode_forward_backward(raw)
    assert (decoded.model_id, decoded.seq_id, len(decoded.forward_backward_input.data)) == ("sess-1:train:0", 1, 2)
    sample_body = json.loads(base64.b64decode(next(q for q in reqs if q["path"] == "/api/v1/asample")["body_b64"]))
    assert x.SampleRequestV2.model_validate(sample_body).prompt_logprobs is True
    if version == "038":
        finish = next(q for q in reqs if q["path"] == "/api/v1/sessions/sess-1/finish")
        assert (
            t.SessionFinishRequest.model_validate(json.loads(base64.b64decode(finish["body_b64"]))).reason.type
            == "success"
        )
