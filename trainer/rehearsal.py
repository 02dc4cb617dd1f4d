"""Updates that keep what the base model could do: rehearsal of the base model's own greedy replies to a pool of
prompts (:data:`POOLS`: capability-like questions, or general everyday prompts) and a KL toward the base model at
those replies' positions,
added to every live step's gradients (:class:`Rehearsal`, called by :meth:`OnlineTrainer.train`). Method and
measurements: docs/live-loop.md ("Learning a taste without forgetting").
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from livelora.clients.types.tinker import Datum
from livelora.core.atomic import atomic_write_bytes
from livelora.core.base_models import BaseModelRef, load_model
from livelora.trainer.settings import TrainingSection

log = logging.getLogger(__name__)

RAILS = Path(__file__).resolve().parent / "rails"
#: The pools (``TrainingSection.rehearsal_pool``): questions of the capability check's four kinds (facts,
#: arithmetic, checkable instructions, reading), disjoint from its items; or everyday open prompts.
POOLS = {"capability": RAILS / "rehearsal_capability.jsonl", "general": RAILS / "rehearsal_prompts.jsonl"}
POOL_FILE = POOLS["capability"]
#: Where the base model's replies to the pool are kept, under the store.
CACHE_DIR = Path("models") / "rehearsal-base"


def shipped_file(pool: Path) -> Path:
    """The built-in model's replies to ``pool``, shipped (``bench/make_rehearsal_base.py`` writes them), so a fresh
    store's first step does not generate them; used when the pool, base identity and token cap match."""
    return pool.with_suffix(".base.json")


SHIPPED_FILE = shipped_file(POOL_FILE)


def shipped_key(prompts: list[str], base_id: str, max_tokens: int) -> dict[str, Any]:
    """What :data:`SHIPPED_FILE` must match: the pool's sha256, the base identity and the reply token cap."""
    pool = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
    return {"pool_sha256": pool, "base_id": base_id, "max_tokens": max_tokens}


def load_prompts(path: Path = POOL_FILE) -> list[str]:
    """The pool's prompts, in file order (one JSON object with a ``prompt`` per line)."""
    return [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line.strip()]


def kl_base_new(base_logp_M_V: Tensor, new_logp_M_V: Tensor) -> Tensor:
    """Mean over M positions of KL(base ‖ new) = Σ_v p_base(v)·(log p_base(v) − log p_new(v)), in nats.

    Shapes: both (M, V) log-softmax rows. 0 when the two are equal; its gradient in ``new`` is the soft-label
    cross-entropy's, −Σ_v p_base(v)·∇log p_new(v) (distillation toward the base, mass-covering).
    """
    return (base_logp_M_V.exp() * (base_logp_M_V - new_logp_M_V)).sum(-1).mean()


def positions_logp(model: Any, ids_B: list[list[int]], sel_B: list[list[bool]], grad: bool) -> Tensor:
    """Log-softmax over the vocabulary at the selected positions of ``model`` (adapter as it is set) run on the
    right-padded rows ``ids_B``; ``sel_B[b][i]`` selects row b's position i (same length as its ids).

    Shapes: returns (M, V) float32, M = selected positions in row order; with autograd when ``grad``.
    """
    b_n, t_max = len(ids_B), max(len(r) for r in ids_B)
    ids = torch.full((b_n, t_max), model.pad_id, dtype=torch.long)
    mask = torch.zeros((b_n, t_max), dtype=torch.long)
    sel = torch.zeros((b_n, t_max), dtype=torch.bool)
    for b, (row, pick) in enumerate(zip(ids_B, sel_B)):
        ids[b, : len(row)] = torch.tensor(row)
        mask[b, : len(row)] = 1
        sel[b, : len(row)] = torch.tensor(pick, dtype=torch.bool)
    dev = model.device
    ids, mask, sel = ids.to(dev), mask.to(dev), sel.to(dev)
    causal_lm = model.peft_model.get_base_model()
    with torch.set_grad_enabled(grad):
        if model.logprobs.plain_head:  # decoder, then the unembedding at the selected positions only
            hidden = causal_lm.model(input_ids=ids, attention_mask=mask).last_hidden_state
            logits = causal_lm.get_output_embeddings()(hidden[sel])
        else:
            logits = causal_lm(input_ids=ids, attention_mask=mask).logits[sel]
        return torch.log_softmax(logits.float(), -1)


def trained_kl_gradients(model: Any, data: list[Datum], coef: float) -> dict[str, float]:
    """Backpropagate ``coef · KL(base ‖ new)``, the mean per token over the vocabulary at the positions the step's
    ``data`` train (``weights`` ≠ 0: the rated, preferred or demonstrated replies), into ``model``'s LoRA
    gradients; the base side runs with the adapter off. Zero, with a zero gradient, at a zero adapter.

    Returns: ``trained_kl:mean`` (nats/token, before ``coef``), ``trained_kl_tokens:sum`` (positions).
    """
    ids_B = [d.model_input.to_ints() for d in data]
    sel_B = [[w != 0 for w in d.loss_fn_inputs["weights"].tolist()] for d in data]
    new_M_V = positions_logp(model, ids_B, sel_B, grad=True)
    with model.peft_model.disable_adapter():
        base_M_V = positions_logp(model, ids_B, sel_B, grad=False)
    kl = kl_base_new(base_M_V, new_M_V)
    if kl.requires_grad:
        (coef * kl).backward()
    return {"trained_kl:mean": float(kl.detach()), "trained_kl_tokens:sum": float(new_M_V.shape[0])}


@dataclass(frozen=True)
class BaseReply:
    """A pool prompt under the chat template and the base model's greedy reply (ending with EOS if it stopped)."""

    prompt: str
    prompt_ids: list[int]
    reply_ids: list[int]


@torch.no_grad()
def greedy_replies(causal_lm: Any, tokenizer: Any, prompts: list[str], max_tokens: int) -> list[BaseReply]:
    """Greedy replies of ``causal_lm`` (no adapter) to ``prompts`` as user turns, ``max_tokens`` at most. Prompts
    of equal token length share a batch, so no row is padded (a padded batch can flip a near-tie argmax)."""
    eos = tokenizer.eos_token_id
    rendered = [
        list(
            tokenizer.encode(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
                ),
                add_special_tokens=False,
            )
        )
        for p in prompts
    ]
    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(rendered):
        by_len.setdefault(len(ids), []).append(i)
    dev = next(causal_lm.parameters()).device
    replies: list[list[int]] = [[] for _ in prompts]
    for n, rows in by_len.items():
        out = causal_lm.generate(
            input_ids=torch.tensor([rendered[i] for i in rows], device=dev),
            attention_mask=torch.ones((len(rows), n), dtype=torch.long, device=dev),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=eos,
            eos_token_id=eos,
        )
        for i, row in zip(rows, out[:, n:].tolist()):
            replies[i] = row[: row.index(eos) + 1] if eos in row else row
    return [BaseReply(p, ids, r) for p, ids, r in zip(prompts, rendered, replies) if r]


class Rehearsal:
    """The pool's base replies (cached per store and base model) and each step's rehearsal + KL gradients.

    Args:
        base_ref: the base model; ``base_id``: its identity (:func:`livelora.core.base_models.base_identity`).
        home: ``LIVELORA_HOME`` (the cache lives in ``models/rehearsal-base/``).
        examples: the trainer's :class:`~livelora.trainer.event_datums.EventDatums` (its ``tokenizer``).
        config: ``rehearsal_per_step``, ``rehearsal_weight``, ``rehearsal_max_tokens``, ``kl_coef``, ``device``.
        prompts: the pool (default: that of ``config.rehearsal_pool``, :data:`POOLS`).
    """

    def __init__(
        self,
        base_ref: BaseModelRef,
        home: Path,
        examples: Any,
        config: TrainingSection,
        base_id: str,
        prompts: list[str] | None = None,
    ):
        self.base_ref, self.home, self.examples, self.config, self.base_id = base_ref, home, examples, config, base_id
        self._thread: threading.Thread | None = None
        self.pool = POOLS[config.rehearsal_pool]
        self.prompts = prompts if prompts is not None else load_prompts(self.pool)
        self._replies: list[BaseReply] | None = None
        self._lock = threading.Lock()
        self._next = 0
        self.source, self.seconds = "", 0.0

    def cache_path(self) -> Path:
        """``<home>/models/rehearsal-base/<sha256(base)[:16]>-<sha256(pool, base, max_tokens, device)[:16]>.json``."""
        key = json.dumps([self.prompts, self.base_id, self.config.rehearsal_max_tokens, self.config.device])
        stem = hashlib.sha256(self.base_id.encode()).hexdigest()[:16]
        return self.home / CACHE_DIR / f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"

    def replies(self) -> list[BaseReply]:
        """The base replies: read from :meth:`cache_path`, else the shipped ones (:meth:`shipped`), else generated
        on a base model of its own (loaded for this, then dropped) and written there atomically. Thread-safe: a
        second caller waits."""
        with self._lock:
            if self._replies is not None:
                return self._replies
            path = self.cache_path()
            try:
                doc = json.loads(path.read_text())
                self._replies = [BaseReply(**r) for r in doc["replies"]]
                self.source, self.seconds = "cache", float(doc["seconds"])
                return self._replies
            except FileNotFoundError:
                pass
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("cached rehearsal replies %s unreadable (%s): generating again", path, exc)
            shipped = self.shipped()
            if shipped is not None:
                self._replies, self.source, self.seconds = shipped, "shipped", 0.0
                return shipped
            self._replies = self.generate()
            doc = {"replies": [r.__dict__ for r in self._replies], "seconds": self.seconds}
            try:
                atomic_write_bytes(path, json.dumps(doc).encode())
            except OSError as exc:
                log.warning("rehearsal replies not cached at %s: %s", path, exc)
            return self._replies

    def generate(self) -> list[BaseReply]:
        """The base model's greedy replies to the pool, on a base model loaded for this and then dropped."""
        t0 = time.perf_counter()
        base = load_model(self.base_ref, dtype=torch.float32, device=self.config.device)
        base.eval()
        replies = greedy_replies(base, self.examples.tokenizer, self.prompts, self.config.rehearsal_max_tokens)
        del base
        self.source, self.seconds = "generated", time.perf_counter() - t0
        log.info("rehearsal: base replies to %d pool prompts in %.1f s", len(replies), self.seconds)
        return replies

    def shipped(self, path: Path | None = None) -> list[BaseReply] | None:
        """The replies in ``path`` (default: the pool's :func:`shipped_file`) when its key is :func:`shipped_key` of
        this pool, base and token cap, else ``None`` (another base model, pool or cap; a missing or unreadable file)."""
        try:
            doc = json.loads((path or shipped_file(self.pool)).read_text())
            if doc["key"] != shipped_key(self.prompts, self.base_id, self.config.rehearsal_max_tokens):
                return None
            return [BaseReply(**r) for r in doc["replies"]]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def in_background(self) -> threading.Thread:
        """Start (once) a daemon thread that makes :meth:`replies` ready (a step waits for it through the lock)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._ready, name="livelora-rehearsal-base", daemon=True)
            self._thread.start()
        return self._thread

    def _ready(self) -> None:
        try:
            self.replies()
        except Exception:
            log.exception("rehearsal: the base replies at start-up failed (the first step tries again)")

    def pick(self, n: int) -> list[BaseReply]:
        """The next ``n`` base replies, rotating through the pool in file order."""
        pool = self.replies()
        out = [pool[(self._next + i) % len(pool)] for i in range(min(n, len(pool)))]
        self._next = (self._next + len(out)) % len(pool)
        return out

    def add_gradients(self, model: Any) -> dict[str, float]:
        """Backpropagate ``rehearsal_weight · CE + kl_coef · KL(base ‖ new)`` over the reply tokens of the next
        ``rehearsal_per_step`` pool prompts into ``model``'s LoRA gradients (they add to the step's batch before
        its one optimizer step). CE and KL are means per reply token; the base side runs with the adapter off.

        Returns: ``rehearsal_loss:mean`` (CE, nats/token), ``rehearsal_kl:mean`` (nats/token, with ``kl_coef``),
        ``rehearsal_tokens:sum`` (prompt + reply tokens run), ``rehearsal_prompts:sum``.
        """
        c = self.config
        items = self.pick(c.rehearsal_per_step)
        seqs = [r.prompt_ids + r.reply_ids for r in items]
        sel = [[len(r.prompt_ids) - 1 <= i for i in range(len(s) - 1)] for r, s in zip(items, seqs)]
        targets = [t for r in items for t in r.reply_ids]  # position i predicts token i + 1
        new_M_V = positions_logp(model, [s[:-1] for s in seqs], sel, grad=True)
        ce = -new_M_V.gather(1, torch.tensor(targets, device=model.device)[:, None]).mean()
        loss = c.rehearsal_weight * ce
        metrics = {
            "rehearsal_loss:mean": float(ce.detach()),
            "rehearsal_tokens:sum": float(sum(len(s) for s in seqs)),
            "rehearsal_prompts:sum": float(len(seqs)),
        }
        if c.kl_coef > 0:
            with model.peft_model.disable_adapter():
                base_M_V = positions_logp(model, [s[:-1] for s in seqs], sel, grad=False)
            kl = kl_base_new(base_M_V, new_M_V)
            loss = loss + c.kl_coef * kl
            metrics["rehearsal_kl:mean"] = float(kl.detach())
        if loss.requires_grad:
            loss.backward()
        return metrics
