"""A base model's tokenizer as plain files: what ``GET /api/v1/tokenizer`` serves, and where clients put it (the
server reads and serves them with :mod:`livelora.core.served_tokenizer`).

:func:`load_tokenizer` loads the served base model's tokenizer from the server's files (:func:`fetch_tokenizer`,
no hub request), stored in the SDK's own cache (:func:`store_tokenizer`, one folder per revision) or placed in the
Hugging Face hub cache (:func:`install_in_hub_cache`) so that ``AutoTokenizer.from_pretrained(hub_id)`` resolves
offline. A revision is the sha1 of the files' names and bytes (:func:`files_revision`); only
:data:`TOKENIZER_FILES` travel, never weights. The two cache layouts: ``docs/internals/tokens.md``.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from livelora.clients.errors import BadRequestError, InternalError
from livelora.clients.types.tinker_ext import TokenizerFilesResponse

if TYPE_CHECKING:
    from livelora.clients._http import Transport

#: The files a tokenizer may consist of (base names; those present are served and placed).
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "config.json",
)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def check_files(files: Mapping[str, bytes]) -> None:
    """Raises: BadRequestError when a name is not one of :data:`TOKENIZER_FILES` (a path, a weights file) or
    there is neither ``tokenizer.json`` nor ``tokenizer_config.json``."""
    bad = sorted(n for n in files if n not in TOKENIZER_FILES)
    if bad:
        raise BadRequestError(f"not tokenizer files: {', '.join(bad)}", param="files")
    if "tokenizer.json" not in files and "tokenizer_config.json" not in files:
        raise BadRequestError("no tokenizer files (neither tokenizer.json nor tokenizer_config.json)", param="files")


def files_revision(files: Mapping[str, bytes]) -> str:
    """sha1 (40 hex digits) of the files' names and bytes, in name order."""
    digest = hashlib.sha1()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name])
    return digest.hexdigest()


def from_response(res: TokenizerFilesResponse) -> dict[str, bytes]:
    """``{base name: bytes}`` of a ``GET /api/v1/tokenizer`` answer.

    Raises:
        InternalError: a file name outside :data:`TOKENIZER_FILES`, no tokenizer file, or bytes that do not match
            ``revision`` (a broken or tampered answer).
    """
    files = {
        f.name: f.content.encode("utf-8") if f.encoding == "utf-8" else base64.b64decode(f.content) for f in res.files
    }
    try:
        check_files(files)
    except BadRequestError as exc:
        raise InternalError(f"the server's tokenizer answer is unusable: {exc}") from None
    if files_revision(files) != res.revision:
        raise InternalError(f"the server's tokenizer files do not match their revision {res.revision}")
    return files


# ---------------------------------------------------------------------------------------------- writing
def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_hub_id(hub_id: str) -> None:
    """Raises: BadRequestError when ``hub_id`` is not a Hugging Face repo id (``org/name`` or ``name``)."""
    if not _HUB_ID.fullmatch(hub_id or "") or ".." in hub_id or hub_id.endswith((".", "-")):
        raise BadRequestError(f"hub id {hub_id!r} is not a Hugging Face repo id ('org/name')", param="hub_id")


def install_in_hub_cache(files: Mapping[str, bytes], hub_id: str, cache_dir: Path | str | None = None) -> Path:
    """Make ``files`` resolvable offline as ``hub_id`` (``AutoTokenizer.from_pretrained(hub_id)`` with
    ``HF_HUB_OFFLINE=1``) by writing them into the Hugging Face hub cache (layout: docs/internals/tokens.md).
    Each file is written atomically; re-running with the same files is a no-op.

    Args:
        files: ``{base name: bytes}`` (:data:`TOKENIZER_FILES` only).
        hub_id: ``org/name`` (or a bare ``name``).
        cache_dir: hub cache root (default ``huggingface_hub.constants.HF_HUB_CACHE``).

    Returns: the snapshot directory.

    Raises:
        BadRequestError: a bad ``hub_id``, or ``files`` that are not a tokenizer (:func:`check_files`).
    """
    from huggingface_hub import constants

    check_hub_id(hub_id)
    check_files(files)
    rev = files_revision(files)
    repo = Path(cache_dir or constants.HF_HUB_CACHE) / ("models--" + hub_id.replace("/", "--"))
    snapshot = repo / "snapshots" / rev
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        _write_atomic(snapshot / name, data)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    _write_atomic(repo / "refs" / "main", rev.encode())
    return snapshot


def tokenizer_cache_root() -> Path:
    """The SDK's tokenizer cache: ``$LIVELORA_TOKENIZER_CACHE``, else ``$XDG_CACHE_HOME/livelora/tokenizers``,
    else ``~/.cache/livelora/tokenizers``."""
    if os.environ.get("LIVELORA_TOKENIZER_CACHE"):
        return Path(os.environ["LIVELORA_TOKENIZER_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "livelora" / "tokenizers"


def _id_dir(tokenizer_id: str, root: Path | None) -> Path:
    safe = re.sub(r"[^\w.-]", "_", tokenizer_id.replace("/", "--")).lstrip(".") or "tokenizer"
    return (root or tokenizer_cache_root()) / safe


def cached_tokenizer_dir(tokenizer_id: str, root: Path | None = None) -> Path | None:
    """The folder of the latest revision of ``tokenizer_id`` in the SDK's cache (``None``: none cached)."""
    base = _id_dir(tokenizer_id, root)
    try:
        rev = (base / "current").read_text().strip()
    except OSError:
        return None
    folder = base / rev
    return folder if re.fullmatch(r"[0-9a-f]{40}", rev) and folder.is_dir() else None


def store_tokenizer(tokenizer_id: str, files: Mapping[str, bytes], root: Path | None = None) -> Path:
    """Put ``files`` in the SDK's cache as the current revision of ``tokenizer_id``; returns their folder.

    The folder is filled under a temporary name and renamed into place whole, so a reader (another process
    loading the same id) sees a complete revision or none; then ``current`` is replaced atomically.

    Raises:
        BadRequestError: ``files`` are not a tokenizer (:func:`check_files`).
    """
    check_files(files)
    base = _id_dir(tokenizer_id, root)
    base.mkdir(parents=True, exist_ok=True)
    rev = files_revision(files)
    final = base / rev
    if not final.is_dir():
        tmp = Path(tempfile.mkdtemp(prefix=f".{rev}.", dir=base))
        try:
            for name, data in files.items():
                (tmp / name).write_bytes(data)
            try:
                os.rename(tmp, final)
            except OSError:  # another process renamed the same revision into place first
                if not final.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _write_atomic(base / "current", rev.encode())
    return final


def fetch_tokenizer(transport: Transport, tokenizer_id: str | None = None, root: Path | None = None) -> Path:
    """Fetch the served base model's tokenizer files (``GET /api/v1/tokenizer``) into the SDK's cache; returns
    the folder ``AutoTokenizer.from_pretrained`` loads. A revision already cached is not downloaded again (the
    request carries it as ``If-None-Match``; the server answers 304).

    Args:
        transport: the connection to the server.
        tokenizer_id: the id the server reported (names the cache folder; default: the answer's).
        root: cache root (default :func:`tokenizer_cache_root`).

    Raises:
        UnavailableError: the server cannot be reached; other errors as the route answers them.
        InternalError: an unusable answer (:func:`from_response`).
    """
    cached = cached_tokenizer_dir(tokenizer_id, root) if tokenizer_id else None
    answer = transport.tokenizer(cached.name if cached is not None else None)
    if answer is None and cached is not None:
        return cached
    res = TokenizerFilesResponse.model_validate(answer)
    return store_tokenizer(tokenizer_id or res.tokenizer_id, from_response(res), root)


def load_tokenizer(tokenizer_id: str, transport: Transport | None = None) -> Any:
    """The tokenizer named ``tokenizer_id``. A folder on this machine (what ``get_info`` reports to a caller on the
    server's machine) is loaded as is. With ``transport``: the files the server serves
    (:func:`fetch_tokenizer`; a cached revision is revalidated, not downloaded), with no request to the hub; when
    the server cannot be reached, the revision last fetched. ``AutoTokenizer.from_pretrained(tokenizer_id)`` (the
    local Hugging Face cache or the hub) only without ``transport``, for a server without ``GET /api/v1/tokenizer``,
    or when neither the server nor the SDK's cache has it.

    Raises:
        OSError/ValueError: transformers' error when the id does not resolve and there is no server to ask.
        UnavailableError: neither the server, nor the SDK's cache, nor the hub has it.
        NotFoundError: the server has no ``GET /api/v1/tokenizer`` (an older one) and the id does not resolve.
    """
    from transformers import AutoTokenizer

    from livelora.clients.errors import NotFoundError, UnavailableError

    if transport is None or (os.path.isabs(tokenizer_id) and os.path.isdir(tokenizer_id)):
        return AutoTokenizer.from_pretrained(tokenizer_id)  # a folder: the one the server placed on this machine
    folder: Path | None
    try:
        folder = fetch_tokenizer(transport, tokenizer_id)
    except UnavailableError:
        folder = cached_tokenizer_dir(tokenizer_id)
        if folder is None:
            try:
                return AutoTokenizer.from_pretrained(tokenizer_id)
            except (OSError, ValueError):
                raise UnavailableError(
                    f"tokenizer {tokenizer_id!r}: the server cannot be reached, none is cached, and the id does "
                    "not resolve here"
                ) from None
    except NotFoundError as exc:  # a server without the route
        try:
            return AutoTokenizer.from_pretrained(tokenizer_id)
        except (OSError, ValueError) as hub:
            raise NotFoundError(
                f"tokenizer {tokenizer_id!r} does not resolve here ({type(hub).__name__}: {str(hub)[:200]}) and "
                f"the server serves no tokenizer files (GET /api/v1/tokenizer: {exc})",
                param="tokenizer_id",
            ) from None
    return AutoTokenizer.from_pretrained(str(folder))
