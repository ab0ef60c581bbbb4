// BuildRankSpecs: the processes one launch of a job starts — each rank's
// argv and environment (torchrun's variables, the coordinator's address and
// the attempt's secret, threads and visible devices) and log file. A pure
// function of what the JobManager decided, so the launch's shape is tested
// without starting anything.
#ifndef SHARDTRAIN_SERVER_RANK_SPECS_H_
#define SHARDTRAIN_SERVER_RANK_SPECS_H_

#include <string>
#include <vector>

#include "server/process_spawner.h"

namespace shardtrain {

struct RankLaunch {
  std::string worker_binary;  // shardtrain-worker
  std::string job_id;
  std::string job_dir;    // --out, and where spec.json is
  std::string spec_path;  // the resolved JobSpec (--spec)
  int world_size = 1;
  bool cpu = true;  // CPU slots; else GPUs `devices`
  std::vector<int> devices;
  int threads_per_rank = 1;  // CPU only
  bool resume = false;       // a restart: continue from the checkpoint
  int master_port = 0;       // the rendezvous store on 127.0.0.1
  std::string coordinator_address;
  std::string secret;
  double heartbeat_seconds = 5;
  // shardtraind --path-root, canonical, ':'-joined (kReadRootsEnv): the
  // ranks check every input file they open against it. Empty: unrestricted.
  std::string read_roots;
  // A built-in dataset ("brown") the ranks prepare into the spec's `data`
  // before training when it is not there yet; empty for a prepared one.
  std::string prepare_data;
  // Log file of rank r: log_paths[r].
  std::vector<std::string> log_paths;
};

// One ProcessSpec per rank, rank order. process_group is left 0: the caller
// sets ranks > 0 to rank 0's group once it exists.
std::vector<ProcessSpec> BuildRankSpecs(const RankLaunch& launch);

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_RANK_SPECS_H_
