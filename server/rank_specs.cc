#include "server/rank_specs.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/read_roots.h"

namespace shardtrain {

std::vector<ProcessSpec> BuildRankSpecs(const RankLaunch& launch) {
  std::vector<ProcessSpec> specs;
  const std::string world = std::to_string(launch.world_size);
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
    spec.env = {
        {"RANK", std::to_string(r)},
        {"WORLD_SIZE", world},
        {"LOCAL_RANK", std::to_string(r)},
        {"LOCAL_WORLD_SIZE", world},
        {"MASTER_ADDR", "127.0.0.1"},
        {"MASTER_PORT", std::to_string(launch.master_port)},
        {"SHARDTRAIN_JOB_ID", launch.job_id},
        {"SHARDTRAIN_COORDINATOR", launch.coordinator_address},
        {"SHARDTRAIN_JOB_SECRET", launch.secret},
        {"SHARDTRAIN_HEARTBEAT_SECONDS",
         absl::StrCat(launch.heartbeat_seconds)},
    };
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
