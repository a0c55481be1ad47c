#include "bindings/kernel_bindings_cuda.hpp"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "signbits/cuda/kernels.h"
#include "backend/torch_adapter.hpp"
#include "bindings/kernel_bindings.hpp"
#include "optimizer/lion.h"
#include "optimizer/lion_cuda.h"

namespace lionbit {
namespace {

cuda::Counts* counts_of(at::Tensor& c) {
  return reinterpret_cast<cuda::Counts*>(c.data_ptr<int64_t>());
}

// A host table of list entries on `device`, for a kernel on the current
// stream: copied from pinned memory without waiting (the caching host
// allocator keeps the pinned block until the copy is done; the device
// table's memory is reused only after the stream has passed the kernel).
template <typename Seg>
at::Tensor device_table(const std::vector<Seg>& host, const c10::Device& device) {
  // The kernels' SegmentWalk indexes the table with 32 bits.
  TORCH_CHECK(
      host.size() <= 0xffffffffu, "lionbit: a list of ", host.size(), " tensors; at most 2^32 - 1");
  const int64_t bytes = static_cast<int64_t>(host.size() * sizeof(Seg));
  at::Tensor pinned = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(pinned.data_ptr<uint8_t>(), host.data(), static_cast<size_t>(bytes));
  return pinned.to(device, /*non_blocking=*/true);
}

// Every tensor of `ts` a float tensor on `device` of one dtype; returns it.
bits::DType list_dtype(
    const char* op,
    const std::vector<at::Tensor>& ts,
    const char* name,
    const c10::Device& device) {
  for (size_t i = 0; i < ts.size(); ++i) {
    const std::string what = std::string(name) + "[" + std::to_string(i) + "]";
    require(op, check_float(ts[i], what.c_str(), device));
    TORCH_CHECK_VALUE(
        ts[i].scalar_type() == ts[0].scalar_type(), "lionbit.", op, ": ", what, " is ",
        ts[i].scalar_type(), ", ", name, "[0] ", ts[0].scalar_type(),
        " (one dtype a list: group the tensors)");
  }
  return *float_dtype(ts[0].scalar_type());
}

// A destination `out` (named `name`) for the new momentum of `m`: a contiguous
// tensor of m's dtype and element count on `device`, overlapping neither m
// (the kernels read m while they write out) nor the gradient g; or an error
// naming `op`.
void check_momentum_out(
    const char* op,
    const at::Tensor& out,
    const std::string& name,
    const at::Tensor& m,
    const std::string& m_name,
    const at::Tensor& g,
    const c10::Device& device) {
  require(op, check_buffer(out, name.c_str(), m.scalar_type(), device, m.numel()));
  TORCH_CHECK_VALUE(
      out.numel() == m.numel(), "lionbit.", op, ": ", name, " has ", out.numel(), " elements, ",
      m_name, " ", m.numel());
  TORCH_CHECK_VALUE(
      at::get_overlap_status(m, out) == at::MemOverlapStatus::No, "lionbit.", op, ": ", name,
      " overlaps ", m_name, " (the new momentum goes to a separate buffer; for an in-place update",
      " leave it out)");
  TORCH_CHECK_VALUE(
      at::get_overlap_status(g, out) == at::MemOverlapStatus::No, "lionbit.", op, ": ", name,
      " overlaps the gradient");
}

// The CUDA device of an apply list `xs` (not empty), or an error naming `op`.
c10::Device apply_list_device(const char* op, const std::vector<at::Tensor>& xs) {
  TORCH_CHECK_VALUE(
      xs[0].defined() && xs[0].is_cuda(), "lionbit.", op,
      ": argument 'xs' must hold CUDA tensors, got ", describe(xs[0]));
  return xs[0].device();
}

// `launch(table, units, stream)` over the apply list `segs` on `device`, its
// table copied there; nothing where the list has no element.
template <typename Launch>
void run_apply_list(
    std::vector<optim::cuda::ApplySeg>& segs,
    const c10::Device& device,
    Launch launch) {
  c10::cuda::CUDAGuard guard(device);
  const uint64_t units = optim::cuda::apply_units(segs.data(), segs.size());
  if (units == 0) {
    return;
  }
  const at::Tensor table = device_table(segs, device);
  launch(
      reinterpret_cast<const optim::cuda::ApplySeg*>(table.data_ptr<uint8_t>()), units,
      c10::cuda::getCurrentCUDAStream(device.index()).stream());
}

} // namespace

void lion_direction_list_device(
    const std::vector<at::Tensor>& gs,
    const std::vector<at::Tensor>& ms,
    double b1,
    double omb1,
    double b2,
    double omb2,
    const std::optional<at::Tensor>& sign,
    const std::optional<at::Tensor>& zero,
    const std::optional<at::Tensor>& counts,
    const std::vector<int64_t>& bit_offsets,
    bool update_momentum,
    const std::optional<std::vector<int64_t>>& starts,
    const std::optional<std::vector<int64_t>>& lengths,
    const std::optional<std::vector<at::Tensor>>& m_outs) {
  const char* op = "lion_direction_list_device";
  TORCH_CHECK_VALUE(
      gs.size() == ms.size() && gs.size() == bit_offsets.size(), "lionbit.", op, ": ", gs.size(),
      " gradients, ", ms.size(), " momenta and ", bit_offsets.size(), " bit offsets");
  if (m_outs.has_value()) {
    TORCH_CHECK_VALUE(
        m_outs->size() == ms.size(), "lionbit.", op, ": ", m_outs->size(), " m_outs for ",
        ms.size(), " momenta (one a pair)");
    TORCH_CHECK_VALUE(
        update_momentum, "lionbit.", op,
        ": argument 'm_outs' takes the new momentum, so update_momentum must be True");
  }
  const std::vector<Span> spans = list_spans(op, gs, starts, lengths);
  if (gs.empty()) {
    return;
  }
  TORCH_CHECK_VALUE(
      gs[0].defined() && gs[0].is_cuda(), "lionbit.", op,
      ": argument 'gs' must hold CUDA tensors, got ", describe(gs[0]));
  const c10::Device device = gs[0].device();
  const bits::DType gd = list_dtype(op, gs, "gs", device);
  const bits::DType md = list_dtype(op, ms, "ms", device);
  TORCH_CHECK_VALUE(
      optim::lion_direction_dtypes_supported(gd, md), "lionbit.", op,
      ": momentum must be float32 or bfloat16, got ", ms[0].scalar_type());
  const bool planes = sign.has_value();
  TORCH_CHECK_VALUE(
      planes == zero.has_value() && planes == counts.has_value(), "lionbit.", op,
      ": sign, zero and counts are given together or not at all");
  TORCH_CHECK_VALUE(
      planes || update_momentum, "lionbit.", op,
      ": without planes only the momentum update is left to do");
  std::vector<optim::cuda::DirectionSeg> segs(gs.size());
  for (size_t i = 0; i < gs.size(); ++i) {
    TORCH_CHECK_VALUE(
        gs[i].numel() == ms[i].numel(), "lionbit.", op, ": gs[", i, "] has ", gs[i].numel(),
        " elements, ms[", i, "] ", ms[i].numel());
    TORCH_CHECK_VALUE(bit_offsets[i] >= 0, "lionbit.", op, ": negative bit_offsets[", i, "]");
    const auto n = static_cast<int64_t>(spans[i].count);
    if (planes) {
      require(op, check_planes(*sign, "sign", device, bit_offsets[i] + n));
      require(op, check_planes(*zero, "zero", device, bit_offsets[i] + n));
    }
    if (m_outs.has_value()) {
      const std::string idx = "[" + std::to_string(i) + "]";
      check_momentum_out(op, (*m_outs)[i], "m_outs" + idx, ms[i], "ms" + idx, gs[i], device);
    }
    const size_t start = spans[i].start;
    const size_t mbytes = start * ms[i].element_size();
    // the span's new momentum: the same elements of m_outs[i], of ms[i] in place, or none
    void* const m_out = !update_momentum ? nullptr
        : m_outs.has_value()             ? static_cast<char*>((*m_outs)[i].data_ptr()) + mbytes
                                         : static_cast<char*>(ms[i].data_ptr()) + mbytes;
    segs[i] = optim::cuda::DirectionSeg{
        static_cast<const char*>(gs[i].data_ptr()) + start * gs[i].element_size(),
        static_cast<const char*>(ms[i].data_ptr()) + mbytes,
        m_out,
        static_cast<uint64_t>(n),
        static_cast<uint64_t>(bit_offsets[i]),
        0};
  }
  if (planes) {
    require(op, check_buffer(*counts, "counts", at::kLong, device, 2));
  }
  c10::cuda::CUDAGuard guard(device);
  const uint64_t units = optim::cuda::direction_units(segs.data(), segs.size());
  if (units == 0) {
    return;
  }
  const at::Tensor table = device_table(segs, device);
  optim::cuda::lion_direction_list(
      gd, md, reinterpret_cast<const optim::cuda::DirectionSeg*>(table.data_ptr<uint8_t>()),
      segs.size(), units, static_cast<float>(b1), static_cast<float>(omb1), static_cast<float>(b2),
      static_cast<float>(omb2), planes ? words_of(*sign) : nullptr,
      planes ? words_of(*zero) : nullptr,
      planes ? reinterpret_cast<cuda::Counts*>(counts->data_ptr<int64_t>()) : nullptr,
      c10::cuda::getCurrentCUDAStream(device.index()).stream());
}

void lion_apply_list_device(
    const std::vector<at::Tensor>& xs,
    const std::vector<at::Tensor>& deltas,
    double lr,
    double decay) {
  const char* op = "lion_apply_list_device";
  TORCH_CHECK_VALUE(
      xs.size() == deltas.size(), "lionbit.", op, ": ", xs.size(), " parameters and ",
      deltas.size(), " deltas");
  if (xs.empty()) {
    return;
  }
  const c10::Device device = apply_list_device(op, xs);
  const bits::DType xd = list_dtype(op, xs, "xs", device);
  const bits::DType dd = list_dtype(op, deltas, "deltas", device);
  std::vector<optim::cuda::ApplySeg> segs(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    TORCH_CHECK_VALUE(
        xs[i].numel() == deltas[i].numel(), "lionbit.", op, ": xs[", i, "] has ", xs[i].numel(),
        " elements, deltas[", i, "] ", deltas[i].numel());
    segs[i] = optim::cuda::ApplySeg{
        xs[i].data_ptr(), deltas[i].data_ptr(), static_cast<uint64_t>(xs[i].numel()), 0, 0};
  }
  run_apply_list(
      segs, device, [&](const optim::cuda::ApplySeg* table, uint64_t units, cudaStream_t stream) {
        optim::cuda::lion_apply_list(
            xd, dd, table, segs.size(), units, static_cast<float>(lr), static_cast<float>(decay),
            stream);
      });
}

void lion_apply_planes_list_device(
    const std::vector<at::Tensor>& xs,
    const at::Tensor& sign,
    const at::Tensor& zero,
    const std::vector<int64_t>& bit_offsets,
    double lr,
    double decay,
    const std::optional<std::vector<int64_t>>& starts,
    const std::optional<std::vector<int64_t>>& lengths) {
  const char* op = "lion_apply_planes_list_device";
  TORCH_CHECK_VALUE(
      xs.size() == bit_offsets.size(), "lionbit.", op, ": ", xs.size(), " parameters and ",
      bit_offsets.size(), " bit offsets");
  const std::vector<Span> spans = list_spans(op, xs, starts, lengths, "xs");
  if (xs.empty()) {
    return;
  }
  const c10::Device device = apply_list_device(op, xs);
  const bits::DType xd = list_dtype(op, xs, "xs", device);
  std::vector<optim::cuda::ApplySeg> segs(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    TORCH_CHECK_VALUE(bit_offsets[i] >= 0, "lionbit.", op, ": negative bit_offsets[", i, "]");
    const auto n = static_cast<int64_t>(spans[i].count);
    require(op, check_planes(sign, "sign", device, bit_offsets[i] + n));
    require(op, check_planes(zero, "zero", device, bit_offsets[i] + n));
    segs[i] = optim::cuda::ApplySeg{
        static_cast<char*>(xs[i].data_ptr()) + spans[i].start * xs[i].element_size(), nullptr,
        static_cast<uint64_t>(n), static_cast<uint64_t>(bit_offsets[i]), 0};
  }
  run_apply_list(
      segs, device, [&](const optim::cuda::ApplySeg* table, uint64_t units, cudaStream_t stream) {
        optim::cuda::lion_apply_planes_list(
            xd, table, segs.size(), units, words_of(sign), words_of(zero), static_cast<float>(lr),
            static_cast<float>(decay), stream);
      });
}

void lion_direction_into_device(
    const at::Tensor& g,
    at::Tensor& m,
    double b1,
    double omb1,
    double b2,
    double omb2,
    at::Tensor& sign,
    at::Tensor& zero,
    at::Tensor& counts,
    int64_t bit_offset,
    bool update_momentum,
    const std::optional<at::Tensor>& m_out) {
  const char* op = "lion_direction_into_device";
  TORCH_CHECK_VALUE(
      g.defined() && g.is_cuda(), "lionbit.", op, ": argument 'g' must be a CUDA tensor, got ",
      describe(g));
  require(op, check_float(g, "g", g.device()));
  require(op, check_float(m, "m", g.device()));
  TORCH_CHECK_VALUE(
      optim::lion_direction_dtypes_supported(
          *float_dtype(g.scalar_type()), *float_dtype(m.scalar_type())),
      "lionbit.", op, ": momentum must be float32 or bfloat16, got ", m.scalar_type());
  TORCH_CHECK_VALUE(
      g.numel() == m.numel(), "lionbit.", op, ": g has ", g.numel(), " elements, m ", m.numel());
  TORCH_CHECK_VALUE(bit_offset >= 0, "lionbit.", op, ": negative bit_offset");
  require(op, check_planes(sign, "sign", g.device(), bit_offset + g.numel()));
  require(op, check_planes(zero, "zero", g.device(), bit_offset + g.numel()));
  require(op, check_buffer(counts, "counts", at::kLong, g.device(), 2));
  if (m_out.has_value()) {
    TORCH_CHECK_VALUE(
        update_momentum, "lionbit.", op,
        ": argument 'm_out' takes the new momentum, so update_momentum must be True");
    check_momentum_out(op, *m_out, "m_out", m, "m", g, g.device());
  }
  // the new momentum: into m_out, into m in place, or nowhere (m only read)
  void* const m_new = !update_momentum ? nullptr
      : m_out.has_value()              ? m_out->data_ptr()
                                       : m.data_ptr();
  c10::cuda::CUDAGuard guard(g.device());
  optim::cuda::lion_direction(
      *float_dtype(g.scalar_type()), g.data_ptr(), *float_dtype(m.scalar_type()), m.data_ptr(),
      static_cast<size_t>(g.numel()), static_cast<float>(b1), static_cast<float>(omb1),
      static_cast<float>(b2), static_cast<float>(omb2), words_of(sign), words_of(zero),
      static_cast<size_t>(bit_offset), counts_of(counts),
      c10::cuda::getCurrentCUDAStream(g.device().index()).stream(), m_new);
}

void lion_apply_device(at::Tensor& x, const at::Tensor& delta, double lr, double decay) {
  const char* op = "lion_apply_device";
  TORCH_CHECK_VALUE(
      x.defined() && x.is_cuda(), "lionbit.", op, ": argument 'x' must be a CUDA tensor, got ",
      describe(x));
  require(op, check_float(x, "x", x.device()));
  require(op, check_float(delta, "delta", x.device()));
  TORCH_CHECK_VALUE(
      x.numel() == delta.numel(), "lionbit.", op, ": x has ", x.numel(), " elements, delta ",
      delta.numel());
  c10::cuda::CUDAGuard guard(x.device());
  optim::cuda::lion_apply_dense(
      *float_dtype(x.scalar_type()), x.data_ptr(), *float_dtype(delta.scalar_type()),
      delta.data_ptr(), static_cast<size_t>(x.numel()), static_cast<float>(lr),
      static_cast<float>(decay), c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
}

} // namespace lionbit
