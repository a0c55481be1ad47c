// The outcomes of a sign collective that callers act on, as types: a rank's
// input held NaN (for DistributedLion: a non-finite direction, so every rank
// skips or refuses the step), or ranks rejected their own arguments (they
// raised their own error; the others fail at once instead of waiting). Both
// are c10::ValueError, so code that does not know them sees the ValueError it
// always saw; bindings/python_module.cpp turns them into
// lionbit.NonFiniteInput and lionbit.PeerRejected. Their messages are for
// people: no code reads them.
#pragma once

#include <c10/util/Exception.h>

#include <string>
#include <utility>
#include <vector>

namespace lionbit {

class RanksError : public c10::ValueError {
 public:
  RanksError(std::vector<int> ranks, const std::string& msg)
      : c10::ValueError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, msg),
        ranks_(std::move(ranks)) {}
  const std::vector<int>& ranks() const { return ranks_; }

 private:
  std::vector<int> ranks_;
};

// NaN in the input of `ranks()` (a Lion direction's NaN or +-Inf); no rank
// reduced anything.
class NonFiniteInputError : public RanksError {
  using RanksError::RanksError;
};

// `ranks()` rejected their arguments to this call and raised their own error.
class PeerRejectedError : public RanksError {
  using RanksError::RanksError;
};

} // namespace lionbit
