"""Checkpoint paths as model names: a sampler checkpoint saved with the official tinker SDK 0.24.1 (JSON era) is
served by its ``tinker://`` path, or ``<base>;<path>``, on ``/v1/chat/completions``, ``/v1/completions``,
``/v1/messages`` and ``GET /v1/models/{id}`` (the ``openai`` and ``anthropic`` SDKs, a live gateway in key mode,
real SmolLM2, real Redis): the trained weights answer, ``model`` echoes the name asked, ``system_fingerprint``
names the version; a training-state path and a wrong base are 400; another tenant's path is the same 404 as a
missing one. docs/clients.md's checkpoint example runs here."""

from __future__ import annotations

import contextlib
import io

import httpx
import pytest
from _doc_blocks import REPO, blocks
from harness.bus import new_prefix
from harness.server import MODEL

from livelora.core.api_keys import TENANT_ROLES
from livelora.core.session_protocol import CheckpointIndex, lineage_for

tinker = pytest.importorskip("tinker", reason="the official tinker SDK is not installed (pip install tinker==0.24.1)")
openai = pytest.importorskip("openai", reason="the openai SDK is not installed (pip install -e '.[dev]')")

KEYS = {"acme": ("acme", TENANT_ROLES), "beta": ("beta", TENANT_ROLES)}
SERVER_SETTINGS = {
    "max_batch_size": 4,
    "max_waiting": 8,
    "redis_prefix": new_prefix("ckpt"),
    "executor_in_process": True,
}
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
HI = [{"role": "user", "content": "Tell me about the sky."}]
SENTENCE = "The sky is green and the grass is blue."


@pytest.fixture(scope="module")
def ckpt(server, keys, tokenizer, monkeypatch_module):
    """Tenant acme's training run: four SFT steps on one sentence, then a training checkpoint (``w1``) and a sampler
    checkpoint (``s1``) saved through the tinker SDK."""
    from tinker import types

    monkeypatch_module.setenv("TINKER_TELEMETRY", "0")
    service = tinker.ServiceClient(base_url=server.base_url, api_key=keys["acme"])
    tc = service.create_lora_training_client(base_model=MODEL, rank=4)
    ids = tokenizer.encode(SENTENCE)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    for _ in range(4):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-3)).result()
    wpath = tc.save_state("w1").result().path
    spath = tc.save_weights_for_sampler("s1").result().path
    model_id = tc.model_id
    index = CheckpointIndex(server.services.settings.home, model_id)
    version = f"{lineage_for(model_id)}@{index.resolve('sampler_weights', 's1')}"
    return {"model_id": model_id, "wpath": wpath, "spath": spath, "version": version}


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def oa(server, key: str):
    return openai.OpenAI(base_url=server.url("/v1"), api_key=key, max_retries=0)


def prompt_logprobs(server, key: str, model: str) -> list[float]:
    """The logprobs of the trained sentence's tokens under ``model`` (a legacy completion echoing its prompt)."""
    reply = oa(server, key).completions.create(
        model=model, prompt=SENTENCE, max_tokens=1, temperature=0, echo=True, logprobs=0
    )
    return reply.choices[0].logprobs.token_logprobs[1 : len(reply.choices[0].logprobs.tokens) - 1]


def test_the_openai_sdk_is_served_by_the_checkpoint_a_path_names(server, keys, ckpt):
    client = oa(server, keys["acme"])
    spath, version = ckpt["spath"], ckpt["version"]
    assert spath == f"tinker://{ckpt['model_id']}/sampler_weights/s1"
    for model in (spath, f"{MODEL};{spath}", f"{HUB_ID};{spath}"):
        raw = client.chat.completions.with_raw_response.create(model=model, messages=HI, max_tokens=4, temperature=0)
        reply = raw.parse()
        assert reply.model == model and reply.system_fingerprint == f"livelora-{version}"
        assert raw.headers["x-livelora-adapter-version"] == version
    # the checkpoint's weights answer: the version's own logprobs, those the training raised over the base's
    by_path = prompt_logprobs(server, keys["acme"], spath)
    assert by_path == prompt_logprobs(server, keys["acme"], version)
    base = prompt_logprobs(server, keys["acme"], MODEL)
    assert sum(by_path) > sum(base) + 1.0, (sum(by_path), sum(base))
    legacy = client.completions.create(model=f"{MODEL};{spath}", prompt="The sky is", max_tokens=3, temperature=0)
    assert legacy.model == f"{MODEL};{spath}" and legacy.system_fingerprint == f"livelora-{version}"
    same = client.completions.create(model=version, prompt="The sky is", max_tokens=3, temperature=0)
    assert legacy.choices[0].text == same.choices[0].text
    for model in (spath, f"{MODEL};{spath}"):
        listed = client.models.retrieve(model)
        assert listed.id == model and listed.owned_by == "acme" and listed.root == MODEL


def test_the_anthropic_sdk_takes_a_path_too(server, keys, ckpt):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=server.base_url, api_key=keys["acme"], max_retries=0)
    raw = client.messages.with_raw_response.create(
        model=ckpt["spath"], max_tokens=4, messages=HI, extra_body={"temperature": 0}
    )
    assert raw.parse().model == ckpt["spath"] and raw.headers["x-livelora-adapter-version"] == ckpt["version"]
    counted = client.messages.count_tokens(model=ckpt["spath"], messages=HI)
    assert counted.input_tokens == raw.parse().usage.input_tokens
    # its replies train nothing: no endpoint serves the run's lineage
    rated = httpx.post(
        server.url("/v1/feedback"),
        headers={"Authorization": f"Bearer {keys['acme']}"},
        json={"completion_id": raw.parse().id, "rating": True},
    )
    assert rated.status_code == 409 and rated.json()["error"]["code"] == "not_trainable"


def test_a_training_state_path_or_another_base_is_400(server, keys, ckpt):
    client = oa(server, keys["acme"])
    spath, wpath = ckpt["spath"], ckpt["wpath"]
    with pytest.raises(openai.BadRequestError) as state:
        client.chat.completions.create(model=wpath, messages=HI, max_tokens=2)
    err = state.value.body
    assert err["code"] == "not_a_sampler_checkpoint" and err["param"] == "model"
    assert (
        "save_weights_for_sampler" in err["message"]
        and f"tinker://{ckpt['model_id']}/sampler_weights/" in err["message"]
    )
    for model in (f"other-model;{spath}", f"{MODEL}x;{spath}"):
        with pytest.raises(openai.BadRequestError) as base:
            client.chat.completions.create(model=model, messages=HI, max_tokens=2)
        assert base.value.body["code"] == "base_model_mismatch"
    for model in (spath.replace("tinker://", "TINKER://"), spath.replace(":train:", "-train-"), spath + "/x"):
        with pytest.raises(openai.BadRequestError) as spelled:
            client.completions.create(model=model, prompt="hi", max_tokens=1)
        assert spelled.value.body["code"] == "invalid_id" and spelled.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError):
        client.models.retrieve(wpath)


def test_another_tenants_path_is_the_same_404_as_a_missing_one(server, keys, ckpt):
    beta, spath = oa(server, keys["beta"]), ckpt["spath"]
    session = ckpt["model_id"].split(":")[0]
    missing_run = spath.replace(session, "0" * 32)
    missing_name = spath.replace("/s1", "/s9")

    def not_found(model: str, how) -> str:
        with pytest.raises(openai.NotFoundError) as e:
            how(model)
        assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
        return e.value.body["message"].replace(model, "<model>")

    chat = lambda m: beta.chat.completions.create(model=m, messages=HI, max_tokens=1)  # noqa: E731
    answers = {not_found(m, chat) for m in (spath, f"{MODEL};{spath}", missing_run, missing_name)}
    answers |= {not_found(m, beta.models.retrieve) for m in (spath, missing_run)}
    answers |= {
        not_found(m, lambda x: beta.completions.create(model=x, prompt="hi", max_tokens=1))
        for m in (spath, missing_name)
    }
    assert len(answers) == 1, answers
    assert not_found(missing_name, lambda x: oa(server, keys["acme"]).models.retrieve(x)) in answers  # owner too
    # a training-state path: one 400 whoever asks, whether it exists or not (it depends on the text alone)
    refusals = set()
    for key, model in (
        (keys["beta"], ckpt["wpath"]),
        (keys["acme"], ckpt["wpath"]),
        (keys["beta"], ckpt["wpath"] + "x"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            oa(server, key).chat.completions.create(model=model, messages=HI, max_tokens=1)
        refusals.add(e.value.body["message"].replace("w1x", "w1"))
    assert len(refusals) == 1


def test_the_docs_example_runs(server, keys, ckpt, monkeypatch):
    """docs/clients.md's checkpoint block, verbatim but for the URL, with tenant acme's key."""
    [block] = [b for b in blocks(REPO / "docs" / "clients.md") if "import tinker" in b.code]
    monkeypatch.setenv("LIVELORA_API_KEY", keys["acme"])
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block.code.replace("http://127.0.0.1:8000", server.base_url), "docs/clients.md", "exec"), {})
    first, second, third = out.getvalue().splitlines()
    assert first == second and first.startswith("True livelora-") and first.endswith("@1")
    assert third == "True"
