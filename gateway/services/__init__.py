"""The gateway's services: what the routes of :mod:`livelora.gateway.api` call (never the other way round).

Serving — :mod:`.serving` (``model`` → weights; :meth:`~.serving.Serving.serve`, the one call of a generation),
:mod:`.checkpoint_names` (checkpoint paths as names), :mod:`.messages` (the Messages API as a chat), :mod:`.plans`
(request → engine jobs), :mod:`.request_fields` (which fields are honoured or refused), :mod:`.served` (a running
request), :mod:`.generation` (choices run together), :mod:`.sampling_defaults`, :mod:`.prompt_limits` (cheap limits),
:mod:`.admission`, :mod:`.token_texts`, :mod:`.drain` (shutdown), :mod:`.observe` (request metrics). Live loop —
:mod:`.live` (its wiring), :mod:`.completion_log`, :mod:`.signals` and :mod:`.signal_stream`, :mod:`.learning`
(learning status), :mod:`.live_stats` (per-version statistics, canary, rollback), :mod:`.registry` (endpoints →
versions, leases), :mod:`.version_checks`, :mod:`.store_sync`, :mod:`.on_demand` (stored versions). Tenants —
:mod:`.usage` (metering), :mod:`.limits` (quotas), :mod:`.model_ceilings`, :mod:`.store_admin`,
:mod:`.version_admin`, :mod:`.key_admin` and :mod:`.admin` (the ``/admin`` service). Console —
:mod:`.console_login` (sessions, CSRF), :mod:`.console_views` and :mod:`.console_reports` (its pages' data).
Training sessions — :mod:`.sessions` (the Tinker API).
"""
