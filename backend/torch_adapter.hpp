// The torch side of the kernels' types in one place: dtype mapping, raw views
// of byte tensors, and the argument checks that the backend and the bindings
// share. Each check returns "" when the argument is fine, else a sentence
// naming it; the caller adds who is asking (op, rank) and raises.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

#include "signbits/types.h"

namespace lionbit {

// The kernels' dtype for a torch dtype (the sign collectives take float32,
// float16, bfloat16, float64 and int8); nullopt for any other.
std::optional<bits::DType> bits_dtype(at::ScalarType t);

// The torch dtype of a kernels' dtype (the inverse of bits_dtype).
at::ScalarType torch_dtype(bits::DType t);

// The dtypes the fused Lion kernels take (float32, bfloat16, float16).
std::optional<bits::DType> float_dtype(at::ScalarType t);

inline uint64_t* words_of(const at::Tensor& t) {
  return reinterpret_cast<uint64_t*>(t.data_ptr<uint8_t>());
}

// The 64-bit words of a bit-plane (a uint8 tensor of whole words).
inline size_t plane_words(const at::Tensor& plane) {
  return static_cast<size_t>(plane.numel()) / 8;
}

inline uint8_t* bytes_of(const at::Tensor& t) {
  return t.data_ptr<uint8_t>();
}

// A CPU uint8 tensor of n bytes (uninitialised).
at::Tensor byte_buffer(size_t n);

// Whether t's elements are in memory the kernels can address: not a tensor
// subclass that dispatches its ops to Python (a wrapper such as torchao's
// float8 training weight keeps its values in another tensor; its own data
// pointer is null).
bool in_own_memory(const at::Tensor& t);

// "float32 on cpu", "float16 on cuda:0 (not contiguous)", "undefined"; a
// tensor not in_own_memory says so.
std::string describe(const at::Tensor& t);

// A contiguous `dtype` tensor on `device` with at least `min_numel` elements.
std::string check_buffer(
    const at::Tensor& t,
    const char* name,
    at::ScalarType dtype,
    const c10::Device& device,
    int64_t min_numel);

// Whether t's data starts on an 8-byte boundary (the kernels read planes as
// 64-bit words; a GPU faults on a misaligned one).
bool word_aligned(const at::Tensor& t);

// describe(t) for a plane: its bytes, and where it starts off an 8-byte
// boundary, that.
std::string describe_planes(const at::Tensor& t);

// Bit-planes: a contiguous uint8 tensor on `device` of whole 64-bit words,
// starting on an 8-byte boundary, holding at least `min_bits` bits.
std::string check_planes(
    const at::Tensor& t,
    const char* name,
    const c10::Device& device,
    int64_t min_bits);

// A contiguous float32, bfloat16 or float16 tensor on `device`.
std::string check_float(const at::Tensor& t, const char* name, const c10::Device& device);

} // namespace lionbit
