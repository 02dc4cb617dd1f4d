"""Training sessions, gateway side: every ``/api/v1`` operation, independent of the wire encoding.

* :mod:`.service` — :class:`SessionService`: sessions, ``retrieve_future``, and the parts below;
* :mod:`.training` — :class:`TrainingOps`: training ops validated and queued for the op executor;
* :mod:`.futures` — :class:`Futures`: op results in Redis, long-polled;
* :mod:`.checkpoints` — :class:`Checkpoints`: ``tinker://`` checkpoints of training runs;
* :mod:`.sampling` — :class:`SamplingSessions`: sampling sessions on the gateway's engine;
* :mod:`.samples` — :class:`Samples`: ``asample`` (admitted, metered, cancellable) on those sessions;
* :mod:`.context` — :class:`SessionContext`: what they share (Redis, engine, store, base model);
* :mod:`.op_checks` (a training op's door checks), :mod:`.seq_order` (op order, gateway side), :mod:`.history`
  (summaries kept after a session ends).
"""

from livelora.gateway.services.sessions.checkpoints import Checkpoints
from livelora.gateway.services.sessions.context import SessionContext
from livelora.gateway.services.sessions.futures import Futures, GoneError, NotReady
from livelora.gateway.services.sessions.samples import Samples
from livelora.gateway.services.sessions.sampling import SamplingSessions
from livelora.gateway.services.sessions.service import SessionService, start_sessions
from livelora.gateway.services.sessions.training import TrainingOps

__all__ = [
    "Checkpoints",
    "Futures",
    "GoneError",
    "NotReady",
    "Samples",
    "SamplingSessions",
    "SessionContext",
    "SessionService",
    "TrainingOps",
    "start_sessions",
]
