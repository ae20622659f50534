"""Start the learner:  python -m learner -c CONFIG [key=value ...]

With actors.num_local > 0 it also starts that many actor processes on this node. The config is
parsed before torch is imported, so --help and config errors are instant.

Distributed (FSDP2): torchrun --nproc_per_node N -m learner -c CONFIG learner.backend=fsdp2
(rank 0 owns the sockets and actors; see learner/distributed.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from configs.loader import ConfigError, describe, load_config, setup_process
from learner.host_memory import tune_malloc
from learner.model_setup import missing_model
from learner.obs import tracking
from learner.run_dir import RunDirError, check


def preflight(cfg) -> None:
    """What would stop the run at its start, said in one line before torch is imported: a
    model.path that holds no model, a run_dir that holds another run (learner/run_dir.py)."""
    problem = missing_model(cfg)
    if problem:
        raise ConfigError(problem)
    if os.environ.get("RANK", "0") == "0":  # rank 0 owns the run directory
        check(cfg)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="tether-learner", description="Tether learner (and, optionally, local actors).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config fields (override with key=value):\n" + "\n".join(describe()))
    p.add_argument("-c", "--config", help="YAML preset (e.g. configs/toy_reverse.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. learner.lr=1e-3")
    ns = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(ns.config, ns.overrides)
        tracking.require(cfg)
        preflight(cfg)
    except (ConfigError, RunDirError) as e:
        print(f"tether-learner: {e}", file=sys.stderr)
        return 2

    rank = os.environ.get("RANK")
    setup_process("learner" if rank is None else f"learner[rank{rank}]")
    tuned = tune_malloc()  # before torch allocates
    logging.getLogger("learner").info("malloc: %s", tuned or "as the environment sets it")
    from configs.placement import PlacementError
    from learner.main import run
    from learner.reward_health import RewardFailing

    try:
        run(cfg)
    except PlacementError as e:  # found when the node's GPUs are counted at start
        print(f"tether-learner: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError, RewardFailing) as e:  # bad input found at start, a failing reward
        logging.getLogger("learner").debug("the run stopped:", exc_info=True)
        print(f"tether-learner: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a torchrun rank: no finalization
        from learner.distributed import exit_rank

        exit_rank(code)
    sys.exit(code)
