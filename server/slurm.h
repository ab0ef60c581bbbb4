// Slurm as shardtraind's second launcher (`--launcher slurm`): an attempt of
// a job is one `sbatch` allocation of world-size tasks over the nodes it
// needs; its batch script `srun`s shardtrain-worker once per rank. The
// coordinator never places ranks itself: Slurm does.
//
// SlurmClient is the interface the JobManager talks to (sbatch, scontrol,
// sacct, scancel, sinfo); CommandSlurmClient runs Slurm's commands, tests use
// a fake. The parsers and the batch script are pure functions, tested on
// output recorded from Debian's slurm-wlm 22.05.
#ifndef SHARDTRAIN_SERVER_SLURM_H_
#define SHARDTRAIN_SERVER_SLURM_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/rank_specs.h"
#include "shardtrain/v1/job.pb.h"

namespace shardtrain {

struct SlurmOptions {
  std::string partition;   // "" = the cluster's default partition
  int tasks_per_node = 1;  // ranks per node (CPU jobs)
  int gpus_per_node = 0;   // > 0: GPU jobs, one rank per GPU
  int cpus_per_task = 1;   // threads of a CPU rank
  // Passed to sbatch as they are (e.g. --account=ml, --time=2:00:00).
  std::vector<std::string> extra_sbatch_args;
  double command_timeout_seconds = 30;
};

// A Slurm job as `scontrol show job` or `sacct` describes it.
struct SlurmJobInfo {
  std::string job_id;
  std::string state;   // PENDING, RUNNING, COMPLETED, FAILED, NODE_FAIL ...
  std::string reason;  // Reason= (Resources, NonZeroExitCode, NodeDown ...)
  int exit_code = 0;   // ExitCode=<code>:<signal>
  int signal = 0;
  std::string nodes;       // NodeList
  std::string batch_host;  // BatchHost

  // Slurm will not run it any more.
  bool Ended() const;
  // Still waiting for its nodes (PENDING, CONFIGURING, REQUEUED ...).
  bool Waiting() const;
};

struct SlurmNode {
  std::string name;
  std::string address;  // NodeAddr
  std::string state;    // IDLE, ALLOCATED, MIXED, DOWN*, DRAINED ...
  int cpus = 0;
  int cpus_allocated = 0;
  int gpus = 0;  // from Gres=gpu[:type]:N
  std::vector<std::string> partitions;
};

struct SlurmPartition {
  std::string name;
  std::string state;  // UP, DOWN, DRAIN, INACTIVE
  std::string nodes;  // host list, e.g. node[1-3]
  int total_nodes = 0;
  int total_cpus = 0;
  bool is_default = false;
};

// `sbatch` arguments, the batch script and the environment of one attempt.
struct SlurmLaunchPlan {
  std::vector<std::string> sbatch_args;  // without the script's path
  std::string script;
  std::vector<std::pair<std::string, std::string>> env;
};

// What an attempt's end means to the JobManager.
struct SlurmOutcome {
  bool success = false;
  v1::FailureReason reason = v1::FAILURE_REASON_UNSPECIFIED;
  int rank = -1;  // the rank that failed first, -1 when Slurm does not say
  int exit_code = -1;
  int signal = 0;
  std::string message;
  // Preempted, by Slurm (state PREEMPTED) or by shardtraind: the ranks were
  // asked to save a checkpoint and stop (exit code kExitPreempted). Not a
  // failure; the job is queued again.
  bool preempted = false;
};

class SlurmClient {
 public:
  virtual ~SlurmClient() = default;
  // Runs sbatch; returns the Slurm job id.
  virtual absl::StatusOr<std::string> Submit(
      const SlurmLaunchPlan& plan, const std::string& script_path) = 0;
  // NotFound when Slurm has no record of the job.
  virtual absl::StatusOr<SlurmJobInfo> Query(const std::string& job_id) = 0;
  // Sends `signal` to the job's tasks (a pending job is cancelled instead).
  virtual absl::Status Signal(const std::string& job_id, int signal) = 0;
  // Ends the job: its tasks get SIGKILL after Slurm's KillWait.
  virtual absl::Status Cancel(const std::string& job_id) = 0;
  virtual absl::StatusOr<std::vector<SlurmNode>> Nodes() = 0;
  virtual absl::StatusOr<std::vector<SlurmPartition>> Partitions() = 0;
};

// Runs Slurm's client commands (found on PATH; SLURM_CONF is honoured as
// Slurm itself honours it). Every command is bounded by
// options.command_timeout_seconds.
class CommandSlurmClient : public SlurmClient {
 public:
  explicit CommandSlurmClient(SlurmOptions options);
  absl::StatusOr<std::string> Submit(const SlurmLaunchPlan& plan,
                                     const std::string& script_path) override;
  absl::StatusOr<SlurmJobInfo> Query(const std::string& job_id) override;
  absl::Status Signal(const std::string& job_id, int signal) override;
  absl::Status Cancel(const std::string& job_id) override;
  absl::StatusOr<std::vector<SlurmNode>> Nodes() override;
  absl::StatusOr<std::vector<SlurmPartition>> Partitions() override;

 private:
  SlurmOptions options_;
};

// The arguments, script and environment of one attempt: world-size tasks on
// ceil(world / ranks-per-node) nodes, per-rank logs in the job directory
// (`srun --output <job_dir>/rank-%t.log`), srun's own messages in
// `batch_log`. The environment carries the coordinator's address and the
// attempt's secret, never RANK/WORLD_SIZE: ranks read Slurm's variables.
SlurmLaunchPlan PlanSlurmLaunch(const RankLaunch& launch,
                                const SlurmOptions& options,
                                const std::string& batch_log);

// Parsers. `text` is the command's stdout.
// `scontrol show job -o <id>` (one line of Key=Value pairs).
absl::StatusOr<SlurmJobInfo> ParseScontrolJob(const std::string& text);
// `sacct -n -P -X -o JobID,State,ExitCode,NodeList -j <id>`.
absl::StatusOr<SlurmJobInfo> ParseSacctJob(const std::string& text);
// `scontrol show node -o` and `scontrol show partition -o`.
std::vector<SlurmNode> ParseScontrolNodes(const std::string& text);
std::vector<SlurmPartition> ParseScontrolPartitions(const std::string& text);
// `sbatch --parsable`: "<id>" or "<id>;<cluster>".
absl::StatusOr<std::string> ParseSbatchJobId(const std::string& text);

// Why an ended attempt ended: Slurm's record of the job and the lines srun
// wrote to the batch log ("srun: error: node2: task 1: Killed").
SlurmOutcome ClassifySlurmEnd(const SlurmJobInfo& info,
                              const std::vector<std::string>& batch_log);

// The partition's ranks: all its nodes', and those of the nodes usable now
// (not DOWN, DRAINED, FAIL, not responding, powered down ...), with the
// unusable nodes named "node3 (DOWN*)".
struct SlurmCapacity {
  int slots = 0;
  int usable_slots = 0;
  std::vector<std::string> unusable_nodes;
};
// Whether a node in `state` (scontrol's State=) can take a job now: not
// DOWN, DRAINED, failing, rebooting, in maintenance or not responding ("*").
// A powered-down cloud node can: Slurm powers it up for a job.
bool SlurmNodeUsable(const std::string& state);
absl::StatusOr<SlurmCapacity> SlurmPartitionCapacity(
    const std::vector<SlurmNode>& nodes,
    const std::vector<SlurmPartition>& partitions, const SlurmOptions& options);

// Ranks Slurm can run at once in the partition (options.partition, else the
// default one): its nodes times GPUs (or tasks) per node.
// FailedPrecondition naming the partition when there is none or it is empty.
absl::StatusOr<int> SlurmSlotCount(
    const std::vector<SlurmNode>& nodes,
    const std::vector<SlurmPartition>& partitions, const SlurmOptions& options);

// `text` quoted for a POSIX shell.
std::string ShellQuote(const std::string& text);

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_SLURM_H_
