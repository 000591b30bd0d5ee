#!/usr/bin/env bash
# One GPU check of megatron_fcp (README, "GPU check"): numerics, speed and memory of the CUDA
# block kernels, the in-process multi-rank harness at cp = 4, the tiny GPT on CUDA, and Megatron-LM's
# own pretrain() loop (tests/megatron_driver: cp = 1 vs FCP cp = 2 via python -m megatron_fcp.run,
# two gloo ranks sharing the GPU). Installs nothing it cannot find offline: put a megatron-core
# wheel in ./.whl to get the GPT sections (pretrain needs >= 0.17, which ships megatron.training;
# otherwise each is skipped with the reason). Under 8 minutes on one H100/H200.
#   bash benchmarks/gpu_check.sh [OUT.json]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results/gpu_check.json}"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fcp_site .whl/*.whl
  export PYTHONPATH="/tmp/fcp_site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
python3 benchmarks/gpu_check.py --json "$out" "${@:2}"
