#include "worker/engine/support/peak_flops.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "nlohmann/json.hpp"
#include "worker/engine/support/cpu_threads.h"

namespace shardtrain {
namespace {
namespace fs = std::filesystem;

// Points the cache at a directory of the test's own for its lifetime.
class PeakFlopsTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("shardtrain_peak_flops_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "shardtrain");
    const char* old = std::getenv("XDG_CACHE_HOME");
    if (old != nullptr) old_ = old;
    setenv("XDG_CACHE_HOME", dir_.c_str(), 1);
  }
  void TearDown() override {
    if (old_.empty()) {
      unsetenv("XDG_CACHE_HOME");
    } else {
      setenv("XDG_CACHE_HOME", old_.c_str(), 1);
    }
    fs::remove_all(dir_);
  }
  std::string Key() const {
    std::string core = BlasCoreName();
    for (char& c : core) c = static_cast<char>(std::tolower(c));
    return core.empty() ? "cpu_fp32_per_core" : "cpu_fp32_per_core_" + core;
  }
  void WriteCache(double flops, int samples) {
    std::ofstream(dir_ / "shardtrain/peak_flops.json") << nlohmann::json{
        {Key(), {{"flops", flops}, {"samples", samples}}}}.dump();
  }
  nlohmann::json ReadCache() {
    std::ifstream in(dir_ / "shardtrain/peak_flops.json");
    return nlohmann::json::parse(in);
  }
  fs::path dir_;
  std::string old_;
};

// One per-core figure for every thread count: a rank of two threads has
// twice the peak of a rank of one, so MFU compares across strategies.
TEST_F(PeakFlopsTest, ARanksPeakIsItsThreadsTimesOnePerCoreFigure) {
  WriteCache(40e9, 5);
  const torch::Device cpu(torch::kCPU);
  EXPECT_DOUBLE_EQ(PeakFlops(cpu, "fp32", 1), 40e9);
  EXPECT_DOUBLE_EQ(PeakFlops(cpu, "fp32", 2), 80e9);
  EXPECT_DOUBLE_EQ(PeakFlops(cpu, "fp32", 4), 160e9);
}

// A figure cached from a busy moment (far below what this machine does) is
// replaced by a new measurement while the first runs still measure; the
// best is kept, and the count of measurements grows.
TEST_F(PeakFlopsTest, ALowFigureFromABusyMomentDoesNotStick) {
  WriteCache(1e6, 0);  // 1 MFLOP/s: no machine is this slow
  const double peak = PeakFlops(torch::Device(torch::kCPU), "fp32", 1);
  EXPECT_GT(peak, 1e8);
  const nlohmann::json cache = ReadCache();
  EXPECT_DOUBLE_EQ(cache[Key()]["flops"].get<double>(), peak);
  EXPECT_EQ(cache[Key()]["samples"], 1);
  // A higher figure already cached is kept over a lower measurement.
  WriteCache(1e15, 1);
  EXPECT_DOUBLE_EQ(PeakFlops(torch::Device(torch::kCPU), "fp32", 1), 1e15);
  EXPECT_EQ(ReadCache()[Key()]["samples"], 2);
}

}  // namespace
}  // namespace shardtrain
