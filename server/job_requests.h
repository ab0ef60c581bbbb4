// JobRequests: the JobManager's face to clients (JobService): submit, get,
// list, cancel, metrics, watch, log paths and the cluster view, over the
// shared JobTable. Submissions are validated here (ValidateSubmission, the
// one place a JobSpec is checked before it is stored) and stored before
// they are acknowledged; so is a cancel.
//
// Locking: each request takes the table's mutex itself; none is called with
// it held. Submit checks the spec and the disk before taking it, Metrics
// reads the store after releasing it.
#ifndef SHARDTRAIN_SERVER_JOB_REQUESTS_H_
#define SHARDTRAIN_SERVER_JOB_REQUESTS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/access_policy.h"
#include "server/job_manager_types.h"
#include "server/job_table.h"
#include "server/job_watch.h"
#include "shardtrain/v1/job.pb.h"

namespace shardtrain {

class AttemptSupervisor;

// A job's data and init_from inside `roots` (each file the ranks will open
// resolved on its own); OK when there are no roots. Checked at submit and
// again at each launch.
absl::Status CheckSpecPaths(const PathRoots& roots, const v1::JobSpec& spec);

class JobRequests {
 public:
  // `supervisor` stops a running job's ranks on Cancel. Neither is owned.
  JobRequests(JobTable* table, AttemptSupervisor* supervisor);
  JobRequests(const JobRequests&) = delete;
  JobRequests& operator=(const JobRequests&) = delete;

  // The contracts are JobManager's (server/job_manager.h).
  absl::StatusOr<v1::Job> Submit(const v1::JobSpec& spec, const Caller& caller)
      ABSL_LOCKS_EXCLUDED(table_->mutex);
  absl::StatusOr<v1::Job> Get(const std::string& job_id) const
      ABSL_LOCKS_EXCLUDED(table_->mutex);
  absl::StatusOr<ListJobsPage> List(const ListJobsQuery& query) const
      ABSL_LOCKS_EXCLUDED(table_->mutex);
  absl::StatusOr<v1::Job> Cancel(const std::string& job_id,
                                 const Caller& caller)
      ABSL_LOCKS_EXCLUDED(table_->mutex);
  absl::StatusOr<std::vector<v1::StepMetrics>> Metrics(
      const std::string& job_id, std::optional<int> rank,
      int64_t from_step) const ABSL_LOCKS_EXCLUDED(table_->mutex);
  absl::StatusOr<std::shared_ptr<JobWatch>> Watch(const std::string& job_id)
      ABSL_LOCKS_EXCLUDED(table_->mutex);
  absl::StatusOr<std::vector<std::string>> LogPaths(
      const std::string& job_id) const ABSL_LOCKS_EXCLUDED(table_->mutex);
  ClusterView Cluster() const ABSL_LOCKS_EXCLUDED(table_->mutex);

 private:
  JobTable* const table_;
  AttemptSupervisor* const supervisor_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_JOB_REQUESTS_H_
