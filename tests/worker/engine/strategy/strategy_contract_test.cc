// What every distributed strategy promises, checked for each distributed row
// of StrategyKinds() through the real factory: the same global batches give
// single-device training (losses, gradient norms, eval loss, parameters)
// within float rounding at world sizes 2 and 3, with or without gradient
// accumulation; and a checkpoint taken mid-run resumes, on fresh ranks
// initialised from other weights, exactly as if uninterrupted. A new
// strategy gets these tests by being a row of the table.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/run/strategy_kinds.h"
#include "tests/fakes/in_process_communicator.h"
#include "tests/worker/engine/strategy/strategy_harness.h"

namespace shardtrain {
namespace strategy_contract_test {
namespace fs = std::filesystem;

// vocab_size 1000 pads wte to 1024 rows; neither a block (49,984 elements)
// nor 1024 rows divide by 3, so world 3 takes every padding path.
constexpr char kSpec[] =
    "custom:n_layer=2,n_head=2,n_embd=64,block_size=64,vocab_size=1000";
constexpr int64_t kVocab = 1000;
constexpr int64_t kSeqLen = 32;
constexpr int64_t kLocalBatch = 2;
constexpr uint64_t kSeed = 7;
// Float rounding differs between a mean over W*B rows and the mean of W
// means over B rows; AdamW turns rounding on ~0 gradients into steps of up
// to lr, so parameters are held in units of lr: 10 steps x 1e-4 x 1%.
constexpr double kLr = 1e-4;
constexpr test::Tolerance kTolerance{/*rel=*/1e-5, /*param=*/1e-5};

std::vector<std::string> DistributedStrategies() {
  std::vector<std::string> names;
  for (const StrategyKind& kind : StrategyKinds()) {
    if (kind.distributed) names.push_back(kind.name);
  }
  return names;
}

class StrategyContractTest : public testing::TestWithParam<std::string> {};

TEST_P(StrategyContractTest, MatchesSingleDeviceAtWorldTwoAndThree) {
  constexpr int64_t kSteps = 10;
  for (const int64_t world : {2, 3}) {
    const torch::Tensor batches =
        test::MakeBatches(kSteps, world * kLocalBatch, kSeqLen, kVocab);
    test::TrainLoop loop;
    loop.last_step = kSteps;
    loop.lr = kLr;
    const test::TrainResult single =
        test::TrainSingle(kSpec, kSeed, batches, loop);
    const std::vector<test::TrainResult> ranks = test::TrainRanks(
        kSpec, kSeed, batches, world, loop, test::FactoryMaker(GetParam()));
    for (int64_t rank = 0; rank < world; ++rank) {
      test::ExpectSameTraining(single, ranks[rank], kTolerance,
                               GetParam() + " world " + std::to_string(world) +
                                   " rank " + std::to_string(rank));
    }
  }
}

// AdamW's update does not change when one tensor's gradient is scaled by a
// positive constant, so losses, the global norm and the weights can hide a
// bug confined to some tensors: every gradient, put together from the
// ranks' slices, is compared with one device's tensor by tensor, with and
// without activation checkpointing. At lr 0 every step's gradients are
// taken at the same weights on both sides: after AdamW steps, elements whose
// gradients are at rounding level have moved by up to lr apart and the next
// gradients differ by 2.6e-5 of a tensor's largest element (measured, FSDP
// at lr 1e-4), which says nothing about the strategy. At equal weights the
// worst measured is 1.15e-6 (HSDP, world 3; FSDP 1.11e-6, DDP 1.13e-6): float
// rounding of a sum taken in another order. The bound leaves room for
// another LibTorch's kernels.
constexpr double kGradientRel = 5e-6;

TEST_P(StrategyContractTest, GradientsMatchOneDeviceTensorByTensor) {
  constexpr int64_t kSteps = 3;
  for (const int64_t world : {2, 3}) {
    for (const int64_t checkpointing : {0, 1}) {
      const torch::Tensor batches =
          test::MakeBatches(kSteps, world * kLocalBatch, kSeqLen, kVocab);
      test::TrainLoop loop;
      loop.last_step = kSteps;
      loop.lr = 0;
      loop.record_gradients = true;
      loop.activation_checkpointing = checkpointing;
      const test::TrainResult single =
          test::TrainSingle(kSpec, kSeed, batches, loop);
      const std::vector<test::TrainResult> ranks = test::TrainRanks(
          kSpec, kSeed, batches, world, loop, test::FactoryMaker(GetParam()));
      test::ExpectSameGradients(single, ranks, kGradientRel,
                                GetParam() + " world " + std::to_string(world) +
                                    (checkpointing ? " checkpointing" : ""));
    }
  }
}

// Every mesh row on gpt2-mini (its 50k vocabulary, 4 heads of 64, 4
// blocks), through the real factory: each gradient tensor, put together
// from the ranks' slices, equal to one device's at equal weights.
TEST(StrategyContractModelTest, GptMiniGradientsMatchOneDeviceOnEveryMesh) {
  struct Mesh {
    const char* name;
    const char* strategy;
    int64_t stages, tensor, world;
    int64_t virtual_stages = 1;
  };
  constexpr char kMini[] = "gpt2-mini";
  constexpr int64_t kMiniSeq = 16;
  // Four sequences: one per replica of the widest mesh.
  const torch::Tensor batches = test::MakeBatches(1, 4, kMiniSeq, 50257);
  test::TrainLoop loop;
  loop.last_step = 1;
  loop.lr = 0;
  loop.record_gradients = true;
  const test::TrainResult single =
      test::TrainSingle(kMini, kSeed, batches, loop);
  for (const Mesh& m :
       {Mesh{"ddp2", "ddp", 1, 1, 2}, Mesh{"fsdp2", "fsdp", 1, 1, 2},
        Mesh{"hsdp4", "hsdp", 1, 1, 4}, Mesh{"pp2", "single", 2, 1, 2},
        Mesh{"pp2xfsdp2", "fsdp", 2, 1, 4}, Mesh{"tp2", "single", 1, 2, 2},
        Mesh{"fsdp2xtp2", "fsdp", 1, 2, 4}, Mesh{"pp2xtp2", "single", 2, 2, 4},
        Mesh{"pp2xfsdp2 interleaved over 2 chunks", "fsdp", 2, 1, 4, 2}}) {
    TrainConfig config;
    config.model = kMini;
    config.seq_len = kMiniSeq;
    config.strategy = m.strategy;
    config.pipeline_stages = m.stages;
    config.virtual_stages = m.virtual_stages;
    config.tensor_parallel = m.tensor;
    config.micro_batches = m.stages > 1 ? 2 : 1;
    test::TrainLoop mesh_loop = loop;
    mesh_loop.whole_steps = m.stages > 1;
    const std::vector<test::TrainResult> ranks = test::TrainRanks(
        kMini, kSeed, batches, m.world, mesh_loop, test::FactoryMaker(config));
    test::ExpectSameGradients(single, ranks, kGradientRel, m.name);
  }
}

// A mesh row of the model-family tests.
struct MeshRow {
  const char* name;
  const char* strategy;
  int64_t stages, tensor, world;
  int64_t checkpointing = 0;
  int64_t virtual_stages = 1;
  const char* schedule = "1f1b";
};

// Each gradient tensor of `spec`, put together from the ranks' slices,
// equal to one device's at equal weights, on every row of `meshes`.
// With `micro_steps`, each step's gradients are accumulated over that many.
void ExpectEveryMeshMatchesOneDevice(const std::string& spec, int64_t vocab,
                                     const std::vector<MeshRow>& meshes,
                                     int64_t micro_steps = 1) {
  constexpr int64_t kRowsSeq = 16;
  // 24 sequences a micro-step: divided by the replicas of every mesh (2, 3
  // or 4) and, in pipelines, by their 2 micro-batches.
  const torch::Tensor batches =
      test::MakeBatches(1, 24 * micro_steps, kRowsSeq, vocab);
  test::TrainLoop loop;
  loop.last_step = 1;
  loop.micro_steps = micro_steps;
  loop.lr = 0;
  loop.record_gradients = true;
  const test::TrainResult single =
      test::TrainSingle(spec, kSeed, batches, loop);
  for (const MeshRow& m : meshes) {
    TrainConfig config;
    config.model = spec;
    config.seq_len = kRowsSeq;
    config.strategy = m.strategy;
    config.pipeline_stages = m.stages;
    config.virtual_stages = m.virtual_stages;
    config.tensor_parallel = m.tensor;
    config.micro_batches = m.stages > 1 ? 2 : 1;
    config.pipeline_schedule = m.schedule;
    test::TrainLoop mesh_loop = loop;
    mesh_loop.whole_steps = m.stages > 1;
    mesh_loop.activation_checkpointing = m.checkpointing;
    const std::vector<test::TrainResult> ranks = test::TrainRanks(
        spec, kSeed, batches, m.world, mesh_loop, test::FactoryMaker(config));
    test::ExpectSameGradients(single, ranks, kGradientRel,
                              spec + " on " + m.name);
  }
}

// The Llama family (RMSNorm, rotary positions, grouped-query attention of 4
// query heads over 2 key/value heads, SwiGLU) on every mesh row, its head
// tied to the embedding; world 3 takes FSDP's padding paths (1024 rows, a
// block of 41,088 elements).
constexpr char kLlamaSpec[] =
    "custom-llama:n_layer=2,n_head=4,n_kv_head=2,n_embd=64,"
    "intermediate_size=96,block_size=64,vocab_size=1000";

TEST(StrategyContractModelTest, LlamaGradientsMatchOneDeviceOnEveryMesh) {
  ExpectEveryMeshMatchesOneDevice(
      kLlamaSpec, kVocab,
      {{"ddp2", "ddp", 1, 1, 2},
       {"fsdp3", "fsdp", 1, 1, 3},
       {"fsdp2 recomputing every block", "fsdp", 1, 1, 2, 1},
       {"hsdp4", "hsdp", 1, 1, 4},
       {"pp2", "single", 2, 1, 2},
       {"pp2xddp2", "ddp", 2, 1, 4},
       {"pp2xfsdp2", "fsdp", 2, 1, 4},
       {"pp2xfsdp2 zb-h1", "fsdp", 2, 1, 4, 0, 1, "zb-h1"},
       {"tp2", "single", 1, 2, 2},
       {"ddp2xtp2", "ddp", 1, 2, 4},
       {"fsdp2xtp2", "fsdp", 1, 2, 4},
       {"hsdp4xtp2", "hsdp", 1, 2, 8},
       {"pp2xtp2", "single", 2, 2, 4},
       {"pp2xhsdp4xtp2", "hsdp", 2, 2, 16}});
}

// Every cell of the grid {no stages, 2 stages} x {one replica, DDP 2,
// FSDP 2, HSDP of 2 groups of 2} x {no tensor ranks, 2}, with one
// micro-step and with two accumulated: each gradient tensor against one
// device's.
TEST(StrategyContractModelTest, EveryCellOfTheMeshGridMatchesOneDevice) {
  std::vector<MeshRow> cells;
  std::vector<std::string> names;  // kept alive for the rows' pointers
  names.reserve(16);
  struct DataParallel {
    const char* strategy;
    int64_t replicas;
  };
  for (const int64_t stages : {1, 2}) {
    for (const DataParallel& dp :
         {DataParallel{"single", 1}, DataParallel{"ddp", 2},
          DataParallel{"fsdp", 2}, DataParallel{"hsdp", 4}}) {
      for (const int64_t tensor : {1, 2}) {
        const int64_t world = stages * dp.replicas * tensor;
        if (world == 1) continue;  // one device is the reference
        names.push_back(absl::StrCat(stages > 1 ? "pp2x" : "", dp.strategy,
                                     dp.replicas, tensor > 1 ? "xtp2" : ""));
        cells.push_back(
            {names.back().c_str(), dp.strategy, stages, tensor, world});
      }
    }
  }
  ASSERT_EQ(cells.size(), 15u);
  for (const int64_t micro_steps : {1, 2}) {
    SCOPED_TRACE(absl::StrCat(micro_steps, " micro-step(s)"));
    ExpectEveryMeshMatchesOneDevice(kLlamaSpec, kVocab, cells, micro_steps);
  }
}

// Its head untied (lm_head, as Llama 3.1 8B's): a second vocabulary-sized
// weight on the output side, which FSDP shards and tensor parallelism splits
// by rows as it does the embedding, and a pipeline's last stage holds alone.
TEST(StrategyContractModelTest, UntiedLlamaHeadMatchesOneDeviceOnEveryMesh) {
  const std::string spec = std::string(kLlamaSpec) + ",tie_embeddings=0";
  ExpectEveryMeshMatchesOneDevice(
      spec, kVocab,
      {{"ddp2", "ddp", 1, 1, 2},
       {"fsdp3", "fsdp", 1, 1, 3},
       {"hsdp4", "hsdp", 1, 1, 4},
       {"pp2", "single", 2, 1, 2},
       {"pp2xddp2", "ddp", 2, 1, 4},
       {"pp2xddp2 zb-h1", "ddp", 2, 1, 4, 0, 1, "zb-h1"},
       {"pp2xfsdp2", "fsdp", 2, 1, 4},
       {"tp2", "single", 1, 2, 2},
       {"ddp2xtp2", "ddp", 1, 2, 4},
       {"fsdp2xtp2", "fsdp", 1, 2, 4},
       {"pp2xtp2", "single", 2, 2, 4}});
  // Four blocks: two stages of two chunks each, the head on the last
  // stage's second chunk, split by rows over two tensor ranks.
  const std::string four_blocks =
      "custom-llama:n_layer=4,n_head=4,n_kv_head=2,n_embd=64,"
      "intermediate_size=96,block_size=64,vocab_size=1000,tie_embeddings=0";
  ExpectEveryMeshMatchesOneDevice(
      four_blocks, kVocab,
      {{"pp2xtp2 interleaved over 2 chunks", "single", 2, 2, 4, 0, 2}});
}

// A Llama checkpoint (its untied head too) written on one mesh resumes on
// other meshes and world sizes, each continuing as one device would have:
// FSDP on two ranks, resumed on one device and on two tensor ranks over one
// replica; and two pipeline stages x FSDP 2 x TP 2 on eight ranks, resumed
// on one device.
TEST(StrategyContractModelTest, LlamaCheckpointResumesOnAnotherMesh) {
  const std::string spec = std::string(kLlamaSpec) + ",tie_embeddings=0";
  constexpr int64_t kSteps = 4;
  constexpr int64_t kSaveAt = 2;
  const torch::Tensor batches =
      test::MakeBatches(kSteps, 2 * kLocalBatch, kSeqLen, kVocab);
  test::TrainLoop loop;
  loop.last_step = kSteps;
  loop.lr = kLr;
  const test::TrainResult uninterrupted =
      test::TrainSingle(spec, kSeed, batches, loop);

  struct Resume {
    const char* name;
    const char* strategy;
    int64_t tensor, world;
  };
  struct Writer {
    const char* name;
    int64_t stages, tensor, world;
    std::vector<Resume> resumes;
  };
  const std::vector<Writer> writers = {
      {"fsdp2",
       1,
       1,
       2,
       {Resume{"single", "single", 1, 1}, Resume{"tp2", "single", 2, 2}}},
      {"pp2xfsdp2xtp2", 2, 2, 8, {Resume{"single", "single", 1, 1}}}};
  for (const Writer& w : writers) {
    SCOPED_TRACE(std::string("written by ") + w.name);
    const fs::path dir = fs::path(testing::TempDir()) /
                         (std::string("contract-llama-") + w.name);
    fs::remove_all(dir);
    fs::create_directories(dir / "export");
    fs::create_directories(dir / "ckpt");
    TrainConfig writer;
    writer.model = spec;
    writer.strategy = "fsdp";
    writer.pipeline_stages = w.stages;
    writer.tensor_parallel = w.tensor;
    writer.micro_batches = w.stages > 1 ? 2 : 1;
    RunRanks(w.world, [&](int64_t rank, Communicator& comm) {
      torch::set_num_threads(1);
      std::unique_ptr<Strategy> strategy =
          test::FactoryMaker(writer)(rank, w.world, &comm);
      ASSERT_TRUE(strategy->Setup(test::MakeCausalLm(spec, kSeed)).ok());
      test::TrainLoop first = loop;
      first.last_step = kSaveAt;
      test::TrainResult ignored;
      test::Train(*strategy, batches, rank, w.world, first, &ignored);
      strategy->Barrier();
      const absl::Status saved =
          strategy->SaveCheckpoint((dir / "ckpt").string());
      ASSERT_TRUE(saved.ok()) << saved;
    });
    for (const Resume& r : w.resumes) {
      TrainConfig config;
      config.model = spec;
      config.strategy = r.strategy;
      config.tensor_parallel = r.tensor;
      std::vector<test::TrainResult> resumed(r.world);
      fs::create_directories(dir / "export" / r.name);
      RunRanks(r.world, [&](int64_t rank, Communicator& comm) {
        torch::set_num_threads(1);
        std::unique_ptr<Strategy> strategy =
            test::FactoryMaker(config)(rank, r.world, &comm);
        ASSERT_TRUE(
            strategy->Setup(test::MakeCausalLm(spec, /*seed=*/99)).ok());
        const absl::Status loaded =
            strategy->LoadCheckpoint((dir / "ckpt").string());
        ASSERT_TRUE(loaded.ok()) << r.name << ": " << loaded;
        test::TrainLoop rest = loop;
        rest.first_step = kSaveAt;
        test::Train(*strategy, batches, rank, r.world, rest, &resumed[rank]);
        resumed[rank].params = test::FullParameters(
            *strategy, spec, (dir / "export" / r.name).string());
      });
      for (int64_t rank = 0; rank < r.world; ++rank) {
        ASSERT_EQ(resumed[rank].losses.size(), kSteps - kSaveAt) << r.name;
        for (int64_t i = 0; i < kSteps - kSaveAt; ++i) {
          EXPECT_NEAR(resumed[rank].losses[i],
                      uninterrupted.losses[kSaveAt + i],
                      kTolerance.rel * uninterrupted.losses[kSaveAt + i])
              << r.name << " step " << kSaveAt + i;
        }
        EXPECT_LT(test::MaxAbsDiff(resumed[rank].params, uninterrupted.params),
                  kTolerance.param)
            << r.name << " rank " << rank;
        EXPECT_EQ(resumed[rank].params.count("lm_head.weight"), 1u);
      }
    }
    fs::remove_all(dir);
  }
}

// The check sees a gradient doubled in one tensor only (what a scale bug
// confined to some parameters would do), which the norm alone blurs.
TEST_P(StrategyContractTest, ADoubledGradientInOneTensorIsCaught) {
  constexpr int64_t kWorld = 2;
  const std::string victim = "h.1.mlp.c_proj.weight";
  const torch::Tensor batches =
      test::MakeBatches(1, kWorld * kLocalBatch, kSeqLen, kVocab);
  test::TrainLoop loop;
  loop.last_step = 1;
  loop.lr = 0;
  loop.record_gradients = true;
  const test::TrainResult single =
      test::TrainSingle(kSpec, kSeed, batches, loop);
  loop.tamper = test::DoubleGradientOf(victim);
  const std::vector<test::TrainResult> ranks = test::TrainRanks(
      kSpec, kSeed, batches, kWorld, loop, test::FactoryMaker(GetParam()));
  test::ExpectOnlyTamperedGradientDiffers(single, ranks, victim, kGradientRel);
}

TEST_P(StrategyContractTest, AccumulatedMicroStepsMatchOneLargeBatch) {
  constexpr int64_t kSteps = 4;
  constexpr int64_t kWorld = 2;
  constexpr int64_t kMicroSteps = 4;
  const torch::Tensor batches = test::MakeBatches(
      kSteps, kWorld * kMicroSteps * kLocalBatch, kSeqLen, kVocab);
  test::TrainLoop loop;
  loop.last_step = kSteps;
  loop.lr = kLr;
  const test::TrainResult single =
      test::TrainSingle(kSpec, kSeed, batches, loop);
  loop.micro_steps = kMicroSteps;
  const std::vector<test::TrainResult> ranks = test::TrainRanks(
      kSpec, kSeed, batches, kWorld, loop, test::FactoryMaker(GetParam()));
  test::ExpectSameTraining(single, ranks[0], kTolerance,
                           GetParam() + " 4 micro-steps vs 1 batch");
  // Only the last micro-step of a step communicates.
  const std::vector<int64_t>& bytes = ranks[0].micro_comm_bytes;
  ASSERT_EQ(bytes.size(), static_cast<size_t>(kSteps * kMicroSteps));
  for (size_t i = 0; i < bytes.size(); ++i) {
    if ((i + 1) % kMicroSteps == 0) {
      EXPECT_GT(bytes[i], 0) << "micro-step " << i;
    }
  }
}

TEST_P(StrategyContractTest, CheckpointResumesAsIfUninterrupted) {
  constexpr int64_t kSteps = 6;
  constexpr int64_t kSaveAt = 3;
  constexpr int64_t kWorld = 2;
  const torch::Tensor batches =
      test::MakeBatches(kSteps, kWorld * kLocalBatch, kSeqLen, kVocab);
  test::TrainLoop loop;
  loop.last_step = kSteps;
  loop.lr = kLr;
  const test::StrategyMaker make = test::FactoryMaker(GetParam());
  const std::vector<test::TrainResult> uninterrupted =
      test::TrainRanks(kSpec, kSeed, batches, kWorld, loop, make);

  const fs::path dir =
      fs::path(testing::TempDir()) / ("contract-checkpoint-" + GetParam());
  fs::remove_all(dir);
  fs::create_directories(dir / "export");
  std::vector<test::TrainResult> resumed(kWorld);
  RunRanks(kWorld, [&](int64_t rank, Communicator& comm) {
    torch::set_num_threads(1);
    {
      std::unique_ptr<Strategy> strategy = make(rank, kWorld, &comm);
      ASSERT_TRUE(strategy->Setup(test::MakeModel(kSpec, kSeed)).ok());
      test::TrainLoop first = loop;
      first.last_step = kSaveAt;
      test::TrainResult ignored;
      test::Train(*strategy, batches, rank, kWorld, first, &ignored);
      strategy->Barrier();
      ASSERT_TRUE(strategy->SaveCheckpoint(dir.string()).ok());
      strategy->Barrier();
    }
    // Fresh ranks from other weights: everything comes from the checkpoint.
    std::unique_ptr<Strategy> strategy = make(rank, kWorld, &comm);
    ASSERT_TRUE(strategy->Setup(test::MakeModel(kSpec, /*seed=*/99)).ok());
    const absl::Status loaded = strategy->LoadCheckpoint(dir.string());
    ASSERT_TRUE(loaded.ok()) << loaded;
    test::TrainLoop rest = loop;
    rest.first_step = kSaveAt;
    Train(*strategy, batches, rank, kWorld, rest, &resumed[rank]);
    resumed[rank].params =
        test::FullParameters(*strategy, kSpec, (dir / "export").string());
  });
  for (int64_t rank = 0; rank < kWorld; ++rank) {
    const double diff =
        test::MaxAbsDiff(resumed[rank].params, uninterrupted[rank].params);
    EXPECT_EQ(diff, 0.0) << GetParam() << " rank " << rank;
    // The resumed steps are the uninterrupted run's last ones.
    ASSERT_EQ(resumed[rank].losses.size(), kSteps - kSaveAt);
    for (int64_t i = 0; i < kSteps - kSaveAt; ++i) {
      EXPECT_EQ(resumed[rank].losses[i],
                uninterrupted[rank].losses[kSaveAt + i])
          << "step " << kSaveAt + i;
    }
  }
  fs::remove_all(dir);
}

// The model above really takes the padding paths at world 3.
TEST(StrategyContractModelTest, BlocksAndEmbeddingRowsDoNotDivideByThree) {
  Gpt2 model = test::MakeModel(kSpec, kSeed);
  int64_t block = 0;
  for (const auto& item : model->named_parameters()) {
    if (item.key().rfind("h.0.", 0) == 0) block += item.value().numel();
  }
  EXPECT_NE(block % 3, 0);
  EXPECT_NE(model->wte()->weight.size(0) % 3, 0);
}

INSTANTIATE_TEST_SUITE_P(DistributedStrategies, StrategyContractTest,
                         testing::ValuesIn(DistributedStrategies()),
                         [](const testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace strategy_contract_test
}  // namespace shardtrain
