"""A sandbox for untrusted generated code: run a Python program with files and stdin, get status, output, exit
code and time (:class:`Sandbox`), isolated by bubblewrap with resource limits (docs/code-rl.md).

:mod:`livelora.clients.sandbox.fusion` has SandboxFusion's ``POST /run_code`` wire shapes (``livelora sandbox``
serves them; :class:`~livelora.clients.sandbox.fusion.FusionClient` calls any server that speaks them).
"""

from livelora.clients.sandbox.runner import IsolationUnavailableError, Limits, RunResult, Sandbox

__all__ = ["IsolationUnavailableError", "Limits", "RunResult", "Sandbox"]
