// JobTable: what the job manager knows of every job, shared by its three
// faces (JobRequests for clients, WorkerReports for the ranks,
// AttemptSupervisor for the supervisor thread), and the one path by which a
// job's change reaches the store, its watchers and the observer.
//
// Locking: `mutex` guards every entry, the device holders and the shutdown
// flag. A face takes it for one request or one supervision round and calls
// the functions here with it held; nothing here takes it (but Load) or waits
// on anything but the store.
//
// Stored before visible: a state change is written (the record and an event,
// one transaction) before a watcher, the observer or a client sees it. A
// change that already happened (a rank exited) but that the store refuses (a
// full disk) is kept in memory as unsaved and written by a later tick
// (StoreUnsaved), its events still in order.
#ifndef SHARDTRAIN_SERVER_JOB_TABLE_H_
#define SHARDTRAIN_SERVER_JOB_TABLE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "server/attempt_launcher.h"
#include "server/job_manager_types.h"
#include "server/job_store.h"
#include "server/job_watch.h"
#include "server/scheduler.h"
#include "shardtrain/v1/job.pb.h"

namespace shardtrain {

// Why an attempt's ranks are being stopped, and so what becomes of the job
// once they have (AttemptSupervisor::FinishAttempt).
// kPreempt: the ranks were asked to save a checkpoint and stop (SIGUSR1),
// and the job is queued again once they have.
enum class StopIntent { kNone, kCancel, kFail, kShutdown, kPreempt };

// One rank of a job's current attempt.
struct RankProcess {
  int pid = 0;  // 0 until known: a rank on another host tells at register
  bool exited = false;
  ExitStatus exit;
  bool registered = false;
  absl::Time last_heartbeat;
};

// One job: its stored record and, while it has one, its current attempt.
struct JobEntry {
  StoredJob stored;
  std::vector<int> devices;
  std::vector<RankProcess> ranks;
  absl::Time launch_time;
  // The step-time model's seconds for all of the attempt's steps, from this
  // host's cached rates (0: none): its end until rank 0 reports a step.
  double predicted_seconds = 0;
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
  // can run (AttemptSupervisor::RestartElastic).
  bool elastic_restart = false;
  bool elastic_restart_counted = false;  // already in Job.restarts
  // The world sizes an elastic job may be re-meshed to (ElasticWorlds);
  // empty for others.
  std::vector<int> elastic_worlds;
  bool launching = false;  // RequestLaunch done, CompleteLaunch not yet
  // A preemption that re-meshes (kPreempt with remesh_to > 0): once the
  // ranks have saved their checkpoint, the job continues at remesh_to ranks
  // on remesh_devices (shrunk: some of its own; grown: its own and the free
  // ones reserved for it) instead of being queued again.
  int remesh_to = 0;
  std::vector<int> remesh_devices;
  std::string remesh_why;
  // A re-meshed attempt's first step is compared with the pace before.
  absl::Time remesh_started = absl::InfinitePast();
  double remesh_tokens_per_second = 0;
  std::string remesh_from;  // the mesh before
  // The step-time model's tokens/s for the mesh it continued on (0: none).
  double remesh_predicted = 0;
  // Goodput accounting (Job.device_seconds_held and _kept): since when the
  // devices it holds were last counted, and rank 0's seconds and world size
  // of each step (index step - 1), so that a step run again replaces its
  // earlier run.
  absl::Time held_since = absl::InfinitePast();
  std::vector<float> step_seconds;
  std::vector<uint16_t> step_world;
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

// Job.resize_reason of a re-mesh ("shrunk from 4 to 2 ranks for job-…",
// "grown from 2 to 3 ranks …"), as against an elastic restart after a loss.
inline constexpr char kShrunkReason[] = "shrunk from ";
inline constexpr char kGrownReason[] = "grown from ";
bool IsRemeshReason(const std::string& resize_reason);

class JobTable {
 public:
  JobTable(JobManagerOptions options, JobStore* store, Clock* clock,
           JobObserver* observer);
  JobTable(const JobTable&) = delete;
  JobTable& operator=(const JobTable&) = delete;

  // Reads the store's jobs. FailedPrecondition when the store is empty but
  // job directories remain (a lost or truncated database would otherwise
  // hand their ids to new jobs).
  absl::Status Load() ABSL_LOCKS_EXCLUDED(mutex);

  // Adds a job (its record's seq and id set) after those already here.
  void Add(std::unique_ptr<JobEntry> entry)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);
  // nullptr when no job has this id.
  JobEntry* Find(const std::string& job_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);

  // Stores the new state with an event and tells watchers and the observer.
  // What already happened (a rank exited) is recorded even when the store
  // fails: it is kept as unsaved and stored once the store accepts it.
  void SetState(JobEntry& entry, v1::JobState state, const std::string& message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);
  // SetState for a change a client asks for: stored first, and on a store
  // failure nothing changes and the error is returned, so that nothing is
  // acknowledged that a restarted coordinator would not know (unless
  // even_if_not_stored: then memory changes anyway and the error is still
  // returned).
  absl::Status CommitState(JobEntry& entry, v1::JobState state,
                           const std::string& message,
                           bool even_if_not_stored = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);
  // Tells watchers and the observer of the state entry now holds; closes the
  // watchers once it is terminal.
  void Announce(JobEntry& entry, const v1::JobEvent& event)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);
  // Stores entry.stored (and `event`); when the store fails the change is
  // kept as unsaved and stored by a later tick (StoreUnsaved).
  void Persist(JobEntry& entry, const std::optional<v1::JobEvent>& event)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);
  // Stores `record` with `event`, after whatever of this job is still
  // unsaved (so events stay in order). On failure nothing new is stored.
  absl::Status Store(JobEntry& entry, const StoredJob& record,
                     const std::optional<v1::JobEvent>& event)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);
  // Remembers a change the store refused, for StoreUnsaved.
  void KeepUnsaved(JobEntry& entry, const std::optional<v1::JobEvent>& event,
                   const absl::Status& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);
  // Retries every job's unsaved changes (each tick, until space returns).
  void StoreUnsaved() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);

  // Devices no job holds and the launcher has not reported lost.
  std::vector<int> FreeDevices() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);
  // Gives back the devices entry holds.
  void ReleaseDevices(JobEntry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);
  // Adds the device-seconds entry's devices were held since the last count
  // to Job.device_seconds_held; counting goes on from now while `holding`.
  void CountHeldDevices(JobEntry& entry, bool holding)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);
  // Counts rank 0's `step` into Job.device_seconds_kept (replacing an
  // earlier run of the same step).
  void CountKeptStep(JobEntry& entry, const v1::StepMetrics& step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);
  // The queued jobs, unsorted, as the scheduler takes them.
  std::vector<QueuedJobRef> QueuedRefs() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);
  // The devices each owner's jobs hold (those reserved to grow onto
  // included), but `except_job`'s: what a grant to that job is checked
  // against.
  QuotaLedger HeldDevices(const std::string& except_job) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);
  // Everything the scheduler decides on: the queue, the free devices, the
  // jobs holding devices (with their predicted ends) and the quotas.
  ScheduleInput SchedulerInput() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);

  // An event stamped with the clock's time.
  v1::JobEvent Event(v1::JobState state, std::string message) const;
  // A failure of `rank`, with the last lines of that rank's log.
  v1::Failure RankFailure(const std::string& job_id, int rank,
                          v1::FailureReason reason, std::string message) const;
  // state-dir/jobs/<id>, and rank r's log in it.
  std::string JobDir(const std::string& job_id) const;
  std::string LogPath(const std::string& job_id, int rank) const;

  // STARTING, RUNNING, RESTARTING or PREEMPTED: the job has, or is getting,
  // an attempt.
  static bool IsActive(v1::JobState state);
  static const char* StateName(v1::JobState state);
  // A fresh secret for a job's ranks to present.
  static std::string NewSecret();
  // One timestamped line of the coordinator's log (stderr).
  static void Log(const std::string& message);

  const JobManagerOptions options;
  JobStore* const store;
  Clock* const clock;
  JobObserver* const observer;  // may be null

  mutable absl::Mutex mutex;
  std::map<std::string, std::unique_ptr<JobEntry>> jobs ABSL_GUARDED_BY(mutex);
  std::vector<std::string> order ABSL_GUARDED_BY(mutex);  // by seq
  int64_t next_seq ABSL_GUARDED_BY(mutex) = 1;
  // Per device: the id of the job holding it; empty when free.
  std::vector<std::string> device_holder ABSL_GUARDED_BY(mutex);
  // Devices the launcher last reported lost (AttemptLauncher::Available).
  std::set<int> lost_devices ABSL_GUARDED_BY(mutex);
  // Set once by Shutdown: nothing new is accepted or started.
  bool shutting_down ABSL_GUARDED_BY(mutex) = false;

 private:
  // Some entry is unsaved: StoreUnsaved has work (saves a pass over every
  // job on each tick otherwise).
  bool any_unsaved_ ABSL_GUARDED_BY(mutex) = false;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_JOB_TABLE_H_
