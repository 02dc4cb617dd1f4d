"""Operator views on a live gateway in key mode (real SmolLM2, real Redis, two tenants and an operator key):
``GET /admin/usage`` and ``livelora usage`` list every tenant for the operator and only the caller's own for a
tenant's admin; ``livelora adapters list`` shows every version a tenant owns, grouped by lineage, with the
checkpoints of its training runs, and says so when there is none."""

from __future__ import annotations

import json
import os
import re
import socket
import uuid

import httpx
import pytest
import redis
from harness.server import start_server
from typer.testing import CliRunner

from livelora.clients import ServiceClient
from livelora.core.api_keys import TENANT_ROLES, KeyStore

MODEL = "smollm2-135m-instruct"
PREFIX = f"{os.environ['LIVELORA_REDIS_PREFIX']}opviews-{uuid.uuid4().hex[:8]}:"


@pytest.fixture(scope="module")
def home(livelora_home, base_ref, tmp_path_factory):
    home = tmp_path_factory.mktemp("operator-views-home")
    (home / "models").symlink_to(livelora_home / "models", target_is_directory=True)
    return home


@pytest.fixture(scope="module")
def keys(home):
    store = KeyStore(home)
    return {
        "acme": store.create(tenant="acme", roles=list(TENANT_ROLES), name="acme-all")[1],
        "beta": store.create(tenant="beta", roles=list(TENANT_ROLES), name="beta-all")[1],
        "operator": store.create(tenant="default", roles=["admin", "operator"], name="operator")[1],
    }


@pytest.fixture(scope="module")
def server(home, keys):
    from livelora.gateway.settings import GatewaySettings

    live = start_server(
        GatewaySettings(
            model=MODEL,
            home=home,
            device="cpu",
            redis_prefix=PREFIX,
            max_batch_size=4,
            max_waiting=8,
            executor_in_process=True,
            usage_rollup_s=0,
        )
    )
    yield live
    live.stop()
    client = redis.Redis()
    for key in client.scan_iter(f"{PREFIX}*", count=1000):
        client.delete(key)
    client.close()


def cli(*args: str) -> str:
    from livelora.cli.main import app

    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def test_the_operator_reads_every_tenants_usage_and_a_tenant_only_its_own(server, keys):
    for tenant in ("acme", "beta"):
        r = httpx.post(
            server.url("/v1/chat/completions"),
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0},
            headers={"Authorization": f"Bearer {keys[tenant]}"},
            timeout=120,
        )
        assert r.status_code == 200, r.text

    def tenants(key: str, **params) -> set[str]:
        r = httpx.get(
            server.url("/admin/usage"),
            params={"group_by": "tenant", **params},
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        return {row["tenant"] for row in r.json()["data"]}

    assert tenants(keys["operator"]) >= {"acme", "beta"}
    assert tenants(keys["operator"], tenant="beta") == {"beta"}
    assert tenants(keys["acme"]) == {"acme"}
    # the CLI over HTTP: the same answer, and its help says whose usage a key reads
    answer = json.loads(
        cli("usage", "--group-by", "tenant", "--json", "--url", server.base_url, "--api-key", keys["operator"])
    )
    assert {row["tenant"] for row in answer["data"]} >= {"acme", "beta"}
    table = cli("usage", "--group-by", "tenant", "--url", server.base_url, "--api-key", keys["operator"])
    assert "acme" in table and "beta" in table
    assert "operator key" in " ".join(cli("usage", "--help").split())


def test_a_401_from_the_cli_names_its_api_key_flag_and_variable(server, monkeypatch):
    from livelora.cli.main import app

    monkeypatch.delenv("LIVELORA_API_KEY", raising=False)
    for args in (["adapters", "list"], ["endpoints", "list"], ["keys", "list"], ["usage"]):
        result = CliRunner().invoke(app, [*args, "--url", server.base_url], env={"COLUMNS": "200"})
        text = " ".join(result.output.split())
        assert result.exit_code == 1 and "(401): missing API key" in text, (args, text)
        assert "--api-key" in text and "$LIVELORA_API_KEY" in text, (args, text)


def test_adapters_list_shows_every_version_a_tenant_owns_grouped_by_lineage(server, keys):
    def listing(tenant: str) -> str:
        return cli("adapters", "list", "--url", server.base_url, "--api-key", keys[tenant])

    assert "no adapter versions that this key's tenant owns" in " ".join(listing("beta").split())
    with ServiceClient(server.base_url, api_key=keys["acme"], heartbeat_s=2.0) as svc:
        tc = svc.create_lora_training_client(MODEL, rank=2, seed=0)
        tc.save_weights_for_sampler("first").result(timeout=120)
        tc.save_weights_for_sampler("second").result(timeout=120)
        tc.save_weights_for_sampler("first").result(timeout=120)  # replaces its version (deleted)
        tc.save_weights_and_get_sampling_client()  # an unnamed save: kept while the session lives
        rows = httpx.get(
            server.url("/admin/adapters"), headers={"Authorization": f"Bearer {keys['acme']}"}, timeout=30
        ).json()["data"]
        assert [(r["version"], r["checkpoints"]) for r in rows] == [
            (2, ["sampler_weights/second"]),
            (3, ["sampler_weights/first"]),
            (4, []),
        ]
        assert {r["training_run"] for r in rows} == {tc.model_id}
        text = " ".join(listing("acme").split())
        lineage = rows[0]["lineage"]
        assert f"lineage {lineage}: 3 version(s) (training run {tc.model_id})" in text
        assert "sampler_weights/second" in text and "sampler_weights/first" in text and "unnamed sampler save" in text
        assert "3 version(s) in 1 lineage(s)" in text
        # each save's parent is the save before it; @1 ("first", replaced by @3) is shown as deleted
        assert [r["parent"] for r in rows] == [1, 2, 3] and "1 (deleted)" in text
    assert "no adapter versions that this key's tenant owns" in " ".join(listing("beta").split())


def test_adapters_list_fits_80_columns_one_line_per_version(server, keys, home):
    """A lineage with a long name (as a training run's): at 80 columns each version is one line, ids and times
    whole, the rows named ``@<n>`` under a title naming the lineage; at 120 the full ``<lineage>@<n>``."""
    from livelora.adapters.store import AdapterStore
    from livelora.cli.main import app
    from livelora.core.owners import OwnerStore

    lineage = "acme.support-assistant-with-a-long-lineage-name"
    OwnerStore(home).claim("lineage", lineage, "acme")
    store = AdapterStore(home)

    def write(tmp):  # listed, never loaded: tiny files are enough
        (tmp / "adapter_model.safetensors").write_bytes(b"-")
        (tmp / "adapter_config.json").write_text("{}")

    for _ in range(3):
        store.write_version(lineage, write, base_model=MODEL)
    args = ["adapters", "list", "--lineage", lineage, "--url", server.base_url, "--api-key", keys["acme"]]
    for columns, names in ((80, ["@1", "@2", "@3"]), (120, [f"{lineage}@{n}" for n in (1, 2, 3)])):
        result = CliRunner().invoke(app, args, env={"COLUMNS": str(columns)})
        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        assert max(map(len, lines)) <= columns, result.output
        header = next(line for line in lines if line.startswith("┃"))
        assert [c.strip() for c in header.strip("┃").split("┃")] == [
            "version",
            "parent",
            "step",
            "created",
            "data",
            "serving",
        ]
        rows = [[c.strip() for c in line.strip("│").split("│")] for line in lines if line.startswith("│")]
        assert [r[0] for r in rows] == names, result.output  # one line each: nothing wrapped
        assert all(re.fullmatch(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}", r[3]) for r in rows), result.output
        assert f"lineage {lineage}: 3 version(s)" in " ".join(result.output.split())


def test_promote_sends_its_reason_and_an_unreachable_url_is_one_line_and_status_2(server, keys):
    from livelora.cli.main import app

    common = ["--url", server.base_url, "--api-key", keys["acme"]]
    cli("endpoints", "create", "acme.polish", "--lineage", "acme.polish", "--reason", "made", *common)
    shown = cli("endpoints", "promote", "acme.polish", "base", "--reason", "back to base for the eval", *common)
    assert "'back to base for the eval'" in shown
    history = httpx.get(
        server.url("/admin/endpoints/acme.polish/history"),
        headers={"Authorization": f"Bearer {keys['acme']}"},
        timeout=30,
    ).json()["data"]
    assert [(h["action"], h["reason"]) for h in history][-1] == ("promote", "back to base for the eval")

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{s.getsockname()[1]}"
    for args in (["adapters", "list"], ["endpoints", "promote", "acme.polish", "base", "--reason", "x"], ["usage"]):
        result = CliRunner().invoke(app, [*args, "--url", gone, "--api-key", keys["acme"]], env={"COLUMNS": "80"})
        assert result.exit_code == 2, (args, result.output)
        [line] = result.output.splitlines()
        assert line.startswith(f"error: cannot reach {gone} (") and "Connection refused" in line, line
        assert "Traceback" not in result.output
