#!/usr/bin/env bash
# The megatron-core version matrix: one reused virtual environment per release (0.14-0.16 on
# Python 3.11, 0.17-0.19 on Python 3.12), the Megatron-facing tests and the end-to-end
# equivalence in each, one JSON table in tests/compat/results/matrix.json.
#   tests/compat/run_matrix.sh [--versions 0.14.0,0.19.2] [--groups e2e] [--home DIR]
# Environments live in $FCP_MATRIX_HOME (default ~/.cache/megatron_fcp_matrix), never in the repo.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 PIP_DISABLE_PIP_VERSION_CHECK=1
exec python3 tests/compat/matrix.py "$@"
