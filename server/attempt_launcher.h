// AttemptLauncher: how the JobManager runs one attempt of a job — starts its
// ranks, signals them, learns how they ended, and cleans up what a previous
// coordinator left. Each backend (server/backend.h) has one: LocalJobLauncher
// (ranks are processes on this host, server/local_job_launcher.h),
// SlurmJobLauncher (an attempt is one Slurm allocation,
// server/slurm_job_launcher.h), a fake in tests. The JobManager does not know
// which backend it drives.
//
// The JobManager calls a launcher from its supervisor thread only, and never
// while holding its own lock, so a backend may run slow commands (sbatch);
// ranks a backend spawns may be tied to that thread's life. Cleanup
// (EndLeftovers) runs once, at startup, before the supervisor starts.
#ifndef SHARDTRAIN_SERVER_ATTEMPT_LAUNCHER_H_
#define SHARDTRAIN_SERVER_ATTEMPT_LAUNCHER_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/process_spawner.h"
#include "server/rank_specs.h"
#include "shardtrain/v1/job.pb.h"

namespace shardtrain {

// One started attempt, as its backend describes it to the JobManager and is
// given it back on every later call.
struct Attempt {
  std::string job_id;
  std::string job_dir;
  int number = 1;  // 1 for a job's first attempt
  int world_size = 0;
  // The backend's name for the attempt (a Slurm job id); "" when it has none.
  std::string handle;
  // The attempt in a few words for the job's events ("Slurm job 812"); ""
  // when its ranks are plain local processes.
  std::string summary;
  // Rank r's pid on this host, 0 when the backend does not know it (ranks on
  // other hosts report theirs when they register). pgid: the ranks' process
  // group, 0 when none.
  std::vector<int> pids;
  int pgid = 0;
};

// The record of attempt `number` of `launch` as a AttemptLauncher's Start
// begins it; the backend fills in what it learns (handle, summary, pids, pgid).
inline Attempt NewAttempt(const RankLaunch& launch, int number) {
  Attempt attempt;
  attempt.job_id = launch.job_id;
  attempt.job_dir = launch.job_dir;
  attempt.number = number;
  attempt.world_size = launch.world_size;
  // 0 until known: local ranks as they start, remote ones at registration.
  attempt.pids.assign(launch.world_size, 0);
  return attempt;
}

// How rank `rank` ended.
struct RankEnd {
  int rank = 0;
  ExitStatus status;
};

// Why an attempt ended, when the backend knows better than the ranks' exit
// statuses (Slurm lost a node, srun named the task that was killed).
struct AttemptFailure {
  v1::FailureReason reason = v1::EXIT_CODE;
  int rank = -1;  // -1: no rank is to blame
  std::string message;
  // For rank -1: the backend's own log lines (srun's), oldest first.
  std::vector<std::string> log_lines;
};

// What a backend saw of a running attempt since it was last asked.
struct AttemptReport {
  std::vector<RankEnd> exits;  // ranks that ended, each reported once
  // Non-empty while the backend has not started the ranks yet (waiting for
  // nodes): why. The rendezvous clock starts when it is empty again.
  std::string waiting;
  // Set with the exits of an attempt that failed for a reason of the
  // backend's (absent for exits the ranks' statuses explain).
  std::optional<AttemptFailure> failure;
};

// What a backend can run now; asked when an elastic job must restart.
struct Capacity {
  // Ranks the backend can place now; -1: as many as the coordinator has
  // devices (less lost_devices).
  int slots = -1;
  // Indices into the coordinator's devices that cannot run a rank now.
  std::vector<int> lost_devices;
  // A backend that places ranks itself (no lost_devices): what is lost, in
  // a few words for the job's events ("node3 (DOWN)").
  std::string lost;
};

class AttemptLauncher {
 public:
  virtual ~AttemptLauncher() = default;

  // "local", "slurm": for logs and events.
  virtual std::string name() const = 0;

  // How often Poll is worth calling for one attempt (0: every tick).
  virtual absl::Duration poll_interval() const = 0;

  // Starts every rank of `launch` as attempt `number`, filling `*attempt`
  // as it goes. On error the message says why (it becomes the job's
  // failure), and the ranks whose pid `*attempt` already holds did start:
  // the JobManager stops them.
  virtual absl::Status Start(const RankLaunch& launch, int number,
                             Attempt* attempt) = 0;

  // What happened to `attempt` since the last call; `running[r]` says which
  // ranks the JobManager still counts as running. An error: the backend could
  // not be asked this time (nothing is concluded; asked again later).
  virtual absl::StatusOr<AttemptReport> Poll(
      const Attempt& attempt, const std::vector<bool>& running) = 0;

  // Sends `signal` to the running ranks `ranks` of `attempt`. SIGTERM asks
  // them to stop (a checkpoint-and-exit); SIGKILL ends the attempt whatever
  // the ranks do. Ranks already gone are not signalled.
  virtual void Signal(const Attempt& attempt, const std::vector<int>& ranks,
                      int signal) = 0;

  // What the backend can run now. An error: it could not be asked.
  virtual absl::StatusOr<Capacity> Available() { return Capacity{}; }

  // Ends whatever a previous coordinator left of job `job_id`'s last attempt
  // (`pids`: the rank pids it stored), so that nothing of it runs when the
  // job is started again.
  virtual void EndLeftovers(const std::string& job_id,
                            const std::string& job_dir,
                            const std::vector<int>& pids) = 0;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_ATTEMPT_LAUNCHER_H_
