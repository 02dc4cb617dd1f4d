"""Tenants and administration.

:mod:`.usage` (metering), :mod:`.limits` (quotas), :mod:`.model_ceilings`, :mod:`.store_admin`,
:mod:`.version_admin`, :mod:`.key_admin`, :mod:`.segment_admin`
(segments of an endpoint) and :mod:`.admin` (the ``/admin`` service).
"""
