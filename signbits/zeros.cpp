#include "zeros.h"

#include <cstring>

namespace lionbit::bits {

uint64_t count_bits(const uint64_t* words, size_t n_words) {
  uint64_t c = 0;
  for (size_t w = 0; w < n_words; ++w) {
    c += static_cast<uint64_t>(__builtin_popcountll(words[w]));
  }
  return c;
}

namespace {
// List slots: the capacity rounded up to an even count, so that a list is a
// whole number of 64-bit words and every plane after it stays aligned.
uint64_t list_slots(uint64_t capacity) {
  return (capacity + 1) & ~uint64_t{1};
}
} // namespace

bool zeros_as_list(uint64_t capacity, size_t words) {
  // Offsets are 32-bit: planes of more than 2^32 - 1 elements go dense.
  return capacity > 0 && list_slots(capacity) * 4 < words * 8 &&
      words * kWordBits < static_cast<uint64_t>(kNoIndex);
}

size_t zero_encoding_bytes(uint64_t capacity, size_t words) {
  if (capacity == 0) {
    return 0;
  }
  return zeros_as_list(capacity, words) ? static_cast<size_t>(list_slots(capacity)) * 4 : words * 8;
}

void encode_zeros(const uint64_t* plane, size_t words, uint64_t capacity, uint8_t* out) {
  if (capacity == 0) {
    return;
  }
  if (!zeros_as_list(capacity, words)) {
    std::memcpy(out, plane, words * 8);
    return;
  }
  uint64_t k = 0;
  for (size_t w = 0; w < words && k < capacity; ++w) {
    uint64_t bits = plane[w];
    while (bits != 0 && k < capacity) {
      const uint32_t idx = static_cast<uint32_t>(w * kWordBits) +
          static_cast<uint32_t>(__builtin_ctzll(bits));
      std::memcpy(out + 4 * k, &idx, 4);
      ++k;
      bits &= bits - 1;
    }
  }
  for (; k < list_slots(capacity); ++k) {
    std::memcpy(out + 4 * k, &kNoIndex, 4);
  }
}

bool decode_zeros(const uint8_t* in, size_t words, uint64_t capacity, uint64_t* plane) {
  if (capacity == 0) {
    std::memset(plane, 0, words * 8);
    return true;
  }
  if (!zeros_as_list(capacity, words)) {
    std::memcpy(plane, in, words * 8);
    return true;
  }
  std::memset(plane, 0, words * 8);
  const uint64_t limit = static_cast<uint64_t>(words) * kWordBits;
  int64_t last = -1;
  const uint64_t slots = list_slots(capacity);
  for (uint64_t k = 0; k < slots; ++k) {
    uint32_t idx;
    std::memcpy(&idx, in + 4 * k, 4);
    if (idx == kNoIndex) {
      // Padding: everything after it must be padding too.
      for (uint64_t r = k + 1; r < slots; ++r) {
        std::memcpy(&idx, in + 4 * r, 4);
        if (idx != kNoIndex) {
          return false;
        }
      }
      return true;
    }
    if (k >= capacity || idx >= limit || static_cast<int64_t>(idx) <= last) {
      return false;
    }
    last = idx;
    plane[idx / kWordBits] |= 1ull << (idx % kWordBits);
  }
  return true;
}

} // namespace lionbit::bits
