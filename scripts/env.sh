#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install Tether into it.
# Re-running is cheap: packages are reinstalled only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[env] creating .venv with $($PY --version)" >&2
  "$PY" -m venv .venv
fi
stamp=.venv/.tether-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[env] installing tether and its dependencies (CPU torch 2.13.0) ..." >&2
  .venv/bin/python -m pip install -q --upgrade pip >&2
  .venv/bin/python -m pip install -q -e ".[test]" >&2
  echo "$want" > "$stamp"
fi
