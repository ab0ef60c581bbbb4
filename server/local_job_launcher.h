// LocalJobLauncher: the AttemptLauncher whose ranks are processes on this host,
// started through a ProcessSpawner (fork/exec; a fake in tests). Ranks
// rendezvous on 127.0.0.1 at a port picked per attempt; rank 0 leads the
// process group the others join, so one signal reaches them all.
#ifndef SHARDTRAIN_SERVER_LOCAL_JOB_LAUNCHER_H_
#define SHARDTRAIN_SERVER_LOCAL_JOB_LAUNCHER_H_

#include <functional>
#include <string>
#include <vector>

#include "common/free_port.h"
#include "server/attempt_launcher.h"
#include "server/process_spawner.h"

namespace shardtrain {

class LocalJobLauncher : public AttemptLauncher {
 public:
  // Indices into the coordinator's devices that cannot run a rank now (a GPU
  // that fell off the bus); null: none ever.
  using LostDevices = std::function<std::vector<int>()>;

  // `processes` must outlive this launcher.
  explicit LocalJobLauncher(ProcessSpawner* processes,
                            LostDevices lost_devices = nullptr);

  std::string name() const override { return "local"; }
  absl::Duration poll_interval() const override { return absl::ZeroDuration(); }
  absl::Status Start(const RankLaunch& launch, int number,
                     Attempt* attempt) override;
  absl::StatusOr<AttemptReport> Poll(const Attempt& attempt,
                                     const std::vector<bool>& running) override;
  void Signal(const Attempt& attempt, const std::vector<int>& ranks,
              int signal) override;
  void EndLeftovers(const std::string& job_id, const std::string& job_dir,
                    const std::vector<int>& pids) override;
  absl::StatusOr<Capacity> Available() override;

 private:
  ProcessSpawner* const processes_;
  const LostDevices lost_devices_;
  // Rendezvous ports: a restart after a taken port never gets it again.
  FreshPortPicker ports_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_LOCAL_JOB_LAUNCHER_H_
