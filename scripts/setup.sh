#!/usr/bin/env bash
# Create (or reuse) .venv and install dpresearch into it.
#
#   bash scripts/setup.sh            # runtime dependencies
#   bash scripts/setup.sh dev        # + test/lint tools
#
# Torch policy: a torch the user already has (in the active environment or the system
# site-packages, which the venv can see) is kept as it is. Otherwise a machine with an NVIDIA
# driver gets PyPI's default (CUDA) build, and a machine without one gets the CPU build, so a
# laptop never downloads gigabytes of CUDA libraries.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
TORCH_CPU_VERSION="${TORCH_CPU_VERSION:-2.13.0}"
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
PYTHON="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
  # --system-site-packages: a CUDA torch installed system-wide stays visible and is reused.
  "$PYTHON" -m venv --system-site-packages .venv
fi
py=.venv/bin/python
pip() { "$py" -m pip --disable-pip-version-check -q "$@"; }

if ! "$py" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found, installing the CUDA build of torch"
    pip install torch
  else
    echo "setup: no GPU found, installing the CPU build of torch ${TORCH_CPU_VERSION}"
    pip install "torch==${TORCH_CPU_VERSION}" --extra-index-url "$TORCH_CPU_INDEX" --retries 1 --timeout 30
  fi
fi

spec="."
[ -n "$extras" ] && spec=".[${extras}]"
# Installed already from this pyproject.toml (with these extras, or any when none are asked
# for): nothing to do, so a second run needs no network (pip would fetch its build tools).
stamp=".venv/.dpresearch-setup"
hash="$("$py" -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())')"
want="$hash $extras"
have="$(cat "$stamp" 2>/dev/null || true)"
if { [ "$have" = "$want" ] || { [ -z "$extras" ] && [ "${have%% *}" = "$hash" ]; }; } \
    && "$py" -c "import dpresearch" >/dev/null 2>&1; then
  echo "setup: ready, already installed ($("$py" -c 'import torch; print("torch", torch.__version__)'))"
  exit 0
fi
# torch is already satisfied above, so this never replaces the user's build.
pip install -e "$spec"
echo "$want" > "$stamp"
echo "setup: ready ($("$py" -c 'import torch; print("torch", torch.__version__)'))"
