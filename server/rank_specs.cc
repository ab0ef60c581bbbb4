#include "server/rank_specs.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dist_env.h"
#include "common/read_roots.h"

namespace shardtrain {

std::vector<ProcessSpec> BuildRankSpecs(const RankLaunch& launch) {
  std::vector<ProcessSpec> specs;
  for (int r = 0; r < launch.world_size; ++r) {
    ProcessSpec spec;
    spec.argv = {launch.worker_binary, "--spec",   launch.spec_path, "--out",
                 launch.job_dir,       "--job-id", launch.job_id};
    if (launch.cpu) {
      spec.argv.push_back("--threads");
      spec.argv.push_back(std::to_string(launch.threads_per_rank));
    }
    if (launch.resume) spec.argv.push_back("--resume");
    if (!launch.prepare_data.empty()) {
      spec.argv.push_back("--prepare-data");
      spec.argv.push_back(launch.prepare_data);
    }
    // One host: every rank local.
    DistEnv env;
    env.rank = r;
    env.local_rank = r;
    env.world_size = launch.world_size;
    env.local_world_size = launch.world_size;
    env.master_addr = "127.0.0.1";
    env.master_port = launch.master_port;
    spec.env = TorchrunEnvironment(env);
    spec.env.insert(spec.env.end(),
                    {{"SHARDTRAIN_JOB_ID", launch.job_id},
                     {"SHARDTRAIN_COORDINATOR", launch.coordinator_address},
                     {"SHARDTRAIN_JOB_SECRET", launch.secret},
                     {"SHARDTRAIN_HEARTBEAT_SECONDS",
                      absl::StrCat(launch.heartbeat_seconds)}});
    if (!launch.read_roots.empty()) {
      spec.env.push_back({kReadRootsEnv, launch.read_roots});
    }
    if (launch.cpu) {
      spec.env.push_back(
          {"OMP_NUM_THREADS", std::to_string(launch.threads_per_rank)});
      spec.env.push_back({"CUDA_VISIBLE_DEVICES", ""});
    } else {
      spec.env.push_back(
          {"CUDA_VISIBLE_DEVICES", absl::StrJoin(launch.devices, ",")});
    }
    spec.log_path = r < static_cast<int>(launch.log_paths.size())
                        ? launch.log_paths[r]
                        : std::string();
    specs.push_back(std::move(spec));
  }
  return specs;
}

}  // namespace shardtrain
