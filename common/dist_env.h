// DistEnv: where this process sits in a distributed run, read from the same
// variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
// MASTER_PORT), so shardtrain processes start under torchrun-style launchers,
// Slurm scripts, `shardtrain-train --nproc N` or by hand. Torch-free.
#ifndef SHARDTRAIN_COMMON_DIST_ENV_H_
#define SHARDTRAIN_COMMON_DIST_ENV_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace shardtrain {

struct DistEnv {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  // Host of rank 0's rendezvous store.
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
};

// Returns the value of an environment variable, or nullopt when it is unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

// Reads and validates the variables through `lookup`. Unset means a single
// process: RANK 0, WORLD_SIZE 1, LOCAL_RANK 0 (which defaults to RANK when
// RANK is set), MASTER_ADDR 127.0.0.1, MASTER_PORT 29500. RANK and WORLD_SIZE
// must be given together. InvalidArgument names the offending variable and
// its value.
absl::StatusOr<DistEnv> DistEnvFromLookup(const EnvLookup& lookup);

// DistEnvFromLookup over this process's environment.
absl::StatusOr<DistEnv> DistEnvFromEnvironment();

}  // namespace shardtrain

#endif  // SHARDTRAIN_COMMON_DIST_ENV_H_
