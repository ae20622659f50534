import json
import subprocess
import sys

import pytest

from configs.loader import ConfigError, describe, load_config

from conftest import ROOT

PRESET = ROOT / "configs" / "toy_reverse.yaml"


def test_preset_loads_and_overrides_apply():
    cfg = load_config(PRESET, ["learner.lr=1e-3", "actors.num_local=3", "max_staleness=0",
                               "run_dir=/tmp/x", "learner.correction=tis"])
    assert cfg.learner.lr == 1e-3 and isinstance(cfg.learner.lr, float)
    assert cfg.actors.num_local == 3 and cfg.max_staleness == 0
    assert cfg.run_dir == "/tmp/x" and cfg.learner.correction == "tis"


@pytest.mark.parametrize("preset", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_preset_is_valid(preset):
    load_config(preset, [])


@pytest.mark.parametrize("override, expected", [
    (["actors.engine=tgi"], "actors.engine must be one of"),
    (["actors.engine=sglang", "actors.engine.mem_fraction_static=1.5"],
     "actors.engine.mem_fraction_static must be in"),
    (["actors.engine=sglang", "actors.engine.max_total_tokens=-1"],
     "actors.engine.max_total_tokens must be >= 0"),
    (["learner.advantage=vtrace", "learner.correction=decoupled"],
     "learner.correction must be none or mask with learner.advantage=vtrace"),
    (["learner.policy_loss=cispo", "learner.correction=tis"], "learner.policy_loss must be ppo"),
    (["task.overlong_buffer=6"], "task.overlong_buffer must be <= the completion budget 5"),
    (["learner.kl_estimator=k4"], "learner.kl_estimator must be one of"),
    (["learner.gamma=1.5"], "learner.gamma must be in"),
    (["actors.engine=vllm", "actors.engine.update_mode=later"],
     "actors.engine.update_mode must be one of"),
    (["transport.weights_via=nfs"], "transport.weights_via must be one of"),
    (["transport.weight_load=lazy"], "transport.weight_load must be one of staged, streamed"),
    (["transport.weight_load=streamed", "transport.weight_full_every=4"],
     "transport.weight_load must be staged with weights_via filesystem or nccl, deltas"),
    (["transport.weight_load=streamed", "transport.weights_via=filesystem"],
     "transport.weight_load must be staged with weights_via filesystem or nccl"),
    (["transport.weight_load=streamed", "learner.lora.rank=4"],
     "transport.weight_load must be staged with weights_via filesystem or nccl, deltas "
     "(weight_full_every > 0) or LoRA"),
    (["actors.engine=vllm", "actors.engine.kv_cache_gb=-0.5"], "actors.engine.kv_cache_gb must be >= 0"),
    (["actors.engine.kv_cache_gb=1"], "unknown config key 'actors.engine.kv_cache_gb' for actors.engine kind hf"),
    (["learner.backend.tp=2"], "unknown config key 'learner.backend.tp' for learner.backend kind single"),
    (["task.name=gsm8k"], "task.data_path must be set (a JSONL file) when task.name is gsm8k"),
    (["learner.foo=1"], "unknown config key 'learner.foo'"),
    (["nosuch.x=1"], "unknown config key 'nosuch'"),
    (["learner.lr=abc"], "learner.lr must be float, got 'abc'"),
    (["actors.num_local=1.5"], "actors.num_local must be int"),
    (["actors.num_local=true"], "actors.num_local must be int"),
    (["max_staleness=-1"], "max_staleness must be >= 0, got -1"),
    (["learner.correction=magic"], "learner.correction must be one of"),
    (["learner.minibatches=3"], "learner.minibatches must be"),
    (["learner.backend=megatron", "learner.backend.tp=0"], "learner.backend.tp must be >= 1, got 0"),
    (["learner.backend=deepspeed"], "learner.backend must be one of single, fsdp2, megatron"),
    (["learner.pack_rows=true"],
     "learner.pack_rows must be false unless learner.max_tokens_per_microbatch > 0"),
    (["learner.backend=megatron", "learner.pack_rows=true", "learner.max_tokens_per_microbatch=9"],
     "learner.backend must be single or fsdp2 with learner.pack_rows=true"),
    (["learner.lr"], "must look like section.field=value"),
    (["transport.kind=inproc", "actors.num_local=0"], "actors.num_local must be >= 1 with transport.kind=inproc"),
    (["transport.kind=ipc"], "transport.kind must be one of zmq, inproc"),
    (["learner=3"], "learner must be a mapping"),
])
def test_bad_overrides_name_the_field(override, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        load_config(PRESET, override)


@pytest.mark.parametrize("override, expected", [
    (["actors.agent=langchain"], "actors.agent must be one of single_turn, tools, openai"),
    (["actors.agent=tools", "actors.agent.tools=calc,shell"],
     "actors.agent.tools must be a comma-separated subset of"),
    (["actors.agent=tools", "actors.agent.max_turns=0"], "actors.agent.max_turns must be >= 1, got 0"),
    (["actors.agent=tools", "actors.agent.max_total_tokens=4"],
     "actors.agent.max_total_tokens must be >= task.max_new_tokens=5, got 4"),
    (["actors.agent=tools", "actors.agent.tool_timeout_s=0"],
     "actors.agent.tool_timeout_s must be > 0, got 0.0"),
    (["actors.agent=tools", "actors.agent.tool_memory_mb=16"],
     "actors.agent.tool_memory_mb must be >= 64, got 16"),
    (["actors.agent=openai", "actors.agent.function=m:f", "actors.agent.port=70000"],
     "actors.agent.port must be in [0, 65535], got 70000"),
    (["actors.agent=openai", "actors.agent.function=m:f", "actors.agent.port=-1"],
     "actors.agent.port must be in [0, 65535], got -1"),
    (["actors.agent=openai"], "actors.agent.function must be set to module:function when actors.agent is openai"),
    (["actors.agent=openai", "actors.agent.function=my_agent"],
     "actors.agent.function must be module:function, got 'my_agent'"),
    (["actors.agent=tools", "actors.agent.max_turns=two"], "actors.agent.max_turns must be int, got 'two'"),
    (["actors.agent=environment"], "actors.agent.environment must be module:attribute (or task.environment set) when actors.agent is environment"),
    (["actors.agent=tools", "actors.agent.tool_parser=qwen"],
     "actors.agent.tool_parser must be one of tether, hermes"),
    (["actors.agent=openai", "actors.agent.function=m:f", "actors.agent.tool_parser=qwen"],
     "actors.agent.tool_parser must be one of tether, hermes"),
    (["actors.agent=tools", "actors.agent.python_sandbox=docker"],
     "actors.agent.python_sandbox must be one of bwrap, rlimits"),
    (["actors.agent=tools", "actors.agent.tool_max_procs=0"],
     "actors.agent.tool_max_procs must be >= 1, got 0"),
    (["actors.agent.max_turns=2"], "unknown config key 'actors.agent.max_turns' for actors.agent kind single_turn"),
    (["actors.agent=openai", "actors.agent.function=m:f", "actors.agent.tools=calc"],
     "unknown config key 'actors.agent.tools' for actors.agent kind openai"),
])
def test_bad_agent_fields_are_rejected_naming_the_field(override, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]").replace("+", r"\+")):
        load_config(PRESET, override)


def test_good_agent_fields_load():
    cfg = load_config(PRESET, ["actors.agent=openai", "task.max_new_tokens=12",
                               "actors.agent.function=actors.agents.openai.example:calculator_agent",
                               "actors.agent.max_total_tokens=12"])
    assert cfg.actors.agent.kind == "openai" and cfg.actors.agent.max_total_tokens == 12
    assert cfg.actors.agent.function == "actors.agents.openai.example:calculator_agent"
    cfg = load_config(PRESET, ["actors.agent=tools", "actors.agent.tools=calc,python"])
    assert cfg.actors.agent.kind == "tools" and cfg.actors.agent.tools == "calc,python"
    with pytest.raises(ConfigError, match="unknown config key 'actors.agent.function' for "
                                          "actors.agent kind single_turn"):
        load_config(PRESET, ["actors.agent.function=no_colon"])  # only openai has it


def test_a_kind_name_alone_is_that_kind_with_its_defaults():
    vllm = ROOT / "configs" / "toy_reverse_vllm.yaml"
    cfg = load_config(vllm, [])
    assert (cfg.actors.engine.kind, cfg.actors.engine.kv_cache_gb) == ("vllm", 0.25)
    cfg = load_config(vllm, ["actors.engine.max_num_seqs=8"])  # the preset's kind and fields stay
    assert (cfg.actors.engine.kv_cache_gb, cfg.actors.engine.max_num_seqs) == (0.25, 8)
    cfg = load_config(vllm, ["actors.engine=sglang"])  # another kind: its defaults only
    assert (cfg.actors.engine.kind, cfg.actors.engine.max_total_tokens) == ("sglang", 0)
    cfg = load_config(vllm, ["actors.engine=vllm"])  # the same kind named alone: its defaults too
    assert cfg.actors.engine.kv_cache_gb == 1.0
    cfg = load_config(PRESET, ["actors.engine={kind: vllm, kv_cache_gb: 0.5}",
                               "learner.backend=fsdp2", "actors.agent=tools"])
    assert cfg.actors.engine.kv_cache_gb == 0.5 and cfg.learner.backend.kind == "fsdp2"
    assert cfg.actors.agent.max_turns == 4
    lora = load_config(ROOT / "configs" / "toy_reverse_lora_vllm.yaml", [])  # through `base:`
    assert lora.actors.engine.kv_cache_gb == 0.25
    with pytest.raises(ConfigError) as e:  # only the kind changed: vllm's field stays and is wrong
        load_config(vllm, ["actors.engine.kind=sglang"])
    assert str(e.value) == ("unknown config key 'actors.engine.kv_cache_gb' for actors.engine "
                            "kind sglang (known in this section: base_gpu_id, max_total_tokens, "
                            "mem_fraction_static, tp_size, update_mode)")


def test_a_preset_naming_another_kind_replaces_its_base_section(tmp_path):
    (tmp_path / "base.yaml").write_text("actors:\n  engine: {kind: vllm, kv_cache_gb: 0.25}\n")
    (tmp_path / "sg.yaml").write_text("base: base.yaml\nactors:\n  engine: {kind: sglang, "
                                      "max_total_tokens: 64}\n")
    (tmp_path / "same.yaml").write_text("base: base.yaml\nactors:\n  engine: {max_num_seqs: 4}\n")
    cfg = load_config(tmp_path / "sg.yaml")
    assert (cfg.actors.engine.kind, cfg.actors.engine.max_total_tokens) == ("sglang", 64)
    cfg = load_config(tmp_path / "same.yaml")
    assert (cfg.actors.engine.kv_cache_gb, cfg.actors.engine.max_num_seqs) == (0.25, 4)


def test_bad_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    f = tmp_path / "list.yaml"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(f)


def test_every_field_is_documented():
    lines = describe()
    assert len(lines) > 40
    undocumented = [ln for ln in lines if not ln.split("\n")[1].strip()]
    assert not undocumented, undocumented


@pytest.mark.parametrize("module", ["learner", "actors"])
def test_cli_config_errors_exit_2_with_one_line_and_no_torch(module):
    extra = ["tcp://h:1"] if module == "actors" else []
    r = subprocess.run([sys.executable, "-m", module, "-c", str(PRESET), "learner.lr=-1", *extra],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "learner.lr must be > 0" in r.stderr
    code = (f"import sys; from {module}.__main__ import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported by --help'")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "max_staleness" in r.stdout


def test_resolved_config_round_trips(tmp_path):
    from configs.loader import save_config

    cfg = load_config(PRESET, ["learner.lr=2e-4"])
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg
    cfg = load_config(PRESET, ["actors.engine=vllm", "actors.agent=openai",
                               "actors.agent.function=m:f", "learner.backend=megatron"])
    save_config(cfg, tmp_path / "k.yaml")
    assert load_config(tmp_path / "k.yaml") == cfg


@pytest.mark.parametrize("override, expected", [
    (["learner.mask_low=1.5"], "learner.mask_low must be in (0, 1), got 1.5"),
    (["learner.mask_high=0.9"], "learner.mask_high must be > 1, got 0.9"),
    (["learner.clip_low=1"], "learner.clip_low must be in [0, 1), got 1.0"),
    (["learner.staleness_decay=0"], "learner.staleness_decay must be in (0, 1], got 0.0"),
    (["learner.dual_clip=0.5"], "learner.dual_clip must be 0 (off) or > 1, got 0.5"),
    (["learner.group_size=1"], "learner.group_size must be >= 2 (group-relative advantages), got 1"),
    (["learner.minibatches=0"], "learner.minibatches must be >= 1, got 0"),
    (["transport.control_port=70000"], "transport.control_port must be in [0, 65535], got 70000"),
    (["transport.peer_timeout_s=1"], "transport.peer_timeout_s must be > 2 * transport.heartbeat_s=1.0, got 1.0"),
    (["buffer.capacity_groups=4"], "buffer.capacity_groups must be >= learner.prompts_per_step=16, got 4"),
    (["model.build_tiny=1"], "model.build_tiny must be bool, got 1"),
    (["run_dir=3"], "run_dir must be str, got 3"),
    (["actors.engine=3"], "actors.engine must be one of hf, vllm, sglang, simulated, got 3"),
    (["actors.engine=vllm", "actors.engine.kv_cache_gb=-1"],
     "actors.engine.kv_cache_gb must be >= 0, got -1.0"),
    (["actors.engine.kv_cache_gb=2"], "unknown config key 'actors.engine.kv_cache_gb' for "
                                      "actors.engine kind hf (known in this section: device, logprobs)"),
    (["actors.engine=vllm", "actors.engine.enforce_eager=3"],
     "actors.engine.enforce_eager must be bool or null, got 3"),
    (["task.name=chess"], "task.name must be one of reverse, calculator, gsm8k, data, additions, environment, verifiers or an import path module:make_task, got 'chess'"),
    (["nosuch=1"], "unknown config key 'nosuch' (known in this section: actors, buffer, learner, "
                   "max_staleness, model, placement, run_dir, scoring, task, transport)"),
])
def test_field_constraints_name_the_field_and_the_rule(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(PRESET, override)
    assert str(e.value) == expected


def test_floats_in_exponent_notation_and_spaced_tool_lists_load():
    cfg = load_config(PRESET, ["actors.engine=vllm", "actors.engine.kv_cache_gb=1e-3",
                               "actors.agent=tools", "actors.agent.tools=calc, python",
                               "learner.is_cap=3"])
    assert cfg.actors.engine.kv_cache_gb == 1e-3 and cfg.actors.agent.tools == "calc, python"
    assert cfg.learner.is_cap == 3.0 and isinstance(cfg.learner.is_cap, float)


@pytest.mark.parametrize("task", ["reverse", "calculator", "gsm8k"])
def test_a_reward_for_a_task_that_scores_by_itself_is_an_error_naming_both(task):
    """task.reward was silently ignored by the tasks that score with their own reward."""
    data = ["task.data_path=gsm8k.jsonl"] if task == "gsm8k" else []  # required (not read here)
    with pytest.raises(ConfigError) as e:
        load_config(PRESET, [f"task.name={task}", "task.reward=nosuch:fn", *data])
    assert str(e.value) == (f"task.reward must be empty with task.name={task} (that task scores "
                            "with its own reward; task.reward is used by task.name data, "
                            "additions or a task given by import path), got 'nosuch:fn'")


def test_a_reward_for_a_task_that_uses_one_loads():
    assert load_config(PRESET, ["task.name=additions", "task.reward=m:f"]).task.reward == "m:f"
    assert load_config(PRESET, ["task.name=my_tasks:make_task", "task.reward=m:f"]).task.reward


def test_a_missing_model_path_is_one_line_unless_the_toy_model_was_asked_for(tmp_path):
    """A typo in model.path used to build and train a fresh toy model without a word."""
    r = subprocess.run([sys.executable, "-m", "learner", f"model.path={tmp_path / 'nosuch'}",
                        f"run_dir={tmp_path / 'run'}", "learner.max_steps=1", "actors.num_local=1",
                        "learner.prompts_per_step=2", "buffer.capacity_groups=2",
                        "task.eval_prompts=2"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip() == (f"tether-learner: model.path {tmp_path / 'nosuch'} holds no model "
                                "(no config.json); set model.build_tiny=true to build the toy "
                                "model there"), r.stderr[-3000:]
    assert not (tmp_path / "nosuch").exists()
    # the toy presets ask for it explicitly, as run.sh's default does
    for preset in ("toy_reverse.yaml", "toy_calculator.yaml"):
        assert load_config(ROOT / "configs" / preset).model.build_tiny


def test_a_roles_learner_address_resolves_to_the_socket_it_needs(tmp_path):
    from configs.loader import resolve_endpoint

    (tmp_path / "endpoints.json").write_text(json.dumps(
        {"control": "tcp://a:1", "weights": "tcp://a:3"}))
    assert resolve_endpoint(str(tmp_path)) == "tcp://a:1"
    assert resolve_endpoint(str(tmp_path / "endpoints.json"), "weights") == "tcp://a:3"
    assert resolve_endpoint("nodeA:5555") == "tcp://nodeA:5555"
    assert resolve_endpoint("tcp://nodeA:5555", "weights") == "tcp://nodeA:5555"
    with pytest.raises(ConfigError, match="has the learner started"):
        resolve_endpoint(str(tmp_path / "other.json"))
    with pytest.raises(ConfigError, match=r"'nodeA' must be tcp://host:port"):
        resolve_endpoint("nodeA")
