"""Training sessions through livelora's SDK against a live gateway (real SmolLM2, real Redis, in-process trainer)."""

from __future__ import annotations

import uuid

import httpx
import pytest
import torch
from harness.server import MODEL

from livelora.clients import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient, TensorData
from livelora.clients.errors import BadRequestError, ConflictError, NotFoundError

TEXTS = ["The capital of France is Paris.", "Two plus two equals four.", "Water boils at 100 degrees."]


def sft_datum(tokenizer, text: str) -> Datum:
    ids = tokenizer.encode(text)
    n = len(ids) - 1
    return Datum(
        model_input=ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData.from_list(ids[1:], "int64"),
            "weights": TensorData.from_list([1.0] * n, "float32"),
        },
    )


@pytest.fixture(scope="module")
def service(sessions_server):
    svc = ServiceClient(sessions_server.base_url, heartbeat_s=2.0)
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def batch(tokenizer):
    return [sft_datum(tokenizer, t) for t in TEXTS]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url("/api/v1" + path), json=body, timeout=60)


def result(server, request_id: str) -> dict:
    while True:
        r = post(server, "/retrieve_future", {"request_id": request_id})
        if r.status_code != 408:
            assert r.status_code == 200, r.text
            return r.json()


def test_sft_loop_loss_falls(service, batch):
    tc = service.create_lora_training_client(MODEL, rank=8, alpha=16, seed=0)
    info = tc.get_info()
    assert (info.lora_rank, info.lora_alpha, info.model_name) == (8, 16.0, MODEL)
    losses = []
    for _ in range(6):
        fb = tc.forward_backward(batch, "cross_entropy")
        opt = tc.optim_step(AdamParams(learning_rate=2e-3))
        losses.append(fb.result(timeout=120).metrics["loss:sum"])
        assert opt.result(timeout=120).metrics["grad_norm:mean"] > 0
    n_tokens = sum(d.model_input.length for d in batch)
    assert losses[0] / n_tokens > 1.0  # nats per token before training
    assert losses[-1] < 0.5 * losses[0], losses
    assert min(losses) == losses[-1], losses


def test_pipelined_ops_run_in_seq_order(service, batch, sessions_server):
    tc = service.create_lora_training_client(MODEL, rank=4, seed=1)
    futs = [
        tc.forward_backward(batch[:1]),
        tc.optim_step(AdamParams(learning_rate=1e-3)),
        tc.forward_backward(batch[:1]),
        tc.optim_step(AdamParams(learning_rate=1e-3)),
        tc.forward(batch[:1]),
    ]
    out = [f.result(timeout=120) for f in futs]
    assert [out[1].metrics["step:max"], out[3].metrics["step:max"]] == [1.0, 2.0]
    assert out[4].metrics["loss:sum"] < out[2].metrics["loss:sum"] < out[0].metrics["loss:sum"]

    # an op that arrives before its predecessor waits for it: optim_step (seq 7) sent first would fail with
    # "no gradients" if it ran before forward_backward (seq 6)
    fb_body = {
        "forward_backward_input": {"data": [batch[0].model_dump(mode="json")], "loss_fn": "cross_entropy"},
        "model_id": tc.model_id,
    }
    opt = post(
        sessions_server, "/optim_step", {"adam_params": {"learning_rate": 1e-3}, "model_id": tc.model_id, "seq_id": 7}
    ).json()
    fb = post(sessions_server, "/forward_backward", {**fb_body, "seq_id": 6}).json()
    assert result(sessions_server, fb["request_id"])["metrics"]["loss:sum"] > 0
    assert result(sessions_server, opt["request_id"])["metrics"]["step:max"] == 3.0


def test_retried_op_is_not_applied_twice(service, batch, sessions_server):
    tc = service.create_lora_training_client(MODEL, rank=4, seed=2)
    body = {
        "forward_backward_input": {"data": [batch[1].model_dump(mode="json")], "loss_fn": "cross_entropy"},
        "model_id": tc.model_id,
        "seq_id": 1,
    }
    first = post(sessions_server, "/forward_backward", body).json()
    retry = post(sessions_server, "/forward_backward", body).json()
    assert retry["request_id"] == first["request_id"]
    opt = {"adam_params": {"learning_rate": 1e-3}, "model_id": tc.model_id, "seq_id": 2}
    step1 = post(sessions_server, "/optim_step", opt).json()
    assert post(sessions_server, "/optim_step", opt).json()["request_id"] == step1["request_id"]
    # the same seq with a different body is a conflict, not a silent replay: a failed future (op routes never
    # answer 409, which the SDK would retry)
    clash = post(sessions_server, "/optim_step", {**opt, "adam_params": {"learning_rate": 5e-3}})
    assert clash.status_code == 200 and clash.json()["request_id"] != step1["request_id"]
    failed = post(sessions_server, "/retrieve_future", {"request_id": clash.json()["request_id"]}).json()
    assert failed["category"] == "user" and failed["code"] == "seq_conflict", failed
    assert result(sessions_server, step1["request_id"])["metrics"]["step:max"] == 1.0
    # the gradients were accumulated once: the applied step used the grad of one forward_backward
    fb1 = result(sessions_server, first["request_id"])
    assert fb1["metrics"]["num_sequences:sum"] == 1.0
    # the model's next op is seq 3 (the retried ones did not consume seq ids)
    tc._seq = type(tc._seq)(3)
    later = tc.optim_step().result
    with pytest.raises(BadRequestError, match="no gradients"):
        later(timeout=60)
    assert tc.forward_backward(batch[1:2]).result(timeout=60).metrics["loss:sum"] > 0
    assert tc.optim_step().result(timeout=60).metrics["step:max"] == 2.0


def test_bad_inputs_fail_the_future_and_later_ops_still_run(service, batch, sessions_server):
    tc = service.create_lora_training_client(MODEL, rank=2, seed=3)
    # unknown model id: 404 at once (the same answer another tenant's gets); a malformed one: 400
    fwd = {"forward_input": {"data": [batch[0].model_dump(mode="json")], "loss_fn": "cross_entropy"}, "seq_id": 1}
    r = post(sessions_server, "/forward", {**fwd, "model_id": f"{'0' * 32}:train:0"})
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]
    r = post(sessions_server, "/forward", {**fwd, "model_id": "nosuchsession:train:0"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model_id"
    # wrong tensor shape
    d = batch[0]
    short = Datum(
        model_input=d.model_input,
        loss_fn_inputs={
            "target_tokens": d.loss_fn_inputs["target_tokens"],
            "weights": TensorData.from_list([1.0, 1.0], "float32"),
        },
    )
    with pytest.raises(BadRequestError, match=r"weights: shape must be"):
        tc.forward_backward([short]).result(timeout=60)
    # unknown loss, and a known one livelora refuses
    with pytest.raises(BadRequestError, match="loss_fn"):
        tc.forward_backward([d], "no_such_loss").result(timeout=60)
    with pytest.raises(BadRequestError, match="stable_reinforce"):
        tc.forward_backward([d], "stable_reinforce").result(timeout=60)
    # the failed ops consumed their seq ids: the next op runs at once
    assert tc.forward([d]).result(timeout=60).metrics["loss:sum"] > 0
    # unknown sampling session / checkpoint: clear synchronous errors
    with pytest.raises(NotFoundError):
        service.create_sampling_client(model_path=f"tinker://{tc.model_id}/sampler_weights/nope")
    with pytest.raises(BadRequestError, match="training checkpoint"):
        service.create_sampling_client(model_path=f"tinker://{tc.model_id}/weights/nope")


def test_resume_with_optimizer_continues_exactly(service, batch):
    probe = batch[2:3]
    adam = AdamParams(learning_rate=2e-3)
    a = service.create_lora_training_client(MODEL, rank=4, seed=5)
    for _ in range(2):
        a.forward_backward(batch[:2])
        a.optim_step(adam)
    path = a.save_state("resume-test").result(timeout=120).path
    assert path == f"tinker://{a.model_id}/weights/resume-test"
    a.forward_backward(batch[:2])
    a.optim_step(adam)
    want = a.forward(probe).result(timeout=120).loss_fn_outputs[0]["logprobs"].to_torch()

    b = service.create_training_client_from_state_with_optimizer(path)
    b.forward_backward(batch[:2])
    assert b.optim_step(adam).result(timeout=120).metrics["step:max"] == 3.0
    got = b.forward(probe).result(timeout=120).loss_fn_outputs[0]["logprobs"].to_torch()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

    c = service.create_training_client_from_state(path)  # fresh optimizer: a different step
    c.forward_backward(batch[:2])
    c.optim_step(adam)
    cold = c.forward(probe).result(timeout=120).loss_fn_outputs[0]["logprobs"].to_torch()
    assert (cold - want).abs().max() > 1e-3

    ckpts = service.list_checkpoints(a.model_id)
    assert [(x["checkpoint_id"], x["checkpoint_type"]) for x in ckpts] == [("weights/resume-test", "training")]
    with pytest.raises(ConflictError):
        a.save_state("resume-test").result(timeout=60)
    service.delete_checkpoint(path)
    assert service.list_checkpoints(a.model_id) == []
    with pytest.raises(NotFoundError):
        service.create_training_client_from_state(path)


def test_forward_backward_custom_matches_builtin_gradient(service, batch):
    d = batch[:2]

    def nll(data, logprobs):
        loss = sum(-(lp * dd.loss_fn_inputs["weights"].to_torch()).sum() for dd, lp in zip(data, logprobs))
        return loss, {"custom:sum": float(loss)}

    x = service.create_lora_training_client(MODEL, rank=2, seed=7)
    y = service.create_lora_training_client(MODEL, rank=2, seed=7)
    custom = x.forward_backward_custom(d, nll)
    gx = x.optim_step(AdamParams(learning_rate=1e-3))
    builtin = y.forward_backward(d, "cross_entropy").result(timeout=120)
    gy = y.optim_step(AdamParams(learning_rate=1e-3)).result(timeout=120)
    out = custom.result(timeout=120)
    assert out.metrics["loss:sum"] == pytest.approx(builtin.metrics["loss:sum"], rel=1e-5)
    assert out.metrics["custom:sum"] == pytest.approx(builtin.metrics["loss:sum"], rel=1e-5)
    assert gx.result(timeout=120).metrics["grad_norm:mean"] == pytest.approx(gy.metrics["grad_norm:mean"], rel=1e-4)


def test_sampling_logprobs_agree_with_compute_logprobs(service, batch, tokenizer, sessions_server):
    tc = service.create_lora_training_client(MODEL, rank=4, seed=8)
    tc.forward_backward(batch)
    tc.optim_step(AdamParams(learning_rate=1e-3))
    sampler = tc.save_weights_and_get_sampling_client()
    assert sampler.adapter and sampler.adapter in sessions_server.engine.loaded_adapters()
    prompt = tokenizer.encode("Once upon a time")
    res = sampler.sample(
        ModelInput.from_ints(prompt),
        2,
        SamplingParams(max_tokens=6, temperature=1.0, seed=3),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
    ).result(timeout=120)
    assert len(res.sequences) == 2 and all(s.sequence_id for s in res.sequences)
    assert len({s.sequence_id for s in res.sequences}) == 2
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(prompt)
    assert res.topk_prompt_logprobs[0] is None and all(len(t) == 3 for t in res.topk_prompt_logprobs[1:])
    for seq in res.sequences:
        assert len(seq.tokens) == len(seq.logprobs) > 0
        full = sampler.compute_logprobs(ModelInput.from_ints(prompt + seq.tokens)).result(timeout=120)
        assert full[0] is None and len(full) == len(prompt) + len(seq.tokens)
        torch.testing.assert_close(torch.tensor(full[len(prompt) :]), torch.tensor(seq.logprobs), atol=2e-3, rtol=0)
    # the same seed reproduces the samples
    again = sampler.sample(ModelInput.from_ints(prompt), 2, SamplingParams(max_tokens=6, seed=3)).result(timeout=120)
    assert [s.tokens for s in again.sequences] == [s.tokens for s in res.sequences]
    # stop token ids end a sample and are part of it
    stop_tok = res.sequences[0].tokens[1]
    cut = sampler.sample(ModelInput.from_ints(prompt), 1, SamplingParams(max_tokens=6, seed=3, stop=[stop_tok])).result(
        timeout=120
    )
    assert cut.sequences[0].stop_reason == "stop" and cut.sequences[0].tokens[-1] == stop_tok
    # the session's adapter is also an OpenAI model
    chat = httpx.post(
        sessions_server.url("/v1/chat/completions"),
        timeout=120,
        json={"model": sampler.adapter, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
    )
    assert chat.status_code == 200, chat.text
    assert sampler.adapter in chat.json()["system_fingerprint"]
    # named sampler checkpoints work too
    named = tc.save_weights_for_sampler("snap").result(timeout=120)
    assert named.path == f"tinker://{tc.model_id}/sampler_weights/snap"
    s2 = service.create_sampling_client(model_path=named.path)
    assert s2.adapter == named.adapter
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    assert (
        s2.sample(ModelInput.from_ints(prompt), 1, greedy).result(timeout=120).sequences[0].tokens
        == sampler.sample(ModelInput.from_ints(prompt), 1, greedy).result(timeout=120).sequences[0].tokens
    )


def test_sdk_futures_support_await_and_concurrent_futures(service, batch):
    import asyncio
    import concurrent.futures

    tc = service.create_lora_training_client(MODEL, rank=2, seed=9)
    fut = tc.forward(batch[:1])
    assert isinstance(fut.future(), concurrent.futures.Future)

    async def main():
        return await fut

    out = asyncio.run(main())
    assert out.metrics["loss:sum"] == fut.result().metrics["loss:sum"] > 0
    caps = service.get_server_capabilities()
    assert caps.supported_models[0].model_name == MODEL


def test_user_metadata_values_are_strings_and_sessions_are_found_by_them(sessions_server):
    """Tinker's session and run summaries carry ``user_metadata: dict[str, str]``: a non-string value is refused
    when the object is created (400 naming the field; nothing is created), so a summary never fails to validate;
    a string value is stored and found by ``sessions/search``."""
    tag = uuid.uuid4().hex

    def refused(r: httpx.Response) -> None:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and "user_metadata" in (err["param"] or "") + err["message"]

    refused(post(sessions_server, "/create_session", {"user_metadata": {"tag": tag, "n": 3}}))
    found = post(sessions_server, "/sessions/search", {"user_metadata": {"tag": tag}})
    assert found.status_code == 200 and found.json()["sessions"] == []
    sid = post(sessions_server, "/create_session", {"user_metadata": {"tag": tag}}).json()["session_id"]
    found = post(sessions_server, "/sessions/search", {"user_metadata": {"tag": tag}})
    assert found.status_code == 200, found.text
    assert [(s["session_id"], s["user_metadata"]) for s in found.json()["sessions"]] == [(sid, {"tag": tag})]
    refused(
        post(
            sessions_server,
            "/create_model",
            {"session_id": sid, "model_seq_id": 0, "base_model": MODEL, "user_metadata": {"step": 1.5}},
        )
    )


def test_readme_training_snippet_runs_as_written(sessions_server, capsys):
    """The "Training sessions" page's code block (docs/training.md) is complete: run as printed (only the URL
    changed), it trains one step on the chat-format datum it builds and samples the saved weights."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "training.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, re.DOTALL).group(1)
    assert "http://127.0.0.1:8000" in code
    ns: dict = {}
    program = compile(code.replace("http://127.0.0.1:8000", sessions_server.base_url), "docs/training.md", "exec")
    exec(program, ns)
    assert ns["fwd"].result().metrics["loss:sum"] > 0
    assert ns["opt"].result().metrics["step:max"] == 1
    assert len(ns["out"].sequences[0].tokens) > 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("{'loss:sum': ") and printed[-1].strip()
