"""Typed sections of the scorers family (`task.scorers`, tasks/scorers/) and of the scorer fleet
(`scoring`, actors/scorer.py + learner/scoring.py).

Each scorer is one tagged section; `kind` picks the member of the union, so a field of one kind
cannot be set on another:

    task:
      scorers:
        - {kind: function, name: format, weight: 0.2, fn: tasks.builtin_rewards:regex_format}
        - {kind: classifier, name: rm, weight: 1.0, path: runs/models/my_rm}
        - {kind: judge, name: judge, path: runs/models/smollm2, engine: vllm,
           template: "...{prompt}...{completion}...{label}...", parser: "(\\d+)"}
        - {kind: remote, name: gpt, base_url: http://host:8000/v1, model: m, max_concurrency: 8}

The reward of a sample is the weighted sum of its scorers' scores. `function` scorers run where
today's reward functions run (a process pool in each actor); the model kinds (`classifier`,
`judge`, `remote`) run in the scorer fleet.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from configs.base import Count, Kind, NonNegative, Positive, Section

Name = Annotated[str, Meta(pattern=r"^[A-Za-z][A-Za-z0-9_]{0,40}$",
                           description="a name of letters, digits and _ (starting with a letter)")]
"""A scorer's name: its score is logged as `score_<name>`."""


class ScorerSection(Kind):
    """A scorer: one kind's section of `task.scorers` (configs/base.py Kind)."""


class FunctionScorer(ScorerSection, tag="function", kw_only=True):
    """An import-path reward (tasks/rewards.py), in the actors' process pools."""

    name: Name
    """Its score is logged as `score_<name>`."""
    weight: float = 1.0
    """Weight of this score in the reward."""
    fn: str = ""
    """Reward import path `package.module:function` or `path/to/file.py:function` (tasks/rewards.py
    signature); "" = the task's own reward."""
    kwargs: dict = msgspec.field(default_factory=dict)
    """Keyword arguments passed to every call of `fn`."""
    timeout_s: Positive = 10.0
    """Wall-clock limit of one call; a timed-out call scores 0 and is counted."""
    workers: Count = 2
    """Worker processes of its pool (per actor, and in the learner for evaluation)."""


class ClassifierScorer(ScorerSection, tag="classifier", kw_only=True):
    """An HF sequence-classification model, batched, in the scorer fleet."""

    name: Name
    """Its score is logged as `score_<name>`."""
    weight: float = 1.0
    """Weight of this score in the reward."""
    path: str
    """HF sequence-classification model directory (AutoModelForSequenceClassification + tokenizer)."""
    output: str = ""
    """The output read: a label name of the model's id2label ("" = the last output)."""
    transform: str = "softmax"
    """Logits to a float: softmax (probability of `output`), sigmoid, raw (the logit), or
    `module:fn` called as fn(logits row: list[float]) -> float."""
    max_length: Count = 512
    """Tokens of prompt + completion kept (the left part is cut)."""


class JudgeScorer(ScorerSection, tag="judge", kw_only=True):
    """A generative judge on a Tether engine, in the scorer fleet."""

    name: Name
    """Its score is logged as `score_<name>`."""
    weight: float = 1.0
    """Weight of this score in the reward."""
    path: str
    """HF causal-LM directory of the judge model (frozen: it never takes policy versions)."""
    engine: Literal["hf", "vllm"] = "hf"
    """Tether engine that serves the judge."""
    template: str = ("Rate the answer to the question from 0 to 10.\nQuestion: {prompt}\n"
                     "Answer: {completion}\nReply with the number only.")
    """The judge's user message; {prompt}, {completion} and {label} are filled in (chat template
    of the judge's tokenizer applied)."""
    parser: str = r"(-?\d+(?:\.\d+)?)"
    """A regex whose first group is the score (first match), or an import path `module:fn`
    called as fn(text) -> float."""
    scale: Positive = 10.0
    """The parsed number is divided by this (0-10 ratings -> 0-1)."""
    max_new_tokens: Count = 8
    """Most tokens the judge generates."""
    temperature: Positive = 0.1
    """The judge's sampling temperature (small = nearly greedy)."""
    seed: int = 0
    """Seed of the judge's sampling."""
    vllm_kv_cache_gb: Positive = 1.0
    """vllm: KV cache size in GiB."""


class RemoteScorer(ScorerSection, tag="remote", kw_only=True):
    """An OpenAI-compatible endpoint as the judge, in the scorer fleet."""

    name: Name
    """Its score is logged as `score_<name>`."""
    weight: float = 1.0
    """Weight of this score in the reward."""
    base_url: str
    """OpenAI-compatible endpoint, e.g. http://host:8000/v1 (POST {base_url}/chat/completions)."""
    model: str = "judge"
    """The `model` field of each request."""
    api_key_env: str = ""
    """Environment variable holding the API key ("" = none); the key itself is never in a config."""
    template: str = ("Rate the answer to the question from 0 to 10.\nQuestion: {prompt}\n"
                     "Answer: {completion}\nReply with the number only.")
    """The judge's user message; {prompt}, {completion} and {label} are filled in (chat template
    of the judge's tokenizer applied)."""
    parser: str = r"(-?\d+(?:\.\d+)?)"
    """A regex whose first group is the score (first match), or an import path `module:fn`
    called as fn(text) -> float."""
    scale: Positive = 10.0
    """The parsed number is divided by this (0-10 ratings -> 0-1)."""
    max_new_tokens: Count = 8
    """`max_tokens` of each request."""
    temperature: Annotated[float, Meta(ge=0)] = 0.0
    """`temperature` of each request."""
    max_concurrency: Count = 4
    """Most requests in flight at once, per scorer process."""
    retries: NonNegative = 2
    """Retries of a request that failed (connection error, HTTP 429 or 5xx, timeout)."""
    retry_backoff_s: Annotated[float, Meta(ge=0)] = 0.5
    """Wait before retry k: retry_backoff_s * 2**k."""
    timeout_s: Positive = 30.0
    """Wall-clock limit of one request."""


Scorer = FunctionScorer | ClassifierScorer | JudgeScorer | RemoteScorer
"""One `task.scorers` entry."""

MODEL_KINDS = (ClassifierScorer, JudgeScorer, RemoteScorer)
"""Kinds that run in the scorer fleet (the others run in the actors)."""


class ScoringConfig(Section):
    """The scorer fleet: processes that run the model scorers of `task.scorers`."""

    num_local: NonNegative = 1
    """Scorer processes the learner starts on this node (0 = start them yourself:
    `python -m actors.scorer -c CONFIG LEARNER`)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the scorers' models: auto (CUDA when present, else cpu) | cpu | cuda."""
    batch_size: Count = 32
    """Most samples in one batch sent to a scorer (samples of any actors)."""
    max_wait_s: Annotated[float, Meta(ge=0)] = 0.05
    """A batch smaller than batch_size leaves once its oldest sample waited this long."""
    in_flight: Count = 2
    """Batches a scorer may hold at once (the next one travels while it computes)."""
    batch_timeout_s: Positive = 60.0
    """A batch not answered within this goes to another scorer (a late answer is ignored)."""
    deadline_s: Positive = 300.0
    """A sample not scored this long after its group arrived scores 0 with `reward_failed`."""
