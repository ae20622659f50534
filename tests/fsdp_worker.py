"""Run under torchrun by tests/test_fsdp.py: the FSDP2 backend + Trainer on a fixed batch sequence.

    torchrun --standalone --nproc_per_node 2 tests/fsdp_worker.py train  OUT MODEL_DIR
    torchrun --standalone --nproc_per_node 2 tests/fsdp_worker.py resume OUT MODEL_DIR [CKPT NAME]

train:  (0) sharded loading: each rank's shards against the files (`check_load`);
        (1) for each loss aggregation, one step with clipping off on batch 0: the loss metrics
        and the full gradients go to OUT/grads_{agg}.* (and to OUT/grads_micro*.* for token_mean
        with MICRO_OVERRIDES and UNEVEN_OVERRIDES); (2) STEPS steps on batches 0..STEPS-1,
        a DCP checkpoint after step CKPT_AT, the full weights after every step, an HF export;
        (3) the same with a critic and a reference model (`train_algos`).
lora:   STEPS steps with LoRA adapters (LORA_OVERRIDES, with the frozen-base KL reference):
        a checkpoint after step CKPT_AT, the adapters after the last step, and an HF export
        (merged model + adapter).
packed: one step with packed micro-batches (PACKED_OVERRIDES): OUT/grads_packed.*.
resume: a fresh process group loads CKPT (default OUT/ckpt; any backend's checkpoint) and trains
        batches CKPT_AT..STEPS-1; the weights go to OUT/NAME (default resume_final.safetensors).
Only rank 0 writes files (besides the checkpoint's shards).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from buffer.record import TrajGroup
from configs.loader import load_config
from configs.schema import FSDP2BackendConfig
from learner import distributed
from learner.backends.registry import make_backend
from learner.algo.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "configs" / "toy_reverse.yaml"
STEPS = 6
CKPT_AT = 3
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "constant")
TRAIN_OVERRIDES = ["learner.prompts_per_step=8", "learner.group_size=4", "learner.minibatches=2",
                   "learner.correction=decoupled", "learner.max_grad_norm=0.5"]
"""The N-step run: two optimizer steps per batch, clipping by global norm active."""
ALGO_OVERRIDES = ["learner.advantage=gae", "learner.lam=0.9", "learner.kl_coef=0.1",
                  "learner.entropy_coef=0.01"]
"""The N-step run with a critic (GAE) and the reference KL in the loss (docs/algorithms.md)."""
LORA_OVERRIDES = ["learner.lora.rank=4", "learner.lora.alpha=8",
                  "learner.lora.targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,"
                  "lm_head", "learner.kl_coef=0.1"]
"""The N-step LoRA run (docs/lora.md): adapters only (the tied head's too), the reference is
the adapter-free base."""
MICRO_OVERRIDES = ["learner.max_tokens_per_microbatch=48", "learner.activation_checkpointing=true"]
"""The one-step gradients again with micro-batches (each rank's 16 rows in several) and
activation checkpointing: still the single-process one-batch gradients."""
UNEVEN_OVERRIDES = ["learner.max_tokens_per_microbatch=32", "learner.activation_checkpointing=true"]
"""The same with a budget that splits rank 0's share into 6 micro-batches and rank 1's into 7
(tests/test_fsdp.py checks): rank 0 runs a stand-in, or the ranks' collectives would hang."""
PACKED_OVERRIDES = [*ALGO_OVERRIDES, "learner.max_tokens_per_microbatch=20",
                    "learner.pack_rows=true"]
"""Packed micro-batches with a critic and the reference (tests/test_packing.py): the budget
packs rank 0's share into 8 micro-batches and rank 1's into 11 (rank 0 runs 3 stand-ins)."""


def config(model_dir: Path, *overrides: str):
    return load_config(PRESET, [f"model.path={model_dir}", *TRAIN_OVERRIDES, *overrides])


def synthetic_groups(cfg, step: int) -> list[TrajGroup]:
    """A deterministic batch for `step`: task prompts, random completions of varying length,
    behavior logprobs, versions step-1..step, a few masked tokens, rewards in quarters."""
    from transformers import AutoTokenizer

    from tasks import make_task

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    task = make_task(cfg.task, tokenizer, seed=0)
    rng = np.random.default_rng(1000 + step)
    L, T = cfg.learner, cfg.task.max_new_tokens
    groups = []
    for k in range(L.prompts_per_step):
        p = task.train_prompt(step * L.prompts_per_step + k)
        lens = rng.integers(1, T + 1, size=L.group_size)
        comps = [rng.integers(4, 16, size=n).astype(np.int64) for n in lens]
        masks = [(rng.random(n) > 0.1).astype(np.float32) for n in lens]
        groups.append(TrajGroup.build(
            lease_id=k, prompt_id=p.prompt_id, actor_id="synthetic",
            prompt_ids=p.token_ids.astype(np.int64), completions=comps,
            logprobs=[np.log(rng.uniform(0.05, 1.0, size=n)).astype(np.float32) for n in lens],
            versions=[np.maximum(step - rng.integers(0, 2, size=n), 0).astype(np.int64)
                      for n in lens],
            loss_masks=masks, rewards=(rng.integers(0, 5, size=L.group_size) / 4).astype(np.float32)))
    return groups


def full_grads(backend) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in backend.model.named_parameters()}


def make(cfg, ranks):
    from models.devices import torch_dtype

    # the critic and reference too (make_models); the weights' dtype as the config says
    cfg.learner.backend = FSDP2BackendConfig(param_dtype=cfg.learner.backend.param_dtype)
    L = cfg.learner
    backend = make_backend(L.backend, Path(cfg.model.path), L.lr, L.weight_decay, L.seed,
                           ranks.device, torch_dtype(cfg.model.dtype), lora=L.lora,
                           activation_checkpointing=L.activation_checkpointing)
    return backend, Trainer(cfg, backend, pad_id=0,
                            models=distributed.make_models(cfg, ranks, backend))


def write(out: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / name))


def check_load(out: Path, model_dir: Path, ranks) -> None:
    """Sharded loading (learner/sharded_load.py): each rank's shards of the policy and of the
    critic against the file's full tensors (bitwise), the tied head, the rotary buffers; the
    result per rank goes to OUT/load_{rank}.json."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from learner.algo.critic import ValueModel
    from learner.backends.sharded_load import _local_part

    full = load_file(str(model_dir / "model.safetensors"))
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = make_backend(FSDP2BackendConfig(), model_dir, 1e-3, 0.0, 0, ranks.device).model
    critic = make_backend(FSDP2BackendConfig(), model_dir, 1e-3, 0.0, 0, ranks.device,
                          model=ValueModel(model_dir, meta=True)).model
    report = {"policy": {}, "critic": {}}
    for what, model in (("policy", policy), ("critic", critic)):
        for name, p in model.named_parameters():
            local, offset = _local_part(p)
            rows = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
            want = (torch.zeros(p.shape) if name.startswith("value_head") else full[name].float())
            report[what][name] = {"equal": bool(torch.equal(local, want[rows])),
                                  "local": local.numel(), "full": want.numel(),
                                  "rows": want.shape[0]}
    report["tied"] = policy.lm_head.weight is policy.model.embed_tokens.weight
    report["rotary"] = bool(torch.equal(policy.model.rotary_emb.inv_freq,
                                        ref.model.rotary_emb.inv_freq))
    (out / f"load_{ranks.rank}.json").write_text(json.dumps(report))


def train(out: Path, model_dir: Path, ranks) -> None:
    check_load(out, model_dir, ranks)
    for name, extra in [*((agg, [f"learner.loss_agg={agg}"]) for agg in LOSS_AGGS),
                        ("micro", MICRO_OVERRIDES), ("micro_uneven", UNEVEN_OVERRIDES)]:
        cfg = config(model_dir, "learner.max_grad_norm=0", "learner.minibatches=1", *extra)
        backend, trainer = make(cfg, ranks)
        metrics = trainer.step(synthetic_groups(cfg, 0), 0)
        grads = full_grads(backend)
        write(out, f"grads_{name}.safetensors", grads)
        if ranks.rank == 0:
            (out / f"grads_{name}.json").write_text(json.dumps(metrics))
    def weights_after(backend, step: int) -> None:
        write(out, f"train_{step + 1}.safetensors", dict(backend.named_full_tensors()))

    backend, _, rows = _steps(config(model_dir), ranks, out / "ckpt", each=weights_after)
    backend.export_hf(out / "hf")
    if ranks.rank == 0:
        (out / "train_metrics.json").write_text(json.dumps(rows))
    train_algos(out, model_dir, ranks)
    train_bf16(out, model_dir, ranks)
    train_bf16_params(out, model_dir, ranks)


BF16_OVERRIDES = ["model.dtype=bfloat16"]
"""The N-step run in bf16: FSDP2's MixedPrecisionPolicy (bf16 params in compute, fp32 shards and
gradient reduction) against the single process's bf16 autocast."""


def train_bf16(out: Path, model_dir: Path, ranks) -> None:
    """STEPS steps in bfloat16: the weights at the end and the metric rows."""
    backend, _, rows = _steps(config(model_dir, *BF16_OVERRIDES), ranks, out / "bf16_ckpt")
    write(out, "bf16_final.safetensors", dict(backend.named_full_tensors()))
    # what a version is published as: each shard cast before the gather (learner/distributed.py)
    write(out, "bf16_published.safetensors", dict(backend.named_full_tensors(torch.bfloat16)))
    if ranks.rank == 0:
        (out / "bf16_metrics.json").write_text(json.dumps(rows))
    publish_sharded(out, backend, ranks)


SHARD_BUCKET = 16 * 1024
"""Small buckets: the tiny model's bf16 version in many of them, over both ranks."""


def publish_sharded(out: Path, backend, ranks) -> None:
    """Two versions (the second changed, as a delta too) published the way the learner's ranks
    do (learner/publisher.py on each rank, transport/weightsrc/shards.py) against each version
    packed whole on rank 0 (transport/weights.py pack). Rank 0 fetches every bucket rank 1
    holds through the Client, as its I/O thread would (two peers asking: one fetch), drops the
    first version's keys, fetches once more after the last collective and stops rank 1's
    server. Writes OUT/shards.json (rank 0) and OUT/shards_rank1.json."""
    import time

    from learner.publisher import Publisher
    from configs.schema import TransportConfig
    from transport import messages as m
    from transport.weights import pack
    from transport.weightsrc import delta, shards
    from transport.weightsrc.store import ShardRef

    link = shards.link(ranks.rank, ranks.world, TransportConfig(),
                       lambda s: distributed.all_gather_strings(ranks, s))
    got = []
    if ranks.rank == 0:
        collector = shards.Collector(link, timeout_s=120)
        publisher = Publisher(SHARD_BUCKET, 4, lambda p: got.append(collector.complete(p)),
                              world=ranks.world)
        client = shards.Client(link, hold_s=60)
    else:
        server = shards.RankServer(link)
        publisher = Publisher(SHARD_BUCKET, 4, server.deliver, rank=ranks.rank,
                              world=ranks.world)

    def fetch(packed, i: int):
        """Bucket i of `packed` as a peer of rank 0 gets it (bytes, or None: not held)."""
        ref = packed.buckets[i]
        if not isinstance(ref, ShardRef):
            return bytes(ref)
        req = m.BucketRequest(peer_id="test", key=packed.manifest.key, index=i, digest=b"",
                              request_id=1000 + i)
        for peer in (b"peer", b"another peer"):  # one fetch from the rank for both
            client.fetch(ref, peer, req, time.monotonic())
        frames = client.socks[ref.rank].recv_multipart(copy=False)
        (p1, h1, d1), (p2, h2, d2) = client.reply(frames)
        assert (p1, p2) == (b"peer", b"another peer") and h1 == h2 and d1 is d2
        assert h1.request_id == 1000 + i and h1.index == i
        assert not client.socks[ref.rank].poll(50)  # the rank was asked once
        return None if d1 is None else d1.bytes

    wholes, report = [], {}
    for v in (1, 2):
        if v == 2:  # a change to some tensors: the delta has work to do
            with torch.no_grad():
                for p in list(backend.model.parameters())[::3]:
                    p.mul_(1.5)
        dtype = torch.bfloat16
        publisher.publish(v, backend.named_full_tensors(dtype), dtype=dtype)
        whole = pack(backend.named_full_tensors(dtype), v, SHARD_BUCKET, dtype=dtype)
        publisher.wait()
        wholes.append(whole)
        if ranks.rank != 0:
            continue
        pub = got[-1]
        own = sum(len(b) for b in pub.full.buckets if not isinstance(b, ShardRef))
        report[f"v{v}"] = {
            "buckets": pub.full.manifest.num_buckets,
            "remote": sum(isinstance(b, ShardRef) for b in pub.full.buckets),
            "own_fraction": own / pub.full.manifest.total_bytes,
            "manifest_equal": pub.full.manifest == whole.manifest,
            "bytes_equal": all(fetch(pub.full, i) == bytes(whole.buckets[i])
                               for i in range(whole.manifest.num_buckets))}
        if v == 2:
            want = delta.make(whole, wholes[0])
            report["delta"] = {
                "manifest_equal": pub.delta.manifest == want.manifest,
                "bytes_equal": all(fetch(pub.delta, i) == want.buckets[i]
                                   for i in range(want.manifest.num_buckets))}
            client.drop([got[0].full.manifest.key])
            first = [i for i, b in enumerate(got[0].full.buckets) if isinstance(b, ShardRef)][0]
            report["dropped_found"] = fetch(got[0].full, first) is not None
    dist.barrier()  # as after the learner's last collective: rank 1 serves until ShardStop
    if ranks.rank == 0:
        remote = [i for i, b in enumerate(got[-1].full.buckets) if isinstance(b, ShardRef)]
        report["served_after_the_group"] = fetch(got[-1].full, remote[-1]) == bytes(
            wholes[-1].buckets[remote[-1]])
        client.stop()
        (out / "shards.json").write_text(json.dumps(report))
    else:
        (out / "shards_rank1.json").write_text(json.dumps({"done": server.done.wait(60)}))


BF16_PARAMS_OVERRIDES = ["model.dtype=bfloat16", "learner.backend.param_dtype=bfloat16"]
"""The N-step run with bf16 weights, gradients and AdamW moments (learner/backends/optim.py)."""


def train_bf16_params(out: Path, model_dir: Path, ranks) -> None:
    """STEPS steps with bf16 shards: the weights at the end, the metric rows, the dtypes."""
    backend, _, rows = _steps(config(model_dir, *BF16_PARAMS_OVERRIDES), ranks,
                              out / "bf16_params_ckpt")
    write(out, "bf16_params_final.safetensors", dict(backend.named_full_tensors()))
    state = next(iter(backend.optimizer.state.values()))
    dtypes = {"params": sorted({str(p.dtype) for p in backend.model.parameters()}),
              "moments": sorted({str(state[k].dtype) for k in ("exp_avg", "exp_avg_sq")})}
    if ranks.rank == 0:
        (out / "bf16_params_metrics.json").write_text(json.dumps({"rows": rows,
                                                                  "dtypes": dtypes}))


def _steps(cfg, ranks, ckpt: Path, each=None, with_models: bool = False):
    """STEPS steps on the synthetic batches, `each(backend, step)` after every one, and a
    checkpoint in `ckpt` after step CKPT_AT (with the critic and reference if `with_models`).
    Returns the backend, the trainer and the metric rows."""
    backend, trainer = make(cfg, ranks)
    rows = []
    for step in range(STEPS):
        rows.append(trainer.step(synthetic_groups(cfg, step), step))
        if each is not None:
            each(backend, step)
        if step + 1 == CKPT_AT:
            backend.save_checkpoint(ckpt, {"version": CKPT_AT})
            if with_models:
                trainer.models.save(ckpt)
    return backend, trainer, rows


def train_algos(out: Path, model_dir: Path, ranks) -> None:
    """STEPS steps with the critic and the reference (ALGO_OVERRIDES): policy and critic
    weights at the end, metrics, and a checkpoint (policy + critic) after step CKPT_AT."""
    backend, trainer, rows = _steps(config(model_dir, *ALGO_OVERRIDES), ranks,
                                    out / "algo_ckpt", with_models=True)
    write(out, "algo_policy.safetensors", dict(backend.named_full_tensors()))
    write(out, "algo_critic.safetensors", dict(trainer.models.critic.named_full_tensors()))
    if ranks.rank == 0:
        (out / "algo_metrics.json").write_text(json.dumps(rows))


def lora(out: Path, model_dir: Path, ranks) -> None:
    from transformers import AutoModelForCausalLM

    def whole(*args, **kwargs):
        raise AssertionError("a rank built the whole model (from_pretrained) under FSDP2")

    AutoModelForCausalLM.from_pretrained = whole  # sharded loading reads shards only
    backend, _, rows = _steps(config(model_dir, *LORA_OVERRIDES), ranks, out / "lora_ckpt")
    write(out, "lora_adapter.safetensors", dict(backend.named_adapter_tensors()))
    write(out, "lora_base.safetensors", dict(backend.named_full_tensors()))
    backend.export_hf(out / "lora_hf")
    if ranks.rank == 0:
        (out / "lora_metrics.json").write_text(json.dumps(rows))


def packed(out: Path, model_dir: Path, ranks) -> None:
    """One step with clipping off on batch 0 with PACKED_OVERRIDES: the metrics and the policy's
    full gradients to OUT/grads_packed.*."""
    cfg = config(model_dir, "learner.max_grad_norm=0", "learner.minibatches=1", *PACKED_OVERRIDES)
    backend, trainer = make(cfg, ranks)
    metrics = trainer.step(synthetic_groups(cfg, 0), 0)
    write(out, "grads_packed.safetensors", full_grads(backend))
    if ranks.rank == 0:
        (out / "grads_packed.json").write_text(json.dumps(metrics))


def resume(out: Path, model_dir: Path, ranks, ckpt: str = "", name: str = "") -> None:
    cfg = config(model_dir)
    backend, trainer = make(cfg, ranks)
    state = backend.load_checkpoint(Path(ckpt) if ckpt else out / "ckpt")
    for step in range(state["version"], STEPS):
        trainer.step(synthetic_groups(cfg, step), step)
    write(out, name or "resume_final.safetensors", dict(backend.named_full_tensors()))


def main() -> None:
    mode, out, model_dir, *rest = sys.argv[1:]
    torch.set_num_threads(1)
    ranks = distributed.start(FSDP2BackendConfig())
    {"train": train, "resume": resume, "lora": lora, "packed": packed}[mode](Path(out), Path(model_dir), ranks, *rest)
    distributed.close(ranks)


if __name__ == "__main__":
    main()
    distributed.exit_rank(0)  # gloo's threads race interpreter finalization (learner/distributed.py)
