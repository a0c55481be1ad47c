// How lionbit names a rank in its messages and typed errors: by its global
// rank (the default group's number for it: what dist.get_rank() returns and
// torchrun's log prefixes show), whatever group a call runs over. A rank of
// an HSDP replica group or a tensor-parallel run's data-parallel group that
// the group numbers 0 may be global rank 5; an error that said "rank 0"
// would send the reader to the wrong process's log.
#pragma once

#include <string>
#include <vector>

namespace lionbit {

class RankNames {
 public:
  // `global`: the group's ranks in the default group's numbers, group rank
  // order (what torch gives a backend's creator as global_ranks_in_group);
  // empty for the default group itself. Throws c10::ValueError unless it
  // holds `group_size` distinct ranks >= 0.
  RankNames(int group_size, const std::vector<int>& global);

  // The global rank of the group's rank `group_rank` (0 <= it < size).
  int operator()(int group_rank) const { return global_[static_cast<size_t>(group_rank)]; }
  // Every group rank's global rank, in group rank order.
  const std::vector<int>& table() const { return global_; }
  // The same for a list of group ranks.
  std::vector<int> of(const std::vector<int>& group_ranks) const;
  // How an error says where it was raised: "rank 5", and where the group
  // numbers its ranks otherwise than the default group, which ranks it
  // holds: "rank 5 (group of ranks [4, 5])".
  std::string here(int group_rank) const;

 private:
  std::vector<int> global_;
  std::string members_; // " (group of ranks [...])", or empty
};

} // namespace lionbit
