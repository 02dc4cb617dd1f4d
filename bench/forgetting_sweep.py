"""Learning a taste without forgetting, offline: a few live-loop updates per configuration, side by side.

No server: per configuration a fresh :class:`~livelora.trainer.online.OnlineTrainer` (the live loop's own step:
KTO ``forward_backward`` + rehearsal/KL gradients + ``optim_step`` + the optional evaluation gate and its line
search) trains ``--steps`` batches of 8 ratings. Each batch is rated on-policy: the lineage's current weights
reply to 8 training prompts of :mod:`tastes` (sampled at temperature 0.7, at most 48 tokens, seeded per step
so every configuration's first batch is the same), and the simulated rater of :mod:`tastes` rates them. After
step 1 and the last step it measures, greedy and with the adapter on:

- taste: the rater's liked share of the 16 held-out prompts of :mod:`tastes` (and the median reply words);
- capability: the bench set's (``trainer/rails/freeform_bench.jsonl``, disjoint from the gate's) first
  ``--bench-items`` items in stratified order, right / lost / gained against the base model's replies.

Usage (one core per torch; ~2 min per configuration on a loaded 2-core CPU)::

    OMP_NUM_THREADS=2 python -u bench/forgetting_sweep.py --configs default,lr3e-4,kl --json sweep.json

Configurations are named presets (:data:`CONFIGS`) or ad hoc ``name:key=value+key=value`` with TrainingSection
fields (``kl:rehearsal_per_step=2+kl_coef=0.1``). Results: docs/live-loop.md, "Learning a taste without forgetting".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tastes import liked, prompt_pools, reply_tokens

from livelora.trainer.capability import BENCH_FILE, CapabilityItem, load_items, stratified

#: Named configurations: TrainingSection overrides (the rest are the trainer's defaults).
CONFIGS: dict[str, dict] = {
    "lr1e-3": {"kto_lr": 1e-3},
    "lr5e-4": {"kto_lr": 5e-4},
    "lr3e-4": {"kto_lr": 3e-4},
    "lr1e-4": {"kto_lr": 1e-4},
    "kl0.05": {"kto_lr": 1e-3, "rehearsal_per_step": 4, "rehearsal_weight": 0.0, "kl_coef": 0.05},
    "kl0.1": {"kto_lr": 1e-3, "rehearsal_per_step": 4, "rehearsal_weight": 0.0, "kl_coef": 0.1},
    "kl0.2": {"kto_lr": 1e-3, "rehearsal_per_step": 4, "rehearsal_weight": 0.0, "kl_coef": 0.2},
    "rehearsal0.1": {"kto_lr": 1e-3, "rehearsal_per_step": 4, "rehearsal_weight": 0.1},
    "attn": {"kto_lr": 1e-3, "lora_targets": "attn"},
    "beta0.5": {"kto_lr": 1e-3, "beta": 0.5},
}


def parse_config(spec: str) -> tuple[str, dict]:
    """``name`` of :data:`CONFIGS`, or ``name:key=value+key=value`` (values parsed as JSON, else strings)."""
    if ":" not in spec:
        return spec, dict(CONFIGS[spec])
    name, body = spec.split(":", 1)
    out = {}
    for kv in body.split("+"):
        k, v = kv.split("=", 1)
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return name, out


class Replies:
    """Chat-template prompts and replies of a :class:`TrainingModel` (adapter on, or off for the base)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def prompt_ids(self, prompt: str) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def sample(self, model, prompts: list[str], seed: int, temperature: float = 0.7, max_tokens: int = 48):
        """Sampled replies ``(prompt_ids, completion_ids without EOS, finish_reason)``, one left-padded batch."""
        import torch

        seqs = [self.prompt_ids(p) for p in prompts]
        t_max = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), t_max), model.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, s in enumerate(seqs):
            ids[b, t_max - len(s) :], mask[b, t_max - len(s) :] = torch.tensor(s), 1
        eos = self.tokenizer.eos_token_id
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.peft_model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                do_sample=True,
                temperature=temperature,
                top_p=1.0,
                top_k=0,
                pad_token_id=model.pad_id,
                eos_token_id=eos,
            )
        rows = []
        for s, row in zip(seqs, out[:, t_max:].tolist()):
            if eos in row:
                rows.append((s, row[: row.index(eos)], "stop"))
            else:
                rows.append((s, row, "length"))
        return rows


def rating_batch(lineage: str, rated: list[tuple[list[int], list[int], str, bool]]):
    """A KTO :class:`Batch` of rating events, class-weighted as the scheduler weighs it."""
    from livelora.clients.types.signals import RatingEvent
    from livelora.trainer.scheduler import Batch, kto_class_weights

    events = []
    for prompt, completion, finish, good in rated:
        cid = f"chatcmpl-{uuid.uuid4().hex[:12]}"
        events.append(
            RatingEvent(
                id=uuid.uuid4().hex,
                endpoint="sweep",
                created=int(time.time()),
                user="rater",
                completion_id=cid,
                prompt_token_ids=prompt,
                completion_token_ids=completion,
                finish_reason=finish,
                rating=good,
                rating_key=f"{cid}:rater",
            )
        )
    n_d = sum(e.rating for e in events)
    d, u = kto_class_weights(n_d, len(events) - n_d)
    return Batch(lineage, "kto", events, [str(i) for i in range(len(events))], desirable_weight=d, undesirable_weight=u)


def greedy(suite, model, adapter: bool = True) -> dict[str, str]:
    """Greedy replies of every item of a :class:`FreeformSuite` (item id → text)."""
    right: dict[str, bool] = {}
    texts: dict[str, str] = {}
    suite.measure(model, right, len(suite), adapter=adapter, texts=texts)
    return texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="lr1e-3,lr5e-4,lr3e-4,attn,kl0.1,kl0.2")
    ap.add_argument("--taste", default="short", help="a taste of bench/tastes.py")
    ap.add_argument("--rater", default="naive", help="naive or careful")
    ap.add_argument("--steps", type=int, default=3, help="live-loop updates (batches of 8 ratings)")
    ap.add_argument("--bench-items", type=int, default=40, help="stratified prefix of the bench set")
    ap.add_argument("--gate-freeform-items", type=int, default=None, help="run the evaluation gate with this check")
    ap.add_argument("--measure-first", action="store_true", help="also measure after step 1")
    ap.add_argument("--measure-at", default="", help="also measure after these steps (comma-separated)")
    ap.add_argument(
        "--thresholds", default="", help="the gate's thresholds for the rated endpoint, e.g. freeform_margin=0.05"
    )
    ap.add_argument("--base-cache", type=Path, default=None, help="the base model's replies: read, else written")
    ap.add_argument("--max-tokens", type=int, default=None, help="reply cap of rated and held-out replies (per taste)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import torch

    from livelora.core.base_models import resolve_base_model
    from livelora.core.settings import DEFAULT_MODEL, CommonSettings
    from livelora.trainer.gate_freeform import FreeformSuite
    from livelora.trainer.online import OnlineTrainer
    from livelora.trainer.settings import GateSection, TrainingSection

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    args.max_tokens = reply_tokens(args.taste, args.max_tokens)
    base_ref = resolve_base_model(DEFAULT_MODEL, CommonSettings().home)
    train, held = prompt_pools()
    bench = stratified(load_items(BENCH_FILE))[: args.bench_items]
    held_items = [
        it or CapabilityItem(f"held-{n}", "fact", p, {"kind": "contains", "accept": ["\0"]})
        for n, (p, it) in enumerate(held)
    ]
    held_items = [CapabilityItem(i.id, i.category, i.prompt, i.check, args.max_tokens) for i in held_items]
    store = Path(tempfile.mkdtemp(prefix="sweep-"))
    # the rehearsal cache of the real store is reused (models/rehearsal-base): link it in
    real = CommonSettings().home / "models" / "rehearsal-base"
    real.mkdir(parents=True, exist_ok=True)
    (store / "models").mkdir()
    (store / "models" / "rehearsal-base").symlink_to(real)
    if args.thresholds:
        from livelora.adapters.endpoints import EndpointBinding, EndpointStore
        from livelora.core.rails import GateThresholds

        gate_thresholds = GateThresholds(**parse_config(f"t:{args.thresholds}")[1])
        EndpointStore(store).set("sweep", EndpointBinding(lineage="sweep", gate=gate_thresholds))
        print(f"gate thresholds of the rated endpoint: {gate_thresholds.model_dump()}")

    def taste_of(texts: dict[str, str]) -> tuple[float, int]:
        ok = [liked(args.taste, args.rater, texts[i.id], it) for i, (_, it) in zip(held_items, held)]
        words = statistics.median(len(texts[i.id].split()) for i in held_items)
        return sum(ok) / len(ok), words

    print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; {len(bench)} bench items, {len(held)} held out")
    results, base = [], None
    measure_at = {int(x) for x in args.measure_at.split(",") if x}
    for spec in args.configs.split(","):
        name, over = parse_config(spec)
        config = TrainingSection(**over)
        gate = GateSection(gate_freeform_items=args.gate_freeform_items) if args.gate_freeform_items else None
        trainer = OnlineTrainer(base_ref, store, config, gate)
        lineage = f"sweep-{name}-{uuid.uuid4().hex[:6]}"
        model = trainer.model_for(lineage)
        replies = Replies(trainer.tokenizer)
        cap_suite = FreeformSuite(trainer.tokenizer, bench, max_items=len(bench), chunk=len(bench))
        taste_suite = FreeformSuite(trainer.tokenizer, held_items, max_items=len(held_items), chunk=len(held_items))
        taste_suite.items = held_items  # held-out order, not stratified
        taste_suite.prompts = [replies.prompt_ids(i.prompt) for i in held_items]
        if base is None:
            t0 = time.perf_counter()
            key = [args.bench_items, args.taste, args.rater, args.max_tokens]
            if args.base_cache and args.base_cache.exists() and json.loads(args.base_cache.read_text())["key"] == key:
                base = json.loads(args.base_cache.read_text())
            else:
                base = {"cap": greedy(cap_suite, model, adapter=False), "taste": greedy(taste_suite, model, False)}
                if args.base_cache:
                    args.base_cache.write_text(json.dumps(base | {"key": key}))
            b_right = sum(i.right(base["cap"][i.id]) for i in bench)
            liked0, words0 = taste_of(base["taste"])
            print(
                f"base: capability {b_right}/{len(bench)}, liked {liked0:.0%}, words {words0} "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
            results.append({"config": "base", "capability": b_right, "liked": liked0, "words": words0})
        rng = random.Random(args.seed)
        row = {"config": name, "settings": over, "steps": [], "update_s": []}
        for step in range(1, args.steps + 1):
            picks = [rng.choice(train) for _ in range(8)]
            out = replies.sample(model, [p for p, _ in picks], seed=args.seed * 1000 + step, max_tokens=args.max_tokens)
            rated = [
                (pi, ci, fin, liked(args.taste, args.rater, trainer.tokenizer.decode(ci), it))
                for (pi, ci, fin), (_, it) in zip(out, picks)
            ]
            t0 = time.perf_counter()
            manifest = trainer.train(rating_batch(lineage, rated))
            row["update_s"].append(time.perf_counter() - t0)
            model = trainer.model_for(lineage)
            gate = manifest.gate or {}
            refused = sorted({c for t in gate.get("line_search") or [] for c in t.get("failed") or []})
            row.setdefault("refused_by", []).append(refused)
            if step != args.steps and not (step == 1 and args.measure_first) and step not in measure_at:
                print(
                    f"{name:14s} step {step}: {sum(r[3] for r in rated)}/8 ratings liked, update "
                    f"{row['update_s'][-1]:.1f} s, gate α {gate.get('step_scale')} served "
                    f"{not gate.get('continued_from')} refused by {refused}",
                    flush=True,
                )
                continue
            cap = greedy(cap_suite, model)
            was = {i.id: i.right(base["cap"][i.id]) for i in bench}
            now = {i.id: i.right(cap[i.id]) for i in bench}
            lost = [i.id for i in bench if was[i.id] and not now[i.id]]
            gained = [i.id for i in bench if now[i.id] and not was[i.id]]
            liked_share, words = taste_of(greedy(taste_suite, model))
            point = {
                "step": step,
                "ratings_liked": sum(r[3] for r in rated),
                "liked": liked_share,
                "words": words,
                "capability": sum(now.values()),
                "lost": lost,
                "gained": gained,
                "gate": (manifest.gate or {}).get("step_scale") if manifest.gate else None,
                "served": manifest.gate is None or not manifest.gate.get("continued_from"),
            }
            row["steps"].append(point)
            print(
                f"{name:14s} step {step}: liked {liked_share:4.0%} words {words:4.1f} capability "
                f"{point['capability']}/{len(bench)} (lost {len(lost)}, gained {len(gained)}) "
                f"update {row['update_s'][-1]:.1f} s gate α {point['gate']} served {point['served']} "
                f"refused by {refused}",
                flush=True,
            )
        row["cap_texts"] = cap
        results.append(row)
        trainer._models.clear()
        if args.json:
            args.json.write_text(json.dumps({"args": vars(args), "results": results}, default=str))
    print(f"load {os.getloadavg()[0]:.1f}")
    print(table(results, len(bench), args.steps))


def table(results: list[dict], n_items: int, steps: int) -> str:
    """Markdown: per configuration, after step 1 and the last step: liked share, words, capability, lost/gained."""
    base = results[0]
    rows = [
        "| configuration | after | liked (held out) | median words | capability | lost / gained vs base | update s |",
        "|---|---|---|---|---|---|---|",
        f"| base model | — | {base['liked']:.0%} | {base['words']:g} | {base['capability']}/{n_items} | — | — |",
    ]
    for r in results[1:]:
        for p in r["steps"]:
            upd = statistics.median(r["update_s"])
            rows.append(
                f"| {r['config']} | {8 * p['step']} ratings | {p['liked']:.0%} | {p['words']:g} | "
                f"{p['capability']}/{n_items} | {len(p['lost'])} / {len(p['gained'])} | {upd:.1f} |"
            )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
