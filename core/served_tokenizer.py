"""The served base model's tokenizer files, server side: read from the model's folder with local paths scrubbed
(:func:`read_tokenizer_dir`) and put in the wire form of ``GET /api/v1/tokenizer`` (:func:`to_response`). What the
files are, their revision and what clients do with them: :mod:`livelora.clients.tokenizer_files`.
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from livelora.clients.tokenizer_files import TOKENIZER_FILES, check_files, files_revision
from livelora.clients.types.tinker_ext import TokenizerFile, TokenizerFilesResponse

#: Keys of ``config.json``/``tokenizer_config.json`` that some savers fill with the directory they saved from;
#: dropped when they hold an absolute path (loading never reads them).
_PATH_KEYS = ("_name_or_path", "name_or_path")


def scrub_paths(name: str, data: bytes) -> bytes:
    """``data`` (the bytes of file ``name``) without a ``name_or_path``/``_name_or_path`` holding an absolute file
    path; any other file, or one without such a key, is returned unchanged."""
    if name not in ("config.json", "tokenizer_config.json"):
        return data
    try:
        obj = json.loads(data)
    except ValueError:
        return data
    if not isinstance(obj, dict):
        return data
    drop = [
        k
        for k in _PATH_KEYS
        if isinstance(obj.get(k), str)
        and (os.path.isabs(obj[k]) or obj[k].startswith("~") or re.match(r"^[A-Za-z]:\\", obj[k]))
    ]
    if not drop:
        return data
    return (json.dumps({k: v for k, v in obj.items() if k not in drop}, indent=2, ensure_ascii=False) + "\n").encode()


def read_tokenizer_dir(directory: Path | str) -> dict[str, bytes]:
    """The :data:`TOKENIZER_FILES` present in ``directory`` (``{base name: bytes}``, paths scrubbed by
    :func:`scrub_paths`).

    Raises:
        BadRequestError: neither ``tokenizer.json`` nor ``tokenizer_config.json`` is there.
    """
    src = Path(directory)
    files = {f: scrub_paths(f, (src / f).read_bytes()) for f in TOKENIZER_FILES if (src / f).is_file()}
    check_files(files)
    return files


def to_response(tokenizer_id: str, files: Mapping[str, bytes], aliases: Sequence[str] = ()) -> TokenizerFilesResponse:
    """The wire form of ``files``: text files as UTF-8, others as base64; ``aliases``: the base model's other
    names."""
    out = []
    for name in sorted(files):
        try:
            out.append(TokenizerFile(name=name, encoding="utf-8", content=files[name].decode("utf-8")))
        except UnicodeDecodeError:
            out.append(TokenizerFile(name=name, encoding="base64", content=base64.b64encode(files[name]).decode()))
    return TokenizerFilesResponse(
        tokenizer_id=tokenizer_id, revision=files_revision(files), files=out, aliases=list(aliases)
    )
