#!/usr/bin/env bash
# The stacked-workers figures of the bench README (issue 31, item 1), back to back on one
# machine: ours vs the vmap ensemble, K = 4 simulated vs one process on the global batch
# (stacked and one by one), and the CPU-study GPT stacked and one by one. ~6 minutes on
# 2 CPUs; JSON under runs/bench/. Run it with nothing else busy; `uptime` marks each part.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
PY=${PYTHON:-.venv/bin/python}
bench=experiments/bench
uptime
$PY $bench/batched_vs_ensemble.py --models mlp logreg --workers 16 64 --rounds 5 \
    --modes stacked vmap false --clock cpu --json runs/bench/bve_stacked.json
uptime
for way in stacked false; do
    $PY $bench/spine_step_time.py --comparisons sim4 --models mlp resnet20 --rounds 5 \
        --block 10 --warmup 10 --batched-workers $way --json runs/bench/spine_$way.json
    uptime
done
for way in stacked false; do
    $PY $bench/lm_throughput.py --model gpt --workers 8 --batch 4 --rounds 4 --block 5 \
        --blocks 2 --warmup 2 --batched $way --sides simulated minimal_global \
        --json runs/bench/lm_$way.json
    uptime
done
