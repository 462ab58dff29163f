#!/usr/bin/env bash
# The main job: set up .venv and train ResNet-20 on CIFAR-10 with 4 synchronous workers,
# downloading the data set into ./data when it is not there. Extra arguments are Hydra
# overrides, e.g. `bash scripts/run.sh data.root=/path/to/cifar data.download=false`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m dpresearch.train experiment=resnet20_cifar10 data.download=true "$@"
