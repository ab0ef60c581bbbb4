// SlurmJobLauncher: the AttemptLauncher for `shardtraind --launcher slurm`. An
// attempt is one `sbatch` allocation of world-size tasks (server/slurm.h plans
// it); its batch script `srun`s shardtrain-worker once per rank, on nodes Slurm
// picks, so the ranks' pids are learnt only when they register. The attempt's
// state is Slurm's record of the job; its end is classified from that record
// and srun's lines in the attempt's batch log.
#ifndef SHARDTRAIN_SERVER_SLURM_JOB_LAUNCHER_H_
#define SHARDTRAIN_SERVER_SLURM_JOB_LAUNCHER_H_

#include <string>
#include <vector>

#include "server/attempt_launcher.h"
#include "server/slurm.h"

namespace shardtrain {

class SlurmJobLauncher : public AttemptLauncher {
 public:
  // `client` must outlive this launcher.
  SlurmJobLauncher(SlurmClient* client, SlurmOptions options,
                   absl::Duration poll_interval = absl::Seconds(1));

  std::string name() const override { return "slurm"; }
  absl::Duration poll_interval() const override { return poll_interval_; }
  // Writes <job_dir>/slurm-attempt-N.sh, submits it and records the Slurm
  // job id in <job_dir>/slurm_job_id for a later coordinator.
  absl::Status Start(const RankLaunch& launch, int number,
                     Attempt* attempt) override;
  absl::StatusOr<AttemptReport> Poll(const Attempt& attempt,
                                     const std::vector<bool>& running) override;
  // SIGKILL is scancel; other signals go to the job's tasks.
  void Signal(const Attempt& attempt, const std::vector<int>& ranks,
              int signal) override;
  // Cancels the Slurm job <job_dir>/slurm_job_id names: its ranks do not die
  // with the coordinator.
  void EndLeftovers(const std::string& job_id, const std::string& job_dir,
                    const std::vector<int>& pids) override;
  // Ranks the partition's usable nodes hold; the nodes that are not usable
  // (DOWN, DRAINED, not responding ...) by name.
  absl::StatusOr<Capacity> Available() override;

  // Attempt `number`'s batch log (srun's own messages).
  static std::string BatchLog(const std::string& job_dir, int number);

 private:
  SlurmClient* const client_;
  const SlurmOptions options_;
  const absl::Duration poll_interval_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_SLURM_JOB_LAUNCHER_H_
