"""The Megatron-core backend: the backend, HF <-> Megatron conversion, the CPU redirects."""
