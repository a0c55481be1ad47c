// Bit-sliced arithmetic on count codes, written once with ATen operations
// (so it runs on every device as it is): the exact hierarchical vote adds
// its nodes' counts with it (backend/sign_hierarchy.cpp).
//
// A code plane set holds one unsigned number per element: plane b is bit b,
// a 1-D int64 tensor of words (bit i of word w: element 64 w + i). The cost
// is a few whole-plane AND / XOR / OR per plane per addend, which is far
// below the exchanges around it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace lionbit {

struct CodeSum {
  at::Tensor total; // int64 [Q, words]: the sum, Q planes
  at::Tensor still; // int64 [words]: elements every addend marked still; undefined if not asked
};

// Sums M numbers per element: `codes` is int64 [M, P, words] (addend m's
// plane b at [m, b]). With `still_value` >= 0, an addend whose P bits are all
// set (2^P - 1, a value the caller never uses otherwise) counts as
// `still_value`, and `still` marks the elements where every addend was so.
// The sum must fit Q planes (the caller's bound; Q >= P).
CodeSum sum_codes(const at::Tensor& codes, int Q, int64_t still_value);

// Where the Q-plane number `total` (int64 [Q, words]) is > t and == t: two
// int64 planes of `words` words.
struct Comparison {
  at::Tensor gt;
  at::Tensor eq;
};
Comparison compare_code(const at::Tensor& total, uint64_t t);

} // namespace lionbit
