"""Megatron-core backend: tensor (TP) and pipeline (PP) parallel, data parallel over the rest.

    world = dp x pp x tp ranks (Megatron's order tp-cp-ep-dp-pp: TP peers are neighbours)
    every rank:  the trainer's batch share of its *data-parallel* rank (TP/PP peers get the same rows)
      pp = 1:  logprobs = GPTModel forward (vocab-parallel log-softmax) -> loss -> backward
      pp > 1:  logprobs = Megatron's 1F1B schedule, forward only; the last stage's logprobs are
               broadcast to the other stages (so every rank computes the same loss statistics).
               step: backward of the trainer's loss to d loss / d logprobs, then the 1F1B schedule
               forward + backward on sum(logprobs * that gradient), which has the same parameter
               gradient (one extra forward per minibatch)
      then: gradients summed over data-parallel ranks (all-reduce, no averaging: LossNorm gives
            each rank its share), tied embedding gradients summed over the first and last stage,
            global-norm clipping over unique shards, torch AdamW on this rank's shards
    publishing: each parameter all-gathered over TP, converted to HF names (learner/backends/megatron/convert.py),
                broadcast from its stage over PP, one tensor at a time

Mixed precision (model.dtype=bfloat16): as the single-process backend, fp32 parameters and AdamW
state, forward and backward under torch.autocast (models/devices.py `compute`; Megatron's linear
layers are autograd Functions whose CUDA-only `custom_bwd` would not restore CPU autocast, so
backward runs inside `compute` too), parameter gradients fp32, summed over data-parallel ranks in
fp32. Two spec changes keep the HF model's autocast numerics: the residual stream stays fp32
(`_residual_add`) and attention scores/softmax run in fp32 (`_float32_core_attention`); both are
bitwise no-ops in float32. Pipeline stages exchange fp32 (PIPELINE_DTYPE). TP partial sums of
activations (row-parallel outputs, column-parallel input gradients) are all-reduced in bf16.

Optimizer: torch AdamW, not Megatron's DistributedOptimizer (that needs Megatron's DDP grad
buffers, which are CUDA-only); optimizer state is therefore replicated over data-parallel ranks.
On CPU (gloo) the redirects in learner/backends/megatron/cpu.py apply; with CUDA the same code runs on
NCCL. Checkpoints are torch.distributed.checkpoint directories keyed by (TP rank, PP stage):
resume needs the same learner.backend.tp and pp (the data-parallel size may change).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from learner import checkpoint
from learner.backends.base import cast
from learner.backends.megatron import convert
from learner.backends.megatron.cpu import cpu_redirects, init_rng_tracker
from models.devices import compute

PIPELINE_DTYPE = torch.float32
"""What pipeline stages send each other (activations forward, their gradients back): Megatron
allocates receive buffers of `config.pipeline_dtype`. float32 under every model.dtype: with
autocast the residual stream between layers is float32, as in the single-process model."""


class MegatronBackend:
    lora = None
    """LoRA is not built for Megatron (configs/schema.py refuses learner.lora.rank > 0)."""

    def __init__(self, model_dir: Path, lr: float, weight_decay: float, seed: int,
                 device: torch.device, tp: int, pp: int,
                 dtype: torch.dtype = torch.float32, activation_checkpointing: bool = False
                 ) -> None:
        """fp32 parameters and AdamW state; forward and backward passes in `dtype` (autocast,
        models/devices.py `compute`, as the single-process backend; see "Mixed precision" in
        the module docstring)."""
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        world = dist.get_world_size()
        if world % (tp * pp):
            raise ValueError(f"learner.backend.tp * learner.backend.pp = {tp * pp} must divide "
                             f"the number of torchrun ranks {world}")
        self.model_dir = Path(model_dir)
        self.hf = AutoConfig.from_pretrained(self.model_dir)
        convert.check_supported(self.hf, tp, pp)
        torch.manual_seed(seed)
        self.device, self.tp, self.pp, self.dtype = device, tp, pp, dtype
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                     pipeline_model_parallel_size=pp)
        init_rng_tracker(seed)
        self.ps = ps
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.hf_shapes = _hf_shapes(self.hf)
        self.offset = self.pp_rank * (self.hf.num_hidden_layers // pp)
        self.model = _build_model(self.hf, tp, pp, self.first, self.last, device,
                                  activation_checkpointing)
        self._load_hf()
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr,
                                           weight_decay=weight_decay)
        self._pending: tuple[torch.Tensor, float, torch.Tensor] | None = None

    def _load_hf(self) -> None:
        """Every rank reads only the HF tensors its shards need, one at a time."""
        from safetensors import safe_open

        with contextlib.ExitStack() as stack, torch.no_grad():
            handles = [stack.enter_context(safe_open(str(f), framework="pt"))
                       for f in sorted(self.model_dir.glob("*.safetensors"))]
            where = {k: h for h in handles for k in h.keys()}
            for name, p in self.model.named_parameters():
                p.copy_(convert.to_megatron(name, lambda k: where[k].get_tensor(k), self.hf,
                                            self.tp_rank, self.tp, self.offset))

    # ---- forward ---------------------------------------------------------------------------

    def logprobs(self, input_ids: torch.Tensor, temperature: float,
                 position_ids: None = None) -> torch.Tensor:
        """Rows only: packed rows are not built (configs refuse learner.pack_rows)."""
        ids = input_ids.to(self.device)
        if self.pp == 1:
            with cpu_redirects(), compute(self.device, self.dtype):
                return _token_logprobs(self.model(**_inputs(ids)), ids, temperature)
        logp = self._last_stage_to_all(self._schedule(ids, temperature, grad=None), ids)
        if torch.is_grad_enabled():
            logp = logp.requires_grad_()
            self._pending = (ids, temperature, logp)
        return logp

    def logprobs_entropy(self, input_ids: torch.Tensor, temperature: float,
                         entropy_grad: bool = False, position_ids: None = None
                         ) -> tuple[torch.Tensor, None]:
        """Logprobs only: the entropy over vocab-parallel logits is not built (None: not
        logged; configs refuse learner.entropy_coef > 0 with this backend)."""
        return self.logprobs(input_ids, temperature), None

    def _schedule(self, ids: torch.Tensor, temperature: float,
                  grad: torch.Tensor | None) -> list[torch.Tensor]:
        """Megatron's pipeline schedule over microbatches of `ids`. grad None: forward only,
        returns each microbatch's logprobs on the last stage (else nothing); with `grad`:
        forward + backward of sum(logprobs * grad), gradients accumulate in the parameters."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        n = max(d for d in range(1, self.pp + 1) if ids.shape[0] % d == 0)
        micro = list(zip(ids.chunk(n), (grad.chunk(n) if grad is not None else [None] * n)))

        def forward_step(data, model):
            mb_ids, mb_grad = next(data)
            out = model(**_inputs(mb_ids))
            if not self.last:  # what this stage sends: the receiver's buffer has PIPELINE_DTYPE
                out = out.to(PIPELINE_DTYPE)

            def loss_func(logits, non_loss_data=False):
                logp = _token_logprobs(logits, mb_ids, temperature)
                if non_loss_data:
                    return logp.detach()
                return (logp * mb_grad).sum(), torch.tensor(1, dtype=torch.int), {}
            return out, loss_func

        with cpu_redirects(), compute(self.device, self.dtype):
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(micro), model=[self.model],
                num_microbatches=n, seq_length=ids.shape[1], micro_batch_size=ids.shape[0] // n,
                forward_only=grad is None, collect_non_loss_data=grad is None)

    def _last_stage_to_all(self, store: list[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        """The last stage's logprobs, broadcast to every stage of this pipeline."""
        shape = (ids.shape[0], ids.shape[1] - 1)
        logp = torch.cat(store) if self.last else torch.empty(shape, device=self.device)
        dist.broadcast(logp, src=self.ps.get_pipeline_model_parallel_last_rank(),
                       group=self.ps.get_pipeline_model_parallel_group())
        return logp

    # ---- backward and optimizer -----------------------------------------------------------

    def step(self, loss: torch.Tensor, max_grad_norm: float) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        if self.pp == 1:
            with cpu_redirects(), compute(self.device, self.dtype):
                loss.backward()
        else:
            ids, temperature, leaf = self._pending
            self._pending = None
            loss.backward()  # d loss / d logprobs, the same on every stage
            self._schedule(ids, temperature, grad=leaf.grad)
        self._sum_gradients()
        params = list(self.model.parameters())
        norm = self._global_norm()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norm)
        self.optimizer.step()
        return float(norm)

    def _sum_gradients(self) -> None:
        ps = self.ps
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.dp_size > 1:
                dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
        if self.pp > 1 and self.hf.tie_word_embeddings and (self.first or self.last):
            shared = self.model.shared_embedding_or_output_weight()
            dist.all_reduce(shared.grad, group=ps.get_embedding_group())

    def _global_norm(self) -> torch.Tensor:
        """L2 norm over every parameter once: TP shards all count, replicated parameters on TP
        rank 0 only, the tied output layer of the last stage not at all."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.model.parameters():
            tied_copy = getattr(p, "shared_embedding", False) and not self.first
            if param_is_not_tensor_parallel_duplicate(p) and not tied_copy:
                sq += p.grad.double().pow(2).sum()
        dist.all_reduce(sq, group=self.ps.get_model_parallel_group())
        return sq.sqrt().float()

    def reduce_stats(self, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        group = self.ps.get_data_parallel_group()
        for op, keys in ((dist.ReduceOp.SUM, [k for k in stats if not k.endswith("_max")]),
                         (dist.ReduceOp.MAX, [k for k in stats if k.endswith("_max")])):
            if keys:
                t = torch.stack([stats[k].detach().float() for k in keys]).to(self.device)
                dist.all_reduce(t, op=op, group=group)
                out.update(zip(keys, t.cpu()))
        return {k: out[k] for k in stats}

    # ---- weights out ----------------------------------------------------------------------

    def named_full_tensors(self, dtype: torch.dtype | None = None, grads: bool = False
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF names and full tensors (`grads`: their gradients), one at a time, on every rank (a
        collective: every rank iterates to the end). TP shards are all-gathered; PP stages
        broadcast in turn; each full tensor is then cast to `dtype`."""
        mine = self._own_hf_tensors(grads)
        pp_group = self.ps.get_pipeline_model_parallel_group()
        for stage in range(self.pp):
            for hf_name, shape in _plan(self.hf, self.hf_shapes, stage, self.pp):
                if stage == self.pp_rank:
                    name, t = next(mine)
                    if name != hf_name:
                        raise RuntimeError(f"megatron publishing order: {name} != {hf_name}")
                    t = t.contiguous()
                else:
                    t = torch.empty(shape, device=self.device)
                if self.pp > 1:
                    dist.broadcast(t, src=dist.get_global_rank(pp_group, stage), group=pp_group)
                yield hf_name, cast(t.detach(), dtype).cpu()

    def _own_hf_tensors(self, grads: bool) -> Iterator[tuple[str, torch.Tensor]]:
        tp_group = self.ps.get_tensor_model_parallel_group()
        for name, p in self.model.named_parameters():
            t = (p.grad if grads else p).detach().contiguous()
            shards = [t]
            if getattr(p, "tensor_model_parallel", False) and self.tp > 1:
                shards = [torch.empty_like(t) for _ in range(self.tp)]
                dist.all_gather(shards, t, group=tp_group)
            yield from convert.to_hf(name, shards, self.hf, self.offset)

    # ---- checkpoints ----------------------------------------------------------------------

    def save_checkpoint(self, path: Path, extra: dict) -> None:
        with_optimizer = bool(self.optimizer.state)
        state = self._dcp_state(with_optimizer)
        checkpoint.ensure_space(path, state, counted=self.dp_rank == 0)  # replicas share keys
        dcp.save(state, checkpoint_id=str(path / "dcp"))
        if dist.get_rank() == 0:
            (path / "backend.json").write_text(json.dumps(
                {"backend": "megatron", "tp": self.tp, "pp": self.pp, "optimizer": with_optimizer}))
            (path / "state.json").write_text(json.dumps(extra, indent=1))
        dist.barrier()

    def load_checkpoint(self, path: Path) -> dict:
        meta_path = path / "backend.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        if meta.get("backend") != "megatron" or (meta["tp"], meta["pp"]) != (self.tp, self.pp):
            raise ValueError(f"checkpoint {path} was written by {meta or 'another backend'}; "
                             f"learner.backend megatron with tp={self.tp}, "
                             f"pp={self.pp} can resume only its own checkpoints")
        if meta["optimizer"]:
            for p in self.model.parameters():  # AdamW's state, to be overwritten by the load
                self.optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                           "exp_avg": torch.zeros_like(p),
                                           "exp_avg_sq": torch.zeros_like(p)}
        state = self._dcp_state(meta["optimizer"])
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        return json.loads((path / "state.json").read_text())

    def _dcp_state(self, with_optimizer: bool) -> dict[str, torch.Tensor]:
        """This rank's tensors under keys unique to its (TP rank, stage): data-parallel
        replicas share keys, so DCP writes each once. Tensors are the live ones (loads in place)."""
        tag = f"tp{self.tp_rank}.pp{self.pp_rank}"
        state = {}
        for name, p in self.model.named_parameters():
            state[f"{tag}.model.{name}"] = p.data
            if with_optimizer:
                for k, v in self.optimizer.state[p].items():
                    state[f"{tag}.optim.{name}.{k}"] = v
        return state

    def gather_export(self, path: Path) -> Callable[[], None]:
        """Megatron writes inside the collective (its gather and rank 0's write are one pass
        over the layers here); nothing is left for later."""
        self.export_hf(path)
        return lambda: None

    def export_hf(self, path: Path) -> None:
        """Rank 0 writes safetensors + config + tokenizer; the full weights exist only there."""
        from safetensors.torch import save_file

        tensors = {name: t.contiguous() for name, t in self.named_full_tensors()
                   if dist.get_rank() == 0}
        if dist.get_rank() == 0:
            from models.tiny import load_tokenizer

            path.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
            self.hf.save_pretrained(path)
            if (self.model_dir / "generation_config.json").exists():
                shutil.copy(self.model_dir / "generation_config.json", path)
            load_tokenizer(self.model_dir).save_pretrained(path)
        dist.barrier()


def _inputs(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """GPTModel inputs: positions 0..L-1 and an explicit causal mask (True = masked): Megatron's
    default mask is built on CUDA (learner/backends/megatron/cpu.py)."""
    L = ids.shape[1]
    mask = torch.triu(torch.ones(L, L, dtype=torch.bool, device=ids.device), diagonal=1)
    pos = torch.arange(L, device=ids.device).unsqueeze(0).expand_as(ids)
    return {"input_ids": ids, "position_ids": pos, "attention_mask": mask[None, None]}


def _token_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Vocab-parallel logits (b, L, V/tp) -> log p(ids[:, t+1] | ...) (b, L-1), tempered."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # always a new tensor (x / 1.0 is exact): vocab_parallel_cross_entropy works in place on it
    logits = (logits[:, :-1].float() / temperature).contiguous()
    return -vocab_parallel_cross_entropy(logits, ids[:, 1:].contiguous())


def _hf_shapes(hf) -> dict[str, tuple[int, ...]]:
    """The HF model's tensor shapes (built on the meta device: no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _plan(hf, shapes: dict[str, tuple[int, ...]], stage: int,
          pp: int) -> list[tuple[str, tuple[int, ...]]]:
    """HF names and shapes held by pipeline `stage`, in the order `_own_hf_tensors` yields them
    (Megatron's parameter order: embedding, layers, final norm, output layer)."""
    per = hf.num_hidden_layers // pp
    names = ["model.embed_tokens.weight"] if stage == 0 else []
    for L in range(stage * per, (stage + 1) * per):
        p = f"model.layers.{L}."
        names += [p + "input_layernorm.weight", p + "self_attn.o_proj.weight"]
        names += [f"{p}self_attn.{x}_proj.weight" for x in "qkv"]
        if convert.qkv_bias(hf):
            names += [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
        names += [p + "post_attention_layernorm.weight", p + "mlp.gate_proj.weight",
                  p + "mlp.up_proj.weight", p + "mlp.down_proj.weight"]
    if stage == pp - 1:
        names += ["model.norm.weight"] + ([] if hf.tie_word_embeddings else ["lm_head.weight"])
    return [(n, shapes[n]) for n in names]


def _build_model(hf, tp: int, pp: int, first: bool, last: bool, device: torch.device,
                 activation_checkpointing: bool = False):
    """GPTModel with Megatron-core's local (non-TransformerEngine) layer spec, float32
    parameters; the residual additions are `_residual_add`."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
        num_attention_heads=hf.num_attention_heads, num_query_groups=hf.num_key_value_heads,
        kv_channels=convert.head_dim(hf), ffn_hidden_size=hf.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=hf.rms_norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=convert.qkv_bias(hf),
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=PIPELINE_DTYPE, params_dtype=torch.float32,
        use_cpu_initialization=device.type == "cpu", batch_p2p_sync=False,
        calculate_per_token_loss=True,
        # learner.activation_checkpointing: every layer's activations recomputed in the backward
        **({"recompute_granularity": "full", "recompute_method": "uniform",
            "recompute_num_layers": 1} if activation_checkpointing else {}))
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    attention = spec.submodules.self_attention
    attention.submodules = dataclasses.replace(attention.submodules,
                                               core_attention=_float32_core_attention())
    spec.submodules = dataclasses.replace(spec.submodules, self_attn_bda=_residual_add,
                                          mlp_bda=_residual_add)
    with cpu_redirects():
        model = GPTModel(config, spec,
                         vocab_size=hf.vocab_size, max_sequence_length=hf.max_position_embeddings,
                         pre_process=first, post_process=last, parallel_output=True,
                         share_embeddings_and_output_weights=hf.tie_word_embeddings,
                         position_embedding_type="rope", rotary_base=convert.rope_theta(hf))
    return model.to(device)


def _residual_add(training: bool, fused: bool):
    """The layer spec's bias-dropout-add (`self_attn_bda`, `mlp_bda`; dropout is 0 and there is
    no bias): `residual + x` in the promoted dtype. Megatron's own casts the residual to x's
    dtype, so under autocast the residual stream would become bfloat16 after the first
    attention block; here it stays float32, as in the HF model under autocast (single-process
    and fsdp2). Bitwise Megatron's result in float32."""
    def add(x_with_bias: tuple[torch.Tensor, torch.Tensor | None], residual: torch.Tensor,
            prob: float) -> torch.Tensor:
        x, bias = x_with_bias
        assert bias is None and prob == 0.0, "the backend builds no linear biases, no dropout"
        return residual + x
    return add


def _float32_core_attention():
    """Megatron's local DotProductAttention computing scores, softmax and probs @ v in float32
    (autocast off) and returning q's dtype, as torch's scaled_dot_product_attention (the HF
    model's attention) does inside for bfloat16 q, k, v; under autocast Megatron's would round
    the scores to bfloat16 before its softmax. Bitwise the same in float32."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class Float32CoreAttention(DotProductAttention):
        def forward(self, query, key, value, *args, **kwargs):
            with torch.autocast(query.device.type, enabled=False):
                out = super().forward(query.float(), key.float(), value.float(), *args, **kwargs)
            return out.to(query.dtype)
    return Float32CoreAttention
