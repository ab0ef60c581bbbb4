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

}  // namespace
}  // namespace shardtrain
