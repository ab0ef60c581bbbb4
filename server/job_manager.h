// JobManager: owns every job's life in shardtraind. Validates and stores
// submissions, runs the scheduler, launches a job's ranks, takes their
// registrations, progress and heartbeats, notices failures (exit, signal,
// missed heartbeats, rendezvous timeout, out of memory), restarts jobs from
// their last checkpoint when allowed, and recovers after a coordinator
// restart. It includes no gRPC header: the services in this folder are thin
// adapters over it, and tests drive it with a fake launcher and clock. Ranks
// start, stop and end through a Launcher (server/launcher.h): local
// processes or Slurm, the same code here for both.
//
// States: QUEUED -> STARTING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED;
// RUNNING -> RESTARTING -> RUNNING while restarts remain. Every change is
// stored (with an event row) before it becomes visible.
#ifndef SHARDTRAIN_SERVER_JOB_MANAGER_H_
#define SHARDTRAIN_SERVER_JOB_MANAGER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "core/data/builtin_dataset.h"
#include "server/access_policy.h"
#include "server/device_inventory.h"
#include "server/job_store.h"
#include "server/job_watch.h"
#include "server/launcher.h"
#include "server/rank_specs.h"
#include "server/scheduler.h"
#include "shardtrain/v1/job.pb.h"
#include "shardtrain/v1/worker_service.pb.h"

namespace shardtrain {

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
};

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
};

class JobManager {
 public:
  // Loads the store. Nothing is changed until ResumeInterruptedJobs().
  static absl::StatusOr<std::unique_ptr<JobManager>> Create(
      JobManagerOptions options, JobStore* store, Launcher* launcher,
      Clock* clock, JobObserver* observer = nullptr);

  ~JobManager();
  JobManager(const JobManager&) = delete;
  JobManager& operator=(const JobManager&) = delete;

  // Deals with jobs the previous coordinator left active, once this one is
  // sure to serve (so a coordinator that fails to start uses up no
  // restarts): leftover workers are killed; a job whose cancel was requested
  // ends CANCELLED; others restart from their last checkpoint when restarts
  // remain, else end FAILED with COORDINATOR_RESTART. Queued jobs stay
  // queued.
  void ResumeInterruptedJobs();

  // Starts the supervisor thread (Tick every options.tick). Workers are
  // spawned from it, so they die with it.
  void Start();
  // Stops all workers (TERM, KILL after the grace period), reaps them and
  // closes the watchers. Jobs that were running stay RUNNING in the store,
  // so the next coordinator resumes or fails them. Idempotent.
  void Shutdown();

  // One supervision round: reap, detect failures, finish stops, schedule and
  // launch (the launch's file work outside the lock). Called by the
  // supervisor thread; tests call it directly.
  void Tick();

  // --- JobService ---
  // InvalidArgument names the field; nothing is stored then.
  absl::StatusOr<v1::Job> Submit(const v1::JobSpec& spec);
  absl::StatusOr<v1::Job> Get(const std::string& job_id) const;
  absl::StatusOr<ListJobsPage> List(const ListJobsQuery& query) const;
  absl::StatusOr<v1::Job> Cancel(const std::string& job_id);
  absl::StatusOr<std::vector<v1::StepMetrics>> Metrics(
      const std::string& job_id, std::optional<int> rank,
      int64_t from_step) const;
  // The job as it is now is the watch's first event; it closes after the
  // job's terminal state change.
  absl::StatusOr<std::shared_ptr<JobWatch>> Watch(const std::string& job_id);
  // state-dir/jobs/<id>/rank-<r>.log, and the job's world size.
  absl::StatusOr<std::vector<std::string>> LogPaths(
      const std::string& job_id) const;
  ClusterView Cluster() const;

  // Replaces options.worker_address (known only once the server listens).
  void set_worker_address(std::string address);

  // --- WorkerService: PermissionDenied unless the identity is a rank of a
  // live job's current attempt presenting its secret. ---
  absl::Status RegisterWorker(const v1::WorkerIdentity& worker);
  // Stores the steps; returns whether the worker should stop.
  absl::StatusOr<bool> ReportProgress(
      const v1::WorkerIdentity& worker,
      const std::vector<v1::StepMetrics>& steps);
  absl::StatusOr<bool> Heartbeat(const v1::WorkerIdentity& worker);

  static bool IsTerminal(v1::JobState state);

 private:
  enum class StopIntent { kNone, kCancel, kFail, kShutdown };
  struct RankProcess {
    int pid = 0;  // 0 until known: a rank on another host tells at register
    bool exited = false;
    ExitStatus exit;
    bool registered = false;
    absl::Time last_heartbeat;
  };
  struct Entry {
    StoredJob stored;
    std::vector<int> devices;
    std::vector<RankProcess> ranks;
    absl::Time launch_time;
    StopIntent stop = StopIntent::kNone;
    absl::Time stop_deadline;
    bool killed = false;
    std::optional<v1::Failure> failure;  // the first failure of the attempt
    bool no_restart = false;             // the attempt could not even start
    // Rank 0 found the picked rendezvous port taken (kExitRendezvousPortTaken):
    // the attempt starts again on another port without using a restart.
    bool port_taken = false;
    int port_retries = 0;
    bool relaunch_pending = false;  // recovered; Tick relaunches it
    // An elastic job's restart, waiting for Tick to learn what the launcher
    // can run (RestartElastic).
    bool elastic_restart = false;
    bool elastic_restart_counted = false;  // already in Job.restarts
    bool launching = false;  // RequestLaunch done, CompleteLaunch not yet
    // The attempt as its launcher started it; polled from next_poll on.
    Attempt attempt;
    absl::Time next_poll;
    std::vector<std::weak_ptr<JobWatch>> watchers;
    // Changes that happened (a rank exited, a launch failed) but could not
    // be stored (a full disk): the record in memory is newer than the
    // store's, and these events wait, in order, for StoreUnsaved.
    bool unsaved = false;
    std::vector<v1::JobEvent> unsaved_events;
  };

  JobManager(JobManagerOptions options, JobStore* store, Launcher* launcher,
             Clock* clock, JobObserver* observer);

  absl::Status Load();
  void SupervisorLoop();

  Entry* Find(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  absl::StatusOr<Entry*> Authenticate(const v1::WorkerIdentity& worker)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Stores the new state with an event and tells watchers and the observer.
  // What already happened (a rank exited) is recorded even when the store
  // fails: it is kept as unsaved and stored once the store accepts it.
  void SetState(Entry& entry, v1::JobState state, const std::string& message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // SetState for a change a client asks for: stored first, and on a store
  // failure nothing changes and the error is returned, so that nothing is
  // acknowledged that a restarted coordinator would not know (unless
  // even_if_not_stored: then memory changes anyway and the error is still
  // returned).
  absl::Status CommitState(Entry& entry, v1::JobState state,
                           const std::string& message,
                           bool even_if_not_stored = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Tells watchers and the observer of the state entry now holds.
  void Announce(Entry& entry, const v1::JobEvent& event)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Stores entry.stored (and `event`); when the store fails the change is
  // kept as unsaved and stored by a later tick (StoreUnsaved).
  void Persist(Entry& entry, const std::optional<v1::JobEvent>& event)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Stores `record` with `event`, after whatever of this job is still
  // unsaved (so events stay in order). On failure nothing new is stored.
  absl::Status Store(Entry& entry, const StoredJob& record,
                     const std::optional<v1::JobEvent>& event)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Remembers a change the store refused, for StoreUnsaved.
  void KeepUnsaved(Entry& entry, const std::optional<v1::JobEvent>& event,
                   const absl::Status& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Retries every job's unsaved changes (each tick, until space returns).
  void StoreUnsaved() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // A launch decided under the lock, prepared outside it.
  struct LaunchRequest {
    v1::JobSpec spec;
    int attempt = 1;
    bool first_attempt = true;
    absl::Time started;
    RankLaunch launch;  // all but master_port
  };
  struct PreparedLaunch {
    std::string error;     // non-empty: the launch failed
    bool skipped = false;  // stopped before the launcher was asked
    Attempt attempt;       // what the launcher started (see Launcher::Start)
    std::optional<int64_t> train_tokens;
  };
  // Takes the devices and queues the launch for the end of this Tick.
  void RequestLaunch(Entry& entry, const std::vector<int>& devices)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // The launch's file system work (job directory, data, spec.json, log
  // headers), then the launcher's Start unless the job was stopped
  // meanwhile. Called without the lock.
  PreparedLaunch PrepareLaunch(const LaunchRequest& request)
      ABSL_LOCKS_EXCLUDED(mutex_);
  // Records the started attempt (or why it did not start).
  void CompleteLaunch(Entry& entry, const LaunchRequest& request,
                      const PreparedLaunch& prepared)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Tick's locked part: reap, detect, finish stops, schedule.
  void Supervise() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void BeginStop(Entry& entry, StopIntent intent)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void FailAttempt(Entry& entry, v1::Failure failure)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // All ranks of the attempt are gone: decide what happens next.
  void FinishAttempt(Entry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Heartbeats, the rendezvous deadline and the stop deadline; finishes the
  // attempt once all its ranks have ended.
  void Detect(Entry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // An attempt due to be asked how its ranks are (outside the lock).
  struct Poll {
    std::string job_id;
    Attempt attempt;
    std::vector<bool> running;
    absl::StatusOr<AttemptReport> report = absl::UnknownError("not asked");
  };
  std::vector<Poll> DuePolls() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Ranks that ended are recorded (the first failure fails the attempt);
  // an attempt still waiting for its backend restarts the rendezvous clock.
  void ApplyPoll(const Poll& poll) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Why rank `rank` ended as it did, when that is a failure.
  v1::Failure RankExitFailure(const Entry& entry, int rank,
                              const ExitStatus& exit)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Queues `signal` for the attempt's running ranks; Tick sends it without
  // the lock.
  void SignalRanks(Entry& entry, int signal)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // The queued signals, for the ranks running now.
  struct PendingSignal {
    Attempt attempt;
    std::vector<int> ranks;
    int signal = 0;
  };
  std::vector<PendingSignal> TakeSignals()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void SendSignals(const std::vector<PendingSignal>& signals)
      ABSL_LOCKS_EXCLUDED(mutex_);
  // Restarts the elastic jobs waiting to, each at the largest world size in
  // [elastic.min_world_size, world_size] that `capacity` and the free
  // devices allow and that shares the global batch equally; fails those
  // that cannot continue.
  void RestartElastic(const absl::StatusOr<Capacity>& capacity)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void ScheduleQueued() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void ReleaseDevices(Entry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  std::vector<int> FreeDevices() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // The queued jobs, unsorted, as the scheduler takes them.
  std::vector<QueuedJobRef> QueuedRefs() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // An event stamped with the clock's time.
  v1::JobEvent Event(v1::JobState state, std::string message) const;
  // A failure of `rank`, with the last lines of that rank's log.
  v1::Failure RankFailure(const std::string& job_id, int rank,
                          v1::FailureReason reason, std::string message) const;
  std::string JobDir(const std::string& job_id) const;
  std::string LogPath(const std::string& job_id, int rank) const;

  const JobManagerOptions options_;
  JobStore* const store_;
  Launcher* const launcher_;
  Clock* const clock_;
  JobObserver* const observer_;

  mutable absl::Mutex mutex_;
  std::map<std::string, std::unique_ptr<Entry>> jobs_ ABSL_GUARDED_BY(mutex_);
  std::vector<std::string> order_ ABSL_GUARDED_BY(mutex_);  // by seq
  int64_t next_seq_ ABSL_GUARDED_BY(mutex_) = 1;
  std::vector<std::string> device_holder_ ABSL_GUARDED_BY(mutex_);
  // Devices the launcher last reported lost (Launcher::Available).
  std::set<int> lost_devices_ ABSL_GUARDED_BY(mutex_);
  std::map<std::string, std::string> waiting_reason_ ABSL_GUARDED_BY(mutex_);
  bool shutting_down_ ABSL_GUARDED_BY(mutex_) = false;
  // Some entry is unsaved: StoreUnsaved has work (saves a pass over every
  // job on each tick otherwise).
  bool any_unsaved_ ABSL_GUARDED_BY(mutex_) = false;
  std::string worker_address_ ABSL_GUARDED_BY(mutex_);
  std::vector<LaunchRequest> launch_requests_ ABSL_GUARDED_BY(mutex_);
  // Job id -> signal for its attempt's ranks, for Tick to send.
  std::vector<std::pair<std::string, int>> signals_ ABSL_GUARDED_BY(mutex_);

  absl::Notification stop_supervisor_;
  std::thread supervisor_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_JOB_MANAGER_H_
