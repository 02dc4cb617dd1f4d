"""``livelora recipe NAME``: one typer command per recipe, its flags generated from the recipe's ``Config``.

Every config field is a flag (``--learning-rate``, ``--log-dir``, ...) whose help is the field's description;
values are validated by the config model, and all errors are reported at once. A progress bar follows the
steps (when stderr is not a terminal, one line per step instead, with the run's elapsed seconds); a summary table
(each evaluation metric before and after, steps, wall time on the same clock) closes the run. ``--smoke`` runs a
preset of about a minute (:mod:`livelora.clients.recipes.smoke`).

Example::

    livelora recipe gsm8k-rl --smoke
    livelora recipe gsm8k-rl --task arithmetic --steps 20 --log-dir runs/arith
    livelora recipe gsm8k-rl --task arithmetic --steps 30 --log-dir runs/arith  # resumes
"""

from __future__ import annotations

import importlib
import inspect
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from livelora.clients.errors import UnavailableError

if TYPE_CHECKING:
    from pydantic import BaseModel

#: recipe command -> module (each has ``Config`` and ``run(cfg, sdk=, on_step=)``).
RECIPES = {
    "chat-sft": "livelora.clients.recipes.chat_sft",
    "gsm8k-rl": "livelora.clients.recipes.gsm8k_rl",
    "kto-ratings": "livelora.clients.recipes.kto_ratings",
    "dpo": "livelora.clients.recipes.dpo",
    "distill": "livelora.clients.recipes.distill",
    "code-rl": "livelora.clients.recipes.code_rl",
}

recipe_app = typer.Typer(
    help="Training recipes over the training-session API (chat SFT, GSM8K RL, KTO, DPO, "
    "distillation, code RL in a sandbox): metrics, checkpoints, exact resume.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
console = Console(stderr=True, soft_wrap=True)  # messages: the terminal wraps them, a log file keeps whole lines


def _option_type(annotation: Any) -> Any:
    """The click-friendly type of a config annotation (Optional[X] -> X, Literal -> str)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return _option_type(args[0])
    if typing.get_origin(annotation) is typing.Literal:
        return str
    return annotation


def _parameters(config_cls: type[BaseModel], recipe: str) -> list[inspect.Parameter]:
    from livelora.clients.recipes.smoke import PRESETS

    params = [
        inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context),
        inspect.Parameter(
            "smoke",
            inspect.Parameter.KEYWORD_ONLY,
            default=False,
            annotation=Annotated[
                bool,
                typer.Option(
                    "--smoke",
                    help="A preset that runs in about a minute on an idle 2-core CPU (2 steps on built-in sample "
                    "data, in a fresh temporary --log-dir) and shows one real update: a held-out metric that "
                    "moves, or (RL recipes) the update's train/update_gain. Flags given with it win.",
                ),
            ],
        ),
    ]
    for name, field in config_cls.model_fields.items():
        typ = _option_type(field.annotation)
        choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal else ()
        help_text = (field.description or "") + (f" [{'|'.join(map(str, choices))}]" if choices else "")
        flag = "--" + name.replace("_", "-")
        decls = [f"{flag}/--no-{name.replace('_', '-')}"] if typ is bool else [flag]
        if name == "log_dir":
            default: Any = Path("runs") / recipe
        elif field.is_required():
            default = None if name in PRESETS[recipe] else ...  # --smoke brings its own
        else:
            default = field.default
        params.append(
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=default,
                annotation=Annotated[typ | None if default is None else typ, typer.Option(*decls, help=help_text)],
            )
        )
    return params


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def summary_table(summary: Any) -> Table:
    """Rich table of a :class:`~livelora.clients.recipes.loop.Summary`: eval metrics before / after / change."""
    title = f"{summary.recipe}: {summary.steps} steps, {summary.wall_s:.0f} s wall (set-up, steps, evaluations)"
    table = Table(title=f"{title}, {summary.log_dir}")
    for col in ("metric", "before", "after", "change"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for key in sorted(set(summary.before) | set(summary.after)):
        b, a = summary.before.get(key), summary.after.get(key)
        table.add_row(key, _fmt(b), _fmt(a), _fmt(a - b) if a is not None and b is not None else "-")
    for key, value in sorted(summary.last_train.items()):
        table.add_row(f"{key} (last step)", "", _fmt(value), "")
    return table


def step_text(metrics: dict[str, float]) -> str:
    """The figures of a step line: loss, reward, datums and eval metrics; a step that trained on no datum says
    so, and why when the recipe counted it (``train/groups``, ``train/groups_equal``)."""
    keys = ("train/loss", "train/reward", "train/datums", "train/update_", "eval/")
    shown = {k: v for k, v in metrics.items() if k.startswith(keys)}
    text = " ".join(f"{k}={v:.4g}" for k, v in shown.items())
    if metrics.get("train/datums") == 0:
        groups, equal = int(metrics.get("train/groups", 0)), int(metrics.get("train/groups_equal", 0))
        why = f"all {groups} groups had equal rewards" if groups and equal == groups else "no datum to train on"
        text += f" (no update: {why})"
    return text


def _with_smoke(recipe: str, given: dict[str, Any], ctx: typer.Context) -> dict[str, Any]:
    """``given`` (the command's values) with ``recipe``'s smoke preset for every flag not on the command line."""
    import tempfile

    from livelora.clients.recipes.smoke import preset

    sources = {k: ctx.get_parameter_source(k) for k in given}
    typed = {k for k, src in sources.items() if src is not None and src.name != "DEFAULT"}
    if "log_dir" not in typed:
        given = {**given, "log_dir": Path(tempfile.mkdtemp(prefix=f"livelora-{recipe}-smoke-"))}
    values = preset(recipe, Path(given["log_dir"]))
    return {**given, **{k: v for k, v in values.items() if k not in typed}}


def _make_command(recipe: str, module_name: str):
    module = importlib.import_module(module_name)
    config_cls = module.Config

    def command(ctx: typer.Context, smoke: bool = False, **kwargs: Any) -> None:
        from pydantic import ValidationError

        kwargs = {k: v for k, v in kwargs.items() if v is not None or not config_cls.model_fields[k].is_required()}
        if smoke:
            kwargs = _with_smoke(recipe, kwargs, ctx)
        try:
            cfg = config_cls(**kwargs)
        except ValidationError as exc:
            for err in exc.errors():  # a field's error names its flag; a rule across fields says it itself
                where = f"--{'.'.join(map(str, err['loc'])).replace('_', '-')}: " if err["loc"] else ""
                console.print(f"[red]error[/]: {where}{err['msg'].removeprefix('Value error, ')}")
            raise typer.Exit(2) from None
        # a terminal gets a live bar; a log file or pipe (nohup, CI) gets one plain line per step instead
        lines = not console.is_terminal
        with Progress(
            TextColumn(f"[bold]{recipe}[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=console,
            disable=lines,
        ) as progress:
            task = progress.add_task("starting", total=cfg.steps)
            if lines:
                console.print(f"{recipe}: starting, {cfg.steps} steps", soft_wrap=True)

            def on_step(done: int, metrics: dict[str, float]) -> None:
                text = step_text(metrics)
                progress.update(task, completed=done, description=text)
                if lines:  # the run's own clock (time/elapsed_s), the one the summary reports
                    console.print(
                        f"{recipe}: step {done}/{cfg.steps} {metrics.get('time/elapsed_s', 0.0):.0f}s {text}",
                        soft_wrap=True,
                        highlight=False,
                    )

            try:
                summary = module.run(cfg, on_step=on_step)
            except (ValueError, RuntimeError, ImportError, OSError) as exc:
                progress.stop()
                hint = ""
                if isinstance(exc, UnavailableError) and exc.__cause__ is not None:  # no connection at all
                    hint = " (a recipe drives a running server: start `livelora serve`, or pass --base-url)"
                console.print(f"[red]error[/]: {exc}{hint}", soft_wrap=True)
                raise typer.Exit(1) from None
        Console().print(summary_table(summary))

    # typer reads the options from the signature inspect finds; a function's __signature__ is not in its type
    typing.cast(Any, command).__signature__ = inspect.Signature(_parameters(config_cls, recipe))
    paragraphs = inspect.cleandoc(module.__doc__ or recipe).split("\n\n")
    first = paragraphs[0].removeprefix(f"{recipe}: ")  # `livelora recipe --help` lists it under its name already
    paragraphs[0] = first[:1].upper() + first[1:]
    command.__doc__ = "\n\n".join(" ".join(p.split()) for p in paragraphs)
    command.__name__ = recipe.replace("-", "_")
    return command


for _name, _module in RECIPES.items():
    recipe_app.command(_name)(_make_command(_name, _module))
