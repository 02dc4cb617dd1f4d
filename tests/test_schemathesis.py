"""Property-based requests from the live app's own OpenAPI document (schemathesis), sent with a tenant's key: no
route answers 5xx, whatever the generated body, path or query. The Tinker routes publish their request schemas
(``openapi_extra``), so they get generated bodies too.

Bounded: :data:`EXAMPLES` examples per operation and a 64-token context (``max_model_len``), so generation stays
short on a CPU; the whole module runs in about two minutes here.
"""

from __future__ import annotations

import os
import uuid

import pytest
import schemathesis
from harness.server import start_server
from hypothesis import HealthCheck, given, settings

from livelora.core.api_keys import TENANT_ROLES, KeyStore

EXAMPLES = 10
PREFIX = f"{os.environ['LIVELORA_REDIS_PREFIX']}fuzz-{uuid.uuid4().hex[:8]}:"


@pytest.fixture(scope="module")
def fuzz_server(livelora_home, base_ref, tmp_path_factory):
    """A gateway on its own store (a key there puts it in key mode) with a short context."""
    from livelora.gateway.settings import GatewaySettings

    home = tmp_path_factory.mktemp("fuzz-home")
    (home / "models").symlink_to(livelora_home / "models", target_is_directory=True)
    _, key = KeyStore(home).create("acme", list(TENANT_ROLES), "fuzz")
    live = start_server(
        GatewaySettings(
            model="smollm2-135m-instruct",
            home=home,
            device="cpu",
            max_batch_size=4,
            max_waiting=8,
            redis_prefix=PREFIX,
            max_model_len=64,
            executor_in_process=True,
        )
    )
    live.key = key
    yield live
    live.stop()


def test_no_route_answers_5xx(fuzz_server):
    """Every operation of the live OpenAPI document, through schemathesis' public API only (its pytest
    ``from_fixture`` plugin reads pytest internals that pytest 9.2 removed)."""
    schema = schemathesis.openapi.from_url(fuzz_server.url("/openapi.json"))
    headers = {"Authorization": f"Bearer {fuzz_server.key}"}
    home = str(fuzz_server.services.settings.home)
    failures, operations, calls = [], 0, []
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case):
            response = case.call(headers=headers, timeout=60)
            calls.append(response.status_code)
            assert response.status_code < 500, (case.method, case.formatted_path, case.body, response.text[:500])
            assert home not in response.text  # tokenizer_id included: a hub id

        try:
            check()
        except Exception as exc:  # every operation is tried; all failures are reported together
            failures.append(f"{operation.label}: {str(exc)[:800]}")
    assert operations > 20 and len(calls) >= operations, (operations, len(calls))
    assert not failures, "\n".join(failures)
