"""The evaluation gate's measures of one set of weights, taken in the trainer right after a step.

:meth:`ProbeSuite.measure` → :class:`Measurement`: capability probes (``trainer/rails/probes.jsonl``, greedy next
token against accepted answers), drift (mean per-token KL of the new weights against the current version and the
base model over the probe replies), degeneracy of greedy replies to open prompts, and the held-out signal margin
(mean per-token logprob of desirable/chosen minus undesirable/rejected completions, nats); :func:`compare` lines
them up against the current version's. The measures come in three passes (:data:`PASSES`, cheapest first,
:meth:`ProbeSuite.run_pass`), so that a candidate can be judged after each. Thresholds and verdicts are in
:mod:`livelora.core.rails`; the measures and why they are taken in the trainer: ``docs/internals/rails.md``.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from livelora.core.chat_tokens import rated_completion_ids
from livelora.core.cpu_share import step_yield
from livelora.trainer.gate_freeform import freeform_score
from livelora.trainer.prompt_kv import PromptKV, cache_of, common_prefix

PROBES_FILE = Path(__file__).resolve().parent / "rails" / "probes.jsonl"
#: System message of the probe prompts (the template's default one is 3× longer, and every token costs CPU time).
PROBE_SYSTEM = "Answer briefly."
#: Open prompts whose greedy replies are checked for degeneracy.
OPEN_PROMPTS = (
    "Explain why the sky is blue.",
    "Give me a tip for staying healthy.",
    "Describe a cat in two sentences.",
    "What should I pack for a trip to the beach?",
)
_STOP = set(
    """a an the and or but if of to in on at by for with from as is are was were be been being it its this
that these those there here i you he she we they me my your our their what which who whom how why when where
answer question response reply sure okay ok yes no not do does did can could would should will just so very
about into than then also let me us""".split()
)
_WORD = re.compile(r"[A-Za-z0-9']+")


@dataclass(frozen=True)
class Probe:
    """One capability probe: ``accept`` are answers whose first letters the greedy next token must start."""

    id: str
    kind: str
    prompt: str
    lead: str
    accept: tuple[str, ...]
    case_sensitive: bool = False

    def right(self, token_text: str) -> bool:
        """Whether a decoded next token answers the probe (it is non-empty and begins an accepted answer)."""
        t = token_text.strip()
        if not t:
            return False
        if not self.case_sensitive:
            return any(a.lower().startswith(t.lower()) for a in self.accept)
        return any(a.startswith(t) for a in self.accept)


def load_probes(path: Path = PROBES_FILE) -> list[Probe]:
    """The probe set (JSONL: ``id, kind, prompt, lead, accept[, case_sensitive]``)."""
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            out.append(
                Probe(
                    d["id"],
                    d["kind"],
                    d["prompt"],
                    d.get("lead", ""),
                    tuple(d["accept"]),
                    bool(d.get("case_sensitive", False)),
                )
            )
    return out


def reply_degenerate(text: str, n_tokens: int) -> bool:
    """Empty, content-free (< 2 words outside :data:`_STOP`) or repetitive (≥ 6 words and fewer than half of
    the word bigrams distinct)."""
    words = [w.lower() for w in _WORD.findall(text)]
    if len([w for w in words if w not in _STOP]) < 2:
        return True
    bigrams = list(itertools.pairwise(words))
    return len(words) >= 6 and len(set(bigrams)) < 0.5 * len(bigrams)


#: The gate's measuring passes, cheapest first (docs/rails.md: measured seconds), each with the checks its measures
#: decide. A candidate is judged after every pass and measured no further once a check failed.
PASSES: dict[str, tuple[str, ...]] = {
    "probes": ("probes", "probes_base", "kl_current", "kl_base"),
    "signal": ("signal",),
    "replies": ("degenerate", "length_ratio"),
    "freeform": ("freeform", "freeform_base"),
}
CHECKS: tuple[str, ...] = tuple(c for checks in PASSES.values() for c in checks)


@dataclass
class Measurement:
    """The gate's measures of one set of weights (``None``: that pass was not run).

    Attributes:
        probe_right: per probe, whether it was answered right.
        logp_M_V: log-softmax over the vocabulary at the M reply positions of the probes (float32, CPU).
        degenerate: share of degenerate open-prompt replies; ``mean_len``: their mean length in tokens.
        replies: the open-prompt replies (text), for the record.
        signal: held-out example key → mean per-token logprob of its completion (nats).
        freeform: capability item id → whether the greedy free-form reply was right (:mod:`.gate_freeform`);
            ``freeform_texts`` the replies; ``freeform_upto`` how many of the suite's items the last judgement used.
    """

    probe_right: list[bool] | None = None
    logp_M_V: torch.Tensor | None = None
    degenerate: float | None = None
    mean_len: float | None = None
    replies: list[str] | None = None
    signal: dict[str, float] = field(default_factory=dict)
    freeform: dict[str, bool] = field(default_factory=dict)
    freeform_texts: dict[str, str] = field(default_factory=dict)
    freeform_upto: int = 0

    @property
    def accuracy(self) -> float | None:
        """Fraction of probes answered right (None: not measured)."""
        if self.probe_right is None:
            return None
        return sum(self.probe_right) / max(1, len(self.probe_right))


def kl_mean(p_logp_M_V: torch.Tensor, q_logp_M_V: torch.Tensor) -> float:
    """Mean over positions of KL(p ‖ q) = Σ_v p(v)·(log p(v) − log q(v)) (nats per token)."""
    return float((p_logp_M_V.exp() * (p_logp_M_V - q_logp_M_V)).sum(-1).mean())


@dataclass
class HeldOut:
    """One held-out scored completion: ``sign`` +1 for desirable/chosen, −1 for undesirable/rejected; ``rater``
    who labelled it (:func:`~livelora.core.governance.rater_of`)."""

    key: str
    prompt: list[int]
    completion: list[int]
    sign: int
    rater: str = ""


def heldout_items(ev: Any, tokenizer: Any, chat_pair: Any) -> list[HeldOut]:
    """The scored completions of a held-out rating (one) or preference pair (two)."""
    from livelora.core.governance import rater_of

    rater = rater_of(ev)
    if ev.type == "rating":
        return [
            HeldOut(
                ev.id,
                list(ev.prompt_token_ids),
                rated_completion_ids(tokenizer, ev.completion_token_ids, ev.finish_reason),
                1 if ev.rating else -1,
                rater,
            )
        ]
    if ev.type != "preference":
        return []
    if ev.prompt_token_ids is not None:
        prompt, chosen, rejected = ev.prompt_token_ids, ev.chosen_token_ids, ev.rejected_token_ids
    else:
        prompt, chosen = chat_pair(ev.messages, ev.chosen)
        _, rejected = chat_pair(ev.messages, ev.rejected)
    return [
        HeldOut(f"{ev.id}:c", list(prompt), list(chosen or []), 1, rater),
        HeldOut(f"{ev.id}:r", list(prompt), list(rejected or []), -1, rater),
    ]


def signal_margin(scores: dict[str, float], items: Sequence[HeldOut], min_examples: int) -> float | None:
    """mean score(+) − mean score(−) over ``items`` scored in ``scores``; None with fewer than ``min_examples``
    items or a class missing."""
    pos = [scores[i.key] for i in items if i.sign > 0 and i.key in scores]
    neg = [scores[i.key] for i in items if i.sign < 0 and i.key in scores]
    if len(pos) + len(neg) < min_examples or not pos or not neg:
        return None
    return sum(pos) / len(pos) - sum(neg) / len(neg)


def signal_countable(items: Sequence[HeldOut], min_examples: int) -> bool:
    """Whether :func:`signal_margin` can count on ``items`` (enough scorable examples, both classes): if not, the
    gate skips scoring them."""
    signs = [i.sign for i in items if i.prompt and i.completion]
    return len(signs) >= min_examples and 1 in signs and -1 in signs


class ProbeSuite:
    """Tokenized probes and open prompts for one tokenizer; :meth:`measure` runs them on a TrainingModel.

    Args:
        tokenizer: the base model's tokenizer (chat template).
        probes: default :func:`load_probes`.
        gen_tokens: greedy tokens generated per open prompt.
    """

    def __init__(
        self,
        tokenizer: Any,
        probes: list[Probe] | None = None,
        *,
        gen_tokens: int = 24,
        freeform_items: int = 0,
        freeform_chunk: int = 30,
    ):
        from livelora.trainer.gate_freeform import FreeformSuite

        self.tokenizer = tokenizer
        #: the free-form capability check (None: ``freeform_items`` 0, the pass is not run)
        self.freeform = (
            FreeformSuite(tokenizer, max_items=freeform_items, chunk=freeform_chunk) if freeform_items > 0 else None
        )
        self.probes = probes if probes is not None else load_probes()
        self.gen_tokens = gen_tokens
        self.seqs: list[list[int]] = []
        self.reply_start: list[int] = []
        for p in self.probes:
            prompt = self._render(p.prompt)
            lead = tokenizer.encode(p.lead, add_special_tokens=False) if p.lead else []
            self.seqs.append(prompt + lead)
            self.reply_start.append(len(prompt))
        self.open_ids = [self._render(q) for q in OPEN_PROMPTS]
        self.eos = tokenizer.eos_token_id
        #: leading tokens every probe shares (the template and system message): run once per measurement
        self.shared = min(common_prefix(self.seqs, minimum=1), min(self.reply_start) - 1)

    def fingerprint(self) -> str:
        """sha256 of everything a measurement depends on besides the weights: the probes' token ids, reply
        positions and accepted answers, the open prompts, ``gen_tokens`` and the end-of-sequence id."""
        doc = {
            "seqs": self.seqs,
            "reply_start": self.reply_start,
            "accept": [[p.accept, p.case_sensitive] for p in self.probes],
            "open": self.open_ids,
            "gen_tokens": self.gen_tokens,
            "eos": self.eos,
            "freeform": self.freeform.fingerprint() if self.freeform is not None else None,
        }
        return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()

    def _render(self, question: str) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            [{"role": "system", "content": PROBE_SYSTEM}, {"role": "user", "content": question}],
            add_generation_prompt=True,
            tokenize=False,
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @torch.no_grad()
    def probe_logprobs(self, model: Any, *, adapter: bool = True) -> tuple[list[bool], torch.Tensor]:
        """``(right per probe, log-softmax (M, V) at the reply positions)``: the shared prefix (:attr:`shared`
        tokens) in one pass, then every probe's rest continuing from its keys/values."""
        peft = model.peft_model
        causal_lm = peft.get_base_model()
        c, dev = self.shared, model.device
        rest = [s[c:] for s in self.seqs]
        b_n, t_max = len(rest), max(len(s) for s in rest)
        ids = torch.full((b_n, t_max), model.pad_id, dtype=torch.long)
        sel = torch.zeros((b_n, t_max), dtype=torch.bool)
        for b, s in enumerate(rest):
            ids[b, : len(s)] = torch.tensor(s)
            sel[b, self.reply_start[b] - 1 - c : len(s)] = True
        ctx = peft.disable_adapter() if not adapter else contextlib.nullcontext()
        decoder = causal_lm.model if model.logprobs.plain_head else causal_lm
        with ctx:
            if c:
                prefix = decoder(input_ids=torch.tensor([self.seqs[0][:c]], device=dev), use_cache=True)
                kw = (
                    PromptKV.capture(cache_of(prefix), [c])
                    .expand(b_n)
                    .continuation([len(s) for s in rest], dev, causal_lm.config)
                )
            else:  # no shared prefix: one pass, right padding masked
                kw = {
                    "attention_mask": (torch.arange(t_max)[None, :] < torch.tensor([len(s) for s in rest])[:, None])
                    .long()
                    .to(dev)
                }
            out = decoder(input_ids=ids.to(dev), **kw)
            if model.logprobs.plain_head:  # decoder, then the unembedding at the selected positions only
                logits_M_V = causal_lm.get_output_embeddings()(out.last_hidden_state[sel.to(dev)]).float()
            else:
                logits_M_V = out.logits[sel.to(dev)].float()
        logp_M_V = torch.log_softmax(logits_M_V, -1).cpu()
        last_rows = torch.cumsum(sel.sum(1), 0) - 1  # the last selected row of each probe = its answer position
        right = [
            p.right(self.tokenizer.decode([int(logp_M_V[r].argmax())])) for p, r in zip(self.probes, last_rows.tolist())
        ]
        return right, logp_M_V

    @torch.no_grad()
    def generate(self, model: Any, *, adapter: bool = True) -> tuple[list[str], list[int]]:
        """Greedy replies to :data:`OPEN_PROMPTS` (``gen_tokens`` at most): ``(texts, token counts)``."""
        peft = model.peft_model
        b_n, t_max = len(self.open_ids), max(len(s) for s in self.open_ids)
        ids = torch.full((b_n, t_max), model.pad_id, dtype=torch.long)
        mask = torch.zeros((b_n, t_max), dtype=torch.long)
        for b, s in enumerate(self.open_ids):  # left padding for generation
            ids[b, t_max - len(s) :] = torch.tensor(s)
            mask[b, t_max - len(s) :] = 1
        ctx = peft.disable_adapter() if not adapter else contextlib.nullcontext()
        with ctx:
            out = peft.get_base_model().generate(
                input_ids=ids.to(model.device),
                attention_mask=mask.to(model.device),
                max_new_tokens=self.gen_tokens,
                do_sample=False,
                pad_token_id=model.pad_id,
                eos_token_id=self.eos,
            )
        texts, lens = [], []
        for row in out[:, t_max:].tolist():
            n = row.index(self.eos) if self.eos in row else len(row)
            texts.append(self.tokenizer.decode(row[:n], skip_special_tokens=True))
            lens.append(n)
        return texts, lens

    @torch.no_grad()
    def score(self, model: Any, items: Sequence[HeldOut], *, adapter: bool = True) -> dict[str, float]:
        """Mean per-token logprob (nats) of each item's completion given its prompt."""
        items = [i for i in items if i.prompt and i.completion]
        if not items:
            return {}
        inputs, targets, keep = [], [], []
        for i in items:
            toks = i.prompt + i.completion
            inputs.append(toks[:-1])
            targets.append(torch.tensor(toks[1:], dtype=torch.long))
            k = torch.zeros(len(toks) - 1, dtype=torch.bool)
            k[len(i.prompt) - 1 :] = True
            keep.append(k)
        lps = model.logprobs(inputs, targets, adapter=adapter, keep_pos=keep)
        return {i.key: float(lp[k].mean()) for i, lp, k in zip(items, lps, keep)}

    def run_pass(
        self,
        name: str,
        model: Any,
        m: Measurement,
        *,
        adapter: bool = True,
        heldout: Sequence[HeldOut] = (),
        upto: int | None = None,
        mirror: bool = True,
    ) -> None:
        """Run the measuring pass ``name`` (a key of :data:`PASSES`) on ``model`` and fill its fields of ``m``.
        ``freeform`` judges the replies to the free-form items below ``upto`` not yet in ``m`` (default: the first
        chunk). A model whose base weights are sharded over a trainer group runs it on every rank (each forward is a
        collective): rank 0's group leader broadcasts the pass (``mirror``) and the other ranks make it too.

        Raises:
            RuntimeError: a sharded model without a group leader (the other ranks would not join its passes).
        """
        group = getattr(model, "group", None)
        if mirror and getattr(group, "shard_base", False):
            leader = getattr(group, "leader_of_group", None)
            if leader is None:
                raise RuntimeError("a model with sharded base weights is measured only by its group's leader")
            kwargs = {"adapter": adapter, "heldout": heldout, "upto": upto}
            with leader.call(model, f"gate {name}", (self, name, m), kwargs, fn=_pass_on_replica):
                return self.run_pass(name, model, m, **kwargs, mirror=False)
        if name == "probes":
            m.probe_right, m.logp_M_V = self.probe_logprobs(model, adapter=adapter)
        elif name == "signal":
            m.signal.update(self.score(model, heldout, adapter=adapter))
        elif name == "replies":
            texts, lens = self.generate(model, adapter=adapter)
            m.degenerate = sum(reply_degenerate(t, n) for t, n in zip(texts, lens)) / max(1, len(texts))
            m.mean_len, m.replies = sum(lens) / max(1, len(lens)), texts
        elif name == "freeform":
            if self.freeform is not None:
                end = upto if upto is not None else self.freeform.chunk_end(1)
                self.freeform.measure(model, m.freeform, end, adapter=adapter, texts=m.freeform_texts)
        else:
            raise ValueError(f"unknown gate pass {name!r}")

    def measure(
        self,
        model: Any,
        *,
        adapter: bool = True,
        heldout: Sequence[HeldOut] = (),
        on_check: Any = None,
        freeform_upto: int | None = None,
    ) -> Measurement:
        """Every measure of ``model`` (adapter on, or the base model with ``adapter=False``), pass by pass in the
        order of :data:`PASSES` (``signal`` only with ``heldout`` items; free-form items below ``freeform_upto``,
        default the first chunk); ``on_check(name)`` as each starts."""
        tell = on_check or (lambda name: None)
        m = Measurement()
        for i, name in enumerate(
            p for p in PASSES if (p != "signal" or heldout) and (p != "freeform" or self.freeform)
        ):
            if i:
                step_yield()  # serving may go first between the gate's passes (core/cpu_share.py)
            tell(name)
            self.run_pass(name, model, m, adapter=adapter, heldout=heldout, upto=freeform_upto)
        return m


def _pass_on_replica(model: Any, suite: ProbeSuite, name: str, m: Measurement, **kwargs: Any) -> None:
    """A rank other than 0: make the pass rank 0 broadcast (:meth:`ProbeSuite.run_pass`) on its replica."""
    suite.run_pass(name, model, m, **kwargs, mirror=False)


def compare(
    new: Measurement,
    current: Measurement,
    base: Measurement,
    items: Sequence[HeldOut],
    min_signal_examples: int,
    only: Collection[str] | None = None,
    freeform_ids: Sequence[str] = (),
) -> dict[str, dict[str, float | None]]:
    """The check values :func:`livelora.core.rails.judge` takes, from three measurements.

    ``new``, ``current`` and ``base``: the stepped weights, the version they would replace, the base model
    (adapter off); ``only``: the checks to compute (default every one; ``new`` must hold their passes'
    measures). ``probes`` compares the probe accuracy with the current version's, ``probes_base`` (same
    value and current) with the base model's (``base``); ``freeform`` and ``freeform_base`` the share of the
    free-form items ``freeform_ids`` answered right with the current version's and the base model's on the same items.
    """
    want = set(CHECKS if only is None else only)
    out: dict[str, dict[str, float | None]] = {}
    if want & set(PASSES["probes"]):
        out["probes"] = {"value": new.accuracy, "current": current.accuracy}
        out["probes_base"] = {"value": new.accuracy, "current": current.accuracy, "base": base.accuracy}
        out["kl_current"] = {"value": kl_mean(new.logp_M_V, current.logp_M_V), "current": None}
        out["kl_base"] = {
            "value": kl_mean(new.logp_M_V, base.logp_M_V),
            "current": kl_mean(current.logp_M_V, base.logp_M_V),
        }
    if want & set(PASSES["replies"]):
        out["degenerate"] = {"value": new.degenerate, "current": current.degenerate}
        out["length_ratio"] = {"value": new.mean_len / max(current.mean_len, 1e-9), "current": 1.0}
    if want & set(PASSES["freeform"]):
        score = lambda m: freeform_score(m, freeform_ids)  # noqa: E731
        out["freeform"] = {"value": score(new), "current": score(current)}
        out["freeform_base"] = {"value": score(new), "current": score(current), "base": score(base)}
    if "signal" in want:
        out["signal"] = {
            "value": signal_margin(new.signal, items, min_signal_examples),
            "current": signal_margin(current.signal, items, min_signal_examples),
        }
    return {k: v for k, v in out.items() if k in want}
