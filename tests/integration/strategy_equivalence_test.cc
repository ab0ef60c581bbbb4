// The proof that DDP and FSDP train exactly like a single device: real
// shardtrain-train processes (--nproc N, c10d over Gloo on loopback), fp32 on
// CPU, compared step by step through their metrics.jsonl and model.bin.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/data/token_file.h"
#include "core/run/step_metrics.h"
#include "tests/test_util.h"

namespace shardtrain {
namespace {
namespace fs = std::filesystem;

struct TrainRun {
  int exit_code = -1;
  std::string output;
  std::vector<StepMetrics> rank0;          // rank 0's steps in order
  std::map<int64_t, int64_t> state_bytes;  // rank -> model_state_bytes
};

class StrategyEquivalenceTest : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(test::ScratchDir("equiv"));
    fs::create_directories(*dir_ + "/data");
    // A noisy periodic stream: learnable, so the runs move away from init.
    std::mt19937 rng(5);
    for (const auto& [name, count] :
         {std::pair{"train.bin", 60000}, std::pair{"val.bin", 9000}}) {
      std::vector<uint16_t> tokens(count);
      for (int i = 0; i < count; ++i) {
        tokens[i] =
            static_cast<uint16_t>((i * 13) % 211 + (rng() % 5 == 0 ? 3000 : 0));
      }
      ASSERT_TRUE(WriteTokenFile(*dir_ + "/data/" + name, tokens).ok());
    }
  }

  // gpt2-tiny's blocks (2, with 4 heads, width 128) for the runs' 64
  // positions, with a vocabulary of 3,328 rows (26 x 128) that holds the
  // stream's tokens: GPT-2's 50,257 would make the embedding and head 94% of
  // every step's work (a 20-step run 6.2 s instead of 1.5 on two cores) and
  // show nothing more.
  static constexpr char kModel[] =
      "custom:n_layer=2,n_head=4,n_embd=128,block_size=64,vocab_size=3328";

  // Eval covers eval_steps global batches (batch x world windows each).
  static std::string Common(int eval_steps = 2,
                            const std::string& model = kModel) {
    return " --data " + *dir_ + "/data --model " + model +
           " --seq-len 64 --max-steps 20 --warmup-steps 2"
           " --eval-every 10 --comm-timeout 60 --log-every 100 --eval-steps " +
           std::to_string(eval_steps);
  }

  // Runs shardtrain-train with --out DIR/name (emptied first unless `keep`).
  static TrainRun Train(const std::string& name, const std::string& args,
                        bool keep = false) {
    TrainRun run;
    const std::string out = *dir_ + "/" + name;
    if (!keep) fs::remove_all(out);
    test::CommandResult result =
        test::RunCommand(std::string(SHARDTRAIN_BINARY_DIR) +
                         "/bin/shardtrain-train " + args + " --out " + out);
    run.exit_code = result.exit_code;
    run.output = result.out + result.err;
    std::ifstream metrics(out + "/metrics.jsonl");
    std::string line;
    while (std::getline(metrics, line)) {
      StepMetrics m = *StepMetrics::FromJson(line);
      run.state_bytes[m.rank] = m.model_state_bytes;
      if (m.rank == 0) run.rank0.push_back(m);
    }
    return run;
  }

  static std::vector<float> ModelWeights(const std::string& name) {
    std::ifstream in(*dir_ + "/" + name + "/model.bin", std::ios::binary);
    in.seekg(0, std::ios::end);
    const size_t bytes = static_cast<size_t>(in.tellg()) - 1024;
    std::vector<float> weights(bytes / sizeof(float));
    in.seekg(1024);
    in.read(reinterpret_cast<char*>(weights.data()),
            static_cast<std::streamsize>(bytes));
    return weights;
  }

  // llm.c's check_tensor: every step's loss and grad norm within `rel`
  // relative, the final weights within `abs` absolute.
  static void ExpectSameTraining(const std::string& a_name, const TrainRun& a,
                                 const std::string& b_name, const TrainRun& b,
                                 double rel, double abs) {
    ASSERT_EQ(a.exit_code, 0) << a.output;
    ASSERT_EQ(b.exit_code, 0) << b.output;
    ASSERT_EQ(a.rank0.size(), b.rank0.size());
    ASSERT_FALSE(a.rank0.empty());
    double loss_diff = 0, norm_diff = 0, val_diff = 0;
    for (size_t i = 0; i < a.rank0.size(); ++i) {
      loss_diff =
          std::max(loss_diff, std::fabs(a.rank0[i].loss - b.rank0[i].loss) /
                                  std::fabs(b.rank0[i].loss));
      norm_diff = std::max(
          norm_diff, std::fabs(a.rank0[i].grad_norm - b.rank0[i].grad_norm) /
                         std::fabs(b.rank0[i].grad_norm));
      if (b.rank0[i].val_loss >= 0) {
        val_diff = std::max(
            val_diff, std::fabs(a.rank0[i].val_loss - b.rank0[i].val_loss) /
                          b.rank0[i].val_loss);
      }
    }
    const std::vector<float> wa = ModelWeights(a_name);
    const std::vector<float> wb = ModelWeights(b_name);
    ASSERT_EQ(wa.size(), wb.size());
    double weight_diff = 0;
    for (size_t i = 0; i < wa.size(); ++i) {
      weight_diff =
          std::max(weight_diff, static_cast<double>(std::fabs(wa[i] - wb[i])));
    }
    std::printf(
        "%s vs %s: loss maxdiff %.2e, grad norm maxdiff %.2e, val maxdiff %.2e "
        "(rel); "
        "weights maxdiff %.2e (abs)\n",
        a_name.c_str(), b_name.c_str(), loss_diff, norm_diff, val_diff,
        weight_diff);
    EXPECT_LE(loss_diff, rel);
    EXPECT_LE(norm_diff, rel);
    EXPECT_LE(val_diff, rel);
    EXPECT_LE(weight_diff, abs);
    // The runs trained: the loss moved well away from its initial value.
    EXPECT_LT(a.rank0.back().loss, a.rank0.front().loss - 0.2);
  }

  // Steps 11-20 of a 20-step run (Common(), `lr`) from the step-10
  // checkpoint of run `from`, under `args`: the same as `full`'s.
  static void ExpectResumes(const std::string& from, const TrainRun& full,
                            const std::string& to, const std::string& args,
                            const std::string& lr) {
    const std::string name = from + "_to_" + to;
    const std::string out = *dir_ + "/" + name;
    fs::remove_all(out);
    fs::copy(*dir_ + "/" + from, out, fs::copy_options::recursive);
    for (const auto& entry : fs::directory_iterator(out + "/checkpoints")) {
      if (entry.is_directory() &&
          entry.path().filename().string() > "step_00000010") {
        fs::remove_all(entry.path());
      }
    }
    fs::remove(out + "/metrics.jsonl");
    std::ofstream(out + "/checkpoints/latest") << "step_00000010\n";
    const TrainRun resumed =
        Train(name, args + Common() + lr + " --resume", /*keep=*/true);
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    ASSERT_EQ(resumed.rank0.size(), 10u) << resumed.output;
    double loss_diff = 0, norm_diff = 0;
    for (size_t i = 0; i < 10; ++i) {
      const StepMetrics& expected = full.rank0[10 + i];
      const StepMetrics& got = resumed.rank0[i];
      ASSERT_EQ(got.step, expected.step);
      loss_diff = std::max(loss_diff,
                           std::fabs(got.loss - expected.loss) / expected.loss);
      norm_diff =
          std::max(norm_diff, std::fabs(got.grad_norm - expected.grad_norm) /
                                  expected.grad_norm);
    }
    std::printf("%s: steps 11-20 loss maxdiff %.3g, grad norm %.3g\n",
                name.c_str(), loss_diff, norm_diff);
    EXPECT_LT(loss_diff, 1e-6) << name;
    EXPECT_LT(norm_diff, 1e-6) << name;
  }

  static std::string* dir_;
};
std::string* StrategyEquivalenceTest::dir_ = nullptr;

// AdamW divides by sqrt(v): an element whose true gradient is 0 gets a float-
// rounding-level gradient that differs with the reduction order, and AdamW
// turns it into a step of up to lr. The weight check therefore runs at
// lr 1e-4, where 20 steps stay within 1e-5 (measured 9e-7). FSDP and DDP
// reduce in the same order per element, so the next test holds them to 1e-5
// at the default lr 6e-4 too on LibTorch 1.13 (measured 5e-7). LibTorch
// 2.6's CPU kernels round differently for FSDP's views into its flat
// parameters than for DDP's own tensors (grad norms 4e-7 apart instead of
// 1e-8), and at lr 6e-4 AdamW carries that to 1.16e-5 in the weights
// (measured, Debian 13): there the bound is 2e-5, the losses and norms
// still within 1e-5.
#if SHARDTRAIN_TORCH_MAJOR >= 2
constexpr double kFsdpDdpWeightBoundAtDefaultLr = 2e-5;
#else
constexpr double kFsdpDdpWeightBoundAtDefaultLr = 1e-5;
#endif
TEST_F(StrategyEquivalenceTest, DdpTwoRanksEqualsSingleWithTheGlobalBatch) {
  const std::string lr = " --lr 1e-4";
  TrainRun single =
      Train("single", "--strategy single --batch-size 8" + Common() + lr);
  TrainRun ddp =
      Train("ddp2", "--strategy ddp --nproc 2 --batch-size 4" + Common() + lr);
  ExpectSameTraining("ddp2", ddp, "single", single, 1e-5, 1e-5);
}

// At the default lr on gpt2-tiny itself, where the bounds above were
// measured: on the other tests' 3,328-token model the same pair ends
// 1.13e-5 apart on LibTorch 1.13 (its head's products take other kernels,
// whose rounding AdamW carries as above).
TEST_F(StrategyEquivalenceTest, FsdpEqualsDdpAtTwoAndThreeRanks) {
  TrainRun ddp2 =
      Train("ddp2_default_lr",
            "--strategy ddp --nproc 2 --batch-size 3" + Common(2, "gpt2-tiny"));
  TrainRun fsdp2 = Train("fsdp2", "--strategy fsdp --nproc 2 --batch-size 3" +
                                      Common(2, "gpt2-tiny"));
  ExpectSameTraining("fsdp2", fsdp2, "ddp2_default_lr", ddp2, 1e-5,
                     kFsdpDdpWeightBoundAtDefaultLr);

  // World 3: no unit's size divides by 3, so every shard is padded.
  TrainRun ddp3 = Train(
      "ddp3", "--strategy ddp --nproc 3 --batch-size 2 --lr 1e-4" + Common());
  TrainRun fsdp3 = Train(
      "fsdp3", "--strategy fsdp --nproc 3 --batch-size 2 --lr 1e-4" + Common());
  ExpectSameTraining("fsdp3", fsdp3, "ddp3", ddp3, 1e-5, 1e-5);
}

// Pipeline stages over real processes (activations and their gradients
// through Gloo send/recv): the model's 2 blocks on 2 stages, alone and with
// 2 data-parallel replicas per stage, under both schedules. The same global
// batch of 8 as the single run; only the micro-batches' mean of means rounds
// differently.
TEST_F(StrategyEquivalenceTest,
       PipelineStagesTrainAsOneDeviceOnTheGlobalBatch) {
  const std::string lr = " --lr 1e-4";
  TrainRun single =
      Train("single_pp", "--strategy single --batch-size 8" + Common() + lr);
  TrainRun pp2 = Train("pp2",
                       "--strategy single --pp 2 --nproc 2 "
                       "--batch-size 8 --micro-batches 4" +
                           Common() + lr);
  ExpectSameTraining("pp2", pp2, "single_pp", single, 1e-6, 1e-5);
  EXPECT_NE(pp2.output.find("mesh: 2 pipeline stages x single 1, 1f1b with 4 "
                            "micro-batch(es): stage 0 = rank 0 (block 0, "
                            "embeddings), stage 1 = rank 1 (block 1, head)"),
            std::string::npos)
      << pp2.output;
  // Each stage holds half the blocks (and wte, tied): less than the model.
  EXPECT_LT(pp2.state_bytes.at(0), single.state_bytes.at(0));
  // Zero bubble over real processes: each micro-batch's weight gradients
  // after its input's, the same training.
  TrainRun zb = Train("pp2_zb",
                      "--strategy single --pp 2 --nproc 2 --batch-size 8 "
                      "--micro-batches 4 --pipeline-schedule zb-h1" +
                          Common() + lr);
  ExpectSameTraining("pp2_zb", zb, "single_pp", single, 1e-6, 1e-5);
  EXPECT_NE(zb.output.find("mesh: 2 pipeline stages x single 1, zb-h1 with 4 "
                           "micro-batch(es)"),
            std::string::npos)
      << zb.output;
  TrainRun pp2_ddp2 = Train("pp2_ddp2",
                            "--strategy ddp --pp 2 --nproc 4 --batch-size 4 "
                            "--micro-batches 2 --pipeline-schedule gpipe" +
                                Common() + lr);
  ExpectSameTraining("pp2_ddp2", pp2_ddp2, "single_pp", single, 1e-6, 1e-5);
  // Each stage sharded over its two ranks: the same training, written out
  // whole (model.bin) from the shards, and half a replica's state per rank.
  TrainRun pp2_fsdp2 = Train("pp2_fsdp2",
                             "--strategy fsdp --pp 2 --nproc 4 --batch-size 4 "
                             "--micro-batches 2" +
                                 Common() + lr);
  ExpectSameTraining("pp2_fsdp2", pp2_fsdp2, "single_pp", single, 1e-6, 1e-5);
  EXPECT_NE(pp2_fsdp2.output.find("mesh: 2 pipeline stages x fsdp 2, 1f1b"),
            std::string::npos)
      << pp2_fsdp2.output;
  for (const int64_t rank : {0, 1, 2, 3}) {
    EXPECT_LT(pp2_fsdp2.state_bytes.at(rank),
              pp2_ddp2.state_bytes.at(rank) * 0.51)
        << "rank " << rank;
  }
  // Four stages of a four-block model, GPipe, every block recomputed (at lr
  // 3e-4, which this small model needs to move in 20 steps).
  const std::string four_blocks =
      Common(2,
             "custom:n_layer=4,n_head=2,n_embd=64,block_size=64,"
             "vocab_size=3328") +
      " --lr 3e-4";
  TrainRun single4 =
      Train("single_pp4", "--strategy single --batch-size 8" + four_blocks);
  TrainRun pp4 = Train("pp4",
                       "--strategy single --pp 4 --nproc 4 --batch-size 8 "
                       "--micro-batches 4 --pipeline-schedule gpipe "
                       "--activation-checkpointing all" +
                           four_blocks);
  ExpectSameTraining("pp4", pp4, "single_pp4", single4, 1e-6, 1e-5);
}

// Tensor parallelism over real processes: the model's 4 heads, MLP units and
// vocabulary rows split over 2 and 4 ranks (Megatron's all-reduces over
// Gloo), alone and replicated by DDP, on the single run's global batch of 8.
// Only the partial products' sums round differently. Recomputing every block
// changes no number at all.
TEST_F(StrategyEquivalenceTest, TensorParallelTrainsAsOneDeviceDoes) {
  const std::string lr = " --lr 1e-4";
  TrainRun single =
      Train("single_tp", "--strategy single --batch-size 8" + Common() + lr);
  TrainRun tp2 =
      Train("tp2", "--strategy single --tp 2 --nproc 2 --batch-size 8" +
                       Common() + lr);
  ExpectSameTraining("tp2", tp2, "single_tp", single, 1e-6, 1e-5);
  EXPECT_NE(tp2.output.find("mesh: tensor parallel 2: ranks 0,1 each run 2 "
                            "of 4 heads and 256 of 512 MLP units"),
            std::string::npos)
      << tp2.output;
  // Parameters, gradients and AdamW's moments: half a replica's, but for
  // wpe, the LayerNorms and the row-parallel biases, which stay whole.
  for (const int64_t rank : {0, 1}) {
    EXPECT_LT(tp2.state_bytes.at(rank), single.state_bytes.at(0) * 0.51)
        << "rank " << rank;
  }
  TrainRun tp2_recomputed =
      Train("tp2_recomputed",
            "--strategy single --tp 2 --nproc 2 --batch-size 8 "
            "--activation-checkpointing all" +
                Common() + lr);
  ExpectSameTraining("tp2_recomputed", tp2_recomputed, "tp2", tp2, 0, 0);
  TrainRun tp4 =
      Train("tp4", "--strategy single --tp 4 --nproc 4 --batch-size 8" +
                       Common() + lr);
  ExpectSameTraining("tp4", tp4, "single_tp", single, 1e-6, 1e-5);
  TrainRun ddp2_tp2 =
      Train("ddp2_tp2",
            "--strategy ddp --tp 2 --nproc 4 --batch-size 4" + Common() + lr);
  ExpectSameTraining("ddp2_tp2", ddp2_tp2, "single_tp", single, 1e-6, 1e-5);
}

// TP 2 x FSDP 2 (torchtitan's 2-D mesh): each rank's slices sharded over the
// two replicas that hold the same slices. It trains as one device does on
// the same global batch of 8, holds about a quarter of a replica's state,
// and its checkpoint is world-size-free: it resumes at FSDP 4 and at one
// device, and FSDP 4's resumes at TP 2 x FSDP 2, each continuing the run.
TEST_F(StrategyEquivalenceTest, TensorParallelComposesWithFsdp) {
  const std::string lr = " --lr 1e-4";
  TrainRun single = Train("single_tpfsdp",
                          "--strategy single --batch-size 8" + Common() + lr);
  const std::string mesh = "--strategy fsdp --tp 2 --nproc 4 ";
  TrainRun tp_fsdp =
      Train("fsdp2_tp2",
            mesh + "--batch-size 4 --checkpoint-every 10" + Common() + lr);
  ExpectSameTraining("fsdp2_tp2", tp_fsdp, "single_tpfsdp", single, 1e-6, 1e-5);
  EXPECT_NE(tp_fsdp.output.find("mesh: fsdp 2 x tensor parallel 2: ranks "
                                "0,1 | 2,3 each run 2 of 4 heads"),
            std::string::npos)
      << tp_fsdp.output;
  // A quarter of a replica's parameters, gradients and moments, but for the
  // tensors a TP rank keeps whole (then halved by FSDP) and the padding.
  for (const int64_t rank : {0, 1, 2, 3}) {
    EXPECT_LT(tp_fsdp.state_bytes.at(rank), single.state_bytes.at(0) * 0.26)
        << "rank " << rank;
  }
  // Accumulating two micro-batches of 2 gathers once and reduces once.
  TrainRun accumulated =
      Train("fsdp2_tp2_accum",
            mesh + "--batch-size 2 --grad-accum 2" + Common(4) + lr);
  ExpectSameTraining("fsdp2_tp2_accum", accumulated, "fsdp2_tp2", tp_fsdp, 1e-6,
                     1e-5);

  ExpectResumes("fsdp2_tp2", tp_fsdp, "fsdp4",
                "--strategy fsdp --nproc 4 --batch-size 2", lr);
  ExpectResumes("fsdp2_tp2", tp_fsdp, "single",
                "--strategy single --batch-size 8", lr);
  ExpectResumes(
      "fsdp2_tp2", tp_fsdp, "pp2_tp2",
      "--strategy single --tp 2 --pipeline-stages 2 --micro-batches 2 "
      "--nproc 4 --batch-size 8",
      lr);
  TrainRun fsdp4 = Train("fsdp4_tp",
                         "--strategy fsdp --nproc 4 --batch-size 2 "
                         "--checkpoint-every 10" +
                             Common() + lr);
  ASSERT_EQ(fsdp4.exit_code, 0) << fsdp4.output;
  ExpectResumes("fsdp4_tp", fsdp4, "fsdp2_tp2", mesh + "--batch-size 4", lr);
}

// PP 2 x TP 2: the model's two blocks in two stages, each split over two
// tensor ranks (the embedding and head vocabulary-parallel on the end
// stages, activations passed between the same tensor ranks of neighbouring
// stages), 1F1B over 2 micro-batches: one device's training on the same
// batch of 8, its export the same model; recomputing every block changes no
// number.
TEST_F(StrategyEquivalenceTest, PipelineStagesComposeWithTensorParallelism) {
  const std::string lr = " --lr 1e-4";
  TrainRun single =
      Train("single_pptp", "--strategy single --batch-size 8" + Common() + lr);
  const std::string mesh =
      "--strategy single --tp 2 --pipeline-stages 2 --micro-batches 2 "
      "--nproc 4 --batch-size 8";
  TrainRun pp_tp =
      Train("pp2_tp2", mesh + " --checkpoint-every 10" + Common() + lr);
  ExpectSameTraining("pp2_tp2", pp_tp, "single_pptp", single, 1e-6, 1e-5);
  EXPECT_NE(pp_tp.output.find("mesh: 2 pipeline stages x single 1 x tensor "
                              "parallel 2, 1f1b with 2 micro-batch(es): stage "
                              "0 = ranks 0,1 (block 0, embeddings), stage 1 = "
                              "ranks 2,3 (block 1, head)"),
            std::string::npos)
      << pp_tp.output;
  // A rank holds one stage's slices: well under half a replica's state.
  for (const int64_t rank : {0, 1, 2, 3}) {
    EXPECT_LT(pp_tp.state_bytes.at(rank), single.state_bytes.at(0) * 0.51)
        << "rank " << rank;
  }
  TrainRun recomputed =
      Train("pp2_tp2_recomputed",
            mesh + " --activation-checkpointing all" + Common() + lr);
  ExpectSameTraining("pp2_tp2_recomputed", recomputed, "pp2_tp2", pp_tp, 0, 0);
  // Its checkpoint (each rank the runs of its stage's slices) at one device.
  ExpectResumes("pp2_tp2", pp_tp, "single", "--strategy single --batch-size 8",
                lr);
  // PP 2 x FSDP 2 x TP 2 (8 ranks): each stage's slices sharded over its
  // two replicas; its checkpoint resumes at TP 2 alone.
  TrainRun three_d =
      Train("pp2_fsdp2_tp2",
            "--strategy fsdp --tp 2 --pipeline-stages 2 --micro-batches 2 "
            "--nproc 8 --batch-size 4 --checkpoint-every 10" +
                Common() + lr);
  ExpectSameTraining("pp2_fsdp2_tp2", three_d, "single_pptp", single, 1e-6,
                     1e-5);
  EXPECT_NE(three_d.output.find("mesh: 2 pipeline stages x fsdp 2 x tensor "
                                "parallel 2"),
            std::string::npos)
      << three_d.output;
  ExpectResumes("pp2_fsdp2_tp2", three_d, "tp2",
                "--strategy single --tp 2 --nproc 2 --batch-size 8", lr);
}

TEST_F(StrategyEquivalenceTest,
       AccumulationEqualsTheLargeBatchUnderEveryStrategy) {
  for (const std::string strategy : {"ddp", "fsdp"}) {
    TrainRun large =
        Train(strategy + "_large", "--strategy " + strategy +
                                       " --nproc 2 --batch-size 4 --lr 1e-4" +
                                       Common());
    // Batch 1 evaluates over 8 batches the windows batch 4 covers in 2.
    TrainRun micro = Train(strategy + "_micro",
                           "--strategy " + strategy +
                               " --nproc 2 --batch-size 1 --grad-accum 4"
                               " --lr 1e-4" +
                               Common(/*eval_steps=*/8));
    ExpectSameTraining(strategy + "_micro", micro, strategy + "_large", large,
                       1e-5, 1e-5);
  }
}

// HSDP over real process groups: four ranks, two shard groups of two (the
// c10d sub-groups of each rank), equal to one device on the whole batch; the
// traffic between the groups is reported apart.
TEST_F(StrategyEquivalenceTest, HsdpInGroupsOfTwoEqualsSingleAtFourRanks) {
  const std::string lr = " --lr 1e-4";
  TrainRun single = Train("single_for_hsdp",
                          "--strategy single --batch-size 8" + Common() + lr);
  TrainRun hsdp = Train("hsdp4",
                        "--strategy hsdp --nproc 4 --shard-group-size 2 "
                        "--batch-size 2" +
                            Common() + lr);
  ExpectSameTraining("hsdp4", hsdp, "single_for_hsdp", single, 1e-5, 1e-5);
  // Between the groups: one all-reduce of the rank's fp32 shard gradient
  // per step, a quarter of its model state from the second step on (shard,
  // its gradient, AdamW's two moments). Inside them: everything else. Step
  // 1 also carries the replicas' broadcast of the initial shard at setup.
  ASSERT_GE(hsdp.rank0.size(), 2u);
  for (const StepMetrics& m : hsdp.rank0) {
    EXPECT_GT(m.comm_bytes, m.comm_inter_group_bytes) << m.step;
    if (m.step == 1) continue;
    EXPECT_GE(m.comm_inter_group_bytes, m.model_state_bytes * 24 / 100)
        << m.step;
    EXPECT_LE(m.comm_inter_group_bytes, m.model_state_bytes * 26 / 100)
        << m.step;
    EXPECT_EQ(m.comm_inter_group_bytes, hsdp.rank0[1].comm_inter_group_bytes)
        << m.step;
  }
  EXPECT_EQ(hsdp.rank0[0].comm_inter_group_bytes,
            2 * hsdp.rank0[1].comm_inter_group_bytes);
}

// Recomputing every block, or every second, trains exactly as without.
TEST_F(StrategyEquivalenceTest, ActivationCheckpointingChangesNoNumber) {
  TrainRun plain = Train("fsdp2_plain",
                         "--strategy fsdp --nproc 2 "
                         "--batch-size 3" +
                             Common());
  for (const std::string every : {"all", "every-2"}) {
    TrainRun recomputed = Train("fsdp2_" + every,
                                "--strategy fsdp --nproc 2 --batch-size 3 "
                                "--activation-checkpointing " +
                                    every + Common());
    ExpectSameTraining("fsdp2_" + every, recomputed, "fsdp2_plain", plain, 1e-6,
                       1e-6);
  }
}

TEST_F(StrategyEquivalenceTest, FsdpShardedCheckpointResumesTheSameRun) {
  const std::string args =
      "--strategy fsdp --nproc 2 --batch-size 2" + Common();
  TrainRun full = Train("fsdp_full", args);
  ASSERT_EQ(full.exit_code, 0) << full.output;
  ASSERT_EQ(full.rank0.size(), 20u);
  TrainRun first = Train("fsdp_ckpt", args + " --checkpoint-every 10");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string out = *dir_ + "/fsdp_ckpt";
  EXPECT_TRUE(fs::exists(out + "/checkpoints/step_00000010/checkpoint.json"));
  EXPECT_TRUE(fs::exists(out + "/checkpoints/step_00000010/rank-00000.bin"));
  EXPECT_TRUE(fs::exists(out + "/checkpoints/step_00000010/rank-00001.bin"));
  // As if the run died after step 10: resume from that checkpoint.
  std::ofstream(out + "/checkpoints/latest") << "step_00000010\n";
  fs::rename(out, *dir_ + "/fsdp_resume");
  TrainRun resumed = Train("fsdp_resume", args + " --resume", /*keep=*/true);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos)
      << resumed.output;
  // metrics.jsonl holds steps 1-20 of the first run, then 11-20 resumed.
  ASSERT_EQ(resumed.rank0.size(), 30u);
  for (size_t i = 0; i < 10; ++i) {
    const StepMetrics& expected = full.rank0[10 + i];
    const StepMetrics& got = resumed.rank0[20 + i];
    ASSERT_EQ(got.step, expected.step);
    EXPECT_NEAR(got.loss, expected.loss, 1e-6 * expected.loss)
        << "step " << got.step;
  }
}

// A checkpoint outlives its world size and strategy: the same training
// continues at another --nproc and --strategy, the global batch kept by
// accumulation, step for step as the run that was never interrupted.
TEST_F(StrategyEquivalenceTest, ACheckpointResumesAtAnyWorldSizeAndStrategy) {
  const std::string common =
      " --data " + *dir_ + "/data --model " + std::string(kModel) +
      " --seq-len 64 --max-steps 12 --warmup-steps 2 "
      "--eval-every 100 --eval-steps 1 --comm-timeout 60 --log-every 100 "
      "--checkpoint-every 6";
  // 12 sequences per step: FSDP 4 x 3 and DDP 2 x 6.
  const std::map<std::string, std::string> sources = {
      {"fsdp4", "--strategy fsdp --nproc 4 --batch-size 3"},
      {"ddp2", "--strategy ddp --nproc 2 --batch-size 6"}};
  std::map<std::string, TrainRun> full;
  for (const auto& [name, args] : sources) {
    full[name] = Train("elastic_" + name, args + common);
    ASSERT_EQ(full[name].exit_code, 0) << full[name].output;
    ASSERT_EQ(full[name].rank0.size(), 12u);
  }
  struct Case {
    std::string from, to, args, split;
  };
  const std::vector<Case> cases = {
      {"fsdp4", "fsdp2", "--strategy fsdp --nproc 2 --batch-size 3",
       "batch 3 x accum 2"},
      {"fsdp4", "ddp3", "--strategy ddp --nproc 3 --batch-size 3",
       "batch 2 x accum 2"},
      {"fsdp4", "single", "--strategy single --batch-size 3",
       "batch 3 x accum 4"},
      {"ddp2", "fsdp4", "--strategy fsdp --nproc 4 --batch-size 6",
       "batch 3 x accum 1"}};
  for (const Case& c : cases) {
    // As if the run stopped after step 6: its checkpoint, nothing newer.
    const std::string name = "elastic_" + c.from + "_to_" + c.to;
    const std::string out = *dir_ + "/" + name;
    fs::remove_all(out);
    fs::copy(*dir_ + "/elastic_" + c.from, out, fs::copy_options::recursive);
    fs::remove_all(out + "/checkpoints/step_00000012");
    fs::remove(out + "/metrics.jsonl");
    std::ofstream(out + "/checkpoints/latest") << "step_00000006\n";

    const TrainRun resumed = Train(name, c.args + common + " --resume",
                                   /*keep=*/true);
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    EXPECT_NE(resumed.output.find(c.split + " per replica: the same 12"),
              std::string::npos)
        << resumed.output;
    ASSERT_EQ(resumed.rank0.size(), 6u) << resumed.output;
    double loss_diff = 0, norm_diff = 0;
    for (size_t i = 0; i < 6; ++i) {
      const StepMetrics& expected = full[c.from].rank0[6 + i];
      const StepMetrics& got = resumed.rank0[i];
      ASSERT_EQ(got.step, expected.step);
      loss_diff = std::max(loss_diff,
                           std::fabs(got.loss - expected.loss) / expected.loss);
      norm_diff =
          std::max(norm_diff, std::fabs(got.grad_norm - expected.grad_norm) /
                                  expected.grad_norm);
    }
    std::printf(
        "OK, %s -> %s: steps 7-12 loss maxdiff %.3g, grad norm %.3g "
        "(relative)\n",
        c.from.c_str(), c.to.c_str(), loss_diff, norm_diff);
    EXPECT_LT(loss_diff, 1e-6) << c.from << " -> " << c.to;
    EXPECT_LT(norm_diff, 1e-6) << c.from << " -> " << c.to;
  }

  if (!test::kHasCli) return;  // the CLI is the host build's
  // Without ranks: the CLI reads the FSDP run's last checkpoint (step 12,
  // the end), and its export is the model the run itself wrote, byte for
  // byte.
  const std::string cli =
      std::string(SHARDTRAIN_BINARY_DIR) + "/bin/shardtrain";
  const std::string run = *dir_ + "/elastic_fsdp4";
  const test::CommandResult inspect =
      test::RunCommand(cli + " checkpoint inspect " + run);
  ASSERT_EQ(inspect.exit_code, 0) << inspect.err;
  EXPECT_NE(inspect.out.find("step_00000012"), std::string::npos)
      << inspect.out;
  EXPECT_NE(inspect.out.find("fsdp4 on 4 rank(s) (batch 3 x accum 1 per "
                             "replica)"),
            std::string::npos)
      << inspect.out;
  EXPECT_NE(inspect.out.find("rank-00003.bin"), std::string::npos)
      << inspect.out;
  const test::CommandResult exported = test::RunCommand(
      cli + " checkpoint export " + run + " --to " + *dir_ + "/exported.bin");
  ASSERT_EQ(exported.exit_code, 0) << exported.err;
  EXPECT_EQ(test::ReadFile(*dir_ + "/exported.bin"),
            test::ReadFile(run + "/model.bin"));
}

TEST_F(StrategyEquivalenceTest, FsdpHoldsAShareOfTheModelState) {
  const std::string mini =
      " --data " + *dir_ +
      "/data --model gpt2-mini --seq-len 32 --batch-size 1 --max-steps 1"
      " --eval-steps 1 --comm-timeout 120";
  TrainRun ddp = Train("mini_ddp", "--strategy ddp --nproc 2" + mini);
  ASSERT_EQ(ddp.exit_code, 0) << ddp.output;
  // gpt2-mini's largest FSDP unit is the root: wte + wpe + ln_f.
  const double largest_unit = (50304.0 * 256 + 512 * 256 + 2 * 256) * 4;
  for (int n : {2, 4}) {
    TrainRun fsdp =
        Train("mini_fsdp" + std::to_string(n),
              "--strategy fsdp --nproc " + std::to_string(n) + mini);
    ASSERT_EQ(fsdp.exit_code, 0) << fsdp.output;
    ASSERT_EQ(fsdp.state_bytes.size(), static_cast<size_t>(n));
    for (const auto& [rank, bytes] : fsdp.state_bytes) {
      const double bound = (ddp.state_bytes[0] / n + largest_unit) * 1.10;
      std::printf(
          "N=%d rank %ld: FSDP model state %.1f MiB, DDP %.1f MiB (ratio "
          "%.3f)\n",
          n, rank, bytes / 1048576.0, ddp.state_bytes[0] / 1048576.0,
          static_cast<double>(bytes) / ddp.state_bytes[0]);
      EXPECT_LE(bytes, bound) << "rank " << rank;
      EXPECT_LE(bytes, ddp.state_bytes[0] / n + 4096)
          << "shards should be exactly 1/N";
    }
  }
}

TEST_F(StrategyEquivalenceTest,
       AKilledRankFailsTheOthersWithinTheTimeoutNamingIt) {
  const std::string out = *dir_ + "/killed";
  fs::remove_all(out);
  const std::string command =
      std::string(SHARDTRAIN_BINARY_DIR) +
      "/bin/shardtrain-train --strategy ddp --nproc 2" + " --data " + *dir_ +
      "/data --model gpt2-tiny --seq-len 64 --batch-size 2"
      " --max-steps 100000 --comm-timeout 10 --log-every 1 --out " +
      out + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char line[4096];
  bool killed = false;
  std::chrono::steady_clock::time_point killed_at;
  while (fgets(line, sizeof line, pipe) != nullptr) {
    output += line;
    if (!killed && output.find("step 3/") != std::string::npos) {
      // Find rank 1: the child of the launcher whose environment has RANK=1.
      for (const auto& entry : fs::directory_iterator("/proc")) {
        std::ifstream environ(entry.path() / "environ");
        std::string env((std::istreambuf_iterator<char>(environ)), {});
        if (env.find(std::string("RANK=1") + '\0') != std::string::npos &&
            env.find(std::string("WORLD_SIZE=2") + '\0') != std::string::npos) {
          const int pid = std::stoi(entry.path().filename().string());
          if (pid != ::getpid() && ::kill(pid, SIGKILL) == 0) killed = true;
        }
      }
      ASSERT_TRUE(killed) << "could not find rank 1's process";
      killed_at = std::chrono::steady_clock::now();
    }
  }
  const int status = pclose(pipe);
  const double seconds = std::chrono::duration<double>(
                             std::chrono::steady_clock::now() - killed_at)
                             .count();
  std::printf("launcher exited %.1f s after rank 1 was killed\n", seconds);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << output;
  EXPECT_LT(seconds, 10 + 5) << output;
  EXPECT_NE(output.find("rank 1"), std::string::npos) << output;
  EXPECT_NE(output.find("KILL"), std::string::npos) << output;
}

}  // namespace
}  // namespace shardtrain
