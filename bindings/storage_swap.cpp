#include "bindings/storage_swap.hpp"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

namespace lionbit {

void swap_storages(const std::vector<at::Tensor>& as, const std::vector<at::Tensor>& bs) {
  TORCH_CHECK_VALUE(
      as.size() == bs.size(), "lionbit.swap_storages: ", as.size(), " tensors and ", bs.size(),
      " buffers");
  for (size_t i = 0; i < as.size(); ++i) {
    const at::Tensor& a = as[i];
    const at::Tensor& b = bs[i];
    TORCH_CHECK_VALUE(
        a.defined() && b.defined() && a.scalar_type() == b.scalar_type() &&
            a.device() == b.device() && a.sizes() == b.sizes(),
        "lionbit.swap_storages: pair ", i, " differs in dtype, device or sizes");
    TORCH_CHECK_VALUE(
        a.is_contiguous() && b.is_contiguous(), "lionbit.swap_storages: pair ", i,
        " is not contiguous");
    TORCH_CHECK_VALUE(
        a.numel() == 0 || at::get_overlap_status(a, b) == at::MemOverlapStatus::No,
        "lionbit.swap_storages: the tensors of pair ", i, " share memory");
  }
  for (size_t i = 0; i < as.size(); ++i) {
    const at::Tensor old = as[i].detach(); // (a second handle on a's storage)
    as[i].set_(bs[i]);
    bs[i].set_(old);
  }
}

} // namespace lionbit
