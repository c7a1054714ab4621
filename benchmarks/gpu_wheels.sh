#!/bin/bash
# The pure-Python packages the GPU machines of this project lack (pydantic, fastapi,
# uvicorn, httpx, prometheus-client and what they need), downloaded here as wheels for
# their Python (3.12, x86_64) into .whl/ (git-ignored), which benchmarks/gpu_check.sh
# installs first. Carry .whl with the call that runs the check.
#
#     bash benchmarks/gpu_wheels.sh && du -sh .whl
set -eu
PY=${PY:-.venv/bin/python}
rm -rf .whl
"$PY" -m pip download -q --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --dest .whl pydantic fastapi uvicorn httpx prometheus-client pyyaml 2>&1 \
    | grep -v "^WARNING: Location" || true
ls .whl
