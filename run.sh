#!/usr/bin/env bash
# The main job: build the tiny model, start the learner with 2 local actor processes and
# train the toy reversal task end to end on CPU. Extra arguments are config overrides,
# e.g.  ./run.sh learner.max_steps=100 max_staleness=0
# A preset file first runs that preset instead, after installing the extras it uses and
# fetching its model (scripts/preset_needs.py), e.g.  ./run.sh configs/smollm2_add_40min.yaml
set -euo pipefail
cd "$(dirname "$0")"
preset=configs/toy_reverse.yaml
case ${1:-} in *.yaml) preset=$1; shift ;; esac
bash scripts/env.sh
read -r extras model run_dir < <(.venv/bin/python scripts/preset_needs.py "$preset" "$@" || echo "! ! !")
[ "$extras" = "!" ] && exit 2
[ "$extras" = "-" ] || TETHER_EXTRAS=tools,lora,$extras bash scripts/env.sh
if [ "$model" != "-" ]; then
  echo "[run] converting $model once (python -m models.fetch $model)" >&2
  .venv/bin/python -m models.fetch "$model" >/dev/null
fi
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
.venv/bin/python -m learner -c "$preset" "$@"
echo "summary: $run_dir/summary.json"
cat "$run_dir/summary.json"
