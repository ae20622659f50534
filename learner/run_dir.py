"""One run per run directory: a new run never lands on an earlier one, and resume takes only
its own run's checkpoints.

    run_dir/run.json   {"run_id": "..."}: written when a run begins; every checkpoint's
                       state.json and summary.json carry the same id

A new run (`learner.resume` false) into a directory that holds a run (metrics.jsonl,
summary.json, a checkpoint, final_model) stops with one line, unless `learner.overwrite` asks
to replace it: then those files go first. `learner.resume` refuses a newest checkpoint whose
run id is not the directory's. Cheap (no torch): the learner's entry point checks before any
heavy import, so the line comes back at once.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

from configs.schema import TetherConfig

RUN_FILE = "run.json"
RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoints", "final_model", "trace.json",
             "tensorboard", RUN_FILE)
"""What a run leaves in its directory (learner.overwrite removes these); config.yaml,
endpoints.json and logs/ are rewritten by every start and say nothing about a run."""


class RunDirError(ValueError):
    """The run directory and the settings disagree; the message is the one line to show."""


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a `step_N.tmp` left by a crash is not one)."""
    dirs = [p for p in (run_dir / "checkpoints").glob("step_*") if p.name[5:].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[5:]))


def run_id_of(run_dir: Path) -> str | None:
    """The id of the run the directory holds (None: no run.json)."""
    path = run_dir / RUN_FILE
    return json.loads(path.read_text())["run_id"] if path.exists() else None


def checkpoint_run_id(checkpoint: Path) -> str | None:
    """The run id a checkpoint was written by (None: written before checkpoints carried one)."""
    state = checkpoint / "state.json"
    return json.loads(state.read_text()).get("run_id") if state.exists() else None


def held_run(run_dir: Path) -> list[str]:
    """What in `run_dir` shows that a run used it (empty: nothing)."""
    found = [name for name in ("metrics.jsonl", "summary.json") if (run_dir / name).exists()]
    found += [f"checkpoints/{p.name}" for p in checkpoint_dirs(run_dir)[-1:]]
    found += ["final_model"] if (run_dir / "final_model").exists() else []
    return found


def check(cfg: TetherConfig) -> None:
    """Raise RunDirError when a new run would land on a run, or a resume would take another
    run's checkpoint (or has none); read-only."""
    run_dir, L = Path(cfg.run_dir), cfg.learner
    if L.resume:
        latest = checkpoint_dirs(run_dir)[-1:]
        if not latest:
            raise RunDirError(f"learner.resume is true but {run_dir}/checkpoints has none")
        mine, theirs = run_id_of(run_dir), checkpoint_run_id(latest[0])
        if mine and theirs and mine != theirs:
            raise RunDirError(f"learner.resume: {latest[0]} belongs to run {theirs}, but run_dir "
                              f"{run_dir} holds run {mine}")
        return
    found = held_run(run_dir)
    if found and not L.overwrite:
        run_id = run_id_of(run_dir)
        raise RunDirError(f"run_dir {run_dir} holds a run ({f'{run_id}: ' if run_id else ''}"
                          f"{', '.join(found)}): continue it with learner.resume=true, or give a "
                          "new run_dir, or replace it with learner.overwrite=true")


def begin(cfg: TetherConfig) -> str:
    """Check (as `check`), then return the run's id: the directory's on resume (the checkpoint's
    for a directory from before run ids), a new one otherwise, written to run.json after
    learner.overwrite removed the earlier run's files."""
    check(cfg)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.learner.resume:
        run_id = run_id_of(run_dir) or checkpoint_run_id(checkpoint_dirs(run_dir)[-1])
        if run_id is not None:
            return run_id
    else:
        for name in RUN_FILES:
            path = run_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    run_id = uuid.uuid4().hex[:12]
    (run_dir / RUN_FILE).write_text(json.dumps({"run_id": run_id}) + "\n")
    return run_id
