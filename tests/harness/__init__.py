"""The test harness: shared fixtures and markers (:mod:`harness.plugin`, registered by ``tests/conftest.py``),
the session's environment (:mod:`harness.environ`), a live gateway in this process (:mod:`harness.server`),
livelora processes (:mod:`harness.cluster`), Redis and op-stream helpers (:mod:`harness.bus`), engine kinds and
generation helpers (:mod:`harness.engines`), seeded adapter versions (:mod:`harness.seeds`), the gate tests'
training batches (:mod:`harness.gate`), the training step's walk through its rooms (:mod:`harness.walk`) and the
packages' source read as text (:mod:`harness.source`)."""
