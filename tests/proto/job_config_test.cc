#include "proto/job_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

namespace shardtrain {
namespace {

constexpr char kOut[] = "/state/jobs/j1";

v1::JobSpec MinimalSpec() {
  v1::JobSpec spec;
  spec.set_model("gpt2-tiny");
  spec.set_data("/data/brown");
  spec.mutable_strategy()->set_name("ddp");
  spec.set_world_size(2);
  return spec;
}

TEST(JobConfigTest, UnsetFieldsKeepTheTrainConfigDefaults) {
  absl::StatusOr<TrainConfig> config =
      TrainConfigFromJobSpec(MinimalSpec(), kOut);
  ASSERT_TRUE(config.ok()) << config.status();
  const TrainConfig defaults;
  EXPECT_EQ(config->model, "gpt2-tiny");
  EXPECT_EQ(config->data, "/data/brown");
  EXPECT_EQ(config->strategy, "ddp");
  EXPECT_EQ(config->device, "cpu");
  EXPECT_EQ(config->out, kOut);
  EXPECT_EQ(config->batch_size, defaults.batch_size);
  EXPECT_DOUBLE_EQ(config->lr, defaults.lr);
  EXPECT_DOUBLE_EQ(config->bucket_mb, defaults.bucket_mb);
  EXPECT_EQ(config->shuffle, defaults.shuffle);
}

TEST(JobConfigTest, SetFieldsOverrideIncludingZeroAndFalse) {
  v1::JobSpec spec = MinimalSpec();
  spec.mutable_trainer()->set_batch_size(3);
  spec.mutable_trainer()->set_warmup_steps(0);
  spec.mutable_trainer()->set_grad_clip(0);  // 0 disables clipping: must stick
  spec.mutable_trainer()->set_shuffle(false);
  spec.mutable_strategy()->set_name("fsdp");
  spec.mutable_strategy()->set_reshard_after_forward(false);
  spec.mutable_strategy()->set_fsdp_no_sync(true);
  spec.set_device_kind(v1::GPU);
  absl::StatusOr<TrainConfig> config = TrainConfigFromJobSpec(spec, kOut);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->batch_size, 3);
  EXPECT_EQ(config->warmup_steps, 0);
  EXPECT_DOUBLE_EQ(config->grad_clip, 0);
  EXPECT_FALSE(config->shuffle);
  EXPECT_FALSE(config->reshard_after_forward);
  EXPECT_TRUE(config->fsdp_no_sync);
  EXPECT_EQ(config->device, "cuda");
}

TEST(JobConfigTest, RoundTripsEveryTrainerField) {
  TrainConfig config;
  config.model = "gpt2-mini";
  config.data = "/d";
  config.strategy = "fsdp";
  config.batch_size = 5;
  config.seq_len = 64;
  config.grad_accum = 2;
  config.max_steps = 77;
  config.lr = 3e-4;
  config.min_lr_ratio = 0.2;
  config.warmup_steps = 7;
  config.weight_decay = 0.05;
  config.beta1 = 0.8;
  config.beta2 = 0.9;
  config.eps = 1e-7;
  config.grad_clip = 0.5;
  config.seed = 99;
  config.eval_every = 10;
  config.eval_steps = 3;
  config.checkpoint_every = 20;
  config.shuffle = false;
  config.peak_flops = 1e12;
  config.bucket_mb = 4;
  config.prefetch = false;
  config.comm_timeout = 30;
  absl::StatusOr<TrainConfig> back =
      TrainConfigFromJobSpec(JobSpecFromTrainConfig(config, 2), kOut);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(JobSpecFromTrainConfig(*back, 2).SerializeAsString(),
            JobSpecFromTrainConfig(config, 2).SerializeAsString());
  EXPECT_EQ(back->max_steps, 77);
  EXPECT_DOUBLE_EQ(back->beta1, 0.8);
  EXPECT_EQ(back->comm_timeout, 30);
}

TEST(JobConfigTest, RoundTripsThePipelineFields) {
  TrainConfig config;
  config.model = "gpt2-mini";
  config.data = "/d";
  config.strategy = "ddp";
  config.pipeline_stages = 2;
  config.pipeline_split = "1,2,3";  // four model stages: two chunks each
  config.micro_batches = 4;
  config.pipeline_schedule = "gpipe";
  config.virtual_stages = 2;
  const v1::JobSpec spec = JobSpecFromTrainConfig(config, 4);
  EXPECT_EQ(spec.strategy().virtual_stages(), 2);
  EXPECT_EQ(spec.strategy().pipeline_stages(), 2);
  EXPECT_EQ(spec.strategy().pipeline_split(), "1,2,3");
  EXPECT_EQ(spec.strategy().micro_batches(), 4);
  EXPECT_EQ(spec.strategy().pipeline_schedule(), "gpipe");
  absl::StatusOr<TrainConfig> back = TrainConfigFromJobSpec(spec, kOut);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(JobSpecFromTrainConfig(*back, 4).SerializeAsString(),
            spec.SerializeAsString());
  EXPECT_EQ(back->pipeline_stages, 2);
  EXPECT_EQ(back->pipeline_split, "1,2,3");
  EXPECT_EQ(back->micro_batches, 4);
  EXPECT_EQ(back->pipeline_schedule, "gpipe");
  EXPECT_EQ(back->virtual_stages, 2);
}

TEST(JobConfigTest, UnsetPipelineFieldsMeanNoPipeline) {
  absl::StatusOr<TrainConfig> config =
      TrainConfigFromJobSpec(MinimalSpec(), kOut);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->pipeline_stages, 1);
  EXPECT_EQ(config->pipeline_split, "");
  EXPECT_EQ(config->micro_batches, 1);
  EXPECT_EQ(config->pipeline_schedule, "1f1b");
}

// MinimalSpec with gpt2-mini (4 blocks) cut into `stages` stages.
v1::JobSpec PipelineSpec(const std::string& strategy, int stages, int world) {
  v1::JobSpec spec = MinimalSpec();
  spec.set_model("gpt2-mini");
  spec.mutable_strategy()->set_name(strategy);
  spec.mutable_strategy()->set_pipeline_stages(stages);
  spec.mutable_strategy()->set_micro_batches(2);
  spec.set_world_size(world);
  return spec;
}

TEST(JobConfigTest, WorldSizeIsPipelineStagesTimesTheDataParallelSize) {
  EXPECT_TRUE(TrainConfigFromJobSpec(PipelineSpec("single", 2, 2), kOut).ok());
  EXPECT_TRUE(TrainConfigFromJobSpec(PipelineSpec("single", 4, 4), kOut).ok());
  EXPECT_TRUE(TrainConfigFromJobSpec(PipelineSpec("ddp", 2, 2), kOut).ok());
  EXPECT_TRUE(TrainConfigFromJobSpec(PipelineSpec("ddp", 2, 6), kOut).ok());
  EXPECT_TRUE(TrainConfigFromJobSpec(PipelineSpec("hsdp", 2, 4), kOut).ok());
  EXPECT_TRUE(TrainConfigFromJobSpec(PipelineSpec("hsdp", 2, 8), kOut).ok());

  struct Case {
    v1::JobSpec spec;
    std::string message;
  };
  // Elastic with stages: re-meshed by the coordinator at other sizes.
  v1::JobSpec elastic = PipelineSpec("ddp", 2, 4);
  elastic.mutable_elastic()->set_min_world_size(2);
  elastic.mutable_trainer()->set_checkpoint_every(10);
  EXPECT_TRUE(TrainConfigFromJobSpec(elastic, kOut).ok());
  v1::JobSpec hsdp_groups = PipelineSpec("hsdp", 2, 8);
  hsdp_groups.mutable_strategy()->set_shard_group_size(3);
  v1::JobSpec no_stages = MinimalSpec();
  no_stages.mutable_strategy()->set_name("single");
  const Case cases[] = {
      {PipelineSpec("single", 2, 4),
       "world_size: got 4; strategy single with 2 pipeline stages runs on 2 "
       "ranks (use ddp for 2 data-parallel replicas per stage)"},
      {PipelineSpec("single", 2, 1),
       "world_size: got 1; must be a multiple of pipeline_stages (2): each "
       "data-parallel replica runs one rank per stage"},
      {PipelineSpec("ddp", 2, 3),
       "world_size: got 3; must be a multiple of pipeline_stages (2): each "
       "data-parallel replica runs one rank per stage"},
      {PipelineSpec("ddp", 4, 2),
       "world_size: got 2; must be a multiple of pipeline_stages (4): each "
       "data-parallel replica runs one rank per stage"},
      {hsdp_groups,
       "shard_group_size: got 3; must divide the 4 ranks of each pipeline "
       "stage (world_size 8 / 2 stages)"},
      // Without stages, single still means one device.
      {no_stages,
       "world_size: got 2; strategy single trains on one device (use ddp, "
       "fsdp or hsdp)"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<TrainConfig> config = TrainConfigFromJobSpec(c.spec, kOut);
    ASSERT_FALSE(config.ok()) << c.message;
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(config.status().message(), c.message);
  }
}

// Strategy auto is resolved when the job starts, for the ranks it then
// has: the spec holds "auto" at any world size, the rest of it must hold
// whatever mesh is picked; an elastic one is picked for at each size.
TEST(JobConfigTest, AutoIsKeptForTheCoordinatorToResolve) {
  v1::JobSpec spec = MinimalSpec();
  spec.mutable_strategy()->set_name("auto");
  spec.set_world_size(4);
  absl::StatusOr<TrainConfig> c = TrainConfigFromJobSpec(spec, kOut);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->strategy, "auto");
  spec.mutable_trainer()->set_batch_size(-1);
  EXPECT_THAT(
      std::string(TrainConfigFromJobSpec(spec, kOut).status().message()),
      ::testing::HasSubstr("batch_size"));
  spec.mutable_trainer()->set_batch_size(4);
  // Elastic: picked for anew at each world size it runs at.
  spec.mutable_trainer()->set_checkpoint_every(10);
  spec.mutable_elastic()->set_min_world_size(2);
  c = TrainConfigFromJobSpec(spec, kOut);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->strategy, "auto");
}

// Auto with a memory cap no mesh fits is refused at submit, naming the
// least any mesh needs, not accepted to fail when it starts.
TEST(JobConfigTest, AutoThatNothingFitsIsRefusedNamingTheLeastMemory) {
  v1::JobSpec spec = MinimalSpec();
  spec.mutable_strategy()->set_name("auto");
  spec.set_world_size(2);
  spec.mutable_trainer()->set_memory_cap_bytes(1 << 20);  // 1 MiB
  const absl::Status refused = TrainConfigFromJobSpec(spec, kOut).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.message()),
              ::testing::HasSubstr("strategy auto: no mesh of 2 ranks fits "
                                   "memory_cap 1.0 MiB"));
  EXPECT_THAT(std::string(refused.message()),
              ::testing::HasSubstr("the least is "));
  spec.mutable_trainer()->set_memory_cap_bytes(int64_t{8} << 30);
  EXPECT_TRUE(TrainConfigFromJobSpec(spec, kOut).ok());
}

// Every view names a job's mesh the one way (MeshName): the tensor and
// pipeline dimensions included, auto's choice once it has one.
TEST(JobConfigTest, JobMeshNameNamesEveryDimension) {
  v1::JobSpec spec = MinimalSpec();
  EXPECT_EQ(JobMeshName(spec), "ddp2");
  spec.mutable_strategy()->set_name("single");
  spec.mutable_strategy()->set_tensor_parallel(2);
  EXPECT_EQ(JobMeshName(spec), "tp2");
  spec.mutable_strategy()->set_name("fsdp");
  spec.set_world_size(4);
  EXPECT_EQ(JobMeshName(spec), "fsdp2xtp2");
  spec.mutable_strategy()->set_pipeline_stages(2);
  spec.set_world_size(8);
  EXPECT_EQ(JobMeshName(spec), "pp2xfsdp2xtp2");
  spec.mutable_strategy()->set_tensor_parallel(1);
  EXPECT_EQ(JobMeshName(spec, /*world_size=*/4), "pp2xfsdp2");
  spec.mutable_strategy()->set_name("auto");
  EXPECT_EQ(JobMeshName(spec), "auto");
  (*spec.mutable_labels())["auto_mesh"] = "tp4";
  EXPECT_EQ(JobMeshName(spec), "auto: tp4");
}

TEST(JobConfigTest, InvalidSpecsNameTheField) {
  struct Case {
    std::string field;
    void (*mutate)(v1::JobSpec&);
  };
  const Case cases[] = {
      {"model", [](v1::JobSpec& s) { s.set_model("gpt5"); }},
      {"batch_size",
       [](v1::JobSpec& s) { s.mutable_trainer()->set_batch_size(-1); }},
      {"seq_len",
       [](v1::JobSpec& s) { s.mutable_trainer()->set_seq_len(100000); }},
      {"strategy",
       [](v1::JobSpec& s) { s.mutable_strategy()->set_name("zero"); }},
      {"world_size", [](v1::JobSpec& s) { s.set_world_size(0); }},
      {"world_size",
       [](v1::JobSpec& s) {
         s.mutable_strategy()->set_name("single");
         s.set_world_size(2);
       }},
      {"max_restarts", [](v1::JobSpec& s) { s.set_max_restarts(-1); }},
      {"threads_as_ranks",
       [](v1::JobSpec& s) { s.mutable_trainer()->set_threads_as_ranks(-2); }},
      {"pipeline_stages",
       [](v1::JobSpec& s) { s.mutable_strategy()->set_pipeline_stages(0); }},
      {"micro_batches",
       [](v1::JobSpec& s) { s.mutable_strategy()->set_micro_batches(3); }},
      {"--pipeline-schedule",
       [](v1::JobSpec& s) {
         s.mutable_strategy()->set_pipeline_schedule("interleaved");
       }},
      {"precision",
       [](v1::JobSpec& s) { s.mutable_trainer()->set_precision("fp8"); }},
      {"data", [](v1::JobSpec& s) { s.set_data(""); }},
      {"name: contains a control character",
       [](v1::JobSpec& s) { s.set_name("a\nb"); }},
      {"name: contains a control character",
       [](v1::JobSpec& s) { s.set_name("\x1b[2Jcleared"); }},
      {"labels[team]: contains a control character",
       [](v1::JobSpec& s) { (*s.mutable_labels())["team"] = "a\tb"; }},
      // UTF-8 C1 control CSI (U+009B) and a right-to-left override (U+202E).
      {"name: contains a control character",
       [](v1::JobSpec& s) {
         s.set_name(
             "a\xc2\x9b"
             "2Jb");
       }},
      {"name: contains a control character",
       [](v1::JobSpec& s) {
         s.set_name(
             "invoice\xe2\x80\xae"
             "exe.pdf");
       }},
      {"labels[team]: contains a control character",
       [](v1::JobSpec& s) {
         (*s.mutable_labels())["team"] = "x\xe2\x81\xa6y";
       }},
  };
  for (const Case& c : cases) {
    v1::JobSpec spec = MinimalSpec();
    c.mutate(spec);
    absl::StatusOr<TrainConfig> config = TrainConfigFromJobSpec(spec, kOut);
    ASSERT_FALSE(config.ok()) << c.field;
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(config.status().message().find(c.field), std::string::npos)
        << c.field << ": " << config.status().message();
  }
}

TEST(JobConfigTest, NamesAndLabelsMayHoldAnyPrintableText) {
  v1::JobSpec spec = MinimalSpec();
  spec.set_name("../../x; rm -rf / $(id) `id` 'q' \"dq\" ünïcödé — 名前 ©");
  (*spec.mutable_labels())["team"] = "../etc/passwd | cat";
  EXPECT_TRUE(TrainConfigFromJobSpec(spec, kOut).ok());
}

}  // namespace
}  // namespace shardtrain
