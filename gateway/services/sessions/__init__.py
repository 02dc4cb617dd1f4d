"""Training sessions, gateway side: every ``/api/v1`` operation, independent of the wire encoding.

The routes in :mod:`livelora.gateway.api.tinker` decode a body into a :mod:`livelora.clients.types.tinker`
model, call one method of a session service and encode what it returns; a later protobuf codec only adds a
decoder/encoder pair. One module per concern:

* :mod:`.service` — :class:`SessionService`: sessions (create, heartbeat, finish), ``retrieve_future``, and the
  parts below, started and closed together;
* :mod:`.training` — :class:`TrainingOps`: training ops (``forward``, ``forward_backward``, ``optim_step``,
  ``save_weights``, ``save_weights_for_sampler``, ``load_weights``, ``create_model``) validated and queued for
  the op executor on ``ops:{model_id}``, model records, server capabilities;
* :mod:`.futures` — :class:`Futures`: op results in Redis, long-polled (408 ``try_again``; 410 when unknown);
* :mod:`.checkpoints` — :class:`Checkpoints`: ``tinker://`` checkpoints of training runs;
* :mod:`.sampling` — :class:`SamplingSessions`: sampling sessions on the gateway's engine, never on the trainer;
* :mod:`.samples` — :class:`Samples`: ``asample`` (admitted, metered, cancellable) on those sessions;
* :mod:`.context` — :class:`SessionContext`: what they share (Redis, engine, store, base model).
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
