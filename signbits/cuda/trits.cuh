// The base-3 form of a vote's results (signbits/trits.h) on the GPU, per
// byte and per element, as host+device functions: signbits/cuda/trits.cu
// runs them a byte or an element a thread; tests/cpp/test_cuda_host.cpp runs
// the very same functions on the host against bits::encode_trits and
// bits::decode_trits. No CUDA headers when compiled by a plain C++ compiler.
#pragma once

#include <cstddef>
#include <cstdint>

#include "signbits/cuda/element.cuh"
#include "signbits/trits.h"

namespace lionbit::cuda::detail {

// Byte b (< 13) of a word's code from its sign and tie words: elements
// 5 b .. 5 b + 4 as sum_j trit_j * 3^j, trit 0 for -1 (neither bit), 1 for +1
// (sign bit), 2 for a tie (tie bit, whatever the sign bit). The 13th byte's
// fifth trit (element 64) is 0.
LIONBIT_HD uint8_t trit_byte(uint64_t sign, uint64_t tie, unsigned b) {
  const unsigned shift = 5 * b;
  const unsigned s = static_cast<unsigned>((sign >> shift) & 31u);
  const unsigned t = static_cast<unsigned>((tie >> shift) & 31u);
  unsigned code = 0, place = 1;
  LIONBIT_UNROLL
  for (unsigned j = 0; j < 5; ++j) {
    code += (((t >> j) & 1u) != 0 ? 2u : (s >> j) & 1u) * place;
    place *= 3;
  }
  return static_cast<uint8_t>(code);
}

// The byte of a message that holds element i.
LIONBIT_HD size_t trit_byte_of(size_t i) {
  return (i / 64) * bits::kTritBytesPerWord + (i % 64) / 5;
}

// Element i's trit (0, 1, 2) from its byte `code`, or 3 where the byte is not
// a code (243 or more: a corrupt message).
LIONBIT_HD unsigned trit_of(unsigned code, size_t i) {
  if (code >= 243u) {
    return 3u;
  }
  for (unsigned j = static_cast<unsigned>((i % 64) % 5); j > 0; --j) {
    code /= 3u;
  }
  return code % 3u;
}

} // namespace lionbit::cuda::detail
