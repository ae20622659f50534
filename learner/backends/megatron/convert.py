"""HF <-> Megatron-core names and layouts for Qwen2/Llama-family decoders (local layer spec).

    HF                                   Megatron GPTModel (per TP rank, layer i local to its stage)
    model.embed_tokens.weight            embedding.word_embeddings.weight      rows split over TP
    layers.L.input_layernorm             decoder.layers.i.input_layernorm      replicated
    layers.L.self_attn.{q,k,v}_proj      decoder.layers.i.self_attention.linear_qkv   (weight, bias)
                                         per query group [q heads of the group; k; v], groups
                                         split over TP
    layers.L.self_attn.o_proj            ...self_attention.linear_proj         columns split
    layers.L.post_attention_layernorm    decoder.layers.i.pre_mlp_layernorm    replicated
    layers.L.mlp.{gate,up}_proj          ...mlp.linear_fc1   [gate shard; up shard] on each rank
    layers.L.mlp.down_proj               ...mlp.linear_fc2                     columns split
    model.norm.weight                    decoder.final_layernorm.weight        (last stage)
    lm_head.weight                       output_layer.weight  rows split (absent if tied, pp = 1)

Layer L = stage offset + i. Pure functions of tensors and the HF config: no process group.
"""

from __future__ import annotations

import torch

SUPPORTED = ("qwen2", "llama")
"""HF `model_type`s whose decoder maps onto GPTModel's local spec this way."""


def check_supported(hf, tp: int, pp: int) -> None:
    """A clear error for models or splits this converter does not handle."""
    if hf.model_type not in SUPPORTED:
        raise ValueError(f"learner.backend=megatron converts {SUPPORTED} models, not "
                         f"model_type={hf.model_type!r}")
    if hf.hidden_act != "silu" or getattr(hf, "mlp_bias", False):
        raise ValueError(f"megatron: only SwiGLU MLPs without bias, got hidden_act={hf.hidden_act}")
    for what, n in (("num_attention_heads", hf.num_attention_heads),
                    ("num_key_value_heads", hf.num_key_value_heads),
                    ("intermediate_size", hf.intermediate_size), ("vocab_size", hf.vocab_size)):
        if n % tp:
            raise ValueError(f"learner.backend.tp={tp} must divide the model's {what}={n}")
    if hf.num_hidden_layers % pp:
        raise ValueError(f"learner.backend.pp={pp} must divide the model's "
                         f"num_hidden_layers={hf.num_hidden_layers}")


def qkv_bias(hf) -> bool:
    return hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False))


def head_dim(hf) -> int:
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def rope_theta(hf) -> float:
    params = getattr(hf, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))


def _layer_names(L: int) -> dict[str, str]:
    """Megatron name suffix -> HF name, for the one-to-one tensors of a layer."""
    p = f"model.layers.{L}."
    return {"input_layernorm.weight": p + "input_layernorm.weight",
            "self_attention.linear_proj.weight": p + "self_attn.o_proj.weight",
            "pre_mlp_layernorm.weight": p + "post_attention_layernorm.weight",
            "mlp.linear_fc2.weight": p + "mlp.down_proj.weight"}


def to_megatron(name: str, get, hf, tp_rank: int, tp: int, offset: int) -> torch.Tensor:
    """This TP rank's value of Megatron parameter `name` (local to a stage whose first layer is
    `offset`); `get(hf_name)` reads one full HF tensor."""
    if name == "embedding.word_embeddings.weight":
        return get("model.embed_tokens.weight").chunk(tp, 0)[tp_rank]
    if name == "output_layer.weight":
        key = "model.embed_tokens.weight" if hf.tie_word_embeddings else "lm_head.weight"
        return get(key).chunk(tp, 0)[tp_rank]
    if name == "decoder.final_layernorm.weight":
        return get("model.norm.weight")
    _, _, i, suffix = name.split(".", 3)
    L = offset + int(i)
    p = f"model.layers.{L}."
    if suffix.startswith("self_attention.linear_qkv."):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = (get(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv")
        return _qkv_pack(q, k, v, hf).chunk(tp, 0)[tp_rank]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")
        return torch.cat([gate.chunk(tp, 0)[tp_rank], up.chunk(tp, 0)[tp_rank]])
    full = get(_layer_names(L)[suffix])
    if suffix in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
        return full.chunk(tp, 1)[tp_rank]
    return full


def to_hf(name: str, shards: list[torch.Tensor], hf, offset: int) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor)s of Megatron parameter `name`, given its shards from every TP rank in
    rank order (one shard for a replicated parameter). Empty for the tied output layer."""
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", torch.cat(shards, 0))]
    if name == "output_layer.weight":
        return [] if hf.tie_word_embeddings else [("lm_head.weight", torch.cat(shards, 0))]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", shards[0])]
    _, _, i, suffix = name.split(".", 3)
    L = offset + int(i)
    p = f"model.layers.{L}."
    if suffix.startswith("self_attention.linear_qkv."):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = _qkv_unpack(torch.cat(shards, 0), hf)
        return [(f"{p}self_attn.{x}_proj.{kind}", t) for x, t in zip("qkv", (q, k, v))]
    if suffix == "mlp.linear_fc1.weight":
        halves = [s.chunk(2, 0) for s in shards]
        return [(p + "mlp.gate_proj.weight", torch.cat([h[0] for h in halves], 0)),
                (p + "mlp.up_proj.weight", torch.cat([h[1] for h in halves], 0))]
    dim = 1 if suffix in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight") else None
    return [(_layer_names(L)[suffix], shards[0] if dim is None else torch.cat(shards, dim))]


def _qkv_pack(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hf) -> torch.Tensor:
    """HF q [heads*d, ...], k, v [groups*d, ...] -> Megatron [groups * (heads/groups + 2) * d, ...]."""
    g, d = hf.num_key_value_heads, head_dim(hf)
    rest = q.shape[1:]
    per = [t.reshape(g, -1, *rest) for t in (q, k, v)]
    return torch.cat(per, 1).reshape(-1, *rest)


def _qkv_unpack(qkv: torch.Tensor, hf) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = hf.num_key_value_heads, head_dim(hf)
    heads = hf.num_attention_heads // g
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (heads + 2) * d, *rest)
    q, k, v = grouped.split([heads * d, d, d], dim=1)
    return (q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest))
