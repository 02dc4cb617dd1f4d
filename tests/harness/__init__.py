"""The test harness: shared fixtures and markers (:mod:`harness.plugin`, registered by ``tests/conftest.py``),
a live gateway in this process (:mod:`harness.server`), livelora processes (:mod:`harness.cluster`), Redis and
op-stream helpers (:mod:`harness.bus`), engine kinds (:mod:`harness.engines`), seeded adapter versions
(:mod:`harness.seeds`)."""
