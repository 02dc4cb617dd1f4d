"""Write the rehearsal pools' shipped base replies (``trainer/rails/<pool>.base.json``, the trainer's
:func:`~livelora.trainer.rehearsal.shipped_file`): the built-in model's greedy replies to each pool, in float32 on
this machine's CPU, so that a fresh store's first live step with a KL or rehearsal does not generate them (about
80 s on an idle 2-core machine). Rerun when the pool, the built-in weights or ``rehearsal_max_tokens``' default
change (the trainer ignores a shipped file whose key does not match, and generates).

    python bench/make_rehearsal_base.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from livelora.core.base_models import base_identity, resolve_base_model
from livelora.core.settings import DEFAULT_MODEL
from livelora.trainer.event_datums import EventDatums
from livelora.trainer.rehearsal import POOLS, Rehearsal, shipped_file, shipped_key
from livelora.trainer.settings import TrainingSection


def main() -> None:
    with tempfile.TemporaryDirectory() as home:
        ref = resolve_base_model(DEFAULT_MODEL, Path(home))
        for pool, path in POOLS.items():
            config = TrainingSection(rehearsal_per_step=1, rehearsal_pool=pool, device="cpu")
            rehearsal = Rehearsal(ref, Path(home), EventDatums(ref, config), config, base_identity(ref))
            replies = rehearsal.generate()
            key = shipped_key(rehearsal.prompts, rehearsal.base_id, config.rehearsal_max_tokens)
            doc = {"key": key, "model": DEFAULT_MODEL, "replies": [r.__dict__ for r in replies]}
            shipped_file(path).write_text(json.dumps(doc, separators=(",", ":")) + "\n")
            print(f"{shipped_file(path)}: {len(replies)} replies in {rehearsal.seconds:.1f} s ({key['base_id']})")


if __name__ == "__main__":
    main()
