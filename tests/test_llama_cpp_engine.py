"""What the llama_cpp engine does beyond the engine contract (tests/test_engine_contract.py runs that on it): its
prompt-prefix cache, its adapter versions' lifetime in llama.cpp, and the settings it refuses. Real model, real
llama.cpp; skipped where llama-cpp-python is not installed."""

from __future__ import annotations

import asyncio
import importlib.util
import json

import pytest
from harness.engines import chat, collect, greedy, logprob_tolerance
from harness.native import skip_if_native_crashes
from harness.seeds import peft_versions

from livelora.clients.errors import BadRequestError
from livelora.gateway.engines import SamplingParams, create_engine
from livelora.gateway.engines.llama_cpp.model import CRASH_FILE_ENV
from livelora.gateway.engines.llama_cpp.process import EngineCrashedError
from livelora.gateway.engines.transformers.calls import on_worker

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed here (pip install -e '.[dev]' builds it)",
)


@pytest.fixture(scope="module")
def llama(base_ref, loop):
    """Versions stay LoRAs here (merge_lora=False): the cache tests follow one lane's cells."""
    skip_if_native_crashes()
    engine = create_engine("llama_cpp", model=base_ref.name, max_batch_size=4, max_model_len=1024, merge_lora=False)
    loop.run_until_complete(engine.start())
    yield engine
    loop.run_until_complete(engine.close())


def test_a_shared_prompt_prefix_is_reused_and_changes_nothing(llama, run):
    worker = llama._worker
    prompts = [chat(llama, q) for q in ("Name a fruit.", "Name a colour.", "Name a planet.")]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts[:2])) if a != b)  # the system turn and more
    assert shared >= 8 and prompts[2][:shared] == prompts[0][:shared]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, ignore_eos=True)
    for p in prompts[:2]:  # the second finds what it shares with the first and keeps it
        run(collect(llama, p, params))
    before = worker.backend.prefix_tokens_reused
    tokens, _, chunks = run(collect(llama, prompts[2], params))  # its first `shared` tokens come from the cache
    assert worker.backend.prefix_tokens_reused - before == shared
    served = [lp.logprob for c in chunks for lp in c.logprobs]
    scored = [x.logprob for x in run(llama.score(prompts[2] + tokens))[len(prompts[2]) :]]  # from scratch
    assert served == pytest.approx(scored, abs=logprob_tolerance(llama))  # one row vs many: docs/internals/engines.md
    # the same prompt twice more: the second time all of it is reused but its last token (its logits start the reply)
    run(collect(llama, prompts[2], params))
    before = worker.backend.prefix_tokens_reused
    again, _, _ = run(collect(llama, prompts[2], params))
    assert worker.backend.prefix_tokens_reused - before == len(prompts[2]) - 1 and again == tokens
    # reused in place: the finished row's id keeps its prompt's cells, and the next row takes the lowest free id
    base = worker.backend.base
    assert run(on_worker(worker, lambda: base.kept[min(base.free_ids)])) == (None, prompts[2])


def test_prefixes_are_kept_per_version_and_dropped_with_it(llama, run, base_ref, tmp_path):
    worker = llama._worker
    version = peft_versions(base_ref, tmp_path, (3,), rank=4, b_scale=0.3)[0]
    run(llama.load_adapter("t@1", str(version)))
    prompts = [chat(llama, q) for q in ("One.", "Two.", "Three.")]

    async def replies(adapter):  # one at a time: with a version, one row and many differ in the last bits
        return [(await collect(llama, p, greedy(4), adapter=adapter))[0] for p in prompts]

    on_version = run(replies("t@1"))
    on_version_again = run(replies("t@1"))  # now from t@1's own prefix cache
    assert "t@1" in worker.backend.base.prefixes and on_version_again == on_version
    on_base = run(replies(None))
    assert on_base != on_version  # the base's cells never serve the version, nor the reverse
    cid, _ = worker.backend.base.prefixes["t@1"]
    run(llama.unload_adapter("t@1"))
    assert "t@1" not in worker.backend.base.prefixes and cid in worker.backend.base.cache_ids
    assert all(
        adapter != "t@1" for adapter, _ in run(on_worker(worker, lambda: list(worker.backend.base.kept.values())))
    )  # no row reuses a gone version's cells
    assert "t@1" not in worker.backend.llama.adapters  # llama.cpp's copy freed


def same_or_near_tie(engine, lora: list[int], lora_chunks, merged: list[int]) -> int:
    """Where the merged lane's greedy tokens first differ from the LoRA's (``len(lora)``: nowhere); a difference
    must be a near tie: the LoRA's two likeliest tokens within twice the engine's logprob tolerance, the merged
    lane taking the second."""
    same = next((k for k, (a, b) in enumerate(zip(lora, merged)) if a != b), len(lora))
    if same < len(lora):
        lps = [lp for c in lora_chunks for lp in c.logprobs]
        (_, top_lp), (second, second_lp) = lps[same].top[:2]
        assert top_lp - second_lp <= 2 * logprob_tolerance(engine) and merged[same] == second, (same, lora, merged)
    return same


def test_a_version_serving_alone_is_merged_into_a_lane_of_its_own(base_ref, loop, run, tmp_path):
    """A version that serves every row for MERGE_AFTER_STEPS steps gets a merged float16 lane; its new rows run
    there (no LoRA in the graph) with the version's replies, the base and other versions stay on the base lane,
    the next version alone takes the lane's place once it is idle, and unloading the version closes it."""
    import gguf
    import numpy as np

    from livelora.gateway.engines.llama_cpp.lane import merge_gguf_lora

    skip_if_native_crashes()
    engine = create_engine("llama_cpp", model=base_ref.name, max_batch_size=4, max_model_len=512)
    loop.run_until_complete(engine.start())
    worker = engine._worker
    v1, v2 = peft_versions(base_ref, tmp_path, (5, 6), rank=8, b_scale=0.2)
    try:
        run(engine.load_adapter("m@1", str(v1)))
        run(engine.load_adapter("m@2", str(v2)))
        prompt = chat(engine, "Name a river.")
        params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=2, ignore_eos=True)
        first, _, chunks = run(collect(engine, prompt, params, adapter="m@1"))  # on the base lane, as a LoRA
        for _ in range(
            1200
        ):  # built off the worker thread (about 3 s alone; a minute allowed), taken by the next prefill
            if worker.backend.ready is not None or worker.backend.hot is not None:
                break
            run(asyncio.sleep(0.05))
        merged, _, merged_chunks = run(collect(engine, prompt, params, adapter="m@1"))
        hot = worker.backend.hot
        assert hot is not None and hot.version == "m@1" and hot.llama.adapters == {}
        kept = run(on_worker(worker, lambda: dict(hot.kept)))  # (read between steps: the row is released)
        assert list(kept.values()) == [("m@1", prompt)]  # the second request ran on the merged lane
        # float16 rounding of W + B A instead of W and the LoRA apart: the same greedy reply, except where the
        # LoRA's two likeliest tokens are within the engine's logprob tolerance (a near tie may break either way)
        same = same_or_near_tie(engine, first, chunks, merged)
        merged_lps = [lp.logprob for c in merged_chunks for lp in c.logprobs]
        lora_lps = [lp.logprob for c in chunks for lp in c.logprobs]
        assert merged_lps[:same] == pytest.approx(lora_lps[:same], abs=logprob_tolerance(engine))
        on_v2, _, v2_chunks = run(collect(engine, prompt, params, adapter="m@2"))  # m@2 alone: built
        on_base, _, _ = run(collect(engine, prompt, greedy(8, ignore_eos=True)))
        assert len({tuple(first), tuple(on_v2), tuple(on_base)}) == 3  # each on its own weights
        for _ in range(1200):
            if worker.backend.ready is not None or worker.backend.hot.version == "m@2":
                break
            run(asyncio.sleep(0.05))
        again_v2, _, _ = run(collect(engine, prompt, greedy(8, ignore_eos=True), adapter="m@2"))
        assert worker.backend.hot.version == "m@2"  # m@1's idle lane gave way to m@2's
        same_or_near_tie(engine, on_v2, v2_chunks, again_v2)
        run(engine.unload_adapter("m@1"))
        assert worker.backend.hot.version == "m@2" and "m@1" not in worker.backend.lora_files
        run(engine.unload_adapter("m@2"))
        assert worker.backend.hot is None and not worker.backend.lora_files
    finally:
        loop.run_until_complete(engine.close())
    # the merged file holds W + B A of the GGUF LoRA's factors, rounded to float16; other tensors untouched
    from livelora.core.base_models import gguf_location
    from livelora.gateway.engines.llama_cpp.model import served_gguf

    f16 = served_gguf(gguf_location(base_ref.name), "f16", tmp_path / "gguf")
    lora = tmp_path / "v1.gguf"
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from livelora.adapters.gguf_export import gguf_lora_from_state, write_gguf_lora

    cfg = json.loads((v1 / "adapter_config.json").read_text())
    factors = gguf_lora_from_state(
        cfg, load_file(v1 / "adapter_model.safetensors"), AutoConfig.from_pretrained(base_ref.path)
    )
    write_gguf_lora(lora, factors, "v1")
    merge_gguf_lora(f16, lora, tmp_path / "merged.gguf")
    base = {t.name: t for t in gguf.GGUFReader(f16).tensors}
    out = {t.name: t for t in gguf.GGUFReader(tmp_path / "merged.gguf").tensors}
    assert out.keys() == base.keys()
    a, b = (np.asarray(factors[f"blk.3.attn_q.weight.{k}"], dtype=np.float32) for k in ("lora_a", "lora_b"))
    w = np.asarray(base["blk.3.attn_q.weight"].data).astype(np.float32).reshape(b.shape[0], a.shape[1])
    want = (w + b @ a).astype(np.float16)
    assert np.array_equal(np.asarray(out["blk.3.attn_q.weight"].data).reshape(want.shape), want)
    assert np.array_equal(np.asarray(out["token_embd.weight"].data), np.asarray(base["token_embd.weight"].data))
    shipped = gguf_location(base_ref.name)  # a quantized file cannot take the update
    with pytest.raises(BadRequestError, match="not F16"):
        merge_gguf_lora(shipped, lora, tmp_path / "refused.gguf")


def test_the_engines_own_process_restarts_after_a_crash_with_its_versions(base_ref, loop, run, tmp_path, monkeypatch):
    """The gateway's form (``child_process=True``): adapter loads, scoring and generation go to the child; a crash
    (the test hook) fails the request it held, and the new child serves the loaded version as before."""
    skip_if_native_crashes()
    crash = tmp_path / "crash-now"
    monkeypatch.setenv(CRASH_FILE_ENV, str(crash))  # the child inherits it
    engine = create_engine("llama_cpp", child_process=True, model=base_ref.name, max_batch_size=2, max_model_len=512)
    loop.run_until_complete(engine.start())
    try:
        version = peft_versions(base_ref, tmp_path, (3,), rank=4, b_scale=0.3)[0]
        prompt = chat(engine, "Name a colour.")
        check = run(engine.load_and_check("t@1", str(version), prompt))
        before = run(collect(engine, prompt, greedy(6), adapter="t@1"))[0]
        crash.touch()
        with pytest.raises(EngineCrashedError, match=r"was killed by SIGSEGV \(signal 11\) while it held this request"):
            run(collect(engine, prompt, greedy(6), adapter="t@1"))
        crash.unlink()
        assert run(collect(engine, prompt, greedy(6), adapter="t@1"))[0] == before  # waits for the new child
        assert engine.restarts == 1 and engine.loaded_adapters() == ["t@1"] and engine.failure is None
        again = run(engine.score(prompt, adapter="t@1"))
        assert [e.token_id for e in again[1:]] == prompt[1:]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(again[1:], check.canary[1:], strict=True)) < 1e-4
    finally:
        loop.run_until_complete(engine.close())


def test_a_killed_workers_gguf_directory_is_swept_by_the_next_one(tmp_path, monkeypatch):
    """A worker keeps each version's GGUF LoRA in its own temp directory until the version unloads; a process killed
    before it stops leaves the directory, which the next worker on the machine removes (a live process's stays)."""
    import os
    import subprocess
    import sys

    from livelora.gateway.engines.llama_cpp import backend as lw

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"{lw.TMP_PREFIX}{gone.stdout.strip()}-abc"
    live = tmp_path / f"{lw.TMP_PREFIX}{os.getpid()}-def"
    other = tmp_path / "livelora-gguf-lora-notapid"
    for d in (dead, live, other):
        d.mkdir()
        (d / "v.gguf").write_bytes(b"x" * 10)
    lw.sweep_stale_dirs(tmp_path)
    assert not dead.exists() and live.exists() and other.exists()


def test_settings_and_arguments_it_cannot_honour_are_refused(monkeypatch, tmp_path):
    from pydantic import ValidationError

    from livelora.gateway.settings import GatewaySettings

    monkeypatch.setenv("LIVELORA_ENGINE", "llama_cpp")
    monkeypatch.setenv("LIVELORA_ENGINE_WEIGHTS", "int4")
    with pytest.raises(ValidationError, match="llama_cpp engine serves LIVELORA_ENGINE_WEIGHTS f16, gguf, not 'int4'"):
        GatewaySettings()
    monkeypatch.setenv("LIVELORA_ENGINE_WEIGHTS", "gguf")
    assert GatewaySettings().inference.engine_weights == "gguf"
    monkeypatch.delenv("LIVELORA_ENGINE_WEIGHTS")
    assert GatewaySettings().inference.engine_weights is None  # the engine's default: f16
    monkeypatch.setenv("LIVELORA_DEVICE", "cuda")  # refused before anything starts, not by the engine's start
    with pytest.raises(ValidationError, match="the llama_cpp engine runs on the CPU, not 'cuda'"):
        GatewaySettings()
    monkeypatch.delenv("LIVELORA_DEVICE")
    import importlib.util

    real = importlib.util.find_spec  # without the package: refused by the settings, before anything starts
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    with pytest.raises(ValidationError, match=r"needs llama-cpp-python: pip install -e '\.\[llamacpp\]'"):
        GatewaySettings()
    monkeypatch.setattr(importlib.util, "find_spec", real)
    with pytest.raises(BadRequestError, match="runs on the CPU"):
        create_engine("llama_cpp", device="cuda")
    for arg, value in (("weights", "int4"), ("dtype", "bfloat16")):
        with pytest.raises(BadRequestError) as err:
            create_engine("llama_cpp", **{arg: value})
        assert err.value.param == arg
    engine = create_engine("llama_cpp", model=str(tmp_path), home=tmp_path)
    with pytest.raises(BadRequestError, match="serves the built-in GGUF models"):
        engine.start_sync()


def test_the_f16_file_holds_the_shipped_weights_in_float16_and_is_written_once(tmp_path):
    import gguf
    import numpy as np

    from livelora.core.base_models import gguf_location
    from livelora.gateway.engines.llama_cpp.model import served_gguf

    skip_if_native_crashes()  # llama.cpp's quantizer runs in this process
    shipped = gguf_location("smollm2-135m-instruct")
    assert served_gguf(shipped, "gguf", tmp_path) == shipped  # the file's own types: the file itself
    f16 = served_gguf(shipped, "f16", tmp_path)
    assert f16.parent == tmp_path and [p.name for p in tmp_path.glob("*.gguf")] == [f16.name]  # no temp file left
    stamp = f16.stat().st_mtime_ns
    assert served_gguf(shipped, "f16", tmp_path) == f16 and f16.stat().st_mtime_ns == stamp  # converted once
    original = {t.name: t for t in gguf.GGUFReader(shipped).tensors}
    converted = {t.name: t for t in gguf.GGUFReader(f16).tensors}
    assert converted.keys() == original.keys()
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight"):
        src, out = original[name], converted[name]
        assert src.tensor_type != gguf.GGMLQuantizationType.F16 and out.tensor_type == gguf.GGMLQuantizationType.F16
        want = gguf.quants.dequantize(src.data, src.tensor_type).astype(np.float16)
        assert np.array_equal(np.asarray(out.data).reshape(want.shape), want)
    with pytest.raises(BadRequestError, match="weights must be one of gguf, f16"):
        served_gguf(shipped, "q2_k", tmp_path)
