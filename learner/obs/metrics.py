"""Per-step metrics: one JSON line per step in run_dir/metrics.jsonl, a progress line every
`learner.log_every` steps, TensorBoard when installed, and the `learner.tracker` (W&B / MLflow,
learner/obs/tracking.py) when set."""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from pathlib import Path

from configs.schema import TetherConfig
from learner.obs.tracking import numeric, open_tracker
from transport.messages import FINISH_REASONS

log = logging.getLogger(__name__)


class MetricsLog:
    def __init__(self, path: Path, cfg: TetherConfig, resume_version: int | None) -> None:
        """Start a new log, or (resume) keep the rows up to `resume_version` and append."""
        self.path = path
        self.cfg = cfg
        if resume_version is not None and path.exists():
            keep = [ln for ln in path.read_text().splitlines()
                    if ln.strip() and json.loads(ln)["step"] <= resume_version]
            path.write_text("".join(ln + "\n" for ln in keep))
        self.file = open(path, "a" if resume_version is not None else "w")
        self.tb = None
        if cfg.learner.tensorboard and importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(path.parent / "tensorboard"), purge_step=resume_version)
        self.tracker = open_tracker(cfg, path.parent)
        self.t0 = time.monotonic()
        self.last_t = self.t0
        self.rows: list[dict] = []
        self.ends_seen: dict[str, int] = {}
        """The server's cumulative rollout end counts at the previous row."""
        self.scores_seen: dict[str, float] = {}
        """The server's cumulative named reward score sums at the previous row."""
        self.parse_errors_seen = 0

    def record(self, version: int, m: dict, step_t0: float, server: dict, buffer: dict) -> None:
        now = time.monotonic()
        row = {"step": version, "time_s": round(now - self.t0, 3), **m,
               "train_s": now - step_t0, "tokens_per_s": m["tokens"] / max(now - self.last_t, 1e-9),
               "buffer_size": buffer["size"], "buffer_capacity": buffer["capacity"],
               "dropped_stale": buffer["dropped"].get("stale", 0),
               "dropped_stale_frac": buffer["dropped"].get("stale", 0) / max(buffer["received"], 1),
               "actors_connected": server["actors_connected"],
               "leases_outstanding": server["leases"]["outstanding"],
               **self._ends(server["rollout_ends"]), **self._scores(server["reward_scores"]),
               "tool_parse_errors": server["tool_parse_errors"] - self.parse_errors_seen}
        self.parse_errors_seen = server["tool_parse_errors"]
        self.last_t = now
        self.rows.append({k: row[k] for k in ("step", "time_s", "reward_mean", "staleness_mean")})
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in row.items():
                if k != "step":
                    self.tb.add_scalar(k, v, version)
        if self.tracker is not None:
            self.tracker.log(version, numeric({k: v for k, v in row.items() if k != "step"}))
        if version % self.cfg.learner.log_every == 0 or version == self.cfg.learner.max_steps:
            log.info("step %d/%d | reward %.3f | staleness %.2f (max %d) | %.0f tok/s | "
                     "buffer %d/%d | actors %d | dropped stale %d | clip %.3f | kl %.2e",
                     version, self.cfg.learner.max_steps, row["reward_mean"],
                     row["staleness_mean"], row["staleness_max"], row["tokens_per_s"],
                     row["buffer_size"], row["buffer_capacity"], row["actors_connected"],
                     row["dropped_stale"], row["clip_frac"], row["kl_behavior_prox_k3"])

    def _ends(self, ends: dict[str, int]) -> dict[str, float]:
        """How the rollouts received since the previous step ended: their number and the
        fraction per end reason (answer / max_turns / max_tokens / error)."""
        new = {k: v - self.ends_seen.get(k, 0) for k, v in ends.items()}
        self.ends_seen = dict(ends)
        n = sum(new.values())
        return {"rollouts": n, **{f"end_{r}_frac": new.get(r, 0) / max(n, 1) for r in FINISH_REASONS}}

    def _scores(self, sums: dict[str, float]) -> dict[str, float]:
        """Mean of each named reward score over the rollouts scored since the previous step
        (`score_<name>`; none for tasks whose reward has no named scores)."""
        new = {k: v - self.scores_seen.get(k, 0) for k, v in sums.items()}
        self.scores_seen = dict(sums)
        n = new.pop("samples", 0)
        return {f"score_{k}": v / n for k, v in new.items()} if n else {}

    def close(self) -> None:
        """Close metrics.jsonl and TensorBoard; the tracker stays open for `finish`."""
        self.file.close()
        if self.tb is not None:
            self.tb.close()

    def finish(self, summary: dict) -> None:
        """Give the tracker the run's summary and end its run."""
        if self.tracker is not None:
            self.tracker.summary(summary)
            self.tracker.close()

    def summary(self) -> dict:
        if not self.rows:
            return {}
        last = self.rows[-20:]
        return {"train_reward_last20": sum(r["reward_mean"] for r in last) / len(last),
                "staleness_mean": sum(r["staleness_mean"] for r in self.rows) / len(self.rows)}
