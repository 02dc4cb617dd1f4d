"""The official ``tinker`` SDK 0.24.1 (JSON era), unmodified, against livelora: SFT, resume, sampling."""

from __future__ import annotations

import pytest
from harness.server import MODEL

tinker = pytest.importorskip("tinker", reason="the official tinker SDK is not installed (pip install tinker==0.24.1)")


def test_official_tinker_sdk_sft_and_sampling(sessions_server, monkeypatch, tmp_path):
    monkeypatch.setenv("TINKER_BASE_URL", sessions_server.base_url)
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    from huggingface_hub import constants
    from tinker import types

    from livelora.cli.main import hf_cache

    # get_tokenizer() on the server's machine loads the folder get_info names; elsewhere the hub id, which
    # `livelora hf-cache --url` makes resolve offline (done here too, as a client elsewhere would)
    hf_cache(url=sessions_server.base_url, cache_dir=tmp_path / "hub")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    assert tinker.__version__ == "0.24.1"
    service = tinker.ServiceClient()
    tc = service.create_lora_training_client(base_model=MODEL, rank=4)
    tok = tc.get_tokenizer()
    examples = ["The sky is blue.", "Grass is green."]
    data = []
    for text in examples:
        ids = tok.encode(text)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
            )
        )
    losses = []
    for _ in range(4):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=2e-3))
        out = fb.result()
        opt.result()
        losses.append(out.metrics["loss:sum"])
        assert len(out.loss_fn_outputs) == 2
        assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == data[0].model_input.length
    assert losses[-1] < 0.7 * losses[0], losses

    # resume through the official create-from-state path
    path = tc.save_state("tinker-sdk").result().path
    resumed = service.create_training_client_from_state_with_optimizer(path)
    assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
        tc.forward(data, "cross_entropy").result().metrics["loss:sum"], rel=1e-5
    )

    sampler = tc.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints(tok.encode("The sky is"))
    res = sampler.sample(
        prompt=prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=0)
    ).result()
    assert len(res.sequences) == 2
    for seq in res.sequences:
        assert 0 < len(seq.tokens) <= 4 and len(seq.logprobs) == len(seq.tokens)
        assert seq.stop_reason in ("stop", "length")
    lps = sampler.compute_logprobs(prompt).result()
    assert lps[0] is None and len(lps) == prompt.length and all(x < 0 for x in lps[1:])
