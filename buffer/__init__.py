"""The replay buffer between the learner's trajectory receiver and its trainer."""

from buffer.accounting import DropReason, Drops
from buffer.record import TrajGroup
from buffer.replay import ReplayBuffer

__all__ = ["DropReason", "Drops", "ReplayBuffer", "TrajGroup"]
