// The sign all-reduce on CUDA tensors (built when LIONBIT_WITH_CUDA is set).
//
// The same two phases as the CPU path (sign_allreduce.hpp), with the kernels
// of signbits/cuda on the GPU and the data on the device transport:
//   0. the caller's thread records an event on its current stream (when it
//      makes the job); the worker's own stream waits for it, so the
//      collective is ordered after everything the caller queued before it;
//   1. pack on the GPU (zero and NaN tallies on the device; one small copy to
//      the host feeds the header round, which runs over the CPU communicator
//      like the CPU path's and is checked the same way);
//   2. all-to-all of packed shards, count / vote of the own shard on the GPU,
//      all-gather of the shard results, unpack in place.
// Planes are dense on the device: a zero plane travels only when some rank
// holds a zero, a tie plane only when a tie is possible (even N, or zeros)
// and the tie rule is "zero" (the others answer ties with a sign bit).
// The data moves over the inner NCCL communicator, or, when the CUDA
// transport is Gloo (several ranks on one GPU), through host memory over the
// CPU communicator.
//
// Everything runs on the worker thread, on a stream of its own; the Work's
// future carries CUDA events, so wait() / value() order the caller's current
// stream after the result without blocking the host longer than the worker.
#pragma once

#include <ATen/core/Tensor.h>


#include "signbits/wire.h"
#include "backend/sign_allreduce.hpp"

namespace lionbit {

// The worker's job for one call on CUDA tensors (checked by the caller).
// Made on the caller's thread: it marks the caller's current stream there,
// and the job orders the worker's stream after that mark.

// The whole collective on a CUDA tensor, in place.
SignJob cuda_allreduce_job(at::Tensor tensor, bits::SignOp op, const TieSpec& tie);

// Direction bits packed on the GPU by the caller (the fused Lion kernel):
// `sign` / `zero` hold at least words_for(numel) words (bits past numel are
// ignored), `counts` two int64 {zeros, NaNs} on the same device. The result
// goes into `out` (contiguous, numel elements, on the same device).
SignJob cuda_allreduce_packed_job(
    at::Tensor sign,
    at::Tensor zero,
    at::Tensor counts,
    int64_t numel,
    at::Tensor out,
    bits::SignOp op,
    const TieSpec& tie);

} // namespace lionbit
