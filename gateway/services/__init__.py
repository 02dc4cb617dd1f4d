"""The gateway's services: what the routes of :mod:`livelora.gateway.api` call (never the other way round).

* :mod:`.serving` — which weights answer a ``model`` name, and :meth:`~.serving.Serving.begin`, the one place a
  served request begins (target, admission ticket, version lease, completion recorder);
* :mod:`.admission` — the gateway's bound on admitted sequences (429 beyond it);
* :mod:`.generation` — OpenAI sampling fields → engine jobs, and the choices of one request run together;
* :mod:`.completion_log` — every served completion in Redis, and the recorder that logs a request's choices;
* :mod:`.signals` — ratings, preferences and demonstrations onto the Redis signals stream;
* :mod:`.registry` — endpoints → adapter versions: leases, checked hot-swaps, drained unloads;
* :mod:`.live` — the live-loop wiring (Redis client, completion log, signals, registry) of a gateway process;
* :mod:`.admin` — endpoints, adapter versions, exports and API keys of a tenant;
* :mod:`.sessions` — the Tinker training-session API (sessions, training ops, futures, checkpoints, sampling).
"""
