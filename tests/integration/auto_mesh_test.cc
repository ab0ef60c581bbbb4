// The step-time model end to end: `shardtrain-train --calibrate` measures
// this host, `shardtrain plan --fit` ranks the meshes by it, and
// `--strategy auto` trains the fastest that fits a memory cap.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/free_port.h"
#include "core/data/token_file.h"
#include "core/plan/memory_plan.h"
#include "core/plan/step_time_plan.h"
#include "core/run/train_config.h"
#include "nlohmann/json.hpp"
#include "tests/test_util.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;

class AutoMeshTest : public testing::Test {
 public:
  static void SetUpTestSuite() {
    dir_ = new std::string(test::ScratchDir("auto_mesh"));
    fs::create_directories(*dir_ + "/data");
    std::mt19937 rng(5);
    std::vector<uint16_t> tokens(40000);
    for (auto& t : tokens) t = static_cast<uint16_t>(rng() % 50257);
    ASSERT_TRUE(WriteTokenFile(*dir_ + "/data/train.bin", tokens).ok());
    fs::create_directories(*dir_ + "/cache");
  }
  static void TearDownTestSuite() { delete dir_; }

 protected:
  // Commands see this suite's rates cache only.
  static std::string Env() { return "XDG_CACHE_HOME=" + *dir_ + "/cache "; }
  static std::string Bin(const std::string& name) {
    return std::string(SHARDTRAIN_BINARY_DIR) + "/bin/" + name;
  }
  // Measures gpt2-tiny once for the suite.
  static void Calibrate() {
    if (fs::exists(*dir_ + "/cache/shardtrain/host_rates.json")) return;
    const test::CommandResult r =
        test::RunCommand(Env() + Bin("shardtrain-train") +
                         " --calibrate --model gpt2-tiny --batch-size 4 "
                         "--seq-len 64");
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_NE(r.out.find("calibrated cpu"), std::string::npos) << r.out;
  }
  static std::string* dir_;
};
std::string* AutoMeshTest::dir_ = nullptr;

TEST_F(AutoMeshTest, CalibrateMeasuresAndCachesThisHost) {
  Calibrate();
  ::setenv("XDG_CACHE_HOME", (*dir_ + "/cache").c_str(), 1);
  absl::StatusOr<HostRates> rates = LoadHostRates("cpu", "gpt2-tiny");
  ::unsetenv("XDG_CACHE_HOME");
  ASSERT_TRUE(rates.ok()) << rates.status();
  EXPECT_EQ(rates->compute_model, "gpt2-tiny");
  EXPECT_GE(rates->cores, 1);
  // A CPU thread trains at 0.1-1000 GFLOP/s; AdamW at 0.1-100 ns per
  // parameter; a loopback all-reduce at under 10 ms latency and over
  // 10 MB/s.
  EXPECT_GT(rates->flops_per_thread, 1e8);
  EXPECT_LT(rates->flops_per_thread, 1e12);
  EXPECT_GT(rates->optimizer_seconds_per_parameter, 1e-10);
  EXPECT_LT(rates->optimizer_seconds_per_parameter, 1e-7);
  EXPECT_GE(rates->intra_node.latency_seconds, 0);
  EXPECT_LT(rates->intra_node.latency_seconds, 1e-2);
  EXPECT_GT(rates->intra_node.bytes_per_second, 1e7);
  // A pass of one 64-token sequence through gpt2-tiny costs something
  // besides its FLOPs on a CPU thread (measured: about 10 ms at 128
  // tokens), and well under a second.
  EXPECT_GT(rates->pass_overhead_seconds, 0);
  EXPECT_LT(rates->pass_overhead_seconds, 1.0);
  EXPECT_FALSE(rates->measured_at.empty());

  // One rank cannot measure a collective.
  const test::CommandResult one =
      test::RunCommand(Env() + Bin("shardtrain-train") +
                       " --calibrate --nproc 1 --nnodes 1 "
                       "--model gpt2-tiny");
  EXPECT_NE(one.exit_code, 0);
}

// Two hosts of two ranks (two launchers, as torchrun's --nnodes 2; here
// both on this machine): the all-reduce between the hosts' first ranks is
// cached as the inter-node link beside the intra-node one, and `plan --fit
// --devices-per-host` prices a group spanning the hosts at it. A later
// calibration on one host keeps it.
TEST_F(AutoMeshTest, CalibrateAcrossHostsMeasuresTheLinkBetweenThem) {
  if (!test::kHasCli) GTEST_SKIP() << "the CLI is the host build's";
  const std::string cache = *dir_ + "/hosts-cache";
  fs::create_directories(cache);
  const std::string env = "XDG_CACHE_HOME=" + cache + " ";
  absl::StatusOr<int> port = PickFreePort();
  ASSERT_TRUE(port.ok()) << port.status();
  auto node = [&](int rank) {
    return env + Bin("shardtrain-train") +
           absl::StrCat(
               " --calibrate --model gpt2-tiny --batch-size 2 "
               "--seq-len 64 --nnodes 2 --nproc 2 --master-addr localhost "
               "--node-rank ",
               rank, " --master-port ", *port);
  };
  const test::CommandResult r =
      test::RunCommand("{ " + node(1) + " > " + *dir_ + "/node1.log 2>&1 & " +
                       node(0) + "; status=$?; wait; exit $status; }");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE((r.out + r.err).find("between 2 hosts (one rank each)"),
            std::string::npos)
      << r.out << r.err;
  ::setenv("XDG_CACHE_HOME", cache.c_str(), 1);
  absl::StatusOr<HostRates> rates = LoadHostRates("cpu", "gpt2-tiny");
  ASSERT_TRUE(rates.ok()) << rates.status();
  EXPECT_TRUE(rates->intra_node.known());
  ASSERT_TRUE(rates->inter_node.known());
  EXPECT_LT(rates->inter_node.latency_seconds, 1e-2);
  EXPECT_GT(rates->inter_node.bytes_per_second, 1e7);

  // A calibration on one host keeps the link between hosts.
  const test::CommandResult one = test::RunCommand(
      env + Bin("shardtrain-train") +
      " --calibrate --model gpt2-tiny --batch-size 2 --seq-len 64");
  ASSERT_EQ(one.exit_code, 0) << one.out << one.err;
  absl::StatusOr<HostRates> again = LoadHostRates("cpu", "gpt2-tiny");
  ::unsetenv("XDG_CACHE_HOME");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->inter_node.bytes_per_second,
            rates->inter_node.bytes_per_second);

  // plan --fit prices DDP over two hosts at the link between them: made
  // slower than within one, the same mesh's predicted step grows.
  HostRates slow = *again;
  slow.inter_node.bytes_per_second = slow.intra_node.bytes_per_second / 100;
  slow.inter_node.latency_seconds = slow.intra_node.latency_seconds * 100;
  ::setenv("XDG_CACHE_HOME", cache.c_str(), 1);
  ASSERT_TRUE(SaveHostRates(slow).ok());
  ::unsetenv("XDG_CACHE_HOME");
  auto ddp4_step = [&](const std::string& hosts) {
    const test::CommandResult fit = test::RunCommand(
        env + Bin("shardtrain") +
        " plan --fit --model gpt2-tiny --seq-len 64 --devices 4 --strategy ddp "
        "--global-batch 8 --memory-per-device 1GiB -o json" +
        hosts);
    EXPECT_EQ(fit.exit_code, 0) << fit.err;
    const nlohmann::json out = nlohmann::json::parse(fit.out);
    for (const nlohmann::json& row : out["fits"]) {
      if (!row.contains("mesh") && row["activation_checkpointing"] == "none") {
        return row["predicted_step_seconds"].get<double>();
      }
    }
    ADD_FAILURE() << "no ddp4 row: " << fit.out;
    return 0.0;
  };
  const double one_host = ddp4_step("");
  const double two_hosts = ddp4_step(" --devices-per-host 2");
  EXPECT_GT(one_host, 0);
  EXPECT_GT(two_hosts, one_host * 1.05);
  const test::CommandResult bad = test::RunCommand(
      env + Bin("shardtrain") +
      " plan --fit --model gpt2-tiny --devices 4 --devices-per-host 3 "
      "--memory-per-device 1GiB");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("--devices-per-host: 3 does not divide the 4"),
            std::string::npos)
      << bad.err;
}

TEST_F(AutoMeshTest, PlanFitRanksTheMeshesByPredictedSpeed) {
  if (!test::kHasCli) GTEST_SKIP() << "the CLI is the host build's";
  Calibrate();
  const test::CommandResult r =
      test::RunCommand(Env() + Bin("shardtrain") +
                       " plan --fit --model gpt2-tiny --seq-len 64 --devices 4 "
                       "--memory-per-device 1GiB -o json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json out = nlohmann::json::parse(r.out);
  ASSERT_TRUE(out.contains("fastest")) << r.out;
  double previous = 1e300;
  std::vector<std::string> meshes;
  for (const nlohmann::json& row : out["fits"]) {
    if (row["batch_size"] == 0) continue;
    ASSERT_TRUE(row.contains("predicted_tokens_per_second")) << row.dump();
    const double tps = row["predicted_tokens_per_second"];
    EXPECT_LE(tps, previous) << row.dump();  // fastest first
    previous = tps;
    if (row.contains("mesh")) meshes.push_back(row["mesh"]);
  }
  // gpt2-tiny's 4 heads: TP 2 x DDP 2 and TP 4 are weighed too.
  EXPECT_NE(std::find(meshes.begin(), meshes.end(), "ddp2xtp2"), meshes.end());
  EXPECT_NE(std::find(meshes.begin(), meshes.end(), "tp4"), meshes.end());
  EXPECT_NE(std::find(meshes.begin(), meshes.end(), "pp2xfsdp2"), meshes.end());
  EXPECT_EQ(out["fastest"]["predicted_tokens_per_second"],
            out["fits"][0]["predicted_tokens_per_second"]);
  // Why, naming the winner.
  EXPECT_EQ(out["fastest"]["why"].get<std::string>().rfind(
                out["fastest"]["mesh"].get<std::string>(), 0),
            0u)
      << out["fastest"].dump();

  const test::CommandResult table =
      test::RunCommand(Env() + Bin("shardtrain") +
                       " plan --fit --model gpt2-tiny --seq-len 64 --devices 2 "
                       "--memory-per-device 1GiB");
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_NE(table.out.find("fastest (predicted): "), std::string::npos)
      << table.out;
  EXPECT_NE(table.out.find("tokens/s (predicted)"), std::string::npos);

  // No mesh can share 6 sequences over 4 FSDP ranks: a usage error.
  const test::CommandResult none = test::RunCommand(
      Env() + Bin("shardtrain") +
      " plan --fit --model gpt2-tiny --devices 4 --strategy fsdp "
      "--global-batch 6 --memory-per-device 1GiB");
  EXPECT_EQ(none.exit_code, 2) << none.out << none.err;
  EXPECT_NE(none.err.find("no mesh of 4 devices"), std::string::npos)
      << none.err;
}

// A cap DDP does not fit: auto trains a sharded or model-parallel mesh
// under it, and reports the measured speed beside the predicted one.
TEST_F(AutoMeshTest, AutoTrainsTheFastestMeshThatFitsTheCap) {
  Calibrate();
  TrainConfig config;
  config.model = "gpt2-tiny";
  config.batch_size = 4;
  config.seq_len = 64;
  config.threads = 1;
  // DDP at one sequence per rank (auto accumulates smaller micro-batches
  // when the batch does not fit): 98% of it is planned, so no DDP fits.
  config.batch_size = 1;
  config.strategy = "ddp";
  const int64_t ddp = PlanMemory(config, 2)->total();
  config.strategy = "fsdp";
  const int64_t fsdp = PlanMemory(config, 2)->total();
  ASSERT_LT(fsdp, ddp * 9 / 10);
  const int64_t cap = ddp;
  const std::string out = *dir_ + "/auto";
  const test::CommandResult r = test::RunCommand(
      Env() + Bin("shardtrain-train") + " --strategy auto --nproc 2 " +
      "--threads 1 --model gpt2-tiny --batch-size 4 --seq-len 64 " +
      "--max-steps 4 --data " + *dir_ + "/data --out " + out +
      " --memory-cap " + std::to_string(cap));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("auto: chose "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("measured"), std::string::npos) << r.out;
  const nlohmann::json report =
      nlohmann::json::parse(test::ReadFile(out + "/auto_mesh.json"));
  const std::string mesh = report["mesh"];
  EXPECT_NE(mesh.rfind("ddp2", 0), 0u) << report.dump();
  EXPECT_LE(report["predicted"]["peak_bytes_per_rank"].get<int64_t>(),
            PlannableBytes(cap));
  EXPECT_GT(report["measured"]["tokens_per_second"].get<double>(), 0);
  // Every rank trained the same global batch: 2 ranks x 4 sequences.
  const int64_t replicas =
      2 / (report["config"]["pipeline_stages"].get<int64_t>() *
           report["config"]["tensor_parallel"].get<int64_t>());
  EXPECT_EQ(report["config"]["batch_size"].get<int64_t>() *
                report["config"]["grad_accum"].get<int64_t>() * replicas,
            8)
      << report.dump();
  // The ranked list leaves DDP out of the fitting ones.
  for (const nlohmann::json& c : report["candidates"]) {
    if (c["mesh"].get<std::string>().rfind("ddp2", 0) == 0) {
      EXPECT_FALSE(c["fits"]) << c.dump();
    }
  }

  // Nothing fits 1 MiB: refused before launching, naming the least need.
  const test::CommandResult none = test::RunCommand(
      Env() + Bin("shardtrain-train") + " --strategy auto --nproc 2 " +
      "--model gpt2-tiny --batch-size 4 --seq-len 64 --max-steps 1 --data " +
      *dir_ + "/data --memory-cap 1MiB");
  EXPECT_EQ(none.exit_code, 2) << none.out << none.err;
  EXPECT_NE(none.err.find("no mesh of 2 ranks fits memory_cap 1.0 MiB"),
            std::string::npos)
      << none.err;
  // The rest of the command is checked first; one host only.
  const test::CommandResult split = test::RunCommand(
      Env() + Bin("shardtrain-train") + " --strategy auto --nproc 2 " +
      "--pipeline-split x --max-steps 1 --data " + *dir_ + "/data");
  EXPECT_EQ(split.exit_code, 2) << split.err;
  EXPECT_NE(split.err.find("--pipeline-split"), std::string::npos) << split.err;
  const test::CommandResult nodes = test::RunCommand(
      Env() + Bin("shardtrain-train") + " --strategy auto --nproc 1 " +
      "--nnodes 2 --master-addr 127.0.0.1 --max-steps 1 --data " + *dir_ +
      "/data");
  EXPECT_EQ(nodes.exit_code, 2) << nodes.err;
  EXPECT_NE(nodes.err.find("runs on one host"), std::string::npos) << nodes.err;
}

}  // namespace
}  // namespace shardtrain
