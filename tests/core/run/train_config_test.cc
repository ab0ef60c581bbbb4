#include "core/run/train_config.h"

#include <gtest/gtest.h>

#include <functional>

#include "core/run/train_flags.h"

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

TEST(TrainConfigTest, PipelineDefaultsAreNoPipeline) {
  const TrainConfig config;
  EXPECT_EQ(config.pipeline_stages, 1);
  EXPECT_EQ(config.pipeline_split, "");
  EXPECT_EQ(config.micro_batches, 1);
  EXPECT_EQ(config.pipeline_schedule, "1f1b");
  EXPECT_EQ(config.DataParallelSize(4), 4);
  // Without stages a distributed strategy takes any world, single one rank.
  EXPECT_TRUE(config.CheckMeshWorld(1).ok());
  const absl::Status single = config.CheckMeshWorld(3, "--nproc x --nnodes");
  EXPECT_EQ(single.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(single.message(),
            "--nproc x --nnodes: got 3; strategy single trains on one device "
            "(use ddp, fsdp or hsdp)");
  TrainConfig ddp;
  ddp.strategy = "ddp";
  EXPECT_TRUE(ddp.CheckMeshWorld(3).ok());
}

TEST(TrainConfigTest, CheckDataDirectoryNamesAMissingDirectory) {
  TrainConfig config;
  EXPECT_TRUE(config.CheckDataDirectory().ok());  // no data: nothing to check
  config.data = ::testing::TempDir();
  EXPECT_TRUE(config.CheckDataDirectory().ok());
  config.data = "/nonexistent/brown";
  const absl::Status missing = config.CheckDataDirectory();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.message(),
            "data: directory '/nonexistent/brown' does not exist (prepare one "
            "with `shardtrain data prepare`)");
}

TEST(TrainConfigTest, FlagsSetThePipelineFieldsAndPpIsPipelineStages) {
  TrainConfig config;
  CLI::App app;
  AddTrainFlags(app, config);
  std::vector<std::string> args = {
      "2",     "--virtual-stages",
      "gpipe", "--pipeline-schedule",
      "4",     "--micro-batches",
      "1,2",   "--pipeline-split",
      "3",     "--pp"};  // reversed, as CLI11 takes
  app.parse(args);
  EXPECT_EQ(config.virtual_stages, 2);
  EXPECT_EQ(config.pipeline_stages, 3);
  EXPECT_EQ(config.pipeline_split, "1,2");
  EXPECT_EQ(config.micro_batches, 4);
  EXPECT_EQ(config.pipeline_schedule, "gpipe");

  TrainConfig long_form;
  CLI::App app2;
  AddTrainFlags(app2, long_form);
  std::vector<std::string> args2 = {"2", "--pipeline-stages"};
  app2.parse(args2);
  EXPECT_EQ(long_form.pipeline_stages, 2);
}

TEST(TrainConfigTest, YamlTakesThePipelineKeys) {
  TrainConfig config;
  ASSERT_TRUE(ApplyYamlTrainConfig(R"(
pipeline-stages: 3
pipeline_split: "4,8"
micro-batches: 4
pipeline-schedule: gpipe
virtual_stages: 2
)",
                                   &config)
                  .ok());
  EXPECT_EQ(config.virtual_stages, 2);
  EXPECT_EQ(config.pipeline_stages, 3);
  EXPECT_EQ(config.pipeline_split, "4,8");
  EXPECT_EQ(config.micro_batches, 4);
  EXPECT_EQ(config.pipeline_schedule, "gpipe");
  // A list of blocks reads as the flag's comma-separated form.
  ASSERT_TRUE(ApplyYamlTrainConfig("pipeline_split: [2, 5]\n", &config).ok());
  EXPECT_EQ(config.pipeline_split, "2,5");
  EXPECT_FALSE(ApplyYamlTrainConfig("pipeline_stages: two\n", &config).ok());
  EXPECT_EQ(config.pipeline_stages, 3);
}

TrainConfig PipelineConfig() {
  TrainConfig config = ValidConfig();  // batch 8
  config.model = "gpt2-mini";          // 4 blocks
  config.pipeline_stages = 2;
  config.micro_batches = 4;
  return config;
}

TEST(TrainConfigTest, PipelineStagesWithSingleAndDdpAreValid) {
  TrainConfig config = PipelineConfig();
  EXPECT_TRUE(config.Validate().ok()) << config.Validate();
  config.strategy = "ddp";
  config.pipeline_split = "1";
  config.pipeline_schedule = "gpipe";
  EXPECT_TRUE(config.Validate().ok()) << config.Validate();
  config.pipeline_stages = 4;  // one block a stage
  config.pipeline_split = "";
  EXPECT_TRUE(config.Validate().ok()) << config.Validate();
  config.pipeline_stages = 2;  // two chunks of one block each
  config.virtual_stages = 2;
  config.pipeline_schedule = "1f1b";
  EXPECT_TRUE(config.Validate().ok()) << config.Validate();
}

TEST(TrainConfigTest, PipelineErrorsNameTheFieldAndTheNumbers) {
  struct Case {
    std::function<void(TrainConfig&)> mutate;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](TrainConfig& c) { c.pipeline_stages = 0; },
       "pipeline_stages: got 0; must be in [1, 1024] (1: no pipeline)"},
      {[](TrainConfig& c) { c.pipeline_stages = 1025; },
       "pipeline_stages: got 1025; must be in [1, 1024] (1: no pipeline)"},
      {[](TrainConfig& c) { c.micro_batches = 0; },
       "micro_batches: got 0; must be in [1, 65536]"},
      {[](TrainConfig& c) { c.micro_batches = 65537; },
       "micro_batches: got 65537; must be in [1, 65536]"},
      {[](TrainConfig& c) { c.micro_batches = 3; },
       "micro_batches: got 3; must divide batch_size (8)"},
      {[](TrainConfig& c) { c.pipeline_schedule = "zb"; },
       "--pipeline-schedule: 'zb' is not one of gpipe, 1f1b, zb-h1"},
      {[](TrainConfig& c) {
         c.pipeline_schedule = "zb-h1";
         c.tensor_parallel = 2;
       },
       "pipeline_schedule: got \"zb-h1\"; zb-h1 splits the projections' "
       "backward, which tensor-parallel layers do not; use 1f1b with "
       "tensor_parallel > 1"},
      {[](TrainConfig& c) { c.pipeline_split = "2;3"; },
       "--pipeline-split: '2;3' is not a list of block indices (e.g. 4,8: "
       "stage 1 starts at block 4, stage 2 at block 8)"},
      {[](TrainConfig& c) {
         c.pipeline_stages = 1;
         c.micro_batches = 2;
       },
       "micro_batches: got 2; micro-batches flow through pipeline stages; "
       "set pipeline_stages > 1"},
      {[](TrainConfig& c) {
         c.pipeline_stages = 1;
         c.micro_batches = 1;
         c.pipeline_split = "2";
       },
       "pipeline_split: got \"2\"; a split cuts the model into pipeline "
       "stages; set pipeline_stages > 1"},
      // gpt2-mini has 4 blocks.
      {[](TrainConfig& c) { c.pipeline_stages = 5; },
       "--pipeline-stages 5: more stages than the model's 4 blocks (every "
       "stage needs at least one)"},
      {[](TrainConfig& c) { c.pipeline_split = "1,2"; },
       "--pipeline-split 1,2 cuts the model into 3 stages; "
       "--pipeline-stages is 2"},
      {[](TrainConfig& c) { c.pipeline_split = "4"; },
       "--pipeline-split 4: stage 1 would hold blocks [4, 4) of the model's "
       "4; each stage needs at least one block, in increasing order"},
      {[](TrainConfig& c) { c.virtual_stages = 0; },
       "virtual_stages: got 0; must be in [1, 64] (1: no interleaving)"},
      {[](TrainConfig& c) {
         c.pipeline_stages = 1;
         c.micro_batches = 1;
         c.virtual_stages = 2;
       },
       "virtual_stages: got 2; chunks interleave pipeline stages; set "
       "pipeline_stages > 1"},
      {[](TrainConfig& c) {
         c.micro_batches = 1;
         c.virtual_stages = 2;
       },
       "--virtual-stages 2 under 1f1b runs micro-batches in groups of "
       "--pipeline-stages 2: --micro-batches must be a multiple of 2, got 1"},
      {[](TrainConfig& c) { c.virtual_stages = 3; },
       "--pipeline-stages 2 x --virtual-stages 3 = 6 model stages: more "
       "stages than the model's 4 blocks (every stage needs at least one)"},
      {[](TrainConfig& c) {
         c.virtual_stages = 2;
         c.pipeline_split = "1";
       },
       "--pipeline-split 1 cuts the model into 2 stages; --pipeline-stages 2 "
       "x --virtual-stages 2 = 4 model stages"},
  };
  for (const Case& c : cases) {
    TrainConfig config = PipelineConfig();
    c.mutate(config);
    const absl::Status status = config.Validate();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_EQ(status.message(), c.message);
  }
}

TEST(TrainConfigTest, PipelineWorldIsStagesTimesReplicas) {
  TrainConfig config = PipelineConfig();
  EXPECT_TRUE(config.CheckMeshWorld(2).ok());
  EXPECT_EQ(config.CheckMeshWorld(4).message(),
            "world_size: got 4; strategy single with 2 pipeline stages runs "
            "on 2 ranks (use ddp for 2 data-parallel replicas per stage)");
  EXPECT_EQ(config.CheckMeshWorld(3).message(),
            "world_size: got 3; must be a multiple of pipeline_stages (2): "
            "each data-parallel replica runs one rank per stage");
  EXPECT_EQ(config.CheckMeshWorld(1, "WORLD_SIZE").message(),
            "WORLD_SIZE: got 1; must be a multiple of pipeline_stages (2): "
            "each data-parallel replica runs one rank per stage");
  config.strategy = "ddp";
  EXPECT_TRUE(config.CheckMeshWorld(2).ok());
  EXPECT_TRUE(config.CheckMeshWorld(6).ok());
  EXPECT_EQ(config.DataParallelSize(6), 3);
  EXPECT_EQ(config.CheckMeshWorld(5).code(),
            absl::StatusCode::kInvalidArgument);
  // HSDP within each stage: its shard groups divide the stage's ranks.
  config.strategy = "hsdp";
  EXPECT_TRUE(config.Validate().ok());
  EXPECT_TRUE(config.CheckMeshWorld(8).ok());
  config.shard_group_size = 2;
  EXPECT_TRUE(config.CheckMeshWorld(8).ok());
  EXPECT_EQ(config.CheckMeshWorld(6).message(),
            "shard_group_size: got 2; must divide the 3 ranks of each "
            "pipeline stage (world_size 6 / 2 stages)");
}

}  // namespace
}  // namespace shardtrain

namespace shardtrain {
namespace {

TEST(TrainConfigTest, TensorParallelDividesTheHeadsAndTheWorld) {
  TrainConfig config;
  config.model = "custom:n_layer=2,n_head=4,n_embd=64";
  config.data = "/data/brown";
  config.tensor_parallel = 2;
  EXPECT_TRUE(config.Validate().ok()) << config.Validate();
  EXPECT_TRUE(config.CheckMeshWorld(2).ok());
  EXPECT_EQ(config.CheckMeshWorld(4).message(),
            "world_size: got 4; strategy single with tensor_parallel 2 runs on "
            "2 ranks (use ddp for 2 data-parallel replicas)");
  config.strategy = "ddp";
  EXPECT_TRUE(config.CheckMeshWorld(4).ok());
  EXPECT_EQ(config.DataParallelSize(4), 2);
  EXPECT_EQ(config.CheckMeshWorld(3).message(),
            "world_size: got 3; must be a multiple of tensor_parallel (2): "
            "each data-parallel replica runs that many ranks");
  config.tensor_parallel = 3;
  EXPECT_EQ(config.Validate().message(),
            "tensor_parallel: got 3; must divide the model's 4 attention heads "
            "(each rank runs whole heads)");
  config.tensor_parallel = 2;
  // FSDP shards each slice over the replicas: two at least; HSDP within
  // groups of them.
  config.strategy = "fsdp";
  EXPECT_TRUE(config.Validate().ok()) << config.Validate();
  EXPECT_TRUE(config.CheckMeshWorld(4).ok());
  EXPECT_EQ(config.CheckMeshWorld(2).message(),
            "world_size: got 2; strategy fsdp with tensor_parallel 2 shards "
            "each slice over the data-parallel replicas: it needs at least "
            "two (4 ranks)");
  config.strategy = "hsdp";
  EXPECT_TRUE(config.Validate().ok()) << config.Validate();
  EXPECT_TRUE(config.CheckMeshWorld(8).ok());
  // Within pipeline stages: replicas of stages x T ranks.
  config.strategy = "ddp";
  config.pipeline_stages = 2;
  EXPECT_TRUE(config.Validate().ok()) << config.Validate();
  EXPECT_EQ(config.ModelParallelSize(), 4);
  EXPECT_TRUE(config.CheckMeshWorld(8).ok());
  EXPECT_EQ(config.DataParallelSize(8), 2);
  EXPECT_EQ(config.CheckMeshWorld(6).message(),
            "world_size: got 6; must be a multiple of pipeline_stages x "
            "tensor_parallel (2 x 2 = 4): each data-parallel replica runs that "
            "many ranks");
  config.strategy = "single";
  EXPECT_EQ(config.CheckMeshWorld(8).message(),
            "world_size: got 8; strategy single with tensor_parallel 2 and 2 "
            "pipeline stages runs on 4 ranks (use ddp for 2 data-parallel "
            "replicas)");
  config.strategy = "fsdp";
  EXPECT_TRUE(config.CheckMeshWorld(8).ok());
  EXPECT_EQ(config.CheckMeshWorld(4).message(),
            "world_size: got 4; strategy fsdp with tensor_parallel 2 shards "
            "each slice over the data-parallel replicas: it needs at least "
            "two (8 ranks)");
}

}  // namespace
}  // namespace shardtrain
