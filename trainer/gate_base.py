"""The evaluation gate's measurement of the base model (adapter off): taken once per store and kept under
``models/gate-base/`` (keyed by the probe set and the base weights), measured in the background when a trainer
starts, with its progress and an estimate of the time left (``GET /v1/learning``)."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

from livelora.clients.types.learning import PASS_WORDS
from livelora.core.atomic import atomic_write_bytes
from livelora.trainer.gate_measure import PASSES, Measurement, ProbeSuite

log = logging.getLogger(__name__)

#: Seconds between progress reports inside one free-form chunk (its replies' tokens so far).
TOKEN_REPORT_S = 2.0
#: Where the base model's gate measurements are kept, under the store.
BASE_CACHE_DIR = Path("models") / "gate-base"


def save_measurement(path: Path, m: Measurement, seconds: float) -> None:
    """Write ``m`` (and the ``seconds`` it took) atomically as a ``torch.save`` file."""
    buf = io.BytesIO()
    doc = {"probe_right": m.probe_right, "logp_M_V": m.logp_M_V, "degenerate": m.degenerate}
    doc.update({"mean_len": m.mean_len, "replies": m.replies, "seconds": seconds})
    doc.update({"freeform": m.freeform, "freeform_texts": m.freeform_texts})
    torch.save(doc, buf)
    atomic_write_bytes(path, buf.getvalue())


def load_measurement(path: Path) -> tuple[Measurement, float] | None:
    """``(measurement, seconds it took)`` read back by :func:`save_measurement`; None when absent or unreadable."""
    try:
        d = torch.load(path, weights_only=True)
        m = Measurement(
            list(d["probe_right"]), d["logp_M_V"], float(d["degenerate"]), float(d["mean_len"]), d["replies"]
        )
        m.freeform, m.freeform_texts = dict(d.get("freeform", {})), dict(d.get("freeform_texts", {}))
        return m, float(d["seconds"])
    except FileNotFoundError:
        return None
    except Exception as exc:  # a torn or foreign file: measured again and rewritten
        log.warning("cached base measurement %s unreadable (%s): measuring again", path, exc)
        return None


class BaseMeasure:
    """The base model's measurement for one gate: ``measurement`` once taken or read, ``source`` (``cache`` or
    ``measured``) and ``seconds`` (what measuring took, read from the cache too).

    Args:
        suite: the gate's probe suite. home: the store. base_id: the base weights' identity
            (:func:`~livelora.core.base_models.base_identity`); None: never cached.
    """

    def __init__(self, suite: ProbeSuite, home: Path, base_id: str | None):
        self.suite, self.home, self.base_id = suite, Path(home), base_id
        self.measurement: Measurement | None = None
        self.source: str | None = None
        self.seconds: float | None = None
        self._lock = threading.Lock()

    def cache_path(self, model: Any) -> Path | None:
        """``<home>/models/gate-base/<sha256(base)[:16]>-<sha256(probes, base, device, dtype)[:16]>.pt`` (None
        without ``base_id``)."""
        if self.base_id is None:
            return None
        dtype = str(next(model.peft_model.parameters()).dtype)
        key = json.dumps([self.suite.fingerprint(), self.base_id, str(model.device), dtype])
        stem = hashlib.sha256(self.base_id.encode()).hexdigest()[:16]
        return self.home / BASE_CACHE_DIR / f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"

    def get(self, model: Any, on_check: Any = None, progress: Any = None) -> Measurement:
        """The measurement: taken once per process, read from the store's cache when the probe set and base weights
        match (:meth:`cache_path`), else measured (:meth:`_measure`) and written there (the same base model's files
        for other probe sets are removed). Thread-safe: a second caller waits."""
        with self._lock:
            if self.measurement is not None:
                return self.measurement
            path = self.cache_path(model)
            got = load_measurement(path) if path is not None else None
            if got is not None:
                (self.measurement, self.seconds), self.source = got, "cache"
                log.info("evaluation gate: base model measurement read from %s (took %.1f s once)", path, got[1])
                return self.measurement
            t0 = time.perf_counter()
            self.measurement = self._measure(model, on_check, progress)
            self.seconds, self.source = time.perf_counter() - t0, "measured"
            log.info("evaluation gate: base model measured in %.1f s", self.seconds)
            if path is not None:
                try:
                    for old in path.parent.glob(path.name.split("-")[0] + "-*.pt"):
                        old.unlink(missing_ok=True)  # the same base model under another probe set: stale
                    save_measurement(path, self.measurement, self.seconds)
                except OSError as exc:
                    log.warning("base measurement not cached at %s: %s", path, exc)
            return self.measurement

    def _measure(self, model: Any, on_check: Any, progress: Any) -> Measurement:
        """Every pass, then the rest of the free-form items chunk by chunk (each chunk one batch, as a candidate's
        are). ``on_check(pass)`` as each pass starts; ``progress(check, left_s)`` then and after each free-form
        chunk (``pass 3 of 3, free-form answers: 30 of 60 items``), and inside a chunk every
        :data:`TOKEN_REPORT_S` (``... (reply tokens: 24 of at most 80)``); ``left_s`` the chunks left times the last
        chunk's seconds, less the time since (None before one is timed)."""
        tell, say = on_check or (lambda name: None), progress or (lambda check, left_s: None)
        ff, started = self.suite.freeform, {}
        passes = [p for p in PASSES if p != "signal" and (p != "freeform" or ff)]

        def words(name: str, done: int | None = None) -> str:
            text = f"pass {passes.index(name) + 1} of {len(passes)}, {PASS_WORDS[name]}"
            return text if done is None else f"{text}: {done} of {len(ff.items)} items"

        last: dict[str, Any] = {"text": "", "left": None, "at": 0.0, "said": 0.0}

        def said(text: str, left: float | None) -> None:
            last.update(text=text, left=left, at=time.perf_counter(), said=time.perf_counter())
            say(text, left)

        def on_token(n: int, most: int) -> None:  # inside a chunk's batch: at most every TOKEN_REPORT_S
            now = time.perf_counter()
            if now - last["said"] >= TOKEN_REPORT_S:
                last["said"] = now
                left = None if last["left"] is None else max(0.0, last["left"] - (now - last["at"]))
                say(f"{last['text']} (reply tokens: {n} of at most {most})", left)

        def pass_started(name: str) -> None:
            started[name] = time.perf_counter()
            tell(name)
            said(words(name, 0) if name == "freeform" and ff else words(name), None)

        if ff is not None:
            ff.on_token = on_token
        try:
            m = self.suite.measure(model, adapter=False, on_check=pass_started)
            if ff is None:
                return m
            k, t = 1, started.get("freeform", time.perf_counter())
            while ff.chunk_end(k) < len(ff.items):
                took, t = time.perf_counter() - t, time.perf_counter()
                left = -(-(len(ff.items) - ff.chunk_end(k)) // ff.chunk)
                said(words("freeform", ff.chunk_end(k)), left * took)
                k += 1
                self.suite.run_pass("freeform", model, m, adapter=False, upto=ff.chunk_end(k))
            return m
        finally:
            if ff is not None:
                ff.on_token = None

    def in_background(self, model: Any, busy: Any, report: Any) -> threading.Thread:
        """Start a daemon thread taking (or reading from the store) the measurement on ``model``, under the
        training flags as a step is (``busy``: :class:`~livelora.core.cpu_share.TrainingFlag`); ``report(None,
        "base", state=..., ...)`` as it starts (``measuring``, with ``check`` and ``left_s`` as it goes) and ends
        (``ready`` with ``source`` and ``seconds``, or ``failed``). A step waits for it (:meth:`get` is locked);
        if it fails, the first step measures."""
        from livelora.core.cpu_share import training_step

        def progress(check: str, left_s: float | None) -> None:
            report(None, "base", state="measuring", check=check, left_s=left_s)

        def run() -> None:
            report(None, "base", state="measuring")
            try:
                with training_step(), busy.held():
                    self.get(model, progress=progress)
                report(None, "base", state="ready", source=self.source, seconds=self.seconds)
            except Exception as exc:
                log.exception("the gate's base measurement at start-up failed")
                report(None, "base", state="failed", reason=str(exc)[:300])

        thread = threading.Thread(target=run, name="livelora-gate-base", daemon=True)
        thread.start()
        return thread
