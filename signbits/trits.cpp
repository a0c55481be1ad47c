#include "trits.h"

#include <array>
#include <cstring>

namespace lionbit::bits {
namespace {

// code[(tie5 << 5) | sign5]: the byte of 5 elements from their 5 sign bits
// and 5 tie bits.
const std::array<uint8_t, 1024>& encode_table() {
  static const std::array<uint8_t, 1024> t = [] {
    std::array<uint8_t, 1024> a{};
    for (unsigned idx = 0; idx < 1024; ++idx) {
      unsigned code = 0, place = 1;
      for (unsigned j = 0; j < 5; ++j) {
        const unsigned trit = ((idx >> (5 + j)) & 1u) ? 2u : ((idx >> j) & 1u);
        code += trit * place;
        place *= 3;
      }
      a[idx] = static_cast<uint8_t>(code);
    }
    return a;
  }();
  return t;
}

// trits of code c: digit j of c in base 3, for c < 243.
const std::array<std::array<uint8_t, 5>, 243>& digit_table() {
  static const std::array<std::array<uint8_t, 5>, 243> t = [] {
    std::array<std::array<uint8_t, 5>, 243> a{};
    for (unsigned c = 0; c < 243; ++c) {
      unsigned v = c;
      for (unsigned j = 0; j < 5; ++j) {
        a[c][j] = static_cast<uint8_t>(v % 3);
        v /= 3;
      }
    }
    return a;
  }();
  return t;
}

// Elements of type U: a table of the values of each byte, 8 a row (5 used),
// then one 8-element copy per byte: byte b of a word writes elements 5 b ..
// 5 b + 7, the next byte overwrites the 3 extra, and the 12th (b = 11) ends
// at element 62, inside the word; the 13th copies its 4. Bytes 243..255 (not
// valid codes) have rows too, so no byte needs a clamp; they are flagged.
template <typename U>
bool decode_typed(const uint8_t* trits, size_t n, const U* lut, U* dst) {
  std::array<std::array<U, 8>, 256> values{};
  const auto& digits = digit_table();
  for (unsigned c = 0; c < 243; ++c) {
    for (unsigned j = 0; j < 5; ++j) {
      values[c][j] = lut[digits[c][j]];
    }
  }
  const size_t full = n / 64;
  unsigned bad = 0;
  for (size_t w = 0; w < full; ++w) {
    const uint8_t* in = trits + w * kTritBytesPerWord;
    U* out = dst + w * 64;
    for (size_t b = 0; b < 12; ++b) {
      bad |= static_cast<unsigned>(in[b] >= 243);
      std::memcpy(out + 5 * b, values[in[b]].data(), 8 * sizeof(U));
    }
    bad |= static_cast<unsigned>(in[12] >= 243);
    std::memcpy(out + 60, values[in[12]].data(), 4 * sizeof(U));
  }
  if (bad != 0) {
    return false;
  }
  for (size_t i = full * 64; i < n; ++i) {
    const uint8_t code = trits[(i / 64) * kTritBytesPerWord + (i % 64) / 5];
    if (code >= 243) {
      return false;
    }
    dst[i] = values[code][(i % 64) % 5];
  }
  return true;
}

} // namespace

void encode_trits(const uint64_t* sign, const uint64_t* tie, size_t words, uint8_t* out) {
  const auto& table = encode_table();
  for (size_t w = 0; w < words; ++w) {
    const uint64_t s = sign[w], t = tie[w];
    for (unsigned b = 0; b < kTritBytesPerWord; ++b) {
      const unsigned shift = 5 * b;
      const unsigned idx = static_cast<unsigned>((s >> shift) & 31u) |
          (static_cast<unsigned>((t >> shift) & 31u) << 5);
      out[w * kTritBytesPerWord + b] = table[idx];
    }
  }
}

bool decode_trits(DType dtype, const uint8_t* trits, size_t n, const void* lut, void* dst) {
  switch (dtype_size(dtype)) {
    case 1:
      return decode_typed<uint8_t>(
          trits, n, static_cast<const uint8_t*>(lut), static_cast<uint8_t*>(dst));
    case 2:
      return decode_typed<uint16_t>(
          trits, n, static_cast<const uint16_t*>(lut), static_cast<uint16_t*>(dst));
    case 4:
      return decode_typed<uint32_t>(
          trits, n, static_cast<const uint32_t*>(lut), static_cast<uint32_t*>(dst));
    default:
      return decode_typed<uint64_t>(
          trits, n, static_cast<const uint64_t*>(lut), static_cast<uint64_t*>(dst));
  }
}

} // namespace lionbit::bits
