#!/usr/bin/env bash
# Ray and its missing dependencies for the GPU check's machine (Python 3.12, no Ray, no network), packed to
# travel with the working tree (at most 64 MiB per call): bench/gpu_wheels/part-*.tar.xz, git-ignored.
# Downloads into /tmp, unpacks the wheels, drops what a one-node training run never loads (Java jars,
# RLlib, Serve, LLM, the dashboard's web client, tests, C++ headers), strips the Ray binaries' symbols and
# recompresses each half with xz -9. bench/gpu_check.py unpacks the parts when `import ray` fails.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=${WORK:-/tmp/raytrain-gpu-wheels}
python=${PYTHON:-python3}
rm -rf "$work" && mkdir -p "$work/download" "$work/site"
"$python" -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$work/download" "ray[train]==2.60.0" pyarrow pillow
cd "$work/site"
for wheel in "$work"/download/*.whl; do unzip -q -o "$wheel"; done
rm -rf ray/jars ray/rllib ray/serve ray/llm ray/dashboard/client pyarrow/include
find . -type d \( -name tests -o -name __pycache__ \) -prune -exec rm -rf {} +
strip --strip-unneeded ray/_raylet.so ray/core/src/ray/gcs/gcs_server ray/core/src/ray/raylet/raylet
mkdir -p "$here/gpu_wheels"
tar -cf - ray | xz -9 -T2 > "$here/gpu_wheels/part-ray.tar.xz"
tar -cf - --exclude=./ray . | xz -9 -T2 > "$here/gpu_wheels/part-deps.tar.xz"
du -b "$here"/gpu_wheels/part-*.tar.xz
