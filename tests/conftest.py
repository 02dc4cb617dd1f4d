"""The test session's environment (set before livelora is imported: :func:`harness.environ.set_session_environment`,
the caller's ``LIVELORA_*`` variables but the suite's inputs removed) and the harness plugin (tests/harness/): one
store (LIVELORA_HOME) per test session, the real SmolLM2 model, real Redis."""

from __future__ import annotations

from harness.environ import set_session_environment

set_session_environment()

pytest_plugins = ["harness.plugin"]
