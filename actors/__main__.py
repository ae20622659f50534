"""Start one rollout actor:  python -m actors -c CONFIG [key=value ...] LEARNER

LEARNER is the learner's control endpoint (tcp://host:port or host:port), or the path of its
endpoints.json / run directory. The config is parsed before torch is imported, so --help and
config errors are instant.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from actors import forked
from actors.scratch import check_socket_room, scratch_dir
from configs.loader import (ConfigError, describe, exit_now, load_config, resolve_endpoint,
                            setup_process)
from configs.schema import StreamingEngineConfig, TetherConfig


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tether-actor", description="Tether rollout actor.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config fields (override with key=value):\n" + "\n".join(describe()))
    p.add_argument("-c", "--config", help="YAML preset (e.g. configs/toy_reverse.yaml)")
    p.add_argument("--actor-id", default=f"{socket.gethostname()}-{os.getpid()}",
                   help="unique name of this actor (default: host-pid)")
    p.add_argument("--cache-dir", default=None,
                   help="where the learner's model files are written (default: RUN_DIR/actor_cache)")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="exit when the parent process dies (used for the learner's local actors)")
    p.add_argument("--cpus", default=[], type=_cpu_list,
                   help="comma-separated cores to run on, with that many torch threads (the "
                        "learner's local actors under learner.cpu_placement=split)")
    p.add_argument("--host", default=socket.gethostname(),
                   help="this actor's node name: a weight relay advertised under it is preferred "
                        "(transport.weights_via=relay; default: the host name)")
    p.add_argument("args", nargs="*", help="LEARNER address and key=value overrides")
    return p.parse_args(argv)


def _cpu_list(text: str) -> list[int]:
    cores = [c.strip() for c in text.split(",") if c.strip()]
    if not cores or not all(c.isdigit() for c in cores):
        raise argparse.ArgumentTypeError(f"--cpus must be core numbers joined by commas (e.g. 0,1), "
                                         f"got {text!r}")
    return [int(c) for c in cores]


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    overrides = [a for a in ns.args if "=" in a and not a.startswith("tcp://")]
    targets = [a for a in ns.args if a not in overrides]
    try:
        cfg = load_config(ns.config, overrides)
        if len(targets) != 1:
            raise ConfigError(f"give exactly one learner address, got {targets or 'none'}")
        endpoint = resolve_endpoint(targets[0])
        if isinstance(cfg.actors.engine, StreamingEngineConfig):  # vLLM, SGLang
            check_socket_room()
    except ConfigError as e:
        print(f"tether-actor: {e}", file=sys.stderr)
        return 2

    setup_process(f"actor[{ns.actor_id}]")
    with scratch_dir():  # before any engine is imported: its temporary files go there
        return run_actor(cfg, endpoint, ns)


def run_actor(cfg: TetherConfig, endpoint: str, ns: argparse.Namespace) -> int:
    """Build the actor and run it until it stops; returns its exit code."""
    import asyncio
    import signal

    from actors.actor import Actor

    cache = Path(ns.cache_dir) if ns.cache_dir else Path(cfg.run_dir) / "actor_cache"
    if ns.cpus:
        os.sched_setaffinity(0, ns.cpus)  # before the engine starts: its processes inherit it
    if len(ns.cpus) <= 1:
        forked.enable()  # its engine's processes fork (one torch thread: actors/forked.py)
    actor = Actor(cfg, endpoint, ns.actor_id, cache,
                  parent_pid=os.getppid() if ns.exit_with_parent else None,
                  threads=len(ns.cpus) or 1, host=ns.host)

    async def run() -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, actor.stop, f"signal {int(sig)}")
        return await actor.run()

    import uvloop

    return uvloop.run(run())


if __name__ == "__main__":
    exit_now(main())
