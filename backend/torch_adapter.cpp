#include "backend/torch_adapter.hpp"

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>

#include <cstdint>

namespace lionbit {

std::optional<bits::DType> bits_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return bits::DType::kFloat32;
    case at::kHalf:
      return bits::DType::kFloat16;
    case at::kBFloat16:
      return bits::DType::kBFloat16;
    case at::kDouble:
      return bits::DType::kFloat64;
    case at::kChar:
      return bits::DType::kInt8;
    default:
      return std::nullopt;
  }
}

at::ScalarType torch_dtype(bits::DType t) {
  switch (t) {
    case bits::DType::kFloat32:
      return at::kFloat;
    case bits::DType::kFloat16:
      return at::kHalf;
    case bits::DType::kBFloat16:
      return at::kBFloat16;
    case bits::DType::kFloat64:
      return at::kDouble;
    case bits::DType::kInt8:
      return at::kChar;
  }
  return at::kByte;
}

std::optional<bits::DType> float_dtype(at::ScalarType t) {
  const auto d = bits_dtype(t);
  if (d && bits::dtype_is_floating(*d) && *d != bits::DType::kFloat64) {
    return d;
  }
  return std::nullopt;
}

at::Tensor byte_buffer(size_t n) {
  return at::empty({static_cast<int64_t>(n)}, at::TensorOptions().dtype(at::kByte));
}

bool in_own_memory(const at::Tensor& t) {
  return !t.key_set().has(c10::DispatchKey::Python);
}

std::string describe(const at::Tensor& t) {
  if (!t.defined()) {
    return "undefined";
  }
  return c10::str(
      t.scalar_type(), " on ", t.device(), t.is_contiguous() ? "" : " (not contiguous)",
      in_own_memory(t) ? "" : " (a tensor subclass with no memory of its own)");
}

std::string check_buffer(
    const at::Tensor& t,
    const char* name,
    at::ScalarType dtype,
    const c10::Device& device,
    int64_t min_numel) {
  if (t.defined() && t.device() == device && t.scalar_type() == dtype && t.is_contiguous() &&
      t.numel() >= min_numel && in_own_memory(t)) {
    return "";
  }
  return c10::str(
      "argument '", name, "' must be a contiguous ", dtype, " tensor on ", device, " of at least ",
      min_numel, " elements, got ", describe(t), t.defined() ? c10::str(" of ", t.numel()) : "");
}

bool word_aligned(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 8 == 0;
}

std::string describe_planes(const at::Tensor& t) {
  if (!t.defined()) {
    return describe(t);
  }
  return c10::str(
      describe(t), " of ", t.numel(), " bytes",
      !in_own_memory(t) || word_aligned(t) ? "" : " starting off an 8-byte boundary");
}

std::string check_planes(
    const at::Tensor& t,
    const char* name,
    const c10::Device& device,
    int64_t min_bits) {
  if (t.defined() && t.device() == device && t.scalar_type() == at::kByte && t.is_contiguous() &&
      t.numel() % 8 == 0 && t.numel() * 8 >= min_bits && in_own_memory(t) && word_aligned(t)) {
    return "";
  }
  return c10::str(
      "argument '", name, "' must be a contiguous uint8 tensor on ", device,
      " of a whole number of 64-bit words, starting on an 8-byte boundary, holding at least ",
      min_bits, " bits, got ", describe_planes(t));
}

std::string check_float(const at::Tensor& t, const char* name, const c10::Device& device) {
  if (t.defined() && t.device() == device && t.is_contiguous() && float_dtype(t.scalar_type()) &&
      in_own_memory(t)) {
    return "";
  }
  return c10::str(
      "argument '", name, "' must be a contiguous float32, bfloat16 or float16 tensor on ", device,
      " holding its elements in memory, got ", describe(t));
}

} // namespace lionbit
