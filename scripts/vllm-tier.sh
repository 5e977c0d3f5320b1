#!/usr/bin/env bash
# The vllm test tier: a venv with vLLM 0.34.0 beside hbmd (scripts/vllm-venv.sh), then `pytest -m vllm`.
# Usage: bash scripts/vllm-tier.sh [VENV]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm}
bash scripts/vllm-venv.sh "$venv"
"$venv/bin/python" -m pytest -q -m vllm -rs
