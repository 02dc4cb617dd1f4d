"""The walk of one live-loop training step through its rooms (``tests/test_training_step_structure.py``).

A room is an object or module of the step (:data:`ROOMS`). :class:`Walk` (``sys.setprofile``, this thread) notes
the room of every function called while it is open, generator resumes included; code outside every room (the
trainer's ``train``, the model, torch) leaves the walk where it is, and a constructor (``__init__``) only binds
its arguments, so it is no visit. Consecutive calls in one room are one visit. The walk then tells the rooms in
order, which of them each was entered from (another room, or ``"hall"``: ``train`` itself), and how many times
it came back to a room it had left.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

from harness.source import REPO

#: room → the files (``path``) or top-level names in a file (``path:Name``) that are its code
ROOMS = {
    "datums": ("trainer/event_datums.py",),
    "step": ("trainer/live_step.py:LiveStep",),
    "judge": (
        "trainer/judge.py",
        "trainer/gate.py",
        "trainer/gate_measure.py",
        "trainer/gate_freeform.py",
        "trainer/line_search.py",
        "trainer/live_step.py:Unjudged",
    ),
    "save": ("trainer/live_step.py:save", "trainer/checkpoints.py:write_version"),
    "report": ("trainer/live_step.py:StepReport",),
}
_WHERE = {place: room for room, places in ROOMS.items() for place in places}


def room_of(code: CodeType) -> str | None:
    """The room whose code ``code`` is (``None``: no room's, or a constructor)."""
    if code.co_name == "__init__":
        return None
    try:
        path = Path(code.co_filename).resolve().relative_to(REPO).as_posix()
    except ValueError:
        return None
    top = code.co_qualname.split(".")[0]
    return _WHERE.get(f"{path}:{top}", _WHERE.get(path))


class Walk:
    """``with Walk() as w: trainer.train(batch)``; then :attr:`rooms` (the visits in order), :attr:`came_from`
    (the room each visit was called from, ``"hall"`` when from no room) and :meth:`returns`."""

    def __init__(self) -> None:
        self.rooms: list[str] = []
        self.came_from: list[str] = []
        self._rooms: dict[CodeType, str | None] = {}

    def __enter__(self) -> Walk:
        self._before = sys.getprofile()
        sys.setprofile(self._event)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(self._before)

    def _room(self, code: CodeType) -> str | None:
        if code not in self._rooms:
            self._rooms[code] = room_of(code)
        return self._rooms[code]

    def _event(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        room = self._room(frame.f_code)
        if room is None or (self.rooms and self.rooms[-1] == room):
            return
        caller, f = "hall", frame.f_back
        while f is not None:
            if (r := self._room(f.f_code)) is not None:
                caller = r
                break
            f = f.f_back
        self.rooms.append(room)
        self.came_from.append(caller)

    def returns(self) -> int:
        """Visits to a room the walk had already left."""
        return sum(room in self.rooms[:i] for i, room in enumerate(self.rooms))

    def entries(self, room: str, came_from: str = "hall") -> int:
        """Visits to ``room`` called from ``came_from``."""
        return sum(r == room and c == came_from for r, c in zip(self.rooms, self.came_from, strict=True))
