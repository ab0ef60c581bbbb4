#include "worker/engine/train/trainer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "core/data/token_file.h"
#include "core/run/lr_schedule.h"
#include "core/run/step_metrics.h"
#include "tests/test_util.h"
#include "worker/engine/model/llmc_checkpoint.h"
#include "worker/engine/strategy/single_device_strategy.h"

namespace shardtrain {
namespace trainer_test {
namespace fs = std::filesystem;

// A small corpus with structure a model can learn: a noisy periodic sequence.
std::string MakeData(const std::string& name) {
  const std::string dir = test::ScratchDir("trainer_" + name);
  std::mt19937 rng(42);
  for (const auto& [file, count] :
       {std::pair{"train.bin", 40000}, std::pair{"val.bin", 8000}}) {
    std::vector<uint16_t> tokens(count);
    for (int i = 0; i < count; ++i) {
      tokens[i] =
          static_cast<uint16_t>((i * 7) % 97 + (rng() % 4 == 0 ? 1000 : 0));
    }
    EXPECT_TRUE(WriteTokenFile(dir + "/" + file, tokens).ok());
  }
  return dir;
}

TrainConfig SmallConfig(const std::string& data) {
  TrainConfig config;
  config.model = "gpt2-tiny";
  config.data = data;
  config.batch_size = 4;
  config.seq_len = 32;
  config.max_steps = 10;
  config.lr = 1e-3;
  config.warmup_steps = 2;
  config.threads = 2;
  config.eval_steps = 2;
  config.peak_flops = 1e12;  // not measured: tests must not depend on load
  return config;
}

std::unique_ptr<Trainer> MakeTrainer(const TrainConfig& config,
                                     std::ostream* log = nullptr) {
  StrategyOptions options;
  options.adamw = {config.beta1, config.beta2, config.eps};
  options.weight_decay = config.weight_decay;
  auto trainer = Trainer::Create(
      config, RankInfo{}, std::make_unique<SingleDeviceStrategy>(options), log);
  EXPECT_TRUE(trainer.ok()) << trainer.status();
  return trainer.ok() ? std::move(*trainer) : nullptr;
}

double RelDiff(double a, double b) {
  return std::fabs(a - b) / std::max(std::fabs(b), 1e-12);
}

TEST(TrainerTest, ResumeReproducesTheUninterruptedLosses) {
  const std::string data = MakeData("resume");
  TrainConfig config = SmallConfig(data);

  auto uninterrupted = MakeTrainer(config);
  ASSERT_TRUE(uninterrupted->Run().ok());

  config.out = data + "/run";
  config.checkpoint_every = 5;
  auto first = MakeTrainer(config);
  ASSERT_TRUE(first->Run().ok());
  // Simulate a crash after the step-5 checkpoint: it becomes the latest.
  std::ofstream(config.out + "/checkpoints/latest") << "step_00000005\n";
  fs::remove(config.out + "/metrics.jsonl");

  config.resume = true;
  auto resumed = MakeTrainer(config);
  ASSERT_EQ(resumed->start_step(), 5);
  ASSERT_TRUE(resumed->Run().ok());
  ASSERT_EQ(resumed->history().size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    const StepMetrics& expected = uninterrupted->history()[5 + i];
    const StepMetrics& got = resumed->history()[i];
    EXPECT_EQ(got.step, expected.step);
    EXPECT_LE(RelDiff(got.loss, expected.loss), 1e-6)
        << "step " << got.step << ": " << got.loss << " vs " << expected.loss;
    EXPECT_LE(RelDiff(got.grad_norm, expected.grad_norm), 1e-6);
  }
}

TEST(TrainerTest, ResumeRefusesACheckpointOfAnotherRunNamingTheFlag) {
  const std::string data = MakeData("mismatch");
  TrainConfig config = SmallConfig(data);
  config.out = data + "/run";
  config.checkpoint_every = 5;
  ASSERT_TRUE(MakeTrainer(config)->Run().ok());

  config.resume = true;
  config.seed += 1;  // another data order
  StrategyOptions options;
  auto trainer =
      Trainer::Create(config, RankInfo{},
                      std::make_unique<SingleDeviceStrategy>(options), nullptr);
  ASSERT_FALSE(trainer.ok());
  EXPECT_EQ(trainer.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(trainer.status().message().find("written with seed"),
            std::string::npos)
      << trainer.status();
  EXPECT_NE(trainer.status().message().find("(--seed)"), std::string::npos)
      << trainer.status();
}

// Training longer: --resume with a larger --max-steps continues from the
// checkpoint, on the new length's schedule; a length the checkpoint is
// already past is refused, naming the flag.
TEST(TrainerTest, ResumeWithALargerMaxStepsTrainsLonger) {
  const std::string data = MakeData("longer");
  TrainConfig config = SmallConfig(data);
  config.out = data + "/run";
  config.max_steps = 5;
  config.checkpoint_every = 5;
  ASSERT_TRUE(MakeTrainer(config)->Run().ok());

  config.resume = true;
  config.max_steps = 8;
  std::ostringstream log;
  auto longer = MakeTrainer(config, &log);
  ASSERT_NE(longer, nullptr);
  ASSERT_EQ(longer->start_step(), 5);
  ASSERT_TRUE(longer->Run().ok());
  ASSERT_EQ(longer->history().size(), 3u);
  const LrSchedule schedule(config.lr, config.min_lr_ratio, config.warmup_steps,
                            8);
  for (const StepMetrics& m : longer->history()) {
    EXPECT_DOUBLE_EQ(m.lr, schedule.At(m.step - 1)) << m.step;
  }
  EXPECT_EQ(longer->history().back().step, 8);
  EXPECT_NE(log.str().find("had 5 steps, this one has 8"), std::string::npos)
      << log.str();
  EXPECT_TRUE(fs::exists(config.out + "/checkpoints/step_00000008"));

  config.max_steps = 6;  // the newest checkpoint is at step 8
  StrategyOptions options;
  auto shorter =
      Trainer::Create(config, RankInfo{},
                      std::make_unique<SingleDeviceStrategy>(options), nullptr);
  ASSERT_FALSE(shorter.ok());
  EXPECT_EQ(shorter.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(shorter.status().message().find("is at step 8"), std::string::npos)
      << shorter.status();
  EXPECT_NE(shorter.status().message().find("pass a larger --max-steps"),
            std::string::npos)
      << shorter.status();
}

// A val.bin too small for one evaluation batch is found before step 1, not
// at the final evaluation after all the training.
TEST(TrainerTest, AValSetTooSmallForOneEvalBatchIsRefusedBeforeTraining) {
  const std::string data = MakeData("small_val");
  ASSERT_TRUE(
      WriteTokenFile(data + "/val.bin", std::vector<uint16_t>(18, 42)).ok());
  TrainConfig config = SmallConfig(data);
  config.out = data + "/run";
  StrategyOptions options;
  auto trainer =
      Trainer::Create(config, RankInfo{},
                      std::make_unique<SingleDeviceStrategy>(options), nullptr);
  ASSERT_FALSE(trainer.ok());
  EXPECT_NE(trainer.status().message().find("val.bin has 18 tokens"),
            std::string::npos)
      << trainer.status();
  EXPECT_NE(trainer.status().message().find("4 x 1 replicas x 33 = 132"),
            std::string::npos)
      << trainer.status();
  EXPECT_FALSE(fs::exists(config.out + "/metrics.jsonl"));
}

// Another per-rank batch is no other run: the checkpoint's global batch is
// kept (split into micro-batches), so the resumed steps are the same.
TEST(TrainerTest, ResumeWithAnotherBatchSizeKeepsTheGlobalBatch) {
  const std::string data = MakeData("rebatch");
  TrainConfig config = SmallConfig(data);
  config.batch_size = 4;
  config.max_steps = 8;
  config.out = data + "/run";
  config.checkpoint_every = 4;
  auto whole = MakeTrainer(config);
  ASSERT_TRUE(whole->Run().ok());

  // Resume from step 4 with batch 2: accumulation 2 keeps 4 per step.
  std::filesystem::remove_all(config.out + "/checkpoints/step_00000008");
  std::ofstream(config.out + "/checkpoints/latest") << "step_00000004";
  config.resume = true;
  config.batch_size = 2;
  std::ostringstream log;
  auto resumed = MakeTrainer(config, &log);
  ASSERT_NE(resumed, nullptr);
  EXPECT_NE(log.str().find("batch 2 x accum 2 per replica"), std::string::npos)
      << log.str();
  ASSERT_TRUE(resumed->Run().ok());
  ASSERT_EQ(resumed->history().size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    const double expected = whole->history()[4 + i].loss;
    EXPECT_NEAR(resumed->history()[i].loss, expected, 1e-5 * expected)
        << "step " << 5 + i;
  }
}

TEST(TrainerTest, ResumeFallsBackPastACorruptedCheckpoint) {
  const std::string data = MakeData("corrupt");
  TrainConfig config = SmallConfig(data);
  config.out = data + "/run";
  config.checkpoint_every = 5;
  ASSERT_TRUE(MakeTrainer(config)->Run().ok());  // checkpoints 5 and 10 kept

  config.resume = true;
  std::ofstream(config.out + "/checkpoints/step_00000010/rank-00000.bin")
      << "torn";
  std::ostringstream log;
  auto trainer = MakeTrainer(config, &log);
  ASSERT_NE(trainer, nullptr);
  EXPECT_EQ(trainer->start_step(), 5);
  EXPECT_NE(log.str().find("step_00000010 is unusable"), std::string::npos)
      << log.str();
  EXPECT_NE(log.str().find("rank-00000.bin"), std::string::npos) << log.str();
  EXPECT_NE(log.str().find("resumed from " + config.out +
                           "/checkpoints/step_00000005 at step 5"),
            std::string::npos)
      << log.str();
  ASSERT_TRUE(trainer->Run().ok());
  EXPECT_EQ(trainer->history().front().step, 6);  // the step after 5

  // That run wrote a fresh step-10 checkpoint; with every checkpoint
  // corrupted, resuming is refused, naming the problem.
  for (const char* step : {"step_00000005", "step_00000010"}) {
    std::ofstream(config.out + "/checkpoints/" + step + "/rank-00000.bin")
        << "torn";
  }
  StrategyOptions options;
  auto refused =
      Trainer::Create(config, RankInfo{},
                      std::make_unique<SingleDeviceStrategy>(options), nullptr);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(refused.status().message().find("none of the 2 checkpoints"),
            std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find("rank-00000.bin"),
            std::string::npos)
      << refused.status();
}

TEST(TrainerTest, AccumulatedMicroBatchesEqualOneLargeBatch) {
  const std::string data = MakeData("accum");
  TrainConfig large = SmallConfig(data);
  large.batch_size = 8;
  large.max_steps = 5;
  TrainConfig micro = large;
  micro.batch_size = 2;
  micro.grad_accum = 4;

  auto a = MakeTrainer(large);
  auto b = MakeTrainer(micro);
  ASSERT_TRUE(a->Run().ok());
  ASSERT_TRUE(b->Run().ok());
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_LE(RelDiff(b->history()[i].loss, a->history()[i].loss), 1e-5) << i;
    EXPECT_LE(RelDiff(b->history()[i].grad_norm, a->history()[i].grad_norm),
              1e-5)
        << i;
    EXPECT_EQ(b->history()[i].tokens, a->history()[i].tokens);
  }
}

TEST(TrainerTest, WritesMetricsLinesStepLinesAndTheModel) {
  const std::string data = MakeData("outputs");
  TrainConfig config = SmallConfig(data);
  config.out = data + "/run";
  config.eval_every = 5;
  std::ostringstream log;
  auto trainer = MakeTrainer(config, &log);
  ASSERT_TRUE(trainer->Run().ok());

  std::ifstream metrics(config.out + "/metrics.jsonl");
  std::string line;
  int lines = 0;
  int evals = 0;
  while (std::getline(metrics, line)) {
    auto m = StepMetrics::FromJson(line);
    ASSERT_TRUE(m.ok()) << line;
    ++lines;
    EXPECT_EQ(m->step, lines);
    EXPECT_GT(m->tokens_per_second, 0);
    EXPECT_GT(m->mfu, 0);
    EXPECT_LT(m->mfu, 1);
    EXPECT_GT(m->memory_peak_bytes, 0);
    EXPECT_GE(m->memory_peak_bytes, m->memory_allocated_bytes);
    if (m->val_loss >= 0) ++evals;
  }
  EXPECT_EQ(lines, 10);
  EXPECT_EQ(evals, 2);  // steps 5 and 10
  EXPECT_NE(log.str().find("step 10/10 | loss "), std::string::npos)
      << log.str();
  EXPECT_NE(log.str().find("val_loss "), std::string::npos);

  // The exported llm.c model holds the trained weights.
  Gpt2 loaded(*ParseModelSpec("gpt2-tiny"));
  ASSERT_TRUE(LoadLlmcCheckpoint(config.out + "/model.bin", loaded).ok());
  TrainConfig eval = config;
  eval.out.clear();
  eval.eval_only = true;
  eval.init_from = config.out + "/model.bin";
  auto evaluator = MakeTrainer(eval);
  auto val_loss = evaluator->Evaluate();
  ASSERT_TRUE(val_loss.ok());
  EXPECT_NEAR(*val_loss, trainer->history().back().val_loss, 1e-5);
}

TEST(TrainerTest, LossFallsOnLearnableData) {
  const std::string data = MakeData("learn");
  TrainConfig config = SmallConfig(data);
  config.max_steps = 60;
  auto trainer = MakeTrainer(config);
  ASSERT_TRUE(trainer->Run().ok());
  EXPECT_NEAR(trainer->history().front().loss, std::log(50257.0), 0.3);
  EXPECT_LT(trainer->history().back().loss,
            0.5 * trainer->history().front().loss);
}

TEST(TrainerTest, CreateNamesTheProblem) {
  StrategyOptions options;
  auto create = [&](const TrainConfig& config) {
    return Trainer::Create(config, RankInfo{},
                           std::make_unique<SingleDeviceStrategy>(options),
                           nullptr)
        .status();
  };
  TrainConfig missing = SmallConfig("/nonexistent/data");
  EXPECT_NE(create(missing).message().find("/nonexistent/data"),
            std::string::npos);

  const std::string data = MakeData("errors");
  TrainConfig too_long = SmallConfig(data);
  too_long.seq_len = 100000;
  EXPECT_NE(create(too_long).message().find("seq_len"), std::string::npos);

  TrainConfig bad_init = SmallConfig(data);
  bad_init.init_from = data + "/train.bin";  // a token file, not a model
  EXPECT_NE(create(bad_init).message().find("init_from"), std::string::npos);

  TrainConfig huge_batch = SmallConfig(data);
  huge_batch.batch_size = 5000;
  EXPECT_NE(create(huge_batch).message().find("data:"), std::string::npos);
}

}  // namespace trainer_test
}  // namespace shardtrain
