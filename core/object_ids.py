"""The one parser of every id and path spelling that names an object; each form has exactly one spelling.

:func:`parse_ref` parses a session id, training model id (``<session>:train:<n>``), sampling session id
(``<session>:sample:<n>``), request id or ``tinker://`` checkpoint path into an :class:`ObjectRef` naming the
session it lives under; :func:`refs_of_request` finds every id a request body names. Anything else is a 400
:class:`BadRequestError` naming the field. The spellings: ``docs/internals/object-ids.md``.

Example::

    ref = parse_ref("model", "0123...cdef:train:0")   # ObjectRef(kind='model', session='0123...cdef', ...)
    parse_ref("model", "0123...cdef-train-0")          # BadRequestError (400)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from livelora.clients.errors import BadRequestError

_SESSION = r"[0-9a-f]{32}"
_INT = r"(?:0|[1-9][0-9]{0,8})"
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_PATTERNS: dict[str, re.Pattern[str]] = {
    "session": re.compile(rf"(?P<session>{_SESSION})"),
    "model": re.compile(rf"(?P<session>{_SESSION}):train:(?P<n>{_INT})"),
    "sampler": re.compile(rf"(?P<session>{_SESSION}):sample:(?P<n>{_INT})"),
    "request": re.compile(
        rf"(?:(?P<session>{_SESSION}):(?:train|sample):{_INT}:(?:{_INT}|x)|sample:(?:{_INT}|x))"
        r":[0-9a-f]{12}"
    ),
    "path": re.compile(
        rf"tinker://(?P<session>{_SESSION}):train:(?P<n>{_INT})"
        rf"/(?P<ckind>weights|sampler_weights|external_weights)/(?P<name>{_NAME})"
    ),
    "checkpoint": re.compile(rf"(?P<ckind>weights|sampler_weights|external_weights)/(?P<name>{_NAME})"),
}
_SPELLING = {
    "session": "a session id as create_session answers it (32 lower-case hex digits)",
    "model": "<session_id>:train:<n>",
    "sampler": "<session_id>:sample:<n>",
    "request": "a request_id as the server answered it",
    "path": "tinker://<session_id>:train:<n>/<weights|sampler_weights|external_weights>/<name>",
    "checkpoint": "<weights|sampler_weights|external_weights>/<name> (a name of letters, digits, '.', '_', '-')",
}


@dataclass(frozen=True)
class ObjectRef:
    """A parsed id.

    Attributes:
        kind: ``session``, ``model``, ``sampler``, ``request`` or ``path``.
        text: the id as given (its one canonical spelling).
        session: the training session it is named under (``None``: an ad-hoc sample's request id).
        model_id: the training model of a ``model`` id or a checkpoint ``path``.
    """

    kind: str
    text: str
    session: str | None
    model_id: str | None = None


def parse_ref(kind: str, value: object, param: str | None = None) -> ObjectRef:
    """Parse ``value`` as an id of ``kind`` in its one accepted spelling.

    Raises:
        BadRequestError: not a string, or any other spelling (``param`` = the field, default ``kind``'s).
    """
    pattern = _PATTERNS[kind]
    m = pattern.fullmatch(value) if isinstance(value, str) else None
    if m is None or not isinstance(value, str):
        shown = repr(value)[:80]
        raise BadRequestError(
            f"invalid {param or kind} {shown}: expected {_SPELLING[kind]}", param=param or kind, code="invalid_id"
        )
    session = m.groupdict().get("session")
    model_id = None
    if kind == "model":
        model_id = value
    elif kind == "path":
        model_id = f"{session}:train:{m.group('n')}"
    return ObjectRef(kind, value, session, model_id)


#: Tinker request body fields naming an object → the form they must have. ``path``/``model_path`` name a
#: checkpoint only when they are ``tinker://`` paths (in ``save_weights`` ``path`` is the new checkpoint's name).
BODY_FIELDS: dict[str, str] = {
    "session_id": "session",
    "model_id": "model",
    "sampling_session_id": "sampler",
    "sampler_id": "sampler",
    "request_id": "request",
    "model_path": "path",
    "path": "path",
    "tinker_path": "path",
}
#: first path segment under ``/api/v1`` → the form of the segment after it
PATH_SEGMENTS: dict[str, str] = {"sessions": "session", "training_runs": "model", "samplers": "sampler"}
#: routes whose second segment is a word, not an id (``POST /api/v1/sessions/search``)
LITERAL_ROUTES: frozenset[tuple[str, str]] = frozenset({("sessions", "search")})


def refs_of_request(api_path: str, body: object) -> list[ObjectRef]:
    """Every object a Tinker request names: path parameters (``/api/v1/<segment>/<id>/...``) and body fields
    (top level, and those of a ``target`` object, as in ``retrieve_futures``).

    Args:
        api_path: the URL path after ``/api/v1/``.
        body: the decoded JSON body (anything that is not an object names nothing).

    Raises:
        BadRequestError: a field or segment in another spelling than its one accepted form.
    """
    out: list[ObjectRef] = []
    parts = api_path.split("/")
    if len(parts) > 1 and parts[0] in PATH_SEGMENTS and tuple(parts[:2]) not in LITERAL_ROUTES:
        out.append(parse_ref(PATH_SEGMENTS[parts[0]], parts[1], param=parts[0][:-1] + "_id"))
    if isinstance(body, dict) and isinstance(body.get("target"), dict):  # retrieve_futures names its sampler there
        out += refs_of_request("", body["target"])
    if isinstance(body, dict):
        for field, kind in BODY_FIELDS.items():
            value = body.get(field)
            if value is None:
                continue
            if kind == "path" and not (isinstance(value, str) and value.lower().startswith("tinker:")):
                continue  # a checkpoint name, validated by its route
            out.append(parse_ref(kind, value, param=field))
    return out
