#include "server/local_job_launcher.h"

#include "absl/strings/str_cat.h"
#include "common/free_port.h"

namespace shardtrain {

LocalJobLauncher::LocalJobLauncher(ProcessSpawner* processes,
                                   LostDevices lost_devices)
    : processes_(processes), lost_devices_(std::move(lost_devices)) {}

absl::StatusOr<Capacity> LocalJobLauncher::Available() {
  Capacity capacity;
  if (lost_devices_) capacity.lost_devices = lost_devices_();
  return capacity;
}

absl::Status LocalJobLauncher::Start(const RankLaunch& launch, int number,
                                     Attempt* attempt) {
  *attempt = NewAttempt(launch, number);
  // The job's rendezvous store. Picked free, it can still be taken before
  // rank 0 binds it: rank 0 then exits kExitRendezvousPortTaken and the
  // JobManager starts the attempt again, on a port none of the launcher's
  // recent starts had.
  absl::StatusOr<int> port = ports_.Pick();
  if (!port.ok()) return port.status();
  RankLaunch with_port = launch;
  with_port.master_port = *port;
  std::vector<ProcessSpec> specs = BuildRankSpecs(with_port);
  for (int r = 0; r < launch.world_size; ++r) {
    specs[r].process_group = attempt->pgid;
    absl::StatusOr<int> pid = processes_->Spawn(specs[r]);
    if (!pid.ok()) {
      return absl::Status(pid.status().code(),
                          absl::StrCat("could not start rank ", r, ": ",
                                       pid.status().message()));
    }
    attempt->pids[r] = *pid;
    if (r == 0) attempt->pgid = *pid;
  }
  return absl::OkStatus();
}

absl::StatusOr<AttemptReport> LocalJobLauncher::Poll(
    const Attempt& attempt, const std::vector<bool>& running) {
  AttemptReport report;
  for (size_t r = 0; r < attempt.pids.size() && r < running.size(); ++r) {
    if (!running[r] || attempt.pids[r] <= 0) continue;
    if (std::optional<ExitStatus> exit = processes_->TryWait(attempt.pids[r])) {
      report.exits.push_back({static_cast<int>(r), *exit});
    }
  }
  return report;
}

void LocalJobLauncher::Signal(const Attempt& attempt,
                              const std::vector<int>& ranks, int signal) {
  for (int r : ranks) {
    if (r < 0 || r >= static_cast<int>(attempt.pids.size())) continue;
    if (attempt.pids[r] <= 0) continue;
    processes_->Signal(attempt.pids[r], attempt.pgid, signal);
  }
}

void LocalJobLauncher::EndLeftovers(const std::string& job_id,
                                    const std::string& /*job_dir*/,
                                    const std::vector<int>& pids) {
  // The previous coordinator's ranks died with it (parent-death signal);
  // make sure of it. Only a process whose command line names the job is
  // killed, so a reused pid is spared.
  for (int pid : pids) processes_->KillOrphan(pid, job_id, absl::Seconds(5));
}

}  // namespace shardtrain
