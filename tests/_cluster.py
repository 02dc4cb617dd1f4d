"""Kept for ``from _cluster import ...`` (bench/soak.py, tests written before the harness): see
:mod:`harness.cluster`."""

from harness.cluster import (
    MODEL,
    Cluster,
    Proc,
    corrupt_versions,
    free_port,
    new_store,
    recorded_counts,
    trained_counts,
)

__all__ = [
    "MODEL",
    "Cluster",
    "Proc",
    "corrupt_versions",
    "free_port",
    "new_store",
    "recorded_counts",
    "trained_counts",
]
