"""Typed, shallow configuration for every Tether role.

One `TetherConfig` is shared by the learner and the actors: each role reads the sections it
needs. Every field has a one-line docstring under it; `configs.loader.describe()` turns those
docstrings into `--help` text, so they are the reference documentation of each setting.

Each section is a msgspec Struct. A field's type states what it accepts: `Literal[...]` for a
choice, `Annotated[int, Meta(ge=1)]` for a range, `Meta(pattern=...)` for a format.
`configs.loader` validates a whole config with `msgspec.convert` and turns msgspec's error into
one line naming the field; `check_ranges` keeps only the rules one field's type cannot state
(rules between fields, a reserved value, files that must exist).

Importing this module is cheap (no torch), so entry points can validate a config and print
help before any heavy import.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from configs.agents import (TOOLS, AgentConfig, EndpointAgentConfig, EnvironmentAgentConfig,
                            MultiTurnAgentConfig, OpenAIAgentConfig, SingleTurnAgentConfig,
                            ToolsAgentConfig, VerifiersAgentConfig)
from configs.backends import (BackendConfig, FSDP2BackendConfig, MegatronBackendConfig,
                              SingleBackendConfig)
from configs.base import Count, Kind, NonNegative, Port, Positive, Section
from configs.engines import (EngineConfig, HFEngineConfig, SGLangEngineConfig,
                             SimulatedEngineConfig, StreamingEngineConfig, VLLMEngineConfig,
                             vllm_engine_arg_errors)
from configs.scorers import MODEL_KINDS, Scorer, ScoringConfig

__all__ = [  # the per-kind sections, importable from here too
    "TOOLS", "AgentConfig", "BackendConfig", "Count", "EndpointAgentConfig", "EngineConfig",
    "EnvironmentAgentConfig", "FSDP2BackendConfig", "HFEngineConfig", "Kind",
    "MegatronBackendConfig", "MultiTurnAgentConfig", "NonNegative", "OpenAIAgentConfig", "Port",
    "Positive", "SGLangEngineConfig", "Section", "SimulatedEngineConfig", "SingleBackendConfig",
    "SingleTurnAgentConfig", "StreamingEngineConfig", "ToolsAgentConfig", "VLLMEngineConfig",
    "VerifiersAgentConfig",
]


class ModelConfig(Section):
    path: str = "runs/models/tiny_reverse"
    """HF-format model directory (config, tokenizer, safetensors) the learner starts from."""
    build_tiny: bool = False
    """Build the tiny Qwen2 model at `path` if it holds none (the toy presets; off: an error)."""
    warmstart_steps: NonNegative = 30
    """Supervised warm-start steps run right after building the tiny model (0 = none)."""
    warmstart_lr: float = 3e-3
    """Learning rate of the supervised warm-start."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype of learner and engines: auto = bfloat16 on CUDA, float32 on CPU (master
    weights stay fp32)."""
    ref_path: str = ""
    """HF directory of the frozen KL reference policy (default: `path`, the initial weights)."""
    critic_path: str = ""
    """HF directory the critic's backbone starts from (default: `path`)."""


class TaskConfig(Section):
    name: str = "reverse"
    """A built-in task or `module:make_task` / `file.py:make_task` (docs/models_data_rewards.md)."""
    num_digits: Count = 4
    """Digits the toy reversal task asks to reverse."""
    data_path: str = ""
    """gsm8k: JSONL {question, answer}; data: JSONL / JSON / Parquet or a `datasets` directory."""
    eval_prompts: NonNegative = 128
    """Held-out prompts scored (one sample each) at the start and end of a run (0 = none)."""
    max_new_tokens: Count = 5
    """Most tokens an actor may generate per sample."""
    temperature: Positive = 1.0
    """Sampling temperature; behavior logprobs are those of this tempered distribution."""
    prompt_key: str = "prompt"
    """data: column holding the prompt, a string or a list of chat messages {role, content}."""
    label_key: str = "label"
    """data: column holding the label the reward gets ("" = none)."""
    metadata_keys: str = ""
    """data: comma-separated columns passed to the reward as its metadata dict."""
    system_prompt: str = ""
    """data: system message put before the prompt ("" = none: the chat template's default)."""
    template_kwargs: dict = msgspec.field(default_factory=dict)
    """data: extra apply_chat_template keyword arguments (e.g. enable_thinking)."""
    environment: str = ""
    """environment: module:attribute of the environment whose `dataset` rows are the prompts (docs/agents.md)."""
    verifiers_env: str = ""
    """verifiers: module:attribute (vf.Env, vf.EnvConfig or a function returning one) or an
    environment id; its taskset gives the prompts, its rubric the reward (docs/agents.md)."""
    eval_path: str = ""
    """data: file or directory of held-out rows ("" = hold out eval_fraction of data_path)."""
    eval_fraction: Annotated[float, Meta(ge=0, lt=1)] = 0.1
    """data: fraction of data_path's rows held out for evaluation when eval_path is empty."""
    shuffle: bool = True
    """data: visit the training rows in a seeded random order, a new one every epoch."""
    reward: str = ""
    """Reward `package.module:function` or `path/to/file.py:function`, run in a process pool ("" =
    the task's own; docs/models_data_rewards.md)."""
    reward_kwargs: dict = msgspec.field(default_factory=dict)
    """Keyword arguments of every `reward` call."""
    reward_timeout_s: Positive = 10.0
    """Wall-clock limit of one reward call; a timed-out call scores 0 and is counted."""
    reward_workers: Count = 2
    """Worker processes of the reward pool (per actor, and in the learner for evaluation)."""
    scorers: list[Scorer] = msgspec.field(default_factory=list)
    """The reward as a weighted sum of scorers, each a `kind` section (below;
    docs/models_data_rewards.md); empty = `reward` (or the task's own) alone."""
    reward_max_error_frac: Annotated[float, Meta(gt=0, le=1)] = 0.5
    """Stop the run when more reward calls than this fail, in an evaluation or over the last
    reward_error_window rollouts (1 = never)."""
    reward_error_window: Count = 64
    """Rollouts over which reward_max_error_frac is judged while training."""
    overlong_buffer: NonNegative = 0
    """DAPO soft overlong punishment: the last this many tokens of the completion budget are
    penalised linearly (0 = off)."""
    overlong_penalty: Annotated[float, Meta(ge=0)] = 1.0
    """Reward subtracted from a sample that uses the whole budget (linear within overlong_buffer)."""


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Linear layers of a Qwen2/Llama decoder layer that LoRA can adapt (`learner.lora.targets`)."""
LORA_HEAD = "lm_head"
"""The output head, also a LoRA target (a tied head is adapted alone: the embedding stays)."""
_TARGET = "|".join((*LORA_TARGETS, LORA_HEAD))
TargetList = Annotated[str, Meta(pattern=rf"^\s*({_TARGET})\s*(,\s*({_TARGET})\s*)*$",
                                 description=f"a comma-separated subset of "
                                             f"{(*LORA_TARGETS, LORA_HEAD)}")]
"""Comma-separated names from LORA_TARGETS and LORA_HEAD."""


class LoraConfig(Section):
    rank: NonNegative = 0
    """LoRA rank r of every adapted layer (0 = off: the full weights train; docs/lora.md)."""
    alpha: Positive = 16.0
    """LoRA alpha: the adapter's update B @ A is scaled by alpha / rank."""
    dropout: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    """Dropout on the adapter's input while training (0 = none: rollouts and training see the same
    function)."""
    targets: TargetList = ",".join(LORA_TARGETS)
    """Linear layers of every decoder layer that get an adapter; `lm_head`: the output head too."""

    def target_list(self) -> list[str]:
        return [t.strip() for t in self.targets.split(",")]


class LearnerConfig(Section):
    max_steps: Count = 500
    """Optimizer steps (= policy versions published) before the run ends."""
    max_train_minutes: Annotated[float, Meta(ge=0)] = 0.0
    """Also end after this many minutes of training (start-up excluded; 0 = no limit;
    end_reason time_limit)."""
    stop_at_reward: float | None = None
    """Also end once the sampled reward over the last `stop_reward_window` steps reaches this
    (null = never; end_reason reward_reached)."""
    stop_reward_window: Count = 20
    """Steps averaged for `stop_at_reward`."""
    prompts_per_step: Count = 16
    """GRPO groups (prompts) in one training batch."""
    group_size: Annotated[int, Meta(ge=2, description=">= 2 (group-relative advantages)")] = 8
    """Samples per prompt (the GRPO group size n)."""
    lr: Positive = 5e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (0 = off)."""
    clip_low: Annotated[float, Meta(ge=0, lt=1)] = 0.2
    """PPO clip: the ratio is clipped below at 1 - clip_low."""
    clip_high: Annotated[float, Meta(ge=0)] = 0.2
    """PPO clip: the ratio is clipped above at 1 + clip_high (DAPO clip-higher if > clip_low)."""
    dual_clip: Annotated[float, Meta(ge=0)] = 0.0
    """Dual-clip constant c > 1 bounding the loss for negative advantages (0 = off)."""
    correction: Literal["none", "tis", "decoupled", "mask"] = "none"
    """Off-policy correction (docs/staleness.md)."""
    is_cap: Positive = 2.0
    """C: importance weights are min(pi_prox / mu, C) (tis, decoupled)."""
    is_level: Literal["token", "sequence"] = "token"
    """Importance weights per token or per sequence."""
    mask_low: Annotated[float, Meta(gt=0, lt=1)] = 0.5
    """mask correction: tokens whose pi_theta / mu falls below this get no gradient."""
    mask_high: Annotated[float, Meta(gt=1)] = 2.0
    """mask correction: tokens whose pi_theta / mu rises above this get no gradient."""
    mask_denominator: Literal["trained", "accepted"] = "trained"
    """mask correction: rejected tokens count in the loss's denominators (trained) or not (accepted, as verl)."""
    staleness_decay: Annotated[float, Meta(gt=0, le=1)] = 1.0
    """Per-token IS weights are scaled by decay**staleness (1.0 = no staleness-aware decay)."""
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "constant"] = "token_mean"
    """Loss aggregation (constant: Dr.GRPO, divided by max_new_tokens)."""
    advantage: Literal["grpo", "drgrpo", "rloo", "reinforce_pp", "gae", "vtrace"] = "grpo"
    """grpo: group mean/std; drgrpo: mean only; reinforce_pp: whitened returns; gae, vtrace: critic."""
    minibatches: Count = 1
    """Optimizer steps per batch; the batch is split into this many minibatches by group."""
    epochs: Count = 1
    """Passes over each batch."""
    checkpoint_every: NonNegative = 100
    """Save a checkpoint every N steps (0 = only at the end)."""
    checkpoint_keep: NonNegative = 2
    """Keep the newest N checkpoints, deleting older ones once a new one is complete (0 = all)."""
    resume: bool = False
    """Continue the run in run_dir from its newest checkpoint (not another run's)."""
    overwrite: bool = False
    """Replace the run run_dir holds (its files are deleted first); without it, an error."""
    log_every: Count = 10
    """Print a progress line every N steps (metrics.jsonl gets every step)."""
    trace_steps: NonNegative = 0
    """Steps traced into run_dir/trace.json (Chrome/Perfetto; 0 = none; docs/operations.md)."""
    trace_from_step: NonNegative = 5
    """The traced steps start after this version (past start-up)."""
    tensorboard: bool = True
    """Also write every step's metrics to run_dir/tensorboard (if tensorboard is installed)."""
    tracker: Literal["none", "wandb", "mlflow"] = "none"
    """Also send metrics and summary to W&B or MLflow (needs `.[tracking]`)."""
    tracker_project: str = "tether"
    """W&B project / MLflow experiment name the run is logged under."""
    tracker_online: bool = False
    """false: offline (files in run_dir); true: W&B syncs, MLflow uses MLFLOW_TRACKING_URI."""
    seed: int = 0
    """Seed for the prompt order and the learner's torch RNG."""
    backend: BackendConfig = msgspec.field(default_factory=SingleBackendConfig)
    """Training backend (each kind's section below; docs/backends.md)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Training device: auto = CUDA when present, else cpu; cuda = cuda:LOCAL_RANK."""
    cpu_placement: Literal["shared", "split"] = "shared"
    """CPU, local actors: shared (every process on every core) | split (learner ranks and
    actors pinned to disjoint halves; docs/operations.md)."""
    collective_timeout_s: Positive = 1800.0
    """Timeout of every collective between the learner's ranks."""
    kl_coef: Annotated[float, Meta(ge=0)] = 0.0
    """Weight of the KL to the frozen reference policy (0 = no reference model is loaded)."""
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    """Per-token KL estimator (Schulman 2020; low_var_kl: k3 clamped as verl does)."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Reference KL as a term of the loss, or subtracted from the rewards."""
    entropy_coef: Annotated[float, Meta(ge=0)] = 0.0
    """Entropy bonus: the loss minus this times the mean policy entropy (logged either way)."""
    gamma: Annotated[float, Meta(ge=0, le=1)] = 1.0
    """Discount per token (gae, vtrace, reinforce_pp)."""
    reinforce_pp_std: Literal["population", "bessel"] = "population"
    """reinforce_pp: whiten with the population std (OpenRLHF) or the Bessel-corrected one (verl)."""
    lam: Annotated[float, Meta(ge=0, le=1)] = 1.0
    """GAE lambda."""
    value_clip: Annotated[float, Meta(ge=0)] = 0.2
    """Clipped value loss: new values stay within this of the step-start values (0 = unclipped)."""
    critic_lr: Positive = 1e-3
    """AdamW learning rate of the critic (its own optimizer; gae and vtrace)."""
    vtrace_rho: Positive = 1.0
    """V-trace rho-bar: truncation of pi_prox / mu in the temporal differences and advantages."""
    vtrace_c: Positive = 1.0
    """V-trace c-bar: truncation of pi_prox / mu in the trace coefficients."""
    ratio_level: Literal["token", "sequence"] = "token"
    """PPO ratio per token, or per sequence (GSPO: the length-normalised sequence ratio is
    clipped)."""
    policy_loss: Literal["ppo", "cispo"] = "ppo"
    """ppo: clipped surrogate; cispo: REINFORCE with a clipped, stop-gradient ratio weight (bounds
    1 - clip_low, 1 + clip_high)."""
    drop_uniform_groups: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal, lease more prompts."""
    mask_truncated: bool = False
    """Samples that used the whole completion budget without ending get no gradient."""
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)
    """LoRA: train low-rank adapters on a frozen base; actors get the base once, then adapters."""
    max_tokens_per_microbatch: NonNegative = 0
    """Per rank: rows split by length into micro-batches of at most this many tokens,
    gradients accumulated (0 = one batch; single, fsdp2)."""
    pack_rows: bool = False
    """Pack each micro-batch's rows into one sequence (needs max_tokens_per_microbatch)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them."""


class ActorsConfig(Section):
    num_local: NonNegative = 2
    """Actor processes the learner spawns on this node (0 = start actors yourself)."""
    engine: EngineConfig = msgspec.field(default_factory=HFEngineConfig)
    """Rollout engine (each kind's section below; docs/engines.md)."""
    groups_per_request: Count = 8
    """Leases an actor asks for at once, generated as one batch (fuller batches, later samples)."""
    agent: AgentConfig = msgspec.field(default_factory=SingleTurnAgentConfig)
    """Agent run per sample (each kind's section below; docs/agents.md)."""
    join_timeout_s: Annotated[float, Meta(ge=0)] = 0.0
    """Seconds an actor tries to join before it exits (code 4); 0 = forever."""


class BufferConfig(Section):
    capacity_groups: int = 64
    """Most complete groups the buffer holds; when full the learner stops reading trajectories."""
    max_reuse: Count = 1
    """Batches a group may be served in (1 = use once); reuse is still bound by max_staleness."""
    sampling: Literal["fifo", "newest", "uniform"] = "fifo"
    """Which fresh groups a batch gets: fifo (oldest first) | newest | uniform (seeded)."""


class TransportConfig(Section):
    kind: Literal["zmq", "inproc"] = "zmq"
    """zmq: TCP, processes on any nodes; inproc: local actors as threads (debugging, tests)."""
    host: str = "127.0.0.1"
    """Interface the learner binds to (0.0.0.0 to accept actors on other nodes)."""
    advertise_host: str = ""
    """Host name actors should dial, written to endpoints.json (default: host)."""
    control_port: Port = 0
    """Control ROUTER port (0 = pick a free port)."""
    trajectory_port: Port = 0
    """Trajectory PULL port (0 = pick a free port)."""
    weights_port: Port = 0
    """Weights ROUTER port (0 = pick a free port)."""
    heartbeat_s: Positive = 1.0
    """Seconds between actor heartbeats."""
    peer_timeout_s: float = 10.0
    """A peer silent this long is dead: its leases expire (learner) or it reconnects (actor)."""
    max_message_bytes: Annotated[int, Meta(ge=1024)] = 64 * 1024 * 1024
    """ZMQ_MAXMSGSIZE on every learner receive socket; larger frames drop the connection."""
    high_water_mark: Count = 64
    """ZMQ send/receive high-water mark (messages) on every socket."""
    weight_bucket_bytes: Annotated[int, Meta(ge=1024)] = 32 * 1024 * 1024
    """Weights are sent to actors in buckets of about this many bytes."""
    weights_via: Literal["zmq", "relay", "filesystem", "nccl"] = "zmq"
    """zmq | relay | filesystem (weights_dir) | nccl: ARCHITECTURE.md."""
    weight_full_every: NonNegative = 0
    """K > 0: lossless deltas, a full version every K."""
    weight_load: Literal["staged", "streamed"] = "staged"
    """staged: load a version once whole; streamed: each bucket as it arrives."""
    nccl_engines: NonNegative = 0
    """nccl: the vLLM or SGLang engines in the broadcast."""
    relay_fanout: Annotated[int, Meta(ge=1)] = 1
    """Relays fed by each relay (1: a chain)."""
    weights_dir: str = ""
    """filesystem weights: shared directory for the version files (default: run_dir/weights)."""
    curve_server_secret: str = ""
    """Learner: its CURVE secret key file (from tether-keys); set to turn on CURVE."""
    curve_allowed_dir: str = ""
    """Learner: directory of the actors' public key files that may connect."""
    curve_client_secret: str = ""
    """Actor: its own CURVE secret key file."""
    curve_server_public: str = ""
    """Actor: the learner's public key file."""


GpuList = Annotated[str, Meta(pattern=r"^\s*\d+(\s*-\s*\d+)?(\s*,\s*\d+(\s*-\s*\d+)?)*\s*$",
                               description='GPU indices and ranges joined by commas, e.g. "0-3"')]
"""A list of GPUs of one node (configs/placement.py)."""
GpuIndex = Annotated[int, Meta(ge=0)]
"""One GPU (YAML reads `4` as a number)."""


class PlacementConfig(Section):
    gpus_per_node: NonNegative = 0
    """GPUs of each node (0 = count them at start; stated: checked at load)."""
    learner: Annotated[str, Meta(pattern=r"^(auto|\s*\d+(\s*-\s*\d+)?(\s*,\s*\d+(\s*-\s*\d+)?)*\s*)$",
                                 description='auto or GPU indices and ranges, e.g. "0-3"')] | GpuIndex = "auto"
    """The learner's GPUs, one per local rank, e.g. "0-3" (auto: the first ones)."""
    actors: list[GpuList | GpuIndex] = []
    """Each local actor's GPUs, e.g. ["4,5", "6,7"] ([] = auto: after the learner's)."""
    scorers: list[GpuList | GpuIndex] = []
    """Each reward scorer's GPUs ([] = none)."""


class TetherConfig(Section):
    run_dir: str = "runs/toy_reverse"
    """Directory for endpoints.json, metrics.jsonl, checkpoints, summary.json and the final model."""
    max_staleness: NonNegative = 1
    """eta: a sample is trained on at step s only if s - (oldest token version) <= eta; 0 = synchronous PPO."""
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    """The policy model."""
    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    """The RL task: prompts, rewards, sampling."""
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    """The trainer."""
    actors: ActorsConfig = msgspec.field(default_factory=ActorsConfig)
    """The rollout actors."""
    buffer: BufferConfig = msgspec.field(default_factory=BufferConfig)
    """The replay buffer between trajectory receiver and trainer."""
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)
    """ZeroMQ sockets, heartbeats and limits."""
    scoring: ScoringConfig = msgspec.field(default_factory=ScoringConfig)
    """The scorer fleet that runs the model scorers of task.scorers."""
    placement: PlacementConfig = msgspec.field(default_factory=PlacementConfig)
    """Which GPUs each process on the learner's node gets (configs/placement.py)."""


BUILTIN_TASKS = ("reverse", "calculator", "gsm8k", "data", "additions", "environment",
                 "verifiers")
"""Short names of the built-in tasks (`task.name`); tasks/registry.py makes each."""
REWARD_TASKS = ("data", "additions")
"""The built-in tasks that score with `task.reward`; the others score with their own reward
(reverse, calculator, gsm8k) or their environment's rubric (environment, verifiers)."""


def max_completion_tokens(cfg: TetherConfig) -> int:
    """Most completion tokens one sample may have: one turn for single-turn agents, the
    multi-turn budget (model + tool tokens) otherwise. The learner refuses longer samples."""
    agent = cfg.actors.agent
    if isinstance(agent, MultiTurnAgentConfig):
        return agent.max_total_tokens
    return cfg.task.max_new_tokens


def check_ranges(cfg: TetherConfig) -> list[str]:
    """Return one message per rule broken (empty when the config is valid). Only the rules one
    field's type cannot state are here: between fields, a reserved value, files that must exist."""
    errors: list[str] = []

    def need(ok: bool, key: str, rule: str, value: object) -> None:
        if not ok:
            errors.append(f"{key} must be {rule}, got {value!r}")

    L, A, T = cfg.learner, cfg.actors, cfg.transport
    agent, task = A.agent, cfg.task
    need(L.dual_clip == 0 or L.dual_clip > 1, "learner.dual_clip", "0 (off) or > 1", L.dual_clip)
    need(L.prompts_per_step % L.minibatches == 0, "learner.minibatches",
         f">= 1 and divide learner.prompts_per_step={L.prompts_per_step}", L.minibatches)
    if isinstance(L.backend, MegatronBackendConfig):
        need(L.kl_coef == 0 and L.entropy_coef == 0 and L.advantage not in ("gae", "vtrace"),
             "learner.backend", "single or fsdp2 with a reference KL, an entropy bonus or a critic "
             "(not built for megatron yet)", L.backend.kind)
        need(not L.pack_rows, "learner.backend",
             "single or fsdp2 with learner.pack_rows=true (not built for megatron)",
             L.backend.kind)
        need(L.max_tokens_per_microbatch == 0, "learner.backend",
             "single or fsdp2 with learner.max_tokens_per_microbatch > 0 (megatron splits its "
             "batches into its own pipeline micro-batches)", L.backend.kind)
        need(L.lora.rank == 0, "learner.backend",
             "single or fsdp2 with learner.lora.rank > 0 (LoRA is not built for megatron)",
             L.backend.kind)
        world = int(os.environ.get("WORLD_SIZE", "0"))  # known only under torchrun
        need(not world or world % (L.backend.tp * L.backend.pp) == 0,
             "learner.backend.tp * learner.backend.pp",
             f"a divisor of the torchrun world size {world}", L.backend.tp * L.backend.pp)
    need(not L.pack_rows or L.max_tokens_per_microbatch > 0, "learner.pack_rows",
         "false unless learner.max_tokens_per_microbatch > 0 (it packs each micro-batch's rows)",
         L.pack_rows)
    need(T.weight_load == "staged" or (T.weights_via in ("zmq", "relay")
                                       and T.weight_full_every == 0 and L.lora.rank == 0),
         "transport.weight_load", "staged with weights_via filesystem or nccl, deltas "
         "(weight_full_every > 0) or LoRA (only full versions over zmq or relay stream)",
         T.weight_load)
    if T.weights_via == "nccl":
        need(A.engine.weight_broadcast() is not None and T.nccl_engines >= 1
             and L.lora.rank == 0, "transport.weights_via", "zmq, relay or filesystem unless "
             "actors.engine is vllm or sglang with transport.nccl_engines >= 1 and full weights "
             "(learner.lora.rank 0)", T.weights_via)
    if isinstance(agent, MultiTurnAgentConfig):
        need(agent.max_total_tokens >= task.max_new_tokens, "actors.agent.max_total_tokens",
             f">= task.max_new_tokens={task.max_new_tokens}", agent.max_total_tokens)
    if isinstance(agent, EnvironmentAgentConfig):
        need(":" in (agent.environment or task.environment), "actors.agent.environment",
             "module:attribute (or task.environment set) when actors.agent is environment",
             agent.environment)
    need(task.name != "environment" or ":" in task.environment, "task.environment",
         "module:attribute when task.name is environment", task.environment)
    need(task.name != "environment" or isinstance(agent, EnvironmentAgentConfig), "actors.agent",
         "environment when task.name is environment (its rubric scores the rollouts)", agent.kind)
    need(isinstance(agent, VerifiersAgentConfig) == (task.name == "verifiers"), "actors.agent",
         "verifiers exactly when task.name is verifiers (its taskset's tasks are what the agent "
         "plays)", agent.kind)
    need(task.name != "verifiers" or bool(task.verifiers_env), "task.verifiers_env",
         "module:attribute or a verifiers environment id when task.name is verifiers",
         task.verifiers_env)
    if task.name == "environment" and isinstance(agent, EnvironmentAgentConfig):
        need(agent.environment in ("", task.environment), "actors.agent.environment",
             f"empty or task.environment={task.environment!r} when task.name is environment",
             agent.environment)
    need(cfg.buffer.capacity_groups >= L.prompts_per_step, "buffer.capacity_groups",
         f">= learner.prompts_per_step={L.prompts_per_step}", cfg.buffer.capacity_groups)
    need(cfg.task.name != "gsm8k" or bool(cfg.task.data_path), "task.data_path",
         "set (a JSONL file) when task.name is gsm8k", cfg.task.data_path)
    need(cfg.task.name in BUILTIN_TASKS or ":" in cfg.task.name, "task.name",
         f"one of {', '.join(BUILTIN_TASKS)} or an import path module:make_task", cfg.task.name)
    need(cfg.task.name != "data" or bool(cfg.task.data_path), "task.data_path",
         "set (a JSONL/Parquet file or a save_to_disk directory) when task.name is data",
         cfg.task.data_path)
    need(not cfg.task.reward or ":" in cfg.task.reward, "task.reward",
         "an import path module:function or path/to/file.py:function", cfg.task.reward)
    need(not cfg.task.reward or cfg.task.name in REWARD_TASKS or cfg.task.name not in BUILTIN_TASKS,
         "task.reward", f"empty with task.name={cfg.task.name} (that task scores with its own "
         "reward; task.reward is used by task.name data, additions or a task given by import "
         "path)", cfg.task.reward)
    need(not (L.resume and L.overwrite), "learner.overwrite", "false with learner.resume=true "
         "(resume continues the run that overwrite would delete)", L.overwrite)
    need(T.peer_timeout_s > 2 * T.heartbeat_s, "transport.peer_timeout_s",
         f"> 2 * transport.heartbeat_s={T.heartbeat_s}", T.peer_timeout_s)
    need(bool(T.curve_server_secret) == bool(T.curve_allowed_dir), "transport.curve_allowed_dir",
         "set together with transport.curve_server_secret", T.curve_allowed_dir)
    need(bool(T.curve_client_secret) == bool(T.curve_server_public), "transport.curve_server_public",
         "set together with transport.curve_client_secret", T.curve_server_public)
    for key in ("curve_server_secret", "curve_allowed_dir", "curve_client_secret", "curve_server_public"):
        path = getattr(T, key)
        need(not path or Path(path).exists(), f"transport.{key}", "an existing path", path)
    need(T.kind != "inproc" or A.num_local >= 1, "actors.num_local",
         ">= 1 with transport.kind=inproc (no other process can reach in-process sockets)",
         A.num_local)
    need(T.kind != "inproc" or not (T.curve_server_secret or T.curve_client_secret),
         "transport.kind", "zmq when CURVE is on (in-process sockets are not encrypted)", T.kind)
    need(L.advantage != "vtrace" or L.correction in ("none", "mask"), "learner.correction",
         "none or mask with learner.advantage=vtrace (its advantages already carry the "
         "truncated ratio rho)", L.correction)
    need(L.policy_loss != "cispo" or L.correction != "tis", "learner.policy_loss",
         "ppo with learner.correction=tis (tis is its own policy gradient)", L.policy_loss)
    need(cfg.task.overlong_buffer <= max_completion_tokens(cfg), "task.overlong_buffer",
         f"<= the completion budget {max_completion_tokens(cfg)}", cfg.task.overlong_buffer)
    errors += placement_errors(cfg)
    if isinstance(A.engine, VLLMEngineConfig):
        errors += vllm_engine_arg_errors(A.engine.engine_args)
    need(T.weight_bucket_bytes < T.max_message_bytes, "transport.weight_bucket_bytes",
         f"< transport.max_message_bytes={T.max_message_bytes}", T.weight_bucket_bytes)
    errors += _scorer_rules(cfg)
    return errors


def model_scorers(cfg: TetherConfig) -> list:
    """The scorers of task.scorers that run in the scorer fleet (classifier, judge, remote)."""
    return [s for s in cfg.task.scorers if isinstance(s, MODEL_KINDS)]


def _scorer_rules(cfg: TetherConfig) -> list[str]:
    task, errors = cfg.task, []
    names = [s.name for s in task.scorers]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        errors.append(f"task.scorers names must be unique, got {dup[0]!r} twice")
    if task.scorers and task.reward:
        errors.append(f"task.reward must be empty when task.scorers is set (add it as "
                      f"{{kind: function, fn: {task.reward}}}), got {task.reward!r}")
    for i, s in enumerate(task.scorers):
        if getattr(s, "fn", "") and ":" not in s.fn:
            errors.append(f"task.scorers[{i}].fn must be an import path module:function, "
                          f"got {s.fn!r}")
    return errors


def engine_gpus(cfg: TetherConfig, node_gpus: int) -> int:
    """GPUs one local actor's engine spans on a node of `node_gpus` GPUs: vLLM's
    tensor_parallel_size, SGLang's tp_size, one HF engine GPU; none for the simulated engine,
    an HF engine on the CPU, or a node without GPUs."""
    return cfg.actors.engine.gpus() if node_gpus else 0


def placement_errors(cfg: TetherConfig) -> list[str]:
    """The placement's problem as one line, when the config states the node's GPUs
    (`placement.gpus_per_node`) and the learner's GPUs (the learner starts with the rest known)."""
    from configs.placement import PlacementError, parse_devices, plan

    P = cfg.placement
    if P.gpus_per_node == 0 or P.learner == "auto" or cfg.learner.device == "cpu":
        return []
    try:
        ranks = len(parse_devices(str(P.learner), "placement.learner"))
        plan(P.gpus_per_node, ranks, str(P.learner), cfg.actors.num_local,
             engine_gpus(cfg, P.gpus_per_node), [str(a) for a in P.actors],
             [str(a) for a in P.scorers])
    except PlacementError as e:
        return [str(e)]
    return []
