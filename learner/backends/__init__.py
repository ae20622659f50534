"""Training backends: one module (or folder) per kind, the protocol in base.py."""
