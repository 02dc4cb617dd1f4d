"""The composition root: the ``livelora`` command line and the wiring of processes.

This is the only package that imports both :mod:`livelora.gateway` and :mod:`livelora.trainer`: it decides
which parts run in which process (``livelora serve``: the gateway, and signal worker + op executor in a
supervised lower-priority child process, :mod:`livelora.cli.trainer_process`; ``livelora gateway`` and
``livelora trainer`` apart) and builds their settings objects.

* :mod:`livelora.cli.main`: the typer app (``serve``, ``gateway``, ``trainer``, plus the admin commands);
* :mod:`livelora.cli.admin` and :mod:`livelora.cli.admin_keys`: ``endpoints``, ``adapters``, ``keys`` (over HTTP, or
  on the store with ``--home``), on what :mod:`livelora.cli.admin_common` holds for them and ``usage``;
* :mod:`livelora.cli.processes`: what runs beside the gateway (op executor, trainer worker thread);
* :mod:`livelora.cli.trainer_process`: ``livelora serve``'s trainer child process (nice, threads, restarts);
* :mod:`livelora.cli.redis_server`: the embedded ``redis-server`` of ``livelora serve``;
* :mod:`livelora.cli.settings`: ``ServeSettings`` and the list of every process's settings class.
"""
