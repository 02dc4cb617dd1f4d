"""Recipes over the training-session API: a library of small parts plus one runnable recipe per task.

Everything here is client side and uses only the SDK surface shared by livelora's ``ServiceClient`` and the
official ``tinker.ServiceClient`` (:mod:`.sdk`: ``Config(sdk="tinker")``), so a recipe that works against
livelora works against any Tinker-compatible service. Recipes (``livelora recipe NAME`` and ``run(cfg)``):
``chat_sft``, ``gsm8k_rl``, ``kto_ratings``, ``dpo``, ``distill``, ``code_rl``. Parts: ``sdk``, ``renderers`` (chat
template + assistant masks), ``datasets``, ``datums``, ``advantages``, ``loop`` (set-up, resume, overlap pipeline),
``evaluation``, ``preference`` (DPO/KTO custom losses), ``checkpoints``, ``metrics`` (metrics.jsonl + MLflow).

Example::

    from livelora.clients.recipes import gsm8k_rl
    summary = gsm8k_rl.run(gsm8k_rl.Config(log_dir="runs/arith", task="arithmetic", steps=20))
    print(summary.before, summary.after)
"""
