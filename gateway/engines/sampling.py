"""Batched next-token sampling with one random generator per sequence.

:func:`sample_batch` handles every running sequence at once as ``(B, V)`` tensor operations (logprobs, greedy
argmax, temperature, top-k, top-p); the only per-sequence work is one uniform draw from that sequence's own CPU
``torch.Generator``, so a sequence's tokens are independent of its batch companions and a seed gives the same
draws on any device. Sampling is inverse-CDF; the order is vLLM's: penalties (:class:`Penalties`, greedy rows too),
temperature, min-p, top-k, then top-p over the renormalised distribution. Logprobs are ``log_softmax`` of the raw
logits, before penalties (:mod:`.base`; vLLM's default ``raw_logprobs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: Temperatures below this are treated as greedy (argmax), never as an error.
GREEDY_EPS = 1e-5


@dataclass
class Penalties:
    """The penalties of one sequence, applied to its raw logits ``l`` (nats) before temperature, as vLLM does.

    Repetition (CTRL, Keskar et al. 2019, as in vLLM and transformers' ``RepetitionPenaltyLogitsProcessor``): for a
    token in the prompt or the output so far, ``l / r`` if ``l > 0`` else ``l * r``. Then OpenAI's frequency and
    presence penalties (platform.openai.com/docs/advanced-usage, "Frequency and presence penalties"), on output
    tokens only: ``l - c * frequency - (c > 0) * presence``, ``c`` the token's count in the output so far.
    """

    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    prompt: tuple[int, ...] = ()
    counts: dict[int, int] = field(default_factory=dict)  # output token id → times generated

    def __post_init__(self) -> None:
        self._seen = {*self.prompt, *self.counts}

    def record(self, token_id: int) -> None:
        """Count a generated token."""
        self.counts[token_id] = self.counts.get(token_id, 0) + 1
        self._seen.add(token_id)

    def apply(self, row: torch.Tensor) -> None:
        """Penalise one ``(V,)`` float logits row in place."""
        if self.repetition != 1.0:
            ids = torch.tensor(sorted(self._seen), dtype=torch.long, device=row.device)
            if len(ids):
                seen = row[ids]
                row[ids] = torch.where(seen > 0, seen / self.repetition, seen * self.repetition)
        if self.counts and (self.presence or self.frequency):
            ids = torch.tensor(list(self.counts), dtype=torch.long, device=row.device)
            c = torch.tensor(list(self.counts.values()), dtype=row.dtype, device=row.device)
            row[ids] -= c * self.frequency + self.presence


@dataclass
class RowSampling:
    """Sampling settings of one sequence (one row of the batch)."""

    temperature: float
    top_p: float
    top_k: int
    generator: torch.Generator | None  # CPU generator; None only for greedy rows
    top_logprobs: int = 0
    banned: tuple[int, ...] = ()  # token ids that cannot be sampled now (min_tokens); logprobs stay raw
    min_p: float = 0.0  # drop tokens whose probability (after temperature) is below min_p × the top one's
    penalties: Penalties | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


@dataclass
class StepSample:
    """Result of sampling one step for a batch of ``B`` rows.

    Attributes:
        token_ids: ``B`` sampled token ids.
        logprobs: ``B`` raw-model logprobs (nats) of the sampled tokens.
        top: per row, up to ``top_logprobs`` ``(token_id, logprob)`` pairs, most likely first.
    """

    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (or fresh OS entropy when ``None``)."""
    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed) % (2**64))
    return g


def sample_batch(logits: torch.Tensor, rows: list[RowSampling]) -> StepSample:
    """Sample one token per row.

    Args:
        logits: ``(B, V)`` next-token logits (any float dtype, any device).
        rows: ``B`` per-row settings.

    Returns:
        :class:`StepSample` with Python lists (one device sync per call).
    """
    logits = logits.float()
    bsz, _vocab = logits.shape
    logprobs_all = torch.log_softmax(logits, dim=-1)
    if any(r.banned or r.penalties for r in rows):
        logits = logits.clone()
        for i, r in enumerate(rows):
            if r.penalties:
                r.penalties.apply(logits[i])
            if r.banned:
                logits[i, list(r.banned)] = float("-inf")
    tokens = logits.argmax(dim=-1)
    # Rows with and without top-k/top-p take different (sorted / unsorted) inverse-CDF paths; the split
    # depends only on each row's own settings, so a seed's draws never depend on the batch companions.
    filtered = [i for i, r in enumerate(rows) if not r.greedy and _filters(r)]
    plain = [i for i, r in enumerate(rows) if not r.greedy and not _filters(r)]
    for group, use_filters in ((filtered, True), (plain, False)):
        if group:
            idx = torch.tensor(group, device=logits.device)
            picked = _sample_rows(logits.index_select(0, idx), [rows[i] for i in group], use_filters)
            tokens = tokens.index_copy(0, idx, picked)
    chosen_lp = logprobs_all.gather(1, tokens[:, None]).squeeze(1)
    k_max = max((r.top_logprobs for r in rows), default=0)
    top: list[list[tuple[int, float]]] = [[] for _ in range(bsz)]
    if k_max > 0:
        vals, ids = logprobs_all.topk(k_max, dim=-1)
        vals_l, ids_l = vals.tolist(), ids.tolist()
        for i, r in enumerate(rows):
            if r.top_logprobs:
                top[i] = list(zip(ids_l[i][: r.top_logprobs], vals_l[i][: r.top_logprobs]))
    return StepSample(tokens.tolist(), chosen_lp.tolist(), top)


def _filters(r: RowSampling) -> bool:
    return r.top_k > 0 or r.top_p < 1.0 or r.min_p > 0.0


def _sample_rows(logits: torch.Tensor, rows: list[RowSampling], use_filters: bool) -> torch.Tensor:
    """Inverse-CDF sampling of ``(b, V)`` logits; returns ``(b,)`` token ids."""
    vocab = logits.shape[1]
    dev = logits.device
    scaled = logits / torch.tensor([r.temperature for r in rows], device=dev)[:, None]
    u = torch.tensor([torch.rand((), generator=r.generator).item() for r in rows], device=dev)
    if not use_filters:
        cdf = torch.softmax(scaled, dim=-1).cumsum(dim=-1)
        return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=vocab - 1).squeeze(1)
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    min_ps = torch.tensor([r.min_p for r in rows], device=dev)
    probs = probs.masked_fill(probs < min_ps[:, None] * probs[:, :1], 0.0)  # vLLM's min_p: relative to the top
    ks = torch.tensor([r.top_k if r.top_k > 0 else vocab for r in rows], device=dev)
    probs = probs.masked_fill(torch.arange(vocab, device=dev)[None, :] >= ks[:, None], 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    top_ps = torch.tensor([r.top_p if r.top_p < 1.0 else 2.0 for r in rows], device=dev)
    probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_ps[:, None], 0.0)
    cdf = probs.cumsum(dim=-1)
    choice = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=vocab - 1)
    return sorted_ids.gather(1, choice).squeeze(1)


def prompt_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, top_k: int = 0
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Logprobs of ``token_ids[1:]`` under ``logits[:-1]`` (teacher forcing).

    Args:
        logits: ``(T, V)`` logits of one sequence.
        token_ids: ``(T,)`` the same sequence's tokens.
        top_k: alternatives per position.

    Returns:
        ``T - 1`` logprobs and ``T - 1`` lists of top alternatives (empty when ``top_k == 0``).
    """
    lp = torch.log_softmax(logits[:-1].float(), dim=-1)
    chosen = lp.gather(1, token_ids[1:, None].to(lp.device)).squeeze(1).tolist()
    if top_k <= 0:
        return chosen, [[] for _ in chosen]
    vals, ids = lp.topk(top_k, dim=-1)
    return chosen, [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
