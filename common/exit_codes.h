// Exit codes of a rank that mean something to the launchers (shardtrain-train
// --nproc, shardtraind), and the errors that lead to them. An error is
// recognised by a payload, whatever its message says.
#ifndef SHARDTRAIN_COMMON_EXIT_CODES_H_
#define SHARDTRAIN_COMMON_EXIT_CODES_H_

#include <string>

#include "absl/status/status.h"

namespace shardtrain {

// Training diverged: a non-finite loss or gradient norm. The step is
// reported and the run stops; restarting would only diverge again. A code
// no other failure uses (1: an error, 2: a bad configuration).
inline constexpr int kExitDiverged = 86;

// The run's configuration, or a file it names (a model's config.json, a
// tokenizer, the data), was refused (InvalidArgument): a restart would be
// refused the same way.
inline constexpr int kExitBadConfiguration = 2;

// Rank 0 could not bind MASTER_PORT: another process holds it
// (EX_TEMPFAIL). Launchers that picked the port start the ranks again on
// another.
inline constexpr int kExitRendezvousPortTaken = 75;

// A file the run was named was refused: outside shardtraind --path-root, or
// not readable by this user (PermissionDenied; EX_NOPERM). Deterministic:
// a restart would be refused the same way.
inline constexpr int kExitInputRefused = 77;

// The run was asked to stop (SIGUSR1: a preemption, or the cluster
// scheduler's own) and saved a checkpoint at a step boundary first; the job
// resumes from it, so this is no failure.
inline constexpr int kExitPreempted = 85;

absl::Status DivergedError(const std::string& message);
bool IsDiverged(const absl::Status& status);

absl::Status RendezvousPortTakenError(const std::string& message);
bool IsRendezvousPortTaken(const absl::Status& status);

absl::Status PreemptedError(const std::string& message);
bool IsPreempted(const absl::Status& status);

// A file the run names (a model's config.json, its weights index) is
// malformed or hostile: InvalidArgument that stays a bad configuration
// (kExitBadConfiguration) wherever a run's other InvalidArgument errors
// count as failures of the run itself.
absl::Status BadInputError(const std::string& message);
bool IsBadInput(const absl::Status& status);

// The exit code for a run that ended with `status`: 0, kExitDiverged,
// kExitPreempted, kExitRendezvousPortTaken, kExitInputRefused,
// kExitBadConfiguration, else 1.
int ExitCodeFor(const absl::Status& status);

}  // namespace shardtrain

#endif  // SHARDTRAIN_COMMON_EXIT_CODES_H_
