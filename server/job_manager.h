// JobManager: owns every job's life in shardtraind. Validates and stores
// submissions, runs the scheduler, launches a job's ranks, takes their
// registrations, progress and heartbeats, notices failures (exit, signal,
// missed heartbeats, rendezvous timeout, out of memory), restarts jobs from
// their last checkpoint when allowed, and recovers after a coordinator
// restart. It includes no gRPC header: the services in this folder are thin
// adapters over it, and tests drive it with a fake launcher and clock. Ranks
// start, stop and end through a AttemptLauncher (server/attempt_launcher.h):
// local processes or Slurm, the same code here for both.
//
// A facade over four parts that share one mutex: JobTable
// (server/job_table.h: the jobs and devices, and how a change is stored and
// announced), JobRequests (job_requests.h: the JobService calls),
// WorkerReports (worker_reports.h: the WorkerService calls) and
// AttemptSupervisor (attempt_supervisor.h: the supervisor thread — polls,
// failure detection, stops, restarts, scheduling and launches). Every public
// call here may be made from any thread, and none with the mutex held.
//
// States: QUEUED -> STARTING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED;
// RUNNING -> RESTARTING -> RUNNING while restarts remain; RUNNING ->
// PREEMPTED -> QUEUED when a higher-priority job takes its devices (its ranks
// checkpoint first, and it resumes from there). Every change is
// stored (with an event row) before it becomes visible.
#ifndef SHARDTRAIN_SERVER_JOB_MANAGER_H_
#define SHARDTRAIN_SERVER_JOB_MANAGER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "core/data/builtin_dataset.h"
#include "server/access_policy.h"
#include "server/attempt_launcher.h"
#include "server/device_inventory.h"
#include "server/job_manager_types.h"
#include "server/job_store.h"
#include "server/job_watch.h"
#include "shardtrain/v1/job.pb.h"
#include "shardtrain/v1/worker_service.pb.h"

namespace shardtrain {

class AttemptSupervisor;
class JobRequests;
class JobTable;
class WorkerReports;

class JobManager {
 public:
  // Loads the store. Nothing is changed until ResumeInterruptedJobs().
  static absl::StatusOr<std::unique_ptr<JobManager>> Create(
      JobManagerOptions options, JobStore* store, AttemptLauncher* launcher,
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
  // InvalidArgument names the field; nothing is stored then. The job is
  // `caller`'s (Job.owner); a job larger than their device quota is
  // refused (FailedPrecondition naming the quota).
  absl::StatusOr<v1::Job> Submit(const v1::JobSpec& spec,
                                 const Caller& caller = {});
  absl::StatusOr<v1::Job> Get(const std::string& job_id) const;
  absl::StatusOr<ListJobsPage> List(const ListJobsQuery& query) const;
  // PermissionDenied naming the owner unless `caller` owns the job or is
  // an admin.
  absl::StatusOr<v1::Job> Cancel(const std::string& job_id,
                                 const Caller& caller = {});
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

 private:
  JobManager(std::unique_ptr<JobTable> table, AttemptLauncher* launcher);

  // In dependency order (destroyed in reverse): the faces work on the table,
  // and Cancel stops ranks through the supervisor.
  std::unique_ptr<JobTable> table_;
  std::unique_ptr<AttemptSupervisor> supervisor_;
  std::unique_ptr<JobRequests> requests_;
  std::unique_ptr<WorkerReports> workers_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_JOB_MANAGER_H_
