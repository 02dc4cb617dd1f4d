"""docs/endpoints-and-keys.md runs as written, in order, against ``livelora serve`` on a fresh store, as a user who
follows it does: the first key made on the store, endpoints created (and the namespace error), eight rated chats
train ``acme.support@1``, promote, roll back, history, a refused delete, an export, the key list and a wrong key,
each output compared with the recording (:func:`harness.docs.replay`). Then docs/serving.md loads the export and
docs/operations.md reads usage with an operator key. The store's converted base model is the test store's, linked
(the conversion a first start does is the walkthrough's, tests/test_readme_walkthrough.py, run on an empty store);
everything else starts empty. Slow: one learned version (a minute or several here)."""

from __future__ import annotations

import json
import re

import pytest
from _doc_blocks import REPO, blocks
from harness.docs import replay, run_bash, run_python, serve_process

pytestmark = [pytest.mark.slow, pytest.mark.live, pytest.mark.timeout(1800)]


def test_the_endpoints_page_runs_in_order_on_a_fresh_store(tmp_path, monkeypatch, base_ref, livelora_home):
    page = [b for b in blocks(REPO / "docs" / "endpoints-and-keys.md") if b.lang in ("text", "python")]
    assert [b.lang for b in page] == ["text", "python", "text"]
    first, rate, admin = page
    work = tmp_path / "work"
    work.mkdir()
    with serve_process(tmp_path, converted_from=livelora_home) as serve:
        env = dict(serve.env)
        env.pop("LIVELORA_API_KEY", None)

        def fill_in(command, steps):
            if command.startswith("H="):  # the page's default store is the server's --home here
                return f"H={serve.store}"
            if command.startswith("export LIVELORA_API_KEY="):  # the page shortens the key it was shown
                key = re.search(r"tml-\S+", steps[-1].output).group(0)
                return f"export LIVELORA_API_KEY={key}"
            return command

        steps = replay(first.code, serve.url, env, work, fill_in)
        assert env["LIVELORA_API_KEY"].startswith("tml-") and len(steps) == 6

        monkeypatch.setenv("LIVELORA_API_KEY", env["LIVELORA_API_KEY"])
        assert run_python(rate.code, serve.url, {}).splitlines()[-1] == "acme.support@1"

        monkeypatch.chdir(work)
        steps = replay(admin.code, serve.url, env, work)
        assert (work / "support-1" / "adapter_config.json").is_file()
        assert steps[-1].returncode != 0 and "401" in steps[-1].output

        # docs/serving.md: the PEFT export loads on the store's converted base
        load = next(b for b in blocks(REPO / "docs" / "serving.md") if "PeftModel.from_pretrained" in b.code)
        ns: dict = {}
        run_python(load.code.replace("/path/to/livelora-home", str(serve.store)), serve.url, ns)
        assert type(ns["model"]).__name__ == "PeftModelForCausalLM"
        assert ns["model"].peft_config["default"].r > 0

        # docs/operations.md: usage with an operator key made on the store, over HTTP and on the store
        usage = next(b for b in blocks(REPO / "docs" / "operations.md") if "/admin/usage" in b.code)
        out = run_bash(usage.code, serve.url, dict(env, H=str(serve.store)), work)
        answer, end = json.JSONDecoder().raw_decode(out)
        assert answer["data"] and {"day", "kind", "tokens"} <= set(answer["data"][0])
        over_http, on_the_store = out[end:].split("token usage")[1:]  # two rich tables
        assert "│ acme " in over_http and "│ acme " in on_the_store
