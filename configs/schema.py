"""Typed, shallow configuration for every Tether role.

One `TetherConfig` is shared by the learner and the actors: each role reads the sections it
needs. Every field has a one-line docstring under it; `configs.loader.describe()` turns those
docstrings into `--help` text, so they are the reference documentation of each setting.

Importing this module is cheap (no torch), so entry points can validate a config and print
help before any heavy import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ModelConfig:
    path: str = "runs/models/tiny_reverse"
    """HF-format model directory (config, tokenizer, safetensors) the learner starts from."""
    build_tiny: bool = True
    """If `path` does not exist, build the tiny Qwen2 model + tokenizer there (no hub needed)."""
    warmstart_steps: int = 30
    """Supervised warm-start steps run right after building the tiny model (0 = none)."""
    warmstart_lr: float = 3e-3
    """Learning rate of the supervised warm-start."""


@dataclass
class TaskConfig:
    name: str = "reverse"
    """Task module in `tasks/` that makes prompts and scores completions."""
    num_digits: int = 4
    """Length of the digit string the toy reversal task asks to reverse."""
    data_path: str = ""
    """gsm8k: JSONL file of {"question", "answer": "... #### N"} lines (every 10th is held out)."""
    eval_prompts: int = 128
    """Held-out prompts scored (one sample each) at the start and end of a run."""
    max_new_tokens: int = 5
    """Most tokens an actor may generate per sample."""
    temperature: float = 1.0
    """Sampling temperature; behavior logprobs are those of this tempered distribution."""


@dataclass
class LearnerConfig:
    max_steps: int = 500
    """Optimizer steps (= policy versions published) before the run ends."""
    prompts_per_step: int = 16
    """GRPO groups (prompts) in one training batch."""
    group_size: int = 8
    """Samples per prompt (the GRPO group size n)."""
    lr: float = 5e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (0 = off)."""
    clip_low: float = 0.2
    """PPO clip: the ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.2
    """PPO clip: the ratio is clipped above at 1 + clip_high (DAPO's clip-higher if > clip_low)."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 bounding the loss for negative advantages (0 = off)."""
    correction: str = "none"
    """Off-policy correction: none | tis | decoupled | mask (see README)."""
    is_cap: float = 2.0
    """C: importance weights min(pi_prox / mu, C) are truncated at this value (tis, decoupled)."""
    is_level: str = "token"
    """Importance weight granularity: token | sequence."""
    mask_low: float = 0.5
    """mask correction: tokens whose pi_theta / mu falls below this get no gradient."""
    mask_high: float = 2.0
    """mask correction: tokens whose pi_theta / mu rises above this get no gradient."""
    staleness_decay: float = 1.0
    """Per-token IS weights are scaled by decay**staleness (1.0 = no staleness-aware decay)."""
    loss_agg: str = "token_mean"
    """Loss aggregation: token_mean | seq_mean_token_mean | constant (Dr.GRPO, / max_new_tokens)."""
    advantage: str = "grpo"
    """Advantage estimator: grpo (group mean/std) | drgrpo (group mean only) | rloo."""
    minibatches: int = 1
    """Optimizer steps per batch; the batch is split into this many minibatches by group."""
    epochs: int = 1
    """Passes over each batch."""
    checkpoint_every: int = 100
    """Save a checkpoint every N steps (0 = only at the end)."""
    resume: bool = False
    """Continue from the newest checkpoint in run_dir/checkpoints."""
    log_every: int = 10
    """Print a progress line every N steps (metrics.jsonl gets every step)."""
    tensorboard: bool = True
    """Also write every step's metrics to run_dir/tensorboard (when the tensorboard package is installed)."""
    tracker: str = "none"
    """Experiment tracker that also gets every step's metrics and the summary: none | wandb | mlflow
    (the package must be installed: `pip install -e .[tracking]`; the learner refuses to start otherwise)."""
    tracker_project: str = "tether"
    """W&B project / MLflow experiment name the run is logged under."""
    tracker_online: bool = False
    """False: offline (W&B mode=offline in run_dir/wandb, MLflow SQLite store run_dir/mlflow.db);
    True: W&B syncs to its server, MLflow uses MLFLOW_TRACKING_URI."""
    seed: int = 0
    """Seed for the prompt order and the learner's torch RNG."""
    backend: str = "single"
    """Training backend: single (one process) | fsdp2 (torch FSDP2 over torchrun ranks) | megatron (reserved)."""


@dataclass
class ActorsConfig:
    num_local: int = 2
    """Actor processes the learner spawns on this node (0 = start actors yourself)."""
    engine: str = "hf"
    """Rollout engine: hf (transformers, CPU fallback) | vllm | sglang | simulated (no model; load tests, benchmarks)."""
    update_mode: str = "keep"
    """vllm, sglang: how new weights reach running requests: wait (finish them first) | keep (pause,
    swap, recompute KV, resume: tokens carry the version that sampled them) | abort (stop them,
    resubmit prompt + generated prefix). The hf engine always waits for its running batch."""
    vllm_kv_cache_gb: float = 1.0
    """vllm: KV cache size in GiB (CPU or GPU memory)."""
    vllm_enforce_eager: bool = True
    """vllm: skip torch.compile and CUDA graphs (starts in ~20 s instead of ~60 s on CPU)."""
    vllm_max_num_seqs: int = 256
    """vllm: most sequences the scheduler runs at once."""
    sglang_max_total_tokens: int = 0
    """sglang: KV cache size in tokens (0 = SGLang sizes it from sglang_mem_fraction_static)."""
    sglang_mem_fraction_static: float = 0.0
    """sglang: fraction of (GPU or CPU) memory for weights + KV cache (0 = SGLang's default)."""
    groups_per_request: int = 2
    """Leases an actor asks for at once; their samples are generated as one batch."""
    agent: str = "single_turn"
    """Agent per sample: single_turn | tools (multi-turn tool calls) | openai (your code via the endpoint)."""
    tools: str = "calc"
    """Comma-separated tools of the `tools` agent: calc (integer sums) | python (limited subprocess)."""
    max_turns: int = 4
    """Multi-turn agents: most model turns (generations) per sample."""
    max_total_tokens: int = 48
    """Multi-turn agents: most completion tokens (model + tool) per sample; the learner refuses more."""
    tool_timeout_s: float = 5.0
    """Wall-clock limit of one tool call (python: also its CPU limit); a timeout is an error message."""
    tool_memory_mb: int = 512
    """Address-space limit (RLIMIT_AS) of the python tool's subprocess."""
    openai_port: int = 0
    """openai agent: port of the actor's chat-completions endpoint on 127.0.0.1 (0 = any free port)."""
    openai_agent: str = ""
    """openai agent: your module:function, called as fn(base_url, messages) (sync or async) per sample."""
    sim_latency_mean_s: float = 0.0
    """simulated engine: mean seconds per request (lognormal; a batch waits for its slowest)."""
    sim_latency_sigma: float = 0.0
    """simulated engine: lognormal sigma of the request latency (0 = constant)."""


@dataclass
class BufferConfig:
    capacity_groups: int = 64
    """Most complete groups the buffer holds; when full the learner stops reading trajectories."""
    max_reuse: int = 1
    """Batches a group may be served in (1 = use once); reuse is still bound by max_staleness."""
    sampling: str = "fifo"
    """Which fresh groups a batch gets: fifo (oldest first) | newest | uniform (seeded)."""


@dataclass
class TransportConfig:
    host: str = "127.0.0.1"
    """Interface the learner binds to (0.0.0.0 to accept actors on other nodes)."""
    advertise_host: str = ""
    """Host name actors should dial, written to endpoints.json (default: host)."""
    control_port: int = 0
    """Control ROUTER port (0 = pick a free port)."""
    trajectory_port: int = 0
    """Trajectory PULL port (0 = pick a free port)."""
    weights_port: int = 0
    """Weights ROUTER port (0 = pick a free port)."""
    heartbeat_s: float = 1.0
    """Seconds between actor heartbeats."""
    peer_timeout_s: float = 10.0
    """A peer silent this long is dead: its leases expire (learner) or it reconnects (actor)."""
    max_message_bytes: int = 64 * 1024 * 1024
    """ZMQ_MAXMSGSIZE on every learner receive socket; larger frames drop the connection."""
    high_water_mark: int = 64
    """ZMQ send/receive high-water mark (messages) on every socket."""
    weight_bucket_bytes: int = 32 * 1024 * 1024
    """Weights are sent to actors in buckets of about this many bytes."""
    weights_via: str = "zmq"
    """How actors get weights: zmq (buckets over the weights socket) | filesystem (safetensors
    files in weights_dir, which every actor must see at the same path; the socket carries only
    the version notice)."""
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


@dataclass
class TetherConfig:
    run_dir: str = "runs/toy_reverse"
    """Directory for endpoints.json, metrics.jsonl, checkpoints, summary.json and the final model."""
    max_staleness: int = 1
    """eta: a sample is trained on at step s only if s - (oldest token version) <= eta; 0 = synchronous PPO."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The RL task: prompts, rewards, sampling."""
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    """The trainer."""
    actors: ActorsConfig = field(default_factory=ActorsConfig)
    """The rollout actors."""
    buffer: BufferConfig = field(default_factory=BufferConfig)
    """The replay buffer between trajectory receiver and trainer."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """ZeroMQ sockets, heartbeats and limits."""


CHOICES: dict[str, tuple[str, ...]] = {
    "task.name": ("reverse", "calculator", "gsm8k"),
    "learner.correction": ("none", "tis", "decoupled", "mask"),
    "learner.is_level": ("token", "sequence"),
    "learner.loss_agg": ("token_mean", "seq_mean_token_mean", "constant"),
    "learner.advantage": ("grpo", "drgrpo", "rloo"),
    "learner.backend": ("single", "fsdp2", "megatron"),
    "learner.tracker": ("none", "wandb", "mlflow"),
    "actors.engine": ("hf", "vllm", "sglang", "simulated"),
    "actors.update_mode": ("wait", "keep", "abort"),
    "transport.weights_via": ("zmq", "filesystem"),
    "buffer.sampling": ("fifo", "newest", "uniform"),
    "actors.agent": ("single_turn", "tools", "openai"),
}
"""Allowed values of the string fields that name a choice."""

TOOLS = ("calc", "python")
"""Tools the `tools` agent can offer (actors/tools.py)."""


def max_completion_tokens(cfg: TetherConfig) -> int:
    """Most completion tokens one sample may have: one turn for single-turn agents, the
    multi-turn budget (model + tool tokens) otherwise. The learner refuses longer samples."""
    if cfg.actors.agent == "single_turn":
        return cfg.task.max_new_tokens
    return cfg.actors.max_total_tokens


def check_ranges(cfg: TetherConfig) -> list[str]:
    """Return one message per out-of-range field (empty when the config is valid)."""
    errors: list[str] = []

    def need(ok: bool, key: str, rule: str, value: object) -> None:
        if not ok:
            errors.append(f"{key} must be {rule}, got {value!r}")

    need(cfg.max_staleness >= 0, "max_staleness", ">= 0", cfg.max_staleness)
    L, A, T = cfg.learner, cfg.actors, cfg.transport
    need(L.max_steps >= 1, "learner.max_steps", ">= 1", L.max_steps)
    need(L.prompts_per_step >= 1, "learner.prompts_per_step", ">= 1", L.prompts_per_step)
    need(L.group_size >= 2, "learner.group_size", ">= 2 (group-relative advantages)", L.group_size)
    need(L.lr > 0, "learner.lr", "> 0", L.lr)
    need(0 <= L.clip_low < 1, "learner.clip_low", "in [0, 1)", L.clip_low)
    need(L.clip_high >= 0, "learner.clip_high", ">= 0", L.clip_high)
    need(L.dual_clip == 0 or L.dual_clip > 1, "learner.dual_clip", "0 (off) or > 1", L.dual_clip)
    need(L.is_cap > 0, "learner.is_cap", "> 0", L.is_cap)
    need(0 < L.mask_low < 1 < L.mask_high, "learner.mask_low/mask_high", "0 < low < 1 < high",
         (L.mask_low, L.mask_high))
    need(0 < L.staleness_decay <= 1, "learner.staleness_decay", "in (0, 1]", L.staleness_decay)
    need(L.minibatches >= 1 and L.prompts_per_step % L.minibatches == 0, "learner.minibatches",
         f">= 1 and divide learner.prompts_per_step={L.prompts_per_step}", L.minibatches)
    need(L.epochs >= 1, "learner.epochs", ">= 1", L.epochs)
    need(L.backend != "megatron", "learner.backend", "single or fsdp2 (megatron is reserved and "
         "not implemented yet)", L.backend)
    need(L.checkpoint_every >= 0, "learner.checkpoint_every", ">= 0", L.checkpoint_every)
    need(L.log_every >= 1, "learner.log_every", ">= 1", L.log_every)
    need(A.num_local >= 0, "actors.num_local", ">= 0", A.num_local)
    need(A.sim_latency_mean_s >= 0, "actors.sim_latency_mean_s", ">= 0", A.sim_latency_mean_s)
    need(A.sim_latency_sigma >= 0, "actors.sim_latency_sigma", ">= 0", A.sim_latency_sigma)
    need(A.vllm_kv_cache_gb > 0, "actors.vllm_kv_cache_gb", "> 0", A.vllm_kv_cache_gb)
    need(A.vllm_max_num_seqs >= 1, "actors.vllm_max_num_seqs", ">= 1", A.vllm_max_num_seqs)
    need(A.sglang_max_total_tokens >= 0, "actors.sglang_max_total_tokens", ">= 0 (0 = SGLang's default)",
         A.sglang_max_total_tokens)
    need(0 <= A.sglang_mem_fraction_static < 1, "actors.sglang_mem_fraction_static",
         "in [0, 1) (0 = SGLang's default)", A.sglang_mem_fraction_static)
    need(A.max_turns >= 1, "actors.max_turns", ">= 1", A.max_turns)
    need(A.max_total_tokens >= cfg.task.max_new_tokens, "actors.max_total_tokens",
         f">= task.max_new_tokens={cfg.task.max_new_tokens}", A.max_total_tokens)
    need(A.tool_timeout_s > 0, "actors.tool_timeout_s", "> 0", A.tool_timeout_s)
    need(A.tool_memory_mb >= 64, "actors.tool_memory_mb", ">= 64", A.tool_memory_mb)
    unknown_tools = [t for t in A.tools.split(",") if t.strip() not in TOOLS]
    need(not unknown_tools, "actors.tools", f"a comma-separated subset of {TOOLS}", A.tools)
    need(0 <= A.openai_port < 65536, "actors.openai_port", "in [0, 65535]", A.openai_port)
    need(A.agent != "openai" or ":" in A.openai_agent, "actors.openai_agent",
         "module:function when actors.agent is openai", A.openai_agent)
    need(A.groups_per_request >= 1, "actors.groups_per_request", ">= 1", A.groups_per_request)
    need(cfg.buffer.capacity_groups >= L.prompts_per_step, "buffer.capacity_groups",
         f">= learner.prompts_per_step={L.prompts_per_step}", cfg.buffer.capacity_groups)
    need(cfg.buffer.max_reuse >= 1, "buffer.max_reuse", ">= 1", cfg.buffer.max_reuse)
    need(cfg.task.num_digits >= 1, "task.num_digits", ">= 1", cfg.task.num_digits)
    need(cfg.task.name != "gsm8k" or bool(cfg.task.data_path), "task.data_path",
         "set (a JSONL file) when task.name is gsm8k", cfg.task.data_path)
    need(cfg.task.eval_prompts >= 1, "task.eval_prompts", ">= 1", cfg.task.eval_prompts)
    need(cfg.task.max_new_tokens >= 1, "task.max_new_tokens", ">= 1", cfg.task.max_new_tokens)
    need(cfg.task.temperature > 0, "task.temperature", "> 0", cfg.task.temperature)
    need(cfg.model.warmstart_steps >= 0, "model.warmstart_steps", ">= 0", cfg.model.warmstart_steps)
    for key in ("control_port", "trajectory_port", "weights_port"):
        port = getattr(T, key)
        need(0 <= port < 65536, f"transport.{key}", "in [0, 65535]", port)
    need(T.heartbeat_s > 0, "transport.heartbeat_s", "> 0", T.heartbeat_s)
    need(T.peer_timeout_s > 2 * T.heartbeat_s, "transport.peer_timeout_s",
         f"> 2 * transport.heartbeat_s={T.heartbeat_s}", T.peer_timeout_s)
    need(T.max_message_bytes >= 1024, "transport.max_message_bytes", ">= 1024", T.max_message_bytes)
    need(T.high_water_mark >= 1, "transport.high_water_mark", ">= 1", T.high_water_mark)
    need(T.weight_bucket_bytes >= 1024, "transport.weight_bucket_bytes", ">= 1024",
         T.weight_bucket_bytes)
    need(bool(T.curve_server_secret) == bool(T.curve_allowed_dir), "transport.curve_allowed_dir",
         "set together with transport.curve_server_secret", T.curve_allowed_dir)
    need(bool(T.curve_client_secret) == bool(T.curve_server_public), "transport.curve_server_public",
         "set together with transport.curve_client_secret", T.curve_server_public)
    for key in ("curve_server_secret", "curve_allowed_dir", "curve_client_secret", "curve_server_public"):
        path = getattr(T, key)
        need(not path or Path(path).exists(), f"transport.{key}", "an existing path", path)
    need(T.weight_bucket_bytes < T.max_message_bytes, "transport.weight_bucket_bytes",
         f"< transport.max_message_bytes={T.max_message_bytes}", T.weight_bucket_bytes)
    return errors
