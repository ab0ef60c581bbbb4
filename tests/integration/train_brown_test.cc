// End to end: prepare the Brown Corpus with the CLI, train gpt2-tiny on it
// with shardtrain-train for a few hundred steps, and check that it learns.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "tests/test_util.h"
#include "worker/engine/train/step_metrics.h"

namespace shardtrain {
namespace {
namespace fs = std::filesystem;

TEST(TrainBrownTest, Gpt2TinyLearnsTheBrownCorpus) {
  const std::string bin = std::string(SHARDTRAIN_BINARY_DIR) + "/bin/";
  const std::string dir =
      (fs::temp_directory_path() /
       ("shardtrain_brown_e2e_" + std::to_string(::getpid())))
          .string();
  fs::remove_all(dir);

  test::CommandResult prepare = test::RunCommand(
      bin + "shardtrain data prepare --corpus brown --out " + dir + "/data");
  ASSERT_EQ(prepare.exit_code, 0) << prepare.err;

  test::CommandResult train = test::RunCommand(
      bin + "shardtrain-train --model gpt2-tiny --data " + dir +
      "/data --batch-size 8 --seq-len 128 --max-steps 300 --lr 1e-3 "
      "--warmup-steps 20 --eval-every 150 --eval-steps 10 --log-every 50 "
      "--out " +
      dir + "/run");
  ASSERT_EQ(train.exit_code, 0) << train.out << train.err;
  std::cout << train.out;

  std::ifstream metrics(dir + "/run/metrics.jsonl");
  std::vector<StepMetrics> steps;
  std::string line;
  while (std::getline(metrics, line))
    steps.push_back(*StepMetrics::FromJson(line));
  ASSERT_EQ(steps.size(), 300u);

  const double initial = std::log(50257.0);  // uniform prediction
  EXPECT_NEAR(steps.front().loss, initial, 0.3);
  double last_ten = 0;
  for (size_t i = steps.size() - 10; i < steps.size(); ++i)
    last_ten += steps[i].loss;
  last_ten /= 10;
  EXPECT_LT(last_ten, 0.7 * initial)
      << "train loss did not fall well below ln(V)";
  ASSERT_GE(steps.back().val_loss, 0);
  EXPECT_LT(steps.back().val_loss, 0.75 * initial) << "val loss did not fall";
  EXPECT_LT(steps.back().val_loss, steps[149].val_loss) << "val loss rose";
  fs::remove_all(dir);
}

}  // namespace
}  // namespace shardtrain
