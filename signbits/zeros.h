// Encoding of a zero plane (or tie plane) on the wire: nothing, a sorted
// list of 32-bit offsets, a sorted list of runs, the runs packed
// (packed_runs.h), or the dense plane, whichever is smallest for what the
// sender announced.
//
// Every sender announces a ZeroCode before the data moves: the most set bits
// K and the most runs R (maximal sequences of consecutive set bits) in any
// plane it will send, and the most bytes P any of them takes packed. So
// every receiver knows each message's form and size:
//   K == 0             -> kNone: 0 bytes (no plane at all)
//   kList              -> K uint32 offsets, ascending, padded with kNoIndex
//                         to an even count (a whole number of 64-bit words)
//   kRuns              -> R pairs (first, end) of uint32, end exclusive,
//                         ascending and disjoint, padded with
//                         (kNoIndex, kNoIndex)
//   kPacked            -> P bytes: the runs as variable-length gaps and
//                         lengths, with repeats (packed_runs.h)
//   kPlane             -> the dense plane
// the smallest of them (ties in that order; offsets are 32-bit, so planes
// of 2^32 - 1 elements or more go dense). A rank with one stray zero thus
// sends 8 bytes, not a second plane; a rank whose zeros are a few whole
// channels or embedding rows (exact zeros cluster in real models) sends 8
// bytes a channel, whatever its length; one whose zeros are the columns of
// dead ReLU units (one zero every row, the same columns in every row) a few
// bytes a column.
#pragma once

#include <vector>

#include "isa.h"
#include "types.h"

namespace lionbit::bits {

constexpr uint32_t kNoIndex = 0xffffffffu;

// What a sender announces about the planes it will send (zeros <= the
// plane's elements, runs <= zeros, runs == 0 iff zeros == 0; packed: the
// packed runs' bytes, a multiple of 8 below the plane's, or 0 where they
// are not offered). When the runs are not known, `at_most(K)` is a valid
// code: never more runs than zeros, nothing packed.
struct ZeroCode {
  uint64_t zeros = 0;
  uint64_t runs = 0;
  uint64_t packed = 0;

  static ZeroCode at_most(uint64_t zeros) { return ZeroCode{zeros, zeros, 0}; }
  bool operator==(const ZeroCode& o) const {
    return zeros == o.zeros && runs == o.runs && packed == o.packed;
  }
  bool operator!=(const ZeroCode& o) const { return !(*this == o); }
};

// A code both planes fit: the element-wise larger, packed only where both
// planes that have zeros offer it (a plane without zeros fits any code).
inline ZeroCode max_code(const ZeroCode& a, const ZeroCode& b) {
  if (a.zeros == 0 || b.zeros == 0) {
    return a.zeros == 0 ? b : a;
  }
  const uint64_t packed = a.packed == 0 || b.packed == 0
      ? 0
      : (a.packed > b.packed ? a.packed : b.packed);
  return ZeroCode{a.zeros > b.zeros ? a.zeros : b.zeros, a.runs > b.runs ? a.runs : b.runs, packed};
}

// A code every plane of `codes` fits (max_code of them all; none: no zeros).
inline ZeroCode max_code(const std::vector<ZeroCode>& codes) {
  ZeroCode most;
  for (const ZeroCode& c : codes) {
    most = max_code(most, c);
  }
  return most;
}

// Values are not on the wire (every rank derives the form from the code).
enum class ZeroForm : uint8_t { kNone = 0, kList = 1, kRuns = 2, kPlane = 3, kPacked = 4 };

const char* zero_form_name(ZeroForm f);

// The form as a message names it: "list of positions", "list of runs",
// "packed runs", "plane" ("nothing" for kNone).
const char* zero_form_noun(ZeroForm f);

// Number of set bits in words[0..n_words).
uint64_t count_bits(const uint64_t* words, size_t n_words, Isa isa = default_isa());

// Number of runs of set bits in words[0..n_words) (bit 0 of word 0 first).
uint64_t count_runs(const uint64_t* words, size_t n_words, Isa isa = default_isa());

// The code of one plane: its bits, its runs and, where that is smaller than
// the plane, its packed runs' bytes.
ZeroCode zero_code_of(const uint64_t* plane, size_t words);

// The packed runs' bytes of a plane with `runs` runs (zero_code_of's
// `packed`): offered where they take at most 3/4 of the plane (a packing
// that saves less is not worth the coder's time: it works run by run, about
// 5 ns an element for 5 % scattered zeros against 0.2 for counting them),
// 0 otherwise or where the plane has 2^32 - 1 bits or more.
uint64_t packed_offer(const uint64_t* plane, size_t words, uint64_t runs);

// Whether packed runs are worth a device's copy of the plane to the host
// (the coder is serial: the GPU kernel sets run it on a host copy): only
// where the plane's list or runs form takes more than 1/32 of the plane. A
// plane with a few stray zeros (a 64M-element chunk with 7 exact zeros)
// then travels as its list, its packing would save a few bytes for an 8 MB
// copy; zeros that cost a real part of the 1-bit figure (dead units'
// columns) are still packed.
bool packed_worth_a_copy(uint64_t zeros, uint64_t runs, size_t words);

// The form of a plane of `words` words announced with `code`.
ZeroForm zero_form(const ZeroCode& code, size_t words);

// Bytes on the wire for a plane of `words` words announced with `code`.
size_t zero_encoding_bytes(const ZeroCode& code, size_t words);

// Writes zero_encoding_bytes(code, words) bytes. The plane must have at
// most code.zeros bits set in at most code.runs runs, and take at most
// code.packed bytes packed where that is the form.
void encode_zeros(const uint64_t* plane, size_t words, const ZeroCode& code, uint8_t* out);

// Reads what encode_zeros wrote into a plane of `words` words. Returns false
// (plane unspecified) for a corrupt message: an offset out of range, out of
// order, repeated or past the announced number, an entry after padding; a
// run empty, overlapping or touching the one before it (encode_zeros writes
// maximal runs), out of range or past the announced number.
bool decode_zeros(const uint8_t* in, size_t words, const ZeroCode& code, uint64_t* plane);

} // namespace lionbit::bits
