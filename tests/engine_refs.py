"""Reference logprobs for engine tests: the learner's own code path on an HF model holding the
same weights as the engine under test (used by tests/test_sglang.py; the same checks as
tests/test_vllm.py)."""

from __future__ import annotations

import numpy as np
import torch


def hf_model(model_dir, state):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model


def noisy_state(model_dir, noise: float = 0.0, seed: int = 0) -> dict[str, torch.Tensor]:
    """The model's weights plus seeded Gaussian noise (tied lm_head left out, as the learner sends)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    return {k: v.detach() + noise * torch.randn(v.shape, generator=g)
            for k, v in model.state_dict().items() if k != "lm_head.weight"}


def prompts(model_dir, n):
    from configs.schema import TaskConfig
    from models.tiny import load_tokenizer
    from tasks import make_task

    task = make_task(TaskConfig(name="reverse", num_digits=4), load_tokenizer(model_dir), seed=3)
    return [task.train_prompt(i).token_ids for i in range(n)]


def reference(model, prompt, completion, temperature):
    """The learner's logprobs of `completion` after `prompt` at `temperature`."""
    from models.logprobs import token_logprobs

    ids = torch.from_numpy(np.concatenate([prompt, completion]).astype(np.int64))[None]
    with torch.no_grad():
        return token_logprobs(model, ids, temperature)[0, len(prompt) - 1:].numpy()
