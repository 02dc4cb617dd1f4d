"""The gateway's services: what the routes of :mod:`livelora.gateway.api` call (never the other way round).

One sub-package per concern, each indexing its own modules: :mod:`.serving` (a request to its generation),
:mod:`.live` (the live loop: completions, signals, versions), :mod:`.tenants` (metering, quotas, ``/admin``),
:mod:`.console` (the console's sessions and pages), :mod:`.sessions` (training sessions, the Tinker API).
The HTTP middlewares (authentication, request metrics, drain) are :mod:`livelora.gateway.middleware`.
"""
