#!/usr/bin/env bash
# The LM study's GPU rows (issue 30), one command on one GPU within BUDGET seconds:
#   1. tokens/s of the nanoGPT-size GPT, K = 8 simulated workers against a minimal AdamW loop at
#      the global batch (experiments/bench/lm_throughput.py, 2 rounds);
#   2. gpu.yaml's six points (3 cases × seeds 0, 1) at once, train.steps set from the step time
#      step 1 measured so that they end within the budget even if the six run one after another;
#      the YAML as it ran and the run folders (runs.tgz) land in OUT.
# Usage: bash experiments/lm_shakespeare/gpu.sh OUT [BUDGET_S=520] [DEVICE=cuda] [PYTHON=python3]
#   [STEPS]: STEPS given, step 1 is skipped and every run takes STEPS steps.
#   A CPU smoke run (tested): bash experiments/lm_shakespeare/gpu.sh /tmp/out 0 cpu .venv/bin/python
#   (BUDGET 0: gpt_tiny, 4 steps.) Then here: tar xzf OUT/runs.tgz -C runs/; cp OUT/gpu.yaml
#   experiments/lm_shakespeare/; python -m dpresearch.study report experiments/lm_shakespeare/gpu.yaml
#   --out runs/lm_shakespeare_gpu. The corpus: DPRESEARCH_SHAKESPEARE (default
#   ../shared/data/shakespeare/works, where gpu.yaml's data.root points).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(realpath -m "${1:?usage: gpu.sh OUT [BUDGET_S] [DEVICE] [PYTHON]}")
budget=${2:-520}
device=${3:-cuda}
py=${4:-python3}
fixed_steps=${5:-}
start=$(date +%s)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ "$budget" -le 0 ]; then  # the smoke run
  model=gpt_tiny; bench=(--rounds 1 --block 2 --blocks 1 --warmup 1)
else
  model=gpt_nanogpt; bench=(--rounds 2 --block 10 --blocks 2 --warmup 5)
fi
autocast=()
[ "$device" = cuda ] && autocast=(--autocast bf16)
[ -n "$fixed_steps" ] || "$py" experiments/bench/lm_throughput.py --device "$device" --model "$model" --workers 8 \
  --batch 8 "${bench[@]}" "${autocast[@]}" --sides simulated minimal_global \
  --json "$out/lm_throughput.json" || echo "gpu.sh: the throughput bench failed; 0.25 s a step assumed"
# Steps: what is left of the budget (less 60 s for starts and evaluations) over six runs of the
# measured simulated step, rounded down to the synchronization period (50), at least 100.
[ -n "$fixed_steps" ] || steps=$("$py" - "$out/lm_throughput.json" "$budget" "$(( $(date +%s) - start ))" <<'PY'
import json, statistics, sys
try:
    rounds = [r for r in json.load(open(sys.argv[1]))["measurements"] if "step_s" in r]
    step_s = statistics.median(r["step_s"]["simulated"] for r in rounds)
except (OSError, ValueError, KeyError):
    step_s = 0.25
left = float(sys.argv[2]) - float(sys.argv[3]) - 60
print(4 if float(sys.argv[2]) <= 0 else max(100, int(left / (6 * step_s)) // 50 * 50))
PY
)
steps=${fixed_steps:-$steps}
every=$(( steps / 5 > 0 ? steps / 5 : 1 ))
echo "gpu.sh: $steps steps a run (eval every $every), $(( $(date +%s) - start )) s spent"
sed -e "s/train.steps=[0-9]*/train.steps=$steps/" -e "s/train.eval_every=[0-9]*/train.eval_every=$every/" \
    experiments/lm_shakespeare/gpu.yaml > "$out/gpu.yaml"
study=$(mktemp -d)/gpu.yaml
sed -e "s/model=gpt_nanogpt/model=$model/" -e "s/train.device=cuda/train.device=$device/" \
    "$out/gpu.yaml" > "$study"
[ "$device" = cuda ] || sed -i "/train.autocast=bf16/d" "$study"
runs=$(dirname "$study")/runs
"$py" -m dpresearch.study run "$study" --out "$runs" --jobs 6 | tee "$out/study.log"
tar czf "$out/runs.tgz" -C "$runs" .
echo "gpu.sh: done in $(( $(date +%s) - start )) s"
