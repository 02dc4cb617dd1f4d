"""The official tinker SDKs (0.38.x: protobuf + zstd; 0.24.1: JSON), unmodified, against a live livelora gateway.

Each SDK runs in its own venv (``.ci/setup-tinker-sdks``; or ``LIVELORA_TINKER038_PYTHON`` /
``LIVELORA_TINKER024_PYTHON``) through ``tests/tinker_sdk_live.py``; without the venvs these tests skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import zstandard

from _sessions_server import MODEL, sessions_server  # noqa: F401  (fixture)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_tinker_wire_sdk import sdk_python  # noqa: E402


def run_live(version: str, base_url: str, tokenizer) -> dict:
    python = sdk_python(version)
    if python is None:
        pytest.skip(f"no tinker SDK venv for {version}: run .ci/setup-tinker-sdks")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINKER_")}
    env.update(TINKER_BASE_URL=base_url, TINKER_API_KEY="tml-local", TINKER_TELEMETRY="0", PYTHONPATH="",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    spec = {"base_model": MODEL, "texts": [tokenizer.encode(t) for t in ("The sky is blue.", "Grass is green.")],
            "prompt": tokenizer.encode("The sky is")}
    proc = subprocess.run([str(python), str(HERE / "tinker_sdk_live.py")], input=json.dumps(spec),
                          capture_output=True, text=True, timeout=900, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "fatal" not in out, out
    return out


@pytest.mark.parametrize("version", ["038", "024"])
def test_official_sdk_against_live_gateway(version, sessions_server, tokenizer):
    out = run_live(version, sessions_server.base_url, tokenizer)
    assert out["version"].startswith("0.38" if version == "038" else "0.24")
    assert out["fb_logprob_lens"] == [len(tokenizer.encode(t)) - 1 for t in ("The sky is blue.", "Grass is green.")]
    assert out["losses"][-1] < 0.7 * out["losses"][0], out["losses"]
    assert out["is_metrics"]["loss:sum"] != 0
    assert out["optim_after_refused"] is True
    assert out["resumed_forward_loss"] == pytest.approx(out["forward_loss_again"], rel=1e-5)
    assert out["save_state"].startswith(f"tinker://{out['model_id']}/weights/live-ckpt")
    assert len(out["samples"]) == 2
    for s in out["samples"]:
        assert 0 < len(s["tokens"]) <= 4 and len(s["logprobs"]) == len(s["tokens"])
    n = len(tokenizer.encode("The sky is"))
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) == n
    assert out["compute_logprobs"][1:] == pytest.approx(out["prompt_logprobs"][1:], abs=1e-4)
    assert out["async"]["sample"] == 1 and out["async"]["optim"] is True, out["async"]
    if version == "038":
        assert out["gspo_metrics"]["loss:sum"] < 0, out["gspo_metrics"]  # A = 0.5 > 0 on every sampled token
        assert "stable_reinforce" in out["stable_reinforce"]["error"] and "unpublished" in out["stable_reinforce"]["error"]
        for s in out["samples"]:  # sample_sequence_ids stamped by the SDK; top-3 at every sampled token
            assert s["sequence_id"]
            assert len(s["topk"]) == len(s["tokens"])
            for tok, lp, row in zip(s["tokens"], s["logprobs"], s["topk"]):
                assert len(row) == 3 and row[0][1] >= row[1][1] >= row[2][1]
                assert lp <= row[0][1] + 1e-4
                if tok in [r[0] for r in row]:
                    assert dict((a, b) for a, b in row)[tok] == pytest.approx(lp, abs=1e-3)
        assert len({s["sequence_id"] for s in out["samples"]}) == 2
        for field in ("target_prompt_logprobs", "prompt_alt_tokens_k", "record_stability_info"):
            assert field in out[f"refused:{field}"]["error"], out[f"refused:{field}"]


def _create_model(base: str, session_id: str, seq: int) -> str:
    r = httpx.post(f"{base}/api/v1/create_model", json={"session_id": session_id, "model_seq_id": seq,
                                                        "base_model": MODEL, "lora_config": {"rank": 4}})
    assert r.status_code == 200, r.text
    fut = r.json()["request_id"]
    res = httpx.post(f"{base}/api/v1/retrieve_future", json={"request_id": fut}, timeout=60).json()
    assert "error" not in res, res
    return r.json()["model_id"]


def _retrieve(base: str, request_id: str, accept: str = "application/json") -> httpx.Response:
    for _ in range(20):
        r = httpx.post(f"{base}/api/v1/retrieve_future", json={"request_id": request_id},
                       headers={"Accept": accept}, timeout=60)
        if r.status_code != 408:
            return r
    raise AssertionError("future never resolved")


def test_undecodable_protobuf_fails_at_once_and_frees_its_seq(sessions_server):
    """A corrupt protobuf forward_backward is a 400 at once; the optim_step queued after it does not wait."""
    base = sessions_server.base_url
    sid = httpx.post(f"{base}/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
    model_id = _create_model(base, sid, 0)
    head = b"\x0a" + bytes([len(model_id)]) + model_id.encode() + b"\x10\x01"  # fields 1 (model_id), 2 (seq_id=1)
    corrupt = head + b"\x1a\xff\xff\x03garbage"  # field 3 (data) claims 65535 bytes
    r = httpx.post(f"{base}/api/v1/forward_backward", content=zstandard.ZstdCompressor().compress(corrupt),
                   headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_body"
    r = httpx.post(f"{base}/api/v1/forward_backward", content=b"x",
                   headers={"Content-Type": "application/x-msgpack"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_content_type"
    r = httpx.post(f"{base}/api/v1/optim_step", json={"model_id": model_id, "seq_id": 2,
                                                      "adam_params": {"learning_rate": 1e-4}})
    assert r.status_code == 200, r.text
    res = _retrieve(base, r.json()["request_id"])  # it ran (seq 1 was consumed), on no gradients
    assert res.status_code == 200 and "no gradients accumulated" in res.json()["error"], res.text
    # a different body under an already used seq: a failed future, never a 409
    r = httpx.post(f"{base}/api/v1/optim_step", json={"model_id": model_id, "seq_id": 2,
                                                      "adam_params": {"learning_rate": 5e-4}})
    assert r.status_code == 200, r.text
    res = _retrieve(base, r.json()["request_id"]).json()
    assert res["category"] == "user" and res["code"] == "seq_conflict", res
