"""Tastes a small model can learn from thumbs up/down, and what each costs in capability.

Per taste (``short``, ``bullets``, ``formal``, ``direct``) and rater kind (``naive``: the taste only; ``careful``: the
taste, and a wrong answer to a factual prompt is disliked), a fresh :class:`live_loop.Loop` (gateway + trainer
thread) is rated in rounds of 8 on a training pool of everyday and factual prompts; after each ``--ratings`` count
it measures the liked share on held-out prompts (``--samples`` each at the serving temperature, Wilson 95 % CI) and
the free-form capability score on ``trainer/rails/freeform_bench.jsonl`` (greedy replies of the served version,
temperature 0, each item's ``max_tokens``), plus versions trained / served / rejected and update times. The
factual prompts are checked disjoint from both capability sets at start. Results: docs/live-loop.md.

Usage::

    python bench/tastes.py --tastes short --raters naive --rails off --capability-items 60
    python bench/tastes.py --tastes short --raters naive --rails off --rehearsal 4 --kl-coef 0.5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from live_loop import Loop, Session, chat, load_line, percentile

from livelora.trainer.capability import BENCH_FILE, GATE_FILE, CapabilityItem, load_items, stratified

#: Everyday prompts without one right answer: (train, held out).
EVERYDAY = (
    [
        "How do I keep my kitchen tidy?",
        "What should I wear to a summer wedding?",
        "How can I learn to cook?",
        "How do I start a vegetable garden?",
        "What is a fun weekend activity?",
        "How do I train a puppy?",
        "How can I be more productive at work?",
        "What are good habits for healthy teeth?",
        "How do I choose a good book?",
        "How do I make friends in a new city?",
        "Why do people like music?",
        "How can I drink more water?",
        "What makes a good breakfast?",
        "How do I care for a goldfish?",
        "How do I prepare for an exam?",
        "What is a nice gift for a grandparent?",
        "How can I relax after work?",
        "How do I iron a shirt?",
        "Why is sleep important?",
        "How do I stop procrastinating?",
        "What is a good way to learn a language?",
        "How do I keep bread fresh?",
        "How can I walk more each day?",
        "How do I plan a birthday party?",
    ],
    [
        "How do I choose running shoes?",
        "What is a good rainy day meal?",
        "How can I keep my desk organised?",
        "How do I talk to a shy child?",
        "Why do people keep diaries?",
        "How do I pack a suitcase well?",
        "What should I do on a day off?",
        "How do I look after a bicycle?",
    ],
)

#: Factual prompts with accepted answers: (train, held out). Checked disjoint from the capability sets.
FACTS = (
    [
        ("What is the largest animal on Earth?", ["blue whale"]),
        ("How many legs does an insect have?", ["six", "6"]),
        ("What gas do plants take in from the air?", ["carbon dioxide", "co2"]),
        ("What is the capital of Canada?", ["ottawa"]),
        ("Which planet is known as the Red Planet?", ["mars"]),
        ("How many minutes are in an hour?", ["sixty", "60"]),
        ("What is the main language of Mexico?", ["spanish"]),
        ("What do bees make?", ["honey"]),
        ("What is the closest star to Earth?", ["sun"]),
        ("Who wrote Hamlet?", ["shakespeare"]),
        ("What is the capital of Egypt?", ["cairo"]),
        ("How many sides does a hexagon have?", ["six", "6"]),
        ("What do caterpillars turn into?", ["butterfl", "moth"]),
        ("What is the largest desert in Africa?", ["sahara"]),
        ("What metal is liquid at room temperature?", ["mercury"]),
        ("What is the capital of Australia?", ["canberra"]),
        ("How many months are in a year?", ["twelve", "12"]),
        ("Which organ pumps blood through the body?", ["heart"]),
        ("What is the currency of Japan?", ["yen"]),
        ("On which continent is Kenya?", ["africa"]),
        ("What colour are ripe bananas?", ["yellow"]),
        ("Who painted The Starry Night?", ["van gogh"]),
        ("What is the capital of Russia?", ["moscow"]),
        ("What is the hardest natural material?", ["diamond"]),
    ],
    [
        ("What is the capital of Portugal?", ["lisbon"]),
        ("How many wheels does a tricycle have?", ["three", "3"]),
        ("Which animal is known as the king of the jungle?", ["lion"]),
        ("What is the chemical symbol for gold?", ["au"]),
        ("Who was the first person to walk on the Moon?", ["armstrong"]),
        ("What is the largest planet in the solar system?", ["jupiter"]),
        ("How many days are there in a week?", ["seven", "7"]),
        ("What is the capital of Greece?", ["athens"]),
    ],
)

_BULLET = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s+\S", re.M)
_EMOJI = re.compile("[\U0001f000-\U0001faff\u2600-\u27bf\u2b50\u2b55\ufe0f]")
_CHATTER = re.compile(
    r"\b(?:I think|I['’]m|I am|I['’]d|I['’]ll|I feel|I believe|I guess|I hope|I love|in my opinion)\b"
)
#: contractions, which a formal register spells out ("it's", "don't", "you're", "here's", ...)
_SHORTENED = re.compile(
    r"\b\w+(?:n['’]t|['’]re|['’]ll|['’]ve|['’]d)\b|\b(?:it|that|there|here|what|let|he|she)['’]s\b", re.I
)
_FILLER = re.compile(
    r"^\W*(?:sure|of course|certainly|absolutely|great|good question|hello|hi|hey|well|okay|ok|as an ai|"
    r"thank you|thanks|i['’]d be happy|i['’]m happy|i can help)\b",
    re.I,
)


def first_sentence(text: str) -> str:
    """The text up to the first sentence end (``.``, ``!``, ``?`` followed by space or end) or line break."""
    m = re.search(r"[.!?](?:\s|$)|\n", text.strip())
    return text.strip()[: m.start() + 1] if m else text.strip()


def taste_short(text: str, item: CapabilityItem | None) -> bool:
    return 1 <= len(text.split()) <= 12


def taste_bullets(text: str, item: CapabilityItem | None) -> bool:
    return len(_BULLET.findall(text)) >= 2


def taste_formal(text: str, item: CapabilityItem | None) -> bool:
    return bool(text.strip()) and not (
        "!" in text or _EMOJI.search(text) or _CHATTER.search(text) or _SHORTENED.search(text)
    )


def taste_direct(text: str, item: CapabilityItem | None) -> bool:
    first = first_sentence(text)
    return bool(first) and not _FILLER.match(first) and (item is None or item.right(first))


TASTES = {"short": taste_short, "bullets": taste_bullets, "formal": taste_formal, "direct": taste_direct}
#: A taste's reply cap (tokens) where it is not the default 48: SmolLM2 opens a list with a sentence, and its
#: items run to 20-40 tokens, so at 48 tokens the second item of a list it starts almost never shows.
REPLY_TOKENS = {"bullets": 96}


def reply_tokens(taste: str, cap: int | None) -> int:
    """The reply cap of the rated and held-out chats of ``taste``: ``cap`` if given, else its own or 48."""
    return cap if cap is not None else REPLY_TOKENS.get(taste, 48)


def liked(taste: str, rater: str, text: str, item: CapabilityItem | None) -> bool:
    """The simulated rater: the taste; a ``careful`` one also dislikes a wrong answer to a factual prompt."""
    return TASTES[taste](text, item) and (rater == "naive" or item is None or item.right(text))


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of ``k`` successes in ``n`` (Wilson 1927), as shares."""
    if n == 0:
        return 0.0, 1.0
    p, d = k / n, 1 + z * z / n
    c, h = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def prompt_pools() -> tuple[list[tuple[str, CapabilityItem | None]], list[tuple[str, CapabilityItem | None]]]:
    """(train, held out) as ``(prompt, item or None)``; factual prompts also in a capability set are dropped."""

    def fold(s: str) -> str:
        return re.sub(r"[^a-z0-9 ]", "", s.lower()).strip()

    taken = {fold(i.prompt) for f in (GATE_FILE, BENCH_FILE) if f.exists() for i in load_items(f)}
    pools = []
    for everyday, facts in zip(EVERYDAY, FACTS):
        items = [
            (q, CapabilityItem(f"taste-{n}", "fact", q, {"kind": "contains", "accept": a}))
            for n, (q, a) in enumerate(facts)
            if fold(q) not in taken
        ]
        pools.append([(p, None) for p in everyday] + items)
    return pools[0], pools[1]


class TasteRun:
    """One taste × rater kind on a fresh loop: rounds of ratings, and the measurements at each checkpoint."""

    def __init__(self, args, taste: str, rater: str, items: list[CapabilityItem]):
        self.args, self.taste, self.rater, self.items = args, taste, rater, items
        self.max_tokens = reply_tokens(taste, args.max_tokens)
        self.train, self.held = prompt_pools()
        training = {"rehearsal_per_step": args.rehearsal, "kl_coef": args.kl_coef, "lora_targets": args.lora_targets}
        if args.rehearsal_weight is not None:
            training["rehearsal_weight"] = args.rehearsal_weight
        self.loop = Loop(args, 8, 8, rails=args.rails == "on", max_wait_s=3.0, **training)
        self.s = Session(args, self.loop, f"{taste}/{rater}")
        self.s.client.close()  # a loaded machine can queue a measurement's requests for more than 10 minutes
        self.s.client = httpx.Client(timeout=args.request_timeout)
        self.points: list[dict] = []
        self.served: set[str] = set()

    def ask(self, prompts: list[str], seeds: list[int], temperature: float, max_tokens: list[int]) -> list[dict]:
        s = self.s
        return list(
            s.pool.map(
                lambda a: chat(s.client, s.chat_url, a[0], max_tokens=a[2], temperature=temperature, seed=a[1]),
                zip(prompts, seeds, max_tokens),
            )
        )

    def measure(self, ratings: int) -> dict:
        t0 = time.perf_counter()
        args, held = self.args, self.held
        n = args.samples
        prompts = [p for p, _ in held for _ in range(n)]
        outs = self.ask(
            prompts, [7_000 + i for i in range(len(prompts))], args.temperature, [self.max_tokens] * len(prompts)
        )
        texts = [o["choices"][0]["message"]["content"] for o in outs]
        k = sum(liked(self.taste, self.rater, t, it) for t, (_, it) in zip(texts, [h for h in held for _ in range(n)]))
        caps = self.ask([i.prompt for i in self.items], [0] * len(self.items), 0.0, [i.max_tokens for i in self.items])
        right = sum(i.right(o["choices"][0]["message"]["content"]) for i, o in zip(self.items, caps))
        version = caps[0]["system_fingerprint"].removeprefix("livelora-")
        point = {
            "ratings": ratings,
            "version": version,
            "liked": k / len(texts),
            "liked_ci": wilson(k, len(texts)),
            "liked_n": len(texts),
            "capability": right / len(self.items),
            "capability_ci": wilson(right, len(self.items)),
            "capability_n": len(self.items),
            "median_words": sorted(len(t.split()) for t in texts)[len(texts) // 2],
            "example": texts[0][:80],
            "measure_s": time.perf_counter() - t0,
        }
        self.points.append(point)
        print(
            f"[{self.taste}/{self.rater}] ratings={ratings:4d} {version:18s} liked {point['liked']:6.1%} "
            f"capability {point['capability']:6.1%} ({right}/{len(self.items)}) words {point['median_words']} "
            f"measured in {point['measure_s']:.1f} s | {point['example']!r}",
            flush=True,
        )
        return point

    def run(self) -> dict:
        args, s = self.args, self.s
        t0 = time.perf_counter()
        try:
            self.measure(0)
            done = 0
            for target in sorted(args.ratings):
                while done < target:
                    picks = [s.rng.choice(self.train) for _ in range(8)]
                    seeds = [s.rng.randrange(1 << 30) for _ in picks]
                    outs = self.ask([p for p, _ in picks], seeds, args.temperature, [self.max_tokens] * 8)
                    rated = [
                        (o["id"], liked(self.taste, self.rater, o["choices"][0]["message"]["content"], it), "user")
                        for o, (_, it) in zip(outs, picks)
                    ]
                    s.round(rated)
                    done += len(rated)
                    if self.loop.served():
                        self.served.add(self.loop.served())
                self.measure(done)
        finally:
            s.close()
        ups = s.updates
        times = [u["update_s"] for u in ups if "update_s" in u]
        return {
            "taste": self.taste,
            "rater": self.rater,
            "settings": self.loop.hparams,
            "points": self.points,
            "trained": len(ups),
            "served": len(self.served),
            "rejected": sum(not u["passed"] for u in ups),
            "update_p50_s": percentile(times, 50) if times else None,
            "update_max_s": max(times) if times else None,
            "total_s": time.perf_counter() - t0,
        }


def table(results: list[dict]) -> str:
    """The results as a markdown table (one row per checkpoint; Δ capability vs the same run's 0-rating point)."""
    rows = [
        "| taste | rater | settings | ratings | liked (95 % CI) | capability (95 % CI) | Δ cap. | trained / served / "
        "rejected | update p50 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        h = r["settings"]
        label = (
            f"rails {'on' if h['rails'] else 'off'}, lr {h['kto_lr']:g}, β {h['beta']:g}, r {h['lora_rank']}"
            + (f", rehearsal {h['rehearsal_per_step']}" if h.get("rehearsal_per_step") else "")
            + (f" (CE weight {h['rehearsal_weight']:g})" if "rehearsal_weight" in h else "")
            + (f", KL {h['kl_coef']:g}" if h.get("kl_coef") else "")
            + (f", {h['lora_targets']}" if h.get("lora_targets", "all") != "all" else "")
        )
        base = r["points"][0]["capability"]
        for p in r["points"]:
            lo, hi = p["liked_ci"]
            clo, chi = p["capability_ci"]
            last = p is r["points"][-1]
            upd = f"{r['update_p50_s']:.1f} s" if last and r["update_p50_s"] is not None else ""
            counts = f"{r['trained']} / {r['served']} / {r['rejected']}" if last else ""
            rows.append(
                f"| {r['taste']} | {r['rater']} | {label} | {p['ratings']} | {p['liked']:.1%} ({lo:.0%}–{hi:.0%}) | "
                f"{p['capability']:.1%} ({clo:.0%}–{chi:.0%}) | {100 * (p['capability'] - base):+.1f} | {counts} | "
                f"{upd} |"
            )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tastes", default="short,bullets,formal,direct", help="comma-separated, of " + ",".join(TASTES))
    ap.add_argument("--raters", default="naive,careful", help="naive, careful or both")
    ap.add_argument("--ratings", default="40,80,160", help="checkpoints (ratings so far), rounds of 8")
    ap.add_argument("--rails", choices=("on", "off"), default="on", help="the evaluation gate (and governance) on/off")
    ap.add_argument("--rehearsal", type=int, default=None, help="rehearsal prompts per step (default: trainer's)")
    ap.add_argument("--rehearsal-weight", type=float, default=None, help="rehearsal CE weight (default: trainer's)")
    ap.add_argument("--kl-coef", type=float, default=None, help="KL(base || new) coefficient (default: trainer's)")
    ap.add_argument("--kto-lr", type=float, default=None, help="KTO learning rate (default: trainer's)")
    ap.add_argument("--beta", type=float, default=None, help="KTO beta (default: trainer's)")
    ap.add_argument("--lora-rank", type=int, default=None, help="LoRA rank (default: trainer's)")
    ap.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: trainer's)")
    ap.add_argument("--lora-targets", choices=("all", "attn", "mlp"), default=None, help="LoRA module groups")
    ap.add_argument("--capability-items", type=int, default=None, help="stratified subset of the bench set (all)")
    ap.add_argument("--samples", type=int, default=2, help="seeded samples per held-out prompt")
    ap.add_argument("--request-timeout", type=float, default=3600, help="seconds one HTTP request may take")
    ap.add_argument("--max-tokens", type=int, default=None, help="reply cap of rated and held-out chats (per taste)")
    ap.add_argument("--temperature", type=float, default=0.7, help="temperature of rated and held-out chats")
    ap.add_argument("--max-batch-size", type=int, default=16, help="engine decode batch")
    ap.add_argument("--rater-max-events", type=int, default=1000, help="per-rater hourly limit with rails on")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompt order and chat seeds")
    ap.add_argument("--keep-store", action="store_true", help="keep each run's temporary store")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()
    from livelora.trainer.settings import TrainingSection

    d = TrainingSection.model_fields
    for name in ("rehearsal", "kl_coef", "lora_targets"):
        field = "rehearsal_per_step" if name == "rehearsal" else name
        if getattr(args, name) is None:
            setattr(args, name, d[field].default)
    args.ratings = [int(x) for x in args.ratings.split(",")]
    items = stratified(load_items(BENCH_FILE))
    items = items[: args.capability_items] if args.capability_items else items
    print(f"{load_line()}; {len(items)} capability items; train/held-out prompts {[len(p) for p in prompt_pools()]}")
    results = []
    for taste in args.tastes.split(","):
        for rater in args.raters.split(","):
            results.append(TasteRun(args, taste, rater, items).run())
            if args.json:
                args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}))
    print(load_line())
    print(table(results))


if __name__ == "__main__":
    main()
