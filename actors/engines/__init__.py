"""Rollout engines: one module (or folder) per kind, the protocol in base.py."""
