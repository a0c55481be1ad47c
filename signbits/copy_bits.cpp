#include "copy_bits.h"

namespace lionbit::bits {

namespace {

// Up to 64 bits of src starting at bit `bit` (bits past the plane's end are
// never requested).
inline uint64_t read64(const uint64_t* src, size_t bit, size_t count) {
  const size_t w = bit / kWordBits;
  const unsigned s = static_cast<unsigned>(bit % kWordBits);
  uint64_t v = src[w] >> s;
  if (s != 0 && count > kWordBits - s) {
    v |= src[w + 1] << (kWordBits - s);
  }
  return count == kWordBits ? v : v & ((uint64_t{1} << count) - 1);
}

} // namespace

void copy_bits(uint64_t* dst, size_t dst_bit, const uint64_t* src, size_t src_bit, size_t nbits) {
  while (nbits > 0) {
    const size_t w = dst_bit / kWordBits;
    const unsigned s = static_cast<unsigned>(dst_bit % kWordBits);
    const size_t take = std::min<size_t>(nbits, kWordBits - s); // fits in dst[w]
    const uint64_t v = read64(src, src_bit, take);
    const uint64_t mask = (take == kWordBits ? ~uint64_t{0} : ((uint64_t{1} << take) - 1)) << s;
    dst[w] = (dst[w] & ~mask) | ((v << s) & mask);
    dst_bit += take;
    src_bit += take;
    nbits -= take;
  }
}

} // namespace lionbit::bits
