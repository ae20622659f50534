"""Experiment trackers (`learner.tracker`): W&B or MLflow get every step's metrics and the summary.

Neither package is a dependency (`pip install -e .[tracking]` adds both). `require()` runs when
the learner starts, before any model is built: a tracker that is set but not installed is a
`ConfigError` naming the setting and the package. Offline by default (`learner.tracker_online`
false): W&B writes an offline run under run_dir/wandb (`wandb sync` uploads it later), MLflow a
SQLite store run_dir/mlflow.db with artifacts in run_dir/mlartifacts (MLflow 3 refuses plain
file stores; `mlflow ui --backend-store-uri sqlite:///run_dir/mlflow.db`).

Only the trainer thread of rank 0 calls a tracker. A run that crashes before `close()` is ended
by the package's own exit hook.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Protocol

from configs.loader import ConfigError, to_dict
from configs.schema import TetherConfig

PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}
"""learner.tracker value -> the package it needs."""


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record one step's numeric metrics."""

    def summary(self, summary: dict) -> None:
        """Record the run's final summary (nested dict, as in summary.json)."""

    def close(self) -> None:
        """Finish the run; nothing may be logged after."""


def require(cfg: TetherConfig) -> None:
    """Raise ConfigError if `learner.tracker` names a package that is not installed."""
    name = cfg.learner.tracker
    if name != "none" and importlib.util.find_spec(PACKAGES[name]) is None:
        raise ConfigError(f"learner.tracker={name} needs the {PACKAGES[name]!r} package, which is "
                          f"not installed (pip install {PACKAGES[name]}, or pip install -e "
                          f".[tracking]); set learner.tracker=none to run without it")


def open_tracker(cfg: TetherConfig, run_dir: Path) -> Tracker | None:
    """The tracker `learner.tracker` names, started for this run; None for `none`."""
    require(cfg)
    match cfg.learner.tracker:
        case "wandb":
            return WandbTracker(cfg, run_dir)
        case "mlflow":
            return MlflowTracker(cfg, run_dir)
    return None


def numeric(row: dict) -> dict[str, float]:
    """The int/float entries of a flat metrics row (trackers take numbers only)."""
    return {k: float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a/b": 1}."""
    out: dict = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        else:
            out[key] = v
    return out


class WandbTracker:
    def __init__(self, cfg: TetherConfig, run_dir: Path) -> None:
        wandb = importlib.import_module("wandb")
        self.run = wandb.init(project=cfg.learner.tracker_project, name=run_dir.name,
                              dir=str(run_dir), config=to_dict(cfg),
                              mode="online" if cfg.learner.tracker_online else "offline")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def summary(self, summary: dict) -> None:
        self.run.summary.update(flatten(summary))

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, cfg: TetherConfig, run_dir: Path) -> None:
        self.mlflow = importlib.import_module("mlflow")
        artifacts = None
        if not cfg.learner.tracker_online:
            self.mlflow.set_tracking_uri(f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
            artifacts = (run_dir / "mlartifacts").resolve().as_uri()
        name = cfg.learner.tracker_project
        exp = self.mlflow.get_experiment_by_name(name)
        exp_id = (exp.experiment_id if exp is not None
                  else self.mlflow.create_experiment(name, artifact_location=artifacts))
        self.run = self.mlflow.start_run(experiment_id=exp_id, run_name=run_dir.name)
        self.mlflow.log_params(flatten(to_dict(cfg)))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def summary(self, summary: dict) -> None:
        self.mlflow.log_metrics({f"summary/{k}": v for k, v in numeric(flatten(summary)).items()})
        self.mlflow.log_dict(summary, "summary.json")

    def close(self) -> None:
        self.mlflow.end_run()
