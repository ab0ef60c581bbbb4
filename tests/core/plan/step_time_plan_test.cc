#include "core/plan/step_time_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "core/model/model_config.h"
#include "core/plan/memory_plan.h"
#include "core/plan/mesh_search.h"
#include "core/run/train_config.h"

namespace shardtrain {
namespace {

// A host of `cores` whose thread computes 10 GFLOP/s, AdamW at 10 ns per
// parameter, links at 1 GB/s and 50 us.
HostRates Rates(int64_t cores = 4) {
  HostRates r;
  r.cores = cores;
  r.flops_per_thread = 1e10;
  r.compute_model = "gpt2-tiny";
  r.optimizer_seconds_per_parameter = 1e-8;
  r.intra_node = {50e-6, 1e9};
  return r;
}

TrainConfig Config(const std::string& strategy, int64_t threads = 1) {
  TrainConfig c;
  c.model = "gpt2-tiny";
  c.strategy = strategy;
  c.batch_size = 8;
  c.seq_len = 128;
  c.threads = threads;
  return c;
}

StepTimePlan Plan(const TrainConfig& c, int64_t world,
                  HostRates rates = Rates(), int64_t per_host = 64) {
  absl::StatusOr<StepTimePlan> p = PlanStepTime(c, world, per_host, rates);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *p : StepTimePlan{};
}

const MeshTraffic* Find(const StepTimePlan& p, const std::string& dim) {
  for (const MeshTraffic& t : p.traffic) {
    if (t.dimension == dim) return &t;
  }
  return nullptr;
}

TEST(StepTimePlanTest, NamesMeshesAsTheStudyDoes) {
  TrainConfig c = Config("single");
  EXPECT_EQ(MeshName(c, 1), "single");
  c.strategy = "fsdp";
  EXPECT_EQ(MeshName(c, 4), "fsdp4");
  c.strategy = "single";
  c.tensor_parallel = 2;
  EXPECT_EQ(MeshName(c, 2), "tp2");
  c.strategy = "ddp";
  EXPECT_EQ(MeshName(c, 4), "ddp2xtp2");
  c.tensor_parallel = 1;
  c.pipeline_stages = 2;
  EXPECT_EQ(MeshName(c, 4), "pp2xddp2");
  c.strategy = "single";
  EXPECT_EQ(MeshName(c, 2), "pp2");
}

TEST(StepTimePlanTest, DdpAllReducesEveryGradientOncePerStep) {
  const ModelConfig model = *ParseModelSpec("gpt2-tiny");
  TrainConfig c = Config("ddp");
  c.grad_accum = 3;  // accumulation steps reduce nothing
  const StepTimePlan p = Plan(c, 4);
  ASSERT_EQ(p.traffic.size(), 1u);
  const MeshTraffic& t = p.traffic[0];
  EXPECT_EQ(t.dimension, "data-parallel");
  EXPECT_EQ(t.ranks, 4);
  // Every parameter's fp32 gradient; the ring sends 2(N-1)/N of it.
  EXPECT_NEAR(static_cast<double>(t.counted_bytes),
              static_cast<double>(model.NumParameters() * 4), 64);
  EXPECT_NEAR(static_cast<double>(t.wire_bytes),
              1.5 * static_cast<double>(model.NumParameters() * 4), 64);
  // 26 MB in 25 MiB buckets: two all-reduces.
  EXPECT_EQ(t.calls, 2);
  EXPECT_EQ(p.tokens_per_step, 8 * 128 * 3 * 4);
}

TEST(StepTimePlanTest, FsdpMovesLessThanDdpWhenTheVocabularyDominates) {
  // gpt2-tiny's wte is 94% of it: FSDP's vocabulary-parallel head moves
  // hidden states instead of wte's gradient.
  const StepTimePlan ddp = Plan(Config("ddp"), 2);
  const StepTimePlan fsdp = Plan(Config("fsdp"), 2);
  EXPECT_LT(fsdp.counted_bytes(), ddp.counted_bytes() / 4);
  EXPECT_LT(fsdp.step_seconds, ddp.step_seconds);
  // FSDP keeps and updates half the parameters.
  EXPECT_NEAR(fsdp.optimizer_seconds, ddp.optimizer_seconds / 2,
              ddp.optimizer_seconds * 0.01);
  // Same FLOPs per rank.
  EXPECT_DOUBLE_EQ(fsdp.compute_seconds, ddp.compute_seconds);
}

TEST(StepTimePlanTest, DataParallelRanksSplitTheComputeOfOneDevice) {
  HostRates free_links = Rates(8);
  free_links.intra_node = {0, 1e30};
  const StepTimePlan single = Plan(Config("single", 1), 1, free_links);
  TrainConfig ddp = Config("ddp", 1);
  ddp.batch_size = 2;  // the same global batch over 4 ranks
  const StepTimePlan four = Plan(ddp, 4, free_links);
  EXPECT_EQ(four.tokens_per_step, single.tokens_per_step);
  EXPECT_NEAR(four.compute_seconds, single.compute_seconds / 4, 1e-12);
  // Single's compute: the model's training FLOPs over the rate.
  const ModelConfig model = *ParseModelSpec("gpt2-tiny");
  const double flops =
      8.0 * 128 *
      (3 * (model.n_layer * (24.0 * 128 * 128 + 4.0 * 128 * 128) +
            2.0 * model.padded_vocab_size * 128));
  EXPECT_NEAR(single.compute_seconds, flops / 1e10, 1e-9);
  EXPECT_GT(four.tokens_per_second, 3 * single.tokens_per_second);
}

TEST(StepTimePlanTest, RanksBeyondTheCoresShareThem) {
  TrainConfig c = Config("fsdp", 1);
  const StepTimePlan two = Plan(c, 2, Rates(2));
  const StepTimePlan four = Plan(c, 4, Rates(2));
  // Four one-thread ranks on two cores run at half speed each.
  EXPECT_NEAR(four.compute_seconds, 2 * two.compute_seconds, 1e-12);
  c.threads = 2;  // two threads per rank on two cores: the same
  EXPECT_NEAR(Plan(c, 2, Rates(2)).compute_seconds, two.compute_seconds, 1e-12);
}

TEST(StepTimePlanTest, TensorParallelismSplitsComputeAndMovesActivations) {
  TrainConfig c = Config("single");
  const StepTimePlan one = Plan(c, 1);
  c.tensor_parallel = 2;
  const StepTimePlan tp = Plan(c, 2);
  EXPECT_NEAR(tp.compute_seconds, one.compute_seconds / 2, 1e-12);
  EXPECT_EQ(tp.tokens_per_step, one.tokens_per_step);  // one shared batch
  const MeshTraffic* t = Find(tp, "tensor-parallel");
  ASSERT_NE(t, nullptr);
  // Per block four all-reduces of [B*T, C] fp32, plus the embeddings' and
  // the head's input gradient: 2 blocks -> 10 activations.
  const double act = 8.0 * 128 * 128 * 4;
  EXPECT_GE(t->counted_bytes, static_cast<int64_t>(10 * act));
  EXPECT_LT(t->counted_bytes, static_cast<int64_t>(10 * act + 2e6));
  // Recomputing every block repeats its two forward all-reduces.
  c.activation_checkpointing = "all";
  const MeshTraffic* r = Find(Plan(c, 2), "tensor-parallel");
  ASSERT_NE(r, nullptr);
  EXPECT_NEAR(static_cast<double>(r->counted_bytes - t->counted_bytes), 4 * act,
              1);
}

TEST(StepTimePlanTest, PipelineBubbleShrinksWithMicroBatches) {
  TrainConfig c = Config("single");
  c.model = "gpt2-mini";
  c.pipeline_stages = 2;
  c.micro_batches = 1;
  const StepTimePlan m1 = Plan(c, 2);
  c.micro_batches = 4;
  const StepTimePlan m4 = Plan(c, 2);
  // The other stage's time on one micro-batch: a quarter of it at M = 4.
  // gpt2-mini's head outweighs its blocks, so the last stage (block 3 and
  // the head) is the slowest and stage 0 (blocks 0-2) fills the pipe.
  EXPECT_NEAR(m4.bubble_seconds, m1.bubble_seconds / 4, 1e-12);
  EXPECT_NEAR(m4.compute_seconds, m1.compute_seconds, 1e-12);
  const ModelConfig model = *ParseModelSpec("gpt2-mini");
  const double block = 24.0 * 256 * 256 + 4.0 * 128 * 256;
  EXPECT_NEAR(m1.bubble_seconds, 3 * 3 * block * 8 * 128 / 1e10, 1e-9);
  EXPECT_NEAR(
      m1.compute_seconds,
      3 * (block + 2.0 * model.padded_vocab_size * 256) * 8 * 128 / 1e10, 1e-9);
  EXPECT_LT(m4.step_seconds, m1.step_seconds);
  const MeshTraffic* t = Find(m4, "pipeline");
  ASSERT_NE(t, nullptr);
  // The last stage holds the head (the slowest, with gpt2-mini's 50k
  // vocabulary): it sends the gradients back, and all-reduces the tied wte
  // with stage 0.
  const double grads = 8.0 * 128 * 256 * 4;
  const double wte = 50304.0 * 256 * 4;
  EXPECT_NEAR(static_cast<double>(t->counted_bytes), grads + wte, 8);
  EXPECT_EQ(m4.Bottleneck(), "compute");
}

// Interleaved over V = 2 chunks, gpt2-mini's four blocks are four model
// stages, one block each: stage 0 runs blocks 0 and 2, stage 1 blocks 1 and
// 3 with the head (the slowest). The fill and drain go by in chunks of half
// a stage: stage 0's time on one micro-batch, halved. The last stage's
// chunks send activations (block 1's) and gradients (both) three ways.
TEST(StepTimePlanTest, InterleavingHalvesTheBubbleForMoreSends) {
  TrainConfig c = Config("single");
  c.model = "gpt2-mini";
  c.pipeline_stages = 2;
  c.micro_batches = 2;
  c.virtual_stages = 2;
  const StepTimePlan v2 = Plan(c, 2);
  const double block = 24.0 * 256 * 256 + 4.0 * 128 * 256;
  const ModelConfig model = *ParseModelSpec("gpt2-mini");
  const double head = 2.0 * model.padded_vocab_size * 256;
  // Stage 0: two blocks; per micro-batch of 4 x 128 tokens, halved.
  EXPECT_NEAR(v2.bubble_seconds, 3 * 2 * block * 4 * 128 / 2 / 1e10, 1e-9);
  EXPECT_NEAR(v2.compute_seconds, 3 * (2 * block + head) * 8 * 128 / 1e10,
              1e-9);
  c.virtual_stages = 1;
  c.pipeline_split = "2";  // the same blocks per stage, not interleaved
  const StepTimePlan v1 = Plan(c, 2);
  EXPECT_NEAR(v2.bubble_seconds, v1.bubble_seconds / 2, 1e-12);
  const MeshTraffic* sends2 = Find(v2, "pipeline");
  const MeshTraffic* sends1 = Find(v1, "pipeline");
  ASSERT_NE(sends2, nullptr);
  ASSERT_NE(sends1, nullptr);
  const double act = 8.0 * 128 * 256 * 4;
  EXPECT_NEAR(
      static_cast<double>(sends2->counted_bytes - sends1->counted_bytes),
      2 * act, 8);
}

// zb-h1 idles the share of 1F1B's idle time its order leaves on paper
// (equal F, B and W): 1 unit of 1F1B's 3 at S = 2, M = 4; the work is the
// same.
TEST(StepTimePlanTest, ZeroBubbleLeavesTheShareOfTheBubbleItsOrderDoes) {
  TrainConfig c = Config("single");
  c.model = "gpt2-mini";
  c.pipeline_stages = 2;
  c.micro_batches = 4;
  const StepTimePlan one = Plan(c, 2);
  c.pipeline_schedule = "zb-h1";
  const StepTimePlan zb = Plan(c, 2);
  EXPECT_NEAR(zb.bubble_seconds, one.bubble_seconds / 3, 1e-12);
  EXPECT_DOUBLE_EQ(zb.compute_seconds, one.compute_seconds);
  EXPECT_LT(zb.step_seconds, one.step_seconds);
}

// The measured overhead of a micro-batch's pass weighs against many small
// micro-batches: with none, a pipeline's fastest count is its most (4S, the
// smallest bubble); with enough, its fewest (S). A search under zb-h1
// leaves out the meshes of stages and tensor ranks, which cannot run it.
TEST(StepTimePlanTest, PassOverheadWeighsAgainstManyMicroBatches) {
  TrainConfig base = Config("ddp", 1);
  base.model = "gpt2-mini";
  MeshSearchOptions options;
  options.devices = 4;
  options.global_batch = 16;
  options.checkpointing = false;
  HostRates rates = Rates(4);
  const auto micro_of = [&](const TrainConfig& config, const HostRates& r,
                            const std::string& mesh) -> int64_t {
    absl::StatusOr<std::vector<MeshCandidate>> ranked =
        SearchMeshes(config, options, &r);
    EXPECT_TRUE(ranked.ok()) << ranked.status();
    for (const MeshCandidate& c : *ranked) {
      if (c.name.rfind(mesh, 0) == 0) return c.config.micro_batches;
    }
    return -1;
  };
  EXPECT_EQ(micro_of(base, rates, "pp2xddp2"), 8);
  rates.pass_overhead_seconds = 5;
  EXPECT_EQ(micro_of(base, rates, "pp2xddp2"), 2);
  const StepTimePlan plain = Plan(base, 1, Rates(4));
  const StepTimePlan paid = Plan(base, 1, rates);
  EXPECT_NEAR(paid.compute_seconds - plain.compute_seconds, 5, 1e-9);

  EXPECT_GT(micro_of(base, rates, "pp2xtp2"), 0);
  TrainConfig zb = base;
  zb.pipeline_schedule = "zb-h1";
  EXPECT_EQ(micro_of(zb, rates, "pp2xtp2"), -1);
  EXPECT_GT(micro_of(zb, rates, "pp2xddp2"), 0);
}

TEST(StepTimePlanTest, SlowLinksMakeTrafficTheBottleneck) {
  HostRates slow = Rates();
  slow.intra_node = {1e-3, 1e6};  // 1 MB/s
  const StepTimePlan ddp = Plan(Config("ddp"), 2, slow);
  EXPECT_EQ(ddp.Bottleneck(), "data-parallel traffic");
  EXPECT_GT(ddp.exposed_comm_seconds, ddp.compute_seconds);
}

// On GPUs DDP alone hides its reduction behind the backward (but its last
// bucket); meshes with pipeline stages or tensor ranks behind the last
// micro-batch's backward (replicated: buckets; sharded: the reduce-scatters,
// and the all-gathers behind the first micro-batch's forward, unit by
// unit); HSDP's average across a pipeline's groups after the schedule, and
// nothing on CPU.
TEST(StepTimePlanTest, OverlapIsCreditedOnlyWhereTheEngineOverlaps) {
  TrainConfig ddp = Config("ddp");
  ddp.device = "cuda";
  ddp.bucket_mb = 0.25;  // several buckets of gpt2-tiny
  const StepTimePlan alone = Plan(ddp, 2);
  const MeshTraffic* reduction = Find(alone, "data-parallel");
  ASSERT_NE(reduction, nullptr);
  EXPECT_LT(alone.exposed_comm_seconds, reduction->seconds);
  const auto all_traffic = [](const StepTimePlan& plan) {
    double seconds = 0;
    for (const MeshTraffic& t : plan.traffic) seconds += t.seconds;
    return seconds;
  };
  // DDP's buckets go during the last micro-step's backward only: with 4
  // accumulated micro-steps the window is a fourth of the step's backward,
  // one micro-step's, and as much stays exposed as without accumulation
  // (links slow enough that the reduction outlasts it).
  {
    TrainConfig slow_links = ddp;
    HostRates slow = Rates();
    slow.intra_node = {1e-4, 2e5};
    const StepTimePlan once = Plan(slow_links, 2, slow);
    slow_links.grad_accum = 4;
    const StepTimePlan accumulated = Plan(slow_links, 2, slow);
    const MeshTraffic* r = Find(accumulated, "data-parallel");
    ASSERT_NE(r, nullptr);
    const double window = accumulated.compute_seconds * 2 / 3 / 4;
    ASSERT_GT(r->seconds - window, r->seconds / static_cast<double>(r->calls));
    EXPECT_NEAR(accumulated.exposed_comm_seconds, r->seconds - window, 1e-12);
    EXPECT_NEAR(accumulated.exposed_comm_seconds, once.exposed_comm_seconds,
                1e-9);
  }

  TrainConfig piped = ddp;
  piped.pipeline_stages = 2;
  piped.micro_batches = 2;
  {
    const StepTimePlan plan = Plan(piped, 4);
    EXPECT_LT(plan.exposed_comm_seconds, all_traffic(plan));
  }
  TrainConfig sharded_stages = piped;
  sharded_stages.strategy = "fsdp";
  {
    const StepTimePlan plan = Plan(sharded_stages, 4);
    const double traffic = all_traffic(plan);
    const MeshTraffic* shards = Find(plan, "data-parallel");
    ASSERT_NE(shards, nullptr);
    // Both halves hide, each but its last unit's call.
    const double per_call =
        shards->seconds / 2 / static_cast<double>(shards->calls / 2);
    EXPECT_LT(plan.exposed_comm_seconds, traffic - shards->seconds / 2);
    EXPECT_GE(plan.exposed_comm_seconds,
              traffic - shards->seconds + 2 * per_call - 1e-12);
  }
  {
    // A pipeline's HSDP: the average across its groups stays exposed.
    TrainConfig hsdp_stages = sharded_stages;
    hsdp_stages.strategy = "hsdp";
    const StepTimePlan plan = Plan(hsdp_stages, 8);
    const MeshTraffic* across = Find(plan, "replica");
    ASSERT_NE(across, nullptr) << plan.mesh;
    const MeshTraffic* pipe = Find(plan, "pipeline");
    ASSERT_NE(pipe, nullptr);
    EXPECT_GE(plan.exposed_comm_seconds, across->seconds + pipe->seconds);
  }
  for (const std::string& dp : {"ddp", "fsdp"}) {
    // DDP x TP's buckets and TP x FSDP's units go during the backward (of
    // the last micro-step); of the tensor group's own traffic, f's
    // backward sums (two of each block's four) hide behind the
    // column-parallel weights' gradients (EnterLinear).
    TrainConfig sliced = ddp;
    sliced.strategy = dp;
    sliced.tensor_parallel = 2;
    const StepTimePlan plan = Plan(sliced, 4);
    const MeshTraffic* data = Find(plan, "data-parallel");
    ASSERT_NE(data, nullptr) << plan.mesh;
    ASSERT_GT(data->calls, 2) << plan.mesh;
    const MeshTraffic* tensor = Find(plan, "tensor-parallel");
    ASSERT_NE(tensor, nullptr);
    EXPECT_LT(plan.exposed_comm_seconds, tensor->seconds + data->seconds / 2)
        << plan.mesh;
    EXPECT_GE(plan.exposed_comm_seconds, tensor->seconds / 2) << plan.mesh;
    // On CPU nothing is credited, as for every other overlap.
    sliced.device = "cpu";
    const StepTimePlan cpu = Plan(sliced, 4);
    EXPECT_DOUBLE_EQ(cpu.exposed_comm_seconds, all_traffic(cpu)) << cpu.mesh;
  }
}

TEST(StepTimePlanTest, GroupsAcrossHostsUseTheInterNodeLink) {
  HostRates r = Rates();
  r.inter_node = {1e-3, 1e8};
  TrainConfig c = Config("ddp");
  const StepTimePlan one_host = Plan(c, 4, r, /*per_host=*/4);
  const StepTimePlan two_hosts = Plan(c, 4, r, /*per_host=*/2);
  EXPECT_GT(two_hosts.traffic[0].seconds, 5 * one_host.traffic[0].seconds);
  // HSDP keeps the shard groups on a host; only the replicas cross.
  c.strategy = "hsdp";
  const StepTimePlan hsdp = Plan(c, 4, r, /*per_host=*/2);
  ASSERT_EQ(hsdp.traffic.size(), 2u);
  EXPECT_EQ(hsdp.traffic[0].dimension, "shard-group");
  EXPECT_EQ(hsdp.traffic[1].dimension, "replica");
  EXPECT_LT(hsdp.step_seconds, two_hosts.step_seconds);
  // On one host HSDP's default groups are still two of two ranks, as the
  // engine forms them.
  const StepTimePlan one = Plan(c, 4, r, /*per_host=*/4);
  ASSERT_EQ(one.traffic.size(), 2u);
  EXPECT_EQ(one.traffic[0].ranks, 2);
  EXPECT_EQ(one.traffic[1].ranks, 2);
}

TEST(StepTimePlanTest, RefusesMissingRatesAndMeshesThatDoNotFit) {
  HostRates none;
  absl::StatusOr<StepTimePlan> p = PlanStepTime(Config("ddp"), 2, 2, none);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("--calibrate"), std::string::npos);
  TrainConfig c = Config("single");
  c.tensor_parallel = 2;
  p = PlanStepTime(c, 3, 3, Rates());
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("3"), std::string::npos);
  p = PlanStepTime(Config("single"), 2, 2, Rates());
  EXPECT_FALSE(p.ok());
}

TEST(StepTimePlanTest, RatesRoundTripThroughTheCache) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      ("step_time_plan_test_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  ::setenv("XDG_CACHE_HOME", dir.c_str(), 1);
  EXPECT_EQ(HostRatesCachePath(),
            (dir / "shardtrain/host_rates.json").string());
  absl::StatusOr<HostRates> missing = LoadHostRates("cpu", "gpt2-tiny");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);

  HostRates tiny = Rates();
  tiny.measured_at = "2026-12-04 05:00 UTC";
  ASSERT_TRUE(SaveHostRates(tiny).ok());
  HostRates mini = Rates();
  mini.compute_model = "gpt2-mini";
  mini.flops_per_thread = 2e10;
  mini.pass_overhead_seconds = 0.042;
  ASSERT_TRUE(SaveHostRates(mini).ok());

  absl::StatusOr<HostRates> got = LoadHostRates("cpu", "gpt2-mini");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->flops_per_thread, 2e10);
  EXPECT_EQ(got->pass_overhead_seconds, 0.042);
  got = LoadHostRates("cpu", "gpt2-tiny");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->measured_at, "2026-12-04 05:00 UTC");
  EXPECT_EQ(got->intra_node.bytes_per_second, 1e9);
  // Another model's rates stand in, naming their model.
  got = LoadHostRates("cpu", "gpt2");
  ASSERT_TRUE(got.ok());
  EXPECT_FALSE(got->compute_model.empty());
  EXPECT_EQ(LoadHostRates("NVIDIA H200", "gpt2").status().code(),
            absl::StatusCode::kNotFound);
  std::filesystem::remove_all(dir);
  ::unsetenv("XDG_CACHE_HOME");
}

// A hostile or broken cache (nested 300,000 deep, a FIFO, a link to a
// device, not JSON) is ignored with a warning, never a crash or a hang:
// the rates are simply not known (and measured again).
TEST(StepTimePlanTest, AnUnreadableCacheIsIgnoredNeverFatal) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      ("step_time_plan_hostile_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir / "shardtrain");
  ::setenv("XDG_CACHE_HOME", dir.c_str(), 1);
  const std::string cache = HostRatesCachePath();
  const auto write = [&](const std::string& text) {
    std::filesystem::remove(cache);
    std::ofstream(cache) << text;
  };
  write(std::string(300000, '[') + std::string(300000, ']'));
  EXPECT_EQ(LoadHostRates("cpu", "gpt2-tiny").status().code(),
            absl::StatusCode::kNotFound);
  write("{\"cpu\": {\"gpt2-tiny\": ");  // truncated
  EXPECT_EQ(LoadHostRates("cpu", "gpt2-tiny").status().code(),
            absl::StatusCode::kNotFound);
  write("{\"cpu\": {\"gpt2-tiny\": {\"cores\": \"two\"}}}");  // wrong type
  EXPECT_FALSE(LoadHostRates("cpu", "gpt2-tiny").ok());
  std::filesystem::remove(cache);
  ASSERT_EQ(::mkfifo(cache.c_str(), 0600), 0);  // would block a plain open
  EXPECT_EQ(LoadHostRates("cpu", "gpt2-tiny").status().code(),
            absl::StatusCode::kNotFound);
  std::filesystem::remove(cache);
  std::filesystem::create_symlink("/dev/zero", cache);  // endless
  EXPECT_EQ(LoadHostRates("cpu", "gpt2-tiny").status().code(),
            absl::StatusCode::kNotFound);
  // Measured again, the cache is rewritten whole.
  std::filesystem::remove(cache);
  write("not json");
  ASSERT_TRUE(SaveHostRates(Rates()).ok());
  EXPECT_TRUE(LoadHostRates("cpu", "gpt2-tiny").ok());
  std::filesystem::remove_all(dir);
  ::unsetenv("XDG_CACHE_HOME");
}

std::vector<std::string> Names(const std::vector<MeshCandidate>& ranked) {
  std::vector<std::string> names;
  for (const MeshCandidate& c : ranked) names.push_back(c.name);
  return names;
}

TEST(MeshSearchTest, WeighsEveryMeshOfTheDevicesFastestFirst) {
  TrainConfig base = Config("ddp", 1);
  MeshSearchOptions options;
  options.devices = 4;
  options.global_batch = 16;
  const HostRates rates = Rates(4);
  absl::StatusOr<std::vector<MeshCandidate>> ranked =
      SearchMeshes(base, options, &rates);
  ASSERT_TRUE(ranked.ok()) << ranked.status();
  std::vector<std::string> names = Names(*ranked);
  std::sort(names.begin(), names.end());
  // gpt2-tiny: 2 blocks (pp2 only), 4 heads (tp2 with DDP or FSDP
  // replicas, tp4, and pp2 x tp2), each with and without checkpointing.
  EXPECT_EQ(names, (std::vector<std::string>{
                       "ddp2xtp2", "ddp2xtp2 +ckpt", "ddp4", "ddp4 +ckpt",
                       "fsdp2xtp2", "fsdp2xtp2 +ckpt", "fsdp4", "fsdp4 +ckpt",
                       "hsdp4", "hsdp4 +ckpt", "pp2xddp2", "pp2xddp2 +ckpt",
                       "pp2xfsdp2", "pp2xfsdp2 +ckpt", "pp2xtp2",
                       "pp2xtp2 +ckpt", "tp4", "tp4 +ckpt"}));
  double previous = 1e300;
  for (const MeshCandidate& c : *ranked) {
    EXPECT_TRUE(c.fits);  // no budget
    EXPECT_LE(c.time.tokens_per_second, previous) << c.name;
    previous = c.time.tokens_per_second;
    // Every mesh trains the same 16 sequences per step.
    EXPECT_EQ(c.config.batch_size * c.config.grad_accum *
                  c.config.DataParallelSize(c.world_size),
              16)
        << c.name;
    EXPECT_EQ(c.time.tokens_per_step, 16 * 128) << c.name;
  }
  // Only DDP's meshes when asked for.
  options.strategy = "ddp";
  ranked = SearchMeshes(base, options, &rates);
  ASSERT_TRUE(ranked.ok());
  names = Names(*ranked);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"ddp2xtp2", "ddp2xtp2 +ckpt",
                                             "ddp4", "ddp4 +ckpt", "pp2xddp2",
                                             "pp2xddp2 +ckpt"}));
}

TEST(MeshSearchTest, ABudgetLeavesOutWhatDoesNotFitAndAccumulates) {
  TrainConfig base = Config("ddp", 1);
  base.batch_size = 8;
  TrainConfig one = base;
  one.batch_size = 1;
  one.activation_checkpointing = "all";
  // Below DDP at one sequence per rank, recomputing every block: no DDP
  // fits, sharded meshes do.
  const int64_t ddp_at_one = PlanMemory(one, 2)->total();
  MeshSearchOptions options;
  options.devices = 2;
  options.global_batch = 16;
  options.budget = ddp_at_one - 1;
  const HostRates rates = Rates(2);
  absl::StatusOr<std::vector<MeshCandidate>> ranked =
      SearchMeshes(base, options, &rates);
  ASSERT_TRUE(ranked.ok()) << ranked.status();
  bool seen_misfit = false;
  for (const MeshCandidate& c : *ranked) {
    if (!c.fits) seen_misfit = true;
    EXPECT_FALSE(c.fits && seen_misfit) << "fitting after a misfit: " << c.name;
    if (c.name.rfind("ddp2", 0) == 0) {
      EXPECT_FALSE(c.fits) << c.name;
    }
    if (c.fits) {
      EXPECT_LE(c.memory.total(), options.budget) << c.name;
    }
  }
  ASSERT_TRUE(ranked->front().fits);
  // With room, DDP fits by accumulating smaller micro-batches.
  TrainConfig plain = one;
  plain.activation_checkpointing = "none";
  options.budget = PlanMemory(plain, 2)->total() + (int64_t{1} << 20);
  ranked = SearchMeshes(base, options, &rates);
  ASSERT_TRUE(ranked.ok());
  for (const MeshCandidate& c : *ranked) {
    if (c.name != "ddp2") continue;
    EXPECT_TRUE(c.fits);
    EXPECT_EQ(c.config.batch_size, 1);
    EXPECT_EQ(c.config.grad_accum, 8);
  }
}

TEST(MeshSearchTest, AutoRefusesWhenNothingFitsAndHandsItsChoiceOn) {
  TrainConfig config = Config("auto", 1);
  config.memory_cap = int64_t{1} << 20;
  absl::StatusOr<std::vector<MeshCandidate>> ranked =
      RankMeshesForAuto(config, 2, 2, Rates(2));
  ASSERT_FALSE(ranked.ok());
  EXPECT_EQ(ranked.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(ranked.status().message().find(
                "no mesh of 2 ranks fits memory_cap 1.0 MiB"),
            std::string::npos)
      << ranked.status();

  config.memory_cap = 0;
  ranked = RankMeshesForAuto(config, 4, 4, Rates(4));
  ASSERT_TRUE(ranked.ok()) << ranked.status();
  const TrainConfig& chosen = ranked->front().config;
  // The ranks rebuild the same config from the launcher's YAML.
  TrainConfig rebuilt = Config("auto", 1);
  rebuilt.data = "data";
  ASSERT_TRUE(ApplyYamlTrainConfig(MeshFieldsYaml(chosen), &rebuilt).ok());
  EXPECT_EQ(rebuilt.strategy, chosen.strategy);
  EXPECT_EQ(rebuilt.pipeline_stages, chosen.pipeline_stages);
  EXPECT_EQ(rebuilt.tensor_parallel, chosen.tensor_parallel);
  EXPECT_EQ(rebuilt.micro_batches, chosen.micro_batches);
  EXPECT_EQ(rebuilt.activation_checkpointing, chosen.activation_checkpointing);
  EXPECT_EQ(rebuilt.batch_size, chosen.batch_size);
  EXPECT_EQ(rebuilt.grad_accum, chosen.grad_accum);
  EXPECT_TRUE(rebuilt.Validate().ok());
}

// Extreme sizes are refused naming the bound, not searched for minutes
// (2^31-1 devices once took over 20 s, a global batch of 10^7 45 s).
TEST(MeshSearchTest, ExtremeSizesAreRefusedNamingTheBound) {
  const TrainConfig base = Config("ddp", 1);
  const HostRates rates = Rates(2);
  MeshSearchOptions options;
  options.devices = 2147483647;
  absl::StatusOr<std::vector<MeshCandidate>> ranked =
      SearchMeshes(base, options, &rates);
  EXPECT_EQ(ranked.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ranked.status().message()),
              ::testing::HasSubstr("a search weighs 1 to 65536 devices"));
  options.devices = 2;
  options.global_batch = 10000000;
  ranked = SearchMeshes(base, options, &rates);
  EXPECT_EQ(ranked.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ranked.status().message()),
              ::testing::HasSubstr("up to 1048576"));
  // At the bounds, answered: every divisor of the share is still weighed.
  options.global_batch = kMaxSearchGlobalBatch;
  ranked = SearchMeshes(base, options, &rates);
  ASSERT_TRUE(ranked.ok()) << ranked.status();
  ASSERT_FALSE(ranked->empty());
  for (const MeshCandidate& c : *ranked) {
    EXPECT_EQ(c.config.batch_size * c.config.grad_accum *
                  c.config.DataParallelSize(c.world_size),
              kMaxSearchGlobalBatch)
        << c.name;
  }
}

// A pipeline's micro-batch count is searched (S, 2S, 4S; the fastest
// predicted kept) unless it is given; more shrink the bubble.
TEST(MeshSearchTest, APipelinesMicroBatchesAreSearchedUnlessGiven) {
  const TrainConfig base = Config("ddp", 1);
  const HostRates rates = Rates(2);
  MeshSearchOptions options;
  options.devices = 2;
  options.global_batch = 16;
  options.checkpointing = false;
  const auto pp2 = [](const std::vector<MeshCandidate>& ranked) {
    for (const MeshCandidate& c : ranked) {
      if (c.name == "pp2") return c;
    }
    ADD_FAILURE() << "no pp2 row";
    return MeshCandidate{};
  };
  absl::StatusOr<std::vector<MeshCandidate>> ranked =
      SearchMeshes(base, options, &rates);
  ASSERT_TRUE(ranked.ok()) << ranked.status();
  const MeshCandidate searched = pp2(*ranked);
  EXPECT_TRUE(searched.config.micro_batches == 2 ||
              searched.config.micro_batches == 4 ||
              searched.config.micro_batches == 8)
      << searched.config.micro_batches;
  for (int64_t m : {2, 4, 8}) {
    TrainConfig fixed = searched.config;
    fixed.micro_batches = m;
    absl::StatusOr<StepTimePlan> plan = PlanStepTime(fixed, 2, 2, rates);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_GE(searched.time.tokens_per_second, plan->tokens_per_second)
        << "M=" << m;
  }
  TrainConfig given = base;
  given.micro_batches = 2;
  ranked = SearchMeshes(given, options, &rates);
  ASSERT_TRUE(ranked.ok());
  EXPECT_EQ(pp2(*ranked).config.micro_batches, 2);
  // --virtual-stages interleaves the meshes with stages only (the others
  // would be refused with it), and its smaller bubble is predicted faster;
  // gpt2-mini's four blocks make two stages of two chunks.
  given.model = "gpt2-mini";
  ranked = SearchMeshes(given, options, &rates);
  ASSERT_TRUE(ranked.ok()) << ranked.status();
  TrainConfig interleaved = given;
  interleaved.virtual_stages = 2;
  absl::StatusOr<std::vector<MeshCandidate>> with_chunks =
      SearchMeshes(interleaved, options, &rates);
  ASSERT_TRUE(with_chunks.ok()) << with_chunks.status();
  EXPECT_EQ(with_chunks->size(), ranked->size());
  for (const MeshCandidate& c : *with_chunks) {
    EXPECT_EQ(c.config.virtual_stages, c.config.pipeline_stages > 1 ? 2 : 1)
        << c.name;
  }
  EXPECT_LT(pp2(*with_chunks).time.bubble_seconds,
            pp2(*ranked).time.bubble_seconds);
}

TEST(MeshSearchTest, SaysWhyTheFirstWins) {
  // Slow links: DDP's all-reduce of wte's gradient loses to FSDP.
  HostRates slow = Rates(2);
  slow.intra_node = {1e-4, 1e8};
  MeshSearchOptions options;
  options.devices = 2;
  options.global_batch = 16;
  options.model_parallel = false;
  options.checkpointing = false;
  absl::StatusOr<std::vector<MeshCandidate>> ranked =
      SearchMeshes(Config("ddp", 1), options, &slow);
  ASSERT_TRUE(ranked.ok());
  ASSERT_EQ(Names(*ranked), (std::vector<std::string>{"fsdp2", "ddp2"}));
  const std::string why = WhyFirstWins(*ranked);
  EXPECT_EQ(why.rfind("fsdp2 predicts ", 0), 0u) << why;
  EXPECT_NE(why.find("collectives"), std::string::npos) << why;
  EXPECT_NE(why.find("ddp2 moves "), std::string::npos) << why;
  // Within 2%: said to be a tie.
  std::vector<MeshCandidate> tie = *ranked;
  tie[1].time = tie[0].time;
  tie[1].time.tokens_per_second *= 0.99;
  EXPECT_NE(WhyFirstWins(tie).find("within 1.0% of each other"),
            std::string::npos)
      << WhyFirstWins(tie);
  tie.resize(1);
  EXPECT_EQ(WhyFirstWins(tie), "fsdp2 is the only mesh that fits");
}

// Meshes at different global batches (plan --fit: each at its largest)
// are compared per token, never step time against step time; a gap
// between meshes with model parallelism smaller than the model's measured
// error there is said to be one.
TEST(MeshSearchTest, WhyComparesPerTokenAcrossBatchesAndNamesTheModelsError) {
  std::vector<MeshCandidate> ranked(2);
  ranked[0].name = "tp2";
  ranked[0].fits = true;
  ranked[0].time.tensor_parallel = 2;
  ranked[0].time.compute_seconds = 8;
  ranked[0].time.step_seconds = 10;
  ranked[0].time.tokens_per_step = 20000;
  ranked[0].time.tokens_per_second = 2000;
  ranked[1].name = "ddp2";
  ranked[1].fits = true;
  ranked[1].time.compute_seconds = 5;
  ranked[1].time.step_seconds = 6;
  ranked[1].time.tokens_per_step = 10000;
  ranked[1].time.tokens_per_second = 1666.7;
  const std::string why = WhyFirstWins(ranked);
  EXPECT_NE(why.find("(2,000 tokens/s vs 1,667)"), std::string::npos) << why;
  EXPECT_EQ(why.find("per step)"), std::string::npos) << why;
  EXPECT_NE(why.find("per 1,000 tokens"), std::string::npos) << why;
  EXPECT_NE(why.find("off by up to 32%"), std::string::npos) << why;
  // Beyond the model's error, no such caveat.
  ranked[1].time.tokens_per_second = 1000;
  EXPECT_EQ(WhyFirstWins(ranked).find("off by up to"), std::string::npos);
}

// A pp2 x fsdp2 job of gpt2-tiny (batch 8 per replica: 16 sequences per
// step) that must continue on 2 ranks, or 1, or grows back to its 4.
TrainConfig ElasticJob() {
  TrainConfig job = Config("fsdp", 1);
  job.pipeline_stages = 2;
  job.micro_batches = 2;
  return job;
}

int64_t GlobalBatch(const TrainConfig& c, int64_t world) {
  return c.batch_size * c.grad_accum * c.DataParallelSize(world);
}

TEST(ElasticMeshTest, AtItsOwnWorldSizeAJobKeepsItsMesh) {
  const TrainConfig job = ElasticJob();
  const HostRates rates = Rates(4);
  absl::StatusOr<ElasticMeshChoice> own = ChooseElasticMesh(job, 4, 4, &rates);
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_EQ(own->name, "pp2xfsdp2");
  EXPECT_EQ(own->config.micro_batches, 2);
  EXPECT_EQ(own->config.batch_size, 8);
  // Predicted as the plan predicts that mesh.
  EXPECT_DOUBLE_EQ(own->predicted_tokens_per_second,
                   Plan(job, 4, rates, 4).tokens_per_second);
  own = ChooseElasticMesh(job, 4, 4, nullptr);
  ASSERT_TRUE(own.ok());
  EXPECT_EQ(own->predicted_tokens_per_second, 0);
}

// On fewer ranks the step-time model picks among every mesh of the job's
// strategy (or one replica), the global batch kept at no larger a batch
// per rank: with links that cost nothing, one without a pipeline bubble;
// with slow ones, the pipeline, whose activations are far less than GPT-2
// small's parameters that FSDP gathers.
TEST(ElasticMeshTest, OnFewerRanksTheFastestMeshForTheSameBatchWins) {
  TrainConfig job = ElasticJob();
  job.model = "gpt2";
  HostRates fast = Rates(4);
  fast.intra_node = {1e-9, 1e15};
  HostRates slow = Rates(4);
  slow.intra_node = {1e-3, 1e6};
  for (const HostRates* rates : {&fast, &slow}) {
    absl::StatusOr<ElasticMeshChoice> chosen =
        ChooseElasticMesh(job, 4, 2, rates);
    ASSERT_TRUE(chosen.ok()) << chosen.status();
    EXPECT_EQ(GlobalBatch(chosen->config, 2), 16) << chosen->name;
    EXPECT_LE(chosen->config.batch_size, 8) << chosen->name;
    EXPECT_TRUE(chosen->config.CheckMeshWorld(2).ok()) << chosen->name;
    EXPECT_GT(chosen->candidates, 1);
    EXPECT_GT(chosen->predicted_tokens_per_second, 0);
    EXPECT_THAT(chosen->why, ::testing::HasSubstr("step-time model"));
    // Nothing of 2 ranks the search weighs is predicted faster.
    MeshSearchOptions all;
    all.devices = 2;
    all.global_batch = 16;
    all.strategy = "fsdp";
    all.one_replica_too = true;
    all.max_batch = 8;
    all.checkpointing = false;
    absl::StatusOr<std::vector<MeshCandidate>> ranked =
        SearchMeshes(job, all, rates);
    ASSERT_TRUE(ranked.ok());
    std::vector<std::string> names = Names(*ranked);
    std::sort(names.begin(), names.end());
    EXPECT_EQ(names, (std::vector<std::string>{"fsdp2", "pp2", "tp2"}));
    for (const MeshCandidate& c : *ranked) {
      EXPECT_LE(c.time.tokens_per_second,
                chosen->predicted_tokens_per_second * (1 + 1e-12))
          << c.name;
    }
  }
  EXPECT_EQ(ChooseElasticMesh(job, 4, 2, &fast)->config.pipeline_stages, 1);
  EXPECT_EQ(ChooseElasticMesh(job, 4, 2, &slow)->name, "pp2");
  // On one rank there is one mesh.
  absl::StatusOr<ElasticMeshChoice> one = ChooseElasticMesh(job, 4, 1, &slow);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->name, "single");
  EXPECT_EQ(one->candidates, 1);
  EXPECT_EQ(one->config.batch_size * one->config.grad_accum, 16);
}

// Without rates the job keeps its own stages and tensor ranks where they
// divide the ranks; the sizes it may run at are those some mesh shares
// its batch at.
TEST(ElasticMeshTest, WithoutRatesItKeepsItsStagesAndSaysWhichSizesWork) {
  TrainConfig job = ElasticJob();
  absl::StatusOr<ElasticMeshChoice> two = ChooseElasticMesh(job, 4, 2, nullptr);
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->name, "pp2");
  EXPECT_EQ(two->predicted_tokens_per_second, 0);
  EXPECT_THAT(two->why, ::testing::HasSubstr("no measured rates"));
  EXPECT_EQ(GlobalBatch(two->config, 2), 16);
  // 16 sequences: 3 ranks of fsdp cannot share them, nor a pipeline of 3.
  EXPECT_FALSE(ChooseElasticMesh(job, 4, 3, nullptr).ok());
  EXPECT_EQ(ElasticWorldSizes(job, 4, 1), (std::vector<int64_t>{1, 2, 4}));
  EXPECT_EQ(ElasticWorldSizes(job, 4, 2), (std::vector<int64_t>{2, 4}));

  // HSDP keeps its shard groups whole: 2 per group, so even sizes only.
  TrainConfig hsdp = Config("hsdp", 1);
  hsdp.batch_size = 3;
  hsdp.shard_group_size = 2;
  EXPECT_EQ(ElasticWorldSizes(hsdp, 8, 1),
            (std::vector<int64_t>{1, 2, 4, 6, 8}));

  // A memory cap no mesh of fewer ranks fits: refused naming it.
  TrainConfig capped = ElasticJob();
  capped.memory_cap = 1;
  absl::StatusOr<ElasticMeshChoice> none =
      ChooseElasticMesh(capped, 4, 2, nullptr);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(none.status().message(),
              ::testing::HasSubstr("no fsdp mesh of 2 ranks shares the 16 "
                                   "sequences per step at 8 or fewer per rank "
                                   "within memory_cap"));
}

// Strategy auto, elastic: at every world size, its own included, every
// strategy's meshes are weighed for the same global batch.
TEST(ElasticMeshTest, AnAutoJobWeighsEveryStrategyAtEachSize) {
  TrainConfig job = Config("auto", 1);  // 8 per rank at 4 ranks: 32
  const HostRates rates = Rates(4);
  for (int64_t world : {4, 2}) {
    absl::StatusOr<ElasticMeshChoice> chosen =
        ChooseElasticMesh(job, 4, world, &rates);
    ASSERT_TRUE(chosen.ok()) << chosen.status();
    EXPECT_NE(chosen->config.strategy, "auto");
    EXPECT_EQ(GlobalBatch(chosen->config, world), 32);
    MeshSearchOptions all;
    all.devices = world;
    all.global_batch = 32;
    all.max_batch = 8;
    all.checkpointing = false;
    absl::StatusOr<std::vector<MeshCandidate>> ranked =
        SearchMeshes(job, all, &rates);
    ASSERT_TRUE(ranked.ok());
    std::set<std::string> strategies;
    for (const MeshCandidate& c : *ranked) {
      strategies.insert(c.config.strategy);
      EXPECT_LE(c.time.tokens_per_second,
                chosen->predicted_tokens_per_second * (1 + 1e-12))
          << c.name;
    }
    EXPECT_GE(strategies.size(), 2u);
    EXPECT_EQ(chosen->candidates, static_cast<int64_t>(ranked->size()));
  }
  EXPECT_EQ(ElasticWorldSizes(job, 4, 1), (std::vector<int64_t>{1, 2, 4}));
}

TEST(StepTimePlanTest, MeasuredAgainstThePredictionInWords) {
  EXPECT_EQ(MeasuredAgainstPrediction(1791, 861), "52% below the prediction");
  EXPECT_EQ(MeasuredAgainstPrediction(866, 1132), "31% above the prediction");
  EXPECT_EQ(MeasuredAgainstPrediction(1000, 1005),
            "within 1% of the prediction");
  EXPECT_EQ(MeasuredAgainstPrediction(0, 5), "no prediction");
}

}  // namespace
}  // namespace shardtrain
