"""The base model's tokenizer without a hub (issues 12 and 17), through a live gateway on the real SmolLM2.

``tokenizer_id`` is the hub id and never a server path (``get_info`` gives a caller on the server's machine the
folder of the tokenizer files it placed); ``GET /api/v1/tokenizer`` serves the tokenizer files;
livelora's SDK loads them from the server when the id does not resolve (``HF_HUB_OFFLINE=1``, empty HF cache);
``livelora hf-cache --url`` places them in a fresh Hugging Face cache, where ``AutoTokenizer.from_pretrained(hub_id)``
then resolves them offline. The client sides run in subprocesses with their own empty ``HF_HOME``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from harness.server import MODEL

from livelora.clients import ServiceClient
from livelora.clients.tokenizer_files import TOKENIZER_FILES, files_revision, from_response
from livelora.clients.types.tinker_ext import TokenizerFilesResponse
from livelora.core.base_models import HUB_IDS
from livelora.core.served_tokenizer import read_tokenizer_dir

HUB_ID = HUB_IDS[MODEL]
SAMPLE = "The sky is blue. <|im_start|>user\nÇa va? ✓ 12345<|im_end|>"


def client_env(tmp_path: Path, name: str) -> dict[str, str]:
    """A client machine: offline, an empty HF_HOME of its own, no HF_HUB_CACHE inherited."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HF_HOME", "TRANSFORMERS_CACHE")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(tmp_path / name / "hf"),
        LIVELORA_TOKENIZER_CACHE=str(tmp_path / name / "livelora-tokenizers"),
    )
    return env


def run(args: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def model_id(sessions_server):
    with ServiceClient(sessions_server.base_url, heartbeat_s=5.0) as service:
        yield service.create_lora_training_client(MODEL, rank=2, train_mlp=False, train_unembed=False).model_id


def test_tokenizer_id_is_the_hub_id_and_no_answer_names_a_server_path(sessions_server, model_id):
    url = sessions_server.url
    answers = {
        "caps": httpx.get(url("/api/v1/get_server_capabilities"), timeout=60),
        "info": httpx.post(url("/api/v1/get_info"), json={"model_id": model_id}, timeout=60),
        "tokenizer": httpx.get(url("/api/v1/tokenizer"), timeout=60),
    }
    # a caller behind a proxy is not on this machine, whatever the socket's address
    proxied = {"X-Forwarded-For": "203.0.113.7"}
    answers["info_proxied"] = httpx.post(
        url("/api/v1/get_info"), json={"model_id": model_id}, headers=proxied, timeout=60
    )
    assert answers["caps"].json()["supported_models"][0]["tokenizer_id"] == HUB_ID
    assert answers["info_proxied"].json()["model_data"]["tokenizer_id"] == HUB_ID
    assert answers["tokenizer"].json()["tokenizer_id"] == HUB_ID
    # to a caller on this machine, get_info names the folder the server placed the served files in (never the store)
    placed = Path(answers["info"].json()["model_data"]["tokenizer_id"])
    assert placed.is_absolute() and placed.name == answers["tokenizer"].headers["etag"].strip('"')
    served = from_response(TokenizerFilesResponse.model_validate(answers["tokenizer"].json()))
    assert read_tokenizer_dir(placed) == served
    source = sessions_server.services.engine.tokenizer.name_or_path  # where the server's tokenizer lives
    assert Path(source).is_dir()
    for name, r in answers.items():
        assert r.status_code == 200, (name, r.text[:300])
        for path in (str(sessions_server.services.settings.home), source, str(Path(source).resolve())):
            assert path not in r.text, (name, path)


def test_the_route_serves_the_tokenizer_files_that_encode_like_the_server(sessions_server, tmp_path):
    from transformers import AutoTokenizer

    r = httpx.get(sessions_server.url("/api/v1/tokenizer"), timeout=60)
    body = r.json()
    assert [f["name"] for f in body["files"]] == [
        "chat_template.jinja",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]  # base names, no weights
    server_tok = sessions_server.services.engine.tokenizer
    files = from_response(TokenizerFilesResponse.model_validate(body))
    assert files == read_tokenizer_dir(server_tok.name_or_path)  # the store's bytes
    assert set(files) <= set(TOKENIZER_FILES) and body["revision"] == files_revision(files)
    assert r.headers["etag"] == f'"{body["revision"]}"'
    again = httpx.get(
        sessions_server.url("/api/v1/tokenizer"), headers={"If-None-Match": r.headers["etag"]}, timeout=60
    )
    assert again.status_code == 304 and again.content == b""
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert loaded.encode(SAMPLE) == server_tok.encode(SAMPLE) and len(server_tok.encode(SAMPLE)) > 10
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert loaded.apply_chat_template(conv, tokenize=False) == server_tok.apply_chat_template(conv, tokenize=False)


SDK_CLIENT = """
import json, os, sys
from pathlib import Path
from transformers import AutoTokenizer
from livelora.clients import ServiceClient
from livelora.clients._http import Transport
from livelora.clients.errors import UnavailableError
from livelora.clients.service_client import load_tokenizer

url, model, hub_id, text = sys.argv[1:5]
out = {}
try:
    AutoTokenizer.from_pretrained(hub_id)
    out["hub"] = "resolved"
except (OSError, ValueError) as exc:
    out["hub"] = type(exc).__name__
with ServiceClient(url, heartbeat_s=5.0) as service:
    tc = service.create_lora_training_client(model, rank=2, train_mlp=False, train_unembed=False)
    out["tokenizer_id"] = tc.get_info().model_data.tokenizer_id
    out["training"] = tc.get_tokenizer().encode(text)
    out["sampling"] = service.create_sampling_client(base_model=model).get_tokenizer().encode(text)
root = Path(os.environ["LIVELORA_TOKENIZER_CACHE"])
out["cache"] = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
try:  # the server is gone: the revision fetched last
    out["offline"] = load_tokenizer(hub_id, Transport("http://127.0.0.1:9", "k")).encode(text)
except UnavailableError as exc:
    out["offline"] = str(exc)
print(json.dumps(out))
"""


def test_sdk_falls_back_to_the_servers_files_offline(sessions_server, tokenizer, tmp_path):
    env = client_env(tmp_path, "sdk")
    out = json.loads(
        run([sys.executable, "-c", SDK_CLIENT, sessions_server.base_url, MODEL, HUB_ID, SAMPLE], env)
        .strip()
        .splitlines()[-1]
    )
    assert out["hub"] != "resolved"  # the id does not resolve on this client: the server's files are needed
    assert Path(out["tokenizer_id"]).is_dir()  # this client shares the server's machine: the placed folder
    expected = tokenizer.encode(SAMPLE)
    assert out["training"] == out["sampling"] == out["offline"] == expected
    rev = files_revision(read_tokenizer_dir(sessions_server.services.engine.tokenizer.name_or_path))
    folder = "HuggingFaceTB--SmolLM2-135M-Instruct"
    assert out["cache"] == sorted(
        [folder, f"{folder}/current", f"{folder}/{rev}"]
        + [
            f"{folder}/{rev}/{n}"
            for n in ("chat_template.jinja", "config.json", "tokenizer.json", "tokenizer_config.json")
        ]
    )


def test_hf_cache_url_places_the_servers_tokenizer_under_its_hub_id(sessions_server, tokenizer, tmp_path):
    env = client_env(tmp_path, "client")
    stdout = run(
        [
            sys.executable,
            "-m",
            "livelora.cli.main",
            "hf-cache",
            "--url",
            sessions_server.base_url,
            "--api-key",
            "tml-local",
        ],
        env,
    )
    rev = files_revision(read_tokenizer_dir(sessions_server.services.engine.tokenizer.name_or_path))
    snapshot = tmp_path / "client" / "hf" / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / rev
    local = tmp_path / "client" / "hf" / "hub" / "models--smollm2-135m-instruct" / "snapshots" / rev
    # the same snapshot `livelora hf-cache` makes locally, under the hub id and under the served name
    assert stdout.strip().splitlines() == [f"{HUB_ID} -> {snapshot}", f"smollm2-135m-instruct -> {local}"]
    code = (
        "import sys; from transformers import AutoTokenizer; "
        "print(AutoTokenizer.from_pretrained(sys.argv[1]).encode(sys.argv[2]))"
    )
    assert run([sys.executable, "-c", code, HUB_ID, SAMPLE], env).strip() == str(tokenizer.encode(SAMPLE))


def test_server_paths_are_scrubbed_and_tokenizer_id_is_never_a_path():
    from livelora.core.base_models import canonical_tokenizer_id
    from livelora.core.served_tokenizer import scrub_paths

    cfg = json.dumps({"_name_or_path": "/srv/models/secret", "model_type": "llama"}).encode()
    assert json.loads(scrub_paths("config.json", cfg)) == {"model_type": "llama"}
    kept = json.dumps({"name_or_path": "org/name", "model_type": "llama"}).encode()
    assert scrub_paths("tokenizer_config.json", kept) == kept and scrub_paths("tokenizer.json", cfg) == cfg
    assert canonical_tokenizer_id({MODEL, HUB_ID}, "/srv/models/smollm2", MODEL) == HUB_ID
    assert canonical_tokenizer_id({"Qwen/Qwen3-0.6B"}, "Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert canonical_tokenizer_id({"/srv/models/mine"}, "/srv/models/mine", "/srv/models/mine") == "mine"
    assert canonical_tokenizer_id({"mine"}, "/srv/models/mine", "mine") == "mine"
