// DistEnvFromLookup reads torchrun's variables and rejects bad ones with a
// message naming the variable.
#include "common/dist_env.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <string>

namespace shardtrain {
namespace {

using ::testing::HasSubstr;

absl::StatusOr<DistEnv> Read(const std::map<std::string, std::string>& vars) {
  return DistEnvFromLookup(
      [&](const std::string& name) -> std::optional<std::string> {
        auto it = vars.find(name);
        if (it == vars.end()) return std::nullopt;
        return it->second;
      });
}

TEST(DistEnvTest, NoVariablesMeansOneProcess) {
  absl::StatusOr<DistEnv> env = Read({});
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->rank, 0);
  EXPECT_EQ(env->world_size, 1);
  EXPECT_EQ(env->local_rank, 0);
  EXPECT_EQ(env->master_addr, "127.0.0.1");
  EXPECT_EQ(env->master_port, 29500);
}

TEST(DistEnvTest, ReadsTorchrunVariables) {
  absl::StatusOr<DistEnv> env = Read({{"RANK", "3"},
                                      {"WORLD_SIZE", "8"},
                                      {"LOCAL_RANK", "1"},
                                      {"MASTER_ADDR", "node0"},
                                      {"MASTER_PORT", "31000"}});
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->rank, 3);
  EXPECT_EQ(env->world_size, 8);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->master_addr, "node0");
  EXPECT_EQ(env->master_port, 31000);
}

// What the launchers write (TorchrunEnvironment) reads back as it was.
TEST(DistEnvTest, TheLaunchersVariablesReadBack) {
  DistEnv written;
  written.rank = 5;
  written.local_rank = 1;
  written.world_size = 8;
  written.local_world_size = 4;
  written.master_addr = "node0";
  written.master_port = 31001;
  const auto vars = TorchrunEnvironment(written, /*group_rank=*/1);
  const std::map<std::string, std::string> by_name(vars.begin(), vars.end());
  EXPECT_EQ(by_name.at("GROUP_RANK"), "1");
  absl::StatusOr<DistEnv> env = Read(by_name);
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->rank, 5);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->world_size, 8);
  EXPECT_EQ(env->local_world_size, 4);
  EXPECT_EQ(env->master_addr, "node0");
  EXPECT_EQ(env->master_port, 31001);
  EXPECT_EQ(env->source, "torchrun");
}

TEST(DistEnvTest, LocalRankDefaultsToRank) {
  absl::StatusOr<DistEnv> env = Read({{"RANK", "2"}, {"WORLD_SIZE", "4"}});
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->local_rank, 2);
}

TEST(DistEnvTest, MissingWorldSizeIsNamed) {
  absl::StatusOr<DistEnv> env = Read({{"RANK", "0"}});
  EXPECT_EQ(env.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(env.status().message(), HasSubstr("WORLD_SIZE is not set"));
}

TEST(DistEnvTest, MissingRankIsNamed) {
  absl::StatusOr<DistEnv> env = Read({{"WORLD_SIZE", "2"}});
  EXPECT_EQ(env.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(env.status().message(), HasSubstr("RANK is not set"));
}

TEST(DistEnvTest, NonNumericWorldSizeIsNamedWithItsValue) {
  absl::StatusOr<DistEnv> env = Read({{"RANK", "0"}, {"WORLD_SIZE", "two"}});
  EXPECT_EQ(env.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(env.status().message(), HasSubstr("WORLD_SIZE='two'"));
}

TEST(DistEnvTest, ZeroWorldSizeIsRejected) {
  absl::StatusOr<DistEnv> env = Read({{"RANK", "0"}, {"WORLD_SIZE", "0"}});
  EXPECT_EQ(env.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(env.status().message(), HasSubstr("WORLD_SIZE='0'"));
}

TEST(DistEnvTest, RankMustBeBelowWorldSize) {
  absl::StatusOr<DistEnv> env = Read({{"RANK", "2"}, {"WORLD_SIZE", "2"}});
  EXPECT_EQ(env.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(env.status().message(),
              HasSubstr("RANK=2 is not below WORLD_SIZE=2"));
}

TEST(DistEnvTest, NegativeRankIsRejected) {
  absl::StatusOr<DistEnv> env = Read({{"RANK", "-1"}, {"WORLD_SIZE", "2"}});
  EXPECT_THAT(env.status().message(), HasSubstr("RANK='-1'"));
}

TEST(DistEnvTest, BadPortIsNamed) {
  absl::StatusOr<DistEnv> env =
      Read({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}});
  EXPECT_EQ(env.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(env.status().message(), HasSubstr("MASTER_PORT='70000'"));
}

TEST(DistEnvTest, EmptyMasterAddrIsRejected) {
  absl::StatusOr<DistEnv> env =
      Read({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", ""}});
  EXPECT_THAT(env.status().message(), HasSubstr("MASTER_ADDR is empty"));
}

TEST(DistEnvTest, LocalRankOutOfRangeIsNamed) {
  absl::StatusOr<DistEnv> env =
      Read({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "5"}});
  EXPECT_THAT(env.status().message(), HasSubstr("LOCAL_RANK='5'"));
}

TEST(DistEnvTest, SrunTasksReadSlurmsVariables) {
  const std::map<std::string, std::string> task = {
      {"SLURM_STEP_ID", "0"},
      {"SLURM_PROCID", "3"},
      {"SLURM_NTASKS", "4"},
      {"SLURM_LOCALID", "1"},
      {"SLURM_JOB_ID", "123456"},
      {"SLURM_STEP_NODELIST", "gpu[07-08]"},
      {"SLURM_JOB_NODELIST", "gpu[07-09]"}};
  absl::StatusOr<DistEnv> env = Read(task);
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->source, "slurm");
  EXPECT_EQ(env->rank, 3);
  EXPECT_EQ(env->world_size, 4);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->master_addr, "gpu07");
  EXPECT_EQ(env->master_port, SlurmDefaultPort(123456));
  EXPECT_EQ(env->master_port, 20000 + 123456 % 20000);

  // MASTER_ADDR / MASTER_PORT given win; torchrun's variables win over all.
  std::map<std::string, std::string> given = task;
  given["MASTER_ADDR"] = "10.0.0.9";
  given["MASTER_PORT"] = "29600";
  env = Read(given);
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->master_addr, "10.0.0.9");
  EXPECT_EQ(env->master_port, 29600);
  given["RANK"] = "0";
  given["WORLD_SIZE"] = "1";
  env = Read(given);
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->source, "torchrun");
  EXPECT_EQ(env->world_size, 1);
}

TEST(DistEnvTest, ABatchScriptWithoutAStepIsOneProcess) {
  absl::StatusOr<DistEnv> env = Read({{"SLURM_PROCID", "0"},
                                      {"SLURM_NTASKS", "8"},
                                      {"SLURM_JOB_ID", "7"},
                                      {"SLURM_JOB_NODELIST", "n[1-2]"}});
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->world_size, 1);
  EXPECT_EQ(env->source, "");
}

TEST(DistEnvTest, SlurmProblemsNameTheVariable) {
  absl::StatusOr<DistEnv> env = Read({{"SLURM_STEP_ID", "0"},
                                      {"SLURM_PROCID", "0"},
                                      {"SLURM_NTASKS", "2"},
                                      {"SLURM_JOB_NODELIST", "n1,n2"}});
  EXPECT_THAT(env.status().message(), HasSubstr("SLURM_JOB_ID"));
  env = Read({{"SLURM_STEP_ID", "0"},
              {"SLURM_PROCID", "0"},
              {"SLURM_NTASKS", "2"},
              {"SLURM_JOB_ID", "5"}});
  EXPECT_THAT(env.status().message(), HasSubstr("MASTER_ADDR"));
}

TEST(DistEnvTest, FirstHostOfASlurmNodeList) {
  EXPECT_EQ(*FirstHostOfNodeList("node01"), "node01");
  EXPECT_EQ(*FirstHostOfNodeList("node[01-03,07],gpu5"), "node01");
  EXPECT_EQ(*FirstHostOfNodeList("node[7,1-3]"), "node7");
  EXPECT_EQ(*FirstHostOfNodeList("gpu5,node[01-03]"), "gpu5");
  EXPECT_EQ(*FirstHostOfNodeList("rack[1-2]-n[3-4]"), "rack1-n3");
  EXPECT_EQ(*FirstHostOfNodeList("10.0.0.1,10.0.0.2"), "10.0.0.1");
  for (const char* bad : {"", "node[01-03", "[]", ","}) {
    EXPECT_FALSE(FirstHostOfNodeList(bad).ok()) << bad;
  }
}

}  // namespace
}  // namespace shardtrain
