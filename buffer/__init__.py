"""The replay buffer between the learner's trajectory receiver and its trainer."""

from buffer.record import TrajGroup
from buffer.replay import DropReason, ReplayBuffer

__all__ = ["DropReason", "ReplayBuffer", "TrajGroup"]
