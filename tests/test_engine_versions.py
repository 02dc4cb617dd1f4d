"""Engine contract, adapter versions: several live versions, leases, swap under load, drain-then-unload.

Runs on every engine kind of the contract suite (``tests/test_engine_contract.py``:
transformers always, vllm when installed or named in ``LIVELORA_TEST_ENGINES``). The
expected values come from the engine's own ``score`` under each version (teacher-forced
prompt logprobs), checked against a plain peft model once, never hard-coded.

What is pinned down here (vllm_lora.md §1.5-1.6):
* two versions serve side by side (``max_loras >= 2``); a stream that started on v1
  keeps v1's weights to its last token while v2 is loaded and used;
* an adapter with an unfinished request cannot be unloaded (nothing changes);
* a name is never reloaded in place; a name loaded again after unload serves the new
  weights (vLLM: new integer id and new path, not the cached old weights);
* the engine does not depend on the store's copy after the load: rewriting or deleting
  the source directory changes nothing (vLLM serves from its own immutable snapshot).
"""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch
from harness.engines import chat, collect, greedy
from harness.seeds import peft_versions

from livelora.clients.errors import ConflictError, ModelNotFoundError
from livelora.gateway.engines import SamplingParams, create_engine

LP_TOL = 1e-4  # nats; same weights, fp32, same engine


@pytest.fixture(scope="module")
def versions(base_ref, tmp_path_factory):
    """Two real rank-8 LoRA versions on SmolLM2 (attention + MLP), different non-zero lora_B."""
    return peft_versions(base_ref, tmp_path_factory.mktemp("versions"), (1, 2), rank=8, b_scale=0.03, name="v{seed}")


def _lps(chunks):
    return [lp.logprob for c in chunks for lp in (c.logprobs or [])]


def _max_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


def test_a_stream_keeps_its_version_while_the_next_one_loads_and_serves(engine, run, versions):
    v1, v2 = versions
    prompt = chat(engine, "Write a long story about a dragon.")
    run(engine.load_adapter("story@1", str(v1)))
    n = 12

    async def swap_under_load():
        gen = engine.generate(
            prompt, SamplingParams(max_tokens=n, temperature=0.0, logprobs=True, ignore_eos=True), adapter="story@1"
        )
        head = [await gen.__anext__()]  # v1 is running ...
        await engine.load_adapter("story@2", str(v2))  # ... while v2 loads
        assert sorted(engine.loaded_adapters()) == ["story@1", "story@2"]
        with pytest.raises(ConflictError):  # leased: refused, nothing changes
            await engine.unload_adapter("story@1")
        assert sorted(engine.loaded_adapters()) == ["story@1", "story@2"]
        second = asyncio.ensure_future(
            collect(
                engine,
                prompt,
                SamplingParams(max_tokens=n, temperature=0.0, logprobs=True, ignore_eos=True),
                adapter="story@2",
            )
        )
        tail = [c async for c in gen]
        return head + tail, await second

    chunks1, (tokens2, _, chunks2) = run(swap_under_load())
    tokens1 = [t for c in chunks1 for t in c.token_ids]
    assert len(tokens1) == n and len(tokens2) == n and chunks1[-1].finish_reason == "length"
    s1 = [x.logprob for x in run(engine.score(prompt + tokens1, adapter="story@1"))[len(prompt) :]]
    s1_under_v2 = [x.logprob for x in run(engine.score(prompt + tokens1, adapter="story@2"))[len(prompt) :]]
    s2 = [x.logprob for x in run(engine.score(prompt + tokens2, adapter="story@2"))[len(prompt) :]]
    assert _lps(chunks1) == pytest.approx(s1, abs=LP_TOL), "the v1 stream changed weights mid-sequence"
    assert _max_diff(_lps(chunks1), s1_under_v2) > 1e-2, "v1 and v2 must differ for this test to mean anything"
    assert _lps(chunks2) == pytest.approx(s2, abs=LP_TOL)

    # drained: now the old version unloads, the new one keeps serving
    run(engine.unload_adapter("story@1"))
    assert engine.loaded_adapters() == ["story@2"]
    with pytest.raises(ModelNotFoundError):
        engine.generate(prompt, greedy(2), adapter="story@1")
    again = run(
        collect(
            engine,
            prompt,
            SamplingParams(max_tokens=n, temperature=0.0, logprobs=True, ignore_eos=True),
            adapter="story@2",
        )
    )
    assert again[0] == tokens2
    if engine.kind == "vllm":
        assert run(engine.vllm_loaded_ids()) == {engine.lora_int_id("story@2")}
    run(engine.unload_adapter("story@2"))
    assert engine.loaded_adapters() == [] and engine.num_unfinished_requests() == 0


def test_store_copy_can_change_after_load_and_a_reused_name_serves_new_weights(
    engine, run, versions, base_ref, tmp_path
):
    from peft import PeftModel

    from livelora.core.base_models import load_model

    v1, v2 = versions
    prompt = chat(engine, "Name a color.")
    tokens = prompt + run(collect(engine, prompt, greedy(6, ignore_eos=True)))[0]
    src = tmp_path / "published"
    shutil.copytree(v1, src)
    run(engine.load_adapter("color@1", str(src)))
    first = [x.logprob for x in run(engine.score(tokens, adapter="color@1"))[1:]]
    with torch.no_grad():  # the reference: plain peft on the same weights
        ref = PeftModel.from_pretrained(load_model(base_ref), str(v1)).eval()
        ref_lp = torch.log_softmax(ref(input_ids=torch.tensor([tokens])).logits[0, :-1], -1)
    assert first == pytest.approx(ref_lp.gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1).tolist(), abs=LP_TOL)

    # the store's directory is rewritten with other weights, then deleted: the engine does not notice
    shutil.copyfile(v2 / "adapter_model.safetensors", src / "adapter_model.safetensors")
    assert [x.logprob for x in run(engine.score(tokens, adapter="color@1"))[1:]] == pytest.approx(first, abs=LP_TOL)
    shutil.rmtree(src)
    assert [x.logprob for x in run(engine.score(tokens, adapter="color@1"))[1:]] == pytest.approx(first, abs=LP_TOL)
    old_id = engine.lora_int_id("color@1") if engine.kind == "vllm" else None

    # the same name after unload: the new weights are served, not a cached copy of the old ones
    run(engine.unload_adapter("color@1"))
    run(engine.load_adapter("color@1", str(v2)))
    run(engine.load_adapter("color@2", str(v2)))
    reused = [x.logprob for x in run(engine.score(tokens, adapter="color@1"))[1:]]
    fresh = [x.logprob for x in run(engine.score(tokens, adapter="color@2"))[1:]]
    assert reused == pytest.approx(fresh, abs=LP_TOL) and _max_diff(reused, first) > 1e-2
    if engine.kind == "vllm":  # integer ids are never reused
        ids = {engine.lora_int_id("color@1"), engine.lora_int_id("color@2")}
        assert len(ids) == 2 and min(ids) > old_id
    for name in ("color@1", "color@2"):
        run(engine.unload_adapter(name))
    assert engine.loaded_adapters() == []


def test_vllm_lora_cache_settings_reach_the_engine_args(monkeypatch):
    """max_loras (adapters in one GPU batch) and max_cpu_loras (vLLM's host-memory LRU cache behind it) become
    the AsyncEngineArgs fields of those names; no vLLM needed."""
    from livelora.clients.errors import BadRequestError
    from livelora.gateway.engines.vllm.config import VLLMConfig

    args = VLLMConfig(device="cuda", max_loras=8, max_cpu_loras=64).engine_kwargs("/m", "m", 1024)
    assert (args["enable_lora"], args["max_loras"], args["max_cpu_loras"]) == (True, 8, 64)
    assert VLLMConfig(device="cuda", max_loras=4).engine_kwargs("/m", "m", 1024)["max_cpu_loras"] == 5
    monkeypatch.setenv("LIVELORA_VLLM_MAX_LORAS", "16")
    monkeypatch.setenv("LIVELORA_VLLM_MAX_CPU_LORAS", "256")
    args = VLLMConfig(device="cuda").engine_kwargs("/m", "m", 1024)
    assert (args["max_loras"], args["max_cpu_loras"]) == (16, 256)
    with pytest.raises(BadRequestError, match="max_cpu_loras"):
        VLLMConfig(device="cuda", max_loras=8, max_cpu_loras=4)


def test_vllm_engine_settings_are_checked_before_vllm_is_imported(run, monkeypatch):
    import importlib.util

    from livelora.clients.errors import BadRequestError, UnavailableError
    from livelora.gateway.engines.vllm.engine import VLLMEngine

    for bad in ({"max_loras": 1}, {"max_lora_rank": 12}, {"device": "cuda:1"}, {"max_batch_size": 0}):
        with pytest.raises(BadRequestError):
            create_engine("vllm", **bad)
    monkeypatch.setenv("LIVELORA_VLLM_MAX_LORAS", "3")
    monkeypatch.setenv("LIVELORA_VLLM_TENSOR_PARALLEL_SIZE", "2")
    eng = create_engine("vllm", device="cpu")
    assert isinstance(eng, VLLMEngine) and eng.config.max_loras == 3 and eng.config.tensor_parallel_size == 2
    assert eng.config.dtype == "float32" and eng.config.enforce_eager and eng.max_model_len == 1024  # CPU defaults
    gpu = VLLMEngine(device="cuda", max_loras=2)
    assert gpu.config.dtype == "bfloat16" and not gpu.config.enforce_eager and gpu.config.max_loras == 2
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(UnavailableError, match="setup-vllm-cpu"):
            run(eng.start())
