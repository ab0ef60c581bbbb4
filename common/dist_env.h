// DistEnv: where this process sits in a distributed run, read from the same
// variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
// MASTER_PORT), or from Slurm's when `srun` started the process, so shardtrain
// processes start under torchrun-style launchers, srun, `shardtrain-train
// --nproc N` or by hand. Torch-free.
#ifndef SHARDTRAIN_COMMON_DIST_ENV_H_
#define SHARDTRAIN_COMMON_DIST_ENV_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace shardtrain {

struct DistEnv {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  // Processes on this host (LOCAL_WORLD_SIZE; under srun the tasks per
  // node); 0 when nothing says.
  int64_t local_world_size = 0;
  // Host of rank 0's rendezvous store.
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // Where the values came from: "torchrun", "slurm" or "" (one process).
  std::string source;
};

// The variables torchrun sets for a process at `env` (and `group_rank`, its
// node's index): RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, LOCAL_WORLD_SIZE
// (when known), MASTER_ADDR and MASTER_PORT. What every launcher here
// writes (shardtrain-train --nproc, the coordinator's ranks) and what
// ReadDistEnv reads back.
std::vector<std::pair<std::string, std::string>> TorchrunEnvironment(
    const DistEnv& env, int64_t group_rank = 0);

// Returns the value of an environment variable, or nullopt when it is unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

// Reads and validates the variables through `lookup`. Unset means a single
// process: RANK 0, WORLD_SIZE 1, LOCAL_RANK 0 (which defaults to RANK when
// RANK is set), LOCAL_WORLD_SIZE unknown (0), MASTER_ADDR 127.0.0.1,
// MASTER_PORT 29500. RANK and WORLD_SIZE
// must be given together. InvalidArgument names the offending variable and
// its value.
//
// Without RANK/WORLD_SIZE, a process started by srun (SLURM_STEP_ID,
// SLURM_PROCID and SLURM_NTASKS set) takes RANK from SLURM_PROCID,
// WORLD_SIZE from SLURM_NTASKS, LOCAL_RANK from SLURM_LOCALID,
// LOCAL_WORLD_SIZE from SLURM_NTASKS_PER_NODE (or the first count of
// SLURM_TASKS_PER_NODE, "2(x3)" -> 2), MASTER_ADDR
// (unless set) from the first host of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST
// / SLURM_NODELIST, and MASTER_PORT (unless set) from SLURM_JOB_ID, so every
// task of a step agrees without a shared file. A batch script itself (no
// step) stays one process.
absl::StatusOr<DistEnv> DistEnvFromLookup(const EnvLookup& lookup);

// The first host of a Slurm host list: "node[01-03,07],gpu5" -> "node01",
// "rack[1-2]-n[3-4]" -> "rack1-n3". InvalidArgument when it is not one.
absl::StatusOr<std::string> FirstHostOfNodeList(const std::string& list);

// The rendezvous port the tasks of Slurm job `job_id` use when MASTER_PORT
// is not set: in [20000, 40000), a function of the job id only.
int SlurmDefaultPort(int64_t job_id);

// DistEnvFromLookup over this process's environment.
absl::StatusOr<DistEnv> DistEnvFromEnvironment();

}  // namespace shardtrain

#endif  // SHARDTRAIN_COMMON_DIST_ENV_H_
