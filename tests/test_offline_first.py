"""Offline first (issue 48): the README walkthrough's tokenizer step, a recipe's smoke run (both SDKs) and the
official tinker SDK's own ``get_tokenizer()`` with tinker-cookbook's tokenizer helper, on a client whose Hugging
Face hub is unreachable and with ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` unset. The hub is ``HF_ENDPOINT``: a
local HTTP server that records every request and answers 503; any request fails."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from _doc_blocks import REPO, section_blocks
from harness.sdks import sdk_python
from harness.server import MODEL

WALKTHROUGH = ("## Five minutes: chat, rate, watch a new version being served", "## Documentation")


class Hub:
    """An unreachable hub that counts: each request is kept in ``requests`` and answered 503."""

    def __init__(self):
        hits: list[str] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                hits.append(f"{self.command} {self.path}")
                self.send_response(503)
                self.end_headers()

            do_HEAD = do_POST = do_GET

            def log_message(self, *args):
                pass

        self.requests = hits
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub():
    h = Hub()
    yield h
    h.close()


def client_env(tmp_path: Path, hub: Hub) -> dict[str, str]:
    """A client machine without the hub: no offline switches, empty caches of its own, the counting endpoint."""
    drop = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HF_HOME", "TRANSFORMERS_CACHE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        HF_ENDPOINT=hub.url,
        HF_HOME=str(tmp_path / "hf"),
        LIVELORA_TOKENIZER_CACHE=str(tmp_path / "livelora-tokenizers"),
        COLUMNS="200",
    )
    return env


def test_the_walkthroughs_tokenizer_step_asks_no_hub(sessions_server, tokenizer, hub, tmp_path):
    session = section_blocks(REPO / "README.md", *WALKTHROUGH)[-1].code
    step = session[: session.index("for step in range")]  # up to the training loop: the tokenizer's part
    assert "training.get_tokenizer()" in step
    code = f"URL = {sessions_server.base_url!r}\n{step}\nprint(json.dumps([prompt, answer]))\nservice.close()\n"
    proc = subprocess.run(
        [sys.executable, "-c", "import json\n" + code],
        env=client_env(tmp_path, hub),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert hub.requests == [], hub.requests
    assert "Retry" not in proc.stderr and "huggingface" not in proc.stderr, proc.stderr[-3000:]
    prompt, answer = json.loads(proc.stdout.strip().splitlines()[-1])
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert prompt == tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    )
    assert answer[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("sdk", ["livelora", "tinker"])
def test_a_recipe_smoke_run_asks_no_hub(sessions_server, hub, tmp_path, sdk):
    proc = subprocess.run(
        [sys.executable, "-m", "livelora.cli.main", "recipe", "kto-ratings", "--smoke", "--steps", "1", "--sdk", sdk]
        + ["--base-url", sessions_server.base_url, "--log-dir", str(tmp_path / "run")],
        env=client_env(tmp_path, hub),
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "kto-ratings: step 1/1" in out
    assert hub.requests == [], hub.requests
    assert "Retry" not in out, out[-3000:]


#: The official SDK as a user calls it (nothing of livelora imported): get_tokenizer(), then the cookbook's helper on
#: the tokenizer_id the server reported.
OFFICIAL = """
import json, tinker
from tinker_cookbook.tokenizer_utils import get_tokenizer
service = tinker.ServiceClient()
tc = service.create_lora_training_client(base_model=%r, rank=2)
tokenizer_id = tc.get_info().model_data.tokenizer_id
text = "The sky is blue."
print(json.dumps([tokenizer_id, tc.get_tokenizer().encode(text), get_tokenizer(tokenizer_id).encode(text)]))
"""


@pytest.mark.sdk
@pytest.mark.timeout(900)
@pytest.mark.parametrize("version", ["038", "024"])
def test_the_official_sdks_get_tokenizer_asks_no_hub(sessions_server, tokenizer, hub, tmp_path, version):
    python = sdk_python(version)
    if python is None:
        pytest.skip(f"no tinker SDK venv for {version}: run .ci/setup-tinker-sdks")
    env = {k: v for k, v in client_env(tmp_path, hub).items() if not k.startswith("TINKER_")}
    env.update(TINKER_BASE_URL=sessions_server.base_url, TINKER_API_KEY="tml-local", TINKER_TELEMETRY="0")
    env["PYTHONPATH"] = ""
    proc = subprocess.run([str(python), "-c", OFFICIAL % MODEL], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert hub.requests == [], hub.requests
    assert "Retry" not in proc.stderr, proc.stderr[-3000:]
    tokenizer_id, by_sdk, by_cookbook = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(tokenizer_id).is_dir()  # the folder the server placed for callers on its machine
    assert by_sdk == by_cookbook == tokenizer.encode("The sky is blue.")
