"""What the rollouts of accepted results reported about themselves: how each ended, its named
reward scores, its tool calls that did not parse. The learner's I/O thread counts every
accepted GroupResult here (learner/server.py, under its lock); metrics and the summary read
`snapshot()`."""

from __future__ import annotations

import math
from collections import Counter

from transport import messages as m


class RolloutReports:
    def __init__(self) -> None:
        self.ends: Counter[str] = Counter()
        """Rollouts by how they ended: transport.messages.FINISH_REASONS, "error" for a sample
        with an error whatever it claims, or "unreported" for agents that do not say."""
        self.scores: Counter[str] = Counter()
        """Sums of the named reward scores (tasks/rewards.py; finite ones only), and `samples`
        scored."""
        self.tool_parse_errors = 0
        """Model turns whose tool calls did not parse."""

    def count(self, msg: m.GroupResult) -> None:
        """Count one accepted result (kept, or dropped as an agent error: the claims of such a
        group were never validated, so an unknown one counts as "unreported")."""
        self.ends.update(
            "error" if s.error else s.finish if s.finish in m.FINISH_REASONS else "unreported"
            for s in msg.samples)
        for s in msg.samples:
            if s.scores:
                self.scores["samples"] += 1
                self.scores.update({k: v for k, v in s.scores.items() if math.isfinite(v)})
        self.tool_parse_errors += sum(s.tool_parse_errors for s in msg.samples)

    def snapshot(self) -> dict:
        return {"rollout_ends": dict(self.ends), "reward_scores": dict(self.scores),
                "tool_parse_errors": self.tool_parse_errors}
