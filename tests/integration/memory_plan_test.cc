// `shardtrain plan` against reality: the predicted per-rank peak of every
// strategy, at world sizes 1, 2 and 4 on gpt2-tiny and gpt2-mini, within 10%
// of the peak the tracking CPU allocator measured in a real shardtrain-train
// run (memory_peak_bytes in metrics.jsonl: exact tensor bytes, per rank and
// step; the plan is compared with the largest over ranks and steps).
#include "worker/engine/train/memory_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "tests/test_util.h"
#include "worker/engine/data/token_file.h"
#include "worker/engine/train/step_metrics.h"

namespace shardtrain {
namespace {
namespace fs = std::filesystem;

// The issue asked for 10%; the model counts the same tensors the engine keeps
// and lands within 0.1% here, so any drift beyond 2% is a change to catch.
constexpr double kTolerance = 0.02;

class MemoryPlanTest : public testing::Test {
 public:
  static void SetUpTestSuite() {
    dir_ =
        new fs::path(fs::temp_directory_path() /
                     ("shardtrain_memory_plan_" + std::to_string(::getpid())));
    fs::remove_all(*dir_);
    fs::create_directories(*dir_ / "data");
    std::mt19937 rng(3);
    std::vector<uint16_t> tokens(60000);
    for (auto& t : tokens) t = static_cast<uint16_t>(rng() % 50257);
    ASSERT_TRUE(
        WriteTokenFile((*dir_ / "data/train.bin").string(), tokens).ok());
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }

  // The largest memory_peak_bytes of any rank and step of a 3-step run.
  static int64_t MeasuredPeak(const TrainConfig& config, int64_t world) {
    const std::string name =
        config.model + "_" + config.strategy + "_" + std::to_string(world);
    const fs::path out = *dir_ / name;
    std::string command = std::string(SHARDTRAIN_BINARY_DIR) +
                          "/bin/shardtrain-train --model " + config.model +
                          " --strategy " + config.strategy + " --data " +
                          (*dir_ / "data").string() + " --batch-size " +
                          std::to_string(config.batch_size) + " --seq-len " +
                          std::to_string(config.seq_len) +
                          " --max-steps 3 --eval-steps 1 --out " + out.string();
    if (config.strategy != "single")
      command += " --nproc " + std::to_string(world);
    const test::CommandResult r = test::RunCommand(command);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    std::ifstream metrics(out / "metrics.jsonl");
    std::string line;
    int64_t peak = 0;
    int rows = 0;
    while (std::getline(metrics, line)) {
      absl::StatusOr<StepMetrics> m = StepMetrics::FromJson(line);
      if (!m.ok()) continue;
      peak = std::max(peak, m->memory_peak_bytes);
      ++rows;
    }
    EXPECT_EQ(rows, 3 * world) << name;
    return peak;
  }

  static fs::path* dir_;
};
fs::path* MemoryPlanTest::dir_ = nullptr;

void CheckModel(const std::string& model, int64_t batch, int64_t seq) {
  for (const int64_t world : {1, 2, 4}) {
    for (const std::string strategy : {"single", "ddp", "fsdp"}) {
      if (strategy == "single" && world != 1) continue;
      TrainConfig config;
      config.model = model;
      config.strategy = strategy;
      config.batch_size = batch;
      config.seq_len = seq;
      absl::StatusOr<MemoryPlan> plan = PlanMemory(config, world);
      ASSERT_TRUE(plan.ok()) << plan.status();
      const int64_t measured = MemoryPlanTest::MeasuredPeak(config, world);
      const double error =
          static_cast<double>(plan->total() - measured) / measured;
      std::printf(
          "%s %s world %ld: predicted %.1f MiB, measured %.1f MiB (%+.1f%%)\n",
          model.c_str(), strategy.c_str(), static_cast<long>(world),
          plan->total() / 1048576.0, measured / 1048576.0, 100 * error);
      EXPECT_LE(std::abs(error), kTolerance)
          << model << " " << strategy << " world " << world;
    }
  }
}

TEST_F(MemoryPlanTest, PredictsTheMeasuredPeakOfGpt2Tiny) {
  CheckModel("gpt2-tiny", 4, 128);
}

TEST_F(MemoryPlanTest, PredictsTheMeasuredPeakOfGpt2Mini) {
  CheckModel("gpt2-mini", 2, 64);
}

// The head's chunk follows the threads of a rank (HeadChunkBytes): one
// thread keeps 128 MiB of logits (667 rows of GPT-2's vocabulary), four take
// the whole 1,024-row batch in one chunk.
TEST(MemoryPlanHeadTest, TheHeadChunkFollowsTheThreadsPerRank) {
  TrainConfig config;
  config.model = "gpt2-tiny";
  config.strategy = "ddp";
  config.batch_size = 8;
  config.seq_len = 128;
  config.threads = 1;
  absl::StatusOr<MemoryPlan> one = PlanMemory(config, 2);
  config.threads = 4;
  absl::StatusOr<MemoryPlan> four = PlanMemory(config, 2);
  ASSERT_TRUE(one.ok() && four.ok());
  const int64_t vocab = 50257;
  const int64_t rows_one = (int64_t{128} << 20) / (vocab * 4);
  EXPECT_EQ(rows_one, 667);
  EXPECT_EQ(four->logits - one->logits, (1024 - rows_one) * vocab * 4);
  EXPECT_EQ(four->total() - one->total(), four->logits - one->logits);
}

// The CLI prints the library's numbers; FSDP's total shrinks with the world
// size while DDP's does not.
TEST_F(MemoryPlanTest, CliPrintsThePlanAsJson) {
  const test::CommandResult r = test::RunCommand(
      std::string(SHARDTRAIN_BINARY_DIR) +
      "/bin/shardtrain plan --model gpt2-mini --world-size 4 --batch-size 2 "
      "--seq-len 64 -o json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json out = nlohmann::json::parse(r.out);
  ASSERT_EQ(out["plans"].size(), 3u);
  int64_t ddp = 0, fsdp = 0;
  for (const nlohmann::json& plan : out["plans"]) {
    TrainConfig config;
    config.model = "gpt2-mini";
    config.strategy = plan["strategy"];
    config.batch_size = plan["batch_size"];
    config.seq_len = 64;
    const absl::StatusOr<MemoryPlan> expected =
        PlanMemory(config, plan["world_size"]);
    ASSERT_TRUE(expected.ok());
    EXPECT_EQ(plan["total_bytes_per_rank"], expected->total());
    int64_t sum = 0;
    for (const auto& [part, bytes] : plan["bytes_per_rank"].items())
      sum += bytes.get<int64_t>();
    EXPECT_EQ(sum, expected->total());
    if (plan["strategy"] == "ddp") ddp = expected->total();
    if (plan["strategy"] == "fsdp") fsdp = expected->total();
  }
  EXPECT_EQ(out["plans"][0]["batch_size"], 8);  // single: strong scaling
  EXPECT_LT(fsdp, ddp / 3);

  const test::CommandResult bad =
      test::RunCommand(std::string(SHARDTRAIN_BINARY_DIR) +
                       "/bin/shardtrain plan --model gpt2-huge --world-size 2");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("model"), std::string::npos) << bad.err;
  const test::CommandResult single =
      test::RunCommand(std::string(SHARDTRAIN_BINARY_DIR) +
                       "/bin/shardtrain plan --strategy single --world-size 2");
  EXPECT_EQ(single.exit_code, 1);
  EXPECT_NE(single.err.find("world size 1"), std::string::npos) << single.err;
}

}  // namespace
}  // namespace shardtrain
