"""Placement (configs/placement.py): which GPUs each process on a node gets, the refusals of
impossible or overlapping assignments (one line naming roles and GPUs), config-time checks of
stated placements, and the environment of real local actor processes (CUDA_VISIBLE_DEVICES set,
torchrun's rendezvous variables gone)."""

from __future__ import annotations

import json
import sys

import pytest

import procs
from configs.loader import ConfigError, load_config
from configs.placement import PlacementError, child_env, parse_devices, plan, span


def test_parse_and_span_round_trip():
    assert parse_devices("0-3", "k") == (0, 1, 2, 3)
    assert parse_devices(" 4, 6-7 ", "k") == (4, 6, 7)
    assert span((0, 1, 2, 3)) == "0-3" and span((4, 6)) == "4,6" and span(()) == "none"
    for bad, msg in (("a", "must be GPU indices"), ("3-1", "empty range '3-1'"),
                     ("1,1", "names a GPU twice")):
        with pytest.raises(PlacementError, match=msg):
            parse_devices(bad, "placement.learner")


def test_auto_gives_the_learner_the_first_gpus_and_each_actor_a_block_after_them():
    p = plan(8, 4, "auto", 2, 2, [])
    assert p.learner == ((0,), (1,), (2,), (3,)) and p.actors == ((4, 5), (6, 7))
    assert p.describe() == ("learner rank 0: GPU 0; learner rank 1: GPU 1; learner rank 2: GPU 2; "
                            "learner rank 3: GPU 3; actor 0: GPU 4-5; actor 1: GPU 6-7")
    assert plan(8, 2, "4,5", 3, 1, []).actors == ((0,), (1,), (2,))  # the free ones, in order
    cpu = plan(0, 0, "auto", 2, 0, [])  # a CPU node: nobody gets a GPU
    assert cpu.learner == () and cpu.actors == ((), ())
    assert plan(8, 0, "auto", 1, 2, []).actors == ((0, 1),)  # CPU learner, GPU actors


def test_stated_lists_are_kept():
    p = plan(8, 4, "4-7", 2, 2, ["0,1", "2,3"], ["7"] * 0)
    assert p.learner == ((4,), (5,), (6,), (7,)) and p.actors == ((0, 1), (2, 3))


@pytest.mark.parametrize("args, message", [
    ((8, 4, "0-3", 2, 2, ["3,4", "5,6"]), "placement: GPU 3 is given to both learner rank 3 and actor 0"),
    ((8, 4, "auto", 2, 2, ["4,5", "5,6"]), "placement: GPU 5 is given to both actor 0 and actor 1"),
    ((8, 4, "auto", 3, 2, []), "placement: 3 actor(s) of 2 GPU(s) each need 6 GPUs but this node "
                               "has 8 (GPU 0-7) and the learner's 4 rank(s) take GPU 0-3"),
    ((1, 1, "auto", 1, 1, []), "placement: 1 actor(s) of 1 GPU(s) each need 1 GPUs but this node "
                               "has 1 (GPU 0) and the learner's 1 rank(s) take GPU 0"),
    ((8, 4, "0-3", 2, 2, ["4,5", "8,9"]), "placement: actor 1 is given GPU 8 but this node has 8 GPU(s) (0-7)"),
    ((8, 4, "0-2", 0, 1, []), "placement.learner gives GPU 0-2 (3 GPUs) to 4 learner rank(s)"),
    ((8, 4, "auto", 1, 2, ["4"]), "placement.actors[0] gives actor 0 GPU 4 (1 GPUs) but its engine spans 2"),
    ((8, 4, "auto", 2, 2, ["4,5"]), "placement.actors lists 1 GPU set(s) but actors.num_local is 2"),
    ((2, 4, "auto", 0, 1, []), "placement: the learner's 4 rank(s) on this node need 4 GPUs but it has 2"),
])
def test_impossible_or_overlapping_placements_are_one_line(args, message):
    with pytest.raises(PlacementError) as e:
        plan(*args)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_scorers_take_part_in_the_overlap_check():
    with pytest.raises(PlacementError, match="GPU 7 is given to both actor 1 and scorer 0"):
        plan(8, 4, "auto", 2, 2, [], ["7"])
    assert plan(8, 4, "auto", 1, 2, [], ["7"]).scorers == ((7,),)


def test_a_stated_placement_is_checked_when_the_config_loads():
    ok = load_config(procs.PRESET, ["placement.gpus_per_node=8", "placement.learner=0-3",
                                    "actors.num_local=4"])
    assert ok.placement.learner == "0-3"
    with pytest.raises(ConfigError, match="placement: GPU 3 is given to both learner rank 3 and "
                                          "actor 0"):
        load_config(procs.PRESET, ["placement.gpus_per_node=8", "placement.learner=0-3",
                                   'placement.actors=["3","5"]'])
    with pytest.raises(ConfigError, match="placement.learner must be"):
        load_config(procs.PRESET, ["placement.learner=first-four"])


def test_child_env_drops_torchrun_and_translates_visible_devices():
    base = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "n1",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x", "PET_NNODES": "2",
            "GROUP_RANK": "0", "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "2,3,5,7"}
    env = child_env((2, 3), base)
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "5,7"}
    assert child_env((), {"PATH": "/bin"})["CUDA_VISIBLE_DEVICES"] == ""
    with pytest.raises(PlacementError, match="GPU 4 is not among the 4 this process sees"):
        child_env((4,), base)


FAKE_ACTOR = """import json, os, sys
run_dir = sys.argv[sys.argv.index("-c") + 1].rsplit("/", 1)[0]
actor = sys.argv[sys.argv.index("--actor-id") + 1]
with open(f"{run_dir}/env-{actor}.json", "w") as f:
    json.dump(dict(os.environ), f)
"""


def test_local_actor_processes_get_their_gpus_and_no_torchrun_env(tmp_path, monkeypatch):
    """LocalActors.start's real Popen, with a python that records its environment instead of
    running an actor (the actor's own code is not what is tested here)."""
    from configs.placement import plan as make_plan
    from learner.local_actors import LocalActors

    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\n{FAKE_ACTOR}")
    fake.chmod(0o755)
    for k, v in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "GROUP_RANK": "0",
                 "TORCHELASTIC_RUN_ID": "r", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr("learner.local_actors.sys.executable", str(fake))
    cfg = load_config(procs.PRESET, ["actors.num_local=2", f"run_dir={tmp_path}"])
    placement = make_plan(8, 4, "auto", 2, 2, [])
    actors = LocalActors.start(cfg, "tcp://127.0.0.1:1", tmp_path, placement=placement)
    for p in actors.procs:
        assert p.wait(timeout=60) == 0
    for i, want in enumerate(("4,5", "6,7")):
        env = json.loads((tmp_path / f"env-local-{i}.json").read_text())
        assert env["CUDA_VISIBLE_DEVICES"] == want
        leaked = [k for k in env if k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                          "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
                  or k.startswith("TORCHELASTIC_")]
        assert not leaked, leaked
