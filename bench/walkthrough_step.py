"""The README walkthrough's first live step, offline, per configuration: does ``@1`` keep its factual answers?

No server: the base model's greedy replies (chat template, at most 40 tokens, as the walkthrough asks) to the
walkthrough's 8 rated questions are rated as it rates them (liked: at most 12 words), one live step trains on them
(:meth:`OnlineTrainer.train <livelora.trainer.online.OnlineTrainer.train>`: KTO + rehearsal/KL gradients + the
evaluation gate and its line search), and the new version's greedy replies to the walkthrough's 9 factual
questions are judged against their answers (``tests/test_readme_walkthrough.py``'s ``FACTS``) beside the base
model's. Greedy replies here run unbatched in this process, so they can differ from a gateway's on another CPU.

    OMP_NUM_THREADS=1 python -u bench/walkthrough_step.py defaults warm10:lr_warmup_steps=10

Configurations: ``name`` or ``name:key=value+key=value`` of TrainingSection fields (``defaults``: none changed).
Results: docs/live-loop.md, "The walkthrough's first step".
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from forgetting_sweep import Replies, parse_config, rating_batch  # noqa: E402


def facts() -> dict[str, str]:
    """Question → accepted-answer pattern, from the walkthrough's test (the first question is asked, not rated)."""
    spec = importlib.util.spec_from_file_location("walkthrough", ROOT / "tests" / "test_readme_walkthrough.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.FACTS)


def greedy(model, replies: Replies, questions: list[str], adapter: bool) -> dict[str, tuple[list, list, str]]:
    """Per question: ``(prompt ids, reply ids without EOS, finish_reason)``, greedy, 40 tokens at most."""
    import contextlib

    import torch

    out, eos = {}, replies.tokenizer.eos_token_id
    for q in questions:
        ids = torch.tensor([replies.prompt_ids(q)])
        off = contextlib.nullcontext() if adapter else model.peft_model.disable_adapter()
        with torch.no_grad(), off:
            row = model.peft_model.generate(
                input_ids=ids, max_new_tokens=40, do_sample=False, pad_token_id=model.pad_id, eos_token_id=eos
            )[0, ids.shape[1] :].tolist()
        out[q] = (ids[0].tolist(), row[: row.index(eos)] if eos in row else row, "stop" if eos in row else "length")
    return out


def main() -> None:
    import torch

    from livelora.core.base_models import resolve_base_model
    from livelora.core.settings import DEFAULT_MODEL, CommonSettings
    from livelora.trainer.online import OnlineTrainer
    from livelora.trainer.settings import GateSection, TrainingSection

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    answers = facts()
    questions = list(answers)
    right = lambda text, q: re.search(rf"\b({answers[q]})\b", text.lower()) is not None  # noqa: E731
    base_ref = resolve_base_model(DEFAULT_MODEL, CommonSettings().home)
    store = Path(tempfile.mkdtemp(prefix="walkthrough-step-"))
    real = CommonSettings().home / "models" / "rehearsal-base"  # the real store's rehearsal cache, linked in
    real.mkdir(parents=True, exist_ok=True)
    (store / "models").mkdir()
    (store / "models" / "rehearsal-base").symlink_to(real)
    print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}", flush=True)
    for spec in sys.argv[1:] or ["defaults"]:
        name, over = parse_config(spec) if ":" in spec else (spec, {})
        trainer = OnlineTrainer(base_ref, store, TrainingSection(**over), GateSection())
        lineage = f"walkthrough-{name}-{uuid.uuid4().hex[:6]}"
        model = trainer.model_for(lineage)
        replies = Replies(trainer.tokenizer)
        text = lambda r, tok=trainer.tokenizer: tok.decode(r[1], skip_special_tokens=True)  # noqa: E731
        base = greedy(model, replies, questions, adapter=False)
        rated = [(*base[q][:3], len(text(base[q]).split()) <= 12) for q in questions[1:]]
        t0 = time.perf_counter()
        manifest = trainer.train(rating_batch(lineage, rated))
        gate = manifest.gate or {}
        new = greedy(trainer.model_for(lineage), replies, questions, adapter=True)
        lost = [q for q in questions if right(text(base[q]), q) and not right(text(new[q]), q)]
        print(
            f"{name}: {sum(r[3] for r in rated)}/8 liked; step {time.perf_counter() - t0:.0f} s, gate α "
            f"{gate.get('step_scale')}, served {not gate.get('continued_from')}; right: base "
            f"{sum(right(text(base[q]), q) for q in questions)}/9, new {sum(right(text(new[q]), q) for q in questions)}"
            f"/9; lost {len(lost)}",
            flush=True,
        )
        for q in questions:
            mark = "LOST" if q in lost else ("gain" if right(text(new[q]), q) and not right(text(base[q]), q) else "")
            print(f"  {mark:4s} {q} | base {text(base[q])[:60]!r} | new {text(new[q])[:60]!r}", flush=True)
        trainer._models.clear()


if __name__ == "__main__":
    main()
