"""distill: on-policy distillation: the student samples, the teacher scores, reverse KL is the advantage.

Teacher: a sampler checkpoint (``teacher_path``, ``tinker://.../sampler_weights/...``) or, for context
distillation, the base model prompted with ``teacher_system_prompt`` (the student sees the prompt without it,
and learns to behave as if it were there).

Each step: snapshot the student, sample ``group_size`` replies per prompt (temperature 1), score each reply
under the teacher (``compute_logprobs`` of the teacher's prompt + the reply), set the per-token advantage to
``−(q_t − lp^teacher_t)`` (negative sampled reverse KL; tinker-cookbook ``distillation/train_on_policy.py``)
and train ``importance_sampling`` on the sampled tokens.

Metric: held-out reverse KL, ``mean_t(q_t − lp^teacher_t)`` over tokens of one seeded student sample per
held-out prompt (nats per token; lower is better). Defaults (SmolLM2-135M, CPU; docs/recipes.md): 8 prompts
x 2 samples, max_tokens 48, lr 1e-4, rank 8.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any, Literal

from pydantic import Field, model_validator

from livelora.clients.recipes.advantages import reverse_kl_advantages
from livelora.clients.recipes.datasets import gsm8k, load_chat, read_jsonl
from livelora.clients.recipes.datums import batch_indices, rl_datum, split
from livelora.clients.recipes.loop import RLConfig, Run, Summary, sampled_batches, update_shift
from livelora.clients.recipes.renderers import ChatRenderer
from livelora.clients.recipes.sdk import Sdk, gather, tolist

CONCISE = "Answer in one short sentence."


class Config(RLConfig):
    data: str = Field(
        ...,
        description="Prompts: a GSM8K folder/hub name (dataset=gsm8k), a messages JSONL "
        "(the first user turn is the prompt) or a JSONL of {'prompt': str}.",
    )
    dataset: Literal["gsm8k", "messages", "prompts"] = Field("gsm8k", description="Prompt source format.")
    teacher_path: str | None = Field(None, description="Teacher sampler checkpoint (tinker://...).")
    teacher_system_prompt: str | None = Field(
        CONCISE, description="Context distillation: the teacher is the base model with this system prompt."
    )
    prompts_per_step: int = Field(8, ge=1, description="Prompts per step.")
    group_size: int = Field(2, ge=1, description="Student samples per prompt.")
    max_tokens: int = Field(48, ge=1, description="Reply token budget.")
    kl_coef: float = Field(1.0, gt=0, description="Scale of the reverse-KL advantage.")
    max_staleness: int = Field(0, ge=0, description="Sample up to N steps ahead while training.")
    eval_size: int = Field(32, ge=1, description="Held-out prompts.")
    learning_rate: float = Field(1e-4, gt=0, description="Adam learning rate.")
    steps: int = Field(20, ge=1, description="Optimizer steps.")

    @model_validator(mode="after")
    def _one_teacher(self) -> Config:
        if self.teacher_path is None and not self.teacher_system_prompt:
            raise ValueError("give teacher_path or teacher_system_prompt")
        return self


def _prompts(cfg: Config) -> tuple[list[str], list[str]]:
    if cfg.dataset == "gsm8k":
        held = [p.question for p in gsm8k(cfg.data, "test")][: cfg.eval_size]
        return [p.question for p in gsm8k(cfg.data, "train")], held
    if cfg.dataset == "messages":
        texts = [next(m["content"] for m in conv if m["role"] == "user") for conv in load_chat(cfg.data)]
    else:
        texts = [row["prompt"] for row in read_jsonl(cfg.data)]
    return split(texts, cfg.eval_size, cfg.seed)


def run(
    cfg: Config, *, sdk: Sdk | None = None, on_step: Callable[[int, dict[str, float]], None] | None = None
) -> Summary:
    """Train ``cfg.steps`` distillation steps (resuming from ``cfg.log_dir`` if it holds a checkpoint)."""
    r = Run(cfg, "distill", sdk=sdk, on_step=on_step)
    try:
        student_r = ChatRenderer(r.tokenizer)
        teacher_r = student_r if cfg.teacher_path else ChatRenderer(r.tokenizer, cfg.teacher_system_prompt)
        teacher = (
            r.service.create_sampling_client(model_path=cfg.teacher_path)
            if cfg.teacher_path
            else r.service.create_sampling_client(base_model=cfg.base_model)
        )
        train, held = _prompts(cfg)
        user = lambda text: [{"role": "user", "content": text}]  # noqa: E731

        def rollouts(sampler: Any, texts: list[str], n: int, seed: int) -> list[tuple[list[int], Any, list[float]]]:
            """(student prompt, sequence, teacher logprobs of its tokens) for n samples per prompt."""
            sp = [student_r.prompt_tokens(user(t)) for t in texts]
            params = lambda i: r.sdk.sampling_params(  # noqa: E731
                max_tokens=cfg.max_tokens, temperature=1.0, seed=seed + i
            )
            res = gather(
                [partial(sampler.sample, r.sdk.model_input(p), n, params(i)) for i, p in enumerate(sp)],
                max_in_flight=max(1, 24 // n),
            )
            seqs = [
                (p, teacher_r.prompt_tokens(user(t)), s)
                for p, t, x in zip(sp, texts, res)
                for s in x.sequences
                if s.tokens
            ]
            scores = gather(
                [partial(teacher.compute_logprobs, r.sdk.model_input(tp + list(s.tokens))) for _, tp, s in seqs]
            )
            return [(p, s, list(lp[len(tp) :])) for (p, tp, s), lp in zip(seqs, scores)]

        def evaluate(step: int) -> dict[str, float]:
            sampler = r.tc.save_weights_and_get_sampling_client()
            diffs = [q - t for _, s, lt in rollouts(sampler, held, 1, 7_777_777) for q, t in zip(s.logprobs, lt)]
            return {"eval/reverse_kl": sum(diffs) / max(len(diffs), 1)}

        def sample(step: int, sampler: Any) -> dict[str, Any]:
            t0 = time.monotonic()
            texts = [train[i] for i in batch_indices(len(train), cfg.prompts_per_step, step, cfg.seed)]
            return {
                "rollouts": rollouts(sampler, texts, cfg.group_size, cfg.seed * 100_003 + step * 1009),
                "sample_s": time.monotonic() - t0,
            }

        r.evaluate_before(evaluate)
        adam = r.sdk.adam(cfg.learning_rate)
        for step, batch, staleness in sampled_batches(r, sample, cfg.max_staleness):
            t0 = time.monotonic()
            data, kls, n_tok = [], [], 0
            for prompt, seq, teacher_lp in batch["rollouts"]:
                adv = reverse_kl_advantages(seq.logprobs, teacher_lp, cfg.kl_coef)
                data.append(rl_datum(r.sdk, prompt, seq.tokens, seq.logprobs, adv))
                kls += [-a / cfg.kl_coef for a in adv]
                n_tok += len(seq.tokens)
            fb = r.tc.forward_backward(data, "importance_sampling")
            opt = r.tc.optim_step(adam)
            out = fb.result()
            opt.result()
            metrics = {
                "train/reverse_kl": sum(kls) / max(len(kls), 1),
                "train/tokens": n_tok,
                "train/loss": out.metrics["loss:sum"] / max(n_tok, 1),
                "train/staleness": staleness,
                "time/sample_s": batch["sample_s"],
            }
            if cfg.check_update:
                trained = [tolist(o["logprobs"]) for o in out.loss_fn_outputs]
                metrics.update(update_shift(r.tc, data, "importance_sampling", trained))
            r.end_step(step, {**metrics, "time/train_s": time.monotonic() - t0}, evaluate)
        return r.finish(evaluate)
    except BaseException:
        r.abort()
        raise
