#!/usr/bin/env bash
# Create (or reuse) the bench-only venv .venv-bench: Tether plus TRL, for the synchronous peer row
# of `lab/bench.py --only peer` (lab/bench_peer.py). Never used by the tests or runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv-bench/bin/python ]; then
  echo "[env-bench] creating .venv-bench with $($PY --version)" >&2
  "$PY" -m venv .venv-bench
fi
stamp=.venv-bench/.tether-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[env-bench] installing tether[bench] (CPU torch 2.13.0, trl) ..." >&2
  .venv-bench/bin/python -m pip install -q -e ".[bench]" 2>&1 | { grep -v "^WARNING: Location" || true; } >&2
  echo "$want" > "$stamp"
fi
