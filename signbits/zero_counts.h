// avg / sum when a call has zeros, but few (wire version 6).
//
// With a zero anywhere, the count code of an element is 2 * #positive +
// #zero: one plane more than the zero-free code #positive, for every element,
// though a handful of them may have a zero (torch.randn gives a few exact
// zeros in 64M draws). Instead a shard's count message is then the zero-free
// planes followed by a list of the elements that have a zero on some rank:
//   [count][(offset << 32) | #zero] * count, ascending, room for `capacity`
// (unused entries 0), 8 + 8 * capacity bytes. The receiver unpacks the
// zero-free planes and rewrites the listed elements from the zero-aware code.
// Zeros carry no sign bit (a zero bit wins over the sign bit), so the
// zero-free planes count the positives correctly at those elements too.
#pragma once

#include "types.h"

namespace lionbit::bits {

// Bytes of a list with room for `capacity` elements.
size_t zero_count_list_bytes(uint64_t capacity);

// Writes the list of the elements (of `words` words) that have a zero in any
// of the n contributions' zero planes (nullptr: no zeros). Returns false,
// with the list unspecified, if there are more than `capacity`.
bool encode_zero_counts(
    const Contribution* in,
    int n,
    size_t words,
    uint64_t capacity,
    uint8_t* out);

// For each listed element e (offset o, z zeros), with p = its code in the P
// zero-free `planes`: writes entry 2 * p + z of `zlut` (the zero-aware code's
// table, entries of `esize` bytes) to dst + o * esize. Returns false, having
// written only the entries before it, at the first sign of a corrupt list:
// a count above `capacity`, offsets not ascending or not below `elems`, z == 0,
// or p + z above n.
bool apply_zero_counts(
    const uint8_t* list,
    uint64_t capacity,
    const uint64_t* const* planes,
    int P,
    size_t elems,
    int n,
    const void* zlut,
    size_t esize,
    void* dst);

} // namespace lionbit::bits
