"""The live loop's training step is a row of named phases (trainer/live_step.py, docs/internals/live-training.md):
``OnlineTrainer.train`` calls only the phases, the evaluation gate is entered once per step (its one entry,
:class:`~livelora.trainer.judge.StepJudge`, owns the before-step measurement, the line search, the settle and
the record: a real step on SmolLM2 counts the calls), and the functions of the step and its passes keep the
60-line budget."""

from __future__ import annotations

import ast
import functools
import inspect

import pytest
from harness.gate import ratings_batch
from harness.source import REPO

from livelora.adapters.endpoints import EndpointStore
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


def _ratings(trainer, endpoint: str) -> Batch:
    """Two real ratings of chat replies (one up, one down), as the live loop batches them."""
    return ratings_batch(trainer, endpoint, [("Name a colour.", "Blue.", True), ("What is 2+2?", "Five.", False)])


@pytest.mark.timeout(1800)
def test_a_real_step_enters_the_gate_once(base_ref, tmp_path, monkeypatch):
    from livelora.trainer import gate as gate_mod
    from livelora.trainer import judge as judge_mod
    from livelora.trainer.online import OnlineTrainer
    from livelora.trainer.settings import GateSection, TrainingSection

    EndpointStore(tmp_path).create("walk", "walk", tenant="default", who="test")
    gate = GateSection(gate_enabled=True, gate_holdout_every=0, gate_gen_tokens=4, gate_min_step_scale=0.5)
    trainer = OnlineTrainer(base_ref, tmp_path, TrainingSection(), gate=gate)
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

    versions = [trainer.train(_ratings(trainer, "walk")) for _ in range(2)]

    assert [v.version for v in versions] == [1, 2] and all(v.gate is not None for v in versions)
    assert entries.count("StepJudge") == 2  # once per step
    assert not [e for e in entries if e.startswith("!")], entries  # nothing of the gate outside its entry
    second = entries.index("StepJudge", 1)
    for step in (entries[:second], entries[second:]):
        # the entry, the snapshot and current measurement, the candidates judged, then settle and record
        assert step[:2] == ["StepJudge", "before_step"] and step[-2:] == ["settle", "record_verdicts"], step
        assert "judge" in step[2:-2]
