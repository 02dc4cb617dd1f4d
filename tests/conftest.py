"""The test session's environment (set before livelora is imported) and the harness plugin (tests/harness/):
one store (LIVELORA_HOME) per test session, the real SmolLM2 model, real Redis."""

from __future__ import annotations

import os
import uuid

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Every gateway/trainer a test starts with default settings writes its Redis keys (completion log, signals,
# sessions) under one prefix per test session, deleted at the end (harness.plugin._redis_prefix_cleanup).
os.environ.setdefault("LIVELORA_REDIS_PREFIX", f"livelora-test-{uuid.uuid4().hex[:12]}:")
# Trainer processes the tests start run without the evaluation gate (it holds out one rating in ten and costs
# seconds per update on these CPUs, which the loop-mechanics tests do not measure); tests/test_gate.py turns it on.
os.environ.setdefault("LIVELORA_GATE_ENABLED", "false")

pytest_plugins = ["harness.plugin"]
