// DdpStrategy against SingleDeviceStrategy, llm.c style: the same global
// batches through both must give the same losses, gradient norms and
// parameters within float rounding. Ranks are threads of this process joined
// by the in-process fake Communicator.
#include "worker/engine/strategy/ddp_strategy.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "core/checkpoint/checkpoint_format.h"
#include "core/model/model_config.h"
#include "tests/fakes/in_process_communicator.h"
#include "tests/worker/engine/strategy/strategy_harness.h"
#include "worker/engine/strategy/single_device_strategy.h"

namespace shardtrain {
namespace ddp_strategy_test {
namespace fs = std::filesystem;

// Small enough that a test runs in seconds on one core per rank. vocab_size
// 500 pads wte to 512 rows, so the padded (never used) rows are in play.
constexpr char kSpec[] =
    "custom:n_layer=2,n_head=2,n_embd=64,block_size=32,vocab_size=500";
constexpr int64_t kSeqLen = 32;
constexpr int64_t kVocab = 500;
constexpr int64_t kWorld = 2;
constexpr int64_t kLocalBatch = 2;
// AdamW moves every element by up to ~lr whatever its gradient's size, so an
// element whose true gradient is at rounding level (cancellation: measured
// 6.7e-9 single vs 5.4e-9 DDP on one weight whose largest gradient is 2e-2)
// takes a different step. The parameter tolerance is therefore in units of
// lr: 10 steps x lr x 1% = 1e-5 at this lr. (At lr 1e-3 the same run differs
// by 4e-5, the same 0.4% of the steps taken.)
constexpr double kLr = 1e-4;
constexpr double kMaxNorm = 1.0;
// Buckets of ~100 KiB split this model into several, exercising the bucket
// boundaries; the default 25 MiB puts it in one.
constexpr double kSmallBucketMb = 0.1;

// Float rounding differs between a mean over 2B rows and the mean of two
// means over B rows; nothing else may. Gradients are compared relative to the
// largest element of their parameter.
constexpr double kRelTol = 1e-5;
constexpr double kGradRelTol = 1e-5;
constexpr double kParamTol = 1e-5;

Gpt2 MakeModel(uint64_t seed) { return test::MakeModel(kSpec, seed); }

torch::Tensor MakeBatches(int64_t steps, int64_t rows) {
  return test::MakeBatches(steps, rows, kSeqLen, kVocab);
}

using test::Slice;

std::vector<torch::Tensor> Snapshot(Gpt2& model) {
  std::vector<torch::Tensor> params;
  for (const torch::Tensor& p : model->parameters()) {
    params.push_back(p.detach().clone());
  }
  return params;
}

double MaxAbsDiff(const std::vector<torch::Tensor>& a,
                  const std::vector<torch::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    diff = std::max(diff, (a[i] - b[i]).abs().max().item<double>());
  }
  return diff;
}

StrategyOptions RankOptions(int64_t rank) {
  StrategyOptions options;
  options.rank = rank;
  options.world_size = kWorld;
  return options;
}

test::TrainLoop Loop(int64_t first_step, int64_t last_step,
                     int64_t micro_steps = 1) {
  return test::MakeLoop(first_step, last_step, micro_steps, kLr, kMaxNorm);
}

// What a run gives beyond the harness's result: each parameter's gradient
// after the first step's backward (and all-reduce).
struct DdpRun {
  test::TrainResult result;
  std::vector<torch::Tensor> first_grads;
};

// Trains a model of seed 7 under `make` on `world` ranks (1: the single
// device reference).
std::vector<DdpRun> TrainRuns(
    const torch::Tensor& batches, int64_t world, const test::TrainLoop& loop,
    const std::function<std::unique_ptr<Strategy>(int64_t, Communicator*)>&
        make) {
  std::vector<DdpRun> runs(world);
  RunRanks(world, [&](int64_t rank, Communicator& comm) {
    torch::set_num_threads(1);
    Gpt2 model = MakeModel(/*seed=*/7);
    std::unique_ptr<Strategy> strategy = make(rank, &comm);
    ASSERT_TRUE(strategy->Setup(model).ok());
    strategy->TakeCommStats();
    test::TrainLoop mine = loop;
    mine.after_backward = [&](int64_t step) {
      if (step != loop.first_step) return;
      for (const torch::Tensor& p : model->parameters()) {
        runs[rank].first_grads.push_back(p.grad().clone());
      }
    };
    test::Train(*strategy, batches, rank, world, mine, &runs[rank].result);
    for (const auto& item : model->named_parameters()) {
      runs[rank].result.params[item.key()] = item.value().detach().clone();
    }
  });
  return runs;
}

DdpRun TrainSingle(const torch::Tensor& batches, int64_t steps) {
  return TrainRuns(batches, 1, Loop(0, steps), [](int64_t, Communicator*) {
    return std::make_unique<SingleDeviceStrategy>(StrategyOptions{});
  })[0];
}

std::vector<DdpRun> TrainDdp(const torch::Tensor& batches, int64_t steps,
                             int64_t micro_steps, double bucket_mb) {
  return TrainRuns(batches, kWorld, Loop(0, steps, micro_steps),
                   [&](int64_t rank, Communicator* comm) {
                     return std::make_unique<DdpStrategy>(RankOptions(rank),
                                                          comm, bucket_mb);
                   });
}

// The first step's gradients within kGradRelTol of single's (relative to
// each parameter's largest element); the rest of the run within the
// harness's tolerances.
void ExpectMatchesSingle(const DdpRun& single, const DdpRun& ddp) {
  ASSERT_EQ(single.first_grads.size(), ddp.first_grads.size());
  double grad_diff = 0;
  for (size_t i = 0; i < single.first_grads.size(); ++i) {
    const double scale = single.first_grads[i].abs().max().item<double>();
    const double diff = (ddp.first_grads[i] - single.first_grads[i])
                            .abs()
                            .max()
                            .item<double>() /
                        std::max(scale, 1e-12);
    EXPECT_LE(diff, kGradRelTol) << "gradient of parameter " << i;
    grad_diff = std::max(grad_diff, diff);
  }
  std::printf("first gradient maxdiff %.3g (rel)\n", grad_diff);
  test::ExpectSameTraining(single.result, ddp.result, {kRelTol, kParamTol},
                           "ddp vs single");
}

TEST(DdpStrategyTest, TwoRanksMatchSingleDeviceOnTheWholeBatch) {
  constexpr int64_t kSteps = 10;
  const torch::Tensor batches = MakeBatches(kSteps, kWorld * kLocalBatch);

  const DdpRun single = TrainSingle(batches, kSteps);
  const std::vector<DdpRun> ddp =
      TrainDdp(batches, kSteps, /*micro_steps=*/1, kSmallBucketMb);

  ExpectMatchesSingle(single, ddp[0]);
  // The replicas never drift apart: the same averaged gradient and the same
  // AdamW arithmetic on every rank.
  EXPECT_EQ(test::MaxAbsDiff(ddp[0].result.params, ddp[1].result.params), 0.0);
  EXPECT_EQ(ddp[0].result.losses, ddp[1].result.losses);
  EXPECT_EQ(ddp[0].result.norms, ddp[1].result.norms);
  // The bucket buffers are the gradients: DDP holds exactly what single does.
  EXPECT_EQ(ddp[0].result.state_bytes, single.result.state_bytes);
}

TEST(DdpStrategyTest, AccumulatedMicroStepsMatchOneLargeBatchAndSyncOnlyLast) {
  constexpr int64_t kSteps = 3;
  constexpr int64_t kMicroSteps = 4;
  const torch::Tensor batches =
      MakeBatches(kSteps, kWorld * kMicroSteps * kLocalBatch);

  const DdpRun single = TrainSingle(batches, kSteps);
  const std::vector<DdpRun> ddp =
      TrainDdp(batches, kSteps, kMicroSteps, /*bucket_mb=*/25);

  ExpectMatchesSingle(single, ddp[0]);
  int64_t grad_bytes = 0;
  for (const auto& [name, p] : single.result.params) grad_bytes += p.nbytes();
  for (const DdpRun& rank : ddp) {
    const std::vector<int64_t>& bytes = rank.result.micro_comm_bytes;
    ASSERT_EQ(bytes.size(), kSteps * kMicroSteps);
    for (size_t i = 0; i < bytes.size(); ++i) {
      const bool sync = (i + 1) % kMicroSteps == 0;
      EXPECT_EQ(bytes[i], sync ? grad_bytes : 0) << "micro-step " << i;
    }
  }
}

TEST(DdpStrategyTest, BucketsInReverseParameterOrderLaunchDuringBackward) {
  const torch::Tensor batches = MakeBatches(1, kWorld * kLocalBatch);
  std::vector<std::vector<std::vector<int64_t>>> layouts(kWorld);
  std::vector<DdpStrategy::OverlapTrace> traces(kWorld);
  int64_t num_params = 0;
  RunRanks(kWorld, [&](int64_t rank, Communicator& comm) {
    torch::set_num_threads(1);
    Gpt2 model = MakeModel(/*seed=*/7);
    DdpStrategy ddp(RankOptions(rank), &comm, kSmallBucketMb);
    ASSERT_TRUE(ddp.Setup(model).ok());
    auto [inputs, targets] = Slice(batches, 0, rank * kLocalBatch, kLocalBatch);
    ddp.ForwardBackward(inputs, targets, 1.0, /*sync=*/true);
    layouts[rank] = ddp.BucketParameterIndices();
    traces[rank] = ddp.last_overlap_trace();
    if (rank == 0) num_params = model->parameters().size();
  });

  const std::vector<std::vector<int64_t>>& layout = layouts[0];
  EXPECT_GE(layout.size(), 4u);
  std::vector<int64_t> order;
  for (const auto& bucket : layout) {
    order.insert(order.end(), bucket.begin(), bucket.end());
  }
  std::vector<int64_t> reversed(num_params);
  std::iota(reversed.rbegin(), reversed.rend(), 0);
  EXPECT_EQ(order, reversed);

  for (int64_t rank = 0; rank < kWorld; ++rank) {
    const DdpStrategy::OverlapTrace& trace = traces[rank];
    ASSERT_EQ(trace.bucket_launch.size(), layout.size());
    EXPECT_TRUE(
        std::is_sorted(trace.bucket_launch.begin(), trace.bucket_launch.end()));
    // Every bucket's gradients are produced inside backward, so every
    // all-reduce starts from a hook before backward returns.
    for (size_t b = 0; b < trace.bucket_launch.size(); ++b) {
      EXPECT_LT(trace.bucket_launch[b], trace.backward_end)
          << "rank " << rank << " bucket " << b;
    }
    const double lead_ms = std::chrono::duration<double, std::milli>(
                               trace.backward_end - trace.bucket_launch[0])
                               .count();
    std::printf(
        "rank %ld: %zu buckets, first launched %.2f ms before "
        "backward ended\n",
        static_cast<long>(rank), layout.size(), lead_ms);
  }
}

TEST(DdpStrategyTest, ParameterWithoutGradientDoesNotBlockTheReduce) {
  const torch::Tensor batches = MakeBatches(1, kWorld * kLocalBatch);
  std::vector<int64_t> wpe_bucket(kWorld, -1);
  std::vector<DdpStrategy::OverlapTrace> traces(kWorld);
  std::vector<double> wpe_grad(kWorld, -1);
  std::vector<double> wte_grad(kWorld, -1);
  RunRanks(kWorld, [&](int64_t rank, Communicator& comm) {
    torch::set_num_threads(1);
    Gpt2 model = MakeModel(/*seed=*/7);
    DdpStrategy ddp(RankOptions(rank), &comm, kSmallBucketMb);
    ASSERT_TRUE(ddp.Setup(model).ok());
    // Frozen: its gradient accumulator never runs, so its hook never fires.
    model->wpe()->weight.set_requires_grad(false);
    auto [inputs, targets] = Slice(batches, 0, rank * kLocalBatch, kLocalBatch);
    ddp.ForwardBackward(inputs, targets, 1.0, /*sync=*/true);
    const std::vector<std::vector<int64_t>> layout =
        ddp.BucketParameterIndices();
    for (size_t b = 0; b < layout.size(); ++b) {
      for (int64_t index : layout[b]) {
        if (index == 1) wpe_bucket[rank] = static_cast<int64_t>(b);  // wpe
      }
    }
    traces[rank] = ddp.last_overlap_trace();
    wpe_grad[rank] = model->wpe()->weight.grad().abs().max().item<double>();
    wte_grad[rank] = model->wte()->weight.grad().abs().max().item<double>();
  });

  for (int64_t rank = 0; rank < kWorld; ++rank) {
    ASSERT_GE(wpe_bucket[rank], 1) << "wpe should not share the first bucket";
    const DdpStrategy::OverlapTrace& trace = traces[rank];
    // Buckets before wpe's still overlap backward; wpe's is launched once
    // backward has returned.
    EXPECT_LT(trace.bucket_launch[0], trace.backward_end);
    EXPECT_GE(trace.bucket_launch[wpe_bucket[rank]], trace.backward_end);
    EXPECT_EQ(wpe_grad[rank], 0.0);
    EXPECT_GT(wte_grad[rank], 0.0);
  }
}

TEST(DdpStrategyTest, SetupBroadcastsRankZeroWeights) {
  const std::vector<torch::Tensor> rank0_init = [] {
    Gpt2 model = MakeModel(/*seed=*/100);
    return Snapshot(model);
  }();
  std::vector<double> diff_before(kWorld);
  std::vector<double> diff_after(kWorld);
  RunRanks(kWorld, [&](int64_t rank, Communicator& comm) {
    torch::set_num_threads(1);
    Gpt2 model = MakeModel(/*seed=*/100 + rank);
    diff_before[rank] = MaxAbsDiff(Snapshot(model), rank0_init);
    DdpStrategy ddp(RankOptions(rank), &comm, kSmallBucketMb);
    ASSERT_TRUE(ddp.Setup(model).ok());
    diff_after[rank] = MaxAbsDiff(Snapshot(model), rank0_init);
  });
  EXPECT_GT(diff_before[1], 0.0);
  EXPECT_EQ(diff_after[0], 0.0);
  EXPECT_EQ(diff_after[1], 0.0);
}

// The resume itself is strategy_contract_test's; here: a checkpoint is
// written by every rank at once, each an even share of every (replicated)
// tensor and no byte twice, while only rank 0 exports.
TEST(DdpStrategyTest,
     EveryRankWritesAnEvenShareOfTheCheckpointOnlyRankZeroExports) {
  const torch::Tensor batches = MakeBatches(1, kWorld * kLocalBatch);
  const fs::path dir = fs::path(::testing::TempDir()) / "ddp_checkpoint_test";
  fs::remove_all(dir);
  fs::create_directories(dir / "checkpoint");
  for (int64_t rank = 0; rank < kWorld; ++rank) {
    fs::create_directories(dir / ("rank" + std::to_string(rank)));
  }
  RunRanks(kWorld, [&](int64_t rank, Communicator& comm) {
    torch::set_num_threads(1);
    const std::string own_dir =
        (dir / ("rank" + std::to_string(rank))).string();
    DdpStrategy ddp(RankOptions(rank), &comm, kSmallBucketMb);
    ASSERT_TRUE(ddp.Setup(MakeModel(/*seed=*/7)).ok());
    test::TrainResult ignored;
    test::Train(ddp, batches, rank, kWorld, Loop(0, 1), &ignored);
    ASSERT_TRUE(ddp.SaveCheckpoint((dir / "checkpoint").string()).ok());
    ASSERT_TRUE(ddp.ExportModel(own_dir + "/model.bin").ok());
    ddp.Barrier();
  });
  absl::StatusOr<std::unique_ptr<CheckpointReader>> reader =
      CheckpointReader::Open((dir / "checkpoint").string());
  ASSERT_TRUE(reader.ok()) << reader.status();
  const CheckpointMetadata& metadata = (*reader)->metadata();
  EXPECT_EQ(metadata.files.size(), static_cast<size_t>(kWorld));
  for (const TensorEntry& tensor : metadata.tensors) {
    ASSERT_EQ(tensor.chunks.size(), static_cast<size_t>(kWorld)) << tensor.name;
    EXPECT_LE(std::abs(tensor.chunks[0].numel - tensor.chunks[1].numel), 1)
        << tensor.name;
  }
  const std::map<std::string, int64_t> bytes = metadata.BytesPerFile();
  EXPECT_EQ(bytes.at("rank-00000.bin") + bytes.at("rank-00001.bin"),
            metadata.TotalBytes());
  EXPECT_LE(std::abs(bytes.at("rank-00000.bin") - bytes.at("rank-00001.bin")),
            static_cast<int64_t>(4 * metadata.tensors.size()));
  EXPECT_TRUE(fs::exists(dir / "rank0" / "model.bin"));
  EXPECT_TRUE(fs::is_empty(dir / "rank1")) << "only rank 0 exports";
  fs::remove_all(dir);
}

}  // namespace ddp_strategy_test
}  // namespace shardtrain
