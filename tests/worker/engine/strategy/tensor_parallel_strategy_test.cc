// TensorParallelStrategy against SingleDeviceStrategy: every block's heads and
// MLP units split over T ranks (threads joined by the in-process
// Communicator), Megatron's f and g all-reducing between them, must train as
// one device does on the same batches; its checkpoints hold global tensors.
#include "worker/engine/strategy/tensor_parallel_strategy.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/model/model_config.h"
#include "tests/fakes/in_process_communicator.h"
#include "tests/test_util.h"
#include "tests/worker/engine/strategy/strategy_harness.h"

namespace shardtrain {
namespace tensor_parallel_strategy_test {

// Four heads, so four ranks can each run one; 4C = 256 MLP units.
constexpr char kSpec[] =
    "custom:n_layer=2,n_head=4,n_embd=64,block_size=32,vocab_size=500";
constexpr int64_t kSeqLen = 32;
constexpr int64_t kVocab = 500;
constexpr int64_t kSteps = 6;
constexpr double kLr = 1e-4;  // as pipeline_strategy_test: weights in lr units

// T tensor-parallel ranks per replica (T = world unless given); with
// `sharded`, FSDP over the replicas, or HSDP within groups of `group`.
test::StrategyMaker Tp(int64_t tensor_parallel = 0, bool sharded = false,
                       int64_t group = 0) {
  return [=](int64_t rank, int64_t world,
             Communicator* comm) -> std::unique_ptr<Strategy> {
    StrategyOptions options;
    options.rank = rank;
    options.world_size = world;
    return std::make_unique<TensorParallelStrategy>(
        options, comm, tensor_parallel > 0 ? tensor_parallel : world, sharded,
        /*bucket_mb=*/25, group);
  };
}

std::unique_ptr<Strategy> MakeTp(int64_t rank, int64_t world,
                                 Communicator* comm) {
  return Tp()(rank, world, comm);
}

struct Case {
  int64_t ranks;          // tensor-parallel ranks per replica
  int64_t checkpointing;  // recompute every N-th block (0: none)
  int64_t accumulation;
  int64_t replicas = 1;  // DDP over them
};

class TensorParallelEquivalenceTest : public ::testing::TestWithParam<Case> {};

TEST_P(TensorParallelEquivalenceTest, TrainsAsOneDeviceDoes) {
  const Case c = GetParam();
  const torch::Tensor batches = test::MakeBatches(kSteps, 8, kSeqLen, kVocab);
  test::TrainLoop loop = test::MakeLoop(0, kSteps, c.accumulation, kLr);
  loop.activation_checkpointing = c.checkpointing;
  const test::TrainResult single =
      test::TrainSingle(kSpec, /*seed=*/7, batches, loop);
  const std::vector<test::TrainResult> ranks = test::TrainRanks(
      kSpec, /*seed=*/7, batches, c.ranks * c.replicas, loop, Tp(c.ranks));
  // The partial products summed over the ranks round differently from one
  // product; nothing else may differ.
  for (size_t r = 0; r < ranks.size(); ++r) {
    test::ExpectSameTraining(
        single, ranks[r], {1e-6, 1e-5},
        absl::StrCat("ddp", c.replicas, "xtp", c.ranks, "_ckpt",
                     c.checkpointing, " rank ", r));
  }
  // Each rank holds 1/T of every attention and MLP matrix, of their
  // column-parallel biases and of wte's rows; only wpe, the LayerNorms and
  // the row-parallel biases are whole: parameters, gradients and AdamW's two
  // moments are the model's state over T plus (1 - 1/T) of those.
  const int64_t whole_floats = 32 * 64 + 2 * (4 * 64 + 2 * 64) + 2 * 64;
  const int64_t whole_bytes = 4 * 4 * whole_floats;  // param, grad, 2 moments
  EXPECT_EQ(ranks[0].state_bytes, single.state_bytes / c.ranks +
                                      whole_bytes * (c.ranks - 1) / c.ranks);
  // Two all-reduces forward and two backward per block and micro-batch
  // move activations between the ranks.
  // They are counted apart from the replicas' gradient all-reduce (and the
  // world's metrics): all of a step's bytes but those.
  for (const CommStats& comm : ranks[0].step_comm) {
    EXPECT_GT(comm.bytes, 0);
    EXPECT_GT(comm.tensor_parallel_bytes, 0);
    EXPECT_LE(comm.tensor_parallel_bytes, comm.bytes);
    if (c.replicas > 1) {
      // The replicas average every gradient of the rank's slice: more than
      // the slice's parameters in bytes.
      EXPECT_GT(comm.bytes - comm.tensor_parallel_bytes,
                ranks[0].state_bytes / 4 / 4);
    }
  }
}

// Every gradient, its slices put together from the ranks, against one
// device's tensor by tensor (at equal weights: lr 0; see
// strategy_contract_test). Measured worst: 1.2e-6 of a tensor's largest
// element.
TEST_P(TensorParallelEquivalenceTest, GradientsMatchOneDeviceTensorByTensor) {
  const Case c = GetParam();
  const torch::Tensor batches = test::MakeBatches(2, 8, kSeqLen, kVocab);
  test::TrainLoop loop = test::MakeLoop(0, 2, c.accumulation, /*lr=*/0);
  loop.activation_checkpointing = c.checkpointing;
  loop.record_gradients = true;
  const test::TrainResult single =
      test::TrainSingle(kSpec, /*seed=*/7, batches, loop);
  const std::vector<test::TrainResult> ranks = test::TrainRanks(
      kSpec, /*seed=*/7, batches, c.ranks * c.replicas, loop, Tp(c.ranks));
  test::ExpectSameGradients(single, ranks, 5e-6,
                            absl::StrCat("ddp", c.replicas, "xtp", c.ranks,
                                         "_ckpt", c.checkpointing));
}

// A gradient doubled in one sliced tensor is caught by the comparison above.
TEST(TensorParallelStrategyTest, ADoubledGradientInOneTensorIsCaught) {
  const std::string victim = "h.1.attn.c_attn.weight";
  const torch::Tensor batches = test::MakeBatches(1, 8, kSeqLen, kVocab);
  test::TrainLoop loop = test::MakeLoop(0, 1, 1, /*lr=*/0);
  loop.record_gradients = true;
  const test::TrainResult single =
      test::TrainSingle(kSpec, /*seed=*/7, batches, loop);
  loop.tamper = test::DoubleGradientOf(victim);
  const std::vector<test::TrainResult> ranks =
      test::TrainRanks(kSpec, /*seed=*/7, batches, 2, loop, Tp());
  test::ExpectOnlyTamperedGradientDiffers(single, ranks, victim, 5e-6);
}

INSTANTIATE_TEST_SUITE_P(Ranks, TensorParallelEquivalenceTest,
                         ::testing::Values(Case{2, 0, 1}, Case{4, 0, 1},
                                           Case{2, 1, 2},
                                           Case{2, 0, 2, /*replicas=*/2}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return absl::StrCat("ddp", info.param.replicas,
                                               "xtp", info.param.ranks, "_ckpt",
                                               info.param.checkpointing,
                                               "_accum",
                                               info.param.accumulation);
                         });

// TP 2 x FSDP 2 moves its units as a sharded pipeline stage does: each
// block's unit is waited for just before the block runs (block 1 starts
// while its gather is still outstanding), and during the last micro-step's
// backward each unit's reduce-scatter goes as the backward completes it,
// before the backward ends (they once all went after it); not during the
// first micro-step's, whose gradients are partial. Training matches one
// device over two accumulated micro-steps.
TEST(TensorParallelStrategyTest, ShardedSlicesMoveAsTheStepNeedsThem) {
  const torch::Tensor batches = test::MakeBatches(kSteps, 8, kSeqLen, kVocab);
  test::TrainLoop loop = test::MakeLoop(0, kSteps, /*micro_steps=*/2, kLr);
  const test::TrainResult single =
      test::TrainSingle(kSpec, /*seed=*/7, batches, loop);
  std::vector<UnitSchedule::OverlapTrace> overlap(4);
  std::vector<std::vector<std::string>> gathers(4);
  std::vector<test::TrainResult> ranks(4);
  RunRanks(4, [&](int64_t rank, Communicator& comm) {
    torch::set_num_threads(1);
    StrategyOptions options;
    options.rank = rank;
    options.world_size = 4;
    TensorParallelStrategy strategy(options, &comm, /*tensor_parallel=*/2,
                                    /*shard_over_replicas=*/true);
    const absl::Status setup = strategy.Setup(test::MakeModel(kSpec, 7));
    ASSERT_TRUE(setup.ok()) << setup;
    test::Train(strategy, batches, rank, 4, loop, &ranks[rank]);
    overlap[rank] = strategy.shard_overlap_trace();
    gathers[rank] = strategy.gather_trace();
  });
  for (size_t r = 0; r < ranks.size(); ++r) {
    ASSERT_EQ(ranks[r].losses.size(), single.losses.size());
    for (size_t step = 0; step < single.losses.size(); ++step) {
      EXPECT_LE(test::RelDiff(ranks[r].losses[step], single.losses[step]), 1e-6)
          << "rank " << r << " step " << step;
      EXPECT_LE(test::RelDiff(ranks[r].norms[step], single.norms[step]), 1e-5)
          << "rank " << r << " step " << step;
    }
  }
  const CausalLm model = test::MakeModel(kSpec, 7);
  for (int64_t r = 0; r < 4; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    // Both blocks' units and the one of the tensors outside them (wpe, the
    // final norm) from their hooks, once each: the token embedding's rows,
    // whose gradient the vocabulary-parallel paths make, go after.
    EXPECT_EQ(overlap[r].unit_launch.size(), 3u);
    for (const auto& launch : overlap[r].unit_launch) {
      EXPECT_LT(launch, overlap[r].backward_end);
    }
    const std::vector<std::string>& trace = gathers[r];
    const auto block = std::find(trace.begin(), trace.end(), "block 1");
    ASSERT_NE(block, trace.end())
        << "block 1 waited for nothing; trace " << absl::StrJoin(trace, ", ");
    ASSERT_NE(block + 1, trace.end());
    EXPECT_EQ(*(block + 1),
              absl::StrCat("unit ", model->BlockName(1), " ready"));
  }
}

// TP 2 x HSDP: 8 ranks, 4 replicas of 2 tensor ranks, each slice sharded
// within groups of 2 replicas and the 2 groups averaging their shards. It
// trains as one device does (two accumulated micro-steps), holds what TP 2
// x FSDP 2 holds per rank (the same shards), and only the averaging of
// shards crosses the groups.
TEST(TensorParallelStrategyTest, HsdpShardsWithinGroupsAndAveragesAcross) {
  const torch::Tensor batches = test::MakeBatches(kSteps, 8, kSeqLen, kVocab);
  test::TrainLoop loop = test::MakeLoop(0, kSteps, /*micro_steps=*/2, kLr);
  const test::TrainResult single =
      test::TrainSingle(kSpec, /*seed=*/7, batches, loop);
  EXPECT_EQ(Tp(2, true, 2)(0, 8, nullptr)->name(), "hsdp");
  EXPECT_EQ(Tp(2, true)(0, 8, nullptr)->name(), "fsdp");
  const std::vector<test::TrainResult> hsdp =
      test::TrainRanks(kSpec, /*seed=*/7, batches, 8, loop, Tp(2, true, 2));
  const std::vector<test::TrainResult> fsdp =
      test::TrainRanks(kSpec, /*seed=*/7, batches, 4, loop, Tp(2, true));
  for (size_t r = 0; r < hsdp.size(); ++r) {
    test::ExpectSameTraining(single, hsdp[r], {1e-6, 1e-5},
                             absl::StrCat("hsdp4xtp2 rank ", r));
    EXPECT_EQ(hsdp[r].state_bytes, fsdp[r % 4].state_bytes) << "rank " << r;
    for (const CommStats& comm : hsdp[r].step_comm) {
      EXPECT_GT(comm.inter_group_bytes, 0) << "rank " << r;
      EXPECT_GT(comm.tensor_parallel_bytes, 0) << "rank " << r;
    }
  }
  for (const CommStats& comm : fsdp[0].step_comm) {
    EXPECT_EQ(comm.inter_group_bytes, 0);
  }
}

// Each slice a rank holds, by name and offset into the flattened tensor.
std::map<std::pair<std::string, int64_t>, torch::Tensor> States(Strategy& s) {
  std::map<std::pair<std::string, int64_t>, torch::Tensor> out;
  for (const StateSlice& slice : s.StateSlices(/*to_save=*/false)) {
    out[{slice.name, slice.offset}] = slice.data.clone();
  }
  return out;
}

TEST(TensorParallelStrategyTest, WholeTensorsStayEqualOnEveryRank) {
  // LayerNorms, row-parallel biases and wpe are not reduced:
  // their gradients agree because f makes them, so after training every
  // rank's copy is the same to the bit.
  const torch::Tensor batches = test::MakeBatches(3, 4, kSeqLen, kVocab);
  std::vector<std::map<std::string, torch::Tensor>> whole(2);
  RunRanks(2, [&](int64_t rank, Communicator& comm) {
    std::unique_ptr<Strategy> strategy = MakeTp(rank, 2, &comm);
    ASSERT_TRUE(strategy->Setup(test::MakeModel(kSpec, 3)).ok());
    test::TrainResult result;
    test::TrainLoop loop = test::MakeLoop(0, 3, 1, 1e-3);
    test::Train(*strategy, batches, rank, 2, loop, &result);
    for (const auto& [key, tensor] : States(*strategy)) {
      if (key.second == 0 && tensor.numel() > 0 &&
          !absl::StrContains(key.first, "c_attn") &&
          !absl::StrContains(key.first, "c_fc") &&
          !absl::StrContains(key.first, "wte") &&
          !absl::EndsWith(key.first, "c_proj.weight")) {
        whole[rank][key.first] = tensor;
      }
    }
  });
  ASSERT_GT(whole[0].size(), 10u);
  EXPECT_EQ(whole[0].count("model.wpe.weight"), 1u);
  EXPECT_EQ(whole[0].count("model.h.1.attn.c_proj.bias"), 1u);
  for (const auto& [name, tensor] : whole[0]) {
    EXPECT_TRUE(torch::equal(tensor, whole[1].at(name))) << name;
  }
}

// The input gradient's sum over the tensor ranks (f's all-reduce) goes
// while the column-parallel weights' gradients are computed: once per
// column-parallel entry (attention and MLP of each block) per micro-step.
TEST(TensorParallelStrategyTest, InputGradientSumsOverlapWeightGradients) {
  const torch::Tensor batches = test::MakeBatches(2, 4, kSeqLen, kVocab);
  RunRanks(2, [&](int64_t rank, Communicator& comm) {
    std::unique_ptr<Strategy> strategy = MakeTp(rank, 2, &comm);
    ASSERT_TRUE(strategy->Setup(test::MakeModel(kSpec, 3)).ok());
    test::TrainResult result;
    test::TrainLoop loop = test::MakeLoop(0, 2, 1, 1e-3);
    test::Train(*strategy, batches, rank, 2, loop, &result);
    const TensorParallelOps* ops =
        static_cast<TensorParallelStrategy&>(*strategy).tensor_parallel_ops();
    ASSERT_NE(ops, nullptr);
    const int64_t blocks = ParseModelSpec(kSpec)->n_layer;
    EXPECT_EQ(ops->overlapped_input_gradients(), 2 * blocks * 2)
        << "rank " << rank;
  });
}

TEST(TensorParallelStrategyTest, ACheckpointLoadsAtOneDeviceAndBackBitForBit) {
  const std::string dir = test::ScratchDir("tensor_parallel_ckpt");
  const torch::Tensor batches = test::MakeBatches(2, 4, kSeqLen, kVocab);
  RunRanks(2, [&](int64_t rank, Communicator& comm) {
    std::unique_ptr<Strategy> strategy = MakeTp(rank, 2, &comm);
    ASSERT_TRUE(strategy->Setup(test::MakeModel(kSpec, 3)).ok());
    test::TrainResult result;
    test::Train(*strategy, batches, rank, 2, test::MakeLoop(0, 2, 1, kLr),
                &result);
    std::filesystem::create_directories(dir + "/a");
    strategy->Barrier();
    const absl::Status saved = strategy->SaveCheckpoint(dir + "/a");
    ASSERT_TRUE(saved.ok()) << saved;
  });
  std::map<std::string, torch::Tensor> at_single;
  RunRanks(1, [&](int64_t, Communicator&) {
    std::unique_ptr<Strategy> single =
        test::FactoryMaker("single")(0, 1, nullptr);
    ASSERT_TRUE(single->Setup(test::MakeModel(kSpec, 99)).ok());
    ASSERT_TRUE(single->LoadCheckpoint(dir + "/a").ok());
    for (const auto& [key, tensor] : States(*single)) {
      at_single[key.first] = tensor;
    }
    EXPECT_EQ(single->optimizer_steps(), 2);
  });
  ASSERT_FALSE(at_single.empty());
  // At TP 4 every slice equals that part of the single-device state; saved
  // again and loaded at one device, every tensor is the same.
  RunRanks(4, [&](int64_t rank, Communicator& comm) {
    std::unique_ptr<Strategy> strategy = MakeTp(rank, 4, &comm);
    ASSERT_TRUE(strategy->Setup(test::MakeModel(kSpec, 98)).ok());
    ASSERT_TRUE(strategy->LoadCheckpoint(dir + "/a").ok());
    for (const auto& [key, piece] : States(*strategy)) {
      const auto& [name, offset] = key;
      EXPECT_TRUE(torch::equal(
          piece.view(-1),
          at_single.at(name).view(-1).narrow(0, offset, piece.numel())))
          << name << " at " << offset;
    }
    std::filesystem::create_directories(dir + "/b");
    strategy->Barrier();
    const absl::Status saved = strategy->SaveCheckpoint(dir + "/b");
    ASSERT_TRUE(saved.ok()) << saved;
  });
  RunRanks(1, [&](int64_t, Communicator&) {
    std::unique_ptr<Strategy> single =
        test::FactoryMaker("single")(0, 1, nullptr);
    ASSERT_TRUE(single->Setup(test::MakeModel(kSpec, 5)).ok());
    ASSERT_TRUE(single->LoadCheckpoint(dir + "/b").ok());
    for (const auto& [key, tensor] : States(*single)) {
      EXPECT_TRUE(torch::equal(tensor, at_single.at(key.first))) << key.first;
    }
  });
}

TEST(TensorParallelStrategyTest, RanksThatDoNotDivideTheHeadsAreRefused) {
  std::vector<std::string> errors(3);
  RunRanks(3, [&](int64_t rank, Communicator& comm) {
    std::unique_ptr<Strategy> strategy = MakeTp(rank, 3, &comm);
    const absl::Status s = strategy->Setup(test::MakeModel(kSpec, 1));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    errors[rank] = std::string(s.message());
  });
  EXPECT_EQ(errors[0],
            "tensor_parallel: 3 ranks do not divide the model's 4 attention "
            "heads (each rank runs whole heads, and 1/T of the MLP's 256 "
            "hidden units)");
  // The vocabulary rows too: each rank holds 1/T of the embedding.
  RunRanks(2, [&](int64_t rank, Communicator& comm) {
    std::unique_ptr<Strategy> strategy = MakeTp(rank, 2, &comm);
    const absl::Status s = strategy->Setup(test::MakeModel(
        "custom:n_layer=1,n_head=4,n_embd=64,block_size=32,vocab_size=500,"
        "padded_vocab_size=501",
        1));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    errors[rank] = std::string(s.message());
  });
  EXPECT_EQ(errors[0],
            "tensor_parallel: 2 ranks do not divide the model's 501 padded "
            "vocabulary rows (each rank holds 1/T of the embedding)");
}

TEST(TensorParallelStrategyTest, TheLayoutNamesTheSplit) {
  std::vector<std::string> layouts(2);
  RunRanks(2, [&](int64_t rank, Communicator& comm) {
    std::unique_ptr<Strategy> strategy = MakeTp(rank, 2, &comm);
    ASSERT_TRUE(strategy->Setup(test::MakeModel(kSpec, 1)).ok());
    layouts[rank] = strategy->layout();
  });
  EXPECT_EQ(layouts[1],
            "mesh: tensor parallel 2: ranks 0,1 each run 2 of 4 heads and 128 "
            "of 256 MLP units of every block and 256 of 512 vocabulary rows");
  std::vector<std::string> meshes(4);
  std::vector<int64_t> replicas(4);
  RunRanks(4, [&](int64_t rank, Communicator& comm) {
    std::unique_ptr<Strategy> strategy = Tp(2)(rank, 4, &comm);
    ASSERT_TRUE(strategy->Setup(test::MakeModel(kSpec, 1)).ok());
    meshes[rank] = strategy->layout();
    replicas[rank] = strategy->data_parallel_rank();
    EXPECT_EQ(strategy->name(), "ddp");
  });
  EXPECT_EQ(meshes[0],
            "mesh: ddp 2 x tensor parallel 2: ranks 0,1 | 2,3 each run 2 of 4 "
            "heads and 128 of 256 MLP units of every block and 256 of 512 "
            "vocabulary rows");
  EXPECT_EQ(replicas, (std::vector<int64_t>{0, 0, 1, 1}));
}

}  // namespace tensor_parallel_strategy_test
}  // namespace shardtrain
