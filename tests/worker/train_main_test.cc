// shardtrain-train as a user meets it: flags, YAML, exit codes, messages.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <regex>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/exit_codes.h"
#include "core/data/token_file.h"
#include "core/model/model_config.h"
#include "core/run/strategy_kinds.h"
#include "tests/test_util.h"
#include "worker/engine/support/cpu_threads.h"

namespace shardtrain {
namespace {
namespace fs = std::filesystem;

struct Result {
  int exit_code;
  std::string output;  // stdout and stderr
};

Result RunTrain(const std::string& args) {
  test::CommandResult r = test::RunCommand(std::string(SHARDTRAIN_BINARY_DIR) +
                                           "/bin/shardtrain-train " + args);
  return {r.exit_code, r.out + r.err};
}

class TrainMainTest : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(test::ScratchDir("train_main"));
    fs::create_directories(*dir_ + "/data");
    std::mt19937 rng(1);
    std::vector<uint16_t> tokens(20000);
    for (auto& t : tokens) t = static_cast<uint16_t>(rng() % 50257);
    ASSERT_TRUE(WriteTokenFile(*dir_ + "/data/train.bin", tokens).ok());
    tokens.resize(4000);
    ASSERT_TRUE(WriteTokenFile(*dir_ + "/data/val.bin", tokens).ok());
  }
  static std::string Data() { return *dir_ + "/data"; }
  static std::string Out(const std::string& name) { return *dir_ + "/" + name; }
  static std::string* dir_;
};
std::string* TrainMainTest::dir_ = nullptr;

// On a CPU whose flags allow AVX2/AVX-512 kernels, shardtrain-train runs
// them even where OpenBLAS's own detection falls back to generic ones (a
// virtual CPU with a generic model name): it re-executes itself with
// OPENBLAS_CORETYPE set.
TEST_F(TrainMainTest, RunsTheFastestBlasKernelsTheCpuSupports) {
  std::ifstream in("/proc/cpuinfo");
  const std::string cpuinfo((std::istreambuf_iterator<char>(in)),
                            std::istreambuf_iterator<char>());
  const std::string expected = BlasCoreTypeFor(cpuinfo.c_str());
  if (expected.empty()) GTEST_SKIP() << "no AVX2 on this CPU";
  test::CommandResult r = test::RunCommand(
      "env -u OPENBLAS_CORETYPE " + std::string(SHARDTRAIN_BINARY_DIR) +
      "/bin/shardtrain-train --model gpt2-tiny --data " + Data() +
      " --batch-size 1 --seq-len 16 --max-steps 1 --eval-steps 1");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const size_t line = r.out.find(", OpenBLAS ");
  ASSERT_NE(line, std::string::npos) << r.out;
  const std::string core =
      r.out.substr(line + 11, r.out.find(' ', line + 11) - line - 11);
  // Either the type the flags allow, or one OpenBLAS detected by itself
  // that is at least as good (it never needed the re-exec).
  EXPECT_TRUE(core == expected || core == "SkylakeX" || core == "Cooperlake" ||
              core == "SapphireRapids" ||
              (expected == "Haswell" && core == "Zen"))
      << "OpenBLAS runs " << core << " kernels; the CPU supports " << expected;
}

TEST(BlasCoreTypeTest, FollowsTheCpuFlags) {
  EXPECT_STREQ(BlasCoreTypeFor("processor : 0\nflags : fpu sse2 avx avx2 fma "
                               "avx512f avx512bw avx512vl\n"),
               "SkylakeX");
  EXPECT_STREQ(BlasCoreTypeFor("flags\t\t: fpu sse2 avx avx2 fma bmi2\n"),
               "Haswell");
  EXPECT_STREQ(BlasCoreTypeFor("flags : fpu sse2 avx\n"), "");
  EXPECT_STREQ(BlasCoreTypeFor("flags : avx2\n"), "");  // no FMA
  EXPECT_STREQ(BlasCoreTypeFor(""), "");
}

TEST_F(TrainMainTest, TrainsPrintsStepLinesAndWritesOutputs) {
  Result r = RunTrain(
      "--model gpt2-tiny --data " + Data() +
      " --batch-size 2 --seq-len 32 --max-steps 3 --eval-steps 2 --out " +
      Out("ok"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("step 1/3 | loss "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step 3/3 | loss "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("tok/s | mem "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("val_loss "), std::string::npos) << r.output;
  // Elapsed and ETA on the step lines; a summary at the end.
  EXPECT_NE(r.output.find(" | elapsed "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" | ETA "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("done: 3 steps in "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("| final loss "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("| val loss "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("outputs: " + Out("ok") + "/model.bin"),
            std::string::npos)
      << r.output;
  // No checkpoint was asked for: none is named.
  EXPECT_EQ(r.output.find("/checkpoints/"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(Out("ok") + "/metrics.jsonl"));
  EXPECT_TRUE(fs::exists(Out("ok") + "/model.bin"));

  // The written model evaluates with --eval-only --init-from.
  Result eval = RunTrain(
      "--model gpt2-tiny --data " + Data() +
      " --batch-size 2 --seq-len 32 --eval-only --eval-steps 2 --init-from " +
      Out("ok") + "/model.bin");
  ASSERT_EQ(eval.exit_code, 0) << eval.output;
  EXPECT_EQ(eval.output.rfind("val_loss ", 0), 0u) << eval.output;
}

// A Llama-family model trains from the command line, on two ranks (FSDP),
// writes its weights in Hugging Face's names (its output a Hugging Face
// directory), exports its checkpoint as a Hugging Face directory that
// initialises it again; a run without checkpoints initialises from its
// output; a GPT-2 model file cannot initialise it, and says so.
TEST_F(TrainMainTest, LlamaTrainsAndWritesSafetensors) {
  Result r =
      RunTrain("--model llama-tiny --strategy fsdp --nproc 2 --data " + Data() +
               " --batch-size 2 --seq-len 32 --max-steps 3 "
               "--eval-steps 1 --checkpoint-every 3 --out " +
               Out("llama"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("step 3/3 | loss "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("outputs: " + Out("llama") + "/model.safetensors"),
            std::string::npos)
      << r.output;
  EXPECT_TRUE(fs::exists(Out("llama") + "/model.safetensors"));
  EXPECT_FALSE(fs::exists(Out("llama") + "/model.bin"));

  // Its checkpoint initialises an evaluation; exported (by the CLI: the
  // host build's) as a Hugging Face directory, it initialises the same
  // model: the same validation loss as from the checkpoint itself.
  const std::string eval = "--model llama-tiny --data " + Data() +
                           " --batch-size 2 --seq-len 32 --eval-only "
                           "--eval-steps 2 --init-from ";
  Result from_checkpoint = RunTrain(eval + Out("llama"));
  ASSERT_EQ(from_checkpoint.exit_code, 0) << from_checkpoint.output;
  EXPECT_EQ(from_checkpoint.output.rfind("val_loss ", 0), 0u)
      << from_checkpoint.output;
  // The run's output is a Hugging Face directory too (config.json beside
  // model.safetensors): without its checkpoints it initialises the model
  // it finished with, the step-3 checkpoint's.
  EXPECT_TRUE(fs::exists(Out("llama") + "/config.json"));
  fs::create_directories(Out("llama-final"));
  for (const char* file : {"/config.json", "/model.safetensors"}) {
    fs::copy_file(Out("llama") + file, Out("llama-final") + file);
  }
  Result from_final = RunTrain(eval + Out("llama-final"));
  ASSERT_EQ(from_final.exit_code, 0) << from_final.output;
  EXPECT_EQ(from_final.output, from_checkpoint.output);
  // Its config.json says which model: --model is not needed.
  Result unnamed = RunTrain("--data " + Data() +
                            " --batch-size 2 --seq-len 32 --eval-only "
                            "--eval-steps 2 --init-from " +
                            Out("llama-final"));
  ASSERT_EQ(unnamed.exit_code, 0) << unnamed.output;
  EXPECT_EQ(unnamed.output, from_checkpoint.output);
  if (test::kHasCli) {
    const test::CommandResult exported =
        test::RunCommand(std::string(SHARDTRAIN_BINARY_DIR) +
                         "/bin/shardtrain checkpoint export " + Out("llama") +
                         " --to hf " + Out("llama-hf"));
    ASSERT_EQ(exported.exit_code, 0) << exported.out << exported.err;
    EXPECT_NE(exported.out.find("LlamaForCausalLM"), std::string::npos)
        << exported.out;
    // These tokens came without a meta.json: no tokenizer to ship, said so.
    EXPECT_NE(exported.err.find("without its tokenizer"), std::string::npos)
        << exported.err;
    EXPECT_TRUE(fs::exists(Out("llama-hf") + "/config.json"));
    Result from_hf = RunTrain(eval + Out("llama-hf"));
    ASSERT_EQ(from_hf.exit_code, 0) << from_hf.output;
    EXPECT_EQ(from_hf.output, from_checkpoint.output);
    // llm.c's format holds GPT-2 only.
    const test::CommandResult llmc =
        test::RunCommand(std::string(SHARDTRAIN_BINARY_DIR) +
                         "/bin/shardtrain checkpoint export " + Out("llama") +
                         " --to llmc " + Out("llama.bin"));
    EXPECT_NE(llmc.exit_code, 0);
    EXPECT_NE((llmc.out + llmc.err).find("export it --to hf"),
              std::string::npos)
        << llmc.out << llmc.err;
  }

  Result seed = RunTrain("--model gpt2-tiny --data " + Data() +
                         " --batch-size 2 --seq-len 32 --max-steps 1 --out " +
                         Out("gpt2-seed"));
  ASSERT_EQ(seed.exit_code, 0) << seed.output;
  // A GPT-2 run without checkpoints initialises from its directory: the
  // model.bin it wrote.
  const std::string gpt2_eval = "--model gpt2-tiny --data " + Data() +
                                " --batch-size 2 --seq-len 32 --eval-only "
                                "--eval-steps 1 --init-from ";
  Result from_run = RunTrain(gpt2_eval + Out("gpt2-seed"));
  Result from_file = RunTrain(gpt2_eval + Out("gpt2-seed") + "/model.bin");
  ASSERT_EQ(from_run.exit_code, 0) << from_run.output;
  EXPECT_EQ(from_run.output, from_file.output);
  Result mixed = RunTrain("--model llama-tiny --data " + Data() +
                          " --batch-size 2 --seq-len 32 --max-steps 1 "
                          "--init-from " +
                          Out("gpt2-seed") + "/model.bin");
  EXPECT_NE(mixed.exit_code, 0) << mixed.output;
  EXPECT_NE(mixed.output.find("holds model gpt2-tiny but --model is "
                              "llama-tiny"),
            std::string::npos)
      << mixed.output;
}

// On a machine without a GPU, a CUDA run is refused with the reason, in a
// CPU build and in a CUDA build alike (where LibTorch's CUDA libraries are
// loaded but find no device): an exit code, never a crash; single-device and
// distributed (the NCCL path) both.
TEST_F(TrainMainTest, CudaWithoutAGpuIsRefusedCleanly) {
  if (fs::exists("/dev/nvidia0")) GTEST_SKIP() << "this machine has a GPU";
  for (const std::string& extra :
       {std::string(""), std::string("--strategy ddp --nproc 2")}) {
    const std::string out = Out("cuda");
    Result r = RunTrain("--data " + Data() + " --out " + out +
                        " --device cuda --max-steps 1 " + extra);
    EXPECT_EQ(r.exit_code, 1) << extra << ": " << r.output;
    EXPECT_NE(r.output.find("sees no CUDA device"), std::string::npos)
        << extra << ": " << r.output;
  }
}

// A run that meets a non-finite loss (here from a model.bin with one NaN
// weight) stops at that step with kExitDiverged, naming it; the step is in
// metrics.jsonl, and no model.bin is written from the broken weights.
TEST_F(TrainMainTest, ADivergingRunStopsNamingTheStep) {
  const std::string seed = Out("nan_seed");
  ASSERT_EQ(RunTrain("--data " + Data() + " --out " + seed +
                     " --model gpt2-tiny --batch-size 2 --seq-len 32 "
                     "--max-steps 1")
                .exit_code,
            0);
  {
    // The first parameter after llm.c's 256-int header: one wte weight.
    std::fstream model(seed + "/model.bin",
                       std::ios::in | std::ios::out | std::ios::binary);
    model.seekp(256 * 4);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    model.write(reinterpret_cast<const char*>(&nan), sizeof(nan));
  }
  const std::string out = Out("diverged");
  Result r =
      RunTrain("--data " + Data() + " --out " + out + " --init-from " + seed +
               "/model.bin --model gpt2-tiny --batch-size 2 "
               "--seq-len 32 --max-steps 5");

  EXPECT_EQ(r.exit_code, kExitDiverged) << r.output;
  EXPECT_NE(r.output.find("training diverged at step 1"), std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(out + "/model.bin"));
  std::string metrics = test::ReadFile(out + "/metrics.jsonl");
  while (!metrics.empty() && metrics.back() == '\n') metrics.pop_back();
  // JSON has no NaN: the non-finite values are written as null.
  EXPECT_NE(metrics.find("\"loss\":null"), std::string::npos) << metrics;
  EXPECT_EQ(metrics.find('\n'), std::string::npos) << "one step only";
}

TEST_F(TrainMainTest, YamlConfigGivesTheBaseAndFlagsWin) {
  const std::string yaml = Out("run.yaml");
  std::ofstream(yaml) << "model: gpt2-tiny\ndata: " << Data()
                      << "\nbatch-size: 2\nseq-len: 16\nmax-steps: 5\n";
  Result r = RunTrain("--config " + yaml + " --max-steps 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("step 2/2"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("step 3/"), std::string::npos) << r.output;
}

// Every usage error exits 2 and names the problem; a mistyped flag gets the
// one that was meant. --help shows each flag's default.
TEST_F(TrainMainTest, UsageErrorsExitTwoAndSuggestTheFlagMeant) {
  Result typo = RunTrain("--data " + Data() + " --max-step 5");
  EXPECT_EQ(typo.exit_code, 2) << typo.output;
  EXPECT_NE(typo.output.find("unknown option --max-step; did you mean "
                             "--max-steps?"),
            std::string::npos)
      << typo.output;
  Result zero = RunTrain("--data " + Data() + " --nproc 0");
  EXPECT_EQ(zero.exit_code, 2) << zero.output;
  EXPECT_NE(zero.output.find("--nproc"), std::string::npos) << zero.output;
  Result help = RunTrain("--help");
  EXPECT_EQ(help.exit_code, 0);
  // The families and strategies the help names are the code's.
  const std::string families = absl::StrJoin(ModelFamilyNames(), ", ");
  EXPECT_NE(help.output.find(
                absl::StrCat("a causal language model (", families, ")")),
            std::string::npos)
      << help.output;
  EXPECT_NE(help.output.find(absl::StrCat("model.safetensors; ", families)),
            std::string::npos)
      << help.output;
  EXPECT_NE(help.output.find(absl::StrCat("mesh (", StrategyNameList())),
            std::string::npos)
      << help.output;
  EXPECT_TRUE(std::regex_search(help.output,
                                std::regex("--seq-len INT( \\[128\\]|=128)")))
      << help.output;
}

// More ranks than cores: said before the ranks start. The header names
// the threads per rank and activation checkpointing.
TEST_F(TrainMainTest, SaysWhatShapesTheRun) {
  const int64_t cores = std::thread::hardware_concurrency();
  Result crowded = RunTrain(absl::StrCat(
      "--data ", Data(), " --strategy ddp --nproc ", cores + 1,
      " --init-from /nonexistent/model.bin --out ", Out("crowded")));
  EXPECT_NE(crowded.exit_code, 0);
  EXPECT_NE(crowded.output.find(absl::StrCat("warning: ", cores + 1,
                                             " ranks on ", cores, " cores")),
            std::string::npos)
      << crowded.output;
  Result header = RunTrain("--data " + Data() +
                           " --batch-size 1 --seq-len 16 --max-steps 1 "
                           "--eval-steps 1 --threads 2 "
                           "--activation-checkpointing every-2 --out " +
                           Out("header"));
  ASSERT_EQ(header.exit_code, 0) << header.output;
  // The threads the rank computes with (OpenBLAS's, ATen's pool then has
  // one), as --threads gave them.
  EXPECT_NE(header.output.find("cpu: 2 thread(s) per rank"), std::string::npos)
      << header.output;
  // The allocator the build linked (tcmalloc, where installed) is the one
  // the rank runs on.
#ifdef SHARDTRAIN_EXPECT_TCMALLOC
  EXPECT_NE(header.output.find(", tcmalloc\n"), std::string::npos)
      << header.output;
#else
  EXPECT_NE(header.output.find(", glibc malloc\n"), std::string::npos)
      << header.output;
#endif
  // The log names the run's mesh as every view does.
  EXPECT_NE(header.output.find("on mesh single (cpu x 1)"), std::string::npos)
      << header.output;
  EXPECT_NE(header.output.find("activation checkpointing: every-2"),
            std::string::npos)
      << header.output;
  EXPECT_EQ(header.output.find("warning:"), std::string::npos) << header.output;
}

TEST_F(TrainMainTest, BadConfigNamesTheFieldAndLeavesNoOutput) {
  struct Case {
    std::string args;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"--model gpt2-huge", "model"},
      {"--seq-len 4096", "seq_len"},
      {"--batch-size 0", "batch_size"},
      {"--batch-size -3", "batch_size"},
      {"--lr -1", "lr"},
      {"--strategy zero3", "strategy"},
      {"--device tpu", "device"},
      {"--batch-size many", "--batch-size"},
      {"--no-such-flag 1", "no-such-flag"},
      {"--config /nonexistent.yaml", "/nonexistent.yaml"},
      {"--config /tmp", "is a directory"},
      // Products of these must not overflow (a rank died of SIGFPE).
      {"--batch-size 4611686018427387904 --grad-accum 4", "batch_size"},
      // Refused by the flag parser (CLI11 2.4) or, where the parser clamps
      // it to INT64_MAX (CLI11 2.3), by validation: either names the field.
      {"--batch-size 99999999999999999999", "batch"},
      {"--grad-accum 4611686018427387904", "grad_accum"},
      {"--comm-timeout 9223372036854775807", "comm_timeout"},
      {"--max-steps 9223372036854775807", "max_steps"},
  };
  for (const Case& c : cases) {
    const std::string out = Out("bad");
    Result r = RunTrain("--data " + Data() + " --out " + out + " " + c.args);
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_NE(r.output.find(c.expected), std::string::npos)
        << c.args << " -> " << r.output;
    EXPECT_FALSE(fs::exists(out)) << c.args << " left " << out;
  }
  const std::string out = Out("bad_data");
  Result missing = RunTrain("--data /nonexistent/dir --out " + out);
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_NE(missing.output.find("/nonexistent/dir"), std::string::npos)
      << missing.output;
  EXPECT_FALSE(fs::exists(out));
  // What every rank would refuse is said once, before any rank starts.
  for (const std::string& args :
       {std::string("--data /nonexistent/dir --strategy ddp --nproc 2"),
        "--data " + Data() + " --strategy single --nproc 2"}) {
    Result once = RunTrain(args + " --out " + out);
    EXPECT_EQ(once.exit_code, 2) << args << ": " << once.output;
    EXPECT_EQ(std::count(once.output.begin(), once.output.end(), '\n'), 1)
        << args << ": " << once.output;
    EXPECT_EQ(once.output.find("[rank"), std::string::npos) << once.output;
    EXPECT_FALSE(fs::exists(out));
  }

  std::ofstream(Out("garbage.bin")) << "not a model";
  Result bad_init =
      RunTrain("--data " + Data() + " --init-from " + Out("garbage.bin"));
  EXPECT_EQ(bad_init.exit_code, 1);
  EXPECT_NE(bad_init.output.find("init_from"), std::string::npos)
      << bad_init.output;
}

// A hostile Hugging Face directory: a config.json nested 100,000 deep (once
// a stack overflow in the error message that quoted it) is refused as a bad
// configuration naming the file, the exit code shardtraind reports as
// INVALID_SPEC.
TEST_F(TrainMainTest, AConfigJsonNestedDeepIsRefusedNamingIt) {
  const std::string dir = Out("deep-llama");
  fs::create_directories(dir);
  std::ofstream(dir + "/config.json")
      << "{\"model_type\": \"llama\", \"head_dim\": "
      << std::string(100000, '[') << std::string(100000, ']') << "}";
  const Result r = RunTrain("--data " + Data() + " --model llama-tiny " +
                            "--max-steps 1 --init-from " + dir);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("config.json"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("nests 100001 levels deep"), std::string::npos)
      << r.output;
  EXPECT_LT(r.output.size(), 2000u);
}

}  // namespace
}  // namespace shardtrain
