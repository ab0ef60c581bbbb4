// AttemptSupervisor: the JobManager's supervisor — runs each job's attempts
// over the shared JobTable. Each Tick it polls the launcher for ranks that
// ended, detects failures (exit, signal, missed heartbeats, rendezvous
// timeout, out of memory), stops attempts (TERM, KILL after the grace
// period), decides what follows an attempt (success, a restart from the last
// checkpoint, an elastic restart at a smaller size, failure), schedules
// queued jobs and launches them. It also resumes the jobs a previous
// coordinator left active, and stops every attempt at shutdown.
//
// Locking: decisions are made under the table's mutex; the launcher (Poll,
// Signal, Available, Start) and the file system work of a launch are only
// ever called with it released, so heartbeats and RPCs are never held up by
// a backend or a disk. Signals and launches decided under the mutex are
// queued and carried out by Tick once it is released. attempt_launch.cc holds
// the launch (RequestLaunch, PrepareLaunch, CompleteLaunch).
#ifndef SHARDTRAIN_SERVER_ATTEMPT_SUPERVISOR_H_
#define SHARDTRAIN_SERVER_ATTEMPT_SUPERVISOR_H_

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "server/attempt_launcher.h"
#include "server/job_table.h"
#include "shardtrain/v1/job.pb.h"

namespace shardtrain {

class AttemptSupervisor {
 public:
  // Neither is owned; `launcher` starts, polls, signals and ends the ranks.
  AttemptSupervisor(JobTable* table, AttemptLauncher* launcher);
  // Shutdown(), unless already done.
  ~AttemptSupervisor();
  AttemptSupervisor(const AttemptSupervisor&) = delete;
  AttemptSupervisor& operator=(const AttemptSupervisor&) = delete;

  // The contracts of these four are JobManager's (server/job_manager.h).
  void ResumeInterruptedJobs() ABSL_LOCKS_EXCLUDED(table_->mutex);
  void Start();
  void Shutdown() ABSL_LOCKS_EXCLUDED(table_->mutex);
  void Tick() ABSL_LOCKS_EXCLUDED(table_->mutex);

  // Starts stopping the attempt's ranks (TERM now, KILL at the grace
  // period's end); `intent` decides what FinishAttempt makes of the job.
  void BeginStop(JobEntry& entry, StopIntent intent)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_->mutex);

  // Asks the attempt's ranks to save a checkpoint at the next step boundary
  // and stop (SIGUSR1; SIGKILL after options.preempt_grace): PREEMPTED now,
  // QUEUED once they have, for `for_job`'s sake.
  // With shrink_to > 0 the job continues at that many ranks on some of its
  // devices instead (re-meshed; an elastic job).
  void BeginPreempt(JobEntry& entry, const std::string& for_job,
                    int shrink_to = 0)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_->mutex);
  // The same request for an elastic job that grows to `growth.to_world`
  // ranks onto `growth.devices` (reserved for it now).
  void BeginGrow(JobEntry& entry, const Growth& growth)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_->mutex);

  // What the ranks of later launches dial.
  void set_worker_address(std::string address)
      ABSL_LOCKS_EXCLUDED(table_->mutex);

 private:
  // A launch decided under the lock, prepared outside it.
  struct LaunchRequest {
    v1::JobSpec spec;
    int attempt = 1;
    bool first_attempt = true;
    // An elastic job whose mesh changes (Remesh): its own mesh is predicted
    // too when it grows back to its own world size.
    bool remesh = false;
    absl::Time started;
    RankLaunch launch;  // all but master_port
  };
  struct PreparedLaunch {
    std::string error;     // non-empty: the launch failed
    bool skipped = false;  // stopped before the launcher was asked
    Attempt attempt;  // what the launcher started (see AttemptLauncher::Start)
    std::optional<int64_t> train_tokens;
    // The step-time model's seconds for its steps (PredictedRunSeconds).
    double predicted_seconds = 0;
    // Strategy auto: the mesh chosen for this attempt (MeshName).
    std::string auto_mesh;
    // An elastic job at another world size: the mesh chosen for it, its
    // predicted tokens/s (0: no rates) and why (ChooseElasticMesh).
    std::string elastic_mesh;
    double elastic_predicted = 0;
    std::string elastic_why;
  };
  // An attempt due to be asked how its ranks are (outside the lock).
  struct Poll {
    std::string job_id;
    Attempt attempt;
    std::vector<bool> running;
    absl::StatusOr<AttemptReport> report = absl::UnknownError("not asked");
  };
  // The queued signals, for the ranks running now.
  struct PendingSignal {
    Attempt attempt;
    std::vector<int> ranks;
    int signal = 0;
  };

  void SupervisorLoop();
  // Tick's locked part: detect, finish stops, relaunch recovered jobs,
  // schedule.
  void Supervise() ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_->mutex);
  // Heartbeats, the rendezvous deadline and the stop deadline; finishes the
  // attempt once all its ranks have ended.
  void Detect(JobEntry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_->mutex);
  // Records the attempt's first failure and stops its ranks.
  void FailAttempt(JobEntry& entry, v1::Failure failure)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_->mutex);
  // All ranks of the attempt are gone: decide what happens next.
  void FinishAttempt(JobEntry& entry)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_->mutex);
  // Forgets the attempt: its ranks, handle, stop, failure and pids.
  static void ClearAttempt(JobEntry& entry);

  std::vector<Poll> DuePolls() ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_->mutex);
  // Ranks that ended are recorded (the first failure fails the attempt);
  // an attempt still waiting for its backend restarts the rendezvous clock.
  void ApplyPoll(const Poll& poll) ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_->mutex);
  // Why rank `rank` ended as it did, when that is a failure.
  v1::Failure RankExitFailure(const JobEntry& entry, int rank,
                              const ExitStatus& exit)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_->mutex);

  // Queues `signal` for the attempt's running ranks; Tick sends it without
  // the lock.
  void SignalRanks(JobEntry& entry, int signal)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_->mutex);
  std::vector<PendingSignal> TakeSignals()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_->mutex);
  void SendSignals(const std::vector<PendingSignal>& signals)
      ABSL_LOCKS_EXCLUDED(table_->mutex);

  // Restarts the elastic jobs waiting to, each at the largest world size in
  // [elastic.min_world_size, world_size] that `capacity` and the free
  // devices allow and that shares the global batch equally; fails those
  // that cannot continue.
  void RestartElastic(const absl::StatusOr<Capacity>& capacity)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_->mutex);
  // One job of RestartElastic; `failure` is the attempt's that ended.
  void RestartElasticJob(JobEntry& entry, const Capacity& capacity,
                         const std::set<int>& lost,
                         std::optional<v1::Failure> failure)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_->mutex);
  void ScheduleQueued() ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_->mutex);
  // A re-meshing preemption's ranks have stopped: the job continues at
  // `world` ranks on the first of `devices` (its checkpoint loads at any
  // world size), RESTARTING without using a restart.
  void Remesh(JobEntry& entry, int world, const std::vector<int>& devices,
              const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_->mutex);

  // A launch in three parts (attempt_launch.cc). Takes the devices and
  // queues the launch for the end of this Tick.
  void RequestLaunch(JobEntry& entry, const std::vector<int>& devices)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_->mutex);
  // The launch's file system work (job directory, data, spec.json, log
  // headers), then the launcher's Start unless the job was stopped
  // meanwhile. Called without the lock.
  PreparedLaunch PrepareLaunch(const LaunchRequest& request)
      ABSL_LOCKS_EXCLUDED(table_->mutex);
  // Records the started attempt (or why it did not start).
  void CompleteLaunch(JobEntry& entry, const LaunchRequest& request,
                      const PreparedLaunch& prepared)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_->mutex);
  // CompleteLaunch's record of which ranks run; how many do.
  int RecordStartedRanks(JobEntry& entry, const LaunchRequest& request,
                         const PreparedLaunch& prepared)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_->mutex);

  JobTable* const table_;
  AttemptLauncher* const launcher_;

  std::string worker_address_ ABSL_GUARDED_BY(table_->mutex);
  std::vector<LaunchRequest> launch_requests_ ABSL_GUARDED_BY(table_->mutex);
  // Job id -> signal for its attempt's ranks, for Tick to send.
  std::vector<std::pair<std::string, int>> signals_
      ABSL_GUARDED_BY(table_->mutex);

  absl::Notification stop_thread_;
  std::thread thread_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_ATTEMPT_SUPERVISOR_H_
