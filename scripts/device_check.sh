#!/usr/bin/env bash
# The GPU path without vLLM in one short run on the lent machine (one H100/H200; its python3
# has torch with CUDA, transformers, safetensors, peft, accelerate, aiohttp, uvloop, PyYAML,
# pytest, psutil; no network). Budget: 7 minutes. Steps (expected durations on an H100):
#   1/4 machine      nvidia-smi, python, torch, NVML's GPU count                      ~5 s
#   2/4 environment  the carried wheels (msgspec, pyzmq for cp312: .device_wheels/) and this
#                    project, `pip install --no-index --no-deps --target` a directory put
#                    on PYTHONPATH after the repo: the machine's torch and the rest stay as
#                    they are (the repo alone on PYTHONPATH if setuptools is missing)   ~15 s
#   3/4 GPU tests    pytest -m "gpu and not vllm" (JUnit XML): FSDP2 with NCCL on one
#                    rank against the single-process CUDA backend, bf16 weights
#                    (BF16AdamW) and packed rows (sdpa) on CUDA                       ~75 s
#   4/4 measurements scripts/device_check.py: placement refusal (~15 s), fork probe
#                    (~30 s), bf16 learner steps and peak memory vs predicted on
#                    Qwen2.5-1.5B and 7B-width/4-layer random inits (~60 s), the HF engine
#                    on CUDA fed by the learner over ZeroMQ (~30 s), a real learner with a
#                    local HF actor placed on the GPU (~90 s)                         ~4 min
# One JSON report (default $OUT/device_check.json when $OUT is set, else
# runs/device_check/report.json) with every step's figures, outcome and duration.
#
#   scripts/device_check.sh [--out FILE] [--wheels DIR] [--dry-run] [-- device_check.py args]
#
# --dry-run: no CUDA needed, nothing installed (the current python); the GPU tests are
# collected and skipped, every measurement runs on the CPU (tests/test_device_check.py).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:+$OUT/device_check.json}
out=${out:-runs/device_check/report.json}
wheels=.device_wheels dry=0 extra=()
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=${2:?--out needs a file}; shift 2 ;;
    --wheels) wheels=${2:?--wheels needs a directory}; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "device_check.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
work=$(dirname "$out")
mkdir -p "$work"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
t0=$SECONDS
say() { echo "[device_check $((SECONDS - t0))s] $*"; }

say "1/4 machine"
py=${TETHER_PYTHON:-}
if [ -z "$py" ]; then
  if [ "$dry" = 1 ] && [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$py" - <<'EOF'
import sys, torch
print(f"python {sys.version.split()[0]} torch {torch.__version__} cuda build {torch.version.cuda} "
      f"NVML devices {torch.cuda._device_count_nvml() if torch.backends.cuda.is_built() else 0}")
EOF

say "2/4 environment"
if [ "$dry" = 0 ]; then  # over the machine's own torch: nothing it has is replaced
  site=${TMPDIR:-/tmp}/tether-device-site
  if ls "$wheels"/*.whl >/dev/null 2>&1; then
    "$py" -m pip install -q --no-index --no-deps --target "$site" "$wheels"/*.whl || exit 2
  fi
  "$py" -m pip install -q --no-index --no-deps --no-build-isolation --target "$site" . \
    || say "pip could not build the project (no setuptools?): it runs from PYTHONPATH=$PWD"
  export PYTHONPATH=$PWD:$site
fi
"$py" -c "import msgspec, zmq, torch, transformers; print('msgspec', msgspec.__version__, 'pyzmq', zmq.__version__, 'transformers', transformers.__version__)" || exit 2
export TETHER_PYTHON=$py

say "3/4 GPU tests (pytest -m 'gpu and not vllm')"
timeout 150 "$py" -m pytest -m "gpu and not vllm" -q -p no:cacheprovider \
  --junitxml="$work/gpu_tests.xml" tests/test_gpu.py
say "pytest exited with $?"

say "4/4 measurements"
[ "$dry" = 1 ] && extra=(--dry-run "${extra[@]}")
timeout 330 "$py" scripts/device_check.py --junit "$work/gpu_tests.xml" --out "$out" "${extra[@]}"
rc=$?
say "report: $out (device_check.py exited with $rc)"
exit $rc
