#!/usr/bin/env bash
# Wheels of exlcli's pure-Python dependencies that the lent GPU machine's image lacks (its torch, numpy,
# transformers and the rest are there), for Python 3.12 on x86-64, into ./.whl (keep it out of git:
# `echo /.whl/ >> .git/info/exclude`). Carry .whl to the device and install them first there:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
# then run scripts/gpu_check.sh. Each version is the one installed here, so both machines run the same.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
for name in platformdirs gguf prompt_toolkit wcwidth llguidance fastapi starlette pydantic pydantic_core \
            annotated_types typing_inspection uvicorn sse_starlette annotated_doc opentelemetry_api; do
  version=$(python3 -m pip show "$name" 2>/dev/null | awk '/^Version/ {print $2}')
  [ -n "$version" ] || { echo "device_wheels: $name is not installed here" >&2; exit 1; }
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$name==$version"
done
ls .whl
