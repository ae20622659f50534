"""Make sure the starting model exists: build the tiny model locally and warm-start it."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from configs.schema import TetherConfig

log = logging.getLogger(__name__)


def missing_model(cfg: TetherConfig) -> str | None:
    """The one line saying model.path holds no model and none may be built there (None when it
    holds one, or model.build_tiny asks for the toy model). Cheap: no torch."""
    path = Path(cfg.model.path)
    if (path / "config.json").exists() or cfg.model.build_tiny:
        return None
    return (f"model.path {path} holds no model (no config.json); set model.build_tiny=true to "
            "build the toy model there")


def ensure_model(cfg: TetherConfig) -> Path:
    path = Path(cfg.model.path)
    if (path / "config.json").exists():
        return path
    if not cfg.model.build_tiny:
        raise FileNotFoundError(missing_model(cfg))
    from models.tiny import build_model, build_tokenizer, save, vocab_for
    from tasks import make_task

    words = vocab_for(cfg.task.name)
    tokenizer = build_tokenizer(words)
    model = build_model(seed=cfg.learner.seed, vocab_size=len(words))
    task = make_task(cfg.task, tokenizer, seed=cfg.learner.seed)
    if cfg.model.warmstart_steps:
        warm_start(model, task, cfg.model.warmstart_steps, cfg.model.warmstart_lr)
    tmp = path.with_name(path.name + ".tmp")
    save(model, tokenizer, tmp)
    tmp.rename(path)  # atomic: a crash never leaves a half-written model directory
    log.info("built tiny model (%d parameters) at %s", sum(p.numel() for p in model.parameters()), path)
    return path


def warm_start(model, task, steps: int, lr: float, batch: int = 64) -> None:
    """Supervised steps on the task's ideal trajectories (e.g. prompt + reversed digits, or a
    tool call, its result and the answer): gets sampled reward off the floor. Only the tokens
    the task marks as the model's are trained on (prompt and tool results are not)."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        examples = [task.supervised_example(task.train_prompt(10_000_000 + step * batch + i))
                    for i in range(batch)]
        length = max(len(ids) for ids, _ in examples)
        rows = np.zeros((batch, length), dtype=np.int64)
        labels = np.full((batch, length), -100, dtype=np.int64)  # -100: not trained on
        for i, (ids, mask) in enumerate(examples):
            rows[i, :len(ids)] = ids
            labels[i, :len(ids)] = np.where(mask > 0, ids, -100)
        ids, target = torch.from_numpy(rows), torch.from_numpy(labels)
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 target[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss = loss.detach()
    log.info("warm-start: %d supervised steps, final loss %.3f", steps, loss.item())
