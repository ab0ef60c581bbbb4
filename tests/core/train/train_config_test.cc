#include "core/train/train_config.h"

#include <gtest/gtest.h>

#include <functional>

namespace shardtrain {
namespace {

TrainConfig ValidConfig() {
  TrainConfig config;
  config.data = "/some/dir";
  return config;
}

TEST(TrainConfigTest, DefaultsWithDataAreValid) {
  EXPECT_TRUE(ValidConfig().Validate().ok()) << ValidConfig().Validate();
}

struct BadField {
  std::string field;  // must appear in the message
  std::function<void(TrainConfig&)> mutate;
};

TEST(TrainConfigTest, EachInvalidFieldIsNamedInTheError) {
  const std::vector<BadField> cases = {
      {"model", [](TrainConfig& c) { c.model = "gpt5"; }},
      {"model", [](TrainConfig& c) { c.model = "custom:n_layer=2"; }},
      {"data", [](TrainConfig& c) { c.data = ""; }},
      {"batch_size", [](TrainConfig& c) { c.batch_size = 0; }},
      {"batch_size", [](TrainConfig& c) { c.batch_size = -4; }},
      {"seq_len", [](TrainConfig& c) { c.seq_len = 0; }},
      {"seq_len", [](TrainConfig& c) { c.seq_len = 257; }},  // tiny: block 256
      {"grad_accum", [](TrainConfig& c) { c.grad_accum = 0; }},
      {"max_steps", [](TrainConfig& c) { c.max_steps = -1; }},
      {"epochs", [](TrainConfig& c) { c.epochs = 0; }},
      {"lr", [](TrainConfig& c) { c.lr = 0; }},
      {"lr", [](TrainConfig& c) { c.lr = std::nan(""); }},
      {"min_lr_ratio", [](TrainConfig& c) { c.min_lr_ratio = 2; }},
      {"warmup_steps", [](TrainConfig& c) { c.warmup_steps = -1; }},
      {"weight_decay", [](TrainConfig& c) { c.weight_decay = -0.1; }},
      {"beta1", [](TrainConfig& c) { c.beta1 = 1.0; }},
      {"beta2", [](TrainConfig& c) { c.beta2 = -0.5; }},
      {"eps", [](TrainConfig& c) { c.eps = 0; }},
      {"strategy", [](TrainConfig& c) { c.strategy = "zero"; }},
      {"device", [](TrainConfig& c) { c.device = "tpu"; }},
      {"device", [](TrainConfig& c) { c.device = "cuda:x"; }},
      {"precision", [](TrainConfig& c) { c.precision = "fp8"; }},
      {"precision", [](TrainConfig& c) { c.precision = "bf16"; }},  // on cpu
      {"threads", [](TrainConfig& c) { c.threads = -2; }},
      {"bucket_mb", [](TrainConfig& c) { c.bucket_mb = 0; }},
      {"comm_timeout", [](TrainConfig& c) { c.comm_timeout = 0; }},
      {"eval_every", [](TrainConfig& c) { c.eval_every = -1; }},
      {"eval_steps", [](TrainConfig& c) { c.eval_steps = 0; }},
      {"checkpoint_every", [](TrainConfig& c) { c.checkpoint_every = -5; }},
      {"out", [](TrainConfig& c) { c.checkpoint_every = 10; }},
      {"out", [](TrainConfig& c) { c.resume = true; }},
      {"log_every", [](TrainConfig& c) { c.log_every = 0; }},
  };
  for (const BadField& bad : cases) {
    TrainConfig config = ValidConfig();
    bad.mutate(config);
    absl::Status status = config.Validate();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument)
        << bad.field << ": " << status;
    EXPECT_NE(status.message().find(bad.field), std::string::npos)
        << "expected '" << bad.field << "' in: " << status.message();
  }
}

TEST(TrainConfigTest, CudaDevicesAndBf16OnCudaAreAccepted) {
  TrainConfig config = ValidConfig();
  config.device = "cuda:3";
  config.precision = "bf16";
  EXPECT_TRUE(config.Validate().ok());
}

TEST(TrainConfigTest, YamlUsesTheFlagNames) {
  TrainConfig config;
  ASSERT_TRUE(ApplyYamlTrainConfig(R"(
model: gpt2-mini
data: /tmp/brown
batch-size: 4
seq_len: 256
lr: 3.0e-4
shuffle: false
eval-only: true
)",
                                   &config)
                  .ok());
  EXPECT_EQ(config.model, "gpt2-mini");
  EXPECT_EQ(config.data, "/tmp/brown");
  EXPECT_EQ(config.batch_size, 4);
  EXPECT_EQ(config.seq_len, 256);
  EXPECT_DOUBLE_EQ(config.lr, 3e-4);
  EXPECT_FALSE(config.shuffle);
  EXPECT_TRUE(config.eval_only);
  EXPECT_EQ(config.grad_accum, 1);  // untouched keys keep their values
}

TEST(TrainConfigTest, YamlRejectsUnknownKeysAndWrongTypesWithoutChanges) {
  TrainConfig config;
  absl::Status unknown =
      ApplyYamlTrainConfig("batch_size: 2\nbatchsize: 4\n", &config);
  EXPECT_FALSE(unknown.ok());
  EXPECT_NE(unknown.message().find("batchsize"), std::string::npos);
  EXPECT_EQ(config.batch_size, 8);  // nothing applied

  absl::Status wrong_type = ApplyYamlTrainConfig("batch_size: many\n", &config);
  EXPECT_FALSE(wrong_type.ok());
  EXPECT_NE(wrong_type.message().find("batch_size"), std::string::npos);

  EXPECT_FALSE(ApplyYamlTrainConfig("[1, 2]", &config).ok());
  EXPECT_FALSE(ApplyYamlTrainConfig("a: [unclosed", &config).ok());
  EXPECT_FALSE(
      LoadYamlTrainConfigFile("/nonexistent/train.yaml", &config).ok());
}

// Evaluating without a model to evaluate would score random weights.
TEST(TrainConfigTest, EvalOnlyNeedsAModelToEvaluate) {
  TrainConfig config;
  config.data = "/tmp/data";
  config.eval_only = true;
  const absl::Status refused = config.Validate();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("eval_only: needs --init-from"),
            std::string::npos)
      << refused;
  config.init_from = "/tmp/model.bin";
  EXPECT_TRUE(config.Validate().ok());
}

}  // namespace
}  // namespace shardtrain
