#include "unpack.h"

#include "float16.h"
#include "kernels.h"

namespace lionbit::bits {

void unpack(
    DType dtype,
    const uint64_t* const* planes,
    int nplanes,
    size_t n,
    const void* lut,
    void* dst,
    Isa isa) {
  if (n == 0) {
    return;
  }
  detail::kernels_for(isa).unpack(dtype_size(dtype), planes, nplanes, n, lut, dst);
}

void make_lut(DType dtype, const double* values, size_t count, void* lut) {
  for (size_t i = 0; i < count; ++i) {
    const double v = values[i];
    switch (dtype) {
      case DType::kFloat64:
        static_cast<double*>(lut)[i] = v;
        break;
      case DType::kFloat32:
        static_cast<float*>(lut)[i] = static_cast<float>(v);
        break;
      case DType::kFloat16:
        static_cast<uint16_t*>(lut)[i] = f32_to_f16(static_cast<float>(v));
        break;
      case DType::kBFloat16:
        static_cast<uint16_t*>(lut)[i] = f32_to_bf16(static_cast<float>(v));
        break;
      case DType::kInt8:
        static_cast<int8_t*>(lut)[i] = static_cast<int8_t>(v);
        break;
    }
  }
}

} // namespace lionbit::bits
