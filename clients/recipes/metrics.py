"""Step metrics: one JSON line per record in ``metrics.jsonl`` and, when MLflow is installed, an MLflow run.

Metric names are slash-namespaced (``train/loss``, ``train/reward``, ``eval/accuracy``, ``time/step_s``, ...).
MLflow (``pip install livelora[mlflow]``; the light ``mlflow-skinny`` distribution is enough) logs to a local
file store under the run directory (``<log_dir>/mlruns``) unless a tracking URI is given (any URI MLflow
accepts: ``http://...``, ``sqlite:///...``, ``databricks``). MLflow 3 refuses new file stores unless
``MLFLOW_ALLOW_FILE_STORE=true``; the default store sets it (only when it is unset). A resumed run logs to
the same MLflow run (its id is kept in ``<log_dir>/mlflow_run_id``).

A resumed run appends to ``metrics.jsonl``; steps it repeats (done after the last checkpoint and redone)
appear twice, the later line being the one that counts (:func:`read_metrics` keeps it).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

from livelora.clients.recipes.checkpoints import append_jsonl, read_jsonl_lenient

METRICS = "metrics.jsonl"


def mlflow_available() -> bool:
    try:
        import mlflow  # noqa: F401
    except ImportError:
        return False
    return True


def _flat(obj: Any, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in obj.items() if isinstance(obj, dict) else []:
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = str(v)[:500]
    return out


class MetricsLogger:
    """Writes step metrics to ``<log_dir>/metrics.jsonl`` and, if enabled, to MLflow.

    Args:
        log_dir: the run directory.
        recipe: MLflow experiment name (``livelora-<recipe>``).
        config: logged once as MLflow params (flattened, values as text).
        use_mlflow: True (error if not installed), False, or None = when installed.
        tracking_uri: MLflow tracking URI; None = ``file:<log_dir>/mlruns``.

    Raises: ImportError when ``use_mlflow=True`` and MLflow is missing.
    """

    def __init__(
        self,
        log_dir: Path,
        recipe: str,
        config: dict[str, Any],
        *,
        use_mlflow: bool | None = None,
        tracking_uri: str | None = None,
    ):
        self.path = Path(log_dir) / METRICS
        self.mlflow = None
        if use_mlflow is None:
            use_mlflow = mlflow_available()
        if use_mlflow:
            try:
                import mlflow
            except ImportError as exc:
                raise ImportError("mlflow=True but MLflow is not installed: pip install 'livelora[mlflow]'") from exc
            uri = tracking_uri or (Path(log_dir).resolve() / "mlruns").as_uri()
            if uri.startswith("file:") or "://" not in uri:
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            self.client = mlflow.MlflowClient(tracking_uri=uri)
            self.tracking_uri = uri
            exp_name = f"livelora-{recipe}"
            exp = self.client.get_experiment_by_name(exp_name)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(exp_name)
            id_file = Path(log_dir) / "mlflow_run_id"
            run_id = id_file.read_text().strip() if id_file.is_file() else None
            if run_id is None:
                run = self.client.create_run(exp_id, run_name=Path(log_dir).name, tags={"livelora.recipe": recipe})
                run_id = run.info.run_id
                for key, value in _flat(config).items():
                    self.client.log_param(run_id, key, value)
                id_file.write_text(run_id)
            self.run_id = run_id
            self.mlflow = mlflow

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record ``metrics`` of ``step`` (non-finite and non-numeric values go to the JSONL only)."""
        append_jsonl(self.path, {"step": step, **metrics})
        if self.mlflow is not None:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            batch = [
                Metric(k, float(v), now, step)
                for k, v in metrics.items()
                if isinstance(v, (int, float)) and math.isfinite(v)
            ]
            if batch:
                self.client.log_batch(self.run_id, metrics=batch)

    def close(self, status: str = "FINISHED") -> None:
        if self.mlflow is not None:
            self.client.set_terminated(self.run_id, status)


def read_metrics(log_dir: Path) -> dict[int, dict[str, float]]:
    """Metrics by step: for each step, the union of its records, later records winning."""
    out: dict[int, dict[str, float]] = {}
    for rec in read_jsonl_lenient(Path(log_dir) / METRICS):
        step = rec.pop("step", None)
        if isinstance(step, int):
            out.setdefault(step, {}).update(rec)
    return out
