#!/usr/bin/env bash
# Counts the lines of lionbit that run only on a GPU: the custom CUDA kernels
# (signbits/cuda/*.cu, their launch helpers), the fused Lion CUDA kernels,
# the CUDA kernel set's launch code, the stream and event glue and the CUDA
# bindings. Every other line of the GPU path is the device-generic code that
# `make test` runs on CPU (the orchestration with the SIMD and the ATen
# kernel sets). signbits/cuda/element.cuh, zero_lists.cuh, trits.cuh and
# optimizer/lion_list.cuh are left out: their __host__ __device__ functions
# are compiled for the host and tested there (tests/cpp/test_cuda_host*.cpp).
#   tools/gpu_only_lines.sh [git-rev]   code lines (no blank or comment-only
#                                       lines) per file and in all
# Every file listed must exist in the working tree (a missing one is an
# error: rename or delete it here when the code moves); at an older
# git-rev, files that did not exist yet are skipped.
# tests/python/test_doc_figures.py checks the README's figure against this list.
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:-}
files=(
  signbits/cuda/count.cu signbits/cuda/pack.cu signbits/cuda/unpack.cu signbits/cuda/zero_lists.cu signbits/cuda/trits.cu
  signbits/cuda/launch.cu
  signbits/cuda/launch.cuh signbits/cuda/warp_planes.cuh signbits/cuda/kernels.h
  optimizer/lion_cuda.cu optimizer/lion_cuda_list.cu optimizer/lion_cuda.h optimizer/lion_warp.cuh
  backend/kernels_cuda.cpp backend/kernels_cuda.hpp backend/cuda_stream.cpp backend/cuda_stream.hpp
  bindings/kernel_bindings_cuda.cpp bindings/kernel_bindings_cuda.hpp
)
total=0
for f in "${files[@]}"; do
  if [ -n "$rev" ]; then
    text=$(git show "$rev:$f" 2>/dev/null) || continue
  else
    if [ ! -f "$f" ]; then
      echo "gpu_only_lines.sh: $f does not exist; update the list in $0" >&2
      exit 1
    fi
    text=$(cat "$f")
  fi
  # Code lines: not blank, not only a // comment.
  n=$(printf '%s\n' "$text" | grep -cvE '^[[:space:]]*(//.*)?$' || true)
  printf '%6d  %s\n' "$n" "$f"
  total=$((total + n))
done
printf '%6d  total (GPU-only code lines%s)\n' "$total" "${rev:+ at $rev}"
