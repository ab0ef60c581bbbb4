// BuildRankSpecs: what each rank of a launch is started with.
#include "server/rank_specs.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>

namespace shardtrain {
namespace {

using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::Not;

std::map<std::string, std::string> Env(const ProcessSpec& spec) {
  return {spec.env.begin(), spec.env.end()};
}

RankLaunch CpuLaunch() {
  RankLaunch launch;
  launch.worker_binary = "/opt/shardtrain/bin/shardtrain-worker";
  launch.job_id = "job-000007";
  launch.job_dir = "/state/jobs/job-000007";
  launch.spec_path = "/state/jobs/job-000007/spec.json";
  launch.world_size = 3;
  launch.cpu = true;
  launch.devices = {0, 1, 2};
  launch.threads_per_rank = 4;
  launch.master_port = 29512;
  launch.coordinator_address = "unix:/state/worker.sock";
  launch.secret = "s3cret";
  launch.heartbeat_seconds = 2.5;
  for (int r = 0; r < 3; ++r) {
    launch.log_paths.push_back("/state/jobs/job-000007/rank-" +
                               std::to_string(r) + ".log");
  }
  return launch;
}

TEST(RankSpecsTest, EachCpuRankGetsTorchrunVariablesThreadsAndItsLog) {
  const std::vector<ProcessSpec> specs = BuildRankSpecs(CpuLaunch());
  ASSERT_EQ(specs.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    const ProcessSpec& spec = specs[r];
    EXPECT_THAT(spec.argv,
                ElementsAre("/opt/shardtrain/bin/shardtrain-worker", "--spec",
                            "/state/jobs/job-000007/spec.json", "--out",
                            "/state/jobs/job-000007", "--job-id", "job-000007",
                            "--threads", "4"));
    const auto env = Env(spec);
    EXPECT_EQ(env.at("RANK"), std::to_string(r));
    EXPECT_EQ(env.at("LOCAL_RANK"), std::to_string(r));
    EXPECT_EQ(env.at("WORLD_SIZE"), "3");
    EXPECT_EQ(env.at("LOCAL_WORLD_SIZE"), "3");
    EXPECT_EQ(env.at("MASTER_ADDR"), "127.0.0.1");
    EXPECT_EQ(env.at("MASTER_PORT"), "29512");
    EXPECT_EQ(env.at("SHARDTRAIN_JOB_ID"), "job-000007");
    EXPECT_EQ(env.at("SHARDTRAIN_COORDINATOR"), "unix:/state/worker.sock");
    EXPECT_EQ(env.at("SHARDTRAIN_JOB_SECRET"), "s3cret");
    EXPECT_EQ(env.at("SHARDTRAIN_HEARTBEAT_SECONDS"), "2.5");
    EXPECT_EQ(env.at("OMP_NUM_THREADS"), "4");
    EXPECT_EQ(env.at("CUDA_VISIBLE_DEVICES"), "");  // CPU ranks see no GPU
    EXPECT_EQ(spec.log_path,
              "/state/jobs/job-000007/rank-" + std::to_string(r) + ".log");
    EXPECT_EQ(spec.process_group, 0);
  }
}

TEST(RankSpecsTest, GpuRanksSeeTheirDevicesAndARestartResumes) {
  RankLaunch launch = CpuLaunch();
  launch.cpu = false;
  launch.devices = {2, 5};
  launch.world_size = 2;
  launch.resume = true;
  const std::vector<ProcessSpec> specs = BuildRankSpecs(launch);
  ASSERT_EQ(specs.size(), 2u);
  for (const ProcessSpec& spec : specs) {
    EXPECT_THAT(spec.argv, Not(Contains("--threads")));
    EXPECT_EQ(spec.argv.back(), "--resume");
    const auto env = Env(spec);
    EXPECT_EQ(env.at("CUDA_VISIBLE_DEVICES"), "2,5");
    EXPECT_EQ(env.count("OMP_NUM_THREADS"), 0u);
  }
}

// A job on the built-in dataset: its ranks prepare it (the daemon does not).
TEST(RankSpecsTest, RanksOfABuiltinDatasetJobArePassedItToPrepare) {
  RankLaunch launch = CpuLaunch();
  for (const ProcessSpec& spec : BuildRankSpecs(launch)) {
    EXPECT_THAT(spec.argv, Not(Contains("--prepare-data")));
  }
  launch.prepare_data = "brown";
  for (const ProcessSpec& spec : BuildRankSpecs(launch)) {
    const auto at = std::find(spec.argv.begin(), spec.argv.end(),
                              std::string("--prepare-data"));
    ASSERT_NE(at, spec.argv.end());
    ASSERT_NE(at + 1, spec.argv.end());
    EXPECT_EQ(*(at + 1), "brown");
  }
}

}  // namespace
}  // namespace shardtrain
