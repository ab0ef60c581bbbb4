// PipelineStrategy against SingleDeviceStrategy: GPT-2's blocks cut into
// stages (ranks as threads, activations and gradients point-to-point over the
// in-process Communicator), composed with data-parallel replicas, under both
// schedules, must train as one device does on the same global batches.
#include "worker/engine/strategy/pipeline_strategy.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "tests/fakes/in_process_communicator.h"
#include "tests/test_util.h"
#include "tests/worker/engine/strategy/strategy_harness.h"
#include "worker/engine/strategy/tensor_parallel_strategy.h"

namespace shardtrain {
namespace pipeline_strategy_test {

// Four blocks, so four stages can each hold one; vocab_size 500 pads wte to
// 512 rows.
constexpr char kSpec[] =
    "custom:n_layer=4,n_head=2,n_embd=64,block_size=32,vocab_size=500";
constexpr int64_t kSeqLen = 32;
constexpr int64_t kVocab = 500;
constexpr int64_t kSteps = 6;
// As in ddp_strategy_test: AdamW moves an element whose true gradient is at
// rounding level by up to lr whatever its size, so the weights are compared
// in units of lr (measured at lr 1e-3: 1.4e-5 to 1.7e-5 after 6 steps, the
// losses still within 8e-8); at 1e-4 they stay within 1e-5.
constexpr double kLr = 1e-4;

struct Case {
  int64_t stages;
  int64_t replicas;  // data-parallel size
  PipelineSchedule schedule;
  int64_t micro_batches;
  int64_t accumulation = 1;
  int64_t checkpointing = 0;  // recompute every N-th block (0: none)
  std::vector<int64_t> split = {};
  std::string data_parallel = "";  // empty: ddp with replicas, else single
  int64_t virtual_stages = 1;      // chunks per stage (interleaved)

  std::string DataParallel() const {
    if (!data_parallel.empty()) return data_parallel;
    return replicas > 1 ? "ddp" : "single";
  }
  std::string Name() const {
    return absl::StrCat(
        "pp", stages, "x", DataParallel(), replicas, "_",
        absl::StrReplaceAll(PipelineScheduleName(schedule), {{"-", ""}}), "_m",
        micro_batches, "_accum", accumulation, "_ckpt", checkpointing,
        split.empty() ? "" : "_split",
        virtual_stages > 1 ? absl::StrCat("_interleaved", virtual_stages) : "");
  }
};

test::StrategyMaker Maker(const Case& c) {
  return [c](int64_t rank, int64_t world,
             Communicator* comm) -> std::unique_ptr<Strategy> {
    StrategyOptions options;
    options.rank = rank;
    options.world_size = world;
    PipelineOptions pipeline;
    pipeline.stages = c.stages;
    pipeline.split = c.split;
    pipeline.micro_batches = c.micro_batches;
    pipeline.schedule = c.schedule;
    pipeline.seq_len = kSeqLen;
    pipeline.data_parallel = c.DataParallel();
    pipeline.virtual_stages = c.virtual_stages;
    return std::make_unique<PipelineStrategy>(options, comm, pipeline);
  };
}

class PipelineEquivalenceTest : public ::testing::TestWithParam<Case> {};

// Rows per global batch: 8 per replica, enough for 4 micro-batches of 2 per
// accumulation step of 2.
TEST_P(PipelineEquivalenceTest, TrainsAsOneDeviceDoes) {
  const Case c = GetParam();
  const torch::Tensor batches =
      test::MakeBatches(kSteps, 8 * c.replicas, kSeqLen, kVocab);
  test::TrainLoop loop = test::MakeLoop(0, kSteps, c.accumulation, kLr);
  loop.activation_checkpointing = c.checkpointing;
  const test::TrainResult single =
      test::TrainSingle(kSpec, /*seed=*/7, batches, loop);
  loop.whole_steps = true;  // the step at once, as the trainer hands it
  const std::vector<test::TrainResult> ranks = test::TrainRanks(
      kSpec, /*seed=*/7, batches, c.stages * c.replicas, loop, Maker(c));
  // The mean of micro-batch means rounds differently from one mean over the
  // batch; nothing else may differ: losses, gradient norms and the eval loss
  // within 1e-6 relative (ExpectSameTraining prints the measured worst).
  for (size_t r = 0; r < ranks.size(); ++r) {
    test::ExpectSameTraining(single, ranks[r], {1e-6, 1e-5},
                             absl::StrCat(c.Name(), " rank ", r));
  }
  // Point-to-point, each step: a stage sends its replica's rows' activations
  // forward (but the last) and their gradients backward (but the first),
  // [rows, T, C] fp32 each way, however the rows are cut; and it waited on
  // its neighbours for some time.
  // Interleaved, each of a stage's chunks does so for its model stage.
  const int64_t each_way = 8 * kSeqLen * 64 * 4;
  const int64_t model_stages = c.stages * c.virtual_stages;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const int64_t stage = static_cast<int64_t>(r) / c.replicas;
    int64_t ways = 0;
    for (int64_t chunk = 0; chunk < c.virtual_stages; ++chunk) {
      const int64_t k = chunk * c.stages + stage;
      ways += (k > 0 ? 1 : 0) + (k + 1 < model_stages ? 1 : 0);
    }
    ASSERT_EQ(ranks[r].step_comm.size(), static_cast<size_t>(kSteps));
    for (const CommStats& comm : ranks[r].step_comm) {
      EXPECT_EQ(comm.p2p_bytes, ways * each_way) << "rank " << r;
      EXPECT_GT(comm.pipeline_bubble_seconds, 0) << "rank " << r;
    }
  }
  // Only HSDP's averaging of shards crosses its shard groups.
  for (size_t r = 0; r < ranks.size(); ++r) {
    for (const CommStats& comm : ranks[r].step_comm) {
      if (c.data_parallel == "hsdp") {
        EXPECT_GT(comm.inter_group_bytes, 0) << "rank " << r;
      } else {
        EXPECT_EQ(comm.inter_group_bytes, 0) << "rank " << r;
      }
    }
  }
  // A stage holds its blocks only: less state than the whole model (the
  // last stage of two, 57% of it here); sharded over two ranks, under half.
  EXPECT_LT(ranks.back().state_bytes, single.state_bytes);
  if (!c.data_parallel.empty()) {
    EXPECT_LT(ranks.back().state_bytes, single.state_bytes / 2);
  }
}

// Every gradient, put together from the stages (and their shards), against
// one device's tensor by tensor, at equal weights (lr 0; see
// strategy_contract_test).
TEST_P(PipelineEquivalenceTest, GradientsMatchOneDeviceTensorByTensor) {
  const Case c = GetParam();
  const torch::Tensor batches =
      test::MakeBatches(2, 8 * c.replicas, kSeqLen, kVocab);
  test::TrainLoop loop = test::MakeLoop(0, 2, c.accumulation, /*lr=*/0);
  loop.activation_checkpointing = c.checkpointing;
  loop.record_gradients = true;
  const test::TrainResult single =
      test::TrainSingle(kSpec, /*seed=*/7, batches, loop);
  loop.whole_steps = true;
  const std::vector<test::TrainResult> ranks = test::TrainRanks(
      kSpec, /*seed=*/7, batches, c.stages * c.replicas, loop, Maker(c));
  test::ExpectSameGradients(single, ranks, 5e-6, c.Name());
}

// A gradient doubled in one tensor of a sharded stage is caught by the
// comparison above (the norm alone would blur it).
TEST(PipelineStrategyTest, ADoubledGradientInOneTensorIsCaught) {
  const Case c{2, 2, PipelineSchedule::kOneFOneB, 2, 1, 0, {}, "fsdp"};
  const std::string victim = "h.3.mlp.c_proj.weight";
  const torch::Tensor batches = test::MakeBatches(1, 16, kSeqLen, kVocab);
  test::TrainLoop loop = test::MakeLoop(0, 1, 1, /*lr=*/0);
  loop.record_gradients = true;
  const test::TrainResult single =
      test::TrainSingle(kSpec, /*seed=*/7, batches, loop);
  loop.whole_steps = true;
  loop.tamper = test::DoubleGradientOf(victim);
  const std::vector<test::TrainResult> ranks =
      test::TrainRanks(kSpec, /*seed=*/7, batches, 4, loop, Maker(c));
  test::ExpectOnlyTamperedGradientDiffers(single, ranks, victim, 5e-6);
}

// Activations and their gradients cross in the wire dtype: in bf16 (the
// compute dtype under CUDA mixed precision, set here on CPU) every transfer
// is half the fp32 bytes, the stages still compute in fp32, and the only
// difference from one device is bf16's rounding of the residual stream and
// its gradient at the cut (8 mantissa bits: 2^-9 relative per element).
TEST(PipelineStrategyTest, ActivationsCrossInTheWireDtype) {
  const torch::Tensor batches = test::MakeBatches(kSteps, 8, kSeqLen, kVocab);
  test::TrainLoop loop = test::MakeLoop(0, kSteps, 1, kLr);
  const test::TrainResult single =
      test::TrainSingle(kSpec, /*seed=*/7, batches, loop);
  loop.whole_steps = true;
  auto train = [&](torch::ScalarType wire) {
    return test::TrainRanks(
        kSpec, /*seed=*/7, batches, 2, loop,
        [wire](int64_t rank, int64_t world,
               Communicator* comm) -> std::unique_ptr<Strategy> {
          StrategyOptions options;
          options.rank = rank;
          options.world_size = world;
          PipelineOptions pipeline;
          pipeline.stages = 2;
          pipeline.micro_batches = 2;
          pipeline.seq_len = kSeqLen;
          pipeline.wire_dtype = wire;
          return std::make_unique<PipelineStrategy>(options, comm, pipeline);
        });
  };
  const std::vector<test::TrainResult> fp32 =
      train(torch::ScalarType::Undefined);  // the compute dtype: fp32 on CPU
  const std::vector<test::TrainResult> bf16 = train(torch::kBFloat16);
  const int64_t fp32_each_way = 8 * kSeqLen * 64 * 4;
  for (size_t r = 0; r < 2; ++r) {
    ASSERT_EQ(fp32[r].step_comm.size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(bf16[r].step_comm.size(), static_cast<size_t>(kSteps));
    for (int64_t step = 0; step < kSteps; ++step) {
      EXPECT_EQ(fp32[r].step_comm[step].p2p_bytes, fp32_each_way);
      EXPECT_EQ(bf16[r].step_comm[step].p2p_bytes, fp32_each_way / 2)
          << "rank " << r << " step " << step;
    }
  }
  // fp32 on the wire is one device's training; bf16 rounds at the cut, by
  // bf16's rounding of the residual stream and its gradient (measured
  // against one device: 1.5e-6 relative in loss, 1.2e-4 in the gradient
  // norm, where the fp32 wire is within 1.5e-7 and 1.5e-8).
  test::ExpectSameTraining(single, fp32[0], {1e-6, 1e-5}, "fp32 wire");
  double worst_loss = 0, worst_norm = 0;
  for (int64_t step = 0; step < kSteps; ++step) {
    worst_loss = std::max(
        worst_loss, test::RelDiff(bf16[0].losses[step], single.losses[step]));
    worst_norm = std::max(
        worst_norm, test::RelDiff(bf16[0].norms[step], single.norms[step]));
  }
  std::printf("bf16 wire against one device: loss %.2e, norm %.2e relative\n",
              worst_loss, worst_norm);
  EXPECT_GT(worst_norm, 1e-6) << "bf16 on the wire rounded nothing";
  EXPECT_LT(worst_norm, 1e-3);
  EXPECT_LT(worst_loss, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, PipelineEquivalenceTest,
    ::testing::Values(
        Case{2, 1, PipelineSchedule::kOneFOneB, 2},
        Case{2, 1, PipelineSchedule::kGpipe, 4},
        Case{4, 1, PipelineSchedule::kOneFOneB, 4},
        Case{4, 1, PipelineSchedule::kGpipe, 2},
        Case{2, 2, PipelineSchedule::kOneFOneB, 2},
        Case{2, 2, PipelineSchedule::kGpipe, 2, /*accumulation=*/2},
        Case{2, 1, PipelineSchedule::kOneFOneB, 4, 1, /*checkpointing=*/1},
        Case{3, 1, PipelineSchedule::kOneFOneB, 1, 2, 0, {1, 3}},
        // Each stage sharded over its two ranks.
        Case{2, 2, PipelineSchedule::kOneFOneB, 2, 1, 0, {}, "fsdp"},
        Case{2, 2, PipelineSchedule::kGpipe, 2, 2, 1, {}, "fsdp"},
        // Each stage's four ranks: two shard groups of two.
        Case{2, 4, PipelineSchedule::kOneFOneB, 2, 1, 0, {}, "hsdp"},
        Case{2, 4, PipelineSchedule::kGpipe, 2, 2, 1, {}, "hsdp"},
        // Interleaved: two chunks per stage (model stages 0, 2 on the
        // first, 1, 3 on the second), alone, replicated, sharded, with
        // accumulation, recomputation and GPipe's order.
        Case{2, 1, PipelineSchedule::kOneFOneB, 4, 1, 0, {}, "", 2},
        Case{2, 2, PipelineSchedule::kOneFOneB, 2, 2, 1, {}, "", 2},
        Case{2, 2, PipelineSchedule::kOneFOneB, 2, 1, 0, {}, "fsdp", 2},
        Case{2, 1, PipelineSchedule::kGpipe, 2, 1, 0, {}, "", 2},
        // Zero bubble: B and W apart, alone, over four stages, replicated
        // with accumulation, sharded with every block recomputed.
        Case{2, 1, PipelineSchedule::kZeroBubble, 4},
        Case{4, 1, PipelineSchedule::kZeroBubble, 4},
        Case{2, 2, PipelineSchedule::kZeroBubble, 2, /*accumulation=*/2},
        Case{2, 2, PipelineSchedule::kZeroBubble, 2, 1, 1, {}, "fsdp"}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return info.param.Name();
    });

// NCCL pairs the transfers of two ranks by their order and a send waits
// for its receive: every schedule's transfers must be posted in an order
// that completes under that rule (the in-process communicator's kNcclOrder),
// for S stages and every M in 1..2S, alone and beside data-parallel and
// tensor-parallel ranks; and it must still train as one device does. One
// step each: the order is the point, the numbers are checked all the same.
struct OrderCase {
  int64_t stages;
  int64_t replicas = 1;
  std::string data_parallel = "single";
  int64_t tensor_parallel = 1;
  int64_t virtual_stages = 1;
  int64_t shard_group_size = 0;  // hsdp
};

void ExpectEveryOrderCompletesUnderNccl(const OrderCase& c) {
  for (PipelineSchedule schedule :
       {PipelineSchedule::kOneFOneB, PipelineSchedule::kGpipe,
        PipelineSchedule::kZeroBubble}) {
    if (schedule == PipelineSchedule::kZeroBubble &&
        (c.virtual_stages > 1 || c.tensor_parallel > 1)) {
      continue;  // not interleaved, not with tensor ranks
    }
    for (int64_t m = 1; m <= 2 * c.stages; ++m) {
      // Interleaved 1F1B runs groups of S micro-batches.
      if (c.virtual_stages > 1 && schedule == PipelineSchedule::kOneFOneB &&
          m % c.stages != 0) {
        continue;
      }
      const std::string what =
          absl::StrCat("pp", c.stages, "x", c.data_parallel, c.replicas, "xtp",
                       c.tensor_parallel, " v", c.virtual_stages, " ",
                       PipelineScheduleName(schedule), " m", m);
      SCOPED_TRACE(what);
      const torch::Tensor batches =
          test::MakeBatches(1, 2 * m * c.replicas, kSeqLen, kVocab);
      test::TrainLoop loop = test::MakeLoop(0, 1, 1, kLr);
      const test::TrainResult single =
          test::TrainSingle(kSpec, /*seed=*/7, batches, loop);
      loop.whole_steps = true;
      loop.point_to_point = PointToPoint::kNcclOrder;
      const std::vector<test::TrainResult> ranks = test::TrainRanks(
          kSpec, /*seed=*/7, batches, c.stages * c.replicas * c.tensor_parallel,
          loop,
          [&](int64_t rank, int64_t world,
              Communicator* comm) -> std::unique_ptr<Strategy> {
            StrategyOptions options;
            options.rank = rank;
            options.world_size = world;
            PipelineOptions pipeline;
            pipeline.stages = c.stages;
            pipeline.micro_batches = m;
            pipeline.schedule = schedule;
            pipeline.seq_len = kSeqLen;
            pipeline.data_parallel = c.data_parallel;
            pipeline.tensor_parallel = c.tensor_parallel;
            pipeline.virtual_stages = c.virtual_stages;
            pipeline.shard_group_size = c.shard_group_size;
            return std::make_unique<PipelineStrategy>(options, comm, pipeline);
          });
      ASSERT_EQ(ranks.front().losses.size(), 1u) << "the step did not end";
      EXPECT_LE(test::RelDiff(ranks.front().losses[0], single.losses[0]), 1e-6);
      EXPECT_LE(test::RelDiff(ranks.front().norms[0], single.norms[0]), 1e-5);
    }
  }
}

// The in-process communicator reads a send's buffer when its receive
// matches it, as NCCL reads it while the transfer runs: a stage that
// changed an activation between posting its send and the receive would
// deliver the changed one, and the tests below would see the numbers move.
TEST(PipelineNcclOrderTest, ASendIsReadWhenItsReceiveMatchesIt) {
  InProcessGroup group(2, std::chrono::seconds(5), PointToPoint::kNcclOrder);
  std::unique_ptr<Communicator> zero = group.ForRank(0);
  std::unique_ptr<Communicator> one = group.ForRank(1);
  torch::Tensor sent = torch::full({4}, 1.0);
  std::unique_ptr<CommWork> send = zero->Send(sent, /*dst=*/1, /*tag=*/0);
  EXPECT_FALSE(send->IsCompleted());
  sent.fill_(2.0);  // before rank 1 has posted its receive
  torch::Tensor received = torch::zeros({4});
  std::unique_ptr<CommWork> recv = one->Recv(received, /*src=*/0, /*tag=*/0);
  ASSERT_TRUE(recv->Wait().ok());
  ASSERT_TRUE(send->Wait().ok());
  EXPECT_TRUE(torch::equal(received, torch::full({4}, 2.0))) << received;
}

TEST(PipelineNcclOrderTest, TwoStages) {
  ExpectEveryOrderCompletesUnderNccl({2});
}
TEST(PipelineNcclOrderTest, ThreeStages) {
  ExpectEveryOrderCompletesUnderNccl({3});
}
TEST(PipelineNcclOrderTest, FourStages) {
  ExpectEveryOrderCompletesUnderNccl({4});
}
TEST(PipelineNcclOrderTest, TwoStagesBesideDdp) {
  ExpectEveryOrderCompletesUnderNccl({2, 2, "ddp"});
}
TEST(PipelineNcclOrderTest, TwoStagesBesideFsdp) {
  ExpectEveryOrderCompletesUnderNccl({2, 2, "fsdp"});
}
TEST(PipelineNcclOrderTest, TwoStagesBesideTensorParallelism) {
  ExpectEveryOrderCompletesUnderNccl({2, 1, "single", 2});
}
// PP x FSDP x TP and PP x HSDP (8 ranks): a stage's units gathered over
// its replicas and tensor ranks, or over its shard group with the groups
// averaged, between the stages' transfers.
TEST(PipelineNcclOrderTest, TwoStagesBesideFsdpAndTensorParallelism) {
  ExpectEveryOrderCompletesUnderNccl({2, 2, "fsdp", 2});
}
TEST(PipelineNcclOrderTest, TwoStagesBesideHsdp) {
  ExpectEveryOrderCompletesUnderNccl(
      {2, 4, "hsdp", 1, 1, /*shard_group_size=*/2});
}
// PP x DDP x TP: the replicas' buckets hold wte's gradient, which the
// vocabulary-parallel head writes outside autograd.
TEST(PipelineNcclOrderTest, TwoStagesBesideDdpAndTensorParallelism) {
  ExpectEveryOrderCompletesUnderNccl({2, 2, "ddp", 2});
}
// Interleaved: the last stage's chunk hands its output to the first stage's
// next chunk, so with two stages activations cross their pair both ways.
TEST(PipelineNcclOrderTest, TwoStagesOfTwoChunks) {
  ExpectEveryOrderCompletesUnderNccl({2, 1, "single", 1, 2});
}
TEST(PipelineNcclOrderTest, TwoStagesOfTwoChunksBesideFsdpAndTensorRanks) {
  ExpectEveryOrderCompletesUnderNccl({2, 2, "fsdp", 1, 2});
  ExpectEveryOrderCompletesUnderNccl({2, 1, "single", 2, 2});
}

// Setup runs the order it is about to post under NCCL's rule, before any
// collective (every rank reaches the same verdict; none is left waiting),
// and refuses one whose transfers would face each other forever, naming
// them. The order handed in is the one the engine once posted, each
// transfer where its compute needs it: at S = 2, M = 2 1F1B's stage 0 sends
// a1 while stage 1 sends g0 (PipelineOrderTest).
TEST(PipelineStrategyTest, SetupRefusesAnOrderNcclCannotComplete) {
  InProcessGroup group(2, std::chrono::seconds(5), PointToPoint::kNcclOrder);
  std::unique_ptr<Communicator> comm = group.ForRank(0);
  StrategyOptions options;
  options.rank = 0;
  options.world_size = 2;
  PipelineOptions pipeline;
  pipeline.stages = 2;
  pipeline.micro_batches = 2;
  pipeline.seq_len = kSeqLen;
  int64_t lowered = 0;
  pipeline.lower =
      [&lowered](
          PipelineSchedule schedule, int64_t stages, int64_t micro_batches,
          int64_t) -> absl::StatusOr<std::vector<std::vector<PipelineOp>>> {
    ++lowered;
    std::vector<std::vector<PipelineOp>> ops;
    for (int64_t s = 0; s < stages; ++s) {
      ops.push_back(NaiveStageOps(schedule, stages, s, micro_batches));
    }
    return ops;
  };
  PipelineStrategy strategy(options, comm.get(), pipeline);
  const absl::Status setup = strategy.Setup(test::MakeModel(kSpec, 7));
  EXPECT_EQ(lowered, 1);
  EXPECT_EQ(setup.code(), absl::StatusCode::kFailedPrecondition) << setup;
  for (const char* part :
       {"pipeline: 1f1b with 2 stages and 2 micro-batches: its transfers "
        "would never complete on NCCL",
        "stage 0's next transfer is send a1 to 1",
        "stage 1's is send g0 to 0"}) {
    EXPECT_TRUE(absl::StrContains(setup.message(), part)) << setup;
  }
}

// Under mixed precision (the bf16 compute dtype, forced here on CPU) a
// step's micro-batch gradients add up in fp32 in the meshes whose units
// hold bf16 copies of the parameters, as on one device: a step of two
// micro-batches has the fp32 sum of the two micro-batches' own gradients
// (each taken alone, at the same weights, by the same mesh; the halving is
// exact). Added in bf16, in the leaves' gradients, they would be up to 2^-9
// of an element apart (measured before: 2e-3 of a tensor's largest
// element).
void ExpectMicroBatchesAddUpInFp32(const std::string& what, int64_t world,
                                   int64_t replicas, bool whole_steps,
                                   const test::StrategyMaker& make) {
  constexpr int64_t kRows = 2;  // per micro-batch and replica
  const torch::Tensor batches =
      test::MakeBatches(1, replicas * 2 * kRows, kSeqLen, kVocab);
  test::TrainLoop loop = test::MakeLoop(0, 1, /*micro_steps=*/2, /*lr=*/0);
  loop.whole_steps = whole_steps;
  loop.record_gradients = true;
  const test::ParamMap both = test::GlobalGradients(
      test::TrainRanks(kSpec, /*seed=*/7, batches, world, loop, make), 0);
  test::ParamMap sum;
  for (int64_t k : {0, 1}) {
    // Every replica's k-th micro-batch, as a step of its own.
    std::vector<torch::Tensor> rows;
    for (int64_t r = 0; r < replicas; ++r) {
      rows.push_back(batches.narrow(1, r * 2 * kRows + k * kRows, kRows));
    }
    test::TrainLoop alone = test::MakeLoop(0, 1, 1, /*lr=*/0);
    alone.whole_steps = whole_steps;
    alone.record_gradients = true;
    const test::ParamMap gradients = test::GlobalGradients(
        test::TrainRanks(kSpec, /*seed=*/7, torch::cat(rows, 1), world, alone,
                         make),
        0);
    for (const auto& [name, gradient] : gradients) {
      auto [it, added] = sum.try_emplace(name, gradient / 2);
      if (!added) it->second = it->second + gradient / 2;
    }
  }
  ASSERT_FALSE(sum.empty()) << what;
  double worst = 0;
  std::string worst_name;
  for (const auto& [name, diff] : test::GradientDiffs(sum, both)) {
    if (diff > worst) {
      worst = diff;
      worst_name = name;
    }
  }
  std::printf(
      "%s, bf16: two micro-batches against the sum of each alone: "
      "%.2e of a tensor's largest element (%s)\n",
      what.c_str(), worst, worst_name.c_str());
  EXPECT_LE(worst, 1e-6) << what << ": " << worst_name;
}

TEST(MixedPrecisionTest, MicroBatchesAddUpInFp32UnderPipelineAndFsdp) {
  ExpectMicroBatchesAddUpInFp32(
      "pp2 x fsdp2", 4, 2, /*whole_steps=*/true,
      [](int64_t rank, int64_t world,
         Communicator* comm) -> std::unique_ptr<Strategy> {
        StrategyOptions options;
        options.rank = rank;
        options.world_size = world;
        options.compute_dtype = torch::kBFloat16;
        PipelineOptions pipeline;
        pipeline.stages = 2;
        pipeline.micro_batches = 1;  // per step's micro-batch: 2 a step
        pipeline.seq_len = kSeqLen;
        pipeline.data_parallel = "fsdp";
        return std::make_unique<PipelineStrategy>(options, comm, pipeline);
      });
}

TEST(MixedPrecisionTest, MicroBatchesAddUpInFp32UnderTensorParallelAndFsdp) {
  ExpectMicroBatchesAddUpInFp32(
      "tp2 x fsdp2", 4, 2, /*whole_steps=*/false,
      [](int64_t rank, int64_t world,
         Communicator* comm) -> std::unique_ptr<Strategy> {
        StrategyOptions options;
        options.rank = rank;
        options.world_size = world;
        options.compute_dtype = torch::kBFloat16;
        return std::make_unique<TensorParallelStrategy>(
            options, comm, /*tensor_parallel=*/2, /*shard_over_replicas=*/true);
      });
}

// Rank `rank`'s strategy after one whole step of two stages, each over two
// ranks of `data_parallel` (4 ranks), micro-batches 2; null if Setup failed.
std::unique_ptr<PipelineStrategy> TrainTwoStagesOfTwo(
    int64_t rank, Communicator& comm, const std::string& data_parallel,
    double bucket_mb = 25, int64_t virtual_stages = 1,
    PipelineSchedule schedule = PipelineSchedule::kOneFOneB) {
  torch::set_num_threads(1);
  StrategyOptions options;
  options.rank = rank;
  options.world_size = 4;
  PipelineOptions pipeline;
  pipeline.stages = 2;
  pipeline.micro_batches = 2;
  pipeline.seq_len = kSeqLen;
  pipeline.data_parallel = data_parallel;
  pipeline.bucket_mb = bucket_mb;
  pipeline.virtual_stages = virtual_stages;
  pipeline.schedule = schedule;
  auto strategy = std::make_unique<PipelineStrategy>(options, &comm, pipeline);
  const absl::Status setup = strategy->Setup(test::MakeModel(kSpec, 7));
  EXPECT_TRUE(setup.ok()) << setup;
  if (!setup.ok()) return nullptr;
  test::TrainLoop loop = test::MakeLoop(0, 1, 1, kLr);
  loop.whole_steps = true;
  test::TrainResult result;
  test::Train(*strategy, test::MakeBatches(1, 16, kSeqLen, kVocab), rank, 4,
              loop, &result);
  return strategy;
}

// A replicated stage reduces over its replicas as DDP does: in buckets
// launched as the step's last backward completes them, before the schedule
// ends (they once waited for it: one all-reduce after the drain).
TEST(PipelineStrategyTest, ReplicatedStagesReduceDuringTheLastBackward) {
  RunRanks(4, [&](int64_t rank, Communicator& comm) {
    // Several buckets per stage.
    const std::unique_ptr<PipelineStrategy> strategy =
        TrainTwoStagesOfTwo(rank, comm, "ddp", /*bucket_mb=*/0.05);
    ASSERT_NE(strategy, nullptr);
    const GradientBuckets::OverlapTrace trace =
        strategy->replica_overlap_trace();
    ASSERT_GE(trace.bucket_launch.size(), 3u) << "rank " << rank;
    // The first bucket went while later ones were still being computed.
    EXPECT_LT(trace.bucket_launch.front(), trace.bucket_launch.back())
        << "rank " << rank;
    EXPECT_LT(trace.bucket_launch.front(), trace.backward_end)
        << "rank " << rank;
  });
}

// A sharded stage reduce-scatters each unit as the step's last backward
// completes its gradient, while the stage's earlier blocks still compute
// (they once all went after the schedule), and trains as before.
TEST(PipelineStrategyTest, ShardedStagesReduceScatterDuringTheLastBackward) {
  RunRanks(4, [&](int64_t rank, Communicator& comm) {
    const std::unique_ptr<PipelineStrategy> strategy =
        TrainTwoStagesOfTwo(rank, comm, "fsdp");
    ASSERT_NE(strategy, nullptr);
    const PipelineStrategy::ShardOverlapTrace trace =
        strategy->shard_overlap_trace();
    // Every stage's blocks and its root unit (positions or the final norm)
    // went from their hooks: two units at least.
    ASSERT_GE(trace.unit_launch.size(), 2u) << "rank " << rank;
    EXPECT_LT(trace.unit_launch.front(), trace.backward_end) << "rank " << rank;
    for (size_t i = 1; i < trace.unit_launch.size(); ++i) {
      EXPECT_LE(trace.unit_launch[i - 1], trace.unit_launch[i]);
    }
  });
}

// A sharded stage gathers its units as its first forward needs them: each
// block's unit is waited for just before the block runs, so the stage's
// first block computes while later blocks' gathers are still outstanding
// (they were once all waited for before the schedule).
TEST(PipelineStrategyTest, ShardedStagesGatherEachUnitAsTheForwardNeedsIt) {
  const CausalLm model = test::MakeModel(kSpec, 7);
  RunRanks(4, [&](int64_t rank, Communicator& comm) {
    const std::unique_ptr<PipelineStrategy> strategy =
        TrainTwoStagesOfTwo(rank, comm, "fsdp");
    ASSERT_NE(strategy, nullptr);
    const std::vector<std::string>& trace = strategy->gather_trace();
    const PipelineStage& mine = strategy->stages()[strategy->stage()];
    ASSERT_GE(mine.end_block - mine.first_block, 2) << "rank " << rank;
    // Every block after the first starts before its unit is ready, and its
    // unit is the next one waited for.
    for (int64_t i = mine.first_block + 1; i < mine.end_block; ++i) {
      const auto block =
          std::find(trace.begin(), trace.end(), absl::StrCat("block ", i));
      ASSERT_NE(block, trace.end())
          << "rank " << rank << ": block " << i << " waited for nothing; trace "
          << absl::StrJoin(trace, ", ");
      ASSERT_NE(block + 1, trace.end());
      EXPECT_EQ(*(block + 1),
                absl::StrCat("unit ", model->BlockName(i), " ready"))
          << "rank " << rank;
    }
    // Every unit was gathered by the end of the first forward.
    const int64_t ready = std::count_if(
        trace.begin(), trace.end(),
        [](const std::string& e) { return absl::StartsWith(e, "unit "); });
    EXPECT_GE(ready, mine.end_block - mine.first_block + 1) << "rank " << rank;
  });
}

// Interleaved, each chunk's units go during that chunk's last backward: on
// both stages of two chunks, every block's unit and the root's (three)
// launch from their hooks, where arming at the step's last backward alone
// (chunk 0's) left the other chunk's for after the schedule.
TEST(PipelineStrategyTest,
     InterleavedStagesReduceEachChunkDuringItsLastBackward) {
  RunRanks(4, [&](int64_t rank, Communicator& comm) {
    const std::unique_ptr<PipelineStrategy> strategy =
        TrainTwoStagesOfTwo(rank, comm, "fsdp", 25, /*virtual_stages=*/2);
    ASSERT_NE(strategy, nullptr);
    const PipelineStrategy::ShardOverlapTrace trace =
        strategy->shard_overlap_trace();
    EXPECT_EQ(trace.unit_launch.size(), 3u) << "rank " << rank;
    for (const auto& launch : trace.unit_launch) {
      EXPECT_LT(launch, trace.backward_end) << "rank " << rank;
    }
  });
  // Replicated: the first bucket holds the last chunk's parameters, which
  // its own last backward completes before the step's last backward
  // (chunk 0's); armed per chunk, it goes then instead of after the drain.
  RunRanks(4, [&](int64_t rank, Communicator& comm) {
    const std::unique_ptr<PipelineStrategy> strategy =
        TrainTwoStagesOfTwo(rank, comm, "ddp", /*bucket_mb=*/0.05,
                            /*virtual_stages=*/2);
    ASSERT_NE(strategy, nullptr);
    const GradientBuckets::OverlapTrace trace =
        strategy->replica_overlap_trace();
    ASSERT_GE(trace.bucket_launch.size(), 2u) << "rank " << rank;
    EXPECT_LT(trace.bucket_launch.front(), trace.backward_end)
        << "rank " << rank;
  });
}

// zb-h1 leaves every projection's weight gradients of a micro-batch to its
// W (four per GPT-2 block: c_attn, attention's c_proj, c_fc, the MLP's
// c_proj), on replicated and sharded stages alike; 1F1B leaves none. The
// reduction still overlaps the step's end: a replicated stage's first
// bucket (its last parameters, a LayerNorm's among them, which W does not
// touch) and a sharded stage's block units go before the schedule ends.
// (That the gradients land, and reduce, right is the equivalence rows'.)
TEST(PipelineStrategyTest, ZeroBubbleLeavesEveryProjectionsWeightsToW) {
  for (const std::string& dp : {"ddp", "fsdp"}) {
    for (PipelineSchedule schedule :
         {PipelineSchedule::kZeroBubble, PipelineSchedule::kOneFOneB}) {
      RunRanks(4, [&](int64_t rank, Communicator& comm) {
        // Several buckets a stage.
        const std::unique_ptr<PipelineStrategy> trained = TrainTwoStagesOfTwo(
            rank, comm, dp, /*bucket_mb=*/0.05, /*virtual_stages=*/1, schedule);
        ASSERT_NE(trained, nullptr);
        const PipelineStrategy& strategy = *trained;
        const PipelineStage& mine = strategy.stages()[strategy.stage()];
        const int64_t blocks = mine.end_block - mine.first_block;
        EXPECT_EQ(
            strategy.deferred_weight_gradients(),
            schedule == PipelineSchedule::kZeroBubble ? 2 * 4 * blocks : 0)
            << dp << " " << PipelineScheduleName(schedule) << " rank " << rank;
        if (dp == "ddp") {
          const GradientBuckets::OverlapTrace trace =
              strategy.replica_overlap_trace();
          ASSERT_GE(trace.bucket_launch.size(), 2u);
          EXPECT_LT(trace.bucket_launch.front(), trace.backward_end)
              << PipelineScheduleName(schedule) << " rank " << rank;
        } else {
          const PipelineStrategy::ShardOverlapTrace trace =
              strategy.shard_overlap_trace();
          ASSERT_GE(trace.unit_launch.size(), 1u)
              << PipelineScheduleName(schedule) << " rank " << rank;
          EXPECT_LT(trace.unit_launch.front(), trace.backward_end);
        }
      });
    }
  }
}

// Tensor-parallel layers make their weight gradients in B: zb-h1 beside
// tensor ranks is refused, naming the schedule to use.
TEST(PipelineStrategyTest, ZeroBubbleBesideTensorRanksIsRefused) {
  RunRanks(4, [&](int64_t rank, Communicator& comm) {
    StrategyOptions options;
    options.rank = rank;
    options.world_size = 4;
    PipelineOptions pipeline;
    pipeline.stages = 2;
    pipeline.micro_batches = 2;
    pipeline.seq_len = kSeqLen;
    pipeline.tensor_parallel = 2;
    pipeline.schedule = PipelineSchedule::kZeroBubble;
    PipelineStrategy strategy(options, &comm, pipeline);
    const absl::Status setup = strategy.Setup(test::MakeModel(kSpec, 7));
    EXPECT_EQ(setup.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(setup.message(), "use 1f1b")) << setup;
  });
}

TEST(PipelineStrategyTest, TheLayoutNamesEachStagesRanksAndBlocks) {
  std::vector<std::string> layouts(4);
  std::vector<int64_t> stages(4);
  RunRanks(4, [&](int64_t rank, Communicator& comm) {
    std::unique_ptr<Strategy> strategy = Maker(
        {2, 2, PipelineSchedule::kOneFOneB, 2, 1, 0, {2}})(rank, 4, &comm);
    ASSERT_TRUE(strategy->Setup(test::MakeModel(kSpec, 1)).ok());
    layouts[rank] = strategy->layout();
    stages[rank] = static_cast<PipelineStrategy&>(*strategy).stage();
    EXPECT_EQ(strategy->data_parallel_size(), 2);
    EXPECT_EQ(strategy->data_parallel_rank(), rank % 2);
  });
  EXPECT_EQ(layouts[0],
            "mesh: 2 pipeline stages x ddp 2, 1f1b with 2 micro-batch(es): "
            "stage 0 = ranks 0,1 (blocks 0-1, embeddings), stage 1 = ranks "
            "2,3 (blocks 2-3, head)");
  EXPECT_EQ(stages, (std::vector<int64_t>{0, 0, 1, 1}));

  std::vector<std::string> hsdp(8);
  RunRanks(8, [&](int64_t rank, Communicator& comm) {
    std::unique_ptr<Strategy> strategy =
        Maker({2, 4, PipelineSchedule::kOneFOneB, 2, 1, 0, {}, "hsdp"})(rank, 8,
                                                                        &comm);
    ASSERT_TRUE(strategy->Setup(test::MakeModel(kSpec, 1)).ok());
    hsdp[rank] = strategy->layout();
    EXPECT_EQ(strategy->data_parallel_size(), 4);
    EXPECT_EQ(strategy->data_parallel_rank(), rank % 4);
  });
  EXPECT_EQ(hsdp[5],
            "mesh: 2 pipeline stages x hsdp 4 (2 shard groups of 2), 1f1b "
            "with 2 micro-batch(es): stage 0 = ranks 0-3 (blocks 0-1, "
            "embeddings), stage 1 = ranks 4-7 (blocks 2-3, head)");
}

TEST(PipelineStrategyTest, ACheckpointLoadsAtAnotherMeshBitForBit) {
  // Train PP 2 x FSDP 2 for two steps, save; load at single, at PP 4, at
  // PP 2 x FSDP 2 and at PP 2 x HSDP 4, saving again after each: every
  // tensor equal to the bit.
  const std::string dir = test::ScratchDir("pipeline_ckpt");
  const torch::Tensor batches = test::MakeBatches(2, 16, kSeqLen, kVocab);
  const Case pp2_fsdp2{2, 2, PipelineSchedule::kOneFOneB, 2, 1, 0, {}, "fsdp"};
  RunRanks(4, [&](int64_t rank, Communicator& comm) {
    std::unique_ptr<Strategy> strategy = Maker(pp2_fsdp2)(rank, 4, &comm);
    ASSERT_TRUE(strategy->Setup(test::MakeModel(kSpec, 3)).ok());
    test::TrainResult result;
    test::TrainLoop loop = test::MakeLoop(0, 2, 1, kLr);
    loop.whole_steps = true;
    test::Train(*strategy, batches, rank, 4, loop, &result);
    std::filesystem::create_directories(dir + "/a");
    strategy->Barrier();
    ASSERT_TRUE(strategy->SaveCheckpoint(dir + "/a").ok());
  });
  // Each slice a rank holds, by name and offset into the flattened tensor.
  auto states = [](Strategy& s) {
    std::map<std::pair<std::string, int64_t>, torch::Tensor> out;
    for (const StateSlice& slice : s.StateSlices(/*to_save=*/false)) {
      out[{slice.name, slice.offset}] = slice.data.clone();
    }
    return out;
  };
  std::map<std::string, torch::Tensor> at_single;
  // Every slice `s` holds equals that part of the single-device state.
  auto expect_as_single = [&](Strategy& s) {
    for (const auto& [key, piece] : states(s)) {
      const auto& [name, offset] = key;
      ASSERT_TRUE(at_single.count(name)) << name;
      EXPECT_TRUE(torch::equal(
          piece.view(-1),
          at_single.at(name).view(-1).narrow(0, offset, piece.numel())))
          << name << " at " << offset;
    }
  };
  RunRanks(1, [&](int64_t, Communicator&) {
    std::unique_ptr<Strategy> single =
        test::FactoryMaker("single")(0, 1, nullptr);
    ASSERT_TRUE(single->Setup(test::MakeModel(kSpec, 99)).ok());
    ASSERT_TRUE(single->LoadCheckpoint(dir + "/a").ok());
    for (const auto& [key, tensor] : states(*single)) {
      at_single[key.first] = tensor;
    }
    EXPECT_EQ(single->optimizer_steps(), 2);
  });
  ASSERT_FALSE(at_single.empty());
  const Case pp4{4, 1, PipelineSchedule::kGpipe, 1};
  RunRanks(4, [&](int64_t rank, Communicator& comm) {
    std::unique_ptr<Strategy> strategy = Maker(pp4)(rank, 4, &comm);
    ASSERT_TRUE(strategy->Setup(test::MakeModel(kSpec, 99)).ok());
    ASSERT_TRUE(strategy->LoadCheckpoint(dir + "/a").ok());
    expect_as_single(*strategy);
    std::filesystem::create_directories(dir + "/b");
    strategy->Barrier();
    ASSERT_TRUE(strategy->SaveCheckpoint(dir + "/b").ok());
  });
  RunRanks(4, [&](int64_t rank, Communicator& comm) {
    std::unique_ptr<Strategy> strategy = Maker(pp2_fsdp2)(rank, 4, &comm);
    ASSERT_TRUE(strategy->Setup(test::MakeModel(kSpec, 98)).ok());
    ASSERT_TRUE(strategy->LoadCheckpoint(dir + "/b").ok());
    expect_as_single(*strategy);
    std::filesystem::create_directories(dir + "/c");
    strategy->Barrier();
    ASSERT_TRUE(strategy->SaveCheckpoint(dir + "/c").ok());
  });
  const Case pp2_hsdp4{2, 4, PipelineSchedule::kOneFOneB, 2, 1, 0, {}, "hsdp"};
  RunRanks(8, [&](int64_t rank, Communicator& comm) {
    std::unique_ptr<Strategy> strategy = Maker(pp2_hsdp4)(rank, 8, &comm);
    ASSERT_TRUE(strategy->Setup(test::MakeModel(kSpec, 97)).ok());
    ASSERT_TRUE(strategy->LoadCheckpoint(dir + "/c").ok());
    expect_as_single(*strategy);
    std::filesystem::create_directories(dir + "/d");
    strategy->Barrier();
    ASSERT_TRUE(strategy->SaveCheckpoint(dir + "/d").ok());
  });
  RunRanks(1, [&](int64_t, Communicator&) {
    std::unique_ptr<Strategy> single =
        test::FactoryMaker("single")(0, 1, nullptr);
    ASSERT_TRUE(single->Setup(test::MakeModel(kSpec, 5)).ok());
    ASSERT_TRUE(single->LoadCheckpoint(dir + "/d").ok());
    expect_as_single(*single);
  });
  std::filesystem::remove_all(dir);
}

}  // namespace pipeline_strategy_test
}  // namespace shardtrain
