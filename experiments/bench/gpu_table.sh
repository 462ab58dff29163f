#!/usr/bin/env bash
# The GPU table of issue 42, one command on one GPU (budget: 8 minutes on an H100):
#   1. nanoGPT's shakespeare-char GPT (gpt_nanogpt, 10.7 M parameters), K = 8 simulated workers
#      × 8 windows of 256, stacked (train.batched_workers=stacked), bf16 autocast, dropout 0.2
#      on the workers' own streams, against a minimal AdamW loop at the global batch (64
#      windows): time per token, simulated ÷ minimal (goal ≤ 1.3);
#   2. the same with DiLoCo (inner AdamW, outer Nesterov every H = 50 steps) and SparseLoCo
#      (H = 50) as the simulated side (timed blocks of 50 steps: one outer step each);
#   3. ResNet-20, K = 16 × 128 images: one by one ÷ stacked (goal ≥ 5) and stacked ÷ one
#      process at batch 2048 (goal ≤ 1.5) (gpu_batched.py);
#   4. the optimizer step alone at nanoGPT's size: K = 8 AdamW and MuonAdamW per worker ÷
#      stacked on the rows (stacked_optimizer.py).
# Every row alternates its sides in rounds (ROUNDS, default 3) and writes its JSON to OUT_DIR;
# the last lines print the table with the device's name.
# Usage: bash experiments/bench/gpu_table.sh OUT_DIR [--tiny] [PYTHON]
#   --tiny: the CPU smoke run (gpt_tiny, 2 workers × 2, one round of one-step blocks; tested).
# The corpus: DPRESEARCH_SHAKESPEARE (default ../shared/data/shakespeare/works).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: gpu_table.sh OUT_DIR [--tiny] [PYTHON]}
tiny=false
[ "${2:-}" = --tiny ] && tiny=true && shift
py=${2:-python3}
rounds=${ROUNDS:-3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if $tiny; then
  device=cpu
  lm=(--model gpt_tiny --workers 2 --batch 2 --rounds 1 --warmup 1)
  short=(--block 1 --blocks 1) period=2 long=(--block 2 --blocks 1)
  resnet=(--workers 2 --batch 2 --rounds 1 --block 1 --blocks 1 --warmup 1 --random-images)
  optim=(--model gpt_tiny --workers 2 --rounds 1 --steps 1 --warmup 1)
else
  device=cuda
  lm=(--model gpt_nanogpt --workers 8 --batch 8 --rounds "$rounds" --warmup 5 --autocast bf16)
  short=(--block 10 --blocks 3) period=50 long=(--block 50 --blocks 2)
  resnet=(--workers 16 --batch 128 --rounds "$rounds" --autocast bf16)
  optim=(--model gpt_nanogpt --workers 8 --rounds "$rounds")
fi
lm+=(--device "$device" --batched stacked --dropout 0.2 --sides simulated minimal_global)
"$py" experiments/bench/lm_throughput.py "${lm[@]}" "${short[@]}" --json "$out/lm_sync.json"
for algorithm in diloco sparseloco; do
  "$py" experiments/bench/lm_throughput.py "${lm[@]}" "${long[@]}" --algorithm "$algorithm" \
    --period "$period" --json "$out/lm_$algorithm.json"
done
"$py" experiments/bench/gpu_batched.py --device "$device" "${resnet[@]}" \
  --sides stacked loop single --json "$out/resnet.json"
"$py" experiments/bench/stacked_optimizer.py --device "$device" "${optim[@]}" \
  --json "$out/optimizer.json"
"$py" - "$out" <<'EOF'
import json, statistics, sys
out = sys.argv[1]


def read(name):
    return json.load(open(f"{out}/{name}.json"))


def cell(ratios):
    return f"{statistics.median(ratios):.2f} [{min(ratios):.2f}–{max(ratios):.2f}]"


device = read("lm_sync")["settings"]["device_name"]
print(f"\n| row ({device}) | ratio, median [range] | goal |\n|---|---|---|")
for name, what in (("lm_sync", "sync AdamW"), ("lm_diloco", "DiLoCo H = 50"),
                   ("lm_sparseloco", "SparseLoCo H = 50")):
    ratios = read(name)["summary"]["simulated_over_minimal_global"]
    print(f"| GPT K = 8, {what}: simulated ÷ minimal loop | {cell(ratios)} | ≤ 1.3 |")
resnet = read("resnet")["summary"]
print(f"| ResNet-20 K = 16: one by one ÷ stacked | {cell(resnet['loop_over_stacked'])} | ≥ 5 |")
print(f"| ResNet-20 K = 16: stacked ÷ one process | {cell(resnet['stacked_over_single'])} | ≤ 1.5 |")
for opt, ratios in read("optimizer")["summary"].items():
    print(f"| {opt} step K = 8: per worker ÷ stacked | {cell(ratios)} | > 1 |")
EOF
