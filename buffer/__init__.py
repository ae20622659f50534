"""The replay buffer between the learner's trajectory receiver and its trainer."""

from buffer.replay import DropReason, ReplayBuffer, TrajGroup

__all__ = ["DropReason", "ReplayBuffer", "TrajGroup"]
