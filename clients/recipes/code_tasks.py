"""Programming tasks for ``code-rl``: HumanEval, a generated easy set, code extraction and the test programs.

A :class:`CodeTask` has a statement shown to the model, public tests (``check_solution`` runs them) and hidden
tests (the reward runs them); tests are Python ``assert`` lines run after the solution in one program. The easy
set is generated here from templates of small functions (deterministic, no download), with expected values
from our own reference lambdas; docs/code-rl.md lists the templates.
"""

from __future__ import annotations

import doctest
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from livelora.clients.recipes.datums import split


@dataclass(frozen=True)
class CodeTask:
    task_id: str
    statement: str
    entry_point: str
    public_tests: tuple[str, ...]
    hidden_tests: str


# name, statement (with {f}, {k}, {c}), reference (a lambda's source, k and c bound), argument kind
TEMPLATES: list[tuple[str, str, str, str]] = [
    ("add", "returns x plus {k}", "lambda x: x + {k}", "int"),
    ("times", "returns x multiplied by {k}", "lambda x: x * {k}", "int"),
    ("minus", "returns x minus {k}", "lambda x: x - {k}", "int"),
    ("divisible_by", "returns True if x is divisible by {k}, else False", "lambda x: x % {k} == 0", "int"),
    ("greater_than", "returns True if x is greater than {k}, else False", "lambda x: x > {k}", "int"),
    ("square_plus", "returns x squared plus {k}", "lambda x: x * x + {k}", "int"),
    ("repeat", "returns the string s repeated {k} times", "lambda s: s * {k}", "str"),
    ("first", "returns the first {k} elements of the list xs", "lambda xs: xs[:{k}]", "list"),
    (
        "add_to_all",
        "returns a new list with {k} added to every element of xs",
        "lambda xs: [v + {k} for v in xs]",
        "list",
    ),
    ("count", "returns how many times the character '{c}' appears in s", "lambda s: s.count('{c}')", "str"),
    ("starts_with", "returns True if s starts with '{c}', else False", "lambda s: s.startswith('{c}')", "str"),
    ("append_char", "returns s with '{c}' added at the end", "lambda s: s + '{c}'", "str"),
    ("last", "returns the last element of the non-empty list xs", "lambda xs: xs[-1]", "list"),
    ("reverse", "returns the string s reversed", "lambda s: s[::-1]", "str"),
    ("total", "returns the sum of the numbers in the list xs", "lambda xs: sum(xs)", "list"),
    ("largest", "returns the largest number in the non-empty list xs", "lambda xs: max(xs)", "list"),
    ("upper", "returns s in upper case", "lambda s: s.upper()", "str"),
    ("evens", "returns the even numbers of the list xs, in order", "lambda xs: [v for v in xs if v % 2 == 0]", "list"),
    ("length", "returns the number of characters in s", "lambda s: len(s)", "str"),
    ("absolute", "returns the absolute value of x", "lambda x: abs(x)", "int"),
]
WORDS = ["apple", "banana", "cherry", "kiwi", "lemon", "mango", "", "abc", "hello", "zebra", "aaa", "code"]


def _argument(kind: str, rng: random.Random):
    if kind == "int":
        return rng.randint(-20, 40)
    if kind == "str":
        return rng.choice(WORDS)
    return [rng.randint(-9, 20) for _ in range(rng.randint(1, 6))]


def easy_tasks(seed: int = 0, variants: int = 8) -> list[CodeTask]:
    """The generated easy set: every template with ``variants`` constants (k in 2..9, c a letter), 2 public and
    4 hidden tests each (seeded)."""
    rng = random.Random(seed)
    tasks: list[CodeTask] = []
    for name, statement, ref, kind in TEMPLATES:
        for v in range(variants):
            k, c = 2 + v, "aeiouklmn"[v % 9]
            fn = f"{name}_{k}" if "{k}" in statement else (f"{name}_{c}" if "{c}" in statement else f"{name}_v{v}")
            if any(t.entry_point == fn for t in tasks):
                continue
            reference = eval(ref.format(k=k, c=c))  # our own template, never model output
            arg = {"int": "x", "str": "s", "list": "xs"}[kind]
            tests: list[str] = []
            seen: set[str] = set()
            while len(tests) < 6:
                x = _argument(kind, rng)
                if repr(x) in seen and len(seen) < 6:
                    continue
                seen.add(repr(x))
                tests.append(f"assert {fn}({x!r}) == {reference(x)!r}")
            text = (
                f"Write a Python function `{fn}({arg})` that {statement.format(k=k, c=c)}.\n\n"
                f"Example: `{tests[0].removeprefix('assert ')}`."
            )
            tasks.append(CodeTask(f"easy/{fn}", text, fn, tuple(tests[:2]), "\n".join(tests[2:])))
    return tasks


def humaneval_tasks(path: str | Path) -> list[CodeTask]:
    """HumanEval (``HumanEval.jsonl`` in ``path`` or the file itself): the prompt (signature + docstring) is the
    statement, its doctest examples the public tests, ``check(entry_point)`` the hidden tests.

    Raises: FileNotFoundError when the file is missing.
    """
    p = Path(path)
    p = p / "HumanEval.jsonl" if p.is_dir() else p
    tasks = []
    for line in p.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        examples = doctest.DocTestParser().get_examples(row["prompt"])
        wants = [
            "\n".join(w for w in ex.want.splitlines() if w.strip() not in ('"""', "'''")).strip() for ex in examples
        ]
        public = tuple(f"assert ({ex.source.strip()}) == ({w})" for ex, w in zip(examples, wants) if w)
        statement = (
            "Complete this Python function; reply with the whole function.\n\n```python\n" + row["prompt"] + "```"
        )
        hidden = row["test"] + f"\ncheck({row['entry_point']})\n"
        tasks.append(CodeTask(row["task_id"], statement, row["entry_point"], public, hidden))
    return tasks


def train_heldout(tasks: list[CodeTask], held_out: int, seed: int) -> tuple[list[CodeTask], list[CodeTask]]:
    """A seeded split (:func:`livelora.clients.recipes.datums.split`)."""
    return split(tasks, held_out, seed)


_BLOCK = re.compile(r"```(?:[\w+-]+)?\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str | None:
    """The last fenced code block of a reply (tinker-cookbook ``extract_code_from_model``), or None."""
    blocks = _BLOCK.findall(text)
    return blocks[-1].strip() if blocks else None


def grading_program(solution: str, tests: str) -> str:
    """The program a test run executes: the solution, then the tests (asserts; exit 0 iff all pass)."""
    return solution + "\n\n" + tests + "\n"


def public_check_program(solution: str, tests: tuple[str, ...]) -> str:
    """Runs each public test on its own and prints ``PASS``/``FAIL`` lines (the ``check_solution`` result)."""
    body = [solution, "", "import traceback as _tb", "_results = []"]
    for t in tests:
        body += [
            "try:",
            f"    {t}",
            f"    print('PASS', {t!r})",
            "except Exception as _e:",
            f"    print('FAIL', {t!r}, '->', type(_e).__name__, str(_e)[:80])",
        ]
    return "\n".join(body) + "\n"
