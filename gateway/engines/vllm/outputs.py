"""vLLM ↔ engine types: :class:`~.base.SamplingParams` → vLLM's, and vLLM's streamed outputs → chunks.

Text: vLLM is asked for token ids only (``detokenize=False``); :class:`DeltaChunks` decodes them with the
same incremental detokenizer and stop-string matcher as the transformers engine, so both engines stream the
same text for the same tokens, never emit part of a stop string, and report stop tokens the same way (not
included in ``token_ids``/text; their logprob entry in ``stop_token``). vLLM is imported only inside
:func:`vllm_sampling_params`.
"""

from __future__ import annotations

from typing import Any

from livelora.clients.errors import InternalError, UnavailableError
from livelora.gateway.engines.base import GenerationChunk, SamplingParams, TokenLogprob
from livelora.gateway.engines.detokenize import IncrementalDetokenizer, StopStringMatcher


def vllm_sampling_params(p: SamplingParams) -> Any:
    """vLLM ``SamplingParams`` for one streamed generation (``n=1``, token deltas, no detokenization)."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VSamplingParams(
        n=1,
        max_tokens=p.max_tokens,
        temperature=float(p.temperature),
        top_p=float(p.top_p),
        top_k=int(p.top_k) if p.top_k > 0 else 0,
        seed=p.seed,
        # EOS / stop tokens are handled by vLLM; stop strings here (detokenize=False).
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=bool(p.ignore_eos),
        min_tokens=int(p.min_tokens),
        repetition_penalty=float(p.repetition_penalty),
        presence_penalty=float(p.presence_penalty),
        frequency_penalty=float(p.frequency_penalty),
        min_p=float(p.min_p),
        logprobs=(int(p.top_logprobs) if p.logprobs else None),
        detokenize=False,
        skip_special_tokens=True,
        output_kind=RequestOutputKind.DELTA,
    )


class DeltaChunks:
    """Turns the ``RequestOutput`` deltas of one vLLM request into :class:`GenerationChunk` s.

    Args:
        tokenizer: the served tokenizer.
        params: the request's parameters (stop strings and token ids, logprobs).
        lora: the ``LoRARequest`` the request was leased on (``None``: the base model); every output must name
            the same integer id.
    """

    def __init__(self, tokenizer, params: SamplingParams, lora: Any = None):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.stopper = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.params = params
        self.lora = lora

    def feed(self, out: Any) -> tuple[GenerationChunk | None, bool]:
        """``(chunk or None, last)`` for one output; ``last`` ends the stream (finished, or a stop string matched:
        the caller then aborts the vLLM request).

        Raises:
            InternalError: vLLM served another adapter than the leased one, or gave no logprob for a token.
            UnavailableError: vLLM aborted the request (engine shutting down).
        """
        params, lora = self.params, self.lora
        want_lp = params.logprobs
        comp = out.outputs[0]
        if (
            lora is not None and out.lora_request is not None and out.lora_request.lora_int_id != lora.lora_int_id
        ):  # the cheap end-to-end check
            raise InternalError(
                f"vLLM served adapter id {out.lora_request.lora_int_id} for a request leased on {lora.lora_int_id}"
            )
        toks = list(comp.token_ids)
        lps = comp.logprobs or []
        done = comp.finish_reason is not None
        stop_tok: int | None = None
        stop_lp: TokenLogprob | None = None
        if (
            done
            and comp.finish_reason == "stop"
            and toks
            and (comp.stop_reason is None or isinstance(comp.stop_reason, int))
        ):
            stop_tok = toks.pop()  # EOS or a stop token id: not part of the completion (its logprob apart)
            if want_lp:
                entry = lps[len(toks)] if len(toks) < len(lps) else None
                stop_lp = token_logprob(stop_tok, entry, params.top_logprobs)
        chunk_ids: list[int] = []
        chunk_lps: list[TokenLogprob] = []
        text = ""
        matched: str | None = None
        for i, tok in enumerate(toks):
            chunk_ids.append(tok)
            if want_lp:
                chunk_lps.append(token_logprob(tok, lps[i] if i < len(lps) else None, params.top_logprobs))
            piece, matched = self.stopper.feed(self.detok.push(tok))
            text += piece
            if matched is not None:
                break
        if matched is None and done:
            piece, matched = self.stopper.feed(self.detok.flush())
            text += piece
            if matched is None:
                text += self.stopper.flush()
        if matched is not None:
            return GenerationChunk(chunk_ids, text, chunk_lps if want_lp else None, "stop", matched), True
        if done:
            if comp.finish_reason == "length":
                reason, stop_reason = "length", None
            elif comp.finish_reason == "stop":
                reason = "stop"
                # vLLM folds the model's extra EOS ids into stop_token_ids; report a
                # token as the stop reason only if the caller asked for it.
                stop_reason = stop_tok if stop_tok in params.stop_token_ids else None
            else:  # "abort": vLLM aborted it (engine shutting down)
                raise UnavailableError(f"vLLM ended the request: {comp.finish_reason}")
            chunk = GenerationChunk(chunk_ids, text, chunk_lps if want_lp else None, reason, stop_reason, stop_lp)
            return chunk, True
        if chunk_ids or text:
            return GenerationChunk(chunk_ids, text, chunk_lps if want_lp else None), False
        return None, False


def token_logprob(tok: int, entry: dict | None, k: int) -> TokenLogprob:
    """A :class:`TokenLogprob` from one vLLM logprobs dict ``{token_id: Logprob(logprob, rank, ...)}``.

    The dict holds the sampled (or prompt) token plus the ``k`` most likely
    alternatives; ``top`` keeps those ``k``, ordered by vLLM's rank (1 = most likely).

    Raises:
        InternalError: vLLM returned no logprob for ``tok``.
    """
    if not entry or tok not in entry:
        raise InternalError(f"vLLM returned no logprob for token {tok}")
    top: list[tuple[int, float]] = []
    if k > 0:
        alts = sorted(
            ((t, v) for t, v in entry.items() if v.rank is not None and v.rank <= k), key=lambda tv: tv[1].rank
        )
        top = [(int(t), float(v.logprob)) for t, v in alts][:k]
    return TokenLogprob(int(tok), float(entry[tok].logprob), top)
