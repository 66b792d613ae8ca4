#!/usr/bin/env bash
# Downloads, into .whl/ (git-ignored), the wheels gpu_check.sh installs on an offline GPU machine
# whose Python lacks them. The lent H200 image has torch, numpy, pytest, hypothesis, pyyaml and
# rich but not pydantic (checked against its package list); msgspec (the step message) is fetched
# too, in case it lacks that as well, and isal (the checksums' CRC-32; zlib's is the fallback), and
# py-spy (gpu_check.sh's profile of a step). It runs Python 3.12 on x86-64.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
PYVER="${GPU_PYTHON_VERSION:-3.12}"
mkdir -p .whl
for pkg in "msgspec==0.23.0" "pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types==0.8.0" "typing-inspection==0.4.5" "isal==1.9.1" "py-spy==0.4.3"; do
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "$pkg"
done
ls -la .whl
