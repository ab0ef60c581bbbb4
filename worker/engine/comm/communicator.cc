#include "worker/engine/comm/communicator.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardtrain {

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::NewGroup(
    const std::string& /*tag*/, const std::vector<int64_t>& /*members*/) {
  return absl::UnimplementedError(
      "this communicator cannot form sub-groups of its ranks");
}

absl::StatusOr<int64_t> PositionInGroup(const std::vector<int64_t>& members,
                                        int64_t rank, int64_t world_size) {
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i] < 0 || members[i] >= world_size ||
        (i > 0 && members[i] <= members[i - 1])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a group's members must be distinct ranks below ", world_size,
          " in ascending order, got [", absl::StrJoin(members, ", "), "]"));
    }
  }
  const auto it = std::find(members.begin(), members.end(), rank);
  if (it == members.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is not a member of the group [",
                     absl::StrJoin(members, ", "), "]"));
  }
  return static_cast<int64_t>(it - members.begin());
}

}  // namespace shardtrain
