#include "backend/rank_names.hpp"

#include <c10/util/Exception.h>

#include <sstream>
#include <unordered_set>

namespace lionbit {

namespace {
// At most this many ranks listed in full; a longer group shows its first
// ones, "...", its last and its size.
constexpr size_t kListed = 8;

std::string members_text(const std::vector<int>& g) {
  std::ostringstream os;
  os << " (group of ";
  if (g.size() > kListed) {
    os << g.size() << " ";
  }
  os << "ranks [";
  for (size_t i = 0; i < g.size(); ++i) {
    if (g.size() > kListed && i == kListed - 1) {
      os << ", ..., " << g.back();
      break;
    }
    os << (i ? ", " : "") << g[i];
  }
  os << "])";
  return os.str();
}
} // namespace

RankNames::RankNames(int group_size, const std::vector<int>& global) {
  TORCH_CHECK_VALUE(group_size > 0, "lionbit: a group of ", group_size, " ranks");
  if (global.empty()) {
    global_.resize(static_cast<size_t>(group_size));
    for (int r = 0; r < group_size; ++r) {
      global_[static_cast<size_t>(r)] = r;
    }
    return;
  }
  TORCH_CHECK_VALUE(
      global.size() == static_cast<size_t>(group_size), "lionbit: argument 'global_ranks' has ",
      global.size(), " ranks for a group of ", group_size);
  std::unordered_set<int> seen;
  bool identity = true;
  for (size_t r = 0; r < global.size(); ++r) {
    TORCH_CHECK_VALUE(
        global[r] >= 0 && seen.insert(global[r]).second,
        "lionbit: argument 'global_ranks' must hold distinct ranks >= 0; it has ", global[r],
        " at ", r);
    identity = identity && global[r] == static_cast<int>(r);
  }
  global_ = global;
  if (!identity) {
    members_ = members_text(global_);
  }
}

std::vector<int> RankNames::of(const std::vector<int>& group_ranks) const {
  std::vector<int> out;
  out.reserve(group_ranks.size());
  for (const int r : group_ranks) {
    out.push_back((*this)(r));
  }
  return out;
}

std::string RankNames::here(int group_rank) const {
  return "rank " + std::to_string((*this)(group_rank)) + members_;
}

} // namespace lionbit
