"""Build the tiny Qwen2 model and word-level tokenizer locally (no model hub).

The result is a normal HF model directory (`save_pretrained`): config.json, model.safetensors
and tokenizer files, loadable by transformers and by vLLM.
"""

from __future__ import annotations

from pathlib import Path

VOCAB = ["<pad>", "<bos>", "<eos>", "<unk>", "rev", "="] + [str(d) for d in range(10)]
"""16 word-level tokens: specials, the task words, the ten digits."""

TOOL_WORDS = ["+", "<call>", "</call>", "<result>", "</result>", "calc", "error"]
"""Extra words of the calculator tool task: the sum, the call format, tool results."""


def vocab_for(task_name: str) -> list[str]:
    """The word list of a task's tiny tokenizer (the reverse task keeps its 16 tokens)."""
    return VOCAB + TOOL_WORDS if task_name == "calculator" else VOCAB


def build_tokenizer(words: list[str] = VOCAB):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")


def build_model(seed: int = 0, vocab_size: int = len(VOCAB)):
    """Qwen2 from config: hidden 64, 2 layers, 2 heads of dim 32, MLP 256, tied embeddings."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, intermediate_size=256, tie_word_embeddings=True,
        max_position_embeddings=64, attention_dropout=0.0, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def save(model, tokenizer, path: str | Path) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def load_tokenizer(path: str | Path):
    """AutoTokenizer, except for word-level tokenizers like the ones built here: transformers
    maps a qwen2 config.json to Qwen2Tokenizer, whose byte-level pre-tokenizer and decoder would
    mangle their words (`<call>` became unknown); those load exactly as saved."""
    import json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    spec = Path(path) / "tokenizer.json"
    if spec.exists() and json.loads(spec.read_text())["model"]["type"] == "WordLevel":
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


TOOL_RESULT = "<result> {content} </result>"
"""How the tiny chat format (tasks/chat.py TinyChat) shows a tool's answer to the model."""


def render_tool_result(tokenizer, content: str):
    """Token ids (int32) of a tool result in the tiny chat format."""
    import numpy as np

    text = TOOL_RESULT.format(content=content)
    return np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int32)
