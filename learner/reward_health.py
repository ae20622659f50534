"""Stop a run whose reward keeps failing: past `task.reward_max_error_frac` of failed calls
(errors and timeouts, the `reward_error` / `reward_timeout` flags every scored rollout carries)
over the last `task.reward_error_window` scored rollouts, or in the held-out evaluation, the
run ends with one line naming the reward (RewardFailing) instead of training on zeros."""

from __future__ import annotations

from collections import deque

from configs.schema import TetherConfig

FLAGS = ("reward_error", "reward_timeout")


class RewardFailing(RuntimeError):
    """The reward failed on too many calls; the message names it and the figures."""


class RewardHealth:
    def __init__(self, cfg: TetherConfig) -> None:
        t = cfg.task
        self.spec = t.reward or f"the reward of task.name={t.name}"
        self.max_frac, self.window = t.reward_max_error_frac, t.reward_error_window
        self.seen: dict[str, float] = {}
        self.recent: deque[tuple[int, int]] = deque()
        """(rollouts scored, of them failed) per observation, newest last, covering the window."""

    def check(self, scored: int, failed: int, where: str) -> None:
        """Raise RewardFailing when `failed` of `scored` calls are too many (at least a window's
        worth of calls, or the whole of an evaluation)."""
        if scored and failed / scored > self.max_frac:
            raise RewardFailing(
                f"task.reward {self.spec} failed on {failed} of {scored} calls {where} (errors and "
                f"timeouts; more than task.reward_max_error_frac={self.max_frac:g}): fix the "
                "reward, or see the warnings above for its error")

    def observe(self, sums: dict[str, float]) -> None:
        """Take the learner's cumulative reward_scores sums (server snapshot) and check the
        rollouts scored over the last window."""
        new = {k: v - self.seen.get(k, 0.0) for k, v in sums.items()}
        self.seen = dict(sums)
        scored = int(new.get("samples", 0))
        if not scored:
            return
        self.recent.append((scored, int(sum(new.get(f, 0.0) for f in FLAGS))))
        while sum(n for n, _ in self.recent) - self.recent[0][0] >= self.window:
            self.recent.popleft()
        total = sum(n for n, _ in self.recent)
        if total >= self.window:
            self.check(total, sum(f for _, f in self.recent), f"in the last {total} rollouts")
