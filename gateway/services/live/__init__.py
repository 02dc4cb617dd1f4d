"""The live loop's gateway side.

:mod:`.wiring` (its wiring), :mod:`.completion_log`, :mod:`.signals` and :mod:`.signal_stream`, :mod:`.learning`
(learning status), :mod:`.live_stats` (per-version statistics, canary, rollback), :mod:`.registry` (endpoints →
versions, leases), :mod:`.version_checks`, :mod:`.store_sync`, :mod:`.on_demand` (stored versions),
:mod:`.segments` (requests of an endpoint → its segments).
"""
