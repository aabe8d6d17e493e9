#!/usr/bin/env bash
# The wheels the GPU machine lacks for the server, its client and the GGUF reader (its image has anyio, h11,
# uvloop, httpx, prometheus-client, ...: the device library's KINDS.md), for its Python 3.12, into .whl/
# (git-ignored; a device call that needs them carries .whl and installs them with
# `python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl`
# then runs with PYTHONPATH=/tmp/site:src). The versions are those this checkout's .venv resolved (the newest for
# one it lacks).
#   bash scripts/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS="fastapi starlette uvicorn pydantic pydantic_core annotated-types typing-inspection httptools openai distro
      jiter sniffio gguf annotated-doc opentelemetry-api importlib_metadata zipp"
mkdir -p .whl
for name in $PKGS; do
  spec=$(.venv/bin/python -c "import importlib.metadata as m; print('$name==' + m.version('$name'))" 2>/dev/null ||
         echo "$name")  # (the newest where the .venv lacks it)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$spec"
done
ls .whl
