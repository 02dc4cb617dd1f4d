"""Recipes over the training-session API: a library of small parts plus one runnable recipe per task.

Everything here is client side and uses only the public SDK surface shared by livelora's ``ServiceClient``
and the official ``tinker.ServiceClient`` (the SDK is a setting: ``Config(sdk="tinker")`` or
``run(cfg, sdk=Sdk.load("tinker", base_url))``), so a recipe that works against livelora works against any
Tinker-compatible service.

Recipes (each ``livelora recipe NAME`` and a ``run(cfg)`` function):

* ``chat_sft`` (chat-sft): SFT on messages-format chat, assistant tokens only;
* ``gsm8k_rl`` (gsm8k-rl): GRPO-style RL on GSM8K or an arithmetic split;
* ``kto_ratings`` (kto-ratings): KTO from binary ratings (the live loop's dataset of record);
* ``dpo`` (dpo): DPO from preference pairs;
* ``distill`` (distill): on-policy distillation, reverse KL to a teacher (sampler path or system-prompted base).

Parts: ``sdk`` (the SDK setting), ``renderers`` (chat template + assistant masks), ``datasets``, ``datums``
(shifted datums, length limits, batching), ``advantages``, ``loop`` (run set-up, resume, overlap pipeline),
``evaluation``, ``preference`` (DPO/KTO custom losses), ``checkpoints`` (config.json, checkpoints.jsonl),
``metrics`` (metrics.jsonl + MLflow).

Example::

    from livelora.clients.recipes import gsm8k_rl

    summary = gsm8k_rl.run(gsm8k_rl.Config(log_dir="runs/arith", task="arithmetic",
                                           steps=20))
    print(summary.before, summary.after)
"""
