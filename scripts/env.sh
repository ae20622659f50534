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
# pip's machine-wide config may name absent local indexes; drop that noise, keep pip's status.
pip_quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[env] installing tether and its dependencies (CPU torch 2.13.0) ..." >&2
  pip_quiet .venv/bin/python -m pip install -q -e ".[test,tools]" >&2
  echo "$want" > "$stamp"
fi
