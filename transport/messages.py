"""Every message that crosses a Tether socket.

MessagePack via msgspec Structs: typed, validated on decode, never pickle. One tagged union per
channel and direction, one decoder per socket (`Decoders` below). Schema evolution: new fields
get defaults and go at the end; `PROTOCOL_VERSION` is checked in the `Hello` handshake.

Channels (learner binds, actors connect):

    control     actor DEALER  <->  learner ROUTER   Hello, WorkRequest, Heartbeat, Goodbye,
                                                     SampleDone (runs with model scorers)
                                                     -> Welcome, Reject, LeaseGrant, HeartbeatAck,
                                                        VersionAnnounce, Shutdown
    trajectory  actor PUSH     ->  learner PULL     GroupResult
    weights     actor DEALER  <->  learner ROUTER   WeightRequest -> WeightOffer (manifests with
                                                       a digest per bucket, the relays)
                                                     BucketRequest -> [WeightBucket header, bytes]
                relay DEALER  <->  learner ROUTER   RelayHello -> RelayWelcome (its upstream);
                                                     BucketRequest -> [WeightBucket header, bytes]
                actor DEALER  <->  relay ROUTER     BucketRequest -> [WeightBucket header, bytes]
    control     scorer DEALER <->  learner ROUTER   ScorerHello, ScorerHeartbeat, ScoreDone
                                                     -> ScorerWelcome, Reject, ScoreBatch,
                                                        HeartbeatAck, Shutdown
    ranks       rank r PUSH    ->  rank 0 PULL      ShardReady (learner ranks: each serves its
                rank 0 DEALER <->  rank r ROUTER    own buckets) BucketRequest -> [WeightBucket,
                                                     bytes]; ShardDrop; ShardStop

Weight manifests (and their digests) come only from the learner; relays carry bucket bytes, which
every actor (and every relay fed by another relay) checks against the learner's digest
(transport/weightsrc/).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec
import numpy as np

PROTOCOL_VERSION = 10
"""2: VersionAnnounce (new versions no longer ride on HeartbeatAck); Heartbeat without
leases_held. 3: LoRA (WeightManifest.kind and .lora, WeightRequest.need_base). 4: GroupResult is
columnar (one Array per token column for the whole group; Sample.num_tokens). 5: Hello.leases_held
and Welcome.leases_kept (which leases survive a learner restart). 6: the scorer fleet (ScorerHello,
ScorerWelcome, ScorerHeartbeat, ScoreBatch, ScoreDone on the control socket). 7: Welcome.run_settings
(the learner's task, agent, reward and sampling settings, which the actor runs). 8: SampleDone
(actors stream each finished sample to the scorer fleet). 9: weights are offered (WeightOffer:
manifests with a BLAKE2b digest per bucket, deltas, relays, NCCL) and pulled bucket by bucket
(BucketRequest), from the learner or a relay (RelayHello / RelayWelcome);
Heartbeat.corrupt_buckets. 10: the buckets' digests are SHA-256; NcclPlan.backend."""

ALLOWED_DTYPES = ("int32", "int64", "uint8", "float32", "float16", "bfloat16")
"""Dtype names an `Array` may carry (bfloat16 only inside weight buckets: numpy has none)."""

NUMPY_DTYPES = {name: np.dtype(name) for name in ALLOWED_DTYPES if name != "bfloat16"}
"""The allowed dtypes numpy can hold, by name: the one table Array decoding and validation use."""


class Array(msgspec.Struct, frozen=True, gc=False):
    """A dense array as raw little-endian bytes + dtype + shape (never a list of numbers).

    Decoding does not copy the bytes: `data` is a read-only memoryview into the received
    message, which it keeps alive (`bytes` where the array was built here, `from_numpy`)."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    @classmethod
    def from_numpy(cls, a: np.ndarray) -> "Array":
        a = np.ascontiguousarray(a)
        return cls(dtype=str(a.dtype), shape=tuple(a.shape), data=a.tobytes())

    def to_numpy(self) -> np.ndarray:
        """Decode and check that dtype and shape agree with the byte count."""
        dt = NUMPY_DTYPES.get(self.dtype)
        if dt is None:
            raise ValueError(f"array dtype {self.dtype!r} is not one of {tuple(NUMPY_DTYPES)}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"array shape {self.shape} has a negative dimension")
        expected = math.prod(self.shape) * dt.itemsize
        if expected != len(self.data):
            raise ValueError(f"array of dtype {self.dtype} and shape {self.shape} needs "
                             f"{expected} bytes, got {len(self.data)}")
        return np.frombuffer(self.data, dtype=dt).reshape(self.shape)


# ---------------------------------------------------------------- control: actor -> learner

class Hello(msgspec.Struct, tag="hello"):
    """Actor -> learner, first message on the control socket (and again after a reconnect).

    `incarnation` is random per actor process: a Hello with a known actor_id but a new
    incarnation is a restarted actor, whose predecessor's leases expire at once."""

    protocol_version: int
    actor_id: str
    engine: str
    incarnation: str = ""
    dtype: str = ""
    """The engine's compute dtype (`model.dtype`); the learner refuses one unlike its own
    ("" = not said, not checked)."""
    leases_held: list[int] = []
    """The leases this actor holds (granted, result not sent yet). The learner keeps exactly
    these of the actor's outstanding leases and expires the rest (their prompts are granted
    again): after a learner restart, those were delivered to the run that died, or lost."""


class WorkRequest(msgspec.Struct, tag="work"):
    """Actor -> learner: ask for up to `max_groups` leases. The learner answers with a
    `LeaseGrant` as soon as the staleness capacity allows (the request is parked until then)."""

    actor_id: str
    max_groups: int


ACTOR_STATES = ("wait_grant", "wait_weights", "generate", "send")
"""The states of an actor's work loop, one at a time (learner/obs/timeline.py)."""
SPAN_STATES = ACTOR_STATES + ("pull_weights",)
"""What a Span may name: a work-loop state, or a weight pull (which runs beside them)."""
MAX_SPANS = 4096
"""Most spans one Heartbeat may carry."""


class Span(msgspec.Struct, array_like=True):
    """A stretch of an actor's wall time in one state (one of SPAN_STATES)."""

    state: str
    start_us: int
    """Start, microseconds since the Unix epoch (the actor host's clock)."""
    dur_us: int


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """Actor -> learner every `transport.heartbeat_s`, also while generating."""

    actor_id: str
    weight_version: int
    spans: list[Span] = []
    """The actor's time spans since its previous heartbeat (learner/obs/timeline.py)."""
    corrupt_buckets: int = 0
    """Weight buckets this actor refused so far because their digest differed from the
    learner's manifest (each was fetched again from another source)."""


class Goodbye(msgspec.Struct, tag="goodbye"):
    """Actor -> learner on clean shutdown: its leases are released for re-granting."""

    actor_id: str


class SampleDone(msgspec.Struct, tag="sample_done"):
    """Actor -> learner, in runs with model scorers (task.scorers): one sample's completion,
    sent as soon as its rollout ends, so that the scorer fleet scores it while the group's other
    samples are still generated (learner/scoring.py). Its GroupResult still carries every
    sample; the learner checks that it carries these same ids. One that arrives after its
    GroupResult is ignored (the group's copy is scored)."""

    actor_id: str
    lease_id: int
    sample_index: int
    completion_ids: Array


ActorToLearner = Hello | WorkRequest | Heartbeat | Goodbye | SampleDone


# ---------------------------------------------------------------- control: learner -> actor

class Welcome(msgspec.Struct, tag="welcome"):
    """Learner -> actor, the answer to a valid Hello.

    `model_files` carries the small files an actor needs to build the model skeleton
    (config.json, tokenizer files); the weights follow on the weights channel."""

    protocol_version: int
    actor_id: str
    trajectory_endpoint: str
    weights_endpoint: str
    latest_version: int
    heartbeat_s: float
    peer_timeout_s: float
    model_files: dict[str, bytes]
    run_id: str
    leases_kept: list[int] = []
    """This actor's leases that this learner run kept (of its Hello's `leases_held`). An actor
    that joins a new run drops every other lease of an earlier run: that run died, and this one
    grants their prompts again (it resumed from a checkpoint taken before they were granted, or
    from none)."""
    run_settings: dict[str, dict[str, Any]] = {}
    """The run's task, agent, reward and sampling settings as config sections
    ({"task": {...}, "actors": {...}}, configs/run_settings.py): the actor runs these, not its own."""


class Reject(msgspec.Struct, tag="reject"):
    """Learner -> actor: the last message was refused (wrong protocol, unknown actor...)."""

    reason: str


class Lease(msgspec.Struct):
    """One GRPO group of work: `num_samples` rollouts of one prompt.

    The actor must generate with weights of version >= `min_version`. Sample i is seeded from
    (seed, prompt_id, i, weight version used), so results never depend on which actor ran it."""

    lease_id: int
    prompt_id: int
    prompt_ids: Array
    num_samples: int
    min_version: int
    seed: int
    max_new_tokens: int
    temperature: float
    meta: dict[str, str]


class LeaseGrant(msgspec.Struct, tag="grant"):
    """Learner -> actor: the answer to a WorkRequest."""

    leases: list[Lease]
    latest_version: int


class HeartbeatAck(msgspec.Struct, tag="heartbeat_ack"):
    """Learner -> actor, the answer to a Heartbeat (proof the learner is alive); carries the
    newest published version too, for an actor that missed an announcement."""

    latest_version: int


class VersionAnnounce(msgspec.Struct, tag="announce"):
    """Learner -> every joined actor, once per published version: weights of `version` can be
    pulled on the weights channel now."""

    version: int


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Learner -> actor: the run is over; finish nothing, exit cleanly."""

    reason: str


LearnerToActor = Welcome | Reject | LeaseGrant | HeartbeatAck | VersionAnnounce | Shutdown


# ---------------------------------------------------------------- trajectory: actor -> learner

FINISH_REASONS = ("answer", "max_turns", "max_tokens", "error")
"""How a rollout ended (`Sample.finish`; actors.rollout.Finish): the model answered, used all its
turns, ran out of tokens, or the agent raised (then `error` is set)."""


class Sample(msgspec.Struct, gc=False):
    """One rollout's scalars. Its tokens are `num_tokens` consecutive entries of every column of
    its GroupResult, right after those of the samples listed before it. `finish` is one of
    FINISH_REASONS ("error" exactly when `error` is set), or "" from agents that do not say."""

    sample_index: int
    reward: float
    num_tokens: int = 0
    """Set by `pack_group`."""
    error: str = ""
    finish: str = ""
    scores: dict[str, float] = msgspec.field(default_factory=dict)
    """Named scores of the reward (e.g. correct, tokens, reward_timeout), logged by the learner."""
    tool_parse_errors: int = 0
    """Model turns whose tool calls did not parse (actors/agents/tool_parsers.py)."""


class GroupResult(msgspec.Struct, tag="group", gc=False):
    """Actor -> learner: the finished rollouts of one lease, columnar.

    Each of TOKEN_COLUMNS is one 1-D Array of all samples' tokens, sample after sample in the
    order of `samples` (a sample's share is its `num_tokens`). Columnar so that the learner
    checks each column of a group in one pass over the received bytes and keeps views of them,
    copying nothing (learner/validate.py). Build it with `pack_group`."""

    lease_id: int
    actor_id: str
    prompt_id: int
    samples: list[Sample]
    completion_ids: Array
    logprobs: Array
    versions: Array
    loss_mask: Array
    """The per-token columns, aligned token for token: the sampled ids, the behavior logprob
    under the sampling distribution, the policy version that sampled the token, and 1 for model
    tokens (0 for tool/environment tokens)."""


TOKEN_COLUMNS = tuple(f.name for f in msgspec.structs.fields(GroupResult) if f.type is Array)
"""GroupResult's per-token columns (its Array fields): a new one is a new field there."""


def pack_group(*, lease_id: int, actor_id: str, prompt_id: int, samples: list[Sample],
               tokens: list[dict[str, np.ndarray] | None]) -> GroupResult:
    """A GroupResult from each sample's scalars and its token arrays: `tokens[i]` maps each of
    TOKEN_COLUMNS to samples[i]'s 1-D array (None: no tokens, e.g. an agent error). Sets every
    sample's `num_tokens` and concatenates the columns (numpy's dtype promotion across samples:
    one dtype per column)."""
    if len(tokens) != len(samples):
        raise ValueError(f"{len(samples)} samples but {len(tokens)} token entries")
    for s, t in zip(samples, tokens):
        s.num_tokens = 0 if t is None else len(t["completion_ids"])
    present = [t for t in tokens if t is not None]
    columns = {name: Array.from_numpy(np.concatenate([t[name] for t in present]) if present
                                      else np.zeros(0, np.int32))
               for name in TOKEN_COLUMNS}
    return GroupResult(lease_id=lease_id, actor_id=actor_id, prompt_id=prompt_id, samples=samples,
                       **columns)


# ---------------------------------------------------------------- weights

class WeightRequest(msgspec.Struct, tag="weight_request"):
    """Actor -> learner: offer me the newest weights (if newer than `have_version`, the version
    whose decoded buckets the actor holds: deltas from it may be offered)."""

    actor_id: str
    have_version: int
    need_base: bool = False
    """LoRA runs: the actor has no base weights of this run yet; the base (kind "base") is sent
    before the version. Ignored when the run trains full weights."""
    request_id: int = 0
    """The actor's count of its requests; the WeightOffer repeats it, so a reply to
    an earlier request (ZeroMQ delivers requests queued while the learner was away to the next
    learner run, which answers each) is told apart and skipped."""
    held_version: int = -1
    """The version whose decoded buckets the actor keeps (deltas may be offered from it;
    -1 = none kept: the full version is offered)."""


class TensorMeta(msgspec.Struct):
    """Where one tensor lives inside the buckets of a weight version."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int


class LoraSpec(msgspec.Struct, frozen=True):
    """Inside a WeightManifest (learner -> actor): the shape of a LoRA adapter (learner.lora).
    Each `targets` layer W of every decoder layer becomes W + (alpha / rank) * B @ A, with A
    (rank, in) and B (out, rank)."""

    rank: int
    """r: rows of A, columns of B."""
    alpha: float
    """B @ A is scaled by alpha / rank."""
    targets: list[str]
    """Module names (q_proj, ...) adapted in every decoder layer."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


WEIGHT_KINDS = ("full", "base", "adapter")
"""What a WeightManifest carries: the whole policy | the frozen base of a LoRA run (sent once
per actor, before its first adapter) | a version's adapter tensors (models/lora.py names)."""


WEIGHT_CODECS = ("raw", "xor-zstd", "nccl")
"""How a manifest's buckets are encoded: the tensors' bytes as they are | zstd of the XOR of
those bytes with the same bucket of version `base_version` (transport/weightsrc/delta.py) |
no buckets: the tensors (names, dtypes, shapes in `tensors`) arrive by an NCCL broadcast."""


class WeightManifest(msgspec.Struct, tag="manifest"):
    """Inside a WeightOffer (learner -> actor): version `version` as `num_buckets` buckets,
    fetched one by one with BucketRequest(key, index) from the learner or a relay.

    With shared-filesystem weights (`transport.weights_via: filesystem`) `path` names the
    safetensors file of this version and there are no buckets. A LoRA run offers an actor
    whose request said `need_base` a "base" manifest before the version's "adapter" one."""

    version: int
    tensors: list[TensorMeta]
    num_buckets: int
    total_bytes: int
    """Bytes of all buckets as they travel (encoded)."""
    path: str = ""
    kind: Literal["full", "base", "adapter"] = "full"
    """One of WEIGHT_KINDS."""
    lora: LoraSpec | None = None
    """The adapter's rank, alpha and targets (set exactly when `kind` is "adapter")."""
    request_id: int = 0
    """Unused since protocol 6 (the WeightOffer carries the request id)."""
    key: str = ""
    """Names this version's buckets in BucketRequests: "f12" (version 12, raw), "d12" (the
    delta from 11 to 12), "a12" (LoRA adapter), "b" (LoRA base)."""
    codec: Literal["raw", "xor-zstd", "nccl"] = "raw"
    """One of WEIGHT_CODECS."""
    base_version: int = -1
    """xor-zstd: the version the delta applies to (always version - 1)."""
    digests: list[bytes] = []
    """SHA-256 of each bucket as it travels (checked before anything is decoded)."""
    raw_digests: list[bytes] = []
    """SHA-256 of each bucket's decoded bytes, the tensors' layout (= digests for raw)."""
    raw_sizes: list[int] = []
    """Each bucket's decoded size in bytes (what the tensors' offsets index)."""


class RelayInfo(msgspec.Struct, frozen=True):
    """A relay that serves weight buckets (learner -> actor in WeightOffer, -> relay)."""

    relay_id: str
    endpoint: str
    host: str
    """The relay's node (actors on the same host prefer it)."""


class NcclPlan(msgspec.Struct, frozen=True):
    """Inside a WeightOffer (transport.weights_via=nccl): the broadcast group to join (once)
    and this actor's engine's rank in it (the learner is rank 0)."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int
    backend: str = "nccl"
    """The collective's backend: nccl, or gloo where the learner runs on CPU (SGLang only)."""


class WeightOffer(msgspec.Struct, tag="offer"):
    """Learner -> actor, the answer to a WeightRequest: what to fetch, in order. Empty
    `manifests`: the actor has version `latest_version` already. Several manifests: the base
    then an adapter (LoRA), or a chain of deltas from the actor's version (each applies to the
    previous one)."""

    request_id: int
    """The WeightRequest's id, repeated (replies to earlier requests are skipped)."""
    latest_version: int
    manifests: list[WeightManifest]
    relays: list[RelayInfo] = []
    """Relays that serve these buckets, nearest the learner first (transport.weights_via=relay)."""
    deltas: bool = False
    """The learner sends deltas (transport.weight_full_every > 0): keep the decoded buckets."""
    nccl: NcclPlan | None = None
    """transport.weights_via=nccl: the version's manifest (codec "nccl") arrives by broadcast."""


class BucketRequest(msgspec.Struct, tag="bucket_request"):
    """Actor or relay -> learner or relay: send bucket `index` of `key` (a manifest's key).
    `digest` is the learner's digest of it: a relay that must fetch it checks it on arrival."""

    peer_id: str
    key: str
    index: int
    digest: bytes
    request_id: int


class WeightBucket(msgspec.Struct, tag="bucket"):
    """Learner or relay -> requester: header frame; the bucket's bytes follow as the next
    frame. `found` false (no bytes follow): the sender does not hold it (an evicted version,
    or a relay whose upstreams failed)."""

    version: int
    index: int
    nbytes: int
    key: str = ""
    request_id: int = 0
    """The BucketRequest's id, repeated."""
    found: bool = True


class RelayHello(msgspec.Struct, tag="relay_hello"):
    """Relay -> learner every heartbeat_s: I serve buckets at `endpoint` (also a liveness beat:
    a relay silent for peer_timeout_s leaves the tree)."""

    relay_id: str
    endpoint: str
    host: str
    protocol_version: int = PROTOCOL_VERSION
    request_id: int = 0


class RelayWelcome(msgspec.Struct, tag="relay_welcome"):
    """Learner -> relay, the answer to RelayHello: fetch buckets from `upstream` (another
    relay's endpoint; "" = the learner itself), falling back to the learner."""

    upstream: str
    latest_version: int
    request_id: int = 0
    """The RelayHello's id, repeated."""
    fallback: str = ""
    """The upstream's own upstream ("" = the learner): asked when the upstream fails, so one
    dead relay does not send everything below it to the learner."""


class ShardReady(msgspec.Struct, tag="shard_ready"):
    """Learner rank r -> rank 0: rank r packed its buckets of `version` (which are whose:
    transport/weights.py Layout). Digests per bucket index, b"" for the other ranks' buckets;
    the delta's likewise, with sizes (0 for the others'), when deltas are on."""

    rank: int
    version: int
    digests: list[bytes]
    delta_digests: list[bytes] | None = None
    delta_sizes: list[int] | None = None


class ShardDrop(msgspec.Struct, tag="shard_drop"):
    """Rank 0 -> rank r: these keys (f12, d12) are offered no more; free their buckets."""

    keys: list[str]


class ShardStop(msgspec.Struct, tag="shard_stop"):
    """Rank 0 -> rank r: the run is over, nobody asks for buckets any more."""


ToRank = BucketRequest | ShardDrop | ShardStop
"""What a learner rank's bucket server receives from rank 0."""

WeightsFromPeer = WeightRequest | BucketRequest | RelayHello
"""What the learner's weights ROUTER receives (a relay's ROUTER: BucketRequest only)."""
WeightsToPeer = WeightOffer | WeightBucket | RelayWelcome | Reject


# ---------------------------------------------------------------- control: scorer <-> learner

class ScorerHello(msgspec.Struct, tag="scorer_hello"):
    """Scorer -> learner, first message on the control socket (and again after a reconnect).
    A known scorer_id with a new `incarnation` is a restarted scorer: the batches its
    predecessor held go to other scorers at once."""

    protocol_version: int
    scorer_id: str
    incarnation: str
    scorers: list[str]
    """The names of the model scorers it runs (must be exactly the config's model scorers)."""


class ScorerHeartbeat(msgspec.Struct, tag="scorer_heartbeat"):
    """Scorer -> learner every `transport.heartbeat_s`, also while it scores."""

    scorer_id: str
    scored: int = 0
    """Samples it scored since its previous heartbeat."""
    busy_us: int = 0
    """Microseconds it spent scoring since its previous heartbeat (learner/timeline.py)."""


class ItemScores(msgspec.Struct, array_like=True):
    """Inside ScoreDone: the scores of one item, by model scorer name (NaN = unreadable)."""

    item_id: int
    scores: dict[str, float]


class ScoreDone(msgspec.Struct, tag="score_done"):
    """Scorer -> learner: the answer to one ScoreBatch, every item's scores in one message, or
    `error` (the batch failed; the learner gives it to another scorer)."""

    scorer_id: str
    batch_id: int
    results: list[ItemScores]
    error: str = ""


ScorerToLearner = ScorerHello | ScorerHeartbeat | ScoreDone
ControlToLearner = ActorToLearner | ScorerToLearner
"""What the learner's control ROUTER receives, from actors and scorers."""


class ScorerWelcome(msgspec.Struct, tag="scorer_welcome"):
    """Learner -> scorer, the answer to a valid ScorerHello: the policy's tokenizer files (to
    decode what it scores) and the liveness settings."""

    protocol_version: int
    scorer_id: str
    heartbeat_s: float
    peer_timeout_s: float
    model_files: dict[str, bytes]
    run_id: str


class ScoreItem(msgspec.Struct, array_like=True):
    """Inside ScoreBatch: one finished sample to score."""

    item_id: int
    prompt_ids: Array
    completion_ids: Array
    meta: dict[str, str]


class ScoreBatch(msgspec.Struct, tag="score_batch"):
    """Learner -> scorer: score these samples (of any actors) with every model scorer; answer
    with one ScoreDone. A batch not answered within `scoring.batch_timeout_s` is given to
    another scorer and this one's late answer is ignored."""

    batch_id: int
    items: list[ScoreItem]


LearnerToScorer = ScorerWelcome | Reject | ScoreBatch | HeartbeatAck | Shutdown


class Decoders:
    """One decoder per socket role, built once (msgspec decoders are reusable)."""

    def __init__(self) -> None:
        self.from_actor = msgspec.msgpack.Decoder(ControlToLearner)
        self.to_scorer = msgspec.msgpack.Decoder(LearnerToScorer)
        self.to_actor = msgspec.msgpack.Decoder(LearnerToActor)
        self.trajectory = msgspec.msgpack.Decoder(GroupResult)
        self.weight_request = msgspec.msgpack.Decoder(WeightsFromPeer)
        self.weights = msgspec.msgpack.Decoder(WeightsToPeer)


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()

