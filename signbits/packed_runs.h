// Packed runs: a plane of set bits (a rank's exact zeros, a shard's ties) as
// a byte stream of its runs, for zeros that are many but follow a pattern.
//
// A ReLU unit dead on a rank's batch leaves a zero row in the matrix before
// it (one run) and a zero column in the matrix after it: in a row-major
// (out, in) weight that is one element every `in`, the same gaps row after
// row. Dead units, all-zero input pixels and masked slices give planes whose
// runs are too many for 8 bytes each (zeros.h's runs) but repeat. So each
// run is written as two variable-length numbers, the clear bits before it
// (the gap) and its length, and a copy token says "the next m runs are the
// runs k before them" (the last k runs again and again when m > k): a whole
// zero column of any height costs a few bytes after the first row has named
// its runs, and a layer whose units died like the last one's a few more.
//
// Format (little-endian): a u32 L, then L bytes of tokens, then zero bytes
// up to the announced size (a multiple of 8: planes after it stay aligned).
// A number is LEB128 (7 bits a byte, low first; at most 10 bytes).
//   token := number v
//     v even: a run of `len` set bits after v / 2 clear bits (after the last
//             run's end; the first run's gap counts from bit 0), then the
//             number len - 1. Every gap but the first is at least 1 (runs
//             are maximal).
//     v odd:  a copy: k = (v - 1) / 2 + 1, then the number m - 1: m runs,
//             each the (gap, length) of the run k before it. k is at most
//             the runs so far and at most kMaxCopyDistance (the decoder keeps
//             those).
// Bits after the last run are clear.
#pragma once

#include "types.h"

namespace lionbit::bits {

constexpr uint64_t kMaxCopyDistance = uint64_t{1} << 16; // runs back a copy may reach

// Bytes of the packed form of a plane of `words` words (a multiple of 8, at
// least 8), or 0 when that is more than `budget` bytes. `runs`: the plane's
// runs (count_runs), or 0; with them the encoder stops as soon as the runs
// it has written, scaled to all of them, come to more than the budget, so a
// plane of scattered zeros or ties costs little to rule out (and it makes
// room for them at once).
uint64_t packed_runs_bytes(const uint64_t* plane, size_t words, uint64_t runs, uint64_t budget);

// Writes the packed form into out[0, bytes), zero-padded; bytes must be at
// least packed_runs_bytes(plane, words, 0, bytes). Where this thread sized a
// plane of the same content with packed_runs_bytes lately, its tokens are
// taken from then, not found again (the same bytes; up to 32 MiB of planes
// are kept a thread for this).
void encode_packed_runs(const uint64_t* plane, size_t words, uint8_t* out, size_t bytes);

// Forgets the planes this thread keeps for encode_packed_runs.
void drop_kept_packed_runs();

// Reads what encode_packed_runs wrote (in[0, bytes)) into a plane of `words`
// words. Returns false (plane unspecified) for a corrupt stream: L past the
// message, a number past L or longer than 10 bytes, a gap of 0 after the
// first run, a run past the plane, a copy from more runs than written or
// than kMaxCopyDistance back, padding that is not zero.
bool decode_packed_runs(const uint8_t* in, size_t bytes, size_t words, uint64_t* plane);

} // namespace lionbit::bits
