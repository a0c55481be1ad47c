#include "signbits/levels.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "signbits/types.h"

namespace lionbit::bits {
namespace {

// u = q + s of one value; counts a non-finite c.
inline uint8_t level_of(float c, double factor, int s, uint64_t& bad) {
  if (!std::isfinite(c)) {
    ++bad;
    return static_cast<uint8_t>(std::isnan(c) ? s : (c > 0 ? 2 * s : 0));
  }
  double x = std::nearbyint(static_cast<double>(c) * factor);
  if (!(x == x)) { // a NaN factor
    x = 0;
  }
  x = std::min(std::max(x, -static_cast<double>(s)), static_cast<double>(s));
  return static_cast<uint8_t>(static_cast<int>(x) + s);
}

// Bit b of each of the 8 bytes of x, gathered into 8 bits (byte j -> bit j):
// each byte's bit lands at a distinct position of the product, so nothing
// carries.
inline uint64_t gather_bit(uint64_t x, int b) {
  return (((x >> b) & 0x0101010101010101ull) * 0x0102040810204080ull) >> 56;
}

} // namespace

uint64_t pack_levels(
    const float* c,
    size_t n,
    double factor,
    int p,
    uint64_t* planes,
    size_t plane_words,
    size_t bit_offset) {
  const int s = level_span(p);
  uint64_t bad = 0;
  size_t i = 0;
  // Element by element up to a word boundary (and for a short tail).
  auto one = [&](size_t k) {
    const uint8_t u = level_of(c[k], factor, s, bad);
    const size_t pos = bit_offset + k;
    for (int b = 0; b < p; ++b) {
      planes[b * plane_words + pos / kWordBits] |= static_cast<uint64_t>((u >> b) & 1)
          << (pos % kWordBits);
    }
  };
  for (; i < n && (bit_offset + i) % kWordBits != 0; ++i) {
    one(i);
  }
  uint8_t u[kWordBits];
  for (; i + kWordBits <= n; i += kWordBits) {
    for (size_t k = 0; k < kWordBits; ++k) {
      u[k] = level_of(c[i + k], factor, s, bad);
    }
    const size_t word = (bit_offset + i) / kWordBits;
    for (int b = 0; b < p; ++b) {
      uint64_t out = 0;
      for (size_t g = 0; g < 8; ++g) {
        uint64_t x;
        std::memcpy(&x, u + 8 * g, 8);
        out |= gather_bit(x, b) << (8 * g);
      }
      planes[b * plane_words + word] |= out;
    }
  }
  for (; i < n; ++i) {
    one(i);
  }
  return bad;
}

void vote_levels(
    const uint64_t* const* in,
    int n,
    int p,
    size_t words,
    uint64_t* out_sign,
    uint64_t* out_tie) {
  const uint64_t s = static_cast<uint64_t>(level_span(p));
  const uint64_t threshold = static_cast<uint64_t>(n) * s; // sum(u) == n * s: sum(q) == 0
  const int width = bit_width(static_cast<uint64_t>(n) * 2 * s);
  uint64_t acc[64];
  for (size_t w = 0; w < words; ++w) {
    std::fill(acc, acc + width, uint64_t{0});
    // Bit-sliced ripple-carry addition of each rank's value.
    for (int i = 0; i < n; ++i) {
      uint64_t carry = 0;
      int b = 0;
      for (; b < p; ++b) {
        const uint64_t x = in[i][static_cast<size_t>(b) * words + w];
        const uint64_t t = acc[b] ^ x;
        const uint64_t next = (acc[b] & x) | (carry & t);
        acc[b] = t ^ carry;
        carry = next;
      }
      for (; carry != 0 && b < width; ++b) {
        const uint64_t next = acc[b] & carry;
        acc[b] ^= carry;
        carry = next;
      }
    }
    // Compare with the threshold, most significant plane first.
    uint64_t gt = 0;
    uint64_t eq = ~uint64_t{0};
    for (int b = width - 1; b >= 0; --b) {
      const uint64_t tb = ((threshold >> b) & 1) ? ~uint64_t{0} : uint64_t{0};
      gt |= eq & acc[b] & ~tb;
      eq &= ~(acc[b] ^ tb);
    }
    out_sign[w] = gt;
    out_tie[w] = eq;
  }
}

} // namespace lionbit::bits
