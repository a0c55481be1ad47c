#include "backend/cuda_stream.hpp"

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <map>
#include <memory>

namespace lionbit {
namespace {

// The worker's stream on a device.
c10::cuda::CUDAStream worker_stream(c10::DeviceIndex device) {
  thread_local std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  auto it = streams.find(device);
  if (it == streams.end()) {
    it = streams.emplace(device, c10::cuda::getStreamFromPool(false, device)).first;
  }
  return it->second;
}

} // namespace

SignJob cuda_ordered_job(std::vector<at::Tensor> uses, SignJob body) {
  const c10::Device device = uses.at(0).device();
  auto ready = std::make_shared<at::cuda::CUDAEvent>();
  ready->record(at::cuda::getCurrentCUDAStream(device.index()));
  return [uses = std::move(uses), body = std::move(body), ready, device](
             const SignComm& comm, uint64_t seq) {
    const c10::cuda::CUDAGuard guard(device);
    const c10::cuda::CUDAStream stream = worker_stream(device.index());
    // Current for the rest of this worker thread's life: the Work's future
    // records its completion events on the current stream.
    c10::cuda::setCurrentCUDAStream(stream);
    ready->block(stream);
    for (const at::Tensor& t : uses) {
      if (t.defined() && t.storage().data_ptr().get() != nullptr) {
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
      }
    }
    body(comm, seq);
  };
}

} // namespace lionbit
