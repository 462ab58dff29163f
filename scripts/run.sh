#!/usr/bin/env bash
# The main job: set up .venv and train ResNet-20 on CIFAR-10 with 4 synchronous workers,
# downloading the data set into ./data (or $DPRESEARCH_DATA) when it is not there. Extra
# arguments are Hydra overrides, e.g. `bash scripts/run.sh data.root=/path/to/cifar
# data.download=false`. Without a network (and without the data) it stops with one error
# naming the three ways out: data you already have, the shipped subset, the synthetic default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
py=.venv/bin/python

# The data first, unless the overrides choose it: an offline machine gets one error naming
# what it can run instead (the trainer itself would only say that the download failed).
chosen=""
for arg in "$@"; do
  case "$arg" in
    data=*|data.root=*|data.download=*|experiment=*|+data*|++data*) chosen=1 ;;
  esac
done
root="${DPRESEARCH_DATA:-./data}"
if [ -z "$chosen" ] && [ ! -d "$root/cifar-10-batches-py" ]; then
  echo "run.sh: downloading CIFAR-10 (170 MB) into $root"
  if ! "$py" - "$root" <<'PY'
import sys
from dpresearch.data.download import CIFAR10_ARCHIVE, ensure_extracted
try:
    ensure_extracted(sys.argv[1], CIFAR10_ARCHIVE, deadline_s=1800)
except (OSError, ValueError) as exc:  # ConnectionError, the deadline, a bad archive
    print(f"error: {exc}".splitlines()[0], file=sys.stderr)
    sys.exit(1)
PY
  then
    cat >&2 <<MSG
error: CIFAR-10 is not under $root and could not be downloaded (offline?). Three ways out:
  1. data you already have (the folder holding cifar-10-batches-py):
       bash scripts/run.sh data.root=/path/to/that/folder data.download=false
  2. the CIFAR-10 subset shipped in ../shared (5085 images; not comparable to full CIFAR-10):
       $py -m dpresearch.train experiment=resnet20_cifar10_subset
  3. no data set at all, the synthetic default (an MLP, seconds):
       $py -m dpresearch.train
MSG
    exit 1
  fi
fi
exec "$py" -m dpresearch.train experiment=resnet20_cifar10 data.download=true "$@"
