// What the tests against a PyTorch reference in bench/reference/ share:
// Debian's /usr/bin/python3 (python3-torch) runs the reference in a
// temporary directory of the test's; a test skips when that Python cannot
// import torch.
#ifndef SHARDTRAIN_TESTS_WORKER_ENGINE_MODEL_PYTHON_REFERENCE_H_
#define SHARDTRAIN_TESTS_WORKER_ENGINE_MODEL_PYTHON_REFERENCE_H_

#include <gtest/gtest.h>
#include <stdlib.h>
#include <torch/types.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

namespace shardtrain::test {

inline constexpr char kReferencePython[] = "/usr/bin/python3";

inline std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Token sequences [B, T + 1] as the references read them: one per line.
inline void WriteTokens(const torch::Tensor& tokens, const std::string& path) {
  std::ofstream out(path);
  const int64_t last = tokens.size(1) - 1;
  for (int64_t i = 0; i < tokens.size(0); ++i) {
    for (int64_t j = 0; j <= last; ++j) {
      out << tokens[i][j].item<int64_t>() << (j < last ? " " : "\n");
    }
  }
}

class PythonReferenceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::system((std::string(kReferencePython) +
                     " -c 'import torch' >/dev/null 2>&1")
                        .c_str()) != 0) {
      GTEST_SKIP() << kReferencePython
                   << " cannot import torch (python3-torch)";
    }
    std::string pattern = ::testing::TempDir() + "reference_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  std::string Path(const std::string& name) const {
    return (dir_ / name).string();
  }

  // Runs `command`, its stdout to `out`; fails the test quoting its stderr
  // when it exits non-zero.
  bool Run(const std::string& command, const std::string& out) {
    const std::string err = out + ".stderr";
    const int rc = std::system((command + " >" + out + " 2>" + err).c_str());
    EXPECT_EQ(rc, 0) << command << "\n" << ReadText(err);
    return rc == 0;
  }

  // bench/reference/`script` with `args`: the JSON it prints, null when it
  // failed (the test fails too).
  nlohmann::json RunReference(const std::string& script,
                              const std::string& args) {
    const std::string out = Path("reference.json");
    if (!Run(std::string(kReferencePython) + " " + SHARDTRAIN_SOURCE_DIR +
                 "/bench/reference/" + script + " " + args,
             out)) {
      return nullptr;
    }
    return nlohmann::json::parse(ReadText(out));
  }

  std::filesystem::path dir_;
};

}  // namespace shardtrain::test

#endif  // SHARDTRAIN_TESTS_WORKER_ENGINE_MODEL_PYTHON_REFERENCE_H_
