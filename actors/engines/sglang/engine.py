"""SGLang rollout engine: SGLang's in-process `Engine`, with weight updates while requests run.

SGLang's tokenizer manager runs inside the actor's event loop; its scheduler and detokenizer are
child processes (docs/engines/sglang.md says why this and not `sglang.launch_server`), forked in CPU
actors (actors/forked.py). The request, update and adapter protocol is
actors/engines/streaming.py's (shared with vLLM); this module is how SGLang does each step.

Weight updates (`actors.engine.update_mode`), each with the engine paused so a version lands whole:

    wait   new requests queue; once the running ones have finished: pause, load, continue
    keep   pause(mode="retract"): running requests go back to the queue and drop their KV;
           load; flush the prefix cache; continue: they recompute their KV with the new weights.
           SGLang records, per request, how many tokens each weight version produced
           (`meta_info["weight_versions"]` spans): that is what `Completion.versions` carries.
    abort  pause(mode="abort"): running requests end with their partial output; each is
           resubmitted as prompt + generated prefix and continues with the new weights.

Weights arrive as Tether's byte buckets; each bucket becomes one uint8 tensor handed to SGLang's
`update_weights_from_tensor(load_format="flattened_bucket")` (SGLang's own layout: a flat byte
tensor plus name/dtype/shape/offsets), between `begin_weight_update` and `end_weight_update`: one
bucket beyond the model is in memory at a time (with `transport.weight_load: streamed`, each as it
arrives: streaming.py). Filesystem weights load with
`update_weights_from_disk` from a per-version directory holding a link to the version file.

LoRA runs (`lora_rank > 0`, docs/lora.md): SGLang starts with `enable_lora` (its `torch_native`
LoRA backend on CPU). The base arrives once and loads like full weights; every adapter version is
added in memory with `load_lora_adapter_from_tensors` under a fresh name, and each request names
the adapter it was submitted with (`lora_path`; SGLang cannot move a running request to another
adapter), so all its tokens carry that adapter's version.

Behavior logprobs are SGLang's `output_token_logprobs`: log of the tempered probabilities it
sampled from (unless SGLANG_RETURN_ORIGINAL_LOGPROB is set, which this module refuses).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

from actors import forked
from actors.engines.base import EngineContext
from actors.engines.streaming import Piece, StreamingEngine
from configs.engines import SGLangEngineConfig
from transport.lifeline import die_with

log = logging.getLogger(__name__)

_PAUSE = {"wait": "retract", "keep": "retract", "abort": "abort"}
"""SGLang pause mode per update_mode. `wait` pauses only once none of our requests runs, so its
retract moves nothing back to the queue; it still clears the finished requests the scheduler has
not yet filtered out of its running batch. (An "in_place" pause froze those there, and the
cache flush after the load then failed with "requests are still running".)"""
LORA_SLOTS = 4
"""Adapters in one running batch (`max_loras_per_batch`): old versions still finishing + the new;
requests on a fifth wait in SGLang's queue."""
_ACTOR_PID = "TETHER_SGLANG_ACTOR_PID"
"""Environment variable (inherited by SGLang's children): the pid whose exit ends them."""


def _engine_class() -> type:
    """SGLang's `Engine` with Tether's scheduler and detokenizer entry points (they end when this
    process ends) and a launch that leaves this process's multiprocessing start method as it was
    (SGLang sets it for the whole process: "spawn", or "fork" by `_fork_children`)."""
    from sglang.srt.entrypoints.engine import Engine as SGLangBase

    class Engine(SGLangBase):
        run_scheduler_process_func = staticmethod(_scheduler_process)
        run_detokenizer_process_func = staticmethod(_detokenizer_process)

        @classmethod
        def _launch_subprocesses(cls, *args, **kwargs):
            import multiprocessing

            method = multiprocessing.get_start_method(allow_none=True)
            try:
                return super()._launch_subprocesses(*args, **kwargs)
            finally:
                multiprocessing.set_start_method(method, force=True)

    return Engine


def _engine_kwargs(model_dir: str | Path, seed: int, max_total_tokens: int,
                   mem_fraction_static: float, lora_rank: int, lora_targets: tuple[str, ...],
                   cpu: bool, dtype: str = "float32", tp_size: int = 1,
                   base_gpu_id: int = 0) -> dict:
    """SGLang's server arguments for an actor's engine (placeholder weights, no tokenizer),
    computing in `dtype` (model.dtype, resolved), on `tp_size` GPUs from `base_gpu_id` (of
    those in the actor's CUDA_VISIBLE_DEVICES) when on CUDA."""
    kw = dict(model_path=str(model_dir), dtype=dtype, load_format="dummy",
              skip_tokenizer_init=True, random_seed=seed, sleep_on_idle=True,
              disable_overlap_schedule=True, log_level="warning")
    if max_total_tokens:
        kw["max_total_tokens"] = max_total_tokens
    if mem_fraction_static:
        kw["mem_fraction_static"] = mem_fraction_static
    if cpu:
        kw.update(device="cpu", attention_backend="torch_native", disable_cuda_graph=True)
    else:
        kw.update(tp_size=tp_size, base_gpu_id=base_gpu_id)
    if lora_rank:
        # no max_loaded_loras: SGLang would then evict adapters by itself; only Tether unloads
        kw.update(enable_lora=True, max_lora_rank=lora_rank,
                  lora_target_modules=list(lora_targets), max_loras_per_batch=LORA_SLOTS)
        if cpu:
            kw["lora_backend"] = "torch_native"
    return kw


class SGLangEngine(StreamingEngine):
    def __init__(self, model_dir: str | Path, update_mode: str, seed: int, max_total_tokens: int,
                 mem_fraction_static: float, on_sigterm: Callable[[], None] | None = None,
                 lora_rank: int = 0, lora_targets: tuple[str, ...] = (),
                 dtype: str = "float32", cpu: bool | None = None, tp_size: int = 1,
                 base_gpu_id: int = 0) -> None:
        """Start SGLang with placeholder weights; nothing is generated before `load_*`.
        `lora_rank > 0`: a LoRA run's actor (the base once, then adapters of that rank on the
        modules `lora_targets`, peft's names).
        Blocks for the engine start-up (40 s or more on CPU): call it from a worker thread that
        lives as long as the engine (SGLang's children die with the thread that started them).
        `on_sigterm` replaces SGLang's own SIGTERM handler in this process (the actor's stop).
        `dtype`: what the model computes in (checked against what SGLang runs). `cpu`: SGLang's
        CPU engine (None: where NVML counts no GPU; CUDA is not initialised to find out)."""
        super().__init__(model_dir, update_mode)
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "0").lower() in ("1", "true"):
            raise ValueError("SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would return untempered "
                             "logprobs, not those of the distribution it sampled from; unset it")
        from models.devices import cuda_count

        if cpu is None:
            cpu = cuda_count() <= 0
        if cpu:
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # read by SGLang at import, inherited by its children
        Engine = _engine_class()
        if cpu and forked.enabled():
            _fork_children()
        os.environ[_ACTOR_PID] = str(os.getpid())
        self.model_dir = Path(model_dir)
        kw = _engine_kwargs(model_dir, seed, max_total_tokens, mem_fraction_static, lora_rank,
                            lora_targets, cpu, dtype, tp_size, base_gpu_id)
        root = logging.getLogger()
        handlers, level = root.handlers[:], root.level
        self.engine = Engine(**kw)
        root.handlers[:] = handlers  # SGLang's logging.basicConfig(force=True) replaced the actor's
        root.setLevel(level)
        self._on_sigterm = on_sigterm
        self._group_joined = False
        """transport.weights_via=nccl: joined the learner's broadcast group."""
        running = str(self.engine.tokenizer_manager.model_config.dtype)
        if running != f"torch.{dtype}":  # behavior logprobs' dtype: what the learner checks
            self.engine.shutdown()
            raise ValueError(f"SGLang runs the model in {running}, model.dtype is {dtype}")
        log.info("SGLangEngine started (update_mode %s, %s; child processes %s)", update_mode,
                 kw.get("device", "cuda"), self.engine.get_all_child_pids())

    def _attach(self) -> None:
        """Start SGLang's output loop in this (the actor's) event loop, keeping our SIGTERM."""
        tm = self.engine.tokenizer_manager
        if tm.event_loop is None:
            if self._on_sigterm is not None:
                tm.signal_handler_class = _signal_handler_class(self._on_sigterm)
            tm.auto_create_handle_loop()

    async def _request(self, prompt: list[int], max_new_tokens: int, temperature: float,
                       seed: int, adapter) -> Piece:
        """One streamed SGLang request (on adapter `adapter`, a name, if any)."""
        self._attach()
        params = {"max_new_tokens": max_new_tokens, "temperature": temperature,
                  "sampling_seed": seed}
        stream = await self.engine.async_generate(input_ids=prompt, sampling_params=params,
                                                  return_logprob=True, stream=True,
                                                  rid=f"t{next(self._ids)}-{os.getpid()}",
                                                  lora_path=adapter)
        out, seen = None, 0
        async for out in stream:  # each output is cumulative
            n = len(out["output_ids"])
            self._received(n - seen)
            seen = n
        info = out["meta_info"]
        new = [int(t) for t in out["output_ids"]]
        lps = [float(x[0]) for x in info["output_token_logprobs"]]
        versions = None if adapter is not None else _span_versions(info.get("weight_versions"),
                                                                   len(new))
        reason = info["finish_reason"]["type"] if info["finish_reason"] else "abort"
        return Piece(new, lps, versions, reason)

    async def _pause(self, mode: str) -> None:
        """`wait` pauses only once none of our requests runs (SGLang's pause has no mode that
        lets running requests finish)."""
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        self._attach()
        if mode == "wait":
            await self._until_idle()
        await self.engine.tokenizer_manager.pause_generation(
            PauseGenerationReqInput(mode=_PAUSE[mode]))

    async def _resume(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        await self.engine.tokenizer_manager.continue_generation(
            ContinueGenerationReqInput(torch_empty_cache=False))

    async def _load_from_file(self, path: str, version: int) -> None:
        await self._load_disk(path, version)

    async def _prepare_adapter(self, adapter_id: int, manifest, buckets: list):
        """The adapter's tensors (peft names) and config, loaded in memory by `_add_adapter`."""
        from models.lora import PEFT_PREFIX
        from transport.weights import unpack

        self._attach()
        v, spec = manifest.version, manifest.lora
        tensors = {PEFT_PREFIX + k: t for k, t in unpack(manifest, buckets).items()}
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank,
                  "lora_alpha": spec.alpha, "target_modules": list(spec.targets),
                  "lora_dropout": 0.0, "bias": "none"}
        return f"a{adapter_id}-v{v}", config, tensors

    async def _add_adapter(self, prepared) -> str:
        from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput
        from sglang.srt.utils.common import MultiprocessingSerializer

        name, config, tensors = prepared
        result = await self.engine.tokenizer_manager.load_lora_adapter_from_tensors(
            LoadLoRAAdapterFromTensorsReqInput(
                lora_name=name, config_dict=config,
                serialized_named_tensors=[MultiprocessingSerializer.serialize(tensors)]), None)
        _check((result.success, result.error_message), f"load_lora_adapter_from_tensors ({name})")
        return name

    async def _remove_adapter(self, handle: str) -> None:
        from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

        result = await self.engine.tokenizer_manager.unload_lora_adapter(
            UnloadLoRAAdapterReqInput(lora_name=handle), None)
        _check((result.success, result.error_message), f"unload_lora_adapter ({handle})")

    def loaded_adapters(self) -> set[str]:
        """LoRA runs: the adapters SGLang's registry holds now (by name)."""
        return set(self.engine.tokenizer_manager.lora_registry.get_all_adapters())

    async def _begin_stream(self, manifest) -> None:
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

        _check(await self.engine.tokenizer_manager.begin_weight_update(
            BeginWeightUpdateReqInput(), None), "begin_weight_update")

    async def _stream_bucket(self, manifest, index: int, bucket) -> None:
        """The last bucket flushes the cache and names the version SGLang labels tokens with
        (a stream that stops part-way names none)."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        flat, metas = _bucket_tensor(manifest, index, bucket, FlattenedTensorMetadata)
        payload = MultiprocessingSerializer.serialize({"flattened_tensor": flat, "metadata": metas})
        last = index == manifest.num_buckets - 1
        _check(await self.engine.tokenizer_manager.update_weights_from_tensor(
            UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=[payload], load_format="flattened_bucket",
                flush_cache=last, weight_version=str(manifest.version) if last else None), None),
            f"update_weights_from_tensor (v{manifest.version}, bucket {index})")

    async def _end_stream(self, manifest, label: bool) -> None:
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

        _check(await self.engine.tokenizer_manager.end_weight_update(EndWeightUpdateReqInput(),
                                                                     None), "end_weight_update")

    async def receive_broadcast(self, manifest, plan) -> None:
        """Version `manifest.version` by the learner's broadcast (transport/weightsrc/nccl.py,
        SGLang's update_weights_from_distributed): join the group on the first call (it blocks
        until the learner and every engine joined), then pause, receive, resume."""
        from sglang.srt.managers.io_struct import (BeginWeightUpdateReqInput,
                                                   EndWeightUpdateReqInput,
                                                   InitWeightsUpdateGroupReqInput,
                                                   UpdateWeightsFromDistributedReqInput)

        from transport.weightsrc.nccl import GROUP

        self._attach()
        tm = self.engine.tokenizer_manager
        if not self._group_joined:
            _check(await tm.init_weights_update_group(InitWeightsUpdateGroupReqInput(
                master_address=plan.master_address, master_port=plan.master_port,
                rank_offset=plan.rank_offset, world_size=plan.world_size, group_name=GROUP,
                backend=plan.backend), None), "init_weights_update_group")
            self._group_joined = True

        async def receive() -> None:
            _check(await tm.begin_weight_update(BeginWeightUpdateReqInput(), None),
                   "begin_weight_update")
            _check(await tm.update_weights_from_distributed(UpdateWeightsFromDistributedReqInput(
                names=[t.name for t in manifest.tensors],
                dtypes=[t.dtype for t in manifest.tensors],
                shapes=[list(t.shape) for t in manifest.tensors], group_name=GROUP,
                flush_cache=True, weight_version=str(manifest.version)), None),
                f"update_weights_from_distributed (v{manifest.version})")
            _check(await tm.end_weight_update(EndWeightUpdateReqInput(), None),
                   "end_weight_update")

        await self._update(manifest.version, receive(), self.update_mode)

    async def _load_disk(self, path: str, version: int) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        directory = self.model_dir / "sglang_versions" / f"v{version:08d}"
        directory.mkdir(parents=True, exist_ok=True)
        link = directory / "model.safetensors"
        link.unlink(missing_ok=True)
        link.symlink_to(Path(path).resolve())
        result = await self.engine.tokenizer_manager.update_weights_from_disk(
            UpdateWeightFromDiskReqInput(model_path=str(directory), load_format="safetensors",
                                         weight_version=str(version)), None)
        _check(result[:2], f"update_weights_from_disk ({path})")
        for old in sorted(directory.parent.glob("v*"))[:-1]:
            for f in old.iterdir():
                f.unlink()
            old.rmdir()

    def shutdown(self) -> None:
        """Stop SGLang's processes. (If this process is killed instead, they stop by themselves:
        each watches this process, `_scheduler_process` and `_detokenizer_process`.)"""
        self.engine.shutdown()


def make(section: SGLangEngineConfig, ctx: EngineContext) -> SGLangEngine:
    """`actors.engine: sglang`, stopped with the actor (SIGTERM stays the actor's)."""
    cfg = ctx.cfg
    llm = SGLangEngine(ctx.model_dir, section.update_mode, seed=cfg.learner.seed,
                       max_total_tokens=section.max_total_tokens,
                       mem_fraction_static=section.mem_fraction_static,
                       on_sigterm=ctx.on_sigterm, dtype=ctx.dtype,
                       cpu=ctx.device.type == "cpu", tp_size=section.tp_size,
                       base_gpu_id=section.base_gpu_id, lora_rank=cfg.learner.lora.rank,
                       lora_targets=tuple(cfg.learner.lora.target_list()))
    ctx.closers.append(llm.shutdown)
    return llm


def _fork_children() -> None:
    """SGLang's scheduler and detokenizer by fork, not spawn (CPU actors: actors/forked.py).
    SGLang sets the start method to "spawn" in `_set_envs_and_config`, which its launch calls
    just before it starts them; this process's copy of that function sets "fork" after it
    (sglang 0.5.23, pinned), and `Engine._launch_subprocesses` puts the method back afterwards.
    Forked, SGLang's spawn-only hooks around the start (`numa_utils.configure_subprocess`'s
    numactl wrapper, the memory saver's LD_PRELOAD) do not apply: neither is on in Tether's
    CPU engines. Idempotent."""
    import multiprocessing

    import sglang.srt.entrypoints.engine as launch

    set_up = launch._set_envs_and_config
    if getattr(set_up, "tether_fork", False):
        return

    def then_fork(server_args) -> None:
        set_up(server_args)
        multiprocessing.set_start_method("fork", force=True)

    then_fork.tether_fork = True
    launch._set_envs_and_config = then_fork


def _scheduler_process(*args, **kwargs):
    """SGLang's scheduler process, ended with the actor (SGLang's own PR_SET_PDEATHSIG ties it to
    the thread that started it, and a SIGKILLed actor has been seen to leave it running)."""
    import torch
    from sglang.srt.managers.scheduler import run_scheduler_process

    die_with(int(os.environ[_ACTOR_PID]))
    if not torch.cuda.is_available():
        from actors.engines.sglang.cpu import unpinned_host_memory

        unpinned_host_memory()  # SGLang's LoRA layers pin host memory (actors/engines/sglang/cpu.py)
    return run_scheduler_process(*args, **kwargs)


def _detokenizer_process(*args, **kwargs):
    """SGLang's detokenizer process, ended with the actor (as `_scheduler_process`)."""
    from sglang.srt.managers.detokenizer_manager import run_detokenizer_process

    die_with(int(os.environ[_ACTOR_PID]))
    return run_detokenizer_process(*args, **kwargs)


def _bucket_tensor(manifest, index: int, buf, metadata_cls):
    """Bucket `index` as one flat uint8 tensor plus SGLang's per-tensor metadata."""
    import torch

    from transport.weights import _DTYPES

    flat = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    metas = []
    for m in manifest.tensors:
        if m.bucket != index:
            continue
        dtype = _DTYPES[m.dtype]
        if m.offset % dtype.itemsize or m.offset + m.nbytes > len(flat):
            raise ValueError(f"weights v{manifest.version}: tensor {m.name} is misplaced in "
                             f"bucket {index} (offset {m.offset}, {m.nbytes} bytes)")
        metas.append(metadata_cls(name=m.name, shape=torch.Size(m.shape), dtype=dtype,
                                  start_idx=m.offset, end_idx=m.offset + m.nbytes, numel=m.nbytes))
    return flat, metas


def _check(result, what: str) -> None:
    success, message = result
    if not success:
        raise RuntimeError(f"SGLang {what} failed: {message}")


def _span_versions(spans, n_total: int) -> list[int]:
    """Per-token versions of one SGLang request from its version spans."""
    out: list[int] = []
    for span in spans or []:
        v = -1 if span["version"] == "default" else int(span["version"])
        out.extend([v] * (span["end"] - span["start"]))
    if len(out) != n_total:
        raise RuntimeError(f"SGLang labelled {len(out)} of {n_total} tokens with a weight version")
    return out


def _signal_handler_class(on_sigterm: Callable[[], None]):
    from sglang.srt.managers.tokenizer_manager import SignalHandler

    class KeepActorSigterm(SignalHandler):
        """SGLang's handler, except that SIGTERM stops the actor (which then shuts SGLang down)."""

        def sigterm_handler(self, signum=None, frame=None):
            on_sigterm()

    return KeepActorSigterm
