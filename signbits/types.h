// Plain types shared by the bit kernels: element dtypes, instruction sets and
// the shard layout of a sign all-reduce. No torch here.
#pragma once

#include <cstddef>
#include <cstdint>

namespace lionbit::bits {

// Element types the sign all-reduce accepts. Values are part of the wire
// header: never renumber.
enum class DType : uint8_t {
  kFloat32 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kFloat64 = 4,
  kInt8 = 5,
};

size_t dtype_size(DType t);
const char* dtype_name(DType t);
bool dtype_is_floating(DType t);

// Instruction sets a kernel can run on. Ordered: a larger value needs more.
enum class Isa : int {
  kScalar = 0,
  kAvx2 = 1,
  kAvx512 = 2,
};

constexpr size_t kWordBits = 64;

inline size_t words_for(size_t numel) {
  return (numel + kWordBits - 1) / kWordBits;
}

// Elements are padded to a multiple of 64 * world_size so that every rank's
// shard is a whole number of 64-bit words. A tensor with fewer elements than
// that still gives every rank one word.
inline size_t padded_numel(size_t numel, int world_size) {
  const size_t unit = kWordBits * static_cast<size_t>(world_size);
  if (numel == 0) {
    return 0;
  }
  return (numel + unit - 1) / unit * unit;
}

inline size_t shard_words(size_t numel, int world_size) {
  return padded_numel(numel, world_size) / kWordBits / static_cast<size_t>(world_size);
}

// Number of bits needed to hold every integer in [0, v].
inline int bit_width(uint64_t v) {
  int b = 0;
  while (v != 0) {
    ++b;
    v >>= 1;
  }
  return b;
}

// One rank's packed contribution to a shard: its sign plane (bit set: x > 0)
// and, when that rank's input held a zero, its zero plane (bit set: x == 0).
// Neither bit set means x < 0.
struct Contribution {
  const uint64_t* sign;
  const uint64_t* zero; // nullptr: this rank has no zeros
};

} // namespace lionbit::bits
