"""Make sure the starting model exists: build the tiny model locally and warm-start it."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from configs.schema import TetherConfig

log = logging.getLogger(__name__)


def ensure_model(cfg: TetherConfig) -> Path:
    path = Path(cfg.model.path)
    if (path / "config.json").exists():
        return path
    if not cfg.model.build_tiny:
        raise FileNotFoundError(f"model.path {path} has no config.json and model.build_tiny is false")
    from models.tiny import build_model, build_tokenizer, save
    from tasks import make_task

    tokenizer = build_tokenizer()
    model = build_model(seed=cfg.learner.seed)
    task = make_task(cfg.task.name, tokenizer, num_digits=cfg.task.num_digits, seed=cfg.learner.seed)
    if cfg.model.warmstart_steps:
        warm_start(model, task, cfg.model.warmstart_steps, cfg.model.warmstart_lr)
    tmp = path.with_name(path.name + ".tmp")
    save(model, tokenizer, tmp)
    tmp.rename(path)  # atomic: a crash never leaves a half-written model directory
    log.info("built tiny model (%d parameters) at %s", sum(p.numel() for p in model.parameters()), path)
    return path


def warm_start(model, task, steps: int, lr: float, batch: int = 64) -> None:
    """Supervised steps on (prompt, reversed digits): gets sampled reward off the floor."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        rows = np.stack([task.supervised_example(task.train_prompt(10_000_000 + step * batch + i))
                         for i in range(batch)])
        ids = torch.from_numpy(rows)
        P = len(task.train_prompt(0).token_ids)
        logits = model(input_ids=ids).logits[:, P - 1:-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 ids[:, P:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss = loss.detach()
    log.info("warm-start: %d supervised steps, final loss %.3f", steps, loss.item())
