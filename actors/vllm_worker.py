"""Runs inside vLLM's worker process (`worker_extension_cls`): loads Tether weights in place.

vLLM calls these methods through `AsyncLLM.collective_rpc`. Only bytes and strings cross that
boundary (vLLM's RPC does not carry tensors), so the worker rebuilds tensors itself with
`transport.weights.unpack`. `model_runner.reload_weights` is the path that works on CPU as well
as GPU (`model.load_weights` breaks on CPU, where oneDNN has pre-packed the linear weights).
"""

from __future__ import annotations

import os

import msgspec


class TetherWorkerExtension:
    def tether_die_with(self, pid: int) -> None:
        """End this worker and its EngineCore parent when process `pid` (the actor) ends,
        however it ends: vLLM's own processes outlive a SIGKILLed actor otherwise."""
        from actors.lifeline import die_with

        die_with(pid, also=(os.getppid(),))

    def tether_load_packed(self, manifest_raw: bytes, buckets: list[bytes]) -> int:
        from transport.messages import WeightManifest
        from transport.weights import unpack

        manifest = msgspec.msgpack.decode(manifest_raw, type=WeightManifest)
        self._tether_reload(unpack(manifest, buckets))
        return manifest.version

    def tether_load_file(self, path: str) -> None:
        from safetensors.torch import load_file

        self._tether_reload(load_file(path))

    def _tether_reload(self, state: dict) -> None:
        # With tied embeddings the learner does not send lm_head.weight, but vLLM's CPU backend
        # keeps a separately packed copy of it: without the head the output keeps old weights.
        from models.tied import with_head

        self.model_runner.reload_weights(weights_iterator=iter(with_head(state).items()))
