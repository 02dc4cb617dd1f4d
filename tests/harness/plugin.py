"""The test harness as a pytest plugin (registered by ``tests/conftest.py``): the shared fixtures and the markers.

Session: ``livelora_home``, ``base_ref``, ``tokenizer``, ``live_server``, ``sessions_server``. Module: ``home``,
``keys``, ``server``, ``server_redis`` (a store, API keys, a gateway of the module's own and a client of its Redis
prefix), ``loop``/``run``, ``engine``. Function: ``bus``. A module shapes the module fixtures with its own names
(read here through ``request.module``): ``seed_home(home, base_ref)``, ``KEYS``, ``SERVER_SETTINGS``,
``ENGINE_OPTIONS``, ``TEST_ENGINE_KINDS``. Markers (``unit``, ``live``, ``sdk``, ``slow``; registered in
pyproject.toml): :func:`pytest_collection_modifyitems`.
"""

from __future__ import annotations

import asyncio
import fnmatch
import inspect
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.bus import REDIS_URL, delete_prefix, new_prefix
from harness.cluster import new_store
from harness.engines import ENGINE_KWARGS, skip_unless_installed
from harness.server import MODEL, TEST_SETTINGS, LiveServer, start_server

REPO = Path(__file__).resolve().parents[2]
#: Server-side session TTL of ``sessions_server`` (the official tinker SDK beats every 10 s).
SESSION_TTL_S = 30


# ----------------------------------------------------------------------------------------- store and model
@pytest.fixture(scope="session")
def livelora_home() -> Path:
    """The store used by the tests: ``$LIVELORA_HOME`` or ``<repo>/.livelora-home`` (keeps the converted model)."""
    home = Path(os.environ.get("LIVELORA_HOME") or REPO / ".livelora-home")
    home.mkdir(parents=True, exist_ok=True)
    os.environ["LIVELORA_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def base_ref(livelora_home):
    """The built-in SmolLM2-135M-Instruct, converted once and cached in the test store."""
    from livelora.core.base_models import resolve_base_model
    from livelora.core.settings import DEFAULT_MODEL

    return resolve_base_model(DEFAULT_MODEL, livelora_home)


@pytest.fixture(scope="session")
def tokenizer(base_ref):
    from livelora.core.base_models import load_tokenizer

    return load_tokenizer(base_ref)


@pytest.fixture(scope="session", autouse=True)
def _tokenizer_cache(tmp_path_factory):
    """The SDK's tokenizer cache (files fetched from ``GET /api/v1/tokenizer``) in the test session's tmp dir, not
    in ``~/.cache/livelora``."""
    os.environ["LIVELORA_TOKENIZER_CACHE"] = str(tmp_path_factory.mktemp("tokenizer-cache"))
    yield


@pytest.fixture(autouse=True)
def _no_leaked_metrics_dir():
    """A test that runs ``livelora serve`` in-process must leave ``PROMETHEUS_MULTIPROC_DIR`` as it found it: set,
    it sends every later ``/metrics`` of the session to that directory's files (and child processes write there)."""
    before = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    yield
    assert os.environ.get("PROMETHEUS_MULTIPROC_DIR") == before, "the test left PROMETHEUS_MULTIPROC_DIR set"


@pytest.fixture
def own_store(livelora_home, base_ref, tmp_path) -> Iterator[tuple[Path, str]]:
    """``(home, prefix)`` for a ``livelora serve`` a test starts: a store (the session's converted models linked) and
    a Redis prefix of its own (deleted after), so its trainer cannot train the ratings other tests left on the
    session's stream into the session store (:func:`_shared_endpoint_untrained`)."""
    prefix = new_prefix("serve")
    yield new_store(tmp_path / "store", livelora_home), prefix
    delete_prefix(REDIS_URL, prefix)


@pytest.fixture(autouse=True)
def _shared_endpoint_untrained(request):
    """A test on the session store must not leave a version of its default endpoint's lineage: the shared gateway
    (``live_server``) catches up from the store and would serve it to every later test. A ``livelora serve`` there
    would train the ratings other tests left on the session's stream: give it a store and prefix of its own."""
    yield
    if "livelora_home" in request.fixturenames:
        lineage = request.getfixturevalue("livelora_home") / "adapters" / MODEL
        versions = sorted(p.name for p in lineage.iterdir() if p.name.isdigit()) if lineage.is_dir() else []
        assert not versions, f"the test left versions of {MODEL} in the session store: {versions}"


@pytest.fixture(scope="session", autouse=True)
def _redis_prefix_cleanup():
    """Delete the session's Redis keys (prefix ``$LIVELORA_REDIS_PREFIX``) when the tests end."""
    yield
    prefix = os.environ["LIVELORA_REDIS_PREFIX"]
    if not prefix.startswith("livelora-test-"):
        return
    import redis

    try:
        delete_prefix(os.environ.get("LIVELORA_REDIS_URL", REDIS_URL), prefix)
    except redis.exceptions.ConnectionError:
        pass


@pytest.fixture(scope="module")
def home(request, livelora_home, base_ref, tmp_path_factory) -> Path:
    """A store of the module's own (API keys in it switch its gateway to key mode, so it must not be the shared
    one), its ``models/`` linked to the session store's; filled by the module's ``seed_home(home, base_ref)``."""
    home = new_store(tmp_path_factory.mktemp(f"{request.module.__name__}-home"), livelora_home)
    seed = getattr(request.module, "seed_home", None)
    if seed is not None:
        seed(home, base_ref)
    return home


class KeyRing(dict):
    """Name → API key (the secret), and ``records``: name → :class:`~livelora.core.api_keys.KeyRecord`."""

    records: dict


@pytest.fixture(scope="module")
def keys(request, home) -> KeyRing:
    """The API keys of the module's ``KEYS`` (name → ``(tenant, roles)``), made in ``home`` (none without it)."""
    from livelora.core.api_keys import KeyStore

    ring = KeyRing()
    ring.records = {}
    store = KeyStore(home)
    for name, (tenant, roles) in getattr(request.module, "KEYS", {}).items():
        ring.records[name], ring[name] = store.create(tenant, list(roles), name)
    return ring


# ----------------------------------------------------------------------------------------------- gateways
_SHARED: LiveServer | None = None


@pytest.fixture(scope="session")
def live_server(livelora_home) -> Iterator[LiveServer]:
    """The session's shared gateway on the real SmolLM2 model and the session store (stopped at the end)."""
    global _SHARED
    started_here = _SHARED is None
    if started_here:
        from livelora.gateway.settings import GatewaySettings

        _SHARED = start_server(GatewaySettings(model=MODEL, home=livelora_home, **TEST_SETTINGS))
    yield _SHARED
    if started_here:  # a module that imports the fixture instantiates it once more; one owner stops it
        _SHARED.stop()
        _SHARED = None


_SESSIONS: LiveServer | None = None


@pytest.fixture(scope="session")
def sessions_server(livelora_home) -> Iterator[LiveServer]:
    """The session's gateway for training sessions: the real SmolLM2, the in-process op executor, a Redis prefix of
    its own and sessions that expire ``SESSION_TTL_S`` after their last heartbeat (stopped, and its Redis keys
    deleted, at the end)."""
    global _SESSIONS
    started_here = _SESSIONS is None
    if started_here:
        from livelora.gateway.settings import GatewaySettings

        prefix = new_prefix("sessions")
        os.environ["LIVELORA_SESSION_TTL_S"] = str(SESSION_TTL_S)
        settings = GatewaySettings(
            model=MODEL,
            home=livelora_home,
            device="cpu",
            redis_prefix=prefix,
            max_batch_size=8,
            max_waiting=16,
            executor_in_process=True,
        )
        try:
            _SESSIONS = start_server(settings)
        finally:
            os.environ.pop("LIVELORA_SESSION_TTL_S", None)
    yield _SESSIONS
    if started_here:
        _SESSIONS.stop()
        _SESSIONS = None
        delete_prefix(settings.redis_url, prefix)


@pytest.fixture(scope="module")
def server(request, home, keys) -> Iterator[LiveServer]:
    """A gateway of the module's own on ``home`` (after ``keys`` are made): the real SmolLM2 on the CPU with the
    module's ``SERVER_SETTINGS`` (:class:`~livelora.gateway.settings.GatewaySettings` fields; give it a
    ``redis_prefix`` from :func:`harness.bus.new_prefix`); stopped at the end of the module."""
    from livelora.gateway.settings import GatewaySettings

    settings = {"model": MODEL, "home": home, "device": "cpu", **getattr(request.module, "SERVER_SETTINGS", {})}
    live = start_server(GatewaySettings(**settings))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def server_redis(request) -> Iterator:
    """A blocking Redis client (``decode_responses``) for the module's ``SERVER_SETTINGS["redis_prefix"]``; every
    key under that prefix is deleted at the end of the module."""
    import redis

    prefix = request.module.SERVER_SETTINGS["redis_prefix"]
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    yield client
    delete_prefix(REDIS_URL, prefix)
    client.close()


# ------------------------------------------------------------------------------------------------ engines
@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop per module: engines may bind to the loop that started them."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def run(loop):
    """``run(coro)``: the coroutine's result, on the module's loop."""
    return loop.run_until_complete


@pytest.fixture(scope="module")
def engine(request, base_ref, loop):
    """An inference engine on the real SmolLM2, started on ``loop``: kind ``transformers``, or each kind of the
    module's ``TEST_ENGINE_KINDS``; :data:`~harness.engines.ENGINE_KWARGS` updated with its ``ENGINE_OPTIONS``."""
    from livelora.gateway.engines import create_engine

    kind = getattr(request, "param", "transformers")
    kwargs = {**ENGINE_KWARGS.get(kind, {}), **getattr(request.module, "ENGINE_OPTIONS", {})}
    skip_unless_installed(kind, kwargs.get("weights"))
    eng = create_engine(kind, model=base_ref.name, **kwargs)
    eng.kind = kind
    loop.run_until_complete(eng.start())
    yield eng
    loop.run_until_complete(eng.close())


def pytest_generate_tests(metafunc):
    kinds = getattr(metafunc.module, "TEST_ENGINE_KINDS", None)
    if kinds and "engine" in metafunc.fixturenames:
        metafunc.parametrize("engine", kinds, indirect=True, scope="module")


# ---------------------------------------------------------------------------------------------------- bus
@pytest.fixture
def bus():
    """``(client, keys)``: a blocking Redis client (``decode_responses``) and a fresh
    :class:`~livelora.core.redis_keys.KeyLayout` whose signals stream and ``trainers`` group exist; its keys are
    deleted afterwards."""
    from livelora.core.bus import connect_sync, ensure_group
    from livelora.core.redis_keys import KeyLayout

    keys = KeyLayout(new_prefix("bus"))
    client = connect_sync(REDIS_URL)
    ensure_group(client, keys)
    yield client, keys
    delete_prefix(REDIS_URL, keys.prefix)
    client.close()


# ------------------------------------------------------------------------------------------------ markers
#: fixtures whose users are `live` (a test's whole fixture closure is looked at)
LIVE_FIXTURES = {
    "base_ref",
    "bus",
    "engine",
    "live_server",
    "sessions_server",
    "server",
    "server_redis",
    "cluster",
    "fuzz_server",
}
#: files whose tests start processes, servers or Redis themselves, or talk to Redis without a fixture
LIVE_FILES = {
    "test_bus_signals.py",
    "test_cli_serve.py",
    "test_drain.py",
    "test_embedded_redis.py",
    "test_harness_env.py",
    "test_live_loop.py",
    "test_native_crash.py",
    "test_trainer_process.py",
}
SDK_FIXTURES = {"sdk"}
SDK_FILES = {
    "test_checkpoint_models.py",
    "test_sessions_tinker_sdk.py",
    "test_tinker_sdk_live.py",
    "test_tinker_wire_sdk.py",
}
#: the `live` and `sdk` tests of the fast run (``pytest -m "not slow"``): ``file`` or ``file::test`` patterns
#: (fnmatch, parameters ignored); every other `live` or `sdk` test is `slow`, `unit` tests never are
FAST = {
    "test_adapter_store.py::test_versions_are_numbered_*",
    "test_adapter_store.py::test_bad_lineage_names_*",
    "test_adapter_store.py::test_version_names_parse",
    "test_adapter_store.py::test_a_save_failing_midway_*",
    "test_adapter_store.py::test_a_process_killed_during_save_*",
    "test_bus_signals.py",
    "test_cli_serve.py::test_help_*",
    "test_cli_serve.py::test_invalid_flag_*",
    "test_cli_serve.py::test_settings_lists_*",
    "test_content_type.py",
    "test_cpu_share.py",
    "test_docs_internals.py",
    "test_embedded_redis.py",
    "test_engine_contract.py::test_stop_matcher_*",
    "test_engine_contract.py::test_incremental_detokenizer_*",
    "test_engine_contract.py::test_sampling_filters_*",
    "test_governance.py::test_one_raters_flood_*",
    "test_harness_env.py",
    "test_learning_status.py::test_rating_to_a_published_version_is_watchable",
    "test_learning_status.py::test_a_partial_batch_and_held_out_ratings_say_so",
    "test_loss_specs.py",
    "test_model_store.py",
    "test_openai_chat.py::test_greedy_answer_names_paris_*",
    "test_openai_chat.py::test_streaming_deltas_*",
    "test_openai_errors.py",
    "test_ownership.py::test_lease_fencing_*",
    "test_ownership.py::test_a_store_binds_one_prefix",
    "test_rating_datum.py",
    "test_recipes_parts.py",
    "test_sessions_executor.py",
    "test_signal_triage.py::test_door_*",
    "test_signal_triage.py::test_trainer_context_is_the_models",
    "test_trainer_model.py",
    "test_worker.py::test_policy_batches_*",
}


def _fast(file: str, name: str) -> bool:
    return any(fnmatch.fnmatchcase(file, p) or fnmatch.fnmatchcase(f"{file}::{name}", p) for p in FAST)


#: what a ``unit`` test's own code (its body and its module's fixtures) must not hold: a Redis client or address, a
#: server or livelora process started by the test
LIVE_CALLS = re.compile(
    r"\bredis\.(?:asyncio\.)?Redis\b|\bconnect_sync\(|\bREDIS_URL\b|(?:127\.0\.0\.1|localhost)\W{1,4}6379"
    r"|\bstart_server\(|\bCluster\(|\bbind_install\(|\bserve_process\("
)


def _live_calls(item) -> list[str]:
    """The :data:`LIVE_CALLS` in ``item``'s test function and in the fixtures its test module defines."""
    funcs = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    for defs in info.name2fixturedefs.values() if info else ():
        funcs += [d.func for d in defs if getattr(d.func, "__module__", None) == getattr(item.module, "__name__", "")]
    found = []
    for func in filter(None, funcs):
        try:
            found += LIVE_CALLS.findall(inspect.getsource(func))
        except (OSError, TypeError):
            continue
    return found


def pytest_collection_modifyitems(config, items):
    """Mark every test ``unit`` or ``live`` (``live``: its fixtures include one of :data:`LIVE_FIXTURES`, or another
    test of its file's do, or its file is in :data:`LIVE_FILES`), ``sdk`` (:data:`SDK_FILES`, :data:`SDK_FIXTURES`)
    and ``slow`` (``live`` or ``sdk`` and not in :data:`FAST`); marks written in the test file win.

    Raises:
        pytest.UsageError: a ``unit`` test's own code holds one of :data:`LIVE_CALLS` (the mark would lie).
    """
    live_files = set(LIVE_FILES)
    for item in items:
        if set(getattr(item, "fixturenames", ())) & LIVE_FIXTURES:
            live_files.add(item.path.name)
    for item in items:
        file, names = item.path.name, set(getattr(item, "fixturenames", ()))
        have = {m.name for m in item.iter_markers()}
        if "sdk" not in have and (file in SDK_FILES or names & SDK_FIXTURES):
            item.add_marker("sdk")
            have.add("sdk")
        if not have & {"unit", "live"}:
            item.add_marker("live" if file in live_files else "unit")
            have.add("live" if file in live_files else "unit")
        if "slow" not in have and have & {"live", "sdk"} and not _fast(file, item.originalname):
            item.add_marker("slow")
    lying = {
        f"{item.nodeid}: {', '.join(sorted(set(calls)))}"
        for item in items
        if any(m.name == "unit" for m in item.iter_markers())
        for calls in [_live_calls(item)]
        if calls
    }
    if lying:
        raise pytest.UsageError(
            "tests marked unit that talk to Redis or start a server (mark them live, or the file in LIVE_FILES):\n"
            + "\n".join(sorted(lying))
        )
