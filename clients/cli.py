"""The ``livelora`` command line (typer app; one sub-command per task).

Example::

    livelora serve                                   # built-in SmolLM2 on http://127.0.0.1:8000/v1
    livelora serve --model ./my-hf-model --port 9000 --home /data/livelora

Flags override ``LIVELORA_*`` environment variables, which override defaults.
Heavy imports (torch, the gateway) happen inside the commands, so ``livelora
--help`` stays fast and ``livelora.clients`` does not import the gateway.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(name="livelora", help="Self-hosted OpenAI-compatible gateway whose model keeps learning.",
                  no_args_is_help=True, add_completion=False)
console = Console(stderr=True)


@app.callback()
def _root() -> None:
    """livelora: serve, train and manage LoRA adapters."""


@app.command()
def serve(
    model: Annotated[str | None, typer.Option(help="Base model: built-in name, HF id or local directory.")] = None,
    host: Annotated[str | None, typer.Option(help="Interface to bind (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (default 8000).")] = None,
    home: Annotated[Path | None, typer.Option(help="Store root, LIVELORA_HOME (models, adapters, data).")] = None,
    engine: Annotated[str | None, typer.Option(help="Inference engine kind (default transformers).")] = None,
    device: Annotated[str | None, typer.Option(help="Torch device, e.g. cpu or cuda (default: auto).")] = None,
    max_batch_size: Annotated[int | None, typer.Option(help="Sequences decoded together (default 8).")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="Name clients pass as `model` "
                                                                "(default: --model).")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Start the OpenAI-compatible server (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``)."""
    import uvicorn
    from pydantic import ValidationError

    from livelora.clients.errors import LiveloraError
    from livelora.gateway.app import create_app
    from livelora.gateway.settings import GatewaySettings

    if home is not None:
        os.environ["LIVELORA_HOME"] = str(home)
    overrides = {"model": model, "host": host, "port": port, "home": home, "engine": engine, "device": device,
                 "max_batch_size": max_batch_size, "served_model_name": served_model_name}
    try:
        settings = GatewaySettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        for err in exc.errors():
            console.print(f"[red]error[/]: {'.'.join(map(str, err['loc']))}: {err['msg']}")
        raise typer.Exit(2) from None
    base_url = f"http://{settings.host}:{settings.port}/v1"
    console.print(f"[bold]livelora[/] serving [cyan]{settings.model_id}[/] with the {settings.engine} engine "
                  f"on [green]{base_url}[/] (store: {settings.home})")
    try:
        uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=log_level)
    except LiveloraError as exc:
        console.print(f"[red]error[/]: {exc}")
        raise typer.Exit(1) from None


def main() -> None:
    """Console-script entry point (``livelora = "livelora.clients.cli:main"``)."""
    app()


if __name__ == "__main__":
    main()
