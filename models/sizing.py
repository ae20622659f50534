"""Predicted memory of a learner step for a Qwen2/Llama-architecture config (an HF config.json
as a dict): what scripts/device_check.py measures against, and what a preset's placement can be
checked with. Bytes; estimates, not bounds.

    training state   16 bytes per parameter on its rank: fp32 weights (4), fp32 gradients (4),
                     AdamW's two fp32 moments (8); divided by the FSDP2 ranks
    activations      per token and decoder layer, kept for backward under bf16 autocast:
                     the fp32 residual stream at both norms (2 x 4h), the bf16 inputs of the
                     q/k/v, o, gate/up and down projections (2h + 2h + 2h + 2i), q/k/v outputs
                     (2(h + 2 kv)), the attention output (2h), gate, up and SiLU outputs (3 x 2i)
                     -> 20h + 8i + 4kv bytes (scaled by 2 for fp32 compute); SDPA keeps no
                     seq x seq scores
    logits           per token: bf16 logits (2V), their fp32 copy (4V), log_softmax's saved
                     output (4V) and its gradient (4V) alive together at the start of backward
                     (models/logprobs.py computes the whole vocabulary)
"""

from __future__ import annotations


def param_count(c: dict) -> int:
    """Parameters of a Qwen2/Llama decoder from its config (tied head counted once)."""
    h, i, v, n = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    kv = c.get("num_key_value_heads", c["num_attention_heads"]) * (h // c["num_attention_heads"])
    bias = (h + 2 * kv) if c.get("attention_bias", c.get("model_type") == "qwen2") else 0
    layer = h * h + 2 * h * kv + bias + h * h + 3 * h * i + 2 * h
    head = 0 if c.get("tie_word_embeddings", False) else v * h
    return v * h + n * layer + h + head


def training_state_bytes(c: dict, ranks: int = 1) -> int:
    return 16 * param_count(c) // ranks


def activation_bytes(c: dict, tokens: int, compute_bytes: int = 2) -> int:
    h, i, n = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = c.get("num_key_value_heads", c["num_attention_heads"]) * (h // c["num_attention_heads"])
    per_layer = 8 * h + (compute_bytes // 2) * (12 * h + 8 * i + 4 * kv)
    return tokens * n * per_layer


def logits_bytes(c: dict, tokens: int) -> int:
    return 14 * c["vocab_size"] * tokens


def step_peak_bytes(c: dict, rows: int, seq: int, ranks: int = 1, compute_bytes: int = 2) -> int:
    """Predicted peak of one forward + backward + AdamW step on `rows` x `seq` tokens per rank."""
    tokens = rows * seq
    return (training_state_bytes(c, ranks) + activation_bytes(c, tokens, compute_bytes)
            + logits_bytes(c, tokens))


QWEN25_1_5B = {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960,
               "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
               "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
               "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu",
               "architectures": ["Qwen2ForCausalLM"], "torch_dtype": "bfloat16",
               "bos_token_id": 151643, "eos_token_id": 151645}
"""Qwen/Qwen2.5-1.5B-Instruct's config.json (the fields that shape the model)."""
QWEN25_7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
             "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
             "vocab_size": 152064, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
             "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
             "architectures": ["Qwen2ForCausalLM"], "torch_dtype": "bfloat16",
             "bos_token_id": 151643, "eos_token_id": 151645}
"""Qwen/Qwen2.5-7B-Instruct's config.json (the fields that shape the model)."""
