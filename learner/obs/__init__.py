"""Observability: step metrics, the actors' timeline and trace, experiment trackers."""
