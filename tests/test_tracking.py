"""learner.tracker: W&B / MLflow sinks, tested with small named fakes injected as the packages
(neither package is installed by test.sh), and the error when the package is missing."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest

from configs.loader import ConfigError, load_config
from learner.obs import tracking
from learner.obs.metrics import MetricsLog

from conftest import ROOT

PRESET = ROOT / "configs" / "toy_reverse.yaml"

STEP = {"tokens": 64, "reward_mean": 0.5, "staleness_mean": 0.25, "staleness_max": 1,
        "clip_frac": 0.0, "kl_behavior_prox_k3": 1e-4}
SERVER = {"actors_connected": 2, "leases": {"outstanding": 3}, "rollout_ends": {"answer": 4},
          "reward_scores": {}, "tool_parse_errors": 0}
BUFFER = {"size": 1, "capacity": 32, "dropped": {"stale": 1}, "received": 10}


def _cfg(tmp_path, tracker: str):
    return load_config(PRESET, [f"run_dir={tmp_path}", f"learner.tracker={tracker}",
                                "learner.tensorboard=false", "learner.max_steps=3"])


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec() sees it installed
    mod.__dict__.update(attrs)
    return mod


class FakeWandbRun:
    def __init__(self, calls: list) -> None:
        self.calls = calls
        self.summary = {}

    def log(self, metrics, step):
        self.calls.append(("log", step, metrics))

    def finish(self):
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
    calls: list = []

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeWandbRun(calls)

    monkeypatch.setitem(sys.modules, "wandb", _module("wandb", init=init))
    return calls


@pytest.fixture
def fake_mlflow(monkeypatch):
    calls: list = []

    def recorder(name):
        return lambda *args, **kwargs: calls.append((name, args, kwargs))

    names = ("set_tracking_uri", "start_run", "log_params", "log_metrics", "log_dict", "end_run")
    fns = {n: recorder(n) for n in names}

    def create_experiment(name, artifact_location):
        calls.append(("create_experiment", (name, artifact_location), {}))
        return "7"

    monkeypatch.setitem(sys.modules, "mlflow", _module(
        "mlflow", **fns, get_experiment_by_name=lambda name: None,
        create_experiment=create_experiment))
    return calls


def _three_steps(cfg, tmp_path) -> MetricsLog:
    log = MetricsLog(tmp_path / "metrics.jsonl", cfg, resume_version=None)
    for v in (1, 2, 3):
        log.record(v, {**STEP, "reward_mean": v / 10}, step_t0=0.0, server=SERVER, buffer=BUFFER)
    log.close()
    log.finish({"steps": 3, "accounting_ok": True, "groups": {"consumed": 48, "dropped": {}},
                "end_reason": "finished"})
    return log


def test_wandb_gets_every_step_the_summary_and_is_finished(tmp_path, fake_wandb):
    log = _three_steps(_cfg(tmp_path, "wandb"), tmp_path)
    init = fake_wandb[0]
    assert init[0] == "init" and init[1]["mode"] == "offline"
    assert init[1]["dir"] == str(tmp_path) and init[1]["project"] == "tether"
    assert init[1]["config"]["learner"]["tracker"] == "wandb"
    steps = [c for c in fake_wandb if c[0] == "log"]
    assert [c[1] for c in steps] == [1, 2, 3]
    assert [c[2]["reward_mean"] for c in steps] == [0.1, 0.2, 0.3]
    assert steps[0][2]["actors_connected"] == 2.0 and "step" not in steps[0][2]
    assert fake_wandb[-1] == ("finish",)
    assert log.tracker.run.summary["groups/consumed"] == 48
    assert log.tracker.run.summary["accounting_ok"] is True


def test_mlflow_uses_a_local_store_in_run_dir_logs_every_step_and_ends(tmp_path, fake_mlflow):
    _three_steps(_cfg(tmp_path, "mlflow"), tmp_path)
    names = [c[0] for c in fake_mlflow]
    assert names[:4] == ["set_tracking_uri", "create_experiment", "start_run", "log_params"]
    assert fake_mlflow[0][1][0] == f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}"
    assert fake_mlflow[1][1] == ("tether", (tmp_path / "mlartifacts").resolve().as_uri())
    assert fake_mlflow[2][2]["experiment_id"] == "7"
    assert fake_mlflow[3][1][0]["learner/tracker"] == "mlflow"
    steps = [c for c in fake_mlflow if c[0] == "log_metrics" and "step" in c[2]]
    assert [c[2]["step"] for c in steps] == [1, 2, 3]
    assert steps[2][1][0]["reward_mean"] == 0.3
    summary = [c for c in fake_mlflow if c[0] == "log_metrics" and "step" not in c[2]]
    assert summary[0][1][0] == {"summary/steps": 3.0, "summary/groups/consumed": 48.0}
    assert names[-2:] == ["log_dict", "end_run"]


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_missing_package_is_a_config_error_naming_setting_and_package(tmp_path, monkeypatch,
                                                                      tracker):
    monkeypatch.setitem(sys.modules, tracker, None)  # find_spec() -> None: not installed
    cfg = _cfg(tmp_path, tracker)
    with pytest.raises(ConfigError, match=f"learner.tracker={tracker} needs the '{tracker}' package"):
        tracking.require(cfg)
    with pytest.raises(ConfigError, match=f"learner.tracker={tracker}"):
        MetricsLog(tmp_path / "metrics.jsonl", cfg, resume_version=None)


def test_cli_refuses_to_start_without_the_package(tmp_path, monkeypatch, capsys):
    from learner.__main__ import main

    monkeypatch.setitem(sys.modules, "mlflow", None)
    assert main(["-c", str(PRESET), f"run_dir={tmp_path}", "learner.tracker=mlflow"]) == 2
    err = capsys.readouterr().err
    assert "learner.tracker=mlflow needs the 'mlflow' package" in err
    assert not (tmp_path / "config.yaml").exists()


def test_tracker_none_opens_nothing(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl", _cfg(tmp_path, "none"), resume_version=None)
    assert log.tracker is None
    log.close()
    log.finish({})


def test_unknown_tracker_is_refused():
    with pytest.raises(ConfigError, match="learner.tracker must be one of none, wandb, mlflow"):
        load_config(PRESET, ["learner.tracker=comet"])
