"""Tenant isolation through one live gateway (real SmolLM2, real Redis, in-process op executor, its own store).

Tenant ``acme`` (A) makes one object of every kind over HTTP: a training session, a training model with a
training and a sampler checkpoint and an external-weights export (adapter versions of the model's lineage), a
sampling session, a request id, an endpoint on that lineage, a completion and an API key. Tenant ``beta`` (B,
every role) and tenant ``default``'s admin then try every route of the app on them: each answers 404 (what B may
not see does not exist), and A's objects are unchanged afterwards. Ids in any other spelling than their one form
answer 400, also for A.

:data:`CASES` has one entry per route of the app (read from its router): a route added without an entry fails
:func:`test_every_route_has_an_isolation_case` with the line to add.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest
from harness.bus import new_prefix
from harness.console import console_client

from livelora.adapters.store import AdapterStore
from livelora.clients.types.tinker import LoraConfig
from livelora.core.api_keys import TENANT_ROLES
from livelora.core.session_protocol import lineage_for
from livelora.gateway.envelopes import is_anthropic
from livelora.gateway.middleware.auth import app_routes

BASE = "smollm2-135m-instruct"
PREFIX = new_prefix("iso")


def seed_home(home, base_ref) -> None:
    """The module's store (harness ``home``): one trained version of the base lineage."""
    from livelora.trainer.model import TrainingModel

    tm = TrainingModel(base_ref, LoraConfig(rank=2, train_unembed=False, train_mlp=False))
    tm.save_weights(AdapterStore(home), BASE)  # BASE@1: tenant default's, made by its feedback


#: the harness ``keys``: every tenant role, for tenants acme, beta and default
KEYS = {name: (name, TENANT_ROLES) for name in ("acme", "beta", "default")}
#: the harness ``server``
SERVER_SETTINGS = {
    "max_batch_size": 4,
    "max_waiting": 8,
    "redis_prefix": PREFIX,
    "executor_in_process": True,
    "max_datums_per_op": 4,
    "max_tokens_per_op": 64,
}


def http(server, key: str) -> httpx.Client:
    """A client with ``key`` in its headers, also logged into the console with it (cookie, CSRF token, Origin)."""
    return console_client(server.base_url, key, headers={"X-API-Key": key})


class Form(dict):
    """A try's body sent as an HTML form (the console's POST routes), not as JSON."""


def ok(r: httpx.Response, status: int = 200) -> dict:
    assert r.status_code == status, (r.request.method, str(r.request.url), r.status_code, r.text)
    return r.json() if r.content else {}


def future(c: httpx.Client, request_id: str) -> dict:
    while True:
        r = c.post("/api/v1/retrieve_future", json={"request_id": request_id})
        if r.status_code != 408:
            return ok(r)


def error_of(r: httpx.Response, status: int) -> dict:
    """The error object, in the OpenAI envelope's keys; an answer of the Messages API must be Anthropic's envelope
    (``{"type": "error", "error": {"type", "message"}}``; its ``param`` and ``code`` read as ``None``)."""
    assert r.status_code == status, (r.request.method, str(r.request.url), r.status_code, r.text)
    body = r.json()
    if is_anthropic(r.request.url.path):
        assert set(body) == {"type", "error"} and set(body["error"]) == {"type", "message"}, body
        return {**body["error"], "param": None, "code": None}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.fixture(scope="module")
def objs(server, keys) -> dict[str, str]:
    """One object of every kind, made by tenant acme over HTTP; and a session of beta's own."""
    with http(server, keys["acme"]) as a:
        sid = ok(a.post("/api/v1/create_session", json={}))["session_id"]
        created = ok(
            a.post(
                "/api/v1/create_model",
                json={
                    "session_id": sid,
                    "model_seq_id": 0,
                    "base_model": BASE,
                    "lora_config": {"rank": 2, "train_mlp": False},
                },
            )
        )
        model = created["model_id"]
        assert future(a, created["request_id"])["model_id"] == model
        saved = ok(a.post("/api/v1/save_weights", json={"model_id": model, "seq_id": 1, "path": "w1"}))
        assert future(a, saved["request_id"])["path"] == f"tinker://{model}/weights/w1"
        sampler_ckpt = ok(
            a.post("/api/v1/save_weights_for_sampler", json={"model_id": model, "seq_id": 2, "path": "s1"})
        )
        assert future(a, sampler_ckpt["request_id"])["path"] == f"tinker://{model}/sampler_weights/s1"
        export = ok(a.post("/api/v1/save_weights_external", json={"model_id": model, "seq_id": 3, "path": "e1"}))
        assert future(a, export["request_id"])["path"] == f"tinker://{model}/external_weights/e1"
        sampler = ok(
            a.post(
                "/api/v1/create_sampling_session",
                json={
                    "session_id": sid,
                    "sampling_session_seq_id": 0,
                    "model_path": f"tinker://{model}/sampler_weights/s1",
                },
            )
        )["sampling_session_id"]
        lineage = lineage_for(model)
        ok(
            a.post("/admin/endpoints", json={"name": "acme.ep", "lineage": lineage, "mode": "pinned", "version": 1}),
            201,
        )
        cid, cid2 = (
            ok(
                a.post(
                    "/v1/chat/completions",
                    json={"model": "acme.ep", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
                )
            )["id"]
            for _ in range(2)
        )
        key_id = ok(a.post("/admin/keys", json={"roles": ["inference"], "name": "spare"}), 201)["id"]
    with http(server, keys["beta"]) as b:
        sid_b = ok(b.post("/api/v1/create_session", json={}))["session_id"]
    return {
        "sid": sid,
        "model": model,
        "sampler": sampler,
        "request": saved["request_id"],
        "lineage": lineage,
        "version": f"{lineage}@1",
        "wpath": f"tinker://{model}/weights/w1",
        "spath": f"tinker://{model}/sampler_weights/s1",
        "base_spath": f"{BASE};tinker://{model}/sampler_weights/s1",
        "epath": f"tinker://{model}/external_weights/e1",
        "endpoint": "acme.ep",
        "cid": cid,
        "cid2": cid2,
        "key_id": key_id,
        "sid_b": sid_b,
    }


def snapshot(server, keys, o) -> dict:
    """What tenant acme sees of its objects (compared before and after the other tenants' tries)."""
    with http(server, keys["acme"]) as a:
        info = a.post("/api/v1/get_info", json={"model_id": o["model"]})
        caps = a.get("/api/v1/get_server_capabilities")
        for r in (info, caps):  # the owner's own answers show no server file path either (tokenizer_id included)
            assert r.status_code == 200 and str(server.services.settings.home) not in r.text
        return {
            "endpoints": ok(a.get("/admin/endpoints")),
            "adapters": ok(a.get("/admin/adapters")),
            "keys": ok(a.get("/admin/keys")),
            "run": ok(a.get(f"/api/v1/training_runs/{o['model']}")),
            "checkpoints": ok(a.get(f"/api/v1/training_runs/{o['model']}/checkpoints")),
            "sampler": ok(a.get(f"/api/v1/samplers/{o['sampler']}")),
            "session_alive": a.post("/api/v1/session_heartbeat", json={"session_id": o["sid"]}).status_code,
        }


# ---------------------------------------------------------------------------------------------- the two examples


def test_a_tenant_cannot_take_the_base_lineage_and_default_keeps_it(server, keys, objs):
    """Issue example 1: another tenant's admin binding an endpoint to the base model's lineage."""
    with http(server, keys["acme"]) as a, http(server, keys["default"]) as d:
        err = error_of(a.post("/admin/endpoints", json={"name": "acme.mine", "lineage": BASE}), 400)
        assert err["param"] == "lineage" and err["code"] == "name_not_in_namespace"
        assert "acme.mine" not in {e["name"] for e in ok(a.get("/admin/endpoints"))["data"]}
        error_of(a.get(f"/admin/adapters?lineage={BASE}"), 404)
        error_of(a.post(f"/admin/adapters/{BASE}@1/export", json={"format": "peft"}), 404)
        assert [v["name"] for v in ok(d.get(f"/admin/adapters?lineage={BASE}"))["data"]] == [f"{BASE}@1"]
        exported = ok(d.post(f"/admin/adapters/{BASE}@1/export", json={"format": "peft"}))
        assert exported["adapter"] == f"{BASE}@1" and "adapter_model.safetensors" in exported["files"]
        assert exported["path"] == f"exports/{BASE}@1.peft"  # relative to the store: no server file path
        # a training run's lineage is bound only by the run's tenant, whether it exists or not
        taken = error_of(d.post("/admin/endpoints", json={"name": "d-ep", "lineage": objs["lineage"]}), 400)
        missing = error_of(d.post("/admin/endpoints", json={"name": "d-ep", "lineage": f"{'0' * 32}-train-0"}), 400)
        assert taken == missing and taken["param"] == "lineage"
        # a taken name of the caller's own namespace is 409
        ok(d.post("/admin/endpoints", json={"name": "d-ep", "lineage": "d-lineage"}), 201)
        mine = error_of(d.post("/admin/endpoints", json={"name": "d-ep", "lineage": "d-lineage"}), 409)
        assert mine["message"] == "endpoint name 'd-ep' is not available; choose another name"


def test_names_outside_the_callers_namespace_are_400_whether_they_exist_or_not(server, keys, objs):
    """Per-tenant namespaces: ``acme.<rest>`` is tenant acme's, every other name tenant default's. Another
    namespace's name answers one 400 whatever exists; the caller's own prefix is 201."""
    with http(server, keys["acme"]) as a, http(server, keys["beta"]) as b, http(server, keys["default"]) as d:
        ok(a.post("/admin/endpoints", json={"name": "acme.ns", "lineage": "acme.ns-lineage"}), 201)

        def same_400(c, bodies, param):
            errs = [error_of(c.post("/admin/endpoints", json=body), 400) for body in bodies]
            assert all(e == errs[0] for e in errs), errs  # identical bodies: nothing tells which names exist
            assert errs[0]["param"] == param and errs[0]["code"] == "name_not_in_namespace"
            return errs[0]["message"]

        # beta's plain names (default's namespace) and acme's prefix: held or free, one answer
        msg = same_400(
            b, [{"name": n, "lineage": "beta.l"} for n in ("d-ep", "free-name", "acme.ep", "acme.nope")], "name"
        )
        assert msg.startswith("tenant beta's endpoint names start with 'beta.'") and "acme" not in msg
        same_400(
            b,
            [
                {"name": "beta.ep", "lineage": n}
                for n in (
                    "acme.ns-lineage",
                    "acme.none",
                    objs["lineage"],
                    f"{'1' * 32}-train-0",
                    BASE,
                    "d-lineage",
                    "free",
                )
            ],
            "lineage",
        )
        # default cannot create in acme's namespace either
        msg = same_400(d, [{"name": n, "lineage": "d-l2"} for n in ("acme.ep", "acme.ns", "acme.x")], "name")
        assert msg.startswith("tenant default's endpoint names do not have the form '<tenant>.<rest>'")
        same_400(d, [{"name": "d-ep2", "lineage": n} for n in ("acme.ns-lineage", "acme.x")], "lineage")
        # the caller's own prefix: 201, and acme's objects are untouched
        made = ok(b.post("/admin/endpoints", json={"name": "beta.ep", "lineage": "beta.l"}), 201)
        assert made["name"] == "beta.ep" and made["tenant"] == "beta"
        assert {e["name"] for e in ok(a.get("/admin/endpoints"))["data"]} == {"acme.ep", "acme.ns"}
        assert {e["name"] for e in ok(b.get("/admin/endpoints"))["data"]} == {"beta.ep"}


def test_a_dash_spelled_model_id_reaches_nothing(server, keys, objs):
    """Issue example 2: ``<session>-train-0`` for ``<session>:train:0`` (same lineage, same checkpoint index)."""
    model, dashed = objs["model"], objs["model"].replace(":", "-")
    assert lineage_for(dashed) == lineage_for(model)  # why the dash spelling used to reach the run
    with http(server, keys["beta"]) as b, http(server, keys["acme"]) as a:
        for c in (b, a):  # one spelling only: even the owner gets 400 for the other one
            assert error_of(c.get(f"/api/v1/training_runs/{dashed}/checkpoints"), 400)["param"] == "training_run_id"
            error_of(c.delete(f"/api/v1/training_runs/{dashed}/checkpoints/weights/w1"), 400)
            error_of(
                c.post(
                    "/api/v1/asample",
                    json={
                        "model_path": f"tinker://{dashed}/sampler_weights/s1",
                        "prompt": {"chunks": [{"tokens": [1, 2]}]},
                    },
                ),
                400,
            )
            error_of(
                c.post(
                    "/api/v1/load_weights",
                    json={
                        "session_id": objs["sid_b"],
                        "model_seq_id": 3,
                        "path": f"tinker://{dashed}/weights/w1",
                        "optimizer": True,
                    },
                ),
                400,
            )
        # the canonical spelling: another tenant's run does not exist for beta
        msg = error_of(b.get(f"/api/v1/training_runs/{model}/checkpoints"), 404)["message"]
        missing = error_of(b.get(f"/api/v1/training_runs/{'0' * 32}:train:0/checkpoints"), 404)["message"]
        assert msg.replace(objs["sid"], "X") == missing.replace("0" * 32, "X")  # the same 404 as a missing one
        error_of(b.delete(f"/api/v1/training_runs/{model}/checkpoints/weights/w1"), 404)
        error_of(
            b.post(
                "/api/v1/load_weights",
                json={"session_id": objs["sid_b"], "model_seq_id": 3, "path": objs["wpath"], "optimizer": True},
            ),
            404,
        )
        names = {c["checkpoint_id"] for c in ok(a.get(f"/api/v1/training_runs/{model}/checkpoints"))["checkpoints"]}
        assert names == {"weights/w1", "sampler_weights/s1", "external_weights/e1"}


def test_a_checkpoint_path_as_model_serves_its_owner_only(server, keys, objs):
    """The path of A's sampler checkpoint names a model for A (raw URL and body); for B it is the missing one's 404;
    a training-state path is one 400 for everyone."""
    missing = objs["spath"].replace("/s1", "/s7")
    chat = {"max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    with http(server, keys["acme"]) as a, http(server, keys["beta"]) as b:
        assert ok(a.get(f"/v1/models/{objs['spath']}"))["id"] == objs["spath"]
        assert (
            ok(a.post("/v1/chat/completions", json={"model": objs["base_spath"], **chat}))["model"]
            == objs["base_spath"]
        )
        messages = set()
        for c, model in ((b, objs["spath"]), (b, objs["base_spath"]), (b, missing), (a, missing)):
            for r in (c.get(f"/v1/models/{model}"), c.post("/v1/chat/completions", json={"model": model, **chat})):
                messages.add(error_of(r, 404)["message"].replace(model, "M"))
        assert len(messages) == 1, messages
        refused = {
            error_of(c.post("/v1/chat/completions", json={"model": objs["wpath"], **chat}), 400)["message"]
            for c in (a, b)
        }
        assert len(refused) == 1 and "save_weights_for_sampler" in refused.pop()


def test_external_weights_urls_are_the_owners_and_need_no_key(server, keys, objs):
    """An export's file URLs: only its run's tenant gets them; fetching one needs no key (the SDK uses urllib)."""
    route = f"/api/v1/training_runs/{objs['model']}/checkpoints/external_weights/e1/external_weights_urls"
    with http(server, keys["acme"]) as a, http(server, keys["beta"]) as b:
        urls = ok(a.get(route))["urls"]
        error_of(b.get(route), 404)
    assert set(urls) == {"adapter_config.json", "adapter_model.safetensors"}
    assert httpx.get(f"{server.base_url}{route}").status_code == 401  # the URLs route itself needs a key
    config = httpx.get(urls["adapter_config.json"])  # no key
    assert config.status_code == 200 and config.json()["peft_type"] == "LORA"


def test_owner_records_are_claimed_once_and_deny_by_default(tmp_path):
    """Eight tenants race for one name: exactly one record wins; a missing and a foreign object read the same."""
    import threading

    from livelora.clients.errors import NotFoundError
    from livelora.core.owners import OwnerStore

    owners, won = OwnerStore(tmp_path), []
    threads = [
        threading.Thread(target=lambda t=t: won.append((t, owners.claim("lineage", "x", t))))
        for t in (f"t{i}" for i in range(8))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [t for t, w in won if w]
    assert len(winners) == 1 and owners.owner("lineage", "x") == winners[0]
    assert owners.claim("lineage", "x", winners[0])  # idempotent for its owner
    owners.check("lineage", "x", winners[0])
    owners.check("lineage", "nobody", None)  # local store access sees everything
    errors = []
    for name, tenant in (("x", "t-other"), ("missing", winners[0]), ("missing", "default")):
        with pytest.raises(NotFoundError) as e:
            owners.check("lineage", name, tenant)
        errors.append(str(e.value).replace("'missing'", "'x'"))
    assert len(set(errors)) == 1 and not list((tmp_path / "owners" / "lineage").glob(".claim-*"))


# ---------------------------------------------------------------------------------------------- every route


@dataclass(frozen=True)
class Case:
    """What tenant B tries on one route and what it must get.

    Attributes:
        tries: ``objs -> [(url, json body or None), ...]`` naming tenant A's objects (empty: the route names none).
        expect: ``404`` (A's object does not exist for B), ``400`` (a create naming a name of another tenant's
            namespace, answered alike whether it exists or not), or ``"own"`` (the route names no object: any
            answer but a 5xx, with none of A's names in it).
    """

    tries: Callable[[dict[str, str]], list[tuple[str, dict | None]]]
    expect: int | str = 404


def _none(o):
    return [("", None)]


PROMPT = {"chunks": [{"tokens": [1, 2, 3]}]}


def _model_names(o) -> list[str]:
    """A's names a request may give as ``model``: its endpoint, its stored versions (@2: loaded by A's sampling
    session), its sampler checkpoint's path, alone and as ``<base>;<path>``."""
    return [o["endpoint"], o["version"], f"{o['lineage']}@2", o["spath"], o["base_spath"]]


FB = {
    "data": [
        {
            "model_input": PROMPT,
            "loss_fn_inputs": {"target_tokens": {"data": [2, 3, 4], "dtype": "int64", "shape": [3]}},
        }
    ],
    "loss_fn": "cross_entropy",
}

#: (method, route path) → what B tries there. A new route needs an entry (see the module docstring).
CASES: dict[tuple[str, str], Case] = {
    ("GET", "/openapi.json"): Case(_none, "own"),
    ("GET", "/docs"): Case(_none, "own"),
    ("GET", "/docs/oauth2-redirect"): Case(_none, "own"),
    ("GET", "/redoc"): Case(_none, "own"),
    ("GET", "/health"): Case(_none, "own"),
    ("GET", "/v1/models"): Case(_none, "own"),
    ("GET", "/v1/models/{model_id:path}"): Case(lambda o: [(f"/v1/models/{m}", None) for m in _model_names(o)]),
    ("POST", "/v1/chat/completions"): Case(
        lambda o: [
            ("", {"model": m, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}) for m in _model_names(o)
        ]
    ),
    ("POST", "/v1/messages"): Case(
        lambda o: [
            ("", {"model": m, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}) for m in _model_names(o)
        ]
    ),
    ("POST", "/v1/messages/count_tokens"): Case(
        lambda o: [("", {"model": m, "messages": [{"role": "user", "content": "x"}]}) for m in _model_names(o)]
    ),
    ("GET", "/v1/learning/{endpoint}"): Case(lambda o: [(f"/v1/learning/{o['endpoint']}", None)]),
    ("POST", "/v1/completions"): Case(
        lambda o: [("", {"model": m, "max_tokens": 1, "prompt": "x"}) for m in _model_names(o)]
    ),
    ("POST", "/api/v1/client/config"): Case(_none, "own"),
    ("POST", "/api/v1/client/dynamic_config"): Case(_none, "own"),
    ("GET", "/api/v1/healthz"): Case(_none, "own"),
    ("POST", "/api/v1/telemetry"): Case(_none, "own"),
    ("GET", "/api/v1/get_server_capabilities"): Case(_none, "own"),
    ("GET", "/api/v1/tokenizer"): Case(_none, "own"),  # the base model's tokenizer files: any valid key
    ("POST", "/api/v1/create_session"): Case(_none, "own"),
    ("POST", "/api/v1/session_heartbeat"): Case(lambda o: [("", {"session_id": o["sid"]})]),
    ("POST", "/api/v1/sessions/{session_id}/finish"): Case(lambda o: [(f"/api/v1/sessions/{o['sid']}/finish", {})]),
    ("POST", "/api/v1/create_model"): Case(
        lambda o: [("", {"session_id": o["sid"], "model_seq_id": 7, "base_model": BASE, "lora_config": {"rank": 2}})]
    ),
    ("POST", "/api/v1/get_info"): Case(lambda o: [("", {"model_id": o["model"]})]),
    ("POST", "/api/v1/forward"): Case(lambda o: [("", {"model_id": o["model"], "seq_id": 3, "forward_input": FB})]),
    ("POST", "/api/v1/forward_backward"): Case(
        lambda o: [("", {"model_id": o["model"], "seq_id": 3, "forward_backward_input": FB})]
    ),
    ("POST", "/api/v1/optim_step"): Case(
        lambda o: [("", {"model_id": o["model"], "seq_id": 3, "adam_params": {"learning_rate": 1.0}})]
    ),
    ("POST", "/api/v1/save_weights"): Case(lambda o: [("", {"model_id": o["model"], "seq_id": 3, "path": "x"})]),
    ("POST", "/api/v1/save_weights_for_sampler"): Case(
        lambda o: [("", {"model_id": o["model"], "seq_id": 3, "path": "x"})]
    ),
    ("POST", "/api/v1/load_weights"): Case(
        lambda o: [
            ("", {"model_id": o["model"], "seq_id": 3, "path": o["wpath"]}),
            ("", {"session_id": o["sid_b"], "model_seq_id": 4, "path": o["wpath"], "optimizer": True}),
        ]
    ),
    ("POST", "/api/v1/retrieve_future"): Case(lambda o: [("", {"request_id": o["request"]})]),
    ("POST", "/api/v1/weights_info"): Case(
        lambda o: [
            ("", {"tinker_path": o["wpath"]}),
            ("", {"tinker_path": o["spath"]}),
            ("", {"tinker_path": o["epath"]}),
        ]
    ),
    ("GET", "/api/v1/training_runs/{model_id}"): Case(lambda o: [(f"/api/v1/training_runs/{o['model']}", None)]),
    ("GET", "/api/v1/training_runs/{model_id}/checkpoints"): Case(
        lambda o: [(f"/api/v1/training_runs/{o['model']}/checkpoints", None)]
    ),
    ("DELETE", "/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}"): Case(
        lambda o: [
            (f"/api/v1/training_runs/{o['model']}/checkpoints/weights/w1", None),
            (f"/api/v1/training_runs/{o['model']}/checkpoints/sampler_weights/s1", None),
            (f"/api/v1/training_runs/{o['model']}/checkpoints/external_weights/e1", None),
        ]
    ),
    ("POST", "/api/v1/create_sampling_session"): Case(
        lambda o: [
            ("", {"session_id": o["sid_b"], "sampling_session_seq_id": 5, "model_path": o["spath"]}),
            ("", {"session_id": o["sid"], "sampling_session_seq_id": 5, "base_model": BASE}),
        ]
    ),
    ("GET", "/api/v1/samplers/{sampler_id}"): Case(lambda o: [(f"/api/v1/samplers/{o['sampler']}", None)]),
    ("POST", "/api/v1/asample"): Case(
        lambda o: [
            ("", {"sampling_session_id": o["sampler"], "prompt": PROMPT, "sampling_params": {"max_tokens": 1}}),
            ("", {"model_path": o["spath"], "prompt": PROMPT, "sampling_params": {"max_tokens": 1}}),
        ]
    ),
    ("POST", "/v1/feedback"): Case(lambda o: [("", {"completion_id": o["cid"], "rating": True})]),
    ("POST", "/v1/preferences"): Case(
        lambda o: [("", {"chosen_completion_id": o["cid"], "rejected_completion_id": o["cid2"]})]
    ),
    ("POST", "/v1/demonstrations"): Case(
        lambda o: [
            (
                "",
                {
                    "model": o["endpoint"],
                    "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hi!"}],
                },
            )
        ]
    ),
    ("GET", "/admin/endpoints"): Case(_none, "own"),
    ("POST", "/admin/endpoints"): Case(
        lambda o: [
            ("", {"name": "b-ep", "lineage": o["lineage"]}),
            ("", {"name": o["endpoint"], "lineage": "b-own-lineage"}),
        ],
        400,
    ),
    ("GET", "/admin/endpoints/{name:path}/history"): Case(
        lambda o: [(f"/admin/endpoints/{o['endpoint']}/history", None)]
    ),
    ("POST", "/admin/endpoints/{name:path}/promote"): Case(
        lambda o: [(f"/admin/endpoints/{o['endpoint']}/promote", {"version": 2})]
    ),
    ("POST", "/admin/endpoints/{name:path}/rollback"): Case(
        lambda o: [(f"/admin/endpoints/{o['endpoint']}/rollback", {})]
    ),
    ("GET", "/admin/endpoints/{name:path}"): Case(lambda o: [(f"/admin/endpoints/{o['endpoint']}", None)]),
    ("GET", "/admin/history"): Case(_none, "own"),
    ("GET", "/admin/adapters"): Case(lambda o: [("", None), (f"?lineage={o['lineage']}", None)], "own"),
    ("GET", "/admin/adapters/{name}"): Case(lambda o: [(f"/admin/adapters/{o['version']}", None)]),
    ("DELETE", "/admin/adapters/{name}"): Case(lambda o: [(f"/admin/adapters/{o['lineage']}@2", None)]),
    ("POST", "/admin/adapters/{name}/export"): Case(
        lambda o: [(f"/admin/adapters/{o['version']}/export", {"format": "peft"})]
    ),
    ("GET", "/admin/exports/{name}/{fmt}"): Case(lambda o: [(f"/admin/exports/{o['version']}/peft", None)]),
    ("GET", "/admin/keys"): Case(_none, "own"),
    ("POST", "/admin/keys"): Case(lambda o: [("", {"roles": ["bogus"]})], "own"),
    ("DELETE", "/admin/keys/{key_id}"): Case(lambda o: [(f"/admin/keys/{o['key_id']}", None)]),
    # Tinker SDK >= 0.25 surface and the RestClient
    ("GET", "/api/v1/sessions"): Case(lambda o: [("", None), ("?limit=100", None)], "own"),
    ("POST", "/api/v1/sessions/search"): Case(
        lambda o: [
            ("", {"owner": {"type": "own"}, "limit": 100}),
            ("", {"owner": {"type": "own"}, "session_id": o["sid"]}),
        ],
        "own",
    ),
    ("GET", "/api/v1/sessions/{session_id}"): Case(lambda o: [(f"/api/v1/sessions/{o['sid']}", None)]),
    ("GET", "/api/v1/training_runs"): Case(lambda o: [("", None), ("?limit=100", None)], "own"),
    ("GET", "/api/v1/checkpoints"): Case(lambda o: [("", None), ("?limit=1000", None)], "own"),
    ("GET", "/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/archive"): Case(
        lambda o: [(f"/api/v1/training_runs/{o['model']}/checkpoints/weights/w1/archive", None)]
    ),
    ("GET", "/api/v1/checkpoint_archives/{name}"): Case(
        lambda o: [("/api/v1/checkpoint_archives/forged.tar", None)], "own"
    ),
    ("POST", "/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/publish"): Case(
        lambda o: [(f"/api/v1/training_runs/{o['model']}/checkpoints/weights/w1/publish", None)]
    ),
    ("DELETE", "/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/publish"): Case(
        lambda o: [(f"/api/v1/training_runs/{o['model']}/checkpoints/weights/w1/publish", None)]
    ),
    ("PUT", "/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/ttl"): Case(
        lambda o: [
            (f"/api/v1/training_runs/{o['model']}/checkpoints/weights/w1/ttl", {"ttl_seconds": 3600}),
            (f"/api/v1/training_runs/{o['model']}/checkpoints/external_weights/e1/ttl", {"ttl_seconds": 3600}),
        ]
    ),
    ("GET", "/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/external_weights_urls"): Case(
        lambda o: [(f"/api/v1/training_runs/{o['model']}/checkpoints/external_weights/e1/external_weights_urls", None)]
    ),
    ("GET", "/api/v1/external_weights_files/{token}/{file_name}"): Case(
        lambda o: [("/api/v1/external_weights_files/forged.0000/adapter_config.json", None)], "own"
    ),
    ("POST", "/api/v1/join_sampling_session"): Case(lambda o: [("", {"sampling_session_id": o["sampler"]})]),
    ("POST", "/api/v1/retrieve_futures"): Case(
        lambda o: [("", {"target": {"type": "sampling_session", "sampling_session_id": o["sampler"]}, "timeout": 0})]
    ),
    ("POST", "/api/v1/cancel_future"): Case(lambda o: [("", {"request_id": o["request"]})]),
    ("POST", "/api/v1/save_weights_external"): Case(
        lambda o: [("", {"model_id": o["model"], "seq_id": 3, "path": "x"})]
    ),
    ("POST", "/api/v1/create_custom_loss"): Case(lambda o: [("", {"model_id": o["model"]})]),
    ("POST", "/api/v1/copy_weights"): Case(lambda o: [("", {"model_id": o["model"]})]),
    ("GET", "/api/v1/auth/apikey/me"): Case(_none, "own"),
    ("DELETE", "/api/v1/auth/apikey/me"): Case(_none, "own"),
    # update-safety rails
    ("POST", "/admin/endpoints/{name:path}/pause"): Case(
        lambda o: [(f"/admin/endpoints/{o['endpoint']}/pause", {"reason": "b"})]
    ),
    ("POST", "/admin/endpoints/{name:path}/resume"): Case(
        lambda o: [(f"/admin/endpoints/{o['endpoint']}/resume", {"reason": "b"})]
    ),
    ("GET", "/admin/endpoints/{name:path}/stats"): Case(lambda o: [(f"/admin/endpoints/{o['endpoint']}/stats", None)]),
    ("GET", "/admin/endpoints/{name:path}/segments"): Case(
        lambda o: [(f"/admin/endpoints/{o['endpoint']}/segments", None)]
    ),
    ("POST", "/admin/endpoints/{name:path}/segments"): Case(
        lambda o: [(f"/admin/endpoints/{o['endpoint']}/segments", {"name": "b"})]
    ),
    ("POST", "/admin/endpoints/{name:path}/segments/{segment}/assign"): Case(
        lambda o: [(f"/admin/endpoints/{o['endpoint']}/segments/b/assign", {"users": ["u"]})]
    ),
    ("POST", "/admin/endpoints/{name:path}/segments/{segment}/unassign"): Case(
        lambda o: [(f"/admin/endpoints/{o['endpoint']}/segments/b/unassign", {"users": ["u"]})]
    ),
    ("PUT", "/admin/endpoints/{name:path}/gate"): Case(
        lambda o: [(f"/admin/endpoints/{o['endpoint']}/gate", {"reset": True, "reason": "b"})]
    ),
    ("GET", "/admin/quarantine"): Case(_none, "own"),
    ("GET", "/admin/raters"): Case(_none, "own"),
    ("POST", "/admin/users/{name}/forget"): Case(lambda o: [("/admin/users/someone/forget", {"reason": "b"})], "own"),
    ("GET", "/admin/usage"): Case(lambda o: [("", None), ("?tenant=acme", None), ("?group_by=subject", None)], "own"),
    ("GET", "/admin/quotas"): Case(lambda o: [("", None), ("?tenant=acme", None)], "own"),
    ("PUT", "/admin/quotas"): Case(lambda o: [("", {"tenant": "nosuch", "max_sessions": 3})], "own"),
    ("GET", "/metrics"): Case(_none, "own"),
    # the admin console (HTML; its credential is the session cookie the client logged in with)
    ("GET", "/console"): Case(_none, "own"),
    ("GET", "/console/login"): Case(_none, "own"),
    ("POST", "/console/login"): Case(lambda o: [("", Form(key="tml-000000000000-not-a-key"))], 401),
    ("POST", "/console/logout"): Case(lambda o: [("", Form(csrf_token="0"))], "own"),  # a wrong token: 403
    ("GET", "/console/static/{name:path}"): Case(
        lambda o: [
            ("/console/static/htmx.min.js", None),
            ("/console/static/vendor/chart.umd.min.js", None),
            ("/console/static/svg.py", None),
        ],
        "own",
    ),
    ("GET", "/console/endpoints"): Case(_none, "own"),
    ("GET", "/console/endpoints/{name:path}"): Case(lambda o: [(f"/console/endpoints/{o['endpoint']}", None)]),
    ("GET", "/console/lineages/{lineage}"): Case(lambda o: [(f"/console/lineages/{o['lineage']}", None)]),
    ("GET", "/console/versions/{name}"): Case(lambda o: [(f"/console/versions/{o['version']}", None)]),
    ("GET", "/console/charts"): Case(_none, "own"),
    ("GET", "/console/feedback"): Case(_none, "own"),
    ("GET", "/console/sessions"): Case(_none, "own"),
    **{
        ("POST", f"/console/endpoints/{{name:path}}/{action}"): Case(
            lambda o, action=action: [
                (f"/console/endpoints/{o['endpoint']}/{action}", Form(version=o["version"], reason="b"))
            ]
        )
        for action in ("promote", "follow", "rollback", "pause", "resume")
    },
    ("POST", "/console/versions/{name}/export"): Case(
        lambda o: [(f"/console/versions/{o['version']}/export", Form(format="peft"))]
    ),
    ("POST", "/console/users/forget"): Case(lambda o: [("", Form(user="someone", reason="b"))], "own"),
}


def _routes(app) -> list[tuple[str, str]]:
    return [(m, p) for m, p in app_routes(app) if m != "HEAD"]


def test_every_route_has_an_isolation_case(server):
    missing = [r for r in _routes(server.app) if r not in CASES]
    assert not missing, "\n".join(
        f"route {m} {p} has no isolation case: add ({m!r}, {p!r}): Case(...) to CASES in tests/test_isolation.py "
        "(what tenant B tries there on tenant A's objects, and the answer it must get)"
        for m, p in missing
    )
    stale = [r for r in CASES if r not in _routes(server.app)]
    assert not stale, f"CASES names routes the app does not have: {stale}"


def _url(path: str, suffix: str) -> str:
    if suffix.startswith("/"):
        return suffix
    return path.split("{")[0].rstrip("/") + suffix if "{" in path else path + suffix


@pytest.mark.parametrize("who", ["beta", "default"])
def test_another_tenant_gets_404_on_every_route(server, keys, objs, who):
    before = snapshot(server, keys, objs)
    secrets = [objs[k] for k in ("sid", "model", "sampler", "lineage", "endpoint", "cid", "key_id")]
    with http(server, keys[who]) as c:
        for (method, path), case in CASES.items():
            for suffix, body in case.tries(objs):
                sent = {"data": body} if isinstance(body, Form) else {"json": body}
                r = c.request(method, _url(path, suffix), **sent)
                where = (who, method, path, suffix, r.status_code, r.text[:300])
                assert r.status_code < 500, where
                assert str(server.services.settings.home) not in r.text, where
                if case.expect == "own":
                    asked = suffix + str(body)  # a name B gave may be echoed; no other of A's may appear
                    assert not any(s in r.text for s in secrets if s not in asked), where
                    assert r.status_code in (200, 201, 303, 400, 403, 404, 409, 422), where
                else:
                    err = error_of(r, case.expect)
                    banned = ("'acme'", "acme's", "tenant acme", str(server.services.settings.home))
                    if case.expect == 404:
                        banned += ("tenant",)  # a 400 of the namespace rule names the caller's own tenant
                    assert not any(s in err["message"] for s in banned), where
    assert snapshot(server, keys, objs) == before


# ---------------------------------------------------------------------------------------------- spellings


def _variants(o) -> list[tuple[str, str]]:
    """Other spellings of acme's ids: each must be refused (400), the owner's own requests included."""
    sid, model = o["sid"], o["model"]
    return [
        (model, model.replace(":", "-")),
        (model, model.upper()),
        (model, f"{sid}:train:00"),
        (model, f"{sid}:TRAIN:0"),
        (model, f" {model}"),
        (sid, sid.upper()),
        (sid, sid + "-"),
        ("tinker://", "TINKER://"),
        ("tinker://", "tinker:/"),
        (o["sampler"], o["sampler"].replace(":", "-")),
    ]


def test_other_spellings_of_an_id_are_400(server, keys, objs):
    """Every id in another spelling is 400, on the Tinker routes and as a checkpoint path named as ``model``."""
    with http(server, keys["acme"]) as a:
        for (method, path), case in CASES.items():
            if case.expect != 404 or not path.startswith(("/api/v1/", "/v1/")):
                continue
            for suffix, body in case.tries(objs):
                if not path.startswith("/api/v1/") and "tinker://" not in str(body) + suffix:
                    continue  # an OpenAI / Messages route: its ids are the checkpoint paths named as model
                for good, bad in _variants(objs):
                    text = str(body) + suffix
                    if good not in text:
                        continue
                    url = _url(path, suffix.replace(good, bad))
                    bad_body = (
                        None
                        if body is None
                        else {k: v.replace(good, bad) if isinstance(v, str) else v for k, v in body.items()}
                    )
                    if bad_body == body and url == _url(path, suffix):
                        continue
                    r = a.request(method, url, json=bad_body)
                    assert r.status_code in (400, 404, 405) and r.status_code != 200, (method, url, bad_body, r.text)
                    if r.status_code != 405 and "%" not in url:
                        err = error_of(r, 400)
                        if is_anthropic(path):  # Anthropic's envelope has no code: the message says it
                            assert err["message"].startswith("invalid model"), (method, url, bad_body, err)
                        else:
                            assert err["code"] in ("invalid_id", "invalid_value"), (method, url, bad_body)


# ---------------------------------------------------------------------------------------------- bounded work


def _datum(n: int) -> dict:
    return {
        "model_input": {"chunks": [{"tokens": list(range(1, n + 1))}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": list(range(2, n + 2)), "dtype": "int64", "shape": [n]},
            "weights": {"data": [1.0] * n, "dtype": "float32", "shape": [n]},
        },
    }


def test_ops_over_the_datum_or_token_limit_are_413_and_later_ops_run(server, keys, objs):
    """The isolation server allows 4 datums and 64 input tokens per op (LIVELORA_MAX_*_PER_OP)."""
    with http(server, keys["acme"]) as a:

        def fwd(seq, data):
            return a.post(
                "/api/v1/forward",
                json={
                    "model_id": objs["model"],
                    "seq_id": seq,
                    "forward_input": {"data": data, "loss_fn": "cross_entropy"},
                },
            )

        err = error_of(fwd(4, [_datum(2)] * 5), 413)
        assert "limit of 4" in err["message"] and "LIVELORA_MAX_DATUMS_PER_OP" in err["message"]
        assert err["code"] == "too_many_datums" and err["param"] == "data"
        err = error_of(fwd(5, [_datum(40)] * 2), 413)
        assert "80 input tokens" in err["message"] and "LIVELORA_MAX_TOKENS_PER_OP" in err["message"]
        done = future(a, ok(fwd(6, [_datum(8)] * 4))["request_id"])  # the refused seqs did not block the model
        assert done["loss_fn_outputs"] and "error" not in done


def test_checkpoint_ids_in_rest_paths_have_one_spelling(server, keys, objs):
    """The owner's own checkpoint ``weights/w1`` in any other spelling is 400 ``invalid_id``, as in a path."""
    run = f"/api/v1/training_runs/{objs['model']}/checkpoints"
    with http(server, keys["acme"]) as a:
        ok(a.get(f"{run}/weights/w1/archive"))
        for spelling in (
            "weights//w1",
            "weights/w1/",
            "weights/..%2Fw1",
            "weights/%2E%2E",
            "Weights/w1",
            "sampler_weights/w1/x",
        ):
            for method, suffix in (("GET", "/archive"), ("PUT", "/ttl"), ("POST", "/publish"), ("DELETE", "")):
                r = a.request(
                    method, f"{run}/{spelling}{suffix}", json={"ttl_seconds": 7200} if method == "PUT" else None
                )
                err = error_of(r, 400)
                assert err["code"] == "invalid_id" and err["param"] == "checkpoint_id", (spelling, method, r.text)
        ok(a.get(f"{run}/weights/w1/archive"))  # nothing was deleted or changed


def test_malformed_nested_or_repeated_key_json_is_400_on_every_route(server, keys):
    bodies = {
        "malformed": b'{"model": [',
        "deep": b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        "repeated-key": b'{"model": "a", "model_id": "x", "model": "b"}',  # a check and a reader could differ
        "repeated-nested-key": b'{"x": [{"completion_id": "a", "completion_id": "b"}]}',
        "deep-in-strings-is-fine": None,
    }
    with http(server, keys["acme"]) as a:
        for method, path in _routes(server.app):
            if method not in ("POST", "PUT", "PATCH"):
                continue
            url = path.replace("{session_id}", "0" * 32).replace("{name:path}", "x")
            url = url.replace("{name}", "x@1")
            for what, raw in bodies.items():
                if raw is None:
                    continue
                r = a.request(method, url, content=raw, headers={"content-type": "application/json"})
                err = error_of(r, 400)
                if is_anthropic(path):  # Anthropic's envelope: no code, the message says it
                    assert err["type"] == "invalid_request_error", (method, path, what)
                    assert err["message"].startswith("request body "), (method, path, what, err)
                else:
                    assert err["code"] == "invalid_json", (method, path, what, r.text)
            if not path.startswith("/api/v1/"):  # only the Tinker routes inflate compressed bodies
                zipped = {"content-type": "application/json", "content-encoding": "gzip"}
                r = a.request(method, url, content=gzip.compress(b'{"model": "a"}'), headers=zipped)
                err = error_of(r, 400)
                assert err["message"].startswith("unsupported Content-Encoding 'gzip'"), (method, path, r.text)
    from livelora.gateway.json_text import check_json_depth

    check_json_depth(b'{"a": "' + b"[" * 5000 + b'"}', 64)  # brackets inside strings do not count


def _body_routes(app) -> list[tuple[str, str, str]]:
    """``(method, template, url)`` of every route that may take a body, its path parameters filled in."""
    out = []
    for method, path in _routes(app):
        if method in ("POST", "PUT", "PATCH"):
            url = path.replace("{session_id}", "0" * 32).replace("{name:path}", "x").replace("{name}", "x@1")
            out.append((method, path, url))
    return out


def _redis_state(server) -> tuple[set[str], int, int]:
    """The gateway's Redis keys (less those its background loops write on their own), the number of sessions in the
    tenants' session histories and the signals stream's length."""
    import redis

    from livelora.core.redis_keys import KeyLayout

    client = redis.Redis.from_url(server.services.settings.redis_url, decode_responses=True)
    layout = KeyLayout(PREFIX)
    background = tuple(PREFIX + s for s in ("usage", "lease:", "fence:", "learning:", "opruns:", "stats:"))
    names = {k for k in client.scan_iter(match=PREFIX + "*", count=1000) if not k.startswith(background)}
    histories = sum(client.zcard(k) for k in client.scan_iter(match=layout.session_index("*"), count=1000))
    return names, histories, client.xlen(layout.signals)


def test_text_with_no_utf8_form_is_400_on_every_json_route_and_stores_nothing(server, keys, objs):
    """A lone surrogate (escaped, raw, in a key) or bytes that are not UTF-8, on every route that takes a body: 400
    ``invalid_text`` naming the field, in the route's envelope; no key, session or signal is written."""
    bodies = {
        "escaped": (
            b'{"user_metadata": {"note": "a\\ud800b"}, "messages": [{"role": "user", "content": "x"}]}',
            "user_metadata.note",
        ),
        "escaped-low": (b'{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content"),
        "in-a-key": (b'{"user_metadata": {"\\ud83d": "x"}}', "user_metadata.\\ud83d"),
        "raw-bytes": (b'{"prompt": "\xed\xa0\x80"}', "prompt"),
        "not-utf8": (b'{"prompt": "\xff"}', None),
    }
    before = _redis_state(server), snapshot(server, keys, objs)
    with http(server, keys["acme"]) as a:
        for method, path, url in _body_routes(server.app):
            for what, (raw, param) in bodies.items():
                r = a.request(method, url, content=raw, headers={"content-type": "application/json"})
                err = error_of(r, 400)
                where = (method, path, what, r.text)
                if is_anthropic(path):
                    assert err["message"].startswith("request body "), where
                else:
                    assert err["code"] == "invalid_text" and err["param"] == param, where
        # a surrogate pair (escaped) is a character beyond U+FFFF and is fine; the session keeps it
        sid = ok(a.post("/api/v1/create_session", json={"user_metadata": {"note": "\U0001f600"}}))["session_id"]
        assert ok(a.get(f"/api/v1/sessions/{sid}"))
        assert ok(
            a.post(
                "/api/v1/session_heartbeat",
                content=b'{"session_id": "%s"}' % sid.encode(),
                headers={"content-type": "application/json"},
            )
        )
    after = _redis_state(server), snapshot(server, keys, objs)
    assert after[1] == before[1]
    new_keys = after[0][0] - before[0][0]
    # only the pair's session was written (and, if it was acme's first, acme's session index and slot set)
    assert all(sid in k or k.endswith(":acme") for k in new_keys), new_keys
    assert after[0][1] == before[0][1] + 1 and after[0][2] == before[0][2]


@pytest.mark.parametrize(
    "headers",
    [
        [("Authorization", "Bearer {acme}"), ("Authorization", "Bearer {beta}")],
        [("Authorization", "Bearer {acme}"), ("Authorization", "Bearer {acme}")],
        [("X-API-Key", "{acme}"), ("X-API-Key", "{beta}")],
        [("Authorization", "Bearer {acme}"), ("X-API-Key", "{beta}")],
    ],
    ids=["two-authorization", "authorization-twice-same-key", "two-x-api-key", "both-headers-two-keys"],
)
def test_more_than_one_key_in_a_request_is_400_on_every_route(server, keys, headers):
    """Two credentials in one request are refused before anything else, on every route (console and Tinker
    included, public ones too): no reader can take the first while another takes the last."""
    sent = [(k, v.format(**keys)) for k, v in headers]
    with console_client(server.base_url, keys["acme"]) as c:  # a console session cookie as well
        for method, path in _routes(server.app):
            url = re.sub(r"\{[^}]+\}", "x", path)
            r = c.request(method, url, headers=sent, json={} if method in ("POST", "PUT", "PATCH") else None)
            err = error_of(r, 400)
            assert err["message"].startswith("ambiguous credentials"), (method, path, r.text)
            if not is_anthropic(path):
                assert err["code"] == "ambiguous_credentials", (method, path, r.text)
    with httpx.Client(base_url=server.base_url) as c:  # one key in both headers is one key
        r = c.get("/v1/models", headers={"Authorization": f"Bearer {keys['acme']}", "X-API-Key": keys["acme"]})
        assert r.status_code == 200, r.text


def test_tinker_json_bodies_refuse_unknown_keys_as_protobuf_does(server, keys, objs):
    """``"model_id "`` (a trailing space) is an unknown key on every Tinker route that reads its body: 400
    ``unknown_parameter`` naming it. An op refused so leaves its seq free: the same seq then runs."""
    unread = {"/api/v1/client/config", "/api/v1/client/dynamic_config", "/api/v1/telemetry"}  # docs/errors.md
    with http(server, keys["acme"]) as a:
        sid = ok(a.post("/api/v1/create_session", json={}))["session_id"]
        for method, path, url in _body_routes(server.app):
            if not path.startswith("/api/v1/") or path in unread:
                continue
            url = url.replace("0" * 32, sid).replace("{model_id}", objs["model"])
            url = url.replace("{checkpoint_id:path}", "weights/w1")
            r = a.request(method, url, json={"model_id ": objs["model"]})
            err = error_of(r, 400)
            if err["code"] == "not_implemented":  # create_custom_loss, copy_weights: refused whatever the body
                continue
            assert err["code"] == "unknown_parameter" and err["param"] == "model_id ", (method, path, r.text)
        # an op refused for an unknown key leaves its seq free: the same seq, spelt right, runs
        made = {"session_id": sid, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 2}}
        model = ok(a.post("/api/v1/create_model", json=made))["model_id"]
        save = {"model_id": model, "seq_id": 1, "path": "u1"}
        for body, param in (({**save, "model_id ": model}, "model_id "), ({**save, "paht": "u2"}, "paht")):
            err = error_of(a.post("/api/v1/save_weights", json=body), 400)
            assert err["code"] == "unknown_parameter" and err["param"] == param, err
        done = future(a, ok(a.post("/api/v1/save_weights", json=save))["request_id"])
        assert done["path"] == f"tinker://{model}/weights/u1", done


def test_protobuf_bodies_go_through_the_same_check(server, keys, objs):
    """SDK ≥0.25 sends ``forward_backward`` as protobuf: its ``model_id`` is read from the body's head and checked
    like a JSON one (another tenant's: 404; another spelling: 400; unreadable: 400)."""
    from livelora.gateway.api.tinker_wire import schema

    def proto(model_id: str) -> bytes:
        return schema.ForwardBackwardRequest(model_id=model_id, seq_id=9, loss_fn="cross_entropy").SerializeToString()

    headers = {"content-type": "application/x-protobuf"}
    with http(server, keys["beta"]) as b, http(server, keys["acme"]) as a:
        error_of(b.post("/api/v1/forward_backward", content=proto(objs["model"]), headers=headers), 404)
        error_of(
            b.post("/api/v1/forward_backward", content=proto(objs["model"].replace(":", "-")), headers=headers), 400
        )
        assert (
            error_of(b.post("/api/v1/forward_backward", content=b"\xff\xfe", headers=headers), 400)["param"]
            == "model_id"
        )
        r = a.post("/api/v1/forward_backward", content=proto(objs["model"]), headers=headers)
        assert r.status_code != 404, r.text  # the owner passes the check (the route then answers for itself)
