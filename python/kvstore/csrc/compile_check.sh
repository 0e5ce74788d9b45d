#!/usr/bin/env bash
# Compiles every .cu source of the torch extension with nvcc for sm_80 and sm_90,
# compile-only (no GPU needed), and fails on any error or warning. nvcc comes from
# $NVCC, $CUDA_HOME, PATH or the nvidia-cuda-nvcc wheel (pip install
# nvidia-cuda-nvcc==13.2.86 nvidia-nvvm==13.2.86 nvidia-cuda-crt==13.2.86 for torch's
# CUDA 13.2; the three versions must match, or ptxas rejects the PTX).
set -euo pipefail
cd "$(dirname "$0")/../../.."
exec python3 -m kvstore.ops --compile-check "$@"
