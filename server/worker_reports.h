// WorkerReports: the JobManager's face to a job's ranks (WorkerService):
// registration, step reports and heartbeats, over the shared JobTable.
// Every call first authenticates the caller: it must be a rank of a live
// job's current attempt presenting that attempt's secret (PermissionDenied,
// with one message for every refusal, otherwise). The last rank to register
// moves the job to RUNNING.
//
// Locking: each call takes the table's mutex itself; none is called with it
// held. ReportProgress stores the steps with the mutex released, so a slow
// store holds up no heartbeat.
#ifndef SHARDTRAIN_SERVER_WORKER_REPORTS_H_
#define SHARDTRAIN_SERVER_WORKER_REPORTS_H_

#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/job_table.h"
#include "shardtrain/v1/job.pb.h"
#include "shardtrain/v1/worker_service.pb.h"

namespace shardtrain {

class WorkerReports {
 public:
  explicit WorkerReports(JobTable* table);  // not owned
  WorkerReports(const WorkerReports&) = delete;
  WorkerReports& operator=(const WorkerReports&) = delete;

  // The contracts are JobManager's (server/job_manager.h).
  absl::Status RegisterWorker(const v1::WorkerIdentity& worker)
      ABSL_LOCKS_EXCLUDED(table_->mutex);
  absl::StatusOr<bool> ReportProgress(const v1::WorkerIdentity& worker,
                                      const std::vector<v1::StepMetrics>& steps)
      ABSL_LOCKS_EXCLUDED(table_->mutex);
  absl::StatusOr<bool> Heartbeat(const v1::WorkerIdentity& worker)
      ABSL_LOCKS_EXCLUDED(table_->mutex);

 private:
  // The caller's entry, when it is a live rank presenting the secret.
  absl::StatusOr<JobEntry*> Authenticate(const v1::WorkerIdentity& worker)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(table_->mutex);

  JobTable* const table_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_WORKER_REPORTS_H_
