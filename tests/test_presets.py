"""Presets state only what differs from the schema's defaults (or from the preset they extend
with `base:`), and still resolve to exactly the configs they resolved to before they were
stripped (tests/data/presets_resolved.json, written by the loader of that time)."""

from __future__ import annotations

import json

import pytest
import yaml

from configs.loader import ConfigError, load_config, read_preset, to_dict
from configs.schema import TetherConfig

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


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_stripped_preset_resolves_as_before(name):
    now = _leaves(to_dict(load_config(ROOT / "configs" / name)))
    # fields added since the snapshot are not in it; every field it has must be unchanged
    changed = {k: (v, now.get(k)) for k, v in _leaves(BEFORE[name]).items()
               if k not in now or now[k] != v or type(now[k]) is not type(v)}
    assert not changed, changed


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_preset_states_only_what_differs_from_its_base(preset):
    own = yaml.safe_load(preset.read_text())
    base = own.pop("base", None)
    under = to_dict(load_config(preset.parent / base) if base else TetherConfig())
    defaults = _leaves(under)  # a dict-valued field's keys (reward_kwargs.x) may be absent there
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
    resolved, default = _leaves(to_dict(load_config(preset))), _leaves(to_dict(TetherConfig()))
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
