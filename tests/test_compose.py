"""docker-compose.yml and Dockerfile checked against the code (no Docker engine runs on these machines).

What would otherwise go wrong silently at ``docker compose up``: a service command that
is not a ``livelora`` sub-command (or passes an option it does not have), a LIVELORA_*
variable no settings class reads (ignored without a word) or whose value does not
validate, volumes or ports that do not line up, a health check on a route the app does
not serve, a build target the Dockerfile lacks. Everything is introspected: the typer app
of ``livelora.cli.main``, each process's settings object (``livelora.cli.settings.PROCESS_SETTINGS``),
``create_app``'s routes
(no model is loaded), the Dockerfile's ``FROM ... AS`` stages.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "docker-compose.yml"
LIVELORA_HOME_IN_CONTAINERS = "/data/livelora"


def _interpolate(value):
    """Compose's ``${NAME:-default}`` / ``${NAME-default}`` / ``${NAME}`` with an empty environment."""
    if isinstance(value, str):
        return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict:
    return _interpolate(yaml.safe_load(COMPOSE.read_text()))  # safe_load resolves anchors and << merges


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def _livelora_services(services):
    return {n: s for n, s in services.items() if _argv(s) and _argv(s)[0] == "livelora"}


def _argv(service) -> list[str]:
    cmd = service.get("command") or []
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def _env(service) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _process_settings() -> dict:
    """``{livelora sub-command: its process's settings class}`` (one settings object per process kind)."""
    from livelora.cli.settings import PROCESS_SETTINGS, ServeSettings
    from livelora.gateway.settings import GatewaySettings
    from livelora.trainer.settings import TrainerSettings

    assert set(PROCESS_SETTINGS) == {GatewaySettings, TrainerSettings, ServeSettings}
    return {"gateway": GatewaySettings, "trainer": TrainerSettings, "serve": ServeSettings}


def _env_names(cls) -> set[str]:
    """Every environment variable a process settings class reads: its own fields and its sections' fields."""
    prefix = cls.model_config.get("env_prefix", "")
    names = {(prefix + name).upper() for name in cls.model_fields if name not in cls.sections}
    for section in cls.section_types().values():
        sp = section.model_config.get("env_prefix", "")
        names |= {(sp + name).upper() for name in section.model_fields}
    return names


@pytest.fixture(scope="module")
def cli_commands() -> dict:
    """``{sub-command name: click command}`` of the ``livelora`` typer app."""
    import typer.main

    from livelora.cli.main import app

    return dict(typer.main.get_command(app).commands)


def test_every_service_command_is_a_real_livelora_subcommand_with_real_options(services, cli_commands):
    livelora = _livelora_services(services)
    assert {"gateway", "trainer", "gateway-cpu", "trainer-cpu"} <= set(livelora)
    for name, service in livelora.items():
        argv = _argv(service)
        assert len(argv) >= 2 and argv[1] in cli_commands, (
            f"{name}: `{' '.join(argv)}` is not a livelora sub-command (have: {sorted(cli_commands)})"
        )
        opts = {o for p in cli_commands[argv[1]].params for o in getattr(p, "opts", [])}
        for arg in argv[2:]:
            if arg.startswith("--"):
                assert arg.split("=", 1)[0] in opts, f"{name}: {arg} is not an option of `livelora {argv[1]}`"


def test_every_livelora_variable_is_read_by_its_process_settings_and_its_value_validates(services, monkeypatch):
    kinds = _process_settings()
    used = set()
    for name, service in _livelora_services(services).items():
        cls = kinds[_argv(service)[1]]
        readers = _env_names(cls)
        env = _env(service)
        for key in env:
            if key.startswith("LIVELORA_"):
                assert key in readers, (
                    f"{name}: {key} is read by no section of {cls.__name__}; known: {sorted(readers)}"
                )
                used.add(key)
        # the values parse: build the process's settings object from exactly this environment
        for key in list(os.environ):
            if key.startswith("LIVELORA_"):
                monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        cls()  # raises pydantic's ValidationError on a bad value in any section
        if env.get("LIVELORA_ENGINE"):
            from livelora.gateway.engines import create_engine

            create_engine(env["LIVELORA_ENGINE"], device=env.get("LIVELORA_DEVICE", "cpu"))  # known kind (unstarted)
    assert {"LIVELORA_HOME", "LIVELORA_REDIS_URL", "LIVELORA_ENGINE", "LIVELORA_PORT"} <= used


def test_gpu_and_cpu_profiles_run_the_same_stack_with_vllm_and_transformers(services):
    by_profile: dict[str, dict] = {}
    for name, s in services.items():
        for profile in s.get("profiles") or ["(always)"]:
            by_profile.setdefault(profile, {})[name] = s
    assert set(by_profile["(always)"]) == {"redis"}
    for profile, engine, device in (("gpu", "vllm", "cuda"), ("cpu", "transformers", "cpu")):
        group = by_profile[profile]
        roles = sorted(_argv(s)[1] for s in _livelora_services(group).values())
        assert roles == ["gateway", "trainer"], profile
        for s in group.values():
            assert _env(s)["LIVELORA_DEVICE"] == device
            if _argv(s)[1] == "gateway":
                assert _env(s)["LIVELORA_ENGINE"] == engine
            devices = s.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
            if profile == "gpu":
                assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices), s
            else:
                assert not devices


def test_redis_persists_append_only_on_a_volume(compose, services):
    redis = services["redis"]
    argv = _argv(redis)
    assert argv[argv.index("--appendonly") + 1] == "yes"
    data_dir = argv[argv.index("--dir") + 1]
    mounts = dict(v.split(":")[1::-1] for v in redis["volumes"])  # target -> source
    assert mounts[data_dir] in compose["volumes"]
    for s in _livelora_services(services).values():
        assert urlparse(_env(s)["LIVELORA_REDIS_URL"]).hostname == "redis"
        assert "redis" in s["depends_on"]


def test_volumes_line_up_gateway_and_trainer_share_the_store(compose, services):
    declared = set(compose["volumes"])
    used = set()
    for name, s in services.items():
        for v in s.get("volumes", []):
            source, _target = v.split(":")[:2]
            if not source.startswith((".", "/")):
                assert source in declared, f"{name}: volume {source} is not declared"
                used.add(source)
    assert used == declared, "declared volumes nobody mounts"
    for name, s in _livelora_services(services).items():
        home = _env(s)["LIVELORA_HOME"]
        assert home == LIVELORA_HOME_IN_CONTAINERS
        mounts = {v.split(":")[1]: v.split(":")[0] for v in s["volumes"]}
        assert mounts.get(home) == "adapter-store", f"{name}: LIVELORA_HOME is not on the shared store volume"


def test_ports_and_health_checks_hit_real_routes_of_the_app(services):
    from livelora.gateway.app import create_app
    from livelora.gateway.settings import GatewaySettings

    app = create_app(GatewaySettings())  # no engine is built: that happens in the lifespan
    # GET routes of the app (FastAPI folds included routers into lazily resolved entries; its
    # OpenAPI schema lists them all).
    routes = {path for path, ops in app.openapi()["paths"].items() if "get" in ops}
    host_ports: dict[str, set] = {}
    for name, s in services.items():
        if name == "redis":
            assert _argv(s)[0] == "redis-server" and s["healthcheck"]["test"][1:] == ["redis-cli", "ping"]
            continue
        argv, env = _argv(s), _env(s)
        if argv[1] != "gateway":
            continue
        port = env["LIVELORA_PORT"]
        assert env["LIVELORA_HOST"] == "0.0.0.0", f"{name}: must listen on all interfaces inside the container"
        # a public bind needs an API key in the store or an explicit LIVELORA_ALLOW_OPEN (default: keys)
        assert (
            GatewaySettings(
                _env_file=None, host=env["LIVELORA_HOST"], allow_open=env["LIVELORA_ALLOW_OPEN"]
            ).server.allow_open
            is False
        )
        published = [p.split(":") for p in s["ports"]]
        assert [c for _, c in published] == [port], f"{name}: publishes {s['ports']} but listens on {port}"
        for profile in s.get("profiles", []):
            clash = host_ports.setdefault(profile, set()) & {h for h, _ in published}
            assert not clash, f"{name}: host port {clash} already used in profile {profile}"
            host_ports[profile] |= {h for h, _ in published}
        check = " ".join(s["healthcheck"]["test"][1:])
        urls = re.findall(r"https?://[^'\" ]+", check)
        assert urls, f"{name}: the health check calls no URL"
        for url in urls:
            u = urlparse(url)
            assert str(u.port) == port, f"{name}: health check on port {u.port}, server on {port}"
            assert u.path in routes, f"{name}: health check path {u.path} is not a route ({sorted(routes)})"
        dependents = [n for n, o in services.items() if name in (o.get("depends_on") or {})]
        for d in dependents:  # service_healthy needs a health check, which this service has
            assert services[d]["depends_on"][name]["condition"] == "service_healthy"


def test_build_targets_exist_in_the_dockerfile_and_images_are_built_once(services):
    stages = set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", (REPO / "Dockerfile").read_text(), re.M | re.I))
    built = {}
    for name, s in services.items():
        if "build" in s:
            assert s["build"]["target"] in stages, f"{name}: Dockerfile has no stage {s['build']['target']}"
            built[s["image"]] = s["build"]["target"]
    for name, s in _livelora_services(services).items():
        assert s["image"] in built, f"{name}: image {s['image']} is built by no service"
        assert built[s["image"]] == ("gpu" if "gpu" in s["profiles"] else "cpu")


def test_every_dockerfile_stage_copies_every_package_folder():
    """``pip install .`` in an image needs every folder of pyproject's ``package-dir`` (a new package is easy to
    forget)."""
    import tomllib

    folders = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    text = (REPO / "Dockerfile").read_text()
    stages = re.split(r"^FROM\s", text, flags=re.M)[1:]
    assert stages
    for stage in stages:
        copied = set(re.findall(r"^COPY\s+(\S+)\s+\S+\s*$", stage, re.M))
        assert folders <= copied, f"stage {stage.split()[2]} does not copy {sorted(folders - copied)}"
