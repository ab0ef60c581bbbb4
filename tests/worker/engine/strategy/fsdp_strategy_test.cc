// What FSDP promises beyond the contract every distributed strategy keeps
// (strategy_contract_test: single-device numbers at world 2 and 3,
// accumulation, resume): the chunked vocabulary-parallel head and no_sync
// still give single-device numbers, sharded memory, resharding, prefetch
// order, sharded checkpoints and export. Ranks are threads of this process
// joined by the in-process fake Communicator.
#include "worker/engine/strategy/fsdp_strategy.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "core/checkpoint/checkpoint_format.h"
#include "core/model/model_config.h"
#include "nlohmann/json.hpp"
#include "tests/fakes/in_process_communicator.h"
#include "tests/worker/engine/strategy/strategy_harness.h"
#include "worker/engine/model/llmc_checkpoint.h"
#include "worker/engine/strategy/single_device_strategy.h"
#include "worker/engine/support/memory_tracker.h"

namespace shardtrain {
namespace fsdp_strategy_test {
namespace fs = std::filesystem;

// Small enough that a test runs in seconds on one core per rank. vocab_size
// 1000 pads wte to 1024 rows. Unit sizes: wte 1024 rows of 64, block 49,984
// elements, neither divisible by 3 (world 3 takes the padding paths).
constexpr char kSpec[] =
    "custom:n_layer=2,n_head=2,n_embd=64,block_size=64,vocab_size=1000";
// Four blocks, for memory and prefetch order over more than two units.
constexpr char kDeepSpec[] =
    "custom:n_layer=4,n_head=2,n_embd=64,block_size=64,vocab_size=1000";
constexpr int64_t kVocab = 1000;
constexpr int64_t kSeqLen = 32;
constexpr int64_t kLocalBatch = 2;
constexpr double kLr = 3e-4;
constexpr double kMaxNorm = 1.0;
constexpr uint64_t kSeed = 7;

// Float rounding differs between a mean over W*B rows and the mean of W
// means over B rows (and in how the norm's sum of squares is ordered);
// nothing else may. AdamW magnifies that rounding on elements whose gradient
// is ~0 (the key bias's is 0 in exact arithmetic: both runs step it by noise,
// up to lr * |g| / eps): after 10 steps the worst element differs by ~3e-6 at
// kLr = 3e-4, by ~1e-5 at 1e-3. Which elements, and by how much, depends on
// the BLAS kernels' rounding: at kLr the worst over world sizes 2 and 3 is
// 7.4e-6 with OpenBLAS's SSE3 kernels and 1.14e-5 with its AVX-512 ones, so
// parameters are held to 1.5e-5; losses, norms and eval losses, where no
// such amplification happens, stay at 1e-5 relative (measured: <= 4e-7).
constexpr double kRelTol = 1e-5;
constexpr double kParamTol = 1.5e-5;

constexpr test::Tolerance kTolerance{kRelTol, kParamTol};

Gpt2 MakeModel(const std::string& spec, uint64_t seed = kSeed) {
  return test::MakeModel(spec, seed);
}

torch::Tensor MakeBatches(int64_t steps, int64_t rows) {
  return test::MakeBatches(steps, rows, kSeqLen, kVocab);
}

using test::MaxAbsDiff;
using test::ParamMap;
using test::Slice;
using test::TrainResult;
using ::testing::ElementsAre;

test::TrainLoop Loop(int64_t first_step, int64_t last_step,
                     int64_t micro_steps = 1) {
  return test::MakeLoop(first_step, last_step, micro_steps, kLr, kMaxNorm);
}

// Trains `strategy` on global batches [first_step, last_step) (the harness's
// loop at this file's learning rate).
void Train(Strategy& strategy, const torch::Tensor& batches, int64_t rank,
           int64_t world, int64_t micro_steps, int64_t first_step,
           int64_t last_step, TrainResult* result) {
  test::Train(strategy, batches, rank, world,
              Loop(first_step, last_step, micro_steps), result);
}

TrainResult TrainSingle(const std::string& spec, const torch::Tensor& batches,
                        int64_t steps) {
  return test::TrainSingle(spec, kSeed, batches, Loop(0, steps));
}

StrategyOptions RankOptions(int64_t rank, int64_t world) {
  StrategyOptions options;
  options.rank = rank;
  options.world_size = world;
  return options;
}

ParamMap Consolidate(FsdpStrategy& fsdp) {
  absl::StatusOr<NamedTensors> full = fsdp.GatherFullParameters();
  EXPECT_TRUE(full.ok()) << full.status();
  ParamMap params;
  if (full.ok()) {
    for (const auto& [name, tensor] : *full) params[name] = tensor.clone();
  }
  return params;
}

// Rank 0's view of an FSDP run of `steps` steps at world size `world`;
// `bytes_sent`, when given, receives what rank 0 sent in its micro-steps.
TrainResult TrainFsdp(const std::string& spec, const torch::Tensor& batches,
                      int64_t steps, int64_t world, int64_t micro_steps = 1,
                      FsdpOptions fsdp_options = {},
                      int64_t* bytes_sent = nullptr) {
  std::vector<TrainResult> ranks = test::TrainRanks(
      spec, kSeed, batches, world, Loop(0, steps, micro_steps),
      [&](int64_t rank, int64_t world_size, Communicator* comm) {
        return std::make_unique<FsdpStrategy>(RankOptions(rank, world_size),
                                              comm, fsdp_options);
      });
  if (bytes_sent != nullptr) {
    *bytes_sent = 0;
    for (int64_t bytes : ranks[0].micro_comm_bytes) *bytes_sent += bytes;
  }
  return ranks[0];
}

void ExpectSameTraining(const TrainResult& expected, const TrainResult& actual,
                        const std::string& what) {
  test::ExpectSameTraining(expected, actual, kTolerance, what);
}

// FSDP at world sizes 2 and 3 against single-device on the whole batch;
// `chunk_rows` > 0 cuts the vocabulary-parallel head into chunks of that
// many rows.
void ExpectFsdpMatchesSingle(int64_t steps, int64_t chunk_rows,
                             const std::string& what) {
  for (const int64_t world : {2, 3}) {
    SCOPED_TRACE(world);
    const torch::Tensor batches = MakeBatches(steps, world * kLocalBatch);
    const TrainResult single = TrainSingle(kSpec, batches, steps);
    FsdpOptions options;
    // wte's 1024 rows pad to 1026 at world 3; a rank owns 1026 / world.
    if (chunk_rows > 0)
      options.head_chunk_bytes = chunk_rows * (1026 / world) * 4;
    const TrainResult fsdp =
        TrainFsdp(kSpec, batches, steps, world, 1, options);
    ExpectSameTraining(single, fsdp, what + "world " + std::to_string(world));
  }
}

// The vocabulary-parallel head in many chunks of 5 rows, the last one short,
// while ranks score different numbers of rows (the last rank's shard ends in
// padding): still the single-device run.
TEST(FsdpStrategyTest, ChunkedVocabParallelHeadMatchesSingleDevice) {
  ExpectFsdpMatchesSingle(/*steps=*/4, /*chunk_rows=*/5, "chunked head, ");
}

// no_sync: the accumulation micro-steps keep full gradients instead of
// reduce-scattering them. Same training (within rounding: the sum over
// micro-steps happens before the reduction instead of after), fewer bytes sent.
TEST(FsdpStrategyTest, NoSyncAccumulationMatchesAndSendsLess) {
  constexpr int64_t kSteps = 3;
  constexpr int64_t kWorld = 2;
  constexpr int64_t kMicroSteps = 4;
  const torch::Tensor batches =
      MakeBatches(kSteps, kWorld * kMicroSteps * kLocalBatch);
  int64_t bytes[2] = {0, 0};
  TrainResult results[2];
  for (const bool no_sync : {false, true}) {
    FsdpOptions options;
    options.no_sync = no_sync;
    results[no_sync] = TrainFsdp(kSpec, batches, kSteps, kWorld, kMicroSteps,
                                 options, &bytes[no_sync]);
  }
  ExpectSameTraining(results[0], results[1],
                     "no_sync vs reduce every micro-step");
  // Three of every four reduce-scatters of the blocks and root are skipped.
  EXPECT_LT(bytes[1], bytes[0]);
  std::printf(
      "bytes sent by rank 0: %.2f MiB reducing every micro-step, "
      "%.2f MiB with no_sync\n",
      bytes[0] / 1048576.0, bytes[1] / 1048576.0);
}

TEST(FsdpStrategyTest, EachRankHoldsAboutOneNthOfTheModelState) {
  MemoryTracker& tracker = MemoryTracker::Get();  // before any model
  const ModelConfig config = *ParseModelSpec("gpt2-mini");
  // A replica's fp32 params + grads + exp_avg + exp_avg_sq: what single and
  // DDP hold on every rank.
  const int64_t replica_bytes = 4 * 4 * config.NumParameters();
  for (const int64_t world : {2, 4}) {
    SCOPED_TRACE(world);
    const int64_t before = tracker.Snapshot(torch::kCPU).allocated_bytes;
    std::vector<int64_t> state(world);
    int64_t largest_unit = 0;
    int64_t after_setup = 0;
    RunRanks(world, [&](int64_t rank, Communicator& comm) {
      torch::set_num_threads(1);
      Gpt2 model = MakeModel("gpt2-mini");
      FsdpStrategy fsdp(RankOptions(rank, world), &comm);
      ASSERT_TRUE(fsdp.Setup(model).ok());
      state[rank] = fsdp.ModelStateBytes();
      if (rank == 0) largest_unit = fsdp.LargestUnitBytes();
      ASSERT_TRUE(comm.Barrier().ok());
      if (rank == 0) {
        after_setup = tracker.Snapshot(torch::kCPU).allocated_bytes;
      }
      ASSERT_TRUE(comm.Barrier().ok());
      // Every rank's model tensors are now empty: the shards are the weights.
      for (const torch::Tensor& p : model->parameters()) {
        EXPECT_EQ(p.numel(), 0);
      }
    });
    int64_t total_state = 0;
    for (int64_t r = 0; r < world; ++r) {
      const double bound = 1.10 * static_cast<double>(replica_bytes) / world +
                           static_cast<double>(largest_unit);
      EXPECT_LE(static_cast<double>(state[r]), bound) << "rank " << r;
      total_state += state[r];
    }
    // Exact tensor bytes: after Setup the N ranks hold their shard state and
    // nothing else (the full parameters really are freed), give or take the
    // fake communicator's 4-byte barrier tensors.
    EXPECT_NEAR(static_cast<double>(after_setup - before),
                static_cast<double>(total_state), 1024.0);
    std::printf(
        "world %ld: per-rank model state %.1f MiB = %.3f x (replica %.1f MiB "
        "/ %ld); all ranks' live tensors after Setup %.1f MiB; largest unit "
        "%.1f MiB\n",
        static_cast<long>(world), state[0] / 1048576.0,
        state[0] / (static_cast<double>(replica_bytes) / world),
        replica_bytes / 1048576.0, static_cast<long>(world),
        (after_setup - before) / 1048576.0, largest_unit / 1048576.0);
  }
}

struct MemoryTrace {
  std::vector<FsdpEvent> events;
  std::vector<int64_t> allocated;  // live tensor bytes at each event
  int64_t after_setup = 0;
  int64_t after_step = 0;
  int64_t peak = 0;  // during the step
  std::vector<int64_t> unit_bytes;
};

// One ForwardBackward at world 1 (a single thread, so the process-wide
// tracking allocator sees this rank alone), with the tracker read at every
// event.
MemoryTrace TraceOneStep(const FsdpOptions& fsdp_options) {
  MemoryTracker& tracker = MemoryTracker::Get();
  const torch::Tensor batches = MakeBatches(1, kLocalBatch);
  MemoryTrace trace;
  RunRanks(1, [&](int64_t rank, Communicator& comm) {
    torch::set_num_threads(1);
    const auto allocated = [&] {
      return tracker.Snapshot(torch::kCPU).allocated_bytes;
    };
    Gpt2 model = MakeModel(kDeepSpec);
    FsdpStrategy fsdp(RankOptions(rank, 1), &comm, fsdp_options);
    ASSERT_TRUE(fsdp.Setup(model).ok());
    for (int64_t u = 0; u < fsdp.num_units(); ++u) {
      trace.unit_bytes.push_back(fsdp.UnitBytes(u));
    }
    auto [inputs, targets] = Slice(batches, 0, 0, kLocalBatch);
    ASSERT_TRUE(comm.Barrier().ok());
    trace.after_setup = allocated();
    fsdp.set_observer([&](const FsdpEvent& event) {
      trace.events.push_back(event);
      trace.allocated.push_back(allocated());
    });
    tracker.ResetPeak(torch::kCPU);
    fsdp.ForwardBackward(inputs, targets, 1.0, /*sync=*/true);
    trace.peak = tracker.Snapshot(torch::kCPU).peak_bytes;
    ASSERT_TRUE(comm.Barrier().ok());  // drops the fake's last buffers
    trace.after_step = allocated();
  });
  return trace;
}

TEST(FsdpStrategyTest, ReshardingFreesEachBlockRightAfterItsForward) {
  const MemoryTrace resharded = TraceOneStep(FsdpOptions{});
  const MemoryTrace kept = TraceOneStep(FsdpOptions{false, true});
  ASSERT_FALSE(resharded.events.empty());

  // In forward (before the first pre-backward hook), each block but the last
  // is resharded right after its compute_end, which frees exactly its full
  // flat buffer.
  int64_t freed_in_forward = 0;
  for (size_t i = 1; i < resharded.events.size(); ++i) {
    const FsdpEvent& event = resharded.events[i];
    if (event.kind == FsdpEvent::Kind::kBackwardBegin) break;
    if (event.kind != FsdpEvent::Kind::kReshard) continue;
    ASSERT_EQ(resharded.events[i - 1].kind, FsdpEvent::Kind::kComputeEnd);
    EXPECT_EQ(resharded.allocated[i - 1] - resharded.allocated[i],
              resharded.unit_bytes[event.unit])
        << "unit " << event.unit;
    ++freed_in_forward;
  }
  EXPECT_EQ(freed_in_forward, 3);
  for (const FsdpEvent& event : kept.events) {
    if (event.kind == FsdpEvent::Kind::kBackwardBegin) break;
    EXPECT_NE(event.kind, FsdpEvent::Kind::kReshard) << event.ToString();
  }
  // After the step no full parameters or gradients are left: only the
  // shards (and small things: the loss, the model's causal mask).
  for (const MemoryTrace* trace : {&resharded, &kept}) {
    EXPECT_LT(trace->after_step - trace->after_setup, trace->unit_bytes[1] / 4);
  }
  // Keeping the blocks gathered until backward costs memory at the peak.
  EXPECT_GE(kept.peak - resharded.peak, resharded.unit_bytes[1]);
  std::printf(
      "peak during the step above the shards: %.2f MiB resharded, %.2f MiB "
      "kept (block %.2f MiB, root %.2f MiB)\n",
      (resharded.peak - resharded.after_setup) / 1048576.0,
      (kept.peak - kept.after_setup) / 1048576.0,
      resharded.unit_bytes[1] / 1048576.0, resharded.unit_bytes[0] / 1048576.0);
}

TEST(FsdpStrategyTest, KeepingParametersUntilBackwardGivesTheSameNumbers) {
  constexpr int64_t kSteps = 5;
  constexpr int64_t kWorld = 2;
  const torch::Tensor batches = MakeBatches(kSteps, kWorld * kLocalBatch);
  const TrainResult resharded = TrainFsdp(kSpec, batches, kSteps, kWorld);
  const TrainResult kept =
      TrainFsdp(kSpec, batches, kSteps, kWorld, 1, FsdpOptions{false, true});
  // The same arithmetic on the same data: bit for bit.
  EXPECT_EQ(kept.losses, resharded.losses);
  EXPECT_EQ(kept.norms, resharded.norms);
  EXPECT_EQ(MaxAbsDiff(kept.params, resharded.params), 0.0);
  std::printf("OK, maxdiff params %.3g over %ld steps\n",
              MaxAbsDiff(kept.params, resharded.params),
              static_cast<long>(kSteps));
}

std::vector<FsdpEvent> TraceEvents(const FsdpOptions& fsdp_options) {
  constexpr int64_t kWorld = 2;
  const torch::Tensor batches = MakeBatches(1, kWorld * kLocalBatch);
  std::vector<FsdpEvent> events;
  RunRanks(kWorld, [&](int64_t rank, Communicator& comm) {
    torch::set_num_threads(1);
    Gpt2 model = MakeModel(kDeepSpec);
    FsdpStrategy fsdp(RankOptions(rank, kWorld), &comm, fsdp_options);
    ASSERT_TRUE(fsdp.Setup(model).ok());
    if (rank == 0) {
      fsdp.set_observer(
          [&](const FsdpEvent& event) { events.push_back(event); });
    }
    auto [inputs, targets] = Slice(batches, 0, rank * kLocalBatch, kLocalBatch);
    fsdp.ForwardBackward(inputs, targets, 1.0, /*sync=*/true);
  });
  return events;
}

// Position of the n-th (0-based) event of `kind` for `unit`; -1 if none.
int64_t Find(const std::vector<FsdpEvent>& events, FsdpEvent::Kind kind,
             int64_t unit, int n = 0) {
  for (size_t i = 0; i < events.size(); ++i) {
    if (events[i].kind == kind && events[i].unit == unit && n-- == 0) {
      return static_cast<int64_t>(i);
    }
  }
  return -1;
}

TEST(FsdpStrategyTest,
     PrefetchLaunchesTheNextGatherBeforeTheCurrentComputeEnds) {
  using Kind = FsdpEvent::Kind;
  constexpr int64_t kLastBlock = 4;  // units 1..4 are the blocks
  const std::vector<FsdpEvent> events = TraceEvents(FsdpOptions{});
  std::string line;
  for (const FsdpEvent& event : events) line += event.ToString() + ", ";
  std::printf("trace: %s\n", line.c_str());

  // Forward: block u+1's all-gather is in flight while block u computes.
  for (int64_t u = 1; u < kLastBlock; ++u) {
    const int64_t launch = Find(events, Kind::kGatherLaunch, u + 1);
    ASSERT_GE(launch, 0);
    EXPECT_LT(launch, Find(events, Kind::kComputeBegin, u)) << "unit " << u;
    EXPECT_GT(launch, Find(events, Kind::kGatherDone, u)) << "unit " << u;
  }
  // Backward: the last block, still gathered from forward, is not gathered
  // again; block u-1's all-gather is launched before block u's gradient is
  // ready.
  EXPECT_EQ(Find(events, Kind::kReshard, kLastBlock),
            Find(events, Kind::kGradReady, kLastBlock) + 1);
  EXPECT_EQ(Find(events, Kind::kGatherLaunch, kLastBlock, 1), -1);
  for (int64_t u = kLastBlock; u > 1; --u) {
    const int64_t launch = Find(events, Kind::kGatherLaunch, u - 1, 1);
    ASSERT_GE(launch, 0) << "unit " << u - 1;
    EXPECT_GT(launch, Find(events, Kind::kBackwardBegin, u)) << "unit " << u;
    EXPECT_LT(launch, Find(events, Kind::kGradReady, u)) << "unit " << u;
  }
  // Every unit's gradient is reduced exactly once, the root's last.
  for (int64_t u = 0; u <= kLastBlock; ++u) {
    EXPECT_GE(Find(events, Kind::kGradReady, u), 0) << "unit " << u;
    EXPECT_EQ(Find(events, Kind::kGradReady, u, 1), -1) << "unit " << u;
  }
  EXPECT_EQ(events.back().kind, Kind::kReshard);
  EXPECT_EQ(events.back().unit, 0);

  // Without prefetch each all-gather waits for the previous compute.
  const std::vector<FsdpEvent> serial = TraceEvents(FsdpOptions{true, false});
  for (int64_t u = 1; u < kLastBlock; ++u) {
    EXPECT_GT(Find(serial, Kind::kGatherLaunch, u + 1),
              Find(serial, Kind::kComputeEnd, u))
        << "unit " << u;
  }
}

// Fresh ranks at `world` (other weights) load checkpoint `dir` and, when
// `save_to` is set, save it again there; each rank's load status.
std::vector<absl::Status> LoadOnFreshRanks(const fs::path& dir, int64_t world,
                                           const fs::path& save_to = {}) {
  std::vector<absl::Status> statuses(world);
  RunRanks(world, [&](int64_t rank, Communicator& comm) {
    torch::set_num_threads(1);
    Gpt2 model = MakeModel(kSpec, /*seed=*/99);
    FsdpStrategy fsdp(RankOptions(rank, world), &comm);
    ASSERT_TRUE(fsdp.Setup(model).ok());
    statuses[rank] = fsdp.LoadCheckpoint(dir.string());
    if (!save_to.empty()) {
      ASSERT_TRUE(fsdp.SaveCheckpoint(save_to.string()).ok());
    }
  });
  return statuses;
}

// Every tensor of checkpoint `a` equals (bit for bit) the same tensor of `b`.
void ExpectSameTensors(const fs::path& a, const fs::path& b) {
  auto left = CheckpointReader::Open(a.string());
  auto right = CheckpointReader::Open(b.string());
  ASSERT_TRUE(left.ok()) << left.status();
  ASSERT_TRUE(right.ok()) << right.status();
  const auto& tensors = (*left)->metadata().tensors;
  ASSERT_EQ(tensors.size(), (*right)->metadata().tensors.size());
  for (const TensorEntry& t : tensors) {
    std::vector<float> x(t.numel()), y(t.numel());
    ASSERT_TRUE((*left)->Read(t.name, 0, t.numel(), x.data()).ok());
    ASSERT_TRUE((*right)->Read(t.name, 0, t.numel(), y.data()).ok()) << t.name;
    EXPECT_EQ(x, y) << t.name;
  }
}

TEST(FsdpStrategyTest, ShardedCheckpointResumesExactlyAndLoadsAtAnyWorldSize) {
  constexpr int64_t kSteps = 6;
  constexpr int64_t kSaveAt = 3;
  constexpr int64_t kWorld = 2;
  const torch::Tensor batches = MakeBatches(kSteps, kWorld * kLocalBatch);
  const fs::path root = fs::path(::testing::TempDir()) /
                        ("fsdp_checkpoint_test_" + std::to_string(::getpid()));
  const fs::path dir = root / "world2";
  fs::remove_all(root);
  fs::create_directories(dir);

  const TrainResult uninterrupted = TrainFsdp(kSpec, batches, kSteps, kWorld);

  TrainResult resumed;
  RunRanks(kWorld, [&](int64_t rank, Communicator& comm) {
    torch::set_num_threads(1);
    {
      Gpt2 model = MakeModel(kSpec);
      FsdpStrategy fsdp(RankOptions(rank, kWorld), &comm);
      ASSERT_TRUE(fsdp.Setup(model).ok());
      TrainResult first;
      Train(fsdp, batches, rank, kWorld, 1, 0, kSaveAt, &first);
      ASSERT_TRUE(fsdp.SaveCheckpoint(dir.string()).ok());
      fsdp.Barrier();
    }
    // Fresh shards from other weights: everything comes from the files.
    Gpt2 model = MakeModel(kSpec, /*seed=*/99);
    FsdpStrategy fsdp(RankOptions(rank, kWorld), &comm);
    ASSERT_TRUE(fsdp.Setup(model).ok());
    const absl::Status loaded = fsdp.LoadCheckpoint(dir.string());
    ASSERT_TRUE(loaded.ok()) << loaded;
    TrainResult mine;
    Train(fsdp, batches, rank, kWorld, 1, kSaveAt, kSteps, &mine);
    mine.params = Consolidate(fsdp);
    if (rank == 0) resumed = std::move(mine);
  });

  // Each rank wrote its shard: wte by whole rows (1024 rows of 64 split in
  // two), padding never.
  auto reader = CheckpointReader::Open(dir.string());
  ASSERT_TRUE(reader.ok()) << reader.status();
  const CheckpointMetadata& metadata = (*reader)->metadata();
  ASSERT_EQ(metadata.files.size(), 2u);
  EXPECT_EQ(metadata.files[1].name, "rank-00001.bin");
  const TensorEntry* wte = metadata.Find("model.wte.weight");
  ASSERT_NE(wte, nullptr);
  ASSERT_EQ(wte->chunks.size(), 2u);
  EXPECT_EQ(wte->chunks[0].numel, 512 * 64);
  EXPECT_EQ(wte->chunks[1].file, "rank-00001.bin");
  ASSERT_NE(metadata.Find("optim.exp_avg_sq.h.1.mlp.c_proj.bias"), nullptr);
  EXPECT_EQ(metadata.training["optimizer_steps"], kSaveAt);
  const std::map<std::string, int64_t> bytes = metadata.BytesPerFile();
  EXPECT_EQ(bytes.at("rank-00000.bin") + bytes.at("rank-00001.bin"),
            metadata.TotalBytes());

  const std::vector<double> tail(uninterrupted.losses.begin() + kSaveAt,
                                 uninterrupted.losses.end());
  EXPECT_EQ(resumed.losses, tail);
  const double diff = MaxAbsDiff(resumed.params, uninterrupted.params);
  EXPECT_EQ(diff, 0.0);
  std::printf("OK, resumed vs uninterrupted maxdiff %.3g\n", diff);

  // At world 3 (other shard boundaries, other padding) and world 1 every
  // rank reads exactly its ranges: saved again, each checkpoint holds the
  // same tensors, bit for bit.
  for (int64_t world : {3, 1}) {
    const fs::path again = root / ("world" + std::to_string(world));
    fs::create_directories(again);
    for (const absl::Status& status : LoadOnFreshRanks(dir, world, again)) {
      EXPECT_TRUE(status.ok()) << status;
    }
    ExpectSameTensors(dir, again);
  }

  // The per-rank format of earlier versions is refused by name.
  const fs::path old = root / "old";
  fs::create_directories(old);
  std::ofstream(old / "fsdp_index.json") << "{}";
  for (const absl::Status& status : LoadOnFreshRanks(old, kWorld)) {
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
    EXPECT_NE(status.message().find("FSDP shard format"), std::string::npos)
        << status;
  }
  fs::remove_all(root);
}

TEST(FsdpStrategyTest, ExportWritesTheConsolidatedModel) {
  constexpr int64_t kWorld = 3;
  const torch::Tensor batches = MakeBatches(2, kWorld * kLocalBatch);
  const std::string path =
      (fs::path(::testing::TempDir()) /
       ("fsdp_export_test_" + std::to_string(::getpid()) + ".bin"))
          .string();
  ParamMap consolidated;
  RunRanks(kWorld, [&](int64_t rank, Communicator& comm) {
    torch::set_num_threads(1);
    Gpt2 model = MakeModel(kSpec);
    FsdpStrategy fsdp(RankOptions(rank, kWorld), &comm);
    ASSERT_TRUE(fsdp.Setup(model).ok());
    TrainResult ignored;
    Train(fsdp, batches, rank, kWorld, 1, 0, 2, &ignored);
    ASSERT_TRUE(fsdp.ExportModel(path).ok());
    ParamMap mine = Consolidate(fsdp);
    if (rank == 0) consolidated = std::move(mine);
    // Training goes on after an export.
    auto [inputs, targets] = Slice(batches, 0, rank * kLocalBatch, kLocalBatch);
    EXPECT_TRUE(std::isfinite(
        fsdp.ForwardBackward(inputs, targets, 1.0, true).item<double>()));
  });
  Gpt2 loaded = MakeModel(kSpec, /*seed=*/99);
  ASSERT_TRUE(LoadLlmcCheckpoint(path, loaded).ok());
  ParamMap from_file;
  for (const auto& item : loaded->named_parameters()) {
    from_file[item.key()] = item.value().detach();
  }
  EXPECT_EQ(MaxAbsDiff(from_file, consolidated), 0.0);
  fs::remove(path);
}

TEST(FsdpStrategyTest, LostPeerMakesTheStepFailNamingTheCollective) {
  InProcessGroup group(2, std::chrono::milliseconds(300));
  std::unique_ptr<Communicator> comm = group.ForRank(0);
  std::thread peer([&] {
    torch::set_num_threads(1);
    std::unique_ptr<Communicator> peer_comm = group.ForRank(1);
    Gpt2 model = MakeModel(kSpec);
    FsdpStrategy fsdp(RankOptions(1, 2), peer_comm.get());
    ASSERT_TRUE(fsdp.Setup(model).ok());
    // ... and then the peer is gone.
  });
  torch::set_num_threads(1);
  Gpt2 model = MakeModel(kSpec);
  // No prefetch: the fake's group is unusable after one timed-out
  // collective, so the step must fail at the first one.
  FsdpStrategy fsdp(RankOptions(0, 2), comm.get(), FsdpOptions{true, false});
  ASSERT_TRUE(fsdp.Setup(model).ok());
  peer.join();
  const int64_t state_bytes = fsdp.ModelStateBytes();

  const torch::Tensor batches = MakeBatches(1, kLocalBatch);
  auto [inputs, targets] = Slice(batches, 0, 0, kLocalBatch);
  std::string error;
  try {
    fsdp.ForwardBackward(inputs, targets, 1.0, /*sync=*/true);
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  EXPECT_NE(error.find("FSDP unit root: all-gather"), std::string::npos)
      << error;
  EXPECT_NE(error.find("timed out"), std::string::npos) << error;
  EXPECT_EQ(fsdp.ModelStateBytes(), state_bytes);
}

}  // namespace fsdp_strategy_test
}  // namespace shardtrain
