// The types the JobManager (server/job_manager.h) and its parts (JobTable,
// JobRequests, WorkerReports, AttemptSupervisor) share: its options, its
// observer, the submission check, and the shapes of a listing and of the
// cluster view. Here so that the parts include this, not the facade above
// them.
#ifndef SHARDTRAIN_SERVER_JOB_MANAGER_TYPES_H_
#define SHARDTRAIN_SERVER_JOB_MANAGER_TYPES_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/data/builtin_dataset.h"
#include "server/access_policy.h"
#include "server/device_inventory.h"
#include "server/user_directory.h"
#include "shardtrain/v1/job.pb.h"

namespace shardtrain {

// SUCCEEDED, FAILED and CANCELLED: a job that changes no more.
inline bool IsTerminalJobState(v1::JobState state) {
  return state == v1::SUCCEEDED || state == v1::FAILED ||
         state == v1::CANCELLED;
}

// A class of jobs the operator defines (shardtraind --priority-class); a
// JobSpec names it in priority_class.
struct PriorityClass {
  int priority = 0;
  // false: jobs of this class are never preempted.
  bool preemptible = true;
  // true: users (not only admins) may name it (open=true). A class is an
  // admin's unless an admin opens it: that is how a non-preemptible class,
  // or one above the priorities users may set, is granted to users.
  bool open = false;
};

// --priority-class values ("urgent=100", "prod=50,preemptible=false",
// "batch=10,open=true") by name; InvalidArgument naming the value and what
// is wrong.
absl::StatusOr<std::map<std::string, PriorityClass>> ParsePriorityClasses(
    const std::vector<std::string>& values);

// kBuiltinDataset ("brown"): the one `data` value that is not a path
// (core/data/builtin_dataset.h); the job's ranks prepare it.

// Turns a JobSpec's `data` ("brown" or a directory) into the directory the
// workers read; errors name the field and the problem.
using DataResolver =
    std::function<absl::StatusOr<std::string>(const std::string& data)>;

// Told about every state change and step report (the Prometheus exporter).
class JobObserver {
 public:
  virtual ~JobObserver() = default;
  virtual void OnJobChanged(const v1::Job& job) = 0;
  virtual void OnSteps(const v1::Job& job,
                       const std::vector<v1::StepMetrics>& steps) = 0;
  virtual void OnHeartbeat(const std::string& job_id, int rank,
                           absl::Time time) = 0;
};

struct JobManagerOptions {
  std::string state_dir;       // jobs/<id>/ live here
  std::string worker_binary;   // shardtrain-worker
  std::string worker_address;  // what workers dial (e.g. unix:/.../sock)
  std::vector<DeviceInfo> devices;
  int cpu_cores = 1;  // split among a CPU job's ranks
  absl::Duration grace_period = absl::Seconds(10);
  absl::Duration heartbeat_interval = absl::Seconds(2);
  absl::Duration heartbeat_timeout = absl::Seconds(30);
  absl::Duration rendezvous_timeout = absl::Seconds(300);
  absl::Duration tick = absl::Milliseconds(50);
  int log_tail_lines = 20;
  DataResolver resolve_data;  // required
  // Where a job's data and init_from may be (server/access_policy.h).
  PathRoots path_roots;
  // Submissions are refused while the state directory's file system has
  // less free space than this (a job needs room for logs, checkpoints and
  // its rows).
  int64_t min_free_bytes = int64_t{64} << 20;
  // The classes a JobSpec's priority_class may name.
  std::map<std::string, PriorityClass> priority_classes;
  // The devices a user's jobs may hold at once (0: no cap); null: none.
  std::function<int(const std::string& user)> device_quota;
  // A preempted job's ranks save a checkpoint and stop within this, else
  // they are killed.
  absl::Duration preempt_grace = absl::Seconds(60);
};

// The priority and preemptibility of a job with `spec`: its priority_class's
// when it names one, else spec.priority, preemptible.
PriorityClass EffectivePriority(const JobManagerOptions& options,
                                const v1::JobSpec& spec);
// The world sizes an elastic job with `spec` may run at: from
// elastic.min_world_size to world_size, those at which some mesh of its
// data-parallel strategy (or one replica), with any pipeline stages and
// tensor ranks, shares its global batch (ElasticWorldSizes). Empty when it
// is not elastic.
// `device_memory`: a device's memory (the plans' budget when the job sets
// no memory cap; 0: no limit).
std::vector<int> ElasticWorlds(const v1::JobSpec& spec,
                               int64_t device_memory = 0);

// The least memory of this daemon's devices of `spec`'s kind that report
// it (GPUs); 0 when none do (CPU slots).
int64_t DeviceMemoryFor(const JobManagerOptions& options,
                        const v1::JobSpec& spec);

// options.device_quota for `user` (0: no cap).
int DeviceQuota(const JobManagerOptions& options, const std::string& user);

// The highest raw JobSpec.priority a user (not an admin) may set: the
// highest priority among the classes open to users, or 0 when none is
// (and never below 0: a user may always lower their own jobs).
int UserPriorityCeiling(const JobManagerOptions& options);

// Who may ask for what priority (docs/operations.md, "Roles"): an admin
// anything; a user only classes open to users, and a raw priority no higher
// than UserPriorityCeiling. PermissionDenied naming the field and the rule
// otherwise.
absl::Status CheckPriorityAllowed(const JobManagerOptions& options,
                                  const v1::JobSpec& spec,
                                  const Caller& caller);

// Everything SubmitJob checks before a job is stored: device kind, the
// JobSpec -> TrainConfig validation, world size against the devices, path
// roots, the data directory and init_from. Returns the spec as it will be
// stored (device_kind filled in); InvalidArgument naming the field otherwise.
// Pure but for the file system lookups of data and init_from.
absl::StatusOr<v1::JobSpec> ValidateSubmission(const JobManagerOptions& options,
                                               const v1::JobSpec& spec);

struct ListJobsQuery {
  std::vector<v1::JobState> states;           // empty: all
  std::map<std::string, std::string> labels;  // all must match
  int page_size = 0;                          // 0: 100
  std::string page_token;
};

struct ListJobsPage {
  std::vector<v1::Job> jobs;
  std::string next_page_token;
};

struct ClusterView {
  struct Holder {
    std::string job_id;
    int rank = 0;
  };
  std::vector<DeviceInfo> devices;
  std::vector<Holder> holders;  // parallel to devices; empty job_id = free
  std::vector<v1::Job> queue;   // in scheduling order, state_reason set
  // The head of the queue when it waits, and its predicted start.
  std::string head;
  std::optional<absl::Time> head_predicted_start;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_JOB_MANAGER_TYPES_H_
