"""HF transformers engine: batched sampling with a KV cache on CPU (or any torch device).

Requests are bucketed by (prompt length, max_new_tokens, temperature) so rows never need left
padding. Every row has its own torch.Generator seeded from (request seed, version), and CPU
kernels give bitwise-identical rows whatever else is in the batch, so a sample does not depend
on which actor ran it or what it was batched with. Behavior logprobs come from one full forward
pass over prompt + completion padded to prompt + max_new_tokens (a fixed length, again for
bitwise reproducibility), under the tempered distribution that was sampled from; with
`logprobs="sampling"` (`actors.engine.logprobs`) they are read off the sampling steps' own
distributions instead, saving that pass, and differ from the learner's by float rounding.

LoRA runs: the base (manifest kind "base") is kept as a state dict; every adapter version is
merged into a copy of it (models/lora.py `merge`, W + (alpha / rank) B @ A) and loaded like
full weights, so generation costs what it costs without LoRA. An adapter on a tied model's
`lm_head` merges into a head of its own (models/tied.py): the model is untied when the first
such version arrives, and a base loaded after that fills the head from the embedding.

Streamed loads (`transport.weight_load: streamed`): each bucket's tensors are copied into the
model as the bucket arrives (`load_bucket`), the same copies a whole load makes, so the weights
are the same bit for bit; `end_load` checks that every weight arrived.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from actors.engines.base import Completion, EngineContext, GenerateRequest, versioned_seed
from actors.engines.client import EngineClient
from configs.engines import HFEngineConfig
from models import lora
from models.tied import HEAD, load_state, loaded, untie, with_head
from models.logprobs import token_logprobs


class HFEngine:
    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, logprobs: str = "forward") -> None:
        """`logprobs`: "forward" (one more full pass, batch-invariant) or "sampling"."""
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
        self.device = device
        self.vocab_size = config.vocab_size
        self.eos_id = config.eos_token_id
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else self.eos_id
        self.logprobs = logprobs
        self.version = -1
        self.base: dict[str, torch.Tensor] | None = None
        """LoRA runs: the frozen base weights every adapter is merged into."""
        self._lock = threading.Lock()
        self._streamed: set[str] = set()
        """A streamed load: the names loaded since `begin_load`."""

    def load_packed(self, manifest, buckets: list) -> None:
        """Load what arrived over the weights channel (manifest + raw buckets): full weights,
        a LoRA run's base, or an adapter version (merged into the base)."""
        from transport.weights import unpack

        state = unpack(manifest, buckets)
        match manifest.kind:
            case "full":
                self.load_weights(state, manifest.version)
            case "base":
                self.load_base(state)
            case "adapter":
                self.load_adapter(state, manifest.lora.scale, manifest.version)

    def begin_load(self, manifest) -> None:
        """Start a streamed full version: the model holds a mix of versions until `end_load`."""
        with self._lock:
            self.version = -1
            self._streamed = set()

    def load_bucket(self, manifest, index: int, bucket) -> None:
        """Copy bucket `index`'s tensors into the model."""
        from transport.weights import bucket_manifest, unpack

        state = unpack(bucket_manifest(manifest, index), [bucket], readonly=True)  # only read
        with self._lock:
            if HEAD in state:  # as load_weights
                untie(self.model)
            unexpected = self.model.load_state_dict(state, strict=False).unexpected_keys
            if unexpected:
                raise ValueError(f"weights v{manifest.version} bucket {index}: {unexpected} "
                                 "are not weights of the model")
            self._streamed.update(state)

    def end_load(self, manifest) -> None:
        with self._lock:
            missing = [k for k in self.model.state_dict() if k not in self._streamed]
            loaded(self.model, missing, [], f"weights v{manifest.version}")
            self.version = manifest.version

    def borrow_packed(self, manifest, buckets: list) -> None:
        """Full weights as the model's parameters without any copy: read-only views of
        `buckets` (CPU). For an evaluation that only reads them; `release_weights` after."""
        from transport.weights import unpack

        state = unpack(manifest, buckets, readonly=True)
        with self._lock:
            load_state(self.model, state, f"weights v{manifest.version}", assign=True)
            self.version = manifest.version

    def release_weights(self) -> None:
        """Drop the parameters' storage (borrowed or own): each becomes a meta tensor of its
        shape until the next `borrow_packed`, so the engine holds no copy of the model."""
        with self._lock:
            for module in self.model.modules():
                for name, p in module._parameters.items():
                    if p is not None:
                        module._parameters[name] = torch.nn.Parameter(
                            torch.empty_like(p, device="meta"), requires_grad=False)
            self.version = -1

    def load_base(self, state: dict[str, torch.Tensor]) -> None:
        """Keep a LoRA run's frozen base; the version stays as it was (no adapter yet)."""
        with self._lock:
            load_state(self.model, with_head(dict(state)), "base weights")
            self.base = state

    def load_adapter(self, adapter: dict[str, torch.Tensor], scale: float, version: int) -> None:
        """Version `version` = the base with `adapter` merged in (`load_base` came first)."""
        if self.base is None:
            raise ValueError(f"adapter v{version} arrived before the base weights")
        self.load_weights(lora.merge(self.base, adapter, scale), version)

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        with self._lock:
            if HEAD in state:  # a merged adapter on a tied head: the head is the model's own now
                untie(self.model)
            load_state(self.model, state, f"weights v{version}")
            self.version = version

    def generate(self, requests: list[GenerateRequest]) -> list[Completion]:
        with self._lock, torch.no_grad():
            buckets: dict[tuple, list[int]] = defaultdict(list)
            for i, r in enumerate(requests):
                buckets[(len(r.prompt_ids), r.max_new_tokens, r.temperature)].append(i)
            out: list[Completion | None] = [None] * len(requests)
            for idx in buckets.values():
                for i, c in zip(idx, self._generate_bucket([requests[i] for i in idx])):
                    out[i] = c
            return out

    def _generate_bucket(self, reqs: list[GenerateRequest]) -> list[Completion]:
        from transformers import DynamicCache

        max_new, temp = reqs[0].max_new_tokens, reqs[0].temperature
        prompts = torch.from_numpy(np.stack([r.prompt_ids for r in reqs]).astype(np.int64)).to(self.device)
        gens = [torch.Generator(device=self.device).manual_seed(versioned_seed(r.seed, self.version))
                for r in reqs]
        cache = DynamicCache(config=self.model.config)
        logits = self.model(input_ids=prompts, past_key_values=cache, use_cache=True).logits[:, -1]
        finished = torch.zeros(len(reqs), dtype=torch.bool, device=self.device)
        steps, step_lps = [], []
        for t in range(max_new):
            probs = torch.softmax(logits.float() / temp, dim=-1)
            nxt = torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(gens)])
            nxt = torch.where(finished, torch.full_like(nxt, self.pad_id), nxt)
            steps.append(nxt)
            if self.logprobs == "sampling":
                step_lps.append(torch.log_softmax(logits.float() / temp, dim=-1)
                                .gather(1, nxt[:, None])[:, 0])
            finished |= nxt == self.eos_id
            if bool(finished.all()) or t == max_new - 1:
                break
            logits = self.model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True).logits[:, -1]
        gen = torch.stack(steps, dim=1)
        if self.logprobs == "sampling":
            lp = torch.stack(step_lps, dim=1)
        else:
            P = prompts.shape[1]
            full = torch.full((len(reqs), P + max_new), self.pad_id, dtype=torch.long,
                              device=self.device)
            full[:, :P] = prompts
            full[:, P:P + gen.shape[1]] = gen
            lp = token_logprobs(self.model, full, temp)[:, P - 1:P - 1 + gen.shape[1]]
        gen_np, lp_np = gen.cpu().numpy(), lp.float().cpu().numpy()
        out = []
        for i in range(len(reqs)):
            eos = np.nonzero(gen_np[i] == self.eos_id)[0]
            n = int(eos[0]) + 1 if eos.size else gen_np.shape[1]
            out.append(Completion(token_ids=gen_np[i, :n].astype(np.int32),
                                  logprobs=lp_np[i, :n].astype(np.float32),
                                  versions=np.full(n, self.version, dtype=np.int32),
                                  finish_reason="stop" if eos.size else "length"))
        return out


def make(section: HFEngineConfig, ctx: EngineContext) -> EngineClient:
    """`actors.engine: hf`: the model on `section.device` (resolved by the actor: ctx.device)
    in model.dtype, behind the batching client."""
    from models import devices

    return EngineClient(HFEngine(ctx.model_dir, ctx.device, devices.torch_dtype(ctx.dtype),
                                 logprobs=section.logprobs))
