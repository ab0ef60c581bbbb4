#include "common/exit_codes.h"

#include "absl/strings/cord.h"

namespace shardtrain {
namespace {

constexpr char kDivergedPayload[] = "shardtrain/diverged";
constexpr char kPortTakenPayload[] = "shardtrain/rendezvous-port-taken";
constexpr char kPreemptedPayload[] = "shardtrain/preempted";
constexpr char kBadInputPayload[] = "shardtrain/bad-input";

absl::Status Marked(absl::Status status, const char* payload) {
  status.SetPayload(payload, absl::Cord("1"));
  return status;
}

}  // namespace

absl::Status DivergedError(const std::string& message) {
  return Marked(absl::AbortedError(message), kDivergedPayload);
}

bool IsDiverged(const absl::Status& status) {
  return status.GetPayload(kDivergedPayload).has_value();
}

absl::Status RendezvousPortTakenError(const std::string& message) {
  return Marked(absl::UnavailableError(message), kPortTakenPayload);
}

bool IsRendezvousPortTaken(const absl::Status& status) {
  return status.GetPayload(kPortTakenPayload).has_value();
}

absl::Status PreemptedError(const std::string& message) {
  return Marked(absl::AbortedError(message), kPreemptedPayload);
}

bool IsPreempted(const absl::Status& status) {
  return status.GetPayload(kPreemptedPayload).has_value();
}

absl::Status BadInputError(const std::string& message) {
  return Marked(absl::InvalidArgumentError(message), kBadInputPayload);
}

bool IsBadInput(const absl::Status& status) {
  return status.GetPayload(kBadInputPayload).has_value();
}

int ExitCodeFor(const absl::Status& status) {
  if (status.ok()) return 0;
  if (IsDiverged(status)) return kExitDiverged;
  if (IsPreempted(status)) return kExitPreempted;
  if (IsRendezvousPortTaken(status)) return kExitRendezvousPortTaken;
  if (absl::IsPermissionDenied(status)) return kExitInputRefused;
  if (IsBadInput(status)) return kExitBadConfiguration;
  return absl::IsInvalidArgument(status) ? kExitBadConfiguration : 1;
}

}  // namespace shardtrain
