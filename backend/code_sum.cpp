#include "backend/code_sum.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace lionbit {

CodeSum sum_codes(const at::Tensor& codes, int Q, int64_t still_value) {
  TORCH_CHECK(
      codes.dim() == 3 && codes.scalar_type() == at::kLong, "sum_codes: int64 [M, P, words]");
  const int64_t M = codes.size(0);
  const int P = static_cast<int>(codes.size(1));
  TORCH_CHECK(Q >= P && P >= 1, "sum_codes: ", Q, " planes cannot hold ", P, "-plane addends");
  const int64_t words = codes.size(2);
  CodeSum s;
  s.total = at::zeros({Q, words}, codes.options());
  const bool marks_still = still_value >= 0;
  if (marks_still) {
    s.still = at::full({words}, -1, codes.options());
  }
  for (int64_t m = 0; m < M; ++m) {
    const at::Tensor c = codes[m];
    at::Tensor still; // this addend's all-ones elements
    if (marks_still) {
      still = c[0].clone();
      for (int b = 1; b < P; ++b) {
        still.bitwise_and_(c[b]);
      }
      s.still.bitwise_and_(still);
    }
    // Ripple-carry addition, one plane at a time.
    at::Tensor carry;
    for (int b = 0; b < Q; ++b) {
      at::Tensor x;
      if (b < P) {
        x = c[b];
        if (marks_still) {
          // still -> still_value's bit b
          x = ((still_value >> b) & 1) != 0 ? x.bitwise_or(still)
                                            : x.bitwise_and(still.bitwise_not());
        }
      } else if (marks_still && ((still_value >> b) & 1) != 0) {
        x = still;
      }
      at::Tensor acc = s.total[b];
      if (!x.defined() && !carry.defined()) {
        continue;
      }
      if (!x.defined() || !carry.defined()) {
        const at::Tensor& y = x.defined() ? x : carry;
        at::Tensor next = acc.bitwise_and(y);
        acc.bitwise_xor_(y);
        carry = next;
      } else {
        at::Tensor axx = acc.bitwise_xor(x);
        at::Tensor next = acc.bitwise_and(x).bitwise_or_(carry.bitwise_and(axx));
        acc.copy_(axx.bitwise_xor_(carry));
        carry = next;
      }
    }
  }
  return s;
}

Comparison compare_code(const at::Tensor& total, uint64_t t) {
  const int Q = static_cast<int>(total.size(0));
  Comparison r;
  r.gt = at::zeros({total.size(1)}, total.options());
  r.eq = at::full({total.size(1)}, -1, total.options());
  if (Q < 64 && (t >> Q) != 0) {
    r.eq.zero_(); // t is out of reach: never equal, never below
    return r;
  }
  // Most significant plane first: the first differing bit decides.
  for (int b = Q - 1; b >= 0; --b) {
    const at::Tensor c = total[b];
    if (((t >> b) & 1) == 0) {
      r.gt.bitwise_or_(r.eq.bitwise_and(c));
      r.eq.bitwise_and_(c.bitwise_not());
    } else {
      r.eq.bitwise_and_(c);
    }
  }
  return r;
}

} // namespace lionbit
