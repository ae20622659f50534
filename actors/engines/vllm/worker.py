"""Runs inside vLLM's worker process (`worker_extension_cls`): loads Tether weights in place.

vLLM calls these methods through `AsyncLLM.collective_rpc`. Only bytes and strings cross that
boundary (vLLM's RPC does not carry tensors), so the worker rebuilds tensors itself with
`transport.weights.unpack`. `model_runner.reload_weights` is the path that works on CPU as well
as GPU (`model.load_weights` breaks on CPU, where oneDNN has pre-packed the linear weights).

A version streams in bucket by bucket: `tether_begin_load`, then `tether_load_bucket` once per
bucket (one bucket's bytes per RPC: the RPC's copies are of one bucket, never of the model), then
`tether_end_load`. These are the three phases of vLLM's own in-place reload
(model_loader/reload: initialize_layerwise_reload, model.load_weights, finalize_layerwise_reload),
spread over several calls; a layer is processed (e.g. re-packed for oneDNN) once all its tensors
have arrived.
"""

from __future__ import annotations


import msgspec


def declare_qwen2_head_lora() -> None:
    """Let vLLM adapt a Qwen2 model's `lm_head` (learner.lora.targets with lm_head).

    vLLM finds the modules a model can adapt in its class's `embedding_modules`;
    LlamaForCausalLM lists `lm_head` there, Qwen2ForCausalLM (vLLM 0.32) does not, so vLLM
    refuses a Qwen2 adapter on the head ("expected target modules in ..."). Declaring it hands
    the head to vLLM's own LogitsProcessorWithLoRA, which adds s (h A^T) B^T to the logits; a
    tied head keeps sharing the embedding's weight, which the adapter never touches. Runs in
    vLLM's worker process when it imports this extension, before the model is built."""
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    if "lm_head" not in Qwen2ForCausalLM.embedding_modules:
        Qwen2ForCausalLM.embedding_modules = {**Qwen2ForCausalLM.embedding_modules,
                                              "lm_head": "output_embeddings"}


declare_qwen2_head_lora()


class TetherWorkerExtension:
    def tether_load_packed(self, manifest_raw: bytes, buckets: list[bytes]) -> int:
        from transport.messages import WeightManifest
        from transport.weights import unpack

        manifest = msgspec.msgpack.decode(manifest_raw, type=WeightManifest)
        self._tether_reload(unpack(manifest, buckets))
        return manifest.version

    def tether_begin_load(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())

    def tether_load_bucket(self, manifest_raw: bytes, bucket: memoryview | bytes) -> int:
        """One bucket (its manifest from transport.weights.bucket_manifest); returns the
        number of tensors loaded. `bucket`: in EngineCore's process, a view of the RPC's
        message as EngineCore received it; in a worker process of its own, the bytes EngineCore
        pickled on (engine.py bucket_rpc_args). The tensors are read-only views of it, no copy
        (vLLM's weight loaders only read them, copying each into its parameter)."""
        from models.tied import with_head
        from transport.messages import WeightManifest
        from transport.weights import unpack

        manifest = msgspec.msgpack.decode(manifest_raw, type=WeightManifest)
        state = with_head(unpack(manifest, [bucket], readonly=True))
        self.model_runner.get_model().load_weights(iter(state.items()))
        return len(state)

    def tether_end_load(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        runner = self.model_runner
        finalize_layerwise_reload(runner.get_model(), runner.vllm_config.model_config)
        runner.reset_lora_state()
        runner.reset_encoder_cache()
        runner.reset_mm_cache()

    def tether_load_file(self, path: str) -> None:
        from safetensors.torch import load_file

        self._tether_reload(load_file(path))

    def _tether_reload(self, state: dict) -> None:
        # With tied embeddings the learner does not send lm_head.weight, but vLLM's CPU backend
        # keeps a separately packed copy of it: without the head the output keeps old weights.
        from models.tied import with_head

        self.model_runner.reload_weights(weights_iterator=iter(with_head(state).items()))
