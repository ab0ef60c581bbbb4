#include "server/slurm_job_launcher.h"

#include <signal.h>

#include <fstream>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "server/log_files.h"

namespace shardtrain {

SlurmJobLauncher::SlurmJobLauncher(SlurmClient* client, SlurmOptions options,
                                   absl::Duration poll_interval)
    : client_(client),
      options_(std::move(options)),
      poll_interval_(poll_interval) {}

std::string SlurmJobLauncher::BatchLog(const std::string& job_dir, int number) {
  return absl::StrCat(job_dir, "/slurm-attempt-", number, ".log");
}

absl::Status SlurmJobLauncher::Start(const RankLaunch& launch, int number,
                                     Attempt* attempt) {
  *attempt = NewAttempt(launch, number);
  const std::string script =
      absl::StrCat(launch.job_dir, "/slurm-attempt-", number, ".sh");
  const SlurmLaunchPlan plan =
      PlanSlurmLaunch(launch, options_, BatchLog(launch.job_dir, number));
  if (absl::Status s = WriteFileAtomically(script, plan.script); !s.ok()) {
    return s;
  }
  absl::StatusOr<std::string> slurm_job = client_->Submit(plan, script);
  if (!slurm_job.ok()) {
    return absl::Status(
        slurm_job.status().code(),
        absl::StrCat("sbatch refused the job: ", slurm_job.status().message()));
  }
  attempt->handle = *slurm_job;
  attempt->summary = absl::StrCat("Slurm job ", *slurm_job);
  // For the next coordinator, should this one die with the job running.
  (void)WriteFileAtomically(launch.job_dir + "/slurm_job_id",
                            *slurm_job + "\n");
  return absl::OkStatus();
}

absl::StatusOr<AttemptReport> SlurmJobLauncher::Poll(
    const Attempt& attempt, const std::vector<bool>& running) {
  AttemptReport report;
  absl::StatusOr<SlurmJobInfo> queried = client_->Query(attempt.handle);
  if (!queried.ok() && !absl::IsNotFound(queried.status())) {
    return queried.status();  // Slurm did not answer this time
  }
  SlurmJobInfo info;
  if (queried.ok()) {
    info = *queried;
    if (info.Waiting()) {
      report.waiting =
          absl::StrCat("waiting for Slurm job ", info.job_id, " to start (",
                       info.state, ": ", info.reason, ")");
      return report;
    }
    if (!info.Ended()) return report;  // running: heartbeats watch it
  } else {
    info.job_id = attempt.handle;
    info.state = "UNKNOWN";
    info.reason = std::string(queried.status().message());
  }
  const std::vector<std::string> batch_log =
      ReadLastLines(BatchLog(attempt.job_dir, attempt.number), 200);
  const SlurmOutcome outcome = ClassifySlurmEnd(info, batch_log);
  // Slurm ended every task of the job at once.
  for (size_t r = 0; r < running.size(); ++r) {
    if (!running[r]) continue;
    RankEnd exit;
    exit.rank = static_cast<int>(r);
    exit.status.exit_code = outcome.success ? 0 : outcome.exit_code;
    exit.status.signal = outcome.signal;
    report.exits.push_back(exit);
  }
  if (!outcome.success && !outcome.preempted) {
    AttemptFailure failure;
    failure.reason = outcome.reason;
    failure.rank = outcome.rank;
    failure.message = outcome.message;
    failure.log_lines = batch_log;
    report.failure = std::move(failure);
  }
  return report;
}

void SlurmJobLauncher::Signal(const Attempt& attempt,
                              const std::vector<int>& /*ranks*/, int signal) {
  if (attempt.handle.empty()) return;  // not submitted
  const absl::Status s = signal == SIGKILL
                             ? client_->Cancel(attempt.handle)
                             : client_->Signal(attempt.handle, signal);
  if (!s.ok()) {
    std::cerr << "shardtraind: Slurm job " << attempt.handle << ": "
              << s.message() << "\n";
  }
}

absl::StatusOr<Capacity> SlurmJobLauncher::Available() {
  absl::StatusOr<std::vector<SlurmNode>> nodes = client_->Nodes();
  if (!nodes.ok()) return nodes.status();
  absl::StatusOr<std::vector<SlurmPartition>> partitions =
      client_->Partitions();
  if (!partitions.ok()) return partitions.status();
  absl::StatusOr<SlurmCapacity> slurm =
      SlurmPartitionCapacity(*nodes, *partitions, options_);
  if (!slurm.ok()) return slurm.status();
  Capacity capacity;
  capacity.slots = slurm->usable_slots;
  capacity.lost = absl::StrJoin(slurm->unusable_nodes, ", ");
  return capacity;
}

void SlurmJobLauncher::EndLeftovers(const std::string& job_id,
                                    const std::string& job_dir,
                                    const std::vector<int>& /*pids*/) {
  std::ifstream recorded(job_dir + "/slurm_job_id");
  std::string slurm_job;
  if (!(recorded >> slurm_job)) return;
  if (client_->Cancel(slurm_job).ok()) {
    std::cerr << "shardtraind: " << job_id << ": cancelled Slurm job "
              << slurm_job << " left by the previous coordinator\n";
  }
}

}  // namespace shardtrain
