"""Prompts from your data, rewards from your function (`task.name: data`).

    task:
      name: data
      data_path: train.jsonl          # .jsonl / .json / .parquet, or a save_to_disk directory
      prompt_key: prompt              # a string, or a list of chat messages {role, content}
      label_key: answer               # passed to the reward as `label` ("" = none)
      metadata_keys: source,level     # passed to the reward as the `metadata` dict
      system_prompt: "..."            # optional system message
      reward: my_pkg.rewards:score    # see tasks/rewards.py for the signature

Files are read with the `datasets` library, only where prompts are made (the learner); actors
score from the lease's `meta` alone (`label` and `metadata` travel JSON-encoded in it). Prompts
are rendered with the tokenizer's chat template (`add_generation_prompt`), or tokenized as they
are when a tokenizer has none and the prompt is a string.

Order: the training stream is epoch after epoch over the training rows, each epoch in its own
seeded order (`learner.seed`, `task.shuffle`), so the `index`-th training prompt is a pure
function of (seed, index): the learner's prompt cursor (state.json) resumes it exactly.
Held-out rows: `task.eval_path`, else a fixed `task.eval_fraction` of the rows (the same for
every seed).
"""

from __future__ import annotations

import json
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np

from configs.schema import TaskConfig
from tasks.base import Prompt

SPLIT_SEED = 20240917
"""Seed of the held-out split when it is taken from data_path (independent of learner.seed)."""


class DataError(ValueError):
    """A data file, row or column is not usable; the message names it."""


def load_rows(path: str | Path) -> list[dict]:
    """Every row of a JSONL / JSON / Parquet file or a `save_to_disk` directory, as dicts."""
    import datasets

    path = Path(path)
    datasets.disable_progress_bars()
    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            raise DataError(f"{path} holds a DatasetDict with splits {sorted(ds)}; point the "
                            f"path at one split's directory, e.g. {path / next(iter(ds))}")
        return ds.to_list()
    if not path.is_file():
        raise DataError(f"{path} does not exist")
    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(path.suffix)
    if kind is None:
        raise DataError(f"{path}: unknown format {path.suffix!r} (use .jsonl, .json, .parquet "
                        f"or a save_to_disk directory)")
    if kind == "json" and path.suffix == ".jsonl":
        _check_jsonl(path)  # datasets' own error does not say which line is broken
    import pyarrow

    try:
        ds = datasets.load_dataset(kind, data_files=str(path), split="train")
    except (datasets.exceptions.DatasetGenerationError, pyarrow.ArrowException) as e:
        raise DataError(f"{path}: cannot read it as {path.suffix}: {e.__cause__ or e}") from e
    return ds.to_list()


def _check_jsonl(path: Path) -> None:
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{n}: a line must hold a JSON object, got "
                                f"{type(row).__name__}")


def check_rows(rows: list[dict], path: str, cfg: TaskConfig) -> None:
    """Every row has the columns the config names, and a prompt of a usable shape."""
    if not rows:
        raise DataError(f"{path}: no rows")
    keys = [cfg.prompt_key, *([cfg.label_key] if cfg.label_key else []), *_metadata_keys(cfg)]
    fields = {cfg.prompt_key: "task.prompt_key", cfg.label_key: "task.label_key"}
    for i, row in enumerate(rows):
        for key in keys:
            if key not in row:
                raise DataError(f"{path}: row {i}: no column {key!r} "
                                f"({fields.get(key, 'task.metadata_keys')}); columns: {sorted(row)}")
            if row[key] is None and key in fields:  # JSON lines without the key read as null
                raise DataError(f"{path}: row {i}: column {key!r} ({fields[key]}) is missing "
                                f"or null")
        problem = _prompt_problem(row[cfg.prompt_key])
        if problem:
            raise DataError(f"{path}: row {i}: column {cfg.prompt_key!r} (task.prompt_key) {problem}")


def _prompt_problem(p) -> str:
    if isinstance(p, str):
        return "" if p else "is an empty string"
    if not isinstance(p, list) or not p:
        return f"must be a string or a non-empty list of chat messages, got {type(p).__name__}"
    for j, msg in enumerate(p):
        if not (isinstance(msg, dict) and isinstance(msg.get("role"), str)
                and isinstance(msg.get("content"), str)):
            return f"message {j} must be {{'role': str, 'content': str}}, got {msg!r}"
    return ""


def split_rows(rows: list[dict], eval_fraction: float, what: str) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows): a fixed `eval_fraction` of `rows` held out (SPLIT_SEED,
    the same for every learner.seed), both in file order."""
    order = np.random.default_rng(SPLIT_SEED).permutation(len(rows))
    k = int(round(eval_fraction * len(rows)))
    if k >= len(rows):
        raise DataError(f"{what}: task.eval_fraction={eval_fraction} leaves no training rows of "
                        f"{len(rows)}")
    held_idx = set(order[:k].tolist())
    return ([r for i, r in enumerate(rows) if i not in held_idx],
            [rows[i] for i in sorted(held_idx)])


def _metadata_keys(cfg: TaskConfig) -> list[str]:
    return [k.strip() for k in cfg.metadata_keys.split(",") if k.strip()]


class DataTask:
    name = "data"

    def __init__(self, cfg: TaskConfig, tokenizer, seed: int = 0,
                 rows: tuple[list[dict], list[dict]] | None = None) -> None:
        """Rows come from `cfg.data_path` / `cfg.eval_path` when first needed, or are given as
        (training rows, held-out rows) by a task that generates them (tasks/additions.py)."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.seed = seed
        self._given = rows

    @cached_property
    def _split(self) -> tuple[list[dict], list[dict]]:
        cfg = self.cfg
        if self._given is not None:
            train, held = self._given
            check_rows(train, "training rows", cfg)
            check_rows(held, "held-out rows", cfg)
            return train, held
        rows = load_rows(cfg.data_path)
        check_rows(rows, cfg.data_path, cfg)
        if cfg.eval_path:
            held = load_rows(cfg.eval_path)
            check_rows(held, cfg.eval_path, cfg)
            return rows, held
        return split_rows(rows, cfg.eval_fraction, cfg.data_path)

    @property
    def num_train(self) -> int:
        return len(self._split[0])

    @lru_cache(maxsize=4)
    def _order(self, epoch: int) -> np.ndarray:
        n = self.num_train
        if not self.cfg.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def position(self, index: int) -> tuple[int, int]:
        """(epoch, training row) of the `index`-th training prompt."""
        epoch, k = divmod(index, self.num_train)
        return epoch, int(self._order(epoch)[k])

    def train_prompt(self, index: int) -> Prompt:
        _, row = self.position(index)
        return self._prompt(index, self._split[0][row], row)

    def eval_prompts(self, n: int) -> list[Prompt]:
        """The first `n` held-out prompts; with more than there are rows, the rows again (with
        new prompt ids, so new samples)."""
        held = self._split[1]
        return [self._prompt(-1 - i, held[i % len(held)], i % len(held)) for i in range(n)]

    def messages(self, prompt) -> list[dict]:
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.cfg.system_prompt and msgs[0]["role"] != "system":
            msgs = [{"role": "system", "content": self.cfg.system_prompt}, *msgs]
        return msgs

    def _prompt(self, prompt_id: int, row: dict, row_index: int) -> Prompt:
        cfg, tok = self.cfg, self.tokenizer
        p = row[cfg.prompt_key]
        if tok.chat_template is None and isinstance(p, str) and not cfg.system_prompt:
            ids = tok(p, add_special_tokens=False)["input_ids"]
        elif tok.chat_template is None:
            raise DataError("the tokenizer has no chat template: prompts must be plain strings "
                            "and task.system_prompt empty")
        else:
            ids = tok.apply_chat_template(self.messages(p), add_generation_prompt=True,
                                          tokenize=True, return_dict=False, **cfg.template_kwargs)
        meta = {"task": self.name, "row": str(row_index),
                "label": json.dumps(row[cfg.label_key] if cfg.label_key else None, default=str),
                "metadata": json.dumps({k: row[k] for k in _metadata_keys(cfg)}, default=str)}
        return Prompt(prompt_id=prompt_id, token_ids=np.asarray(ids, dtype=np.int32), meta=meta)

    @cached_property
    def _pool(self):
        from tasks.rewards import RewardPool

        c = self.cfg
        return RewardPool(c.reward, c.reward_kwargs, c.reward_workers, c.reward_timeout_s)

    async def reward(self, meta: dict[str, str], completion_ids: np.ndarray):
        """The configured reward on one completion: a `RewardResult` (reward + named scores)."""
        ids = np.asarray(completion_ids).tolist()
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return await self._pool.score(text, ids, json.loads(meta["label"]),
                                      json.loads(meta["metadata"]))

    def supervised_example(self, prompt: Prompt):
        raise NotImplementedError("data tasks have no supervised warm-start; "
                                  "set model.warmstart_steps=0")


def make_task(cfg: TaskConfig, tokenizer, seed: int = 0) -> DataTask:
    """`task.name: data` (= `tasks.data:make_task`)."""
    if not cfg.reward and not cfg.scorers:
        raise DataError("task.reward (or task.scorers) must name a reward for task.name=data")
    return DataTask(cfg, tokenizer, seed)
