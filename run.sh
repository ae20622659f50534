#!/usr/bin/env bash
# The main job: build the tiny model, start the learner with 2 local actor processes and
# train the toy reversal task end to end on CPU. Extra arguments are config overrides,
# e.g.  ./run.sh learner.max_steps=100 max_staleness=0
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/env.sh
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
.venv/bin/python -m learner -c configs/toy_reverse.yaml "$@"
run_dir=$(.venv/bin/python -c "import sys; from configs import load_config; print(load_config('configs/toy_reverse.yaml', sys.argv[1:]).run_dir)" "$@")
echo "summary: $run_dir/summary.json"
cat "$run_dir/summary.json"
