#!/usr/bin/env bash
# The language-model GPU rows (issue 29), one command on one GPU (about 5 minutes on an H200):
#   1. tokens/s of nanoGPT's shakespeare-char GPT (10.7 M parameters, bf16 autocast): K = 8
#      simulated workers × 8 windows of 256 tokens against a minimal AdamW loop at the global
#      batch (64 windows, nanoGPT's), and our one-worker loop against the minimal loop at 8;
#   2. one DiLoCo run at that size (8 workers, H = 50 inner AdamW steps, outer Nesterov lr 0.7
#      momentum 0.9) beside synchronous AdamW over the same tokens, each with its validation
#      curve and a text sample.
# Usage: bash experiments/bench/gpu_lm.sh OUT_DIR [STEPS] [DEVICE] [MODEL] [PYTHON]
#   defaults: STEPS=600, DEVICE=cuda, MODEL=gpt_nanogpt, PYTHON=python3. A CPU smoke run (tested):
#   bash experiments/bench/gpu_lm.sh /tmp/out 4 cpu gpt_tiny .venv/bin/python
# The corpus: DPRESEARCH_SHAKESPEARE (default ../shared/data/shakespeare/works).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: gpu_lm.sh OUT_DIR [STEPS] [DEVICE] [MODEL] [PYTHON]}
steps=${2:-600}
device=${3:-cuda}
model=${4:-gpt_nanogpt}
py=${5:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
corpus=${DPRESEARCH_SHAKESPEARE:-../shared/data/shakespeare/works}
autocast=()
[ "$device" = cuda ] && autocast=(--autocast bf16)
if [ "$steps" -le 10 ]; then rounds=(--rounds 1 --block 2 --blocks 1 --warmup 1); else rounds=(--rounds 3); fi
"$py" experiments/bench/lm_throughput.py --device "$device" --model "$model" --workers 8 \
  --batch 8 "${rounds[@]}" "${autocast[@]}" --json "$out/lm_throughput.json"
runs=$(mktemp -d)
# train.grad_clip=null: as the shipped figures ran (before the LM data sets clipped at 1.0)
common=(data=shakespeare "data.root=$corpus" train.grad_clip=null "model=$model" workers=8 train.batch_size=8
        "train.steps=$steps" "train.eval_every=$(( steps / 4 > 0 ? steps / 4 : 1 ))"
        train.log_every=10 train.save_model=false "train.device=$device"
        data.sample_tokens=300)
[ "$device" = cuda ] && common+=(train.autocast=bf16)
period=$(( steps / 12 > 0 ? (steps < 50 ? 2 : 50) : 1 ))
for case in diloco sync; do
  extra=()
  [ "$case" = diloco ] && extra=(algorithm=local_sgd "algorithm.period=$period" outer=nesterov)
  "$py" -m dpresearch.train "${common[@]}" "${extra[@]}" "hydra.run.dir=$runs/$case"
  for f in metrics.jsonl summary.json sample.txt; do cp "$runs/$case/$f" "$out/${case}_$f"; done
done
"$py" - "$out" <<'EOF'
import json, sys
out = sys.argv[1]
for case in ("sync", "diloco"):
    s = json.load(open(f"{out}/{case}_summary.json"))
    print(f"{case}: val/bpc {s['val/bpc']:.4f} test/bpc {s['test/bpc']:.4f} after {s['tokens']:.0f}"
          f" tokens, {s['comm/bytes'] / 1e6:.1f} MB sent per worker, {s['tokens_per_s']:.0f} tokens/s")
EOF
