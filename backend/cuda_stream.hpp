// The stream and event glue of the sign collectives on CUDA tensors (built
// when LIONBIT_WITH_CUDA is set). The collectives themselves are the same
// code as on CPU (sign_allreduce.cpp, sign_reduce_scatter.cpp) with the
// CUDA kernel set; this only orders them on the GPU:
//   - the caller's thread records an event on its current stream when the
//     job is made, so the collective sees everything the caller queued
//     before the call;
//   - the worker runs the job with a stream of its own current (one per
//     device for the worker thread's life: its calls stay in order), made to
//     wait for that event on the GPU: the host never waits for the caller's
//     stream;
//   - the tensors the job uses are marked as in use on the worker's stream
//     for the caching allocator;
//   - the Work's future records its completion on the worker's stream, so
//     wait() / value() order the caller's stream after the result.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "backend/sign_allreduce.hpp"

namespace lionbit {

// `body` as a job ordered after the caller's current stream on the device of
// `uses[0]`; every tensor of `uses` is marked as used by the worker's stream.
SignJob cuda_ordered_job(std::vector<at::Tensor> uses, SignJob body);

} // namespace lionbit
