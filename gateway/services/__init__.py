"""The gateway's services: what the routes of :mod:`livelora.gateway.api` call (never the other way round).

Serving — :mod:`.serving` (``model`` → weights; :meth:`~.serving.Serving.serve`, the one call of a chat or
completion request), :mod:`.plans` (request → engine jobs), :mod:`.served` (a running request, recorded and
metered), :mod:`.generation` (jobs, choices run together), :mod:`.sampling_defaults` (omitted sampling fields),
:mod:`.prompt_limits` (cheap prompt limits, tokenizing off the loop), :mod:`.admission` (sequence bound),
:mod:`.token_texts` (token text and bytes), :mod:`.drain` (graceful shutdown), :mod:`.observe` (request metrics).
Live loop — :mod:`.live` (its wiring), :mod:`.completion_log`, :mod:`.signals` and :mod:`.signal_stream` (signals
onto the Redis stream), :mod:`.learning` (an endpoint's learning status), :mod:`.live_stats` (per-version
statistics, canary, rollback), :mod:`.registry` (endpoints → versions, leases), :mod:`.version_checks`,
:mod:`.store_sync`, :mod:`.on_demand` (stored versions). Tenants — :mod:`.usage` (token metering), :mod:`.limits`
(quotas), :mod:`.model_ceilings` (training-model ceilings), :mod:`.store_admin`, :mod:`.version_admin`,
:mod:`.key_admin` and :mod:`.admin` (the ``/admin`` service). Console — :mod:`.console_login` (sessions, CSRF),
:mod:`.console_views` and :mod:`.console_reports` (its pages' data). Training sessions — :mod:`.sessions` (Tinker).
"""
