"""The gate's free-form capability check: greedy replies to the capability set, judged on content.

:class:`FreeformSuite` renders the gate's capability items (:mod:`livelora.trainer.capability`, stratified order)
with the chat template and its default system message, no forced lead, and generates greedy replies chunk by chunk
(:meth:`FreeformSuite.measure`); an item is right when :meth:`CapabilityItem.right` accepts its reply.
:func:`curtail` decides after each chunk whether the verdict on the whole sample is already clear (Bayesian
predictive curtailment of the fixed-sample test ``score(new) ≥ score(ref) − margin``). Why and how:
``docs/internals/rails.md``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from livelora.core.cpu_share import step_yield
from livelora.trainer.capability import CATEGORIES, GATE_FILE, CapabilityItem, load_items, stratified

#: Predictive probability of the other final verdict below which the sample stops early.
CLEAR = 0.10
#: Paired items measured before :func:`curtail` gives an early verdict (one default chunk).
MIN_ITEMS = 30
#: Free-form items lost, and items gained, against the current version kept in a gate result (each list).
CHANGED_EXAMPLES = 5


class FreeformSuite:
    """The gate's free-form items for one tokenizer.

    Args:
        tokenizer: the base model's tokenizer (chat template).
        items: default the gate set (:data:`~livelora.trainer.capability.GATE_FILE`), in stratified order.
        max_items: the sample size at most (a stratified prefix); ``chunk``: items per measuring step.
    """

    def __init__(
        self, tokenizer: Any, items: Sequence[CapabilityItem] | None = None, *, max_items: int = 120, chunk: int = 30
    ):
        self.tokenizer = tokenizer
        self.items = stratified(list(items) if items is not None else load_items(GATE_FILE))[: max(1, max_items)]
        self.chunk = max(1, chunk)
        self.prompts = [
            list(
                tokenizer.encode(
                    tokenizer.apply_chat_template(
                        [{"role": "user", "content": it.prompt}], add_generation_prompt=True, tokenize=False
                    ),
                    add_special_tokens=False,
                )
            )
            for it in self.items
        ]
        self.eos = tokenizer.eos_token_id
        #: ``on_token(tokens generated, most tokens)`` after each decoding step of :meth:`replies`, or None
        self.on_token: Any = None

    def __len__(self) -> int:
        return len(self.items)

    def fingerprint(self) -> str:
        """sha256 of what a measurement depends on besides the weights: prompt ids, checks, token budgets, chunks."""
        doc = {
            "prompts": self.prompts,
            "checks": [[it.id, it.check, it.max_tokens] for it in self.items],
            "chunk": self.chunk,
            "eos": self.eos,
        }
        return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def chunk_end(self, k: int) -> int:
        """Items measured after ``k`` chunks (``k`` ≥ 1)."""
        return min(len(self.items), k * self.chunk)

    @torch.no_grad()
    def replies(self, model: Any, lo: int, hi: int, *, adapter: bool = True) -> list[str]:
        """Greedy replies to items ``lo:hi`` in one left-padded batch (each cut at its item's ``max_tokens``);
        the batch is always one whole chunk, so a reply does not depend on which weights asked before."""
        peft = model.peft_model
        seqs = self.prompts[lo:hi]
        budget = [it.max_tokens for it in self.items[lo:hi]]
        b_n, t_max = len(seqs), max(len(s) for s in seqs)
        ids = torch.full((b_n, t_max), model.pad_id, dtype=torch.long)
        mask = torch.zeros((b_n, t_max), dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, t_max - len(s) :] = torch.tensor(s)
            mask[b, t_max - len(s) :] = 1
        with peft.disable_adapter() if not adapter else contextlib.nullcontext():
            out = peft.get_base_model().generate(
                input_ids=ids.to(model.device),
                attention_mask=mask.to(model.device),
                max_new_tokens=max(budget),
                do_sample=False,
                pad_token_id=model.pad_id,
                eos_token_id=self.eos,
                stopping_criteria=StoppingCriteriaList([_Budget(t_max, budget, self.on_token)]),
            )
        texts = []
        for row, n_max in zip(out[:, t_max:].tolist(), budget):
            row = row[:n_max]
            n = row.index(self.eos) if self.eos in row else len(row)
            texts.append(self.tokenizer.decode(row[:n], skip_special_tokens=True))
        return texts

    def measure(self, model: Any, right: dict[str, bool], upto: int, *, adapter: bool = True, texts: Any = None) -> int:
        """Judge the replies of every chunk below item ``upto`` whose items are not in ``right`` yet (item id →
        right); ``texts`` (a dict) receives the replies. Returns the number of items generated."""
        done = 0
        for lo in range(0, min(upto, len(self.items)), self.chunk):
            hi = min(lo + self.chunk, len(self.items))
            if all(it.id in right for it in self.items[lo:hi]):
                continue
            for it, text in zip(self.items[lo:hi], self.replies(model, lo, hi, adapter=adapter)):
                right[it.id] = it.right(text)
                if texts is not None:
                    texts[it.id] = text
            done += hi - lo
        return done

    def score(self, right: dict[str, bool], upto: int) -> float | None:
        """Share right of items ``:upto`` (None when any of them is unmeasured)."""
        ids = [it.id for it in self.items[:upto]]
        if not ids or any(i not in right for i in ids):
            return None
        return sum(right[i] for i in ids) / len(ids)

    def categories(self, new: dict[str, bool], refs: dict[str, dict[str, bool]], upto: int) -> dict[str, dict]:
        """Per category of items ``:upto``: ``n`` and the items right for ``new`` and each reference (name → map)."""
        out: dict[str, dict] = {}
        for it in self.items[:upto]:
            c = out.setdefault(it.category, {"n": 0, "new": 0, **{r: 0 for r in refs}})
            c["n"] += 1
            c["new"] += bool(new.get(it.id))
            for r, m in refs.items():
                c[r] += bool(m.get(it.id))
        return {k: out[k] for k in CATEGORIES if k in out} | {k: v for k, v in out.items() if k not in CATEGORIES}


class FreeformGate:
    """The free-form check of one candidate inside :meth:`EvaluationGate.judge`: measured chunk by chunk (the
    current version's replies too, where missing) until :func:`curtail` finds both comparisons clear.

    Args:
        suite: the gate's :class:`~livelora.trainer.gate_measure.ProbeSuite` (its ``freeform`` and ``run_pass``).
    """

    def __init__(self, suite: Any):
        self.suite = suite

    def judge(self, model: Any, new: Any, current: Any, base: Any, start: dict, t: Any, tell: Any) -> None:
        """Fill ``new`` (the stepped ``model``'s measurement) chunk by chunk until the verdicts against
        ``current`` (weights ``start``) and ``base`` under thresholds ``t`` are clear or the sample is exhausted;
        ``new.freeform_upto`` is the sample judged; ``tell(check)`` as each further chunk starts."""
        ff = self.suite.freeform
        for k in range(1, -(-len(ff) // ff.chunk) + 1):
            upto = ff.chunk_end(k)
            if k > 1:
                step_yield()
                tell(f"freeform ({upto} of {len(ff)} items)")
            self.suite.run_pass("freeform", model, new, upto=upto)
            self._current(model, current, start, upto)
            new.freeform_upto = upto
            ids = [it.id for it in ff.items[:upto]]
            got = [new.freeform[i] for i in ids]
            outcomes = [
                curtail(got, [ref.freeform[i] for i in ids], len(ff), margin)
                for ref, margin in ((current, t.freeform_margin), (base, t.freeform_base_margin))
            ]
            if "fail" in outcomes or outcomes == ["pass", "pass"]:
                return

    def _current(self, model: Any, current: Any, start: dict, upto: int) -> None:
        """The current version's replies below item ``upto`` where missing: its weights ``start`` are loaded for
        that and the candidate's put back."""
        ff = self.suite.freeform
        if all(it.id in current.freeform for it in ff.items[:upto]):
            return
        with torch.no_grad():
            candidate = {k: p.detach().clone() for k, p in model.lora_params.items()}
            for k, p in model.lora_params.items():
                p.copy_(start[k])
            try:
                self.suite.run_pass("freeform", model, current, upto=upto)
            finally:
                for k, p in model.lora_params.items():
                    p.copy_(candidate[k])

    def summary(self, new: Any, current: Any, base: Any) -> dict[str, Any]:
        """A judged candidate's free-form measures: scores on the sample, per-category counts, the counts of items
        lost and gained against the current version, and up to :data:`CHANGED_EXAMPLES` of each (``lost``: the current
        version answered right and the candidate did not; ``gained``: the other way round)."""
        ff, upto = self.suite.freeform, new.freeform_upto
        ids = [it.id for it in ff.items[:upto]]

        def changed(was_right: bool) -> list[dict[str, Any]]:
            return [
                {
                    "id": i,
                    "prompt": it.prompt,
                    "reply": new.freeform_texts.get(i, ""),
                    "was": current.freeform_texts.get(i),
                }
                for it, i in zip(ff.items[:upto], ids)
                if bool(current.freeform.get(i)) == was_right and bool(new.freeform.get(i)) != was_right
            ]

        lost, gained = changed(True), changed(False)
        return {
            "items": upto,
            "of": len(ff),
            "score": freeform_score(new, ids),
            "current": freeform_score(current, ids),
            "base": freeform_score(base, ids),
            "categories": ff.categories(new.freeform, {"current": current.freeform, "base": base.freeform}, upto),
            "lost": lost[:CHANGED_EXAMPLES],
            "gained": gained[:CHANGED_EXAMPLES],
            "lost_count": len(lost),
            "gained_count": len(gained),
        }


def freeform_score(m: Any, ids: Sequence[str]) -> float | None:
    """Share of the free-form items ``ids`` that measurement ``m`` answered right (None: no items, or one not
    measured)."""
    if not ids or any(i not in m.freeform for i in ids):
        return None
    return sum(m.freeform[i] for i in ids) / len(ids)


def curtail(
    new: Sequence[bool], ref: Sequence[bool], total: int, margin: float, *, min_items: int | None = None
) -> str:
    """Whether the fixed-sample verdict "``score(new) ≥ score(ref) − margin`` over ``total`` items" is already clear
    after the first ``len(new)`` paired items: ``"pass"``, ``"fail"`` or ``"continue"``.

    net = losses − gains (items ``ref`` got right and ``new`` wrong, minus the reverse); the verdict fails when the
    final net exceeds ``margin·total``. Before ``min_items`` (default :data:`MIN_ITEMS`) paired items the answer is
    ``"continue"``; after, the sample stops when the observed sample's own verdict and the final one agree with
    posterior predictive probability ≥ 1 − :data:`CLEAR` (:func:`final_fail_probability`: the rest's losses and
    gains drawn from a Dirichlet posterior of the paired outcome, not from the observed rates, so a few items
    cannot make the verdict look clear). Source: Bayesian predictive stochastic curtailment, Spiegelhalter,
    Freedman & Blackburn (1986), "Monitoring clinical trials: conditional or predictive power?".
    """
    n = len(new)
    net = _net(new, ref)
    if n >= total:
        return "pass" if net <= margin * n + 1e-9 else "fail"
    if n < (MIN_ITEMS if min_items is None else min_items):
        return "continue"
    losses = sum(bool(r) and not x for x, r in zip(new, ref))
    gains = sum(bool(x) and not r for x, r in zip(new, ref))
    p_fail = final_fail_probability(net, losses, gains, n, total, margin)
    here_passes = net <= margin * n + 1e-9
    if here_passes and p_fail < CLEAR:
        return "pass"
    if not here_passes and p_fail > 1 - CLEAR:
        return "fail"
    return "continue"


def final_fail_probability(net: int, losses: int, gains: int, n: int, total: int, margin: float) -> float:
    """P(final net > ``margin·total``) after ``n`` paired items with ``losses``, ``gains`` and net ``net``.

    Each remaining paired item is a loss, a gain or unchanged with probabilities (p_l, p_g, p_s) ~ Dirichlet(
    losses + ½, gains + ½, n − losses − gains + ½) (Jeffreys prior); the rest's counts are then Dirichlet-
    multinomial, summed exactly: the changed count c ~ BetaBinomial(rest, a_l + a_g, a_s) and, given c, the losses
    ~ BetaBinomial(c, a_l, a_g) (terms of c beyond a 1e-12 tail are left out).
    """
    rest = total - n
    limit = math.floor(margin * total + 1e-9)  # the integer final net fails above this
    a_l, a_g, a_s = losses + 0.5, gains + 0.5, n - losses - gains + 0.5
    p, mass = 0.0, 0.0
    for c in range(rest + 1):
        p_c = math.exp(_log_beta_binomial(c, rest, a_l + a_g, a_s))
        mass += p_c
        # final net = net + l − (c − l) > limit  ⇔  l > (limit − net + c) / 2
        lo = max(0, (limit - net + c) // 2 + 1)
        if lo <= c:
            p += p_c * sum(math.exp(_log_beta_binomial(k, c, a_l, a_g)) for k in range(lo, c + 1))
        if 1 - mass < 1e-12:
            break
    return min(1.0, max(0.0, p))


def _log_beta_binomial(k: int, m: int, a: float, b: float) -> float:
    """log P(K = k) for K ~ BetaBinomial(m, a, b)."""
    lg = math.lgamma
    return lg(m + 1) - lg(k + 1) - lg(m - k + 1) + lg(k + a) + lg(m - k + b) - lg(m + a + b) + lg(a + b) - lg(a) - lg(b)


def _net(new: Sequence[bool], ref: Sequence[bool]) -> int:
    return sum(int(r) - int(x) for x, r in zip(new, ref))


class _Budget(StoppingCriteria):
    """Per row: done once it generated its own token budget (the batch ends when every row is done or ended)."""

    def __init__(self, start: int, budget: list[int], on_token: Any = None):
        self.start, self.budget, self.on_token = start, torch.tensor(budget), on_token

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        n = input_ids.shape[1] - self.start
        if self.on_token is not None:
            self.on_token(n, int(self.budget.max()))
        return n >= self.budget.to(input_ids.device)
