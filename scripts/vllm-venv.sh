#!/usr/bin/env bash
# A venv with vLLM 0.34.0 beside hbmd, for the vllm test tier (scripts/vllm-tier.sh, .ci/run).
# vLLM's wheel pins a flashinfer release this registry lacks and a CUDA torch of several GB; neither is
# needed to drive its extensible KV cache on hbmd's host backend, so vLLM goes in without its
# dependencies and its other requirements follow against the CPU torch 2.13.0.
# Usage: bash scripts/vllm-venv.sh [VENV]   (about 3 minutes with a warm pip cache, 2.8 GB)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q --no-deps vllm==0.34.0
"$venv/bin/python" - > "$venv/vllm-requirements.txt" <<'PY'
import importlib.metadata
import re

for requirement in importlib.metadata.requires("vllm"):
    name = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower()
    if "extra ==" not in requirement and name not in {"torch", "torchvision", "torchaudio", "flashinfer-python"}:
        print(requirement)
PY
echo torch==2.13.0 > "$venv/torch-constraint.txt"
"$venv/bin/pip" install -q -r "$venv/vllm-requirements.txt" -c "$venv/torch-constraint.txt"
"$venv/bin/pip" install -q -e '.[test]' -c "$venv/torch-constraint.txt"
