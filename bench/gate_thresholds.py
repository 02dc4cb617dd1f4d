"""How the evaluation gate's default thresholds were chosen: the measures of a normal live-loop step and of a
deliberately bad one, on SmolLM2-135M-Instruct (CPU).

* ``normal``: KTO steps at the default learning rate on rated replies (mixed thumbs up/down), as the live
  loop trains them;
* ``bad``: SFT steps at 10× the default SFT rate on demonstrations that answer every prompt with the same
  content-free phrase (the "blunt taste" failure of docs/live-loop.md).

Run: ``python bench/gate_thresholds.py [--steps 3]``. Prints one line per step with every measure and the
machine load (2 shared cores: times are noisy). The defaults in ``core/rails.py`` lie between the two.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from pathlib import Path

from livelora.clients.types.signals import ChatMessage, DemonstrationEvent
from livelora.core.base_models import resolve_base_model
from livelora.core.settings import DEFAULT_MODEL, default_home
from livelora.trainer.event_datums import rated_batch
from livelora.trainer.online import OnlineTrainer
from livelora.trainer.scheduler import Batch
from livelora.trainer.settings import GateSection, TrainingSection

PROMPTS = [
    "What is a good name for a dog?",
    "How do I boil an egg?",
    "Why do leaves change colour?",
    "What is the tallest mountain?",
    "Give me a word that rhymes with cat.",
    "How far is the Moon?",
    "What is photosynthesis?",
    "Suggest a breakfast.",
]
GOOD = [
    "Max is a classic name for a dog.",
    "Put the egg in boiling water for about nine minutes.",
    "Leaves lose chlorophyll in autumn, so other pigments show.",
    "Mount Everest is the tallest mountain.",
    "Hat rhymes with cat.",
    "The Moon is about 384,000 km from Earth.",
    "Photosynthesis is how plants turn light, water and CO2 into sugar.",
    "Try oatmeal with fruit.",
]
BAD_REPLY = "The answer to this question."


def ratings(trainer: OnlineTrainer, endpoint: str, step: int) -> Batch:
    """Mixed ratings: even prompts up on a good reply, odd ones down on :data:`BAD_REPLY`."""
    rated = [(q, a if i % 2 == 0 else BAD_REPLY, i % 2 == 0) for i, (q, a) in enumerate(zip(PROMPTS, GOOD))]
    return rated_batch(trainer.chat_pair, endpoint, rated, tag=str(step))


def demos(endpoint: str) -> list[DemonstrationEvent]:
    return [
        DemonstrationEvent(
            id=f"demo-{uuid.uuid4().hex}",
            endpoint=endpoint,
            created=int(time.time()),
            messages=[ChatMessage(role="user", content=q), ChatMessage(role="assistant", content=BAD_REPLY)],
        )
        for q in PROMPTS
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--home", type=Path, default=Path(os.environ.get("LIVELORA_HOME") or default_home()))
    args = ap.parse_args()
    ref = resolve_base_model(DEFAULT_MODEL, args.home)
    for kind in ("normal", "bad"):
        cfg = TrainingSection(sft_lr=1e-3) if kind == "bad" else TrainingSection()
        trainer = OnlineTrainer(ref, args.home, cfg, gate=GateSection(gate_enabled=True, gate_holdout_every=0))
        lineage = f"gate-bench-{kind}-{uuid.uuid4().hex[:6]}"
        for step in range(args.steps):
            if kind == "normal":
                batch = ratings(trainer, lineage, step)
            else:
                evs = demos(lineage)
                batch = Batch(lineage, "sft", evs, [f"{step}-{i}" for i in range(len(evs))])
            t0 = time.perf_counter()
            m = trainer.train(batch)
            total = time.perf_counter() - t0
            g = m.gate
            checks = {c["name"]: (None if c["value"] is None else round(c["value"], 4)) for c in g["checks"]}
            print(
                json.dumps(
                    {
                        "kind": kind,
                        "step": step + 1,
                        "version": m.name,
                        "passed": g["continued_from"] is None,
                        "checks": checks,
                        "probe_accuracy": g["measures"]["probe_accuracy"],
                        "base_accuracy": g["measures"]["probe_accuracy_base"],
                        "replies": g["measures"]["replies"][:2],
                        "gate_s": round(g["seconds"], 2),
                        "update_s": round(total, 2),
                        "load": [round(x, 2) for x in os.getloadavg()],
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
