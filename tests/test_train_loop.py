"""learner/main.py's `train` loop on rank 0, with small fakes for what it drives (named below):
how a stop signal that arrives while the learner waits for trajectories ends the run.

With several learner ranks a signal only sets the team's stop flag (learner/distributed.py), and
Ctrl-C, or torchrun passing a signal on, reaches the local actors too, which then exit. The run
must end as an interrupted one (checkpoint, summary), not as "every local actor has exited":
tests/test_fsdp.py's interrupted-then-resumed run failed that way once in a fresh-clone suite,
when the signal came while rank 0 waited for a batch.
"""

from __future__ import annotations

import threading
import types

import pytest

import procs
from configs.loader import load_config
from learner import distributed
from learner import main as learner_main
from learner.obs.timeline import Timeline

PRESET = procs.ROOT / "configs" / "toy_reverse.yaml"


class _Team(distributed.Leader):
    """A several-rank Leader with its real stop flag (request_stop, check_interrupt) and no
    process group: idle() sends nothing, and no signal handler is installed in pytest."""

    def __init__(self) -> None:  # not Leader's: that would take over SIGINT/SIGTERM
        self.ranks = types.SimpleNamespace(world=2)
        self.trainer = types.SimpleNamespace(timeline=Timeline())
        self._interrupted = threading.Event()

    def idle(self) -> None:
        pass


class _Wait:
    """A replay buffer whose every wait for a batch ends empty; with `signal`, the stop signal
    arrived during the wait (as it did with the local actors' exit)."""

    def __init__(self, team: _Team, signal: bool) -> None:
        self.team, self.signal = team, signal

    def take(self, n: int, version: int, timeout: float):
        if self.signal:
            self.team.request_stop()
        return None

    def __len__(self) -> int:
        return 0

    def close(self) -> None:
        pass


class _Server:
    """The learner server's snapshot as it is once every actor has left."""

    stopped = None

    class evaluations:
        """The start round, already in (evaluation runs on the actors)."""

        @staticmethod
        def wait(version: int, timeout: float) -> bool:
            return True

        @staticmethod
        def result(version: int) -> dict:
            return {"samples": 0, "prompts": 0, "errors": 0, "reward_failures": 0}

    ended = False

    def end_training(self) -> None:
        self.ended = True

    def is_alive(self) -> bool:
        return self.stopped is None

    def snapshot(self) -> dict:
        return {"actors_connected": 0, "oldest_actor_weights": -1, "leases": {"outstanding": 0}}

    def stop(self, reason: str) -> None:
        self.stopped = reason


class _Publisher:
    """Nothing is ever published: no step completes."""

    def wait(self) -> None:
        pass


class _ExitedActors:
    """Two local actor processes, both exited."""

    def __len__(self) -> int:
        return 2

    def exited(self) -> list[str]:
        return ["101", "102"]

    def reap(self) -> None:
        pass


class _Metrics:
    rows: list = []

    def close(self) -> None:
        pass


def _train(signal: bool) -> tuple[str, _Server]:
    """train() for at most 5 steps, every local actor gone and no batch ever coming."""
    cfg = load_config(PRESET, ["learner.max_steps=5"])
    team, server = _Team(), _Server()
    st = learner_main.LeadState(task=None, tokenizer=None, drops=None, buffer=_Wait(team, signal),
                                leases=None, server=server, actors=_ExitedActors(),
                                scorers=_ExitedActors(), metrics=_Metrics(), eval_start=0, version=0,
                                publisher=_Publisher())
    reason = learner_main.train(cfg, team, st, learner_main._Sigterm(team))
    learner_main._stop_fleet(st, reason)  # as run() does once training ended
    return reason, server


def test_a_signal_while_waiting_for_trajectories_interrupts_even_with_every_actor_gone():
    reason, server = _train(signal=True)
    assert reason == "interrupted"
    assert server.ended
    assert server.stopped == "interrupted"


def test_every_actor_gone_without_a_signal_is_still_an_error():
    """The check the fix puts first does not hide the real failure."""
    with pytest.raises(RuntimeError, match="every local actor has exited"):
        _train(signal=False)
