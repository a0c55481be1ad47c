#include "zero_counts.h"

#include <cstring>

namespace lionbit::bits {

size_t zero_count_list_bytes(uint64_t capacity) {
  return 8 + 8 * static_cast<size_t>(capacity);
}

bool encode_zero_counts(
    const Contribution* in,
    int n,
    size_t words,
    uint64_t capacity,
    uint8_t* out) {
  uint64_t count = 0;
  for (size_t w = 0; w < words; ++w) {
    uint64_t any = 0;
    for (int i = 0; i < n; ++i) {
      any |= in[i].zero != nullptr ? in[i].zero[w] : 0;
    }
    for (; any != 0; any &= any - 1) {
      const unsigned j = static_cast<unsigned>(__builtin_ctzll(any));
      uint64_t zeros = 0;
      for (int i = 0; i < n; ++i) {
        zeros += in[i].zero != nullptr ? (in[i].zero[w] >> j) & 1u : 0;
      }
      if (count == capacity) {
        return false;
      }
      const uint64_t entry = (static_cast<uint64_t>(w * kWordBits + j) << 32) | zeros;
      std::memcpy(out + 8 * (1 + count), &entry, 8);
      ++count;
    }
  }
  std::memcpy(out, &count, 8);
  std::memset(out + 8 * (1 + count), 0, 8 * (capacity - count));
  return true;
}

bool apply_zero_counts(
    const uint8_t* list,
    uint64_t capacity,
    const uint64_t* const* planes,
    int P,
    size_t elems,
    int n,
    const void* zlut,
    size_t esize,
    void* dst) {
  uint64_t count = 0;
  std::memcpy(&count, list, 8);
  if (count > capacity) {
    return false;
  }
  const uint8_t* lut = static_cast<const uint8_t*>(zlut);
  uint8_t* out = static_cast<uint8_t*>(dst);
  uint64_t prev = 0;
  for (uint64_t e = 0; e < count; ++e) {
    uint64_t entry = 0;
    std::memcpy(&entry, list + 8 * (1 + e), 8);
    const uint64_t off = entry >> 32;
    const uint64_t zeros = entry & 0xffffffffu;
    if (off >= elems || (e > 0 && off <= prev) || zeros == 0) {
      return false;
    }
    uint64_t pos = 0;
    for (int b = 0; b < P; ++b) {
      pos |= ((planes[b][off / kWordBits] >> (off % kWordBits)) & 1u) << b;
    }
    if (pos + zeros > static_cast<uint64_t>(n)) {
      return false;
    }
    std::memcpy(out + off * esize, lut + (2 * pos + zeros) * esize, esize);
    prev = off;
  }
  return true;
}

} // namespace lionbit::bits
