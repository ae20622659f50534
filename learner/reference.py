"""A plain, in-process synchronous PPO loop: generate with the engine -> loss -> step.

No sockets, no buffer, no leases. It is the yardstick that `max_staleness = 0` must match
bitwise (tests/test_sync_equivalence.py): same prompts in the same order, samples seeded by
(run seed, prompt id, sample index, version), the same Trainer.step.
"""

from __future__ import annotations

import numpy as np
import torch

from actors.engine import GenerateRequest, sample_seed
from actors.hf_engine import HFEngine
from buffer.replay import TrajGroup
from configs.schema import TetherConfig
from learner.backend import SingleProcessBackend
from learner.trainer import Trainer


def run_reference(cfg: TetherConfig, steps: int) -> SingleProcessBackend:
    """Train `steps` synchronous steps from cfg.model.path; returns the trained backend."""
    from transformers import AutoTokenizer

    from tasks import make_task

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    task = make_task(cfg.task.name, tokenizer, num_digits=cfg.task.num_digits, seed=cfg.learner.seed)
    L = cfg.learner
    backend = SingleProcessBackend(cfg.model.path, L.lr, L.weight_decay, L.seed)
    trainer = Trainer(cfg, backend, pad_id=tokenizer.pad_token_id)
    engine = HFEngine(cfg.model.path)
    cursor = 0
    for version in range(steps):
        engine.load_weights(backend.state_dict(), version)
        prompts = [task.train_prompt(cursor + k) for k in range(L.prompts_per_step)]
        cursor += L.prompts_per_step
        reqs = [GenerateRequest(p.token_ids, cfg.task.max_new_tokens, cfg.task.temperature,
                                sample_seed(L.seed, p.prompt_id, i))
                for p in prompts for i in range(L.group_size)]
        outs = engine.generate(reqs)
        groups = []
        for k, p in enumerate(prompts):
            mine = outs[k * L.group_size:(k + 1) * L.group_size]
            groups.append(TrajGroup(
                lease_id=k, prompt_id=p.prompt_id, actor_id="reference",
                prompt_ids=p.token_ids.astype(np.int64),
                completions=[o.token_ids.astype(np.int64) for o in mine],
                logprobs=[o.logprobs.astype(np.float32) for o in mine],
                versions=[o.versions.astype(np.int64) for o in mine],
                loss_masks=[np.ones(len(o.token_ids), np.float32) for o in mine],
                rewards=np.asarray([task.reward(p.meta, o.token_ids) for o in mine], np.float32)))
        trainer.step(groups, version)
    return backend
