"""tinker-cookbook recipes, unmodified, against a running livelora gateway (only env vars and command-line flags).

Runs ``math_rl`` (``env=arithmetic``, sync and ``max_steps_off_policy=2``, then killed mid-run and resumed),
``rl_loop`` and ``sl_loop`` from the cookbook installed in an SDK venv (``.ci/setup-tinker-sdks``), each as its
own process, and prints one row per run: exit status, seconds, steps logged, and the last error line when it
failed (what blocks it). Nothing is asserted; the machine load is printed with every figure.

    livelora serve --port 8123 &                       # the gateway (any store)
    livelora hf-cache --cache-dir /tmp/hub             # the tokenizer under its hub id, offline
    python bench/tinker_cookbook.py --base-url http://127.0.0.1:8123 --hf-cache /tmp/hub [--venv .venv-tinker038]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: SmolLM2 is not in the cookbook's model_info table: recipes that take renderer_name get the generic one.
RENDERER = "role_colon"
MATH = [
    "tinker_cookbook.recipes.math_rl.train",
    "env=arithmetic",
    f"model_name={HUB_ID}",
    f"renderer_name={RENDERER}",
    "loss_fn=importance_sampling",
    "groups_per_batch=4",
    "group_size=2",
    "max_tokens=5",
    "lora_rank=4",
]


def runs(tmp: Path, sdk: str) -> list[tuple[str, list[str]]]:
    rl_loss = [] if sdk.startswith("0.24") else ["loss_fn=importance_sampling"]  # cookbook 0.5.7 has no such flag
    return [
        ("math_rl arithmetic (sync)", [*MATH, "max_steps=2", f"log_path={tmp}/math-sync"]),
        (
            "math_rl arithmetic (max_steps_off_policy=2)",
            [*MATH, "max_steps=3", "max_steps_off_policy=2", f"log_path={tmp}/math-async"],
        ),
        (
            "rl_loop",
            [
                "tinker_cookbook.recipes.rl_loop",
                f"model_name={HUB_ID}",
                *rl_loss,
                "batch_size=4",
                "group_size=2",
                "max_tokens=8",
                "lora_rank=4",
                "max_steps=2",
                f"log_path={tmp}/rl-loop",
            ],
        ),
        (
            "sl_loop",
            [
                "tinker_cookbook.recipes.sl_loop",
                f"model_name={HUB_ID}",
                "batch_size=4",
                "lora_rank=4",
                "max_steps=2",
                "save_every=1",
                f"log_path={tmp}/sl-loop",
            ],
        ),
    ]


def steps_logged(log_path: Path) -> int:
    f = log_path / "metrics.jsonl"
    return sum(1 for line in f.read_text().splitlines() if line.strip()) if f.is_file() else 0


def last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if any(k in ln for k in ("Error", "error", "Exception", "not found", "Traceback")):
            return ln[:240]
    return (lines[-1] if lines else "")[:240]


def run(python: str, args: list[str], env: dict[str, str], timeout: float) -> tuple[int, float, str]:
    t0 = time.monotonic()
    try:
        p = subprocess.run(
            [python, "-m", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            cwd=tempfile.gettempdir(),
            check=False,
        )
        return p.returncode, time.monotonic() - t0, p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return -1, time.monotonic() - t0, out + "\ntimed out"


def kill_and_resume(python: str, env: dict[str, str], tmp: Path, timeout: float) -> str:
    """math_rl with a checkpoint every step: SIGKILL once the first checkpoint is recorded, then the same
    command again (the cookbook resumes from its log_path's checkpoints.jsonl)."""
    log = tmp / "math-resume"
    args = [*MATH, "max_steps=4", "save_every=1", f"log_path={log}"]
    proc = subprocess.Popen(
        [python, "-m", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tempfile.gettempdir()
    )
    deadline = time.monotonic() + timeout
    ckpts = log / "checkpoints.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if ckpts.is_file() and ckpts.read_text().strip():
            break
        time.sleep(0.5)
    if proc.poll() is not None:
        return f"finished before it could be killed (exit {proc.returncode})"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = [json.loads(x) for x in ckpts.read_text().splitlines() if x.strip()]
    rc, secs, out = run(python, [*args, "behavior_if_log_dir_exists=resume"], env, timeout)
    resumed = "Resuming" in out or "resum" in out.lower()
    return (
        f"killed after checkpoint {saved[-1].get('name')}; rerun exit {rc} in {secs:.0f} s, resumed={resumed}, "
        f"steps logged {steps_logged(log)}" + ("" if rc == 0 else f"; {last_error(out)}")
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8123")
    ap.add_argument("--venv", default=str(ROOT / ".venv-tinker038"))
    ap.add_argument("--hf-cache", required=True, help="HF hub cache holding the tokenizer (livelora hf-cache)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--only", default="", help="comma list of row-name prefixes to run")
    a = ap.parse_args()
    python = str(Path(a.venv).resolve() / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINKER_")}
    env.update(
        TINKER_BASE_URL=a.base_url,
        TINKER_API_KEY="tml-local",
        TINKER_TELEMETRY="0",
        HF_HUB_CACHE=a.hf_cache,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONPATH="",
    )
    version = subprocess.run(
        [
            python,
            "-c",
            "import tinker, importlib.metadata as m; print(tinker.__version__, m.version('tinker-cookbook'))",
        ],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    print(f"tinker / tinker-cookbook: {version.strip()}; base model {HUB_ID}; load {os.getloadavg()}")
    tmp = Path(tempfile.mkdtemp(prefix="livelora-cookbook-"))
    try:
        for name, args in runs(tmp, version):
            if a.only and not any(name.startswith(p) for p in a.only.split(",")):
                continue
            rc, secs, out = run(python, args, env, a.timeout)
            log = Path(next(x for x in args if x.startswith("log_path=")).split("=", 1)[1])
            status = "ok" if rc == 0 else f"FAILED ({rc}): {last_error(out)}"
            print(
                f"| {name} | {status} | {secs:.0f} s | {steps_logged(log)} steps | load {os.getloadavg()[0]:.1f} |",
                flush=True,
            )
        if not a.only or "resume" in a.only:
            print(
                f"| math_rl kill + resume | {kill_and_resume(python, env, tmp, a.timeout)} | load "
                f"{os.getloadavg()[0]:.1f} |",
                flush=True,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
