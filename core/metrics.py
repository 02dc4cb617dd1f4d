"""Prometheus metrics of every livelora process (``prometheus-client``), served by the gateway at ``/metrics``.

The metrics are module-level objects in the default registry, so a gateway, a trainer and ``livelora serve``
(both in one process) update the same names. Units are in the names (``_seconds``, ``_tokens``).

**Several processes.** With ``PROMETHEUS_MULTIPROC_DIR`` set (a directory shared by the processes, emptied
before they start, the prometheus-client convention), every process writes its values there and
:func:`exposition` aggregates all of them (``prometheus_client.multiprocess.MultiProcessCollector``): several
uvicorn workers, or a trainer process beside the gateway, then show up in one scrape. Without it each process
exposes its own registry (a separate ``livelora trainer`` process is then not visible at the gateway's
``/metrics``; ``livelora serve`` sets up such a directory for itself and its trainer child). Gauges use
``multiprocess_mode="livesum"`` (the sum over live processes).

docs/operations.md has the table of names.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_GAP = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_STEP = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# ------------------------------------------------------------------ HTTP
REQUESTS = Counter(
    "livelora_http_requests_total",
    "HTTP requests answered, by method, route template and status.",
    ["method", "route", "status"],
)
REQUEST_LATENCY = Histogram(
    "livelora_http_request_duration_seconds",
    "Time from request start to the end of the response body (s), by route and status.",
    ["method", "route", "status"],
    buckets=_LATENCY,
)
# ------------------------------------------------------------------ generation
TTFT = Histogram(
    "livelora_time_to_first_token_seconds",
    "Time from admission to a served request's first generated token (s), by route kind "
    "(chat, completion, messages, sample).",
    ["kind"],
    buckets=_LATENCY,
)
INTER_TOKEN = Histogram(
    "livelora_inter_token_latency_seconds",
    "Time between consecutive generated tokens of one choice (s), by route kind.",
    ["kind"],
    buckets=_TOKEN_GAP,
)
GENERATED_TOKENS = Counter(
    "livelora_generated_tokens_total",
    "Tokens generated for served requests, by route kind; rate() of it is tokens per second.",
    ["kind"],
)
PROMPT_TOKENS = Counter("livelora_prompt_tokens_total", "Prompt tokens of served requests, by route kind.", ["kind"])
TOKENS_PER_SECOND = Histogram(
    "livelora_request_tokens_per_second",
    "Generated tokens per second of one served request (completion tokens / time from admission to the last token).",
    ["kind"],
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000),
)
# ------------------------------------------------------------------ admission and engine
QUEUE_DEPTH = Gauge(
    "livelora_admission_sequences",
    "Sequences admitted by the gateway (running or waiting for an engine batch slot).",
    multiprocess_mode="livesum",
)
REJECTIONS = Counter(
    "livelora_admission_rejections_total", "Requests refused by admission (429 busy), by reason.", ["reason"]
)
BATCH_SIZE = Histogram(
    "livelora_engine_batch_size",
    "Sequences decoded together in one engine step.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
VERSION_LOADS = Counter(
    "livelora_engine_version_loads_total",
    "Cold adapter versions loaded back into the engine for a request (gateway/engines/residency.py).",
)
VERSION_EVICTIONS = Counter(
    "livelora_engine_version_evictions_total",
    "Idle adapter versions the engine made cold to stay within LIVELORA_ENGINE_MAX_LOADED_VERSIONS.",
)
RESIDENT_VERSIONS = Gauge(
    "livelora_engine_resident_versions",
    "Adapter versions whose weights are in the engine now (the others loaded are cold, on its disk).",
    multiprocess_mode="livesum",
)
ADAPTER_VERSIONS = Gauge(
    "livelora_loaded_adapter_versions",
    "Adapter versions loaded in the engine, by endpoint (versions still leased by running requests count).",
    ["endpoint"],
    multiprocess_mode="livesum",
)
SWAP_LATENCY = Histogram(
    "livelora_adapter_swap_seconds",
    "Time to load and check a new adapter version in the engine "
    "before the endpoints of its lineage move to it (s), by lineage.",
    ["lineage"],
    buckets=_LATENCY,
)
# ------------------------------------------------------------------ live loop
SIGNALS = Counter(
    "livelora_signals_total",
    "Live-loop signals by stage: accepted (gateway), recorded (dataset of "
    "record), trained (in a published version), dead_lettered; and by type.",
    ["stage", "type"],
)
TRAIN_STEP = Histogram(
    "livelora_train_step_seconds",
    "Time of one live-loop training step, forward_backward to saved version (s), by endpoint.",
    ["endpoint"],
    buckets=_STEP,
)
TRAIN_LOSS = Gauge(
    "livelora_train_loss",
    "Loss of the latest live-loop training step, by endpoint.",
    ["endpoint"],
    multiprocess_mode="livemax",
)
STEP_SCALE = Gauge(
    "livelora_live_step_scale",
    "Fraction of its trained step the latest published live-loop version holds (the gate's line search: 1, 0.5, "
    "0.25, ...), by endpoint.",
    ["endpoint"],
    multiprocess_mode="livemostrecent",
)
GATE_CANDIDATES = Counter(
    "livelora_gate_candidates_total",
    "Candidates the evaluation gate judged (each step scale of the line search), by endpoint and outcome "
    "(passed, rejected).",
    ["endpoint", "outcome"],
)
VERSIONS_PRUNED = Counter(
    "livelora_adapter_versions_pruned_total",
    "Adapter versions the live loop deleted to stay "
    "within the tenant's max_adapter_versions (oldest versions no endpoint uses), by "
    "endpoint.",
    ["endpoint"],
)
STEPS_HELD_BACK = Counter(
    "livelora_live_steps_held_back_total",
    "Live-loop steps not run because the tenant is at "
    "its max_adapter_versions and no version of the lineage could be freed (the signals stay "
    "queued and the step is tried again), by endpoint.",
    ["endpoint"],
)
# ------------------------------------------------------------------ training sessions
SESSION_OPS = Counter(
    "livelora_session_ops_total",
    "Training-session ops run by the op executor, by kind and outcome (done, failed).",
    ["kind", "outcome"],
)
SESSION_OP_QUEUE = Histogram(
    "livelora_session_op_queue_seconds",
    "Time a training-session op waited between being queued by the gateway and starting in the executor (s), by kind.",
    ["kind"],
    buckets=_LATENCY,
)
# ------------------------------------------------------------------ infrastructure
REDIS_ERRORS = Counter("livelora_redis_errors_total", "Redis commands that failed, by where they were used.", ["where"])


def exposition() -> tuple[bytes, str]:
    """``(body, content type)`` of the Prometheus text format: this process's registry, or every process's
    when ``PROMETHEUS_MULTIPROC_DIR`` is set (see the module docstring)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(), CONTENT_TYPE_LATEST
