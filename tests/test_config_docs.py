"""docs/configuration.md is generated from configs/schema.py and must match it."""

import msgspec

from configs import docs
from configs.loader import describe
from configs.schema import TetherConfig

from conftest import ROOT


def test_committed_configuration_doc_matches_the_schema():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == docs.render(), "docs/configuration.md is stale: run python -m configs.docs"


def test_configuration_doc_has_a_row_per_field_with_its_docstring():
    text = docs.render()
    keys = [ln.split(" = ")[0].strip() for ln in describe() if " = " in ln.split("\n")[0]]
    assert len(keys) > 40
    assert all(f"| `{k}` |" in text for k in keys)
    assert "| `learner.correction` | `none` | `none` \\| `tis` \\| `decoupled` \\| `mask` |" in text
    assert "| `transport.control_port` | `0` | int, in [0, 65535] | Control ROUTER port" in text
    sections = [f.name for f in msgspec.structs.fields(TetherConfig)
                if isinstance(getattr(TetherConfig(), f.name), msgspec.Struct)]
    assert all(f"## `{s}`:" in text for s in sections)


def test_check_mode_fails_on_a_stale_file(tmp_path, monkeypatch):
    monkeypatch.setattr(docs, "OUT", tmp_path / "configuration.md")
    assert docs.main(["--check"]) == 1
    assert docs.main([]) == 0 and docs.main(["--check"]) == 0
    docs.OUT.write_text(docs.OUT.read_text().replace("Optimizer steps", "Steps"))
    assert docs.main(["--check"]) == 1
