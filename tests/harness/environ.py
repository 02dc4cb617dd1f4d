"""The test session's environment, made before livelora is imported (called by ``tests/conftest.py``).

The caller's ``LIVELORA_*`` variables are removed, but for the suite's inputs (:data:`SUITE_INPUTS`): a
``LIVELORA_REDIS_PREFIX`` or ``LIVELORA_REDIS_URL`` set for the user's own install must not reach the servers,
trainers and settings the tests make (``tests/test_harness_env.py`` runs a probe with them set).
"""

from __future__ import annotations

import os
import uuid

#: the ``LIVELORA_*`` variables the suite reads from the caller (CONTRIBUTING.md, "Run the tests")
SUITE_INPUTS = frozenset(
    {
        "LIVELORA_HOME",  # the test store, which keeps the converted model (default: <repo>/.livelora-home)
        "LIVELORA_TEST_ENGINES",  # engine kinds of the engine tests (harness.engines)
        "LIVELORA_TINKER024_PYTHON",  # the official tinker SDKs' interpreters (harness.sdks)
        "LIVELORA_TINKER038_PYTHON",
        "LIVELORA_HUMANEVAL",  # HumanEval's folder (tests/test_code_rl_parts.py)
        "LIVELORA_SKIP_TINKER_SDKS",  # read by .ci/run, not by livelora
    }
)
#: the update's and the gate's capability keeping, off for the loop-mechanics tests (seconds per step); their own
#: tests, the README walkthrough and ``harness.docs.serve_process(installed=True)`` run them as installed
LOOP_MECHANICS = {
    "LIVELORA_GATE_FREEFORM_ITEMS": "0",
    "LIVELORA_REHEARSAL_PER_STEP": "0",
    "LIVELORA_KL_COEF": "0",
    "LIVELORA_LR_WARMUP_STEPS": "0",  # their steps are calibrated on the full rate from the first one
}
#: what :func:`set_session_environment` sets (besides the inputs and the harness's ``LIVELORA_TOKENIZER_CACHE``)
SET_HERE = frozenset({"LIVELORA_REDIS_PREFIX", "LIVELORA_GATE_ENABLED", *LOOP_MECHANICS})


def set_session_environment() -> None:
    """Drop every ``LIVELORA_*`` variable but :data:`SUITE_INPUTS`, then set the session's own: a Redis prefix per
    test session (``livelora-test-<12 hex>:``, deleted at the end by ``harness.plugin``) and the evaluation gate
    off (it holds out one rating in ten and costs seconds per update on these CPUs, which the loop-mechanics tests
    do not measure; tests/test_gate.py turns it on), and with it the free-form check and the rehearsal KL of each
    step (:data:`LOOP_MECHANICS`, seconds per step). Offline Hugging Face unless the caller says otherwise."""
    for name in [n for n in os.environ if n.startswith("LIVELORA_") and n not in SUITE_INPUTS]:
        del os.environ[name]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ["LIVELORA_REDIS_PREFIX"] = f"livelora-test-{uuid.uuid4().hex[:12]}:"
    os.environ["LIVELORA_GATE_ENABLED"] = "false"
    os.environ.update(LOOP_MECHANICS)
