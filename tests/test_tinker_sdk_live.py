"""The official tinker SDKs (0.38.x: protobuf + zstd; 0.24.1: JSON), unmodified, against a live livelora gateway.

Each SDK runs in its own venv (``.ci/setup-tinker-sdks``; or ``LIVELORA_TINKER038_PYTHON`` /
``LIVELORA_TINKER024_PYTHON``) through ``tests/tinker_sdk_live.py``; without the venvs these tests skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import zstandard
from harness.server import MODEL

from livelora.core.base_models import HUB_IDS

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness.sdks import sdk_python  # noqa: E402


def run_live(version: str, base_url: str, tokenizer, hf_cache: Path) -> dict:
    python = sdk_python(version)
    if python is None:
        pytest.skip(f"no tinker SDK venv for {version}: run .ci/setup-tinker-sdks")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINKER_")}
    env.update(
        TINKER_BASE_URL=base_url,
        TINKER_API_KEY="tml-local",
        TINKER_TELEMETRY="0",
        PYTHONPATH="",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_CACHE=str(hf_cache),
    )
    spec = {
        "base_model": MODEL,
        "hub_id": HUB_IDS[MODEL],
        "texts": [tokenizer.encode(t) for t in ("The sky is blue.", "Grass is green.")],
        "prompt": tokenizer.encode("The sky is"),
    }
    proc = subprocess.run(
        [str(python), str(HERE / "tinker_sdk_live.py")],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "fatal" not in out, out
    return out


@pytest.mark.parametrize("version", ["038", "024"])
def test_official_sdk_against_live_gateway(version, sessions_server, tokenizer, tmp_path):
    from livelora.cli.main import hf_cache

    # what `livelora hf-cache --url` does on a client machine: the server's tokenizer files, under the hub id
    hf_cache(url=sessions_server.base_url, cache_dir=tmp_path / "hub")
    out = run_live(version, sessions_server.base_url, tokenizer, tmp_path / "hub")
    assert Path(out["info"]["tokenizer_id"]).is_dir()  # a caller on the server's machine: the placed folder
    assert out["sdk_tokenizer"] == tokenizer.encode("The sky is blue."), out["sdk_tokenizer"]
    # SamplingClient.get_tokenizer() loads by the sampler's base model: the hub id the server reports, or the served
    # name given as base_model; `livelora hf-cache` placed the tokenizer under both (issue 29)
    assert out["sampler_tokenizer"] == tokenizer.encode("The sky is blue."), out["sampler_tokenizer"]
    assert out["named_sampler_tokenizer"] == tokenizer.encode("The sky is blue."), out["named_sampler_tokenizer"]
    assert out["hub_id_accepted"].endswith(":train:1")
    assert out["version"].startswith("0.38" if version == "038" else "0.24")
    assert out["fb_logprob_lens"] == [len(tokenizer.encode(t)) - 1 for t in ("The sky is blue.", "Grass is green.")]
    assert out["losses"][-1] < 0.7 * out["losses"][0], out["losses"]
    assert out["is_metrics"]["loss:sum"] != 0
    assert out["optim_after_refused"] is True
    assert out["resumed_forward_loss"] == pytest.approx(out["forward_loss_again"], rel=1e-5)
    assert out["save_state"].startswith(f"tinker://{out['model_id']}/weights/live-ckpt")
    assert len(out["samples"]) == 2
    assert out["rest_run"]["id"] == out["model_id"] and out["rest_run"]["last_checkpoint"] == "weights/live-ckpt"
    assert out["rest_checkpoints"][0][0] == "weights/live-ckpt" and out["rest_checkpoints"][0][1] != "None"
    assert out["rest_user_checkpoints"] >= 1 and out["model_id"] in out["rest_runs"]
    for s in out["samples"]:
        assert 0 < len(s["tokens"]) <= 4 and len(s["logprobs"]) == len(s["tokens"])
    n = len(tokenizer.encode("The sky is"))
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) == n
    assert out["compute_logprobs"][1:] == pytest.approx(out["prompt_logprobs"][1:], abs=1e-4)
    assert out["async"]["sample"] == 1 and out["async"]["optim"] is True, out["async"]
    if version == "038":
        assert out["gspo_metrics"]["loss:sum"] < 0, out["gspo_metrics"]  # A = 0.5 > 0 on every sampled token
        assert (
            "stable_reinforce" in out["stable_reinforce"]["error"] and "unpublished" in out["stable_reinforce"]["error"]
        )
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
    r = httpx.post(
        f"{base}/api/v1/create_model",
        json={"session_id": session_id, "model_seq_id": seq, "base_model": MODEL, "lora_config": {"rank": 4}},
    )
    assert r.status_code == 200, r.text
    fut = r.json()["request_id"]
    res = httpx.post(f"{base}/api/v1/retrieve_future", json={"request_id": fut}, timeout=60).json()
    assert "error" not in res, res
    return r.json()["model_id"]


def _retrieve(base: str, request_id: str, accept: str = "application/json") -> httpx.Response:
    for _ in range(20):
        r = httpx.post(
            f"{base}/api/v1/retrieve_future", json={"request_id": request_id}, headers={"Accept": accept}, timeout=60
        )
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
    r = httpx.post(
        f"{base}/api/v1/forward_backward",
        content=zstandard.ZstdCompressor().compress(corrupt),
        headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_body"
    r = httpx.post(f"{base}/api/v1/forward_backward", content=b"x", headers={"Content-Type": "application/x-msgpack"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_content_type"
    r = httpx.post(
        f"{base}/api/v1/optim_step", json={"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-4}}
    )
    assert r.status_code == 200, r.text
    res = _retrieve(base, r.json()["request_id"])  # it ran (seq 1 was consumed), on no gradients
    assert res.status_code == 200 and "no gradients accumulated" in res.json()["error"], res.text
    # a different body under an already used seq: a failed future, never a 409
    r = httpx.post(
        f"{base}/api/v1/optim_step", json={"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 5e-4}}
    )
    assert r.status_code == 200, r.text
    res = _retrieve(base, r.json()["request_id"]).json()
    assert res["category"] == "user" and res["code"] == "seq_conflict", res


def _op(base: str, route: str, body: dict) -> dict:
    r = httpx.post(f"{base}/api/v1/{route}", json=body)
    assert r.status_code == 200, r.text
    return _retrieve(base, r.json()["request_id"]).json()


def test_checkpoint_ttl_expiry_spares_checkpoints_in_use(sessions_server):
    """ttl_seconds sets expires_at; housekeeping deletes expired checkpoints, never one loaded for sampling."""
    from datetime import UTC, datetime, timedelta

    from livelora.gateway.api.deps import services_of

    base = sessions_server.base_url
    sid = httpx.post(f"{base}/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
    model_id = _create_model(base, sid, 0)
    assert "error" not in _op(
        base,
        "save_weights",
        {"model_id": model_id, "seq_id": 1, "path": "t1", "ttl_seconds": 3600, "user_metadata": {"step": "1"}},
    )
    assert "error" not in _op(base, "save_weights", {"model_id": model_id, "seq_id": 2, "path": "keep"})
    res = _op(base, "save_weights_for_sampler", {"model_id": model_id, "seq_id": 3, "path": "s1", "ttl_seconds": 3600})
    assert res["path"] == f"tinker://{model_id}/sampler_weights/s1", res
    bad = _op(base, "save_weights", {"model_id": model_id, "seq_id": 4, "path": "t2", "ttl_seconds": 5})
    assert bad["category"] == "user" and "ttl_seconds" in bad["error"], bad
    listed = httpx.get(f"{base}/api/v1/training_runs/{model_id}/checkpoints").json()["checkpoints"]
    by_id = {c["checkpoint_id"]: c for c in listed}
    assert set(by_id) == {"weights/t1", "weights/keep", "sampler_weights/s1"}
    in_an_hour = datetime.now(UTC) + timedelta(hours=1)
    for cid in ("weights/t1", "sampler_weights/s1"):
        assert abs((datetime.fromisoformat(by_id[cid]["expires_at"]) - in_an_hour).total_seconds()) < 120
    # no ttl_seconds: the default retention, LIVELORA_CHECKPOINT_RETENTION_S (30 days)
    in_30_days = datetime.now(UTC) + timedelta(days=30)
    assert abs((datetime.fromisoformat(by_id["weights/keep"]["expires_at"]) - in_30_days).total_seconds()) < 120
    assert by_id["weights/t1"]["user_metadata"] == {"step": "1"}
    # the sampler checkpoint is being served (a sampling session loaded it)
    r = httpx.post(
        f"{base}/api/v1/create_sampling_session",
        json={"session_id": sid, "sampling_session_seq_id": 0, "model_path": res["path"]},
    )
    assert r.status_code == 200, r.text
    run = httpx.get(f"{base}/api/v1/training_runs/{model_id}").json()
    assert run["last_request_time"] and run["last_checkpoint"]["checkpoint_id"] in ("weights/t1", "weights/keep")
    checkpoints = services_of(sessions_server.app).sessions.checkpoints
    assert checkpoints.expire_due() == []  # nothing has expired yet
    deleted = checkpoints.expire_due(datetime.now(UTC) + timedelta(hours=2))  # (other runs' may go too)
    assert [p for p in deleted if p.startswith(f"tinker://{model_id}/")] == [f"tinker://{model_id}/weights/t1"]
    left = {
        c["checkpoint_id"]
        for c in httpx.get(f"{base}/api/v1/training_runs/{model_id}/checkpoints").json()["checkpoints"]
    }
    assert left == {"weights/keep", "sampler_weights/s1"}
    # TTL update, publish / unpublish, user checkpoint listing, training-run listing
    path = f"{base}/api/v1/training_runs/{model_id}/checkpoints/weights/keep"
    assert httpx.put(f"{path}/ttl", json={"ttl_seconds": 7200}).status_code == 204
    assert httpx.post(f"{path}/publish").status_code == 204
    mine = httpx.get(f"{base}/api/v1/checkpoints", params={"limit": 1000}).json()["checkpoints"]
    keep = next(c for c in mine if c["tinker_path"] == f"tinker://{model_id}/weights/keep")
    assert keep["public"] is True and keep["expires_at"]
    assert httpx.delete(f"{path}/publish").status_code == 204
    runs = httpx.get(f"{base}/api/v1/training_runs", params={"limit": 1000}).json()
    assert model_id in [r["training_run_id"] for r in runs["training_runs"]]
    # archive: a signed URL (no API key needed) of a tar with the adapter and checkpoint_complete
    url = httpx.get(f"{path}/archive").json()["url"]
    import io
    import tarfile

    tar = tarfile.open(fileobj=io.BytesIO(httpx.get(url).content))
    assert set(tar.getnames()) == {"adapter_config.json", "adapter_model.safetensors", "checkpoint_complete"}
    assert httpx.get(url[:-4] + "0000").status_code == 404


def _train_step(base: str, model_id: str, seq: int, tokens: list[int]) -> None:
    """forward_backward (seq) + optim_step (seq + 1) at a large learning rate: every LoRA ``B`` leaves zero."""
    n = len(tokens) - 1
    datum = {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [n]},
            "weights": {"data": [1.0] * n, "dtype": "float32", "shape": [n]},
        },
    }
    assert "error" not in _op(
        base,
        "forward_backward",
        {"model_id": model_id, "seq_id": seq, "forward_backward_input": {"data": [datum], "loss_fn": "cross_entropy"}},
    )
    assert "error" not in _op(
        base, "optim_step", {"model_id": model_id, "seq_id": seq + 1, "adam_params": {"learning_rate": 1e-2}}
    )


def _stored_files(home: Path, model_id: str, checkpoint_id: str) -> Path:
    """The store's version directory behind a checkpoint."""
    from livelora.adapters.store import AdapterStore
    from livelora.core.session_protocol import CheckpointIndex

    index = CheckpointIndex(home, model_id)
    return AdapterStore(home).version_dir(index.lineage, index.resolve(*checkpoint_id.split("/")))


def test_save_weights_external_signed_file_urls_ttl_and_delete(sessions_server, tokenizer, livelora_home):
    """``save_weights_external`` writes a PEFT adapter directory as checkpoint ``external_weights/<name>``; its
    files come from signed, expiring URLs that need no API key; it is listed, re-timed, expired and deleted like
    any checkpoint; other kinds have no file URLs, and an export is not loadable as a training checkpoint."""
    from datetime import UTC, datetime, timedelta

    from safetensors.torch import load_file

    from livelora.gateway.api.deps import services_of
    from livelora.gateway.middleware.auth import PUBLIC, required_role

    base = sessions_server.base_url
    sid = httpx.post(f"{base}/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
    model_id = _create_model(base, sid, 0)
    _train_step(base, model_id, 1, tokenizer.encode("The sky is blue."))
    assert "error" not in _op(base, "save_weights", {"model_id": model_id, "seq_id": 3, "path": "w"})
    res = _op(
        base,
        "save_weights_external",
        {"model_id": model_id, "seq_id": 4, "path": "export", "ttl_seconds": 3600, "type": "save_weights_external"},
    )
    path = f"tinker://{model_id}/external_weights/export"
    stored = _stored_files(livelora_home, model_id, "external_weights/export")
    files = {"adapter_config.json", "adapter_model.safetensors"}
    assert res == {
        "path": path,
        "size_bytes": sum((stored / f).stat().st_size for f in files),
        "type": "save_weights_external",
    }, res
    # refused by name, each consuming its seq (the next op runs)
    enc = _op(
        base,
        "save_weights_external",
        {"model_id": model_id, "seq_id": 5, "path": "e2", "age_encryption_recipients": ["age1xyz"]},
    )
    assert enc["code"] == "unsupported_parameter" and enc["param"] == "age_encryption_recipients", enc
    for seq, body in ((6, {"path": "../up"}), (7, {"path": "e3", "ttl_seconds": 60})):
        bad = _op(base, "save_weights_external", {"model_id": model_id, "seq_id": seq, **body})
        assert bad["category"] == "user" and bad["param"] in ("path", "ttl_seconds"), bad
    # listed with its type, TTL and size
    listed = {
        c["checkpoint_id"]: c
        for c in httpx.get(f"{base}/api/v1/training_runs/{model_id}/checkpoints").json()["checkpoints"]
    }
    assert set(listed) == {"weights/w", "external_weights/export"}
    ext = listed["external_weights/export"]
    assert (
        ext["checkpoint_type"] == "external" and ext["tinker_path"] == path and ext["size_bytes"] == res["size_bytes"]
    )
    in_an_hour = datetime.now(UTC) + timedelta(hours=1)
    assert abs((datetime.fromisoformat(ext["expires_at"]) - in_an_hour).total_seconds()) < 120
    mine = httpx.get(f"{base}/api/v1/checkpoints", params={"limit": 1000}).json()["checkpoints"]
    assert [c["checkpoint_type"] for c in mine if c["tinker_path"] == path] == ["external"]
    assert httpx.post(f"{base}/api/v1/weights_info", json={"tinker_path": path}).json()["lora_rank"] == 4
    # per-file signed URLs, fetched without any header; the bytes are the store's, the weights those of save_state
    ckpt = f"{base}/api/v1/training_runs/{model_id}/checkpoints/external_weights/export"
    got = httpx.get(f"{ckpt}/external_weights_urls").json()
    assert set(got["urls"]) == files
    assert 0 < (datetime.fromisoformat(got["expires"]) - datetime.now(UTC)).total_seconds() <= 900
    for name, url in got["urls"].items():
        assert required_role("GET", httpx.URL(url).path) == PUBLIC  # no key needed, also in key mode
        r = httpx.get(url)
        assert r.status_code == 200 and r.content == (stored / name).read_bytes(), (name, r.status_code)
        assert int(r.headers["content-length"]) == len(r.content)
    state_dir = _stored_files(livelora_home, model_id, "weights/w")
    ext_w, state_w = (load_file(str(d / "adapter_model.safetensors")) for d in (stored, state_dir))
    assert ext_w.keys() == state_w.keys() and all(ext_w[k].equal(state_w[k]) for k in ext_w)
    assert any(ext_w[k].abs().sum() > 0 for k in ext_w if "lora_B" in k)
    cfg = json.loads((stored / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == HUB_IDS[MODEL] and cfg["peft_type"] == "LORA" and cfg["r"] == 4
    # a forged signature, or one file's token for another file, is 404
    cfg_url = got["urls"]["adapter_config.json"]
    assert httpx.get(cfg_url[: -len("adapter_config.json")] + "adapter_model.safetensors").status_code == 404
    token_end = cfg_url.rindex("/")
    assert httpx.get(cfg_url[: token_end - 4] + "0000" + cfg_url[token_end:]).status_code == 404
    # only external_weights has file URLs; an export is not a training checkpoint
    r = httpx.get(f"{base}/api/v1/training_runs/{model_id}/checkpoints/weights/w/external_weights_urls")
    assert r.status_code == 400 and r.json()["error"]["param"] == "checkpoint_id", r.text
    r = httpx.post(f"{base}/api/v1/load_weights", json={"session_id": sid, "model_seq_id": 1, "path": path})
    assert r.status_code == 400 and "external-weights export" in r.json()["error"]["message"], r.text
    # TTL update, then delete: the version goes, the URLs and the listing follow
    assert httpx.put(f"{ckpt}/ttl", json={"ttl_seconds": 7200}).status_code == 204
    ext = next(
        c
        for c in httpx.get(f"{base}/api/v1/training_runs/{model_id}/checkpoints").json()["checkpoints"]
        if c["checkpoint_id"] == "external_weights/export"
    )
    assert datetime.fromisoformat(ext["expires_at"]) > in_an_hour + timedelta(minutes=50)
    assert httpx.delete(ckpt).status_code == 204
    assert not stored.exists()
    assert httpx.get(got["urls"]["adapter_config.json"]).status_code == 404
    assert httpx.get(f"{ckpt}/external_weights_urls").status_code == 404
    # housekeeping expires exports like other checkpoints
    assert "error" not in _op(
        base, "save_weights_external", {"model_id": model_id, "seq_id": 8, "path": "e4", "ttl_seconds": 3600}
    )
    deleted = services_of(sessions_server.app).sessions.checkpoints.expire_due(datetime.now(UTC) + timedelta(hours=2))
    assert f"tinker://{model_id}/external_weights/e4" in deleted
    left = {
        c["checkpoint_id"]
        for c in httpx.get(f"{base}/api/v1/training_runs/{model_id}/checkpoints").json()["checkpoints"]
    }
    assert left == {"weights/w"}


def test_sdk_038_routes_join_cancel_and_clear_refusals(sessions_server, tokenizer):
    base = sessions_server.base_url
    sid = httpx.post(f"{base}/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
    r = httpx.post(
        f"{base}/api/v1/create_sampling_session",
        json={"session_id": sid, "sampling_session_seq_id": 0, "base_model": MODEL},
    )
    sampler = r.json()["sampling_session_id"]
    joins = [
        httpx.post(f"{base}/api/v1/join_sampling_session", json={"sampling_session_id": sampler}).json()
        for _ in range(2)
    ]
    assert [j["client_counter"] for j in joins] == [1, 2]
    missing = f"{'0' * 32}:sample:0"  # well spelled, never created (another spelling is 400: adapters/object_ids)
    assert httpx.post(f"{base}/api/v1/join_sampling_session", json={"sampling_session_id": missing}).status_code == 404
    assert (
        httpx.post(f"{base}/api/v1/join_sampling_session", json={"sampling_session_id": "nosuch:sample:0"}).status_code
        == 400
    )
    # cancel a running sample: its future fails with code "cancelled"
    sample = httpx.post(
        f"{base}/api/v1/asample",
        json={
            "sampling_session_id": sampler,
            "seq_id": 1,
            "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokenizer.encode("Tell me a long story.")}]},
            "sampling_params": {"max_tokens": 400, "stop": []},
        },
    ).json()
    assert len(sample["sample_sequence_ids"]) == 1
    c = httpx.post(f"{base}/api/v1/cancel_future", json={"request_id": sample["request_id"]}).json()
    res = _retrieve(base, sample["request_id"]).json()
    if c["cancelled"]:
        assert res["code"] == "cancelled" and res["category"] == "user", res
    else:  # it had already finished (a fast machine): a normal result
        assert "sequences" in res
    again = httpx.post(f"{base}/api/v1/cancel_future", json={"request_id": sample["request_id"]}).json()
    assert again["cancelled"] is False
    r = httpx.post(f"{base}/api/v1/cancel_future", json={"request_id": f"{sid}:train:0:1:0123456789ab"})
    assert r.status_code == 400 and "cannot be cancelled" in r.json()["error"]["message"]
    for route in ("create_custom_loss", "copy_weights"):  # 400, not 501: the SDK retries every 5xx for minutes
        r = httpx.post(f"{base}/api/v1/{route}", json={})
        assert r.status_code == 400 and r.json()["error"]["code"] == "not_implemented", (route, r.text)
    me = httpx.get(f"{base}/api/v1/auth/apikey/me").json()
    assert isinstance(me["key_id"], int) and me["name"] and me["details"]["org_details"]["name"]
    dyn = httpx.post(f"{base}/api/v1/client/dynamic_config", json={"sdk_version": "0.38.0"}).json()
    assert dyn["sample_cancel_enabled"] is False and dyn["refresh_interval_sec"] == 300


def _peft_prompt_logprobs(base_ref, adapter_dir: Path, tokens: list[int]) -> tuple[list[float], list[float]]:
    """Logprob of each prompt token after the first under base + the PEFT adapter in ``adapter_dir``, and under
    the base model alone, computed here with plain transformers + peft (float32, CPU)."""
    import torch
    from peft import PeftModel

    from livelora.core.base_models import load_model

    model = PeftModel.from_pretrained(load_model(base_ref), str(adapter_dir)).eval()
    ids, targets = torch.tensor([tokens]), torch.tensor(tokens[1:])[:, None]
    with torch.no_grad():
        tuned = model(ids).logits[0, :-1].float()
        with model.disable_adapter():
            plain = model(ids).logits[0, :-1].float()
    return tuple(torch.log_softmax(x, -1).gather(1, targets)[:, 0].tolist() for x in (tuned, plain))


@pytest.mark.parametrize("version", ["038", "024"])
def test_tinker_cli_checkpoint_list_and_download(
    version, sessions_server, tmp_path, tokenizer, base_ref, livelora_home
):
    """``python -m tinker.cli checkpoint list|download`` of the official SDKs. Download: SDK ≤0.24 fetches a tar
    from the archive URL; SDK 0.38 loads the checkpoint into a new training run, exports it with
    ``save_weights_external``, fetches each file from its signed URL and deletes the export. The 0.38 download
    is a PEFT adapter with the checkpoint's exact tensors, and base + adapter under peft gives the logprobs the
    server computes for the same weights."""
    python = sdk_python(version)
    if python is None:
        pytest.skip(f"no tinker SDK venv for {version}: run .ci/setup-tinker-sdks")
    base = sessions_server.base_url
    sid = httpx.post(f"{base}/api/v1/create_session", json={"tags": [], "sdk_version": "x"}).json()["session_id"]
    model_id = _create_model(base, sid, 0)
    _train_step(base, model_id, 1, tokenizer.encode("The sky is blue."))
    assert "error" not in _op(base, "save_weights", {"model_id": model_id, "seq_id": 3, "path": "cli"})
    if version == "038":  # the same weights for the server's logprobs (saved now: the session expires unbeaten)
        assert "error" not in _op(
            base, "save_weights_for_sampler", {"model_id": model_id, "seq_id": 4, "path": "cli-s"}
        )
    path = f"tinker://{model_id}/weights/cli"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINKER_")}
    env.update(TINKER_BASE_URL=base, TINKER_API_KEY="tml-local", TINKER_TELEMETRY="0", PYTHONPATH="")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(python), "-m", "tinker.cli", "--format", "json", "checkpoint", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            check=False,
            cwd=str(tmp_path),
        )

    listed = cli("list")
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert path in [c["tinker_path"] for c in json.loads(listed.stdout)["checkpoints"]]
    got = cli("download", path, "--output", str(tmp_path / "dl"))
    assert got.returncode == 0, (got.stdout + got.stderr)[-3000:]
    (folder,) = (tmp_path / "dl").iterdir()
    files = {f.name for f in folder.iterdir()}
    if version == "024":
        assert files == {"adapter_config.json", "adapter_model.safetensors", "checkpoint_complete"}
        return
    from safetensors.torch import load_file

    assert files == {"adapter_config.json", "adapter_model.safetensors"}
    assert json.loads(got.stdout)["destination"] == str(folder)
    stored = load_file(str(_stored_files(livelora_home, model_id, "weights/cli") / "adapter_model.safetensors"))
    downloaded = load_file(str(folder / "adapter_model.safetensors"))
    assert downloaded.keys() == stored.keys() and all(downloaded[k].equal(stored[k]) for k in stored)
    # the temporary export (tinker://<new run>/external_weights/download) was deleted by the CLI
    mine = httpx.get(f"{base}/api/v1/checkpoints", params={"limit": 10000}).json()["checkpoints"]
    assert not [c for c in mine if c["tinker_path"].endswith("/external_weights/download")]
    # base + downloaded adapter under peft == the server's prompt logprobs for the same weights
    prompt = tokenizer.encode("The sky is blue and the grass is green.")
    served = httpx.post(
        f"{base}/api/v1/asample",
        json={
            "model_path": f"tinker://{model_id}/sampler_weights/cli-s",
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
            "prompt_logprobs": True,
            "sampling_params": {"max_tokens": 1},
        },
    ).json()
    served = _retrieve(base, served["request_id"]).json()["prompt_logprobs"]
    local, base_only = _peft_prompt_logprobs(base_ref, folder, prompt)
    assert served[0] is None and local == pytest.approx(served[1:], abs=1e-4)
    assert max(abs(a - b) for a, b in zip(local, base_only)) > 0.05  # the adapter moves them: a real comparison


def test_sessions_get_list_search_outlive_the_session(sessions_server):
    base = sessions_server.base_url
    meta = {"run": uuid.uuid4().hex}
    sid = httpx.post(
        f"{base}/api/v1/create_session",
        json={"tags": [], "sdk_version": "0.38.0", "display_name": "s1", "user_metadata": meta},
    ).json()["session_id"]
    model_id = _create_model(base, sid, 0)
    assert "error" not in _op(base, "save_weights", {"model_id": model_id, "seq_id": 1, "path": "a"})
    httpx.post(
        f"{base}/api/v1/create_sampling_session",
        json={"session_id": sid, "sampling_session_seq_id": 0, "base_model": MODEL},
    ).raise_for_status()
    got = httpx.get(f"{base}/api/v1/sessions/{sid}").json()
    assert got["training_run_ids"] == [model_id] and got["sampler_ids"] == [f"{sid}:sample:0"], got
    assert got["display_name"] == "s1" and got["user_metadata"] == meta
    search = {"user_metadata": meta}
    found = httpx.post(f"{base}/api/v1/sessions/search", json=search).json()["sessions"]
    assert [(s["session_id"], s["status"]["type"], s["checkpoints_count"]) for s in found] == [(sid, "active", 1)]
    r = httpx.post(f"{base}/api/v1/sessions/{sid}/finish", json={"reason": {"type": "interrupted"}})
    assert r.status_code == 200, r.text
    found = httpx.post(f"{base}/api/v1/sessions/search", json={**search, "statuses": [{"type": "client_finished"}]})
    (summary,) = found.json()["sessions"]
    assert summary["status"] == {"type": "client_finished", "reason": {"type": "interrupted"}, "detail": None}
    assert sid in httpx.get(f"{base}/api/v1/sessions", params={"limit": 5}).json()["sessions"]
    assert httpx.get(f"{base}/api/v1/sessions/{'0' * 32}").status_code == 404
    assert httpx.get(f"{base}/api/v1/sessions/nosuchsession").status_code == 400


def test_retrieve_futures_reports_a_sampling_sessions_completions(sessions_server, tokenizer):
    base = sessions_server.base_url
    sid = httpx.post(f"{base}/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
    sampler = httpx.post(
        f"{base}/api/v1/create_sampling_session",
        json={"session_id": sid, "sampling_session_seq_id": 0, "base_model": MODEL},
    ).json()["sampling_session_id"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": tokenizer.encode("Hi")}]}
    ids = [
        httpx.post(
            f"{base}/api/v1/asample",
            json={
                "sampling_session_id": sampler,
                "seq_id": seq,
                "num_samples": 1,
                "prompt": prompt,
                "sampling_params": {"max_tokens": 2},
            },
        ).json()["request_id"]
        for seq in (1, 2)
    ]
    seen, cursor = [], 0
    while len(seen) < 2:
        r = httpx.post(
            f"{base}/api/v1/retrieve_futures",
            json={"target": {"sampling_session_id": sampler}, "prev_cursor": cursor, "timeout": 10},
            timeout=60,
        ).json()
        seen += r["completions"]
        cursor = r["cursor"]
    assert sorted(c["request_id"] for c in seen) == sorted(ids) and all(c["state"] == "finished" for c in seen)
    clone = httpx.post(
        f"{base}/api/v1/retrieve_futures",
        json={"target": {"sampling_session_id": sampler, "cloned_sampler_id": 1}, "timeout": 0.1},
    ).json()
    assert clone["completions"] == [] and clone["cursor"] == 2
    for rid in ids:
        assert "sequences" in _retrieve(base, rid).json()
