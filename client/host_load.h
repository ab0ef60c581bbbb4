// What else ran on a host while a job trained: the CPU that processes other
// than the job's own used, sampled from /proc once a second. The comparison
// study uses it to tell a speed difference from interference (another
// process taking cores from one strategy's run and not the others').
// Torch-free; Linux only (elsewhere nothing is measured).
#ifndef SHARDTRAIN_CLIENT_HOST_LOAD_H_
#define SHARDTRAIN_CLIENT_HOST_LOAD_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/time.h"

namespace shardtrain::cli {

// Other processes' CPU use on the host over one run, in cores (1.0: one core
// busy the whole time). Hypervisor steal counts as other use.
struct HostLoad {
  bool measured = false;
  int cores = 0;                // online CPUs
  double seconds = 0;           // time sampled
  double other_cores_mean = 0;  // over the whole run
  double other_cores_peak = 0;  // the busiest sampling period
  double job_cores_mean = 0;    // the job's own processes
};

// Other use at or above this share of the host's cores (and at least a fifth
// of a core) disturbs a run: the job's ranks were not alone on the host.
bool Disturbs(const HostLoad& load);

// The job's rank processes as the coordinator reports them (GetJob's
// worker_pids); asked once a sampling period, so a restarted attempt's new
// ranks are followed. Empty when it cannot say.
using JobPids = std::function<std::vector<int>()>;

// Samples /proc/stat and every process's /proc/<pid>/stat on a background
// thread. The job's own processes are the ranks `job_pids` names and every
// process descended from them (a rank's helpers), plus this process;
// everything else is other use. Nothing a process says about itself (its
// command line, its name) makes it the job's.
class HostLoadSampler {
 public:
  HostLoadSampler(JobPids job_pids, absl::Duration period);
  ~HostLoadSampler();
  HostLoadSampler(const HostLoadSampler&) = delete;
  HostLoadSampler& operator=(const HostLoadSampler&) = delete;

  // Stops sampling and returns what was measured (measured = false when
  // /proc/stat cannot be read, no process of the job ran on this host, or
  // less than one period passed).
  HostLoad Stop();

 private:
  void Run();

  const JobPids job_pids_;
  const absl::Duration period_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;  // guarded by mu_
  HostLoad load_;
  std::thread thread_;
};

}  // namespace shardtrain::cli

#endif  // SHARDTRAIN_CLIENT_HOST_LOAD_H_
