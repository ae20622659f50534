#!/usr/bin/env bash
# Write the locks: scripts/lock.txt for .venv (pyproject.toml with every extra test.sh installs)
# and scripts/lock_sglang.txt for .venv-sglang (scripts/sglang_cpu_requirements.txt). scripts/env.sh
# and scripts/env_sglang.sh install with them as constraint files, so ./run.sh, ./test.sh and a
# fresh clone get exactly the versions the suite passed with.
#   bash scripts/lock.sh             # after adding or changing a dependency: the locked versions
#                                    # stay where they still fit (uv prefers the existing pins)
#   bash scripts/lock.sh --upgrade   # a fresh resolution: every package at its newest allowed version
# Then rerun the tests and commit the locks with the change (docs/getting_started.md).
# uv resolves from pip's package sources (scripts/venv_install.py compile) for .venv's python
# (made bare here if missing). Resolved for that interpreter and platform: CPython 3.11, Linux x86_64.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
extras=$(sed -n 's/^TETHER_EXTRAS=\([a-z0-9,-]*\) bash scripts\/env\.sh.*/\1/p' test.sh)
[ -n "$extras" ] || { echo "[lock] no 'TETHER_EXTRAS=... bash scripts/env.sh' line in test.sh" >&2; exit 1; }

lock() {  # lock OUT HEADER INPUT ARGS...: resolve INPUT into OUT, HEADER on top
  local out=$1 header=$2; shift 2
  local tmp; tmp=$(mktemp)
  [ -f "$out" ] && grep -v '^#' "$out" > "$tmp"  # the current pins, as uv's preferences
  .venv/bin/python scripts/venv_install.py compile "$@" --output-file "$tmp" --no-header \
    2>&1 | { grep -v "^WARNING: Location" || true; } >&2
  # The local label of the CPU build (torch==2.13.0+cpu here) is not on every index; torch==2.13.0
  # admits it where an index has it. The machine's own pip constraint file is no reason to name.
  { printf '%s\n' "$header"; sed -e 's/^\(torch==[^+]*\)+cpu$/\1/' -e '/#   -c \//d' "$tmp"; } > "$out"
  rm -f "$tmp"
  echo "[lock] $out: $(grep -c '^[a-z0-9]' "$out") packages" >&2
}

lock scripts/lock.txt "# .venv's lock (scripts/env.sh installs with it as a constraint file): written by
# \`bash scripts/lock.sh\`, do not edit. CPython 3.11, Linux x86_64.
# extras: $extras" \
  pyproject.toml $(for e in ${extras//,/ }; do echo --extra "$e"; done) "$@"
lock scripts/lock_sglang.txt "# .venv-sglang's lock (scripts/env_sglang.sh installs with it as a constraint file): written
# by \`bash scripts/lock.sh\` from scripts/sglang_cpu_requirements.txt, do not edit. CPython 3.11, Linux x86_64." \
  scripts/sglang_cpu_requirements.txt "$@"
