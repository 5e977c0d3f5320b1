#!/usr/bin/env bash
# The vLLM GPU tier: real vLLM 0.34 engines on hbmd's CUDA backend, each beside the same engine without hbmd
# (bench/vllm_tier.py says what it checks). Needs an NVIDIA GPU, this checkout installed (pip install -e '.[cuda13]',
# or cuda12 on an older driver) and vLLM 0.34 importable: on a machine that reaches PyPI, `pip install vllm==0.34.0`;
# on one that does not, the wheel and its dependencies as files, given as WHEELS (the wheel, or its parts p00..p03
# made by `split -n 4`, and a deps/ folder), installed into /tmp/vllm-site with no network. The serve group's
# `vllm serve` imports more than the offline engine: seen missing on the GPU machine (2026-12-06), uvicorn, h11,
# model_hosting_container_standards, jmespath and supervisor; put their wheels in deps/ too.
# Usage: bash scripts/vllm-gpu-tier.sh [--wheels WHEELS] [bench/vllm_tier.py options]   (about 8 minutes on an H100)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--wheels" ]; then
    wheels=$2; shift 2
    if [ ! -d /tmp/vllm-site/vllm ]; then
        wheel="$wheels/vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl"
        [ -f "$wheel" ] || cat "$wheels"/p0? > "$wheel"
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vllm-site "$wheel" "$wheels"/deps/*.whl
        # vLLM's warm-up of one model family (MiniMax-M3) imports a 0.5 GB kernel DSL that this install leaves out:
        # that warm-up becomes a no-op, which no model of this tier reaches.
        printf 'def minimax_m3_msa_warmup(worker):\n    return None\n' \
            > /tmp/vllm-site/vllm/model_executor/warmup/minimax_m3_msa_warmup.py
    fi
    export PYTHONPATH=/tmp/vllm-site${PYTHONPATH:+:$PYTHONPATH}
    # vLLM pins a flashinfer release the registry lacks; its sampler is the only part of it vLLM would use here.
    export VLLM_USE_FLASHINFER_SAMPLER=0
fi
python3 -c "import vllm, torch; print('vLLM', vllm.__version__, 'on torch', torch.__version__, torch.cuda.get_device_name(0))"
exec python3 bench/vllm_tier.py "$@"
