"""Oracle for the tinker wire tests: runs the **official tinker SDK's own code** in its own virtualenv.

Run as ``<sdk venv>/bin/python tests/tinker_sdk_oracle.py`` with ``{"ops": [...]}`` (JSON) on stdin; prints
``{"results": [...]}``, one result per op (``{"error": "..."}`` when an op raised). Bytes travel as base64.
Ops build requests with the SDK's types and send them through the SDK's own resource methods to an
``httpx.MockTransport`` that records the exact body and headers; responses are read with the SDK's own
decoders and pydantic models. :mod:`tests.test_tinker_wire_sdk` drives it; nothing here imports livelora,
and nothing imports ``tinker`` at module level, so the helpers below can be imported without the SDK.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import sys
import traceback
from typing import Any


def descriptor_signature(file_descriptor: Any) -> dict[str, dict[str, list]]:
    """Every message of a protobuf file descriptor: field number → [name, type, referenced type, repeated,
    containing oneof, has presence]; map fields as ``["map", key type, value type, value message]``."""
    out: dict[str, dict[str, list]] = {}
    for name, md in file_descriptor.message_types_by_name.items():
        fields: dict[str, list] = {}
        for f in md.fields:
            ref: Any = None
            if f.message_type is not None and f.message_type.GetOptions().map_entry:
                k, v = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
                ref = ["map", k.type, v.type, v.message_type.name if v.message_type else None]
            elif f.message_type is not None:
                ref = f.message_type.name
            elif f.enum_type is not None:
                ref = f.enum_type.name
            fields[str(f.number)] = [
                f.name,
                f.type,
                ref,
                bool(f.is_repeated and not isinstance(ref, list)),
                f.containing_oneof.name if f.containing_oneof else None,
                bool(f.has_presence),
            ]
        out[name] = fields
    return out


# ------------------------------------------------------------------------------------------------ capture
def _capture(call, client_config: dict[str, Any] | None = None, answer: Any = None) -> dict[str, Any]:
    """Run ``call(client)`` on an AsyncTinker whose transport records the one request it sends."""
    import httpx
    from tinker import types
    from tinker._client import AsyncTinker

    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=answer if answer is not None else {"request_id": "req-1"})

    async def run() -> Any:
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        cfg = types.ClientConfigResponse.model_validate({"use_pyqwest_transport": False, **(client_config or {})})
        client = AsyncTinker(api_key="tml-oracle", base_url="http://oracle.test", http_client=http, _client_config=cfg)
        try:
            return await call(client)
        finally:
            await http.aclose()

    asyncio.run(run())
    req = seen[-1]
    body = req.content
    return {
        "method": req.method,
        "path": req.url.path,
        "query": dict(req.url.params),
        "content_type": req.headers.get("content-type"),
        "content_encoding": req.headers.get("content-encoding"),
        "body_b64": base64.b64encode(body).decode(),
    }


def _tensor(spec: dict[str, Any]) -> Any:
    """``{"values": nested list, "dtype", "form": "tensordata"|"numpy"|"torch"|"sparse"|"list", "pad"?}``."""
    import numpy as np
    from tinker import types

    values, dtype, form = spec["values"], spec["dtype"], spec.get("form", "tensordata")
    if form == "list":
        return values  # the Datum coerces raw lists by key
    arr = np.asarray(values, dtype=np.int64 if dtype == "int64" else np.float32)
    if form == "numpy":
        return arr
    import torch

    t = torch.from_numpy(arr)
    if form == "torch":
        return t  # 2-D target_tokens/weights are auto-sparsified by the Datum
    if form == "sparse":
        return types.TensorData.from_torch_sparse(t, pad_value=spec.get("pad", 0))
    return types.TensorData.from_torch(t)


def _datum(spec: dict[str, Any]) -> Any:
    from tinker import types

    chunks = [types.EncodedTextChunk(tokens=list(c)) for c in spec["chunks"]]
    datum = types.Datum(
        model_input=types.ModelInput(chunks=chunks), loss_fn_inputs={k: _tensor(v) for k, v in spec["inputs"].items()}
    )
    spans = spec.get("spans")
    if spans:

        def make(items):
            return [
                (types.PromptProvenanceSpan if kind == "prompt" else types.SampledProvenanceSpan)(
                    sequence_id=sid, offset=off, length=n
                )
                for kind, sid, off, n in items
            ]

        datum = datum.with_provenance(
            model_input=make(spans["model_input"]), loss_fn_inputs=make(spans["loss_fn_inputs"])
        )
    return datum


def op_fwdbwd_body(a: dict[str, Any]) -> dict[str, Any]:
    """The exact ``POST /api/v1/forward_backward`` the SDK's resource sends (protobuf; zstd if asked)."""
    from tinker import types

    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[_datum(d) for d in a["data"]], loss_fn=a["loss_fn"], loss_fn_config=a.get("loss_fn_config")
        ),
        model_id=a["model_id"],
        seq_id=a["seq_id"],
    )
    # SDK 0.20-0.24 write protobuf only when the server sets proto_write_fwdbwd (else JSON); 0.25+ always do
    config = {"proto_compress_fwdbwd": bool(a.get("compress")), "proto_write_fwdbwd": not a.get("json")}
    return _capture(
        lambda c: c.training.forward_backward(request=request, forward_only=bool(a.get("forward_only"))), config
    )


def op_sample_body(a: dict[str, Any]) -> dict[str, Any]:
    """The exact ``POST /api/v1/asample`` JSON the SDK's resource sends for a ``SampleRequest``."""
    from tinker import types

    kw = dict(a["request"])
    kw["prompt"] = types.ModelInput.from_ints(kw["prompt"])
    kw["sampling_params"] = types.SamplingParams(**kw.get("sampling_params", {}))
    if kw.get("target_prompt_logprobs") is not None:  # as SamplingClient.sample converts it
        from tinker.lib.public_interfaces.sampling_client import _tensor_data_to_model

        kw["target_prompt_logprobs"] = _tensor_data_to_model(_tensor(kw["target_prompt_logprobs"]))
    request = types.SampleRequest(**kw)
    return _capture(
        lambda c: c.sampling.asample(request=request, extra_headers={"X-Tinker-Sampling-Backpressure": "1"})
    )


#: op → (resource attribute, method, request type, extra kwargs of the method)
_JSON_OPS = {
    "create_model": ("models", "create", "CreateModelRequest"),
    "optim_step": ("training", "optim_step", "OptimStepRequest"),
    "save_weights": ("weights", "save", "SaveWeightsRequest"),
    "save_weights_for_sampler": ("weights", "save_for_sampler", "SaveWeightsForSamplerRequest"),
    "save_weights_external": ("weights", "save_external", "SaveWeightsExternalRequest"),
    "load_weights": ("weights", "load", "LoadWeightsRequest"),
    "copy_weights": ("models", "copy_weights", "CopyWeightsRequest"),
    "join_sampling_session": ("service", "join_sampling_session", "JoinSamplingSessionRequest"),
    "create_sampling_session": ("service", "create_sampling_session", "CreateSamplingSessionRequest"),
    "create_session": ("service", "create_session", "CreateSessionRequest"),
    "retrieve_futures": ("futures", "retrieve_multi", "FuturesRetrieveRequest"),
    "retrieve_future": ("futures", "retrieve", "FutureRetrieveRequest"),
}


def op_json_body(a: dict[str, Any]) -> dict[str, Any]:
    """The exact JSON body the SDK's resource sends for one of :data:`_JSON_OPS` built from ``kwargs``."""
    from tinker import types

    attr, method, type_name = _JSON_OPS[a["op"]]
    kw = dict(a["kwargs"])
    if a["op"] == "optim_step":
        params = kw.pop("params")
        kw["optim_params" if hasattr(types, "DimuonParams") else "adam_params"] = (
            types.DimuonParams(**params) if params.get("type") == "dimuon" else types.AdamParams(**params)
        )
    model = getattr(types, type_name)
    dropped = sorted(k for k in kw if k not in model.model_fields and k not in ("adam_params", "optim_params"))
    request = model(**{k: v for k, v in kw.items() if k not in dropped})  # older SDKs lack newer fields
    answer = {"session_id": "s1"} if a["op"] == "create_session" else None
    if a["op"] == "copy_weights":
        answer = {"tinker_path": "tinker://x/weights/y"}
    elif a["op"] == "join_sampling_session":
        answer = {"client_counter": 1}
    elif a["op"] == "create_sampling_session":
        answer = {"sampling_session_id": "s1:sample:0"}
    elif a["op"] == "retrieve_futures":
        answer = {"completions": [], "cursor": 0}
    elif a["op"] == "retrieve_future":
        answer = {"metrics": {}}
    return {**_capture(lambda c: getattr(getattr(c, attr), method)(request=request), answer=answer), "dropped": dropped}


# ------------------------------------------------------------------------------------------------ decoders
def _plain(x: Any) -> Any:
    """SDK objects → JSON (NaN → None; numpy → lists)."""
    if hasattr(x, "tolist") and not isinstance(x, (list, tuple)):
        return _plain(x.tolist())
    if isinstance(x, float):
        return None if math.isnan(x) else x
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _tensor_out(t: Any) -> Any:
    if t is None:
        return None
    data = t._numpy.flatten().tolist() if hasattr(t, "_numpy") else list(t.data)
    return _plain(
        {
            "data": data,
            "dtype": t.dtype,
            "shape": t.shape,
            "crow": getattr(t, "sparse_crow_indices", None),
            "col": getattr(t, "sparse_col_indices", None),
        }
    )


def op_decode_sample(a: dict[str, Any]) -> dict[str, Any]:
    """``retrieve_future``'s proto path for a SampleResponse: the SDK decoder (+ sequence ids on 0.26+)."""
    from tinker import types
    from tinker.proto.response_conv import deserialize_proto_response

    resp = deserialize_proto_response(base64.b64decode(a["body_b64"]), types.SampleResponse)
    if a.get("sample_sequence_ids") is not None:
        from tinker.lib.public_interfaces.sampling_client import _attach_sequence_ids

        resp = _attach_sequence_ids(resp, a["sample_sequence_ids"])
    seqs = [
        {
            "stop_reason": s.stop_reason,
            "tokens": _plain(list(s.tokens)),
            "logprobs": _plain(s.logprobs) if s.logprobs is not None else None,
            "topk_logprobs": _plain(getattr(s, "topk_logprobs", None)),
            "sequence_id": getattr(s, "sequence_id", None),
        }
        for s in resp.sequences
    ]
    alt = getattr(resp, "prompt_alt_tokens", None)
    return {
        "sequences": seqs,
        "prompt_logprobs": _plain(resp.prompt_logprobs),
        "topk_prompt_logprobs": _plain(resp.topk_prompt_logprobs),
        "target_prompt_logprobs": _tensor_out(getattr(resp, "target_prompt_logprobs", None)),
        "prompt_alt_tokens": None
        if alt is None
        else {"tokens": _tensor_out(alt.tokens), "logprobs": _tensor_out(alt.logprobs)},
        "prompt_cache_hit_tokens": getattr(resp, "prompt_cache_hit_tokens", None),
    }


def _fwdbwd_out(out: Any) -> dict[str, Any]:
    return {
        "loss_fn_output_type": out.loss_fn_output_type,
        "metrics": _plain(dict(out.metrics)),
        "loss_fn_outputs": [{k: _tensor_out(v) for k, v in d.items()} for d in out.loss_fn_outputs],
    }


def op_decode_fwdbwd(a: dict[str, Any]) -> dict[str, Any]:
    """The SDK decoder of a ForwardBackwardOutput; with several bodies, also the SDK's chunk combiner."""
    from tinker import types
    from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results
    from tinker.proto.response_conv import deserialize_proto_response

    outs = [deserialize_proto_response(base64.b64decode(b), types.ForwardBackwardOutput) for b in a["bodies_b64"]]
    return {"each": [_fwdbwd_out(o) for o in outs], "combined": _fwdbwd_out(combine_fwd_bwd_output_results(outs))}


def op_validate(a: dict[str, Any]) -> dict[str, Any]:
    """Validate JSON as an SDK response model (what ``cast_to`` does with strict validation)."""
    from tinker import types

    model = getattr(types, a["type"])
    return {"value": json.loads(model.model_validate(a["data"]).model_dump_json())}


class _FakeServer:
    """A local HTTP server answering from a table, recording every request (the SDK's full client stack,
    real HTTP). ``routes``: ``"METHOD /path"`` → response; ``futures``: request_id → list of responses given
    to successive ``retrieve_future`` polls (the last one repeats). A response is ``{"status", "json"}`` or
    ``{"status", "content_type", "body_b64"}``."""

    def __init__(self, routes: dict[str, Any], futures: dict[str, list]):
        import http.server
        import threading

        self.routes, self.futures, self.seen = routes, {k: list(v) for k, v in futures.items()}, []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _answer(self):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                path = self.path.split("?", 1)[0]
                server.seen.append(
                    {
                        "method": self.command,
                        "path": path,
                        "headers": dict(self.headers.items()),
                        "body_b64": base64.b64encode(body).decode(),
                    }
                )
                resp = server.routes.get(f"{self.command} {path}")
                if path == "/api/v1/retrieve_future":
                    queue = server.futures.get(json.loads(body)["request_id"], [])
                    resp = queue.pop(0) if len(queue) > 1 else (queue[0] if queue else None)
                if resp is None:
                    resp = {"status": 404, "json": {"detail": f"no route {self.command} {path}"}}
                if "json" in resp:
                    out, ctype = json.dumps(resp["json"]).encode(), "application/json"
                else:
                    out, ctype = base64.b64decode(resp["body_b64"]), resp["content_type"]
                self.send_response(resp.get("status", 200))
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_PUT = do_DELETE = _answer

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def op_client_roundtrip(a: dict[str, Any]) -> dict[str, Any]:
    """The SDK's public clients end to end against :class:`_FakeServer`: create a LoRA training client,
    ``forward_backward`` one batch, sample from the base model, close. Returns the results as JSON and every
    request the SDK made (method, path, headers, body)."""
    import os

    import tinker
    from tinker import types

    os.environ["TINKER_TELEMETRY"] = "0"
    server = _FakeServer(a["routes"], a["futures"])
    out: dict[str, Any] = {}
    try:
        service = tinker.ServiceClient(base_url=server.url, api_key="tml-oracle")
        training = service.create_lora_training_client(base_model=a["base_model"], rank=4)
        fb = training.forward_backward([_datum(d) for d in a["data"]], a["loss_fn"]).result()
        out["forward_backward"] = _fwdbwd_out(fb)
        sampler = service.create_sampling_client(base_model=a["base_model"])
        sampler = sampler.result() if hasattr(sampler, "result") else sampler
        res = sampler.sample(
            types.ModelInput.from_ints(a["prompt"]),
            num_samples=2,
            sampling_params=types.SamplingParams(max_tokens=4),
            include_prompt_logprobs=True,
        ).result()
        out["sample"] = {
            "sequences": [
                {
                    "tokens": list(s.tokens),
                    "logprobs": _plain(s.logprobs),
                    "stop_reason": s.stop_reason,
                    "sequence_id": getattr(s, "sequence_id", None),
                }
                for s in res.sequences
            ],
            "prompt_logprobs": _plain(res.prompt_logprobs),
        }
        if hasattr(service, "close"):
            service.close("success").result()  # what `with ServiceClient()` does on exit
    finally:
        server.close()
    out["requests"] = server.seen
    return out


def op_version(a: dict[str, Any]) -> dict[str, Any]:
    import tinker

    return {"version": tinker.__version__}


def op_schema(a: dict[str, Any]) -> dict[str, Any]:
    from tinker.proto import tinker_public_pb2

    return {"messages": descriptor_signature(tinker_public_pb2.DESCRIPTOR)}


OPS = {name[3:]: fn for name, fn in globals().items() if name.startswith("op_")}


def main() -> None:
    request = json.load(sys.stdin)
    results = []
    for op in request["ops"]:
        try:
            results.append(OPS[op["op"] if op["op"] in OPS else "json_body"](op))
        except Exception as exc:  # reported per op, so one failure does not hide the others
            results.append({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]})
    json.dump({"results": results}, sys.stdout)


if __name__ == "__main__":
    main()
