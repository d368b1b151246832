#!/usr/bin/env bash
# The wheels the GPU machine's image lacks, downloaded into .whl (git-ignored) for a device call to carry
# (`carry: [".whl"]`); bench/gpu_run.sh installs them into /tmp/site there. The image: Python 3.12,
# torch 2.11, Triton 3.6, transformers; no pydantic, no llguidance, no cudnn frontend.
#
#   bash bench/device_wheels.sh        # reuses what .whl already holds
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
mkdir -p .whl
get() {  # get PLATFORM REQUIREMENT
  local name=${2%%[=<>]*}
  ls .whl/"${name//-/_}"-*.whl >/dev/null 2>&1 && return 0
  "$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform "$1" \
    -d .whl "$2"
}
get manylinux2014_x86_64 pydantic==2.14.4
get manylinux2014_x86_64 pydantic-core==2.50.5
get manylinux2014_x86_64 annotated-types==0.8.0
get manylinux2014_x86_64 typing-inspection==0.4.5
get manylinux2014_x86_64 pydantic-settings==2.16.3
get manylinux2014_x86_64 python-dotenv==1.2.4
get manylinux_2_31_x86_64 llguidance==1.9.1          # guided decoding (a dependency; its GPU test needs it)
get manylinux_2_28_x86_64 nvidia-cudnn-frontend==1.16.0  # FP8 dense prefill attention (the gpu extra)
ls .whl
