"""Rollout actors: engines, the engine client, agents, and the actor process."""
