"""code-rl: reinforcement learning on programming tasks graded in a sandbox, two turns with a ``check_solution`` tool.

Each step: ``tasks_per_step`` tasks (the generated easy set, HumanEval, or both) x ``group_size`` episodes. An
episode: the model replies; when it calls ``check_solution`` (``--tool-call auto``: it writes the word after a
code block; ``always``: every first reply with a code block is checked) the public tests run on its last code
block, their result comes back as the next user turn, and the model replies again. Reward: 1 when the final code
block passes every hidden test, 0 otherwise, −0.1 without a code block. Advantages are group-relative; both
assistant turns train with the sampler's logprobs (``cispo``), tool turns masked; the gradient is accumulated
over ``minibatches`` ``forward_backward`` calls. With ``max_staleness`` > 0 a sampler thread runs ahead and
batches more than ``max_staleness`` steps old are dropped (:mod:`livelora.clients.recipes.async_rl`).

Programs run in the local bubblewrap sandbox (:mod:`livelora.clients.sandbox`) or, with ``--sandbox-url``, on a
SandboxFusion server (``livelora sandbox``). Evaluation: greedy pass rate (and, with ``eval_samples``, sampled)
on the easy held-out split and on HumanEval held-out tasks. docs/code-rl.md has the details.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Literal

from pydantic import Field

from livelora.clients.recipes.advantages import Estimator, group_advantages
from livelora.clients.recipes.async_rl import AsyncSampler, Batch, forward_backward_minibatches
from livelora.clients.recipes.code_tasks import (
    CodeTask,
    easy_tasks,
    extract_code,
    grading_program,
    humaneval_tasks,
    public_check_program,
    train_heldout,
)
from livelora.clients.recipes.datums import batch_indices
from livelora.clients.recipes.loop import RLConfig, Run, Summary, sampler_kl, update_shift
from livelora.clients.recipes.renderers import ChatRenderer
from livelora.clients.recipes.sdk import Sdk, gather, tolist

SYSTEM = (
    "You write Python functions. Put your code in a ```python code block. To run the public tests on your code, "
    "write check_solution after the code block; you will see the results and can reply once more."
)
EVAL_SEED = 7_919  # sampled evaluation: the same draws before and after training


class Config(RLConfig):
    dataset: Literal["easy", "humaneval", "mixed"] = Field("easy", description="Training tasks.")
    humaneval: str | None = Field(None, description="HumanEval folder or .jsonl (needed by humaneval/mixed/eval).")
    easy_held_out: int = Field(40, ge=1, description="Easy tasks held out (the rest train).")
    humaneval_held_out: int = Field(40, ge=1, description="HumanEval tasks held out.")
    eval_size: int = Field(40, ge=0, description="Held-out easy tasks evaluated (0: none).")
    eval_samples: int = Field(
        0, ge=0, description="Also N episodes per held-out task at --temperature (eval/*_pass_sampled); 0: greedy only."
    )
    humaneval_eval_size: int | None = Field(
        None, ge=0, description="Held-out HumanEval tasks evaluated (default 20 with --humaneval, else 0)."
    )
    tasks_per_step: int = Field(8, ge=1, description="Tasks (groups) per step.")
    group_size: int = Field(4, ge=2, description="Episodes per task.")
    max_tokens: int = Field(160, ge=8, description="Token budget of each assistant turn.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the rollouts.")
    tool_call: Literal["auto", "always", "never"] = Field("auto", description="When check_solution runs.")
    loss: Literal["importance_sampling", "ppo", "cispo"] = Field("cispo", description="RL loss.")
    advantage: Estimator = Field("mean", description="mean (Dr. GRPO), mean_std (GRPO) or loo (RLOO).")
    no_code_penalty: float = Field(
        0.1, ge=0, description="Amount subtracted from the reward of an episode with no code block (0: none)."
    )
    minibatches: int = Field(2, ge=1, description="forward_backward calls per optimizer step.")
    max_staleness: int = Field(0, ge=0, description="Sample ahead, dropping batches older than N steps (0: sync).")
    sandbox_url: str | None = Field(None, description="SandboxFusion /run_code URL (default: local sandbox).")
    test_timeout_s: float = Field(6.0, gt=0, description="Wall seconds per test program.")
    learning_rate: float = Field(5e-4, gt=0, description="Adam learning rate.")
    steps: int = Field(20, ge=1, description="Optimizer steps.")


class Grader:
    """Runs test programs on the local sandbox or a SandboxFusion URL; ``(exit 0, output, sandbox seconds)``."""

    def __init__(self, url: str | None, timeout_s: float):
        self.timeout_s, self.fusion = timeout_s, None
        if url:
            from livelora.clients.sandbox.fusion import FusionClient

            self.fusion = FusionClient(url)
        else:
            from livelora.clients.sandbox import Limits, Sandbox

            self.sandbox = Sandbox(Limits(wall_s=timeout_s, cpu_s=timeout_s, max_output_bytes=20_000))

    def run(self, program: str) -> tuple[bool, str, float]:
        t0 = time.monotonic()
        if self.fusion is None:
            r = self.sandbox.run(program)
            return r.ok, (r.stdout + r.stderr)[-600:], time.monotonic() - t0
        w = self.fusion.run(program, run_timeout=self.timeout_s)
        rr = w.run_result
        out = ((rr.stdout or "") + (rr.stderr or "")) if rr else w.message
        return w.status == "Success", out[-600:], time.monotonic() - t0


def reward(code: str | None, passed: bool, no_code_penalty: float = 0.1) -> float:
    """1 when every hidden test passed, else 0; ``−no_code_penalty`` when the episode had no code block."""
    return float(passed) - (no_code_penalty if code is None else 0.0)


def task_splits(cfg: Config) -> tuple[list[CodeTask], list[CodeTask], list[CodeTask]]:
    """(training tasks, held-out easy tasks evaluated, held-out HumanEval tasks evaluated)."""
    easy_train, easy_held = train_heldout(easy_tasks(0), cfg.easy_held_out, 0)
    he_train: list[CodeTask] = []
    he_held: list[CodeTask] = []
    he_eval = cfg.humaneval_eval_size if cfg.humaneval_eval_size is not None else (20 if cfg.humaneval else 0)
    if cfg.dataset != "easy" or he_eval:
        if cfg.humaneval is None:
            raise ValueError("--humaneval is needed for --dataset humaneval/mixed and --humaneval-eval-size > 0")
        he_train, he_held = train_heldout(humaneval_tasks(cfg.humaneval), cfg.humaneval_held_out, 0)
    train = {"easy": easy_train, "humaneval": he_train, "mixed": easy_train + he_train}[cfg.dataset]
    return train, easy_held[: cfg.eval_size], he_held[:he_eval]


class Episodes:
    """Two-turn episodes of a sampler: token layout, tool turn, reward."""

    def __init__(self, cfg: Config, sdk: Sdk, renderer: ChatRenderer, grader: Grader):
        self.cfg, self.sdk, self.renderer, self.grader = cfg, sdk, renderer, grader
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="code-rl-grader")

    def messages(self, task: CodeTask) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.statement}]

    def _continuation(self, msgs: list[dict], reply: str, tool: dict[str, str], stopped: bool) -> list[int]:
        """Tokens between turn 1's sampled tokens and turn 2's (end of turn, the tool result, generation prompt)."""
        text = self.renderer.tokenizer.apply_chat_template
        a = text([*msgs, {"role": "assistant", "content": reply}], tokenize=False)
        b = text([*msgs, {"role": "assistant", "content": reply}, tool], tokenize=False, add_generation_prompt=True)
        if not b.startswith(a):
            raise ValueError("the chat template is not prefix-stable; code-rl cannot append the tool turn")
        ids = self.renderer.tokenizer(a[len(a.rstrip()) :] + b[len(a) :], add_special_tokens=False)["input_ids"]
        return ids if stopped else self.renderer.stop_token_ids + ids

    def run(self, sampler: Any, tasks: list[CodeTask], n: int, temperature: float, seed: int) -> list[list[dict]]:
        """``n`` episodes per task; each ``{tokens, sampled mask, logprobs, reward, passed, code, tool, sandbox_s}``."""
        sdk, cfg = self.sdk, self.cfg
        stop = self.renderer.stop_token_ids or None
        params = lambda i: sdk.sampling_params(  # noqa: E731
            max_tokens=cfg.max_tokens, temperature=temperature, seed=seed + i, stop=stop
        )
        prompts = [self.renderer.prompt_tokens(self.messages(t)) for t in tasks]
        first = gather(
            [partial(sampler.sample, sdk.model_input(p), n, params(i)) for i, p in enumerate(prompts)],
            max_in_flight=max(1, 24 // n),
        )
        eps: list[list[dict]] = []
        for task, p, res in zip(tasks, prompts, first):
            group = []
            for s in res.sequences:
                reply = self.renderer.decode(s.tokens)
                group.append(
                    {
                        "task": task,
                        "reply": reply,
                        "tokens": list(p) + list(s.tokens),
                        "mask": [0.0] * len(p) + [1.0] * len(s.tokens),
                        "logprobs": [0.0] * len(p) + list(s.logprobs),
                        "stopped": s.stop_reason == "stop",
                        "code": extract_code(reply),
                        "tool": False,
                        "sandbox_s": 0.0,
                    }
                )
            eps.append(group)
        flat = [e for g in eps for e in g]
        calls = [e for e in flat if e["code"] is not None and self._calls_tool(e["reply"])]
        checks = self.pool.map(
            lambda e: self.grader.run(public_check_program(e["code"], e["task"].public_tests)), calls
        )
        seconds = list(checks)
        tool_msgs: list[dict[str, str]] = []
        for e, (_, out, secs) in zip(calls, seconds):
            e["tool"], e["sandbox_s"] = True, secs
            result = out.strip() or "(no output)"
            tool_msgs.append(
                {"role": "user", "content": f"check_solution result:\n{result}\nReply with your final code."}
            )
        conts = [
            self._continuation(self.messages(e["task"]), e["reply"], m, e["stopped"]) for e, m in zip(calls, tool_msgs)
        ]
        second = gather(
            [
                partial(sampler.sample, sdk.model_input(e["tokens"] + c), 1, params(10_000 + i))
                for i, (e, c) in enumerate(zip(calls, conts))
            ],
            max_in_flight=24,
        )
        for e, c, res in zip(calls, conts, second):
            s = res.sequences[0]
            e["tokens"] += c + list(s.tokens)
            e["mask"] += [0.0] * len(c) + [1.0] * len(s.tokens)
            e["logprobs"] += [0.0] * len(c) + list(s.logprobs)
            revised = extract_code(self.renderer.decode(s.tokens))
            e["code"] = revised if revised is not None else e["code"]
        graded = list(
            self.pool.map(
                lambda e: self.grader.run(grading_program(e["code"], e["task"].hidden_tests)) if e["code"] else None,
                flat,
            )
        )
        for e, g in zip(flat, graded):
            e["passed"] = bool(g and g[0])
            e["sandbox_s"] += g[2] if g else 0.0
            e["reward"] = reward(e["code"], e["passed"], cfg.no_code_penalty)
        return eps

    def _calls_tool(self, reply: str) -> bool:
        mode = self.cfg.tool_call
        return mode == "always" or (mode == "auto" and "check_solution" in reply)

    def pass_rate(self, sampler: Any, tasks: list[CodeTask], name: str) -> dict[str, float]:
        """Greedy (temperature ~0) episodes: ``eval/{name}_pass`` and ``eval/{name}_code_block``; with
        ``eval_samples`` N > 0 also ``eval/{name}_pass_sampled``: the mean pass rate of N episodes per task at the
        rollouts' temperature (pass@1 estimated from N samples)."""
        if not tasks:
            return {}
        eps = [g[0] for g in self.run(sampler, tasks, 1, 1e-4, 0)]
        out = {
            f"eval/{name}_pass": sum(e["passed"] for e in eps) / len(eps),
            f"eval/{name}_code_block": sum(e["code"] is not None for e in eps) / len(eps),
        }
        if self.cfg.eval_samples:
            n = self.cfg.eval_samples
            sampled = [e for g in self.run(sampler, tasks, n, self.cfg.temperature, EVAL_SEED) for e in g]
            out[f"eval/{name}_pass_sampled"] = sum(e["passed"] for e in sampled) / len(sampled)
        return out

    def evaluate(self, sampler: Any, easy: list[CodeTask], humaneval: list[CodeTask]) -> dict[str, float]:
        """``pass_rate`` on the held-out easy and HumanEval tasks (``eval/easy_*``, ``eval/humaneval_*``)."""
        return {**self.pass_rate(sampler, easy, "easy"), **self.pass_rate(sampler, humaneval, "humaneval")}


def _datum(sdk: Sdk, e: dict, advantage: float) -> Any:
    tokens, mask, lps = e["tokens"], e["mask"], e["logprobs"]
    return sdk.datum(
        tokens[:-1],
        {
            "target_tokens": (tokens[1:], "int64"),
            "logprobs": (lps[1:], "float32"),
            "advantages": ([advantage * m for m in mask[1:]], "float32"),
        },
    )


def run(
    cfg: Config, *, sdk: Sdk | None = None, on_step: Callable[[int, dict[str, float]], None] | None = None
) -> Summary:
    """Train ``cfg.steps`` RL steps (resuming from ``cfg.log_dir`` if it holds a checkpoint)."""
    train, easy_held, he_held = task_splits(cfg)
    r = Run(cfg, "code-rl", sdk=sdk, on_step=on_step)
    pool = None
    try:
        ep = Episodes(cfg, r.sdk, ChatRenderer(r.tokenizer), Grader(cfg.sandbox_url, cfg.test_timeout_s))

        def evaluate(step: int) -> dict[str, float]:
            return ep.evaluate(r.tc.save_weights_and_get_sampling_client(), easy_held, he_held)

        def sample(index: int, sampler: Any) -> dict[str, Any]:
            t0 = time.monotonic()
            tasks = [train[i] for i in batch_indices(len(train), cfg.tasks_per_step, index, cfg.seed)]
            groups = ep.run(sampler, tasks, cfg.group_size, cfg.temperature, cfg.seed * 100_003 + index * 1009)
            return {"groups": groups, "sample_s": time.monotonic() - t0}

        r.evaluate_before(evaluate)
        adam = r.sdk.adam(cfg.learning_rate)
        sampler = r.tc.save_weights_and_get_sampling_client()
        if cfg.max_staleness:
            pool = AsyncSampler(
                sample,
                sampler,
                r.start_step,
                workers=1,
                queue_size=cfg.max_staleness,
                first_index=r.start_step,
                last_index=cfg.steps - 1,
            )
        for step in r.steps():
            t_wait = time.monotonic()
            batch, dropped = pool.next_fresh(step, cfg.max_staleness) if pool else (Batch(step, step, None), 0)
            if pool is None:
                batch.data = sample(step, sampler)
            t0 = time.monotonic()
            metrics = _train_step(cfg, r, batch, adam)
            metrics.update(
                {
                    "train/staleness": step - batch.sampler_version,
                    "train/sampler_version": batch.sampler_version,
                    "train/dropped_batches": dropped,
                    "time/sample_s": batch.data["sample_s"],
                    "time/wait_s": t0 - t_wait,
                    "time/train_s": time.monotonic() - t0,
                }
            )
            sampler = r.tc.save_weights_and_get_sampling_client()
            if pool:
                pool.update(sampler, step + 1)
            r.end_step(step, metrics, evaluate)
        if pool:
            pool.close()
        return r.finish(evaluate)
    except BaseException:
        if pool:
            pool.close()
        r.abort()
        raise


def _train_step(cfg: Config, r: Run, batch: Batch, adam: Any) -> dict[str, float]:
    flat = [e for g in batch.data["groups"] for e in g]
    data, qs, masks, equal = [], [], [], 0
    for group in batch.data["groups"]:
        advs = group_advantages([e["reward"] for e in group], cfg.advantage)
        if not any(advs):
            equal += 1
            continue
        for e, a in zip(group, advs):
            data.append(_datum(r.sdk, e, a))
            qs.append(e["logprobs"][1:])
            masks.append(e["mask"][1:])
    n = len(flat)
    metrics = {
        "train/reward": sum(e["reward"] for e in flat) / n,
        "train/pass_rate": sum(e["passed"] for e in flat) / n,
        "train/code_block_rate": sum(e["code"] is not None for e in flat) / n,
        "train/tool_call_rate": sum(e["tool"] for e in flat) / n,
        "train/datums": len(data),
        "train/groups": len(batch.data["groups"]),
        "train/groups_equal": equal,
        "time/sandbox_s": sum(e["sandbox_s"] for e in flat),
    }
    if data:
        outputs, loss_sum = forward_backward_minibatches(r.tc, data, cfg.loss, cfg.minibatches)
        r.tc.optim_step(adam).result()
        n_tok = sum(sum(m) for m in masks)
        metrics["train/loss"] = loss_sum / max(n_tok, 1)
        trained = [tolist(o["logprobs"]) for o in outputs]
        metrics.update(sampler_kl(qs, trained, masks))
        if cfg.check_update:
            metrics.update(update_shift(r.tc, data, cfg.loss, trained))
    return metrics
