"""The live loop's training step is a row of named phases (trainer/live_step.py, docs/internals/live-training.md):
``OnlineTrainer.train`` calls only the phases, the evaluation gate is entered once per step (its one entry,
:class:`~livelora.trainer.judge.StepJudge`, owns the before-step measurement, the line search, the settle and
the record: a real step on SmolLM2 counts the calls), the walk of a real step through its rooms (datums, step,
judge, save, report; traced by :class:`harness.walk.Walk`) comes back at most twice to a room it left, and the
functions of the step and its passes keep the 60-line budget."""

from __future__ import annotations

import ast
import functools
import inspect

import pytest
from harness.source import REPO
from harness.walk import Walk

from livelora.adapters.endpoints import EndpointStore
from livelora.trainer.event_datums import rated_batch
from livelora.trainer.scheduler import Batch

#: The trainer files of the step and its passes, whose every function keeps :data:`MAX_BODY_LINES`.
STEP_FILES = (
    "trainer/online.py",
    "trainer/live_step.py",
    "trainer/judge.py",
    "trainer/loss_pass.py",
    "trainer/logprobs.py",
    "trainer/model.py",
    "trainer/worker.py",
)
MAX_BODY_LINES = 60
#: What ``OnlineTrainer.train`` may call: the phases, the model they run on and the clock.
PHASES = {"self.datums", "StepData", "time.monotonic", "LiveStep", "self.model_for", "self.judge", "self.report"}
#: The gate's parts that only its one entry (trainer/judge.py) may reach during a step.
GATE_PARTS = {"before_step", "settle", "line_search", "record_verdicts", "step_scales"}


def _function(path: str, qualname: str) -> ast.FunctionDef:
    cls, name = qualname.split(".")
    tree = ast.parse((REPO / path).read_text())
    [node] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    [fn] = [f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == name]
    return fn


def body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from a function's first statement (its docstring included) to its end."""
    return fn.end_lineno - fn.body[0].lineno + 1


def test_train_calls_only_the_phases():
    called = {
        ast.unparse(n.func)
        for n in ast.walk(_function("trainer/online.py", "OnlineTrainer.train"))
        if isinstance(n, ast.Call)
    }
    assert called == PHASES


def _gate_parts_reached(path: str) -> set[str]:
    tree = ast.parse((REPO / path).read_text())
    called = {ast.unparse(n.func).split(".")[-1] for n in ast.walk(tree) if isinstance(n, ast.Call)}
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    return (called | imported) & GATE_PARTS


def test_only_the_gates_entry_reaches_its_parts():
    assert _gate_parts_reached("trainer/judge.py") == GATE_PARTS  # the entry reaches every part
    assert _gate_parts_reached("trainer/online.py") == set()
    assert _gate_parts_reached("trainer/live_step.py") == set()


def test_the_step_functions_keep_the_budget():
    over = [
        f"{path}:{fn.lineno} {fn.name}: {body_lines(fn)} lines"
        for path in STEP_FILES
        for fn in ast.walk(ast.parse((REPO / path).read_text()))
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and body_lines(fn) > MAX_BODY_LINES
    ]
    assert over == []


def test_the_budget_check_counts_a_long_function():
    source = "def f():\n    '''doc'''\n" + "    x = 1\n" * 61
    [fn] = ast.parse(source).body
    assert body_lines(fn) == 62 > MAX_BODY_LINES


def test_adams_eps_is_a_trainer_setting(monkeypatch):
    from typer.testing import CliRunner

    from livelora.cli.main import app
    from livelora.trainer.settings import TrainerSettings, TrainingSection

    assert TrainingSection().adam_eps == 1e-8  # the live loop's ε as it was hard-coded
    monkeypatch.setenv("LIVELORA_ADAM_EPS", "0.001")
    assert TrainerSettings().training.adam_eps == 1e-3
    monkeypatch.setenv("COLUMNS", "250")  # one line per setting
    out = CliRunner().invoke(app, ["settings", "trainer"])
    [row] = [line for line in out.output.splitlines() if "LIVELORA_ADAM_EPS" in line]
    assert [c.strip() for c in row.split("│")[1:5]] == ["LIVELORA_ADAM_EPS", "training", "1e-08", "0.001"]


@pytest.mark.timeout(900)
def test_the_learning_rate_warms_up_over_a_lineages_first_steps(base_ref, tmp_path):
    from livelora.trainer.online import OnlineTrainer
    from livelora.trainer.settings import TrainingSection

    assert TrainingSection.model_fields["lr_warmup_steps"].default == 3  # the live loop's default
    EndpointStore(tmp_path).create("warm", "warm", tenant="default", who="test")
    trainer = OnlineTrainer(base_ref, tmp_path, TrainingSection(lr_warmup_steps=3, kto_lr=1e-3), gate=None)
    lrs = [trainer.train(_ratings(trainer, "warm")).metrics["learning_rate:mean"] for _ in range(4)]
    assert lrs == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3])  # step n: min(1, n / 3) of the rate


def _ratings(trainer, endpoint: str) -> Batch:
    """Two real ratings of chat replies (one up, one down), as the live loop batches them."""
    rated = [("Name a colour.", "Blue.", True), ("What is 2+2?", "Five.", False)]
    return rated_batch(trainer.chat_pair, endpoint, rated)


@pytest.mark.timeout(1800)
def test_a_real_step_enters_the_gate_once(base_ref, tmp_path, monkeypatch):
    from livelora.trainer import gate as gate_mod
    from livelora.trainer import judge as judge_mod
    from livelora.trainer.online import OnlineTrainer
    from livelora.trainer.settings import GateSection, TrainingSection

    EndpointStore(tmp_path).create("walk", "walk", tenant="default", who="test")
    gate = GateSection(gate_enabled=True, gate_holdout_every=0, gate_gen_tokens=4, gate_min_step_scale=0.5)
    trainer = OnlineTrainer(base_ref, tmp_path, TrainingSection(), gate=gate)
    trainer.warm_up()  # as the trainer's loop does first: the model and the gate are built before any batch
    trainer.model_for("walk")  # (and the gate's base measurement, in the background, is waited for)
    entries: list[str] = []  # the gate's entry and each gate method, in call order; "!" marks one outside the entry
    inside = [False]

    def counted(name, fn, entry=False):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            entries.append(name if inside[0] or entry else "!" + name)
            if not entry:
                return fn(*args, **kwargs)
            inside[0] = True
            try:
                return fn(*args, **kwargs)
            finally:
                inside[0] = False

        return call

    monkeypatch.setattr(judge_mod.StepJudge, "__call__", counted("StepJudge", judge_mod.StepJudge.__call__, entry=True))
    for name, fn in inspect.getmembers(gate_mod.EvaluationGate, inspect.isfunction):
        if not name.startswith("_"):  # its public methods
            monkeypatch.setattr(gate_mod.EvaluationGate, name, counted(name, fn))
    monkeypatch.setattr(judge_mod, "record_verdicts", counted("record_verdicts", gate_mod.record_verdicts))

    walks = [Walk() for _ in range(3)]
    versions = []
    for walk in walks[:2]:
        batch = _ratings(trainer, "walk")
        with walk:
            versions.append(trainer.train(batch))

    assert [v.version for v in versions] == [1, 2] and all(v.gate is not None for v in versions)
    for walk in walks[:2]:
        # the judge is entered once, from train(); it comes back after the step (the α candidates) and after the
        # save (settle and record); no other room is gone back to
        assert walk.rooms == ["datums", "judge", "step", "judge", "save", "judge", "report"], walk.rooms
        assert walk.returns() == 2 and walk.entries("judge") == 1
        assert walk.came_from == ["hall", "hall", "judge", "judge", "judge", "judge", "hall"]
    assert entries.count("StepJudge") == 2  # once per step
    assert not [e for e in entries if e.startswith("!")], entries  # nothing of the gate outside its entry
    second = entries.index("StepJudge", 1)
    for step in (entries[:second], entries[second:]):
        # the entry, the snapshot and current measurement, the candidates judged, then settle and record
        assert step[:2] == ["StepJudge", "before_step"] and step[-2:] == ["settle", "record_verdicts"], step
        assert "judge" in step[2:-2]

    trainer.gate_config = None  # the same lineage's next step without a gate: the walk goes straight through
    batch = _ratings(trainer, "walk")
    with walks[2]:
        assert trainer.train(batch).gate is None
    assert walks[2].rooms == ["datums", "judge", "step", "save", "report"] and walks[2].returns() == 0


def test_the_walk_counts_returns_to_rooms_left():
    """A walk through stand-in code of the rooms: each function is compiled as if it were the room's file."""
    from harness.walk import REPO as repo

    def fn(path: str, name: str, body: str = "pass"):
        scope: dict = {}
        exec(compile(f"def {name}(f=None):\n    {body}\n", str(repo / path), "exec"), scope)
        return scope[name]

    datums, save = fn("trainer/event_datums.py", "datums"), fn("trainer/checkpoints.py", "write_version")
    step = fn("trainer/live_step.py", "LiveStep")  # a top-level name in live_step.py: the step room's
    settle = fn("trainer/gate.py", "settle")
    judge = fn("trainer/judge.py", "judge", "f[0](); f[1](); f[0]()")
    with Walk() as w:
        datums()
        judge((lambda: (step(), save()), settle))  # judge → step → save → judge (settle) → step → save
        datums()
    assert w.rooms == ["datums", "judge", "step", "save", "judge", "step", "save", "datums"]
    assert w.came_from == ["hall", "hall", "judge", "judge", "judge", "judge", "judge", "hall"]
    assert w.returns() == 4 and w.entries("judge") == 1 and w.entries("judge", "judge") == 1
