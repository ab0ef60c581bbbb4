#include "server/job_manager.h"

#include <utility>

#include "server/attempt_supervisor.h"
#include "server/job_requests.h"
#include "server/job_table.h"
#include "server/worker_reports.h"

namespace shardtrain {

absl::StatusOr<std::unique_ptr<JobManager>> JobManager::Create(
    JobManagerOptions options, JobStore* store, AttemptLauncher* launcher,
    Clock* clock, JobObserver* observer) {
  if (options.devices.empty()) {
    return absl::InvalidArgumentError("job manager: no devices to schedule");
  }
  if (!options.resolve_data) {
    return absl::InvalidArgumentError("job manager: no data resolver");
  }
  auto table =
      std::make_unique<JobTable>(std::move(options), store, clock, observer);
  if (absl::Status s = table->Load(); !s.ok()) return s;
  return std::unique_ptr<JobManager>(
      new JobManager(std::move(table), launcher));
}

JobManager::JobManager(std::unique_ptr<JobTable> table,
                       AttemptLauncher* launcher)
    : table_(std::move(table)),
      supervisor_(std::make_unique<AttemptSupervisor>(table_.get(), launcher)),
      requests_(std::make_unique<JobRequests>(table_.get(), supervisor_.get())),
      workers_(std::make_unique<WorkerReports>(table_.get())) {}

JobManager::~JobManager() { Shutdown(); }

void JobManager::ResumeInterruptedJobs() {
  supervisor_->ResumeInterruptedJobs();
}
void JobManager::Start() { supervisor_->Start(); }
void JobManager::Shutdown() { supervisor_->Shutdown(); }
void JobManager::Tick() { supervisor_->Tick(); }

void JobManager::set_worker_address(std::string address) {
  supervisor_->set_worker_address(std::move(address));
}

absl::StatusOr<v1::Job> JobManager::Submit(const v1::JobSpec& spec,
                                           const Caller& caller) {
  return requests_->Submit(spec, caller);
}

absl::StatusOr<v1::Job> JobManager::Get(const std::string& job_id) const {
  return requests_->Get(job_id);
}

absl::StatusOr<ListJobsPage> JobManager::List(
    const ListJobsQuery& query) const {
  return requests_->List(query);
}

absl::StatusOr<v1::Job> JobManager::Cancel(const std::string& job_id,
                                           const Caller& caller) {
  return requests_->Cancel(job_id, caller);
}

absl::StatusOr<std::vector<v1::StepMetrics>> JobManager::Metrics(
    const std::string& job_id, std::optional<int> rank,
    int64_t from_step) const {
  return requests_->Metrics(job_id, rank, from_step);
}

absl::StatusOr<std::shared_ptr<JobWatch>> JobManager::Watch(
    const std::string& job_id) {
  return requests_->Watch(job_id);
}

absl::StatusOr<std::vector<std::string>> JobManager::LogPaths(
    const std::string& job_id) const {
  return requests_->LogPaths(job_id);
}

ClusterView JobManager::Cluster() const { return requests_->Cluster(); }

absl::Status JobManager::RegisterWorker(const v1::WorkerIdentity& worker) {
  return workers_->RegisterWorker(worker);
}

absl::StatusOr<bool> JobManager::ReportProgress(
    const v1::WorkerIdentity& worker,
    const std::vector<v1::StepMetrics>& steps) {
  return workers_->ReportProgress(worker, steps);
}

absl::StatusOr<bool> JobManager::Heartbeat(const v1::WorkerIdentity& worker) {
  return workers_->Heartbeat(worker);
}

}  // namespace shardtrain
