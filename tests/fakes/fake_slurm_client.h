// FakeSlurmClient: records what the job manager submits and signals, and lets
// a test set what Slurm says about each job.
#ifndef SHARDTRAIN_TESTS_FAKES_FAKE_SLURM_CLIENT_H_
#define SHARDTRAIN_TESTS_FAKES_FAKE_SLURM_CLIENT_H_

#include <signal.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/slurm.h"

namespace shardtrain {

class FakeSlurmClient : public SlurmClient {
 public:
  struct Job {
    SlurmLaunchPlan plan;
    std::string script_path;
    SlurmJobInfo info;
    std::vector<int> signals;  // SIGKILL stands for scancel
  };

  absl::StatusOr<std::string> Submit(const SlurmLaunchPlan& plan,
                                     const std::string& script_path) override {
    absl::MutexLock lock(&mutex_);
    if (!refuse_.empty()) return absl::UnavailableError(refuse_);
    const std::string id = std::to_string(next_id_++);
    Job& job = jobs_[id];
    job.plan = plan;
    job.script_path = script_path;
    job.info.job_id = id;
    job.info.state = "PENDING";
    job.info.reason = "Resources";
    order_.push_back(id);
    return id;
  }
  absl::StatusOr<SlurmJobInfo> Query(const std::string& job_id) override {
    absl::MutexLock lock(&mutex_);
    ++queries_;
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) {
      return absl::NotFoundError(
          absl::StrCat("Slurm has no record of job ", job_id));
    }
    return it->second.info;
  }
  absl::Status Signal(const std::string& job_id, int signal) override {
    absl::MutexLock lock(&mutex_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return absl::NotFoundError("no such job");
    it->second.signals.push_back(signal);
    // SIGUSR1: the ranks save a checkpoint and stop (a shutdown's or a
    // preemption's request).
    if ((signal == SIGTERM || signal == SIGUSR1) && exit_on_sigterm_) {
      End(it->second, "COMPLETED");
    }
    return absl::OkStatus();
  }
  absl::Status Cancel(const std::string& job_id) override {
    absl::MutexLock lock(&mutex_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return absl::NotFoundError("no such job");
    it->second.signals.push_back(SIGKILL);
    if (!it->second.info.Ended()) End(it->second, "CANCELLED");
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<SlurmNode>> Nodes() override { return nodes_; }
  absl::StatusOr<std::vector<SlurmPartition>> Partitions() override {
    return partitions_;
  }

  // --- for tests ---
  void SetState(const std::string& job_id, const std::string& state,
                const std::string& reason = "None", int exit_code = 0,
                int signal = 0) {
    absl::MutexLock lock(&mutex_);
    SlurmJobInfo& info = jobs_.at(job_id).info;
    info.state = state;
    info.reason = reason;
    info.exit_code = exit_code;
    info.signal = signal;
    info.nodes = "node[1-2]";
  }
  void Forget(const std::string& job_id) {
    absl::MutexLock lock(&mutex_);
    jobs_.erase(job_id);
  }
  void set_refuse(std::string message) {
    absl::MutexLock lock(&mutex_);
    refuse_ = std::move(message);
  }
  void set_exit_on_sigterm(bool value) {
    absl::MutexLock lock(&mutex_);
    exit_on_sigterm_ = value;
  }
  Job job(const std::string& id) {
    absl::MutexLock lock(&mutex_);
    return jobs_.at(id);
  }
  std::vector<std::string> submitted() {
    absl::MutexLock lock(&mutex_);
    return order_;
  }
  int queries() {
    absl::MutexLock lock(&mutex_);
    return queries_;
  }
  std::vector<SlurmNode> nodes_;
  std::vector<SlurmPartition> partitions_;

 private:
  static void End(Job& job, const std::string& state) {
    job.info.state = state;
    job.info.reason = "None";
  }

  absl::Mutex mutex_;
  std::map<std::string, Job> jobs_;
  std::vector<std::string> order_;
  int next_id_ = 100;
  int queries_ = 0;
  bool exit_on_sigterm_ = true;
  std::string refuse_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_TESTS_FAKES_FAKE_SLURM_CLIENT_H_
