"""The weight-source room: how a policy version travels from the learner into every engine.

How a new policy version gets from the learner's ranks into every engine: published in the
engine's dtype, pulled bucket by bucket with a digest each, optionally as a lossless delta,
through a tree of relays so that the learner's egress does not grow with the number of actors.
Code: `learner/publisher.py` (packing) and this package (everything on the wire).

Publishing

`Leader.gather_weights` gathers the full weights one tensor at a time (an all-gather per tensor
under FSDP2: no rank holds the whole model at once), each rank's shard cast to the engine dtype
before the gather (`model.dtype`: bf16 halves what fp32 master weights would cost, on the wire
between ranks too) and queues it for the learner's **packer thread**. The packer copies each tensor straight into its bucket (16-byte
aligned, so engines rebuild tensors as views without copying), computes a SHA-256 digest per
bucket, and, with `transport.weight_full_every` = K > 0, the delta against the previous version;
then it announces the version. The queue holds two buckets' worth of tensors: the trainer blocks
only while the packer is that far behind (backpressure), so digests and deltas run beside the
next step. LoRA adapters and the frozen base stay fp32 (engines merge them).

Pulling

```
actor ── WeightRequest(have, held) ─▶ learner: WeightOffer(manifests + digests, relays)
actor ── BucketRequest(key, i, digest) ─▶ its relay ─▶ (miss) upstream relay ─▶ ... ─▶ learner
         at most WINDOW (4) in flight; timeout / not found / bad digest: next source
```

Manifests, and the digests in them, come only from the learner. Relays carry bytes; every
receiver (actor or relay) checks a bucket's digest before using it, refuses one that differs,
counts it (`corrupt_buckets`) and asks the next source. A relay therefore cannot make an actor
load anything the learner did not publish, and a bad upstream cannot poison a relay's cache.
Asking one bucket at a time (instead of the whole version in one reply) bounds what is queued
for any peer by its window, so a slow actor no longer has the learner stream a reply it has
already given up on.

Deltas (`transport.weight_full_every` = K)

Version v+1 has exactly the layout of v, so bucket i of v+1 XOR bucket i of v is zero wherever an
element's bits did not change; zstd (level 1) removes those zeros. An actor keeps the decoded
buckets of its version (one host copy of the model) and XORs each delta bucket into it in place;
each result is checked against the learner's digest of the full bucket, so reconstruction is
bit-identical or refused. Offers: a full version at every multiple of K (everyone resynchronises
there, once per relay), to an actor that keeps no copy, or one from before the last full point;
otherwise the chain of deltas from the actor's version, if smaller than the full version. The
learner keeps the two newest full versions and the deltas since the last full point.

Relays and the topology

`python -m transport.weightsrc.relay` runs one relay per node. It says RelayHello to the learner
every heartbeat and gets its place in a tree of fan-out `transport.relay_fanout` (k; 1, the
default, makes a chain), in the order relays joined: relay 0 fetches from the learner, relay i
from relay (i − 1) // k, falling back to that relay's upstream and then the learner. A relay
fetches a bucket once however many peers ask for it (single flight), caches the newest
max_staleness + 3 versions, and serves zero-copy. Actors prefer the relay on their own host
(`--host`), then the root relay, then the learner. Why this shape: ARCHITECTURE.md (Weights at
scale): the learner sends each version once; a chain puts one copy on every node's link and
forwards bucket by bucket, so the last of N nodes is about M/B + N·b/B behind (model M, bucket
b, bandwidth B); a dead relay costs its peers one peer_timeout_s, not a version.

Loading into engines

HF: tensors are views of the received (or held) buckets, copied into the model once. vLLM: the
version streams into vLLM's worker one bucket per RPC (`tether_begin_load`, `tether_load_bucket`
× N, `tether_end_load`: vLLM's own in-place reload spread over calls), so vLLM's RPC copies one
bucket at a time instead of the model several times over. SGLang loads bucket by bucket between
`begin_weight_update` and `end_weight_update`.

`transport.weight_load` says when: `staged` (default) loads a version once all its buckets
arrived and were checked, so the engine is paused (per `actors.engine.update_mode`) for the load
only, and the actor holds the whole version meanwhile. `streamed` hands each checked bucket to
the engine in order (WeightSink `begin_load` / `load_bucket` / `end_load`), at most WINDOW held
by the actor: the peak is a few buckets instead of a version, and the price is an engine paused
for the whole transfer, since an in-place load cannot serve requests from a half-loaded model
(a live engine would need a second copy of the weights to swap in at the end). A stream that
stops part-way leaves the engine paused with version -1, and the next pull loads a whole
version. Deltas and LoRA stay staged (zmq_pull.py says why). Figures:
lab/results/vllm_load_memory.json.

GPU path (`transport.weights_via: nccl`, nccl.py)

An NCCL broadcast from the learner into its local vLLM engines (vLLM's weight-transfer engine:
`init_weight_transfer_engine` once, then per version `start_weight_update` / `update_weights` /
`finish_weight_update`), offered through the same WeightRequest / WeightOffer exchange. A
broadcast is a collective: every engine receives every version at the same time, so the learner
parks requests until every engine of the group asked, then offers and broadcasts the newest
version to all. It suits a fixed set of engines on GPUs; ZeroMQ and relays stay the
fault-tolerant default for actors that come and go. (SGLang's `update_weights_from_distributed`
would be the same seam; not built.)

Modules: base.py (the WeightSource protocol), registry.py (kind -> source), zmq_pull.py
(zmq, relay, filesystem sources), nccl.py (GPU), relay.py (the relay role), link.py (a DEALER
shared by concurrent requests), service.py + store.py (the learner's side), delta.py, integrity.py.
"""
