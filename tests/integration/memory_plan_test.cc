// `shardtrain plan` against reality: the predicted per-rank peak of every
// strategy, at world sizes 1, 2 and 4 on gpt2-tiny and gpt2-mini, and of
// every pipeline stage (GPipe and 1F1B, with and without activation
// checkpointing, one replica or DDP), within 2% of the peak the tracking CPU
// allocator measured in a real shardtrain-train run (memory_peak_bytes in
// metrics.jsonl: exact tensor bytes, per rank and step; the plan is compared
// with the largest over steps, and over ranks, or over a stage's ranks). Two
// steps suffice: the second is the first with the optimizer's state alive,
// and every later step repeats it (a third step measured the same bytes).
#include "core/plan/memory_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/data/token_file.h"
#include "core/plan/pipeline_plan.h"
#include "core/plan/step_time_plan.h"
#include "core/run/step_metrics.h"
#include "nlohmann/json.hpp"
#include "tests/test_util.h"

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
    // For models with a vocabulary of 512.
    fs::create_directories(*dir_ / "data512");
    for (auto& t : tokens) t %= 512;
    ASSERT_TRUE(
        WriteTokenFile((*dir_ / "data512/train.bin").string(), tokens).ok());
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }

  // The largest memory_peak_bytes of any rank and step of a 2-step run.
  static int64_t MeasuredPeak(const TrainConfig& config, int64_t world) {
    int64_t peak = 0;
    for (const auto& [rank, bytes] : MeasuredPeaks(config, world)) {
      peak = std::max(peak, bytes);
    }
    return peak;
  }

  // Each rank's largest memory_peak_bytes over the steps of a 2-step run.
  static std::map<int64_t, int64_t> MeasuredPeaks(const TrainConfig& config,
                                                  int64_t world) {
    const std::string name = absl::StrCat(
        std::hash<std::string>()(config.model), "_", config.strategy, "_",
        world, "_", config.activation_checkpointing, "_pp",
        config.pipeline_stages, "_", config.micro_batches, "_",
        config.pipeline_schedule, "_v", config.virtual_stages, "_tp",
        config.tensor_parallel, "_b", config.batch_size, "_s", config.seq_len);
    const fs::path out = *dir_ / name;
    std::string command =
        std::string(SHARDTRAIN_BINARY_DIR) + "/bin/shardtrain-train --model " +
        config.model + " --strategy " + config.strategy + " --data " +
        (*dir_ / (absl::StrContains(config.model, "vocab_size=512") ? "data512"
                                                                    : "data"))
            .string() +
        " --batch-size " + std::to_string(config.batch_size) + " --seq-len " +
        std::to_string(config.seq_len) + " --activation-checkpointing " +
        config.activation_checkpointing + " --shard-group-size " +
        std::to_string(config.shard_group_size) +
        " --max-steps 2 --eval-steps 1 --out " + out.string();
    if (world > 1) command += " --nproc " + std::to_string(world);
    if (config.tensor_parallel > 1) {
      command += absl::StrCat(" --tensor-parallel ", config.tensor_parallel);
    }
    if (config.pipeline_stages > 1) {
      command += absl::StrCat(" --pipeline-stages ", config.pipeline_stages,
                              " --micro-batches ", config.micro_batches,
                              " --pipeline-schedule ", config.pipeline_schedule,
                              " --virtual-stages ", config.virtual_stages);
    }
    const test::CommandResult r = test::RunCommand(command);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    std::ifstream metrics(out / "metrics.jsonl");
    std::string line;
    std::map<int64_t, int64_t> peaks;
    int rows = 0;
    while (std::getline(metrics, line)) {
      absl::StatusOr<StepMetrics> m = StepMetrics::FromJson(line);
      if (!m.ok()) continue;
      peaks[m->rank] = std::max(peaks[m->rank], m->memory_peak_bytes);
      ++rows;
    }
    EXPECT_EQ(rows, 2 * world) << name;
    return peaks;
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

// The Llama family's activations are counted from its code (memory_plan.cc
// LlamaBlockBytesPerToken): measured, 0.2% to 0.6% under the peak (single,
// DDP and FSDP at 1, 2 and 4 ranks), within the bound GPT-2's plans hold.
TEST_F(MemoryPlanTest, PredictsTheMeasuredPeakOfLlamaTiny) {
  CheckModel("llama-tiny", 4, 128);
}

TEST_F(MemoryPlanTest, PredictsTheMeasuredPeakOfGpt2Mini) {
  CheckModel("gpt2-mini", 2, 64);
}

// Tensor parallelism: each rank holds 1/T of every layer and of wte's rows,
// and 1/T of the activations inside the blocks; with replicas, DDP, FSDP or
// HSDP (two groups of two) over them; with activation checkpointing, where the
// head is large (the end of the forward), and where it is small (a vocabulary
// of 512: the recomputed block's start, or, with long sequences, its softmax's
// backward). The plan of each mesh against the largest peak any rank
// measured.
TEST_F(MemoryPlanTest, PredictsTheMeasuredPeakOfTensorParallelMeshes) {
  struct Case {
    const char* model;
    const char* strategy;
    int64_t tensor_parallel;
    int64_t world;
    int64_t batch;
    int64_t seq;
    const char* checkpointing = "none";
  };
  const char* small_head =
      "custom:n_layer=4,n_head=4,n_embd=256,block_size=128,vocab_size=512";
  const char* long_sequences =
      "custom:n_layer=4,n_head=8,n_embd=128,block_size=512,vocab_size=512";
  for (const Case& c : {Case{"gpt2-tiny", "single", 2, 2, 4, 64},
                        Case{"gpt2-mini", "single", 4, 4, 8, 128},
                        Case{"gpt2-mini", "ddp", 2, 4, 8, 128},
                        Case{"gpt2-mini", "fsdp", 2, 4, 8, 128},
                        Case{"gpt2-mini", "single", 2, 2, 8, 128, "all"},
                        Case{small_head, "single", 2, 2, 16, 64, "all"},
                        Case{small_head, "fsdp", 2, 4, 16, 64, "all"},
                        Case{small_head, "hsdp", 2, 8, 8, 64},
                        Case{long_sequences, "single", 4, 4, 4, 512, "all"}}) {
    TrainConfig config;
    config.model = c.model;
    config.strategy = c.strategy;
    config.tensor_parallel = c.tensor_parallel;
    config.batch_size = c.batch;
    config.seq_len = c.seq;
    config.activation_checkpointing = c.checkpointing;
    absl::StatusOr<MemoryPlan> plan = PlanMemory(config, c.world);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->tensor_parallel, c.tensor_parallel);
    const int64_t measured = MemoryPlanTest::MeasuredPeak(config, c.world);
    const double error =
        static_cast<double>(plan->total() - measured) / measured;
    std::printf(
        "%s %s x tp %ld world %ld, activation checkpointing %s: predicted "
        "%.2f MiB at %s, measured %.2f MiB (%+.2f%%)\n",
        c.model, c.strategy, static_cast<long>(c.tensor_parallel),
        static_cast<long>(c.world), c.checkpointing, plan->total() / 1048576.0,
        plan->PeakMomentName().c_str(), measured / 1048576.0, 100 * error);
    EXPECT_LE(std::abs(error), kTolerance)
        << c.model << " tp" << c.world << " " << c.checkpointing;
  }
}

// The state a tensor-parallel rank keeps: the model's over T but for the
// tensors every rank holds whole (wpe, the LayerNorms, the row-parallel
// biases), so TP 2 keeps about half of what a DDP rank does.
TEST(MemoryPlanTensorParallelTest, EachRankKeepsItsShareOfTheState) {
  for (const char* model : {"gpt2-tiny", "gpt2-mini", "gpt2"}) {
    TrainConfig config;
    config.model = model;
    config.strategy = "ddp";
    const absl::StatusOr<MemoryPlan> ddp = PlanMemory(config, 2);
    config.strategy = "single";
    config.tensor_parallel = 2;
    const absl::StatusOr<MemoryPlan> tp = PlanMemory(config, 2);
    ASSERT_TRUE(ddp.ok() && tp.ok()) << ddp.status() << tp.status();
    const ModelConfig shapes = *ParseModelSpec(model);
    const int64_t c = shapes.n_embd;
    const int64_t whole =
        shapes.block_size * c + 2 * c + shapes.n_layer * 6 * c;
    const int64_t state = tp->parameters + tp->gradients + tp->optimizer_state;
    EXPECT_EQ(state,
              (ddp->parameters + ddp->gradients + ddp->optimizer_state) / 2 +
                  16 * whole / 2)
        << model;
    const double ratio =
        static_cast<double>(state) /
        (ddp->parameters + ddp->gradients + ddp->optimizer_state);
    std::printf("%s: tp 2 keeps %.3f of a ddp rank's state\n", model, ratio);
    EXPECT_LT(ratio, 0.52) << model;
  }
  // Refused: tensor ranks that do not divide the heads or the world.
  TrainConfig config;
  config.model = "gpt2-tiny";
  config.tensor_parallel = 3;
  EXPECT_EQ(PlanMemory(config, 3).status().code(),
            absl::StatusCode::kInvalidArgument);
  config.tensor_parallel = 2;
  config.strategy = "ddp";
  EXPECT_EQ(PlanMemory(config, 3).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Activation checkpointing keeps each recomputed block's output only.
  const absl::StatusOr<MemoryPlan> whole = PlanMemory(config, 4);
  config.activation_checkpointing = "all";
  const absl::StatusOr<MemoryPlan> recomputed = PlanMemory(config, 4);
  ASSERT_TRUE(whole.ok() && recomputed.ok())
      << whole.status() << recomputed.status();
  EXPECT_EQ(recomputed->recomputed_blocks, 2);
  EXPECT_LT(recomputed->activations, whole->activations);
}

// Activation checkpointing and HSDP. A model whose attention is large
// against its head (batch 8 of 512 tokens), so that for DDP and FSDP the
// backward's recomputation of a block, not the end of the forward, is the
// peak the plan must find.
TEST_F(MemoryPlanTest, PredictsThePeakWithActivationCheckpointingAndHsdp) {
  const std::string model =
      "custom:n_layer=2,n_head=8,n_embd=256,block_size=512";
  struct Case {
    const char* strategy;
    int64_t world;
    const char* checkpointing;
  };
  // DDP's replicated blocks recompute as one device's do (single); FSDP
  // without checkpointing is PredictsTheMeasuredPeakOfGpt2Mini's.
  for (const Case& c : {Case{"single", 1, "all"}, Case{"fsdp", 2, "all"},
                        Case{"fsdp", 2, "every-2"}, Case{"hsdp", 4, "all"}}) {
    TrainConfig config;
    config.model = model;
    config.strategy = c.strategy;
    config.batch_size = 8;
    config.seq_len = 512;
    config.activation_checkpointing = c.checkpointing;
    if (config.strategy == "hsdp") config.shard_group_size = 2;
    absl::StatusOr<MemoryPlan> plan = PlanMemory(config, c.world);
    ASSERT_TRUE(plan.ok()) << plan.status();
    if (config.strategy != "single" &&
        config.activation_checkpointing != "none" &&
        BuiltAttentionKind() == AttentionKind::kMaskedSoftmax) {
      // The case this test is for.
      EXPECT_GT(plan->recomputation, 0) << c.strategy;
    }
    const int64_t measured = MemoryPlanTest::MeasuredPeak(config, c.world);
    const double error =
        static_cast<double>(plan->total() - measured) / measured;
    std::printf(
        "%s world %ld, activation checkpointing %s: predicted %.1f MiB "
        "(recomputation %.1f MiB), measured %.1f MiB (%+.2f%%)\n",
        c.strategy, static_cast<long>(c.world), c.checkpointing,
        plan->total() / 1048576.0, plan->recomputation / 1048576.0,
        measured / 1048576.0, 100 * error);
    EXPECT_LE(std::abs(error), kTolerance)
        << c.strategy << " " << c.checkpointing;
  }
}

// Where the head is small (a vocabulary of 512), the step with activation
// checkpointing peaks at the start of the last recomputed block's backward,
// with all its rebuilt activations alive: the plan says so and is within
// its 2% there too.
TEST_F(MemoryPlanTest, PredictsThePeakAtTheStartOfARecomputedBlock) {
  for (const auto& [strategy, world] :
       {std::pair<const char*, int64_t>{"single", 1}, {"ddp", 2}}) {
    TrainConfig config;
    config.model =
        "custom:n_layer=4,n_head=4,n_embd=256,block_size=128,vocab_size=512";
    config.strategy = strategy;
    config.batch_size = 16;
    config.seq_len = 64;
    config.activation_checkpointing = "all";
    absl::StatusOr<MemoryPlan> plan = PlanMemory(config, world);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->peak_moment, MemoryPlan::Moment::kRecomputedBlockStart)
        << plan->PeakMomentName();
    const int64_t measured = MemoryPlanTest::MeasuredPeak(config, world);
    const double error =
        static_cast<double>(plan->total() - measured) / measured;
    std::printf(
        "%s world %ld, peak at %s: predicted %.2f MiB, measured %.2f "
        "MiB (%+.2f%%)\n",
        strategy, static_cast<long>(world), plan->PeakMomentName().c_str(),
        plan->total() / 1048576.0, measured / 1048576.0, 100 * error);
    EXPECT_LE(std::abs(error), kTolerance) << strategy;
  }
}

// A pipeline run: `stages` stages x `world` / `stages` / `tensor_parallel`
// replicas (DDP for more than one), its batch cut into `micro_batches`.
struct PipelineCase {
  int64_t stages;
  int64_t world;
  int64_t micro_batches;
  const char* schedule;
  const char* checkpointing;
  const char* strategy = "";  // "": single for one replica, else ddp
  int64_t tensor_parallel = 1;
  int64_t virtual_stages = 1;  // chunks per stage (interleaved)
};

// Every stage's plan (PlanPipelineStages) against the largest peak its
// ranks measured (rank r runs stage r / (world / stages)).
void CheckPipeline(const std::string& model, int64_t batch, int64_t seq,
                   const PipelineCase& c) {
  TrainConfig config;
  config.model = model;
  config.strategy = *c.strategy != '\0'                      ? c.strategy
                    : c.world > c.stages * c.tensor_parallel ? "ddp"
                                                             : "single";
  config.tensor_parallel = c.tensor_parallel;
  config.batch_size = batch;
  config.seq_len = seq;
  config.pipeline_stages = c.stages;
  config.micro_batches = c.micro_batches;
  config.pipeline_schedule = c.schedule;
  config.virtual_stages = c.virtual_stages;
  config.activation_checkpointing = c.checkpointing;
  absl::StatusOr<std::vector<MemoryPlan>> plans =
      PlanPipelineStages(config, c.world);
  ASSERT_TRUE(plans.ok()) << plans.status();
  ASSERT_EQ(plans->size(), static_cast<size_t>(c.stages));
  const std::map<int64_t, int64_t> peaks =
      MemoryPlanTest::MeasuredPeaks(config, c.world);
  const int64_t stage_ranks = c.world / c.stages;
  const int64_t replicas = stage_ranks / c.tensor_parallel;
  for (const MemoryPlan& plan : *plans) {
    int64_t measured = 0;
    for (const auto& [rank, bytes] : peaks) {
      if (rank / stage_ranks == plan.stage) {
        measured = std::max(measured, bytes);
      }
    }
    const double error =
        static_cast<double>(plan.total() - measured) / measured;
    std::printf(
        "%s %ld stages (%ld chunks each) x %ld %s x tp %ld, %s, %ld "
        "micro-batches, activation checkpointing %s: stage %ld (%s) predicted "
        "%.2f MiB at %s, measured %.2f MiB (%+.2f%%)\n",
        model.c_str(), static_cast<long>(c.stages),
        static_cast<long>(c.virtual_stages), static_cast<long>(replicas),
        config.strategy.c_str(), static_cast<long>(c.tensor_parallel),
        c.schedule, static_cast<long>(c.micro_batches), c.checkpointing,
        static_cast<long>(plan.stage), plan.stage_layers.c_str(),
        plan.total() / 1048576.0, plan.PeakMomentName().c_str(),
        measured / 1048576.0, 100 * error);
    EXPECT_LE(std::abs(error), kTolerance)
        << model << " pp" << c.stages << " v" << c.virtual_stages << " tp"
        << c.tensor_parallel << " " << c.schedule << " " << c.checkpointing
        << " stage " << plan.stage;
  }
}

// gpt2-tiny's two blocks in two stages: stage 0 peaks in the embeddings'
// backward (wte's dense gradient), the last stage at its LM head, where
// GPipe holds every micro-batch's gradient of wte; one replica or two; and
// zb-h1, whose micro-batches keep what their W needs past their B.
TEST_F(MemoryPlanTest, PredictsEachPipelineStageOfGpt2Tiny) {
  for (const PipelineCase& c : {PipelineCase{2, 2, 2, "1f1b", "none"},
                                PipelineCase{2, 2, 4, "gpipe", "all"},
                                PipelineCase{2, 4, 2, "1f1b", "none"},
                                PipelineCase{2, 2, 4, "zb-h1", "none"}}) {
    CheckPipeline("gpt2-tiny", 4, 128, c);
  }
}

// gpt2-mini in two stages (three blocks and one); the second replica's
// stage 0 peaks in the all-reduce of its gradients.
// The Llama family's pipeline stages and tensor-parallel ranks: each stage's
// plan, and a tensor-parallel rank's, against the measured peak (measured:
// the stages 0.12% and 0.16% under, a TP 2 rank 0.5% under).
TEST_F(MemoryPlanTest, PredictsLlamaStagesAndTensorRanks) {
  CheckPipeline("llama-tiny", 4, 128, PipelineCase{2, 2, 2, "1f1b", "none"});
  // zb-h1: each micro-batch keeps its projections' inputs and output
  // gradients from its B to its W.
  CheckPipeline("llama-tiny", 4, 128, PipelineCase{2, 2, 4, "zb-h1", "none"});
  TrainConfig config;
  config.model = "llama-tiny";
  config.strategy = "single";
  config.tensor_parallel = 2;
  config.batch_size = 4;
  config.seq_len = 128;
  absl::StatusOr<MemoryPlan> plan = PlanMemory(config, 2);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const int64_t measured = MemoryPlanTest::MeasuredPeak(config, 2);
  const double error = static_cast<double>(plan->total() - measured) / measured;
  std::printf(
      "llama-tiny tp2: predicted %.2f MiB, measured %.2f MiB (%+.2f%%)\n",
      plan->total() / 1048576.0, measured / 1048576.0, 100 * error);
  EXPECT_LE(std::abs(error), kTolerance);
}

TEST_F(MemoryPlanTest, PredictsEachStageOfGpt2MiniInTwoStages) {
  for (const PipelineCase& c : {PipelineCase{2, 2, 4, "gpipe", "none"},
                                PipelineCase{2, 2, 2, "1f1b", "every-2"},
                                PipelineCase{2, 4, 2, "1f1b", "none"}}) {
    CheckPipeline("gpt2-mini", 4, 64, c);
  }
}

// Interleaved: gpt2-mini's four blocks as two chunks on each of two stages
// (stage 0: blocks 0 and 2 with the embeddings, stage 1: blocks 1 and 3
// with the head); each chunk's micro-batches hold its activations from
// their forward to their backward, stage 0 up to 2(S-1) + (V-1)S + 1 = 5
// chunks at once under 1F1B; replicated and sharded.
TEST_F(MemoryPlanTest, PredictsEachInterleavedStageOfGpt2Mini) {
  for (const PipelineCase& c :
       {PipelineCase{2, 2, 4, "1f1b", "none", "", 1, 2},
        PipelineCase{2, 4, 2, "1f1b", "every-2", "fsdp", 1, 2},
        PipelineCase{2, 2, 2, "gpipe", "none", "", 1, 2}}) {
    CheckPipeline("gpt2-mini", 4, 64, c);
  }
}

// gpt2-mini in four stages of one block: the middle stages, without
// embeddings or head, peak in a block's backward, holding 3 and 2
// micro-batches under 1F1B and all 4 under GPipe.
TEST_F(MemoryPlanTest, PredictsEachStageOfGpt2MiniInFourStages) {
  for (const PipelineCase& c : {PipelineCase{4, 4, 4, "1f1b", "none"},
                                PipelineCase{4, 4, 4, "gpipe", "all"}}) {
    CheckPipeline("gpt2-mini", 4, 64, c);
  }
}

// FSDP within each stage of gpt2-mini's two: a shard of the stage kept, the
// whole stage gathered and its full gradients made within the step.
TEST_F(MemoryPlanTest, PredictsEachShardedStageOfGpt2Mini) {
  for (const PipelineCase& c :
       {PipelineCase{2, 4, 2, "1f1b", "none", "fsdp"},
        PipelineCase{2, 4, 4, "gpipe", "every-2", "fsdp"}}) {
    CheckPipeline("gpt2-mini", 4, 64, c);
  }
}

// Tensor parallelism within the stages: each stage's ranks hold 1/T of its
// layers and of wte's rows; one replica, DDP and FSDP over the replicas.
// gpt2-tiny's stage 0 peaks at the gradient norm (its double-precision
// piece on CPU), the small-vocabulary model's stages in a block's backward.
TEST_F(MemoryPlanTest, PredictsEachStageWithTensorParallelism) {
  CheckPipeline("gpt2-tiny", 4, 128,
                PipelineCase{2, 4, 2, "1f1b", "none", "", 2});
  CheckPipeline(
      "custom:n_layer=4,n_head=4,n_embd=256,block_size=128,vocab_size=512", 8,
      64, PipelineCase{2, 4, 2, "1f1b", "none", "", 2});
  for (const PipelineCase& c :
       {PipelineCase{2, 4, 4, "gpipe", "all", "", 2},
        PipelineCase{2, 8, 2, "1f1b", "none", "ddp", 2},
        PipelineCase{2, 8, 2, "1f1b", "none", "fsdp", 2}}) {
    CheckPipeline("gpt2-mini", 4, 64, c);
  }
}

// Each stage plans its own share: the embeddings on stage 0, ln_f and the
// tied wte's copy on the last, the micro-batches the schedule has it hold
// (1F1B: S - s, GPipe: all), and PlanMemory is the stage that needs most.
TEST(MemoryPlanPipelineTest, EachStagePlansItsShareAndSchedule) {
  TrainConfig config;
  config.model = "gpt2-mini";  // 4 blocks of C 256, positions 512
  config.strategy = "single";
  config.batch_size = 8;
  config.seq_len = 64;
  config.pipeline_stages = 4;
  config.micro_batches = 8;
  absl::StatusOr<std::vector<MemoryPlan>> plans = PlanPipelineStages(config, 4);
  ASSERT_TRUE(plans.ok()) << plans.status();
  ASSERT_EQ(plans->size(), 4u);
  const int64_t c = 256, block = 12 * c * c + 13 * c, wte = 50304 * c;
  EXPECT_EQ((*plans)[0].parameters, 4 * (block + wte + 512 * c));
  EXPECT_EQ((*plans)[1].parameters, 4 * block);
  EXPECT_EQ((*plans)[3].parameters, 4 * (block + wte + 2 * c));
  EXPECT_EQ((*plans)[3].stage_layers, "block 3, head");
  for (const MemoryPlan& plan : *plans) {
    EXPECT_EQ(plan.pipeline_stages, 4);
    EXPECT_EQ(plan.optimizer_state, 2 * plan.parameters);
  }
  // The middle stages peak in a backward with all their micro-batches held.
  EXPECT_EQ((*plans)[1].micro_batches_in_flight, 3);
  EXPECT_EQ((*plans)[2].micro_batches_in_flight, 2);
  EXPECT_EQ((*plans)[3].peak_moment, MemoryPlan::Moment::kHead);
  const MemoryPlan& largest = *std::max_element(
      plans->begin(), plans->end(),
      [](const auto& a, const auto& b) { return a.total() < b.total(); });
  EXPECT_EQ(PlanMemory(config, 4)->total(), largest.total());

  config.pipeline_schedule = "gpipe";
  absl::StatusOr<std::vector<MemoryPlan>> gpipe = PlanPipelineStages(config, 4);
  ASSERT_TRUE(gpipe.ok()) << gpipe.status();
  EXPECT_EQ((*gpipe)[1].micro_batches_in_flight, 8);
  EXPECT_GT((*gpipe)[1].activations, (*plans)[1].activations);
  // The last stage holds every micro-batch's gradient of wte from its head.
  EXPECT_GT((*gpipe)[3].logits - (*plans)[3].logits, 7 * 4 * wte);
}

// A Llama model's state is counted from its own shapes: Llama 3.1 8B's
// published 8,030,261,248 parameters on one device, its untied head on the
// last stage only, its embedding on the first, and under tensor parallelism
// every matrix split but the RMSNorms.
TEST(MemoryPlanLlamaTest, CountsTheStateOfLlama31_8B) {
  TrainConfig config;
  config.model = "llama3.1-8b";
  config.strategy = "single";
  config.device = "cuda";
  config.batch_size = 4;
  config.seq_len = 2048;
  absl::StatusOr<MemoryPlan> single = PlanMemory(config, 1);
  ASSERT_TRUE(single.ok()) << single.status();
  constexpr int64_t kParameters = 8'030'261'248;
  EXPECT_EQ(single->parameters, 4 * kParameters);
  EXPECT_EQ(single->optimizer_state, 8 * kParameters);

  const int64_t c = 4096, vocab = 128256 * c;
  const int64_t block = 2 * c + 2 * c * c + 2 * c * 1024 + 3 * c * 14336;
  config.pipeline_stages = 4;
  config.micro_batches = 4;
  absl::StatusOr<std::vector<MemoryPlan>> stages =
      PlanPipelineStages(config, 4);
  ASSERT_TRUE(stages.ok()) << stages.status();
  ASSERT_EQ(stages->size(), 4u);
  absl::StatusOr<std::vector<PipelineStage>> cuts =
      PartitionPipeline(*ParseModelSpec("llama3.1-8b"), config.seq_len, 4, {});
  ASSERT_TRUE(cuts.ok()) << cuts.status();
  int64_t blocks = 0;
  for (size_t i = 0; i < 4; ++i) {
    const PipelineStage& cut = (*cuts)[i];
    const int64_t held = cut.end_block - cut.first_block;
    blocks += held;
    // The embedding on the first stage, the untied head and the final norm
    // on the last, nothing of either in between.
    EXPECT_EQ(
        (*stages)[i].parameters,
        4 * (held * block + (i == 0 ? vocab : 0) + (i == 3 ? vocab + c : 0)))
        << "stage " << i;
  }
  EXPECT_EQ(blocks, 32);

  config.pipeline_stages = 1;
  config.micro_batches = 1;
  config.tensor_parallel = 8;
  absl::StatusOr<MemoryPlan> tp = PlanMemory(config, 8);
  ASSERT_TRUE(tp.ok()) << tp.status();
  const int64_t norms = (2 * 32 + 1) * c;
  EXPECT_EQ(tp->parameters, 4 * ((kParameters - norms) / 8 + norms));
  config.tensor_parallel = 16;
  absl::StatusOr<MemoryPlan> sixteen = PlanMemory(config, 16);
  ASSERT_FALSE(sixteen.ok());
  EXPECT_THAT(std::string(sixteen.status().message()),
              testing::HasSubstr("8 key/value heads"));
}

// HSDP within a stage: each stage sharded over its shard group of G ranks,
// so a rank of PP 2 x HSDP 4 (two groups of two) holds what a rank of PP 2 x
// FSDP 2 does, and its groups' all-reduce adds nothing.
TEST(MemoryPlanPipelineTest, HsdpShardsEachStageWithinItsGroups) {
  TrainConfig config;
  config.model = "gpt2-mini";
  config.seq_len = 64;
  config.batch_size = 4;
  config.pipeline_stages = 2;
  config.micro_batches = 4;
  config.strategy = "fsdp";
  const absl::StatusOr<std::vector<MemoryPlan>> fsdp =
      PlanPipelineStages(config, 4);
  config.strategy = "hsdp";
  const absl::StatusOr<std::vector<MemoryPlan>> hsdp =
      PlanPipelineStages(config, 8);
  config.strategy = "ddp";
  const absl::StatusOr<std::vector<MemoryPlan>> ddp =
      PlanPipelineStages(config, 8);
  ASSERT_TRUE(fsdp.ok() && hsdp.ok() && ddp.ok());
  for (size_t s = 0; s < 2; ++s) {
    EXPECT_EQ((*hsdp)[s].shard_group_size, 2);
    EXPECT_EQ((*hsdp)[s].total(), (*fsdp)[s].total()) << "stage " << s;
    EXPECT_EQ((*hsdp)[s].optimizer_state, (*fsdp)[s].optimizer_state);
    EXPECT_LT(2 * (*hsdp)[s].optimizer_state, (*ddp)[s].optimizer_state + 64);
  }
}

// What a pipeline plan refuses: a world that is not a multiple of the
// stages, more stages than blocks, HSDP groups that do not divide a stage;
// and --fit's batch is a whole number of micro-batches.
TEST(MemoryPlanPipelineTest, RefusesWhatThePipelineCannotRun) {
  TrainConfig config;
  config.model = "gpt2-mini";
  config.seq_len = 64;
  config.batch_size = 4;
  config.pipeline_stages = 2;
  config.micro_batches = 4;
  config.strategy = "hsdp";
  config.shard_group_size = 3;
  EXPECT_EQ(PlanMemory(config, 8).status().code(),
            absl::StatusCode::kInvalidArgument);
  config.shard_group_size = 0;
  config.strategy = "ddp";
  EXPECT_FALSE(PlanMemory(config, 3).ok());
  config.pipeline_stages = 8;
  EXPECT_FALSE(PlanMemory(config, 8).ok());
  config.pipeline_stages = 2;
  absl::StatusOr<int64_t> batch =
      LargestFittingBatch(config, 4, int64_t{400} << 20);
  ASSERT_TRUE(batch.ok()) << batch.status();
  ASSERT_GT(*batch, 0);
  EXPECT_EQ(*batch % 4, 0);
  config.batch_size = *batch;
  EXPECT_LE(PlanMemory(config, 4)->total(), int64_t{400} << 20);
  config.batch_size = *batch + 4;
  EXPECT_GT(PlanMemory(config, 4)->total(), int64_t{400} << 20);
}

// What recomputation saves, as planned: every block's ~16 C floats per token
// become one residual (C) for "all".
TEST(MemoryPlanCheckpointTest, RecomputingBlocksShrinksTheActivations) {
  TrainConfig config;
  config.model = "gpt2-mini";
  config.batch_size = 8;
  config.seq_len = 256;
  std::map<std::string, int64_t> activations;
  for (const char* checkpointing : {"none", "every-2", "all"}) {
    config.activation_checkpointing = checkpointing;
    absl::StatusOr<MemoryPlan> plan = PlanMemory(config, 1);
    ASSERT_TRUE(plan.ok()) << plan.status();
    activations[checkpointing] = plan->activations;
    EXPECT_EQ(plan->recomputed_blocks, std::string(checkpointing) == "all" ? 4
                                       : std::string(checkpointing) == "every-2"
                                           ? 2
                                           : 0);
  }
  EXPECT_LT(activations["all"], activations["every-2"]);
  EXPECT_LT(activations["every-2"], activations["none"]);
  EXPECT_LT(activations["all"] * 4, activations["none"]);
  config.activation_checkpointing = "sometimes";
  EXPECT_FALSE(PlanMemory(config, 1).ok());
}

// --fit: the largest batch under a budget is the one whose plan fits while
// one more sequence would not.
TEST(MemoryPlanFitTest, FindsTheLargestBatchThatFits) {
  TrainConfig config;
  config.model = "gpt2-mini";
  config.seq_len = 128;
  config.strategy = "fsdp";
  const int64_t budget = int64_t{512} << 20;
  absl::StatusOr<int64_t> batch = LargestFittingBatch(config, 4, budget);
  ASSERT_TRUE(batch.ok()) << batch.status();
  ASSERT_GT(*batch, 0);
  config.batch_size = *batch;
  EXPECT_LE(PlanMemory(config, 4)->total(), budget);
  config.batch_size = *batch + 1;
  EXPECT_GT(PlanMemory(config, 4)->total(), budget);
  // Nothing fits in 1 MiB.
  EXPECT_EQ(*LargestFittingBatch(config, 4, 1 << 20), 0);
}

// --memory-cap makes the tracking allocator refuse what a device of that
// size could not hold: below the planned peak the run fails out of memory,
// naming the cap; just above it, it trains.
TEST_F(MemoryPlanTest, AMemoryCapBelowThePeakFailsOutOfMemory) {
  TrainConfig config;
  config.model = "gpt2-tiny";
  config.batch_size = 2;
  config.seq_len = 64;
  const int64_t peak = PlanMemory(config, 1)->total();
  for (const double share : {0.8, 1.02}) {
    const int64_t cap = static_cast<int64_t>(peak * share);
    const test::CommandResult r = test::RunCommand(absl::StrCat(
        SHARDTRAIN_BINARY_DIR,
        "/bin/shardtrain-train --model gpt2-tiny "
        "--data ",
        (*dir_ / "data").string(),
        " --batch-size 2 --seq-len 64 "
        "--max-steps 2 --eval-steps 1 --memory-cap ",
        cap, " --out ", (*dir_ / absl::StrCat("cap_", share)).string()));
    if (share < 1) {
      EXPECT_NE(r.exit_code, 0) << r.out;
      EXPECT_NE(r.err.find("out of memory"), std::string::npos) << r.err;
      EXPECT_NE(r.err.find("past the memory cap of " + FormatBytes(cap)),
                std::string::npos)
          << r.err;
    } else {
      EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    }
  }
  const test::CommandResult bad = test::RunCommand(absl::StrCat(
      SHARDTRAIN_BINARY_DIR, "/bin/shardtrain-train --data ",
      (*dir_ / "data").string(), " --max-steps 1 --memory-cap lots"));
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("'lots' is not a size"), std::string::npos) << bad.err;
}

// `plan --fit` answers per strategy and pipeline mesh, with and without
// activation checkpointing, the largest batch per device (per replica for a
// mesh) under the memory given: the library's LargestFittingBatch, and the
// most sequences per step named.
TEST_F(MemoryPlanTest, PlanFitAnswersWhatFits) {
  if (!test::kHasCli) GTEST_SKIP() << "the CLI is the host build's";
  // Rates of a made-up host, so that the plan measures nothing here.
  const std::string cache = (*dir_ / "cache").string();
  ::setenv("XDG_CACHE_HOME", cache.c_str(), 1);
  HostRates rates;
  rates.cores = 2;
  rates.flops_per_thread = 2e10;
  rates.compute_model = "gpt2-mini";
  rates.optimizer_seconds_per_parameter = 2e-9;
  rates.intra_node = {1e-4, 1e9};
  ASSERT_TRUE(SaveHostRates(rates).ok());
  ::unsetenv("XDG_CACHE_HOME");
  const std::string bin = "XDG_CACHE_HOME=" + cache + " " +
                          std::string(SHARDTRAIN_BINARY_DIR) +
                          "/bin/shardtrain plan --fit --model gpt2-mini "
                          "--seq-len 128 --devices ";
  const std::string plan = bin + "4 ";
  const test::CommandResult r =
      test::RunCommand(plan + "--memory-per-device 512MiB -o json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json out = nlohmann::json::parse(r.out);
  // 4 strategies, 3 pipeline meshes (pp2xddp2, pp2xfsdp2, pp4: gpt2-mini
  // has 4 blocks), 3 tensor-parallel meshes (ddp2xtp2, fsdp2xtp2, tp4: 4
  // heads) and pp2xtp2, each with and without activation checkpointing.
  ASSERT_EQ(out["fits"].size(), 22u) << out.dump();
  int64_t most = 0;
  std::vector<std::string> meshes;
  double previous = 1e300;
  for (const nlohmann::json& row : out["fits"]) {
    TrainConfig config;
    config.model = "gpt2-mini";
    config.seq_len = 128;
    config.strategy = row["strategy"];
    config.activation_checkpointing = row["activation_checkpointing"];
    const int64_t world = row["world_size"];
    if (row["batch_size"] > 0) {  // ranked by the predicted speed
      const double tps = row["predicted_tokens_per_second"];
      EXPECT_LE(tps, previous) << row.dump();
      previous = tps;
    }
    if (row.contains("mesh")) {
      config.pipeline_stages = row.value("pipeline_stages", int64_t{1});
      config.micro_batches = row.value("micro_batches", int64_t{1});
      config.tensor_parallel = row.value("tensor_parallel", int64_t{1});
      EXPECT_EQ(world, 4);
      EXPECT_EQ(row["batch_size"].get<int64_t>() % config.micro_batches, 0);
      EXPECT_EQ(
          row["global_batch"].get<int64_t>(),
          row["batch_size"].get<int64_t>() * 4 / config.ModelParallelSize());
      meshes.push_back(row["mesh"]);
    } else {
      EXPECT_EQ(world, config.strategy == "single" ? 1 : 4);
    }
    EXPECT_EQ(
        row["batch_size"],
        *LargestFittingBatch(config, world, PlannableBytes(int64_t{512} << 20)))
        << row.dump();
    most = std::max<int64_t>(most, row["global_batch"]);
  }
  std::sort(meshes.begin(), meshes.end());
  EXPECT_EQ(meshes, (std::vector<std::string>{
                        "ddp2xtp2", "ddp2xtp2", "fsdp2xtp2", "fsdp2xtp2",
                        "pp2xddp2", "pp2xddp2", "pp2xfsdp2", "pp2xfsdp2",
                        "pp2xtp2", "pp2xtp2", "pp4", "pp4", "tp4", "tp4"}));
  ASSERT_TRUE(out.contains("fastest")) << r.out;
  EXPECT_FALSE(out["fastest"]["why"].get<std::string>().empty());
  ASSERT_TRUE(out.contains("best")) << r.out;
  // Sharded and recomputing: the model state spread thinnest, the
  // activations smallest. Pipeline stages with many micro-batches (the
  // search weighs S, 2S and 4S) hold one small micro-batch's activations
  // each, so a sharded pipeline can afford the most sequences.
  const std::string best = out["best"]["strategy"];
  EXPECT_TRUE(best == "fsdp" || best == "hsdp") << best;
  EXPECT_EQ(out["best"]["activation_checkpointing"], "all");
  // Its sequences per step are the most of any row.
  int64_t model_parallel = 1;
  for (const nlohmann::json& row : out["fits"]) {
    if (row.value("mesh", std::string()) ==
            out["best"].value("mesh", std::string("-")) &&
        row["activation_checkpointing"] == "all") {
      model_parallel = 4 * row["batch_size"].get<int64_t>() /
                       row["global_batch"].get<int64_t>();
    }
  }
  EXPECT_EQ(out["best"]["batch_size"].get<int64_t>() * 4 / model_parallel,
            most);

  // --micro-batches without --pp sets the pipeline meshes' count, the rest
  // keep one.
  const test::CommandResult micro = test::RunCommand(
      plan + "--memory-per-device 512MiB --micro-batches 4 -o json");
  ASSERT_EQ(micro.exit_code, 0) << micro.err;
  int pipelines = 0;
  const nlohmann::json micro_out = nlohmann::json::parse(micro.out);
  for (const nlohmann::json& row : micro_out["fits"]) {
    if (row.contains("pipeline_stages")) {
      EXPECT_EQ(row["micro_batches"], 4) << row.dump();
      ++pipelines;
    }
  }
  EXPECT_GT(pipelines, 0) << micro.out;

  // Nothing fits: the table says so and what would.
  const test::CommandResult none =
      test::RunCommand(plan + "--memory-per-device 64MiB");
  ASSERT_EQ(none.exit_code, 0) << none.err;
  EXPECT_NE(none.out.find("nothing fits"), std::string::npos) << none.out;
  // Each row's peak against the 98% of the device it was planned to.
  EXPECT_NE(none.out.find("at batch 1 (over 62.7 MiB)"), std::string::npos)
      << none.out;
  EXPECT_NE(none.out.find("to fit: FSDP with activation checkpointing fits "
                          "one sequence per device on "),
            std::string::npos)
      << none.out;
  const test::CommandResult bad =
      test::RunCommand(plan + "--memory-per-device eighty");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("'eighty' is not a size"), std::string::npos)
      << bad.err;

  // Below 4 devices HSDP would be FSDP or DDP: left out unless asked for.
  const std::string two = bin + "2 --memory-per-device 512MiB -o json";
  const test::CommandResult all_two = test::RunCommand(two);
  ASSERT_EQ(all_two.exit_code, 0) << all_two.err;
  const nlohmann::json fits = nlohmann::json::parse(all_two.out)["fits"];
  // single, ddp, fsdp, pp2 and tp2, with and without.
  EXPECT_EQ(fits.size(), 10u) << all_two.out;
  for (const nlohmann::json& row : fits) EXPECT_NE(row["strategy"], "hsdp");
  const test::CommandResult asked = test::RunCommand(two + " --strategy hsdp");
  ASSERT_EQ(asked.exit_code, 0) << asked.err;
  EXPECT_EQ(nlohmann::json::parse(asked.out)["fits"].size(), 2u);

  // From four ranks per stage the meshes include HSDP within each stage;
  // pipelines of tensor-parallel stages, with replicas or without.
  const test::CommandResult eight =
      test::RunCommand(bin + "8 --memory-per-device 512MiB -o json");
  ASSERT_EQ(eight.exit_code, 0) << eight.err;
  const nlohmann::json eight_fits = nlohmann::json::parse(eight.out)["fits"];
  std::vector<std::string> at_eight;
  for (const nlohmann::json& row : eight_fits) {
    if (!row.contains("mesh") || row["activation_checkpointing"] != "none") {
      continue;
    }
    at_eight.push_back(row["mesh"]);
    if (row["mesh"] == "pp2xhsdp4") {
      EXPECT_EQ(row["shard_group_size"], 2) << row.dump();
    }
  }
  std::sort(at_eight.begin(), at_eight.end());
  EXPECT_EQ(at_eight,
            (std::vector<std::string>{
                "ddp2xtp4", "ddp4xtp2", "fsdp2xtp4", "fsdp4xtp2",
                "pp2xddp2xtp2", "pp2xddp4", "pp2xfsdp2xtp2", "pp2xfsdp4",
                "pp2xhsdp4", "pp2xtp4", "pp4xddp2", "pp4xfsdp2", "pp4xtp2"}));
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
  if (!test::kHasCli) GTEST_SKIP() << "the CLI is the host build's";
  const test::CommandResult r = test::RunCommand(
      std::string(SHARDTRAIN_BINARY_DIR) +
      "/bin/shardtrain plan --model gpt2-mini --world-size 4 --batch-size 2 "
      "--seq-len 64 -o json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json out = nlohmann::json::parse(r.out);
  ASSERT_EQ(out["plans"].size(), 4u);
  int64_t ddp = 0, fsdp = 0, hsdp = 0;
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
    if (plan["strategy"] == "hsdp") {
      hsdp = expected->total();
      EXPECT_EQ(plan["shard_group_size"], 2);  // one node of 4: two groups
    }
  }
  EXPECT_EQ(out["plans"][0]["batch_size"], 8);  // single: strong scaling
  EXPECT_LT(fsdp, ddp / 3);
  // Sharded over 2 instead of 4: between FSDP and DDP.
  EXPECT_GT(hsdp, fsdp);
  EXPECT_LT(hsdp, ddp);
  // Below four ranks HSDP has no two groups of two: not planned unasked.
  const test::CommandResult two = test::RunCommand(
      std::string(SHARDTRAIN_BINARY_DIR) +
      "/bin/shardtrain plan --model gpt2-mini --world-size 2 -o json");
  ASSERT_EQ(two.exit_code, 0) << two.err;
  EXPECT_EQ(nlohmann::json::parse(two.out)["plans"].size(), 3u);
  // The table says so.
  const test::CommandResult two_table =
      test::RunCommand(std::string(SHARDTRAIN_BINARY_DIR) +
                       "/bin/shardtrain plan --model gpt2-mini --world-size 2");
  ASSERT_EQ(two_table.exit_code, 0) << two_table.err;
  EXPECT_NE(two_table.out.find("hsdp is left out below 4 data-parallel "
                               "replicas (here 2, where it would be ddp or "
                               "fsdp); --strategy hsdp plans it anyway"),
            std::string::npos)
      << two_table.out;

  const test::CommandResult bad =
      test::RunCommand(std::string(SHARDTRAIN_BINARY_DIR) +
                       "/bin/shardtrain plan --model gpt2-huge --world-size 2");
  EXPECT_EQ(bad.exit_code, 2);  // a usage error
  EXPECT_NE(bad.err.find("model"), std::string::npos) << bad.err;
  const test::CommandResult single =
      test::RunCommand(std::string(SHARDTRAIN_BINARY_DIR) +
                       "/bin/shardtrain plan --strategy single --world-size 2");
  EXPECT_EQ(single.exit_code, 2);
  EXPECT_NE(single.err.find("world size 1"), std::string::npos) << single.err;

  // --tp: the strategies that compose with it (not HSDP's groups), each
  // rank with 1/T of every layer.
  const test::CommandResult tp = test::RunCommand(
      std::string(SHARDTRAIN_BINARY_DIR) +
      "/bin/shardtrain plan --model gpt2-mini --world-size 4 --tp 2 "
      "--batch-size 2 --seq-len 64 -o json");
  ASSERT_EQ(tp.exit_code, 0) << tp.err;
  const nlohmann::json tp_out = nlohmann::json::parse(tp.out);
  ASSERT_EQ(tp_out["plans"].size(), 3u) << tp.out;
  EXPECT_EQ(tp_out["plans"][0]["strategy"], "single");
  EXPECT_EQ(tp_out["plans"][0]["world_size"], 2);  // its two tensor ranks
  EXPECT_EQ(tp_out["plans"][0]["batch_size"], 4);  // strong scaling
  EXPECT_EQ(tp_out["plans"][1]["strategy"], "ddp");
  EXPECT_EQ(tp_out["plans"][2]["strategy"], "fsdp");  // FSDP x TP
  for (const nlohmann::json& plan : tp_out["plans"]) {
    EXPECT_EQ(plan["tensor_parallel"], 2);
    TrainConfig config;
    config.model = "gpt2-mini";
    config.strategy = plan["strategy"];
    config.tensor_parallel = 2;
    config.batch_size = plan["batch_size"];
    config.seq_len = 64;
    const absl::StatusOr<MemoryPlan> expected =
        PlanMemory(config, plan["world_size"]);
    ASSERT_TRUE(expected.ok()) << expected.status();
    EXPECT_EQ(plan["total_bytes_per_rank"], expected->total());
  }
  const test::CommandResult tp_table = test::RunCommand(
      std::string(SHARDTRAIN_BINARY_DIR) +
      "/bin/shardtrain plan --model gpt2-mini --world-size 2 --tp 2 "
      "--strategy single");
  ASSERT_EQ(tp_table.exit_code, 0) << tp_table.err;
  EXPECT_NE(tp_table.out.find("  tp2: 2 rank(s), batch 8 per replica"),
            std::string::npos)
      << tp_table.out;
  const test::CommandResult tp_bad = test::RunCommand(
      std::string(SHARDTRAIN_BINARY_DIR) +
      "/bin/shardtrain plan --model gpt2-mini --world-size 3 --tp 3");
  EXPECT_EQ(tp_bad.exit_code, 2);
  EXPECT_NE(tp_bad.err.find("4 attention heads"), std::string::npos)
      << tp_bad.err;
}

// With --pp, plan prints each stage: the JSON's stages are the library's,
// the plan's total is its largest stage's, and the table has a column per
// stage.
TEST_F(MemoryPlanTest, CliPrintsEveryPipelineStage) {
  if (!test::kHasCli) GTEST_SKIP() << "the CLI is the host build's";
  const std::string plan = std::string(SHARDTRAIN_BINARY_DIR) +
                           "/bin/shardtrain plan --model gpt2-mini --pp 2 "
                           "--world-size 4 --batch-size 4 --micro-batches 2 "
                           "--seq-len 64 --pipeline-schedule gpipe "
                           "--virtual-stages 2";
  const test::CommandResult r = test::RunCommand(plan + " -o json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json out = nlohmann::json::parse(r.out);
  // single (on 2 ranks), ddp and fsdp
  ASSERT_EQ(out["plans"].size(), 3u);
  for (const nlohmann::json& entry : out["plans"]) {
    TrainConfig config;
    config.model = "gpt2-mini";
    config.strategy = entry["strategy"];
    config.batch_size = entry["batch_size"];
    config.seq_len = 64;
    config.pipeline_stages = 2;
    config.micro_batches = 2;
    config.pipeline_schedule = "gpipe";
    config.virtual_stages = 2;
    const absl::StatusOr<std::vector<MemoryPlan>> expected =
        PlanPipelineStages(config, entry["world_size"]);
    ASSERT_TRUE(expected.ok()) << expected.status();
    ASSERT_EQ(entry["stages"].size(), 2u);
    int64_t largest = 0;
    for (size_t s = 0; s < 2; ++s) {
      EXPECT_EQ(entry["stages"][s]["total_bytes_per_rank"],
                (*expected)[s].total());
      EXPECT_EQ(entry["stages"][s]["stage_layers"],
                (*expected)[s].stage_layers);
      EXPECT_EQ(entry["virtual_stages"], 2);
      largest = std::max(largest, (*expected)[s].total());
    }
    EXPECT_EQ(entry["total_bytes_per_rank"], largest);
    EXPECT_EQ(entry["world_size"], config.strategy == "single" ? 2 : 4);
  }
  const test::CommandResult table = test::RunCommand(plan);
  ASSERT_EQ(table.exit_code, 0) << table.err;
  // Narrow columns named by mesh and stage, what each holds below.
  // Interleaved: stage 1 runs model stages 1 and 3.
  EXPECT_NE(table.out.find("  pp2xddp2 s1: block 1; block 3, head, 4 rank(s), "
                           "batch 4 per replica"),
            std::string::npos)
      << table.out;
  EXPECT_NE(table.out.find("2 pipeline stages of 2 interleaved chunks"),
            std::string::npos)
      << table.out;
  for (absl::string_view line : absl::StrSplit(table.out, '\n')) {
    EXPECT_LE(line.size(), 122u) << line;  // six columns
  }
  EXPECT_NE(table.out.find("micro-batches held"), std::string::npos);

  EXPECT_NE(table.out.find("  pp2xfsdp2 s0: block 0, embeddings; block 2, 4 "
                           "rank(s)"),
            std::string::npos)
      << table.out;
  // HSDP within each stage, at 8 ranks: two shard groups of two per stage.
  std::string hsdp_plan = plan;
  hsdp_plan.replace(hsdp_plan.find("--world-size 4"), 14, "--world-size 8");
  const test::CommandResult hsdp =
      test::RunCommand(hsdp_plan + " --strategy hsdp");
  ASSERT_EQ(hsdp.exit_code, 0) << hsdp.err;
  EXPECT_NE(hsdp.out.find("  pp2xhsdp4 s0: block 0, embeddings; block 2, "
                          "shard groups of 2, 8 rank(s)"),
            std::string::npos)
      << hsdp.out;
}

}  // namespace
}  // namespace shardtrain
