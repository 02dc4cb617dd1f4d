"""How many sequences the gateway admits at once.

:class:`Admission` bounds the sequences in the gateway: up to ``max_batch_size`` run in the engine batch and
``max_waiting`` more wait; a request that would exceed that gets 429 with ``Retry-After`` (contract §1.4: the
SDK retries 429 and honours the header). Every generation — chat, legacy completions, Tinker sampling — is
admitted here, by :meth:`livelora.gateway.services.serving.Serving.begin`.
"""

from __future__ import annotations

from collections.abc import Callable

from livelora.clients.errors import BadRequestError, RateLimitError
from livelora.core import metrics
from livelora.gateway.settings import GatewaySettings


class Admission:
    """Counts sequences admitted by the gateway (running + waiting). Event-loop confined."""

    def __init__(self, settings: GatewaySettings):
        self.limit = settings.inference.max_sequences
        self.retry_after = settings.inference.retry_after_s
        self.active = 0

    def acquire(self, sequences: int, param: str = "n") -> Ticket:
        """Reserve ``sequences`` slots until the returned ticket is released.

        Raises:
            BadRequestError: one request asks for more sequences than the gateway ever admits.
            RateLimitError: not enough free slots now (429, ``Retry-After``).
        """
        if sequences > self.limit:
            raise BadRequestError(
                f"this request needs {sequences} sequences but the server admits at most "
                f"{self.limit} at once; lower {param}",
                param=param,
                code="integer_above_max_value",
            )
        if self.active + sequences > self.limit:
            metrics.REJECTIONS.labels("busy").inc()
            raise RateLimitError(
                f"the server is busy ({self.active} of {self.limit} sequences queued or running); retry later",
                retry_after=self.retry_after,
            )
        self.active += sequences
        metrics.QUEUE_DEPTH.set(self.active)
        return Ticket(self, sequences)


class Ticket:
    """Admitted slots; :meth:`release` is idempotent."""

    def __init__(self, admission: Admission, sequences: int):
        self._admission = admission
        self._sequences = sequences
        self._also: list[Callable[[], None]] = []

    def also_release(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` when the ticket is released (e.g. an adapter-version lease)."""
        self._also.append(fn)

    def release(self) -> None:
        self._admission.active -= self._sequences
        if self._sequences:
            metrics.QUEUE_DEPTH.set(self._admission.active)
        self._sequences = 0
        also, self._also = self._also, []
        for fn in also:
            fn()
