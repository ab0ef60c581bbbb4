#include "worker/engine/comm/communicator.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardtrain {
namespace {

class DoneWork final : public CommWork {
 public:
  explicit DoneWork(absl::Status status) : status_(std::move(status)) {}
  absl::Status Wait() override { return status_; }
  bool IsCompleted() override { return true; }

 private:
  absl::Status status_;
};

}  // namespace

std::unique_ptr<CommWork> CompletedWork(absl::Status status) {
  return std::make_unique<DoneWork>(std::move(status));
}

std::unique_ptr<CommWork> Communicator::Send(const torch::Tensor& /*tensor*/,
                                             int64_t /*dst*/, int64_t /*tag*/) {
  return CompletedWork(
      absl::UnimplementedError("this communicator cannot send point-to-point"));
}

std::unique_ptr<CommWork> Communicator::Recv(torch::Tensor& /*tensor*/,
                                             int64_t /*src*/, int64_t /*tag*/) {
  return CompletedWork(absl::UnimplementedError(
      "this communicator cannot receive point-to-point"));
}

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
