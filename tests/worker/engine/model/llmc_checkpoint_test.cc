#include "worker/engine/model/llmc_checkpoint.h"

#include <stdlib.h>
#include <torch/types.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/model/model_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/engine/model/gpt2.h"

namespace shardtrain {
namespace llmc_checkpoint_test {

using ::testing::HasSubstr;

// Small enough that every corrupt-file case writes a file in microseconds.
ModelConfig Small() {
  return *ParseModelSpec(
      "custom:n_layer=2,n_head=2,n_embd=16,block_size=32,vocab_size=100");
}

class LlmcCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = ::testing::TempDir() + "llmc_checkpoint_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Path(const std::string& name) const {
    return (dir_ / name).string();
  }

  static std::vector<char> ReadBytes(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::vector<char>(std::istreambuf_iterator<char>(in), {});
  }
  static void WriteBytes(const std::string& path,
                         const std::vector<char>& bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  static std::array<int32_t, 256> Header(const std::vector<char>& bytes) {
    std::array<int32_t, 256> header{};
    std::memcpy(header.data(), bytes.data(), sizeof(header));
    return header;
  }
  static void SetHeaderInt(std::vector<char>& bytes, int index, int32_t value) {
    std::memcpy(bytes.data() + index * sizeof(int32_t), &value, sizeof(value));
  }

  // A valid checkpoint of Small(), returned as bytes to corrupt.
  std::vector<char> SmallCheckpointBytes() {
    Gpt2 model(Small(), /*seed=*/1);
    const std::string path = Path("small.bin");
    EXPECT_TRUE(SaveLlmcCheckpoint(model, path).ok());
    return ReadBytes(path);
  }

  std::filesystem::path dir_;
};

TEST_F(LlmcCheckpointTest, RoundTripRestoresEveryParameterExactly) {
  Gpt2 saved(*ModelConfig::FromPreset("gpt2-tiny"), /*seed=*/1);
  const std::string path = Path("tiny.bin");
  ASSERT_TRUE(SaveLlmcCheckpoint(saved, path).ok());

  Gpt2 loaded(*ModelConfig::FromPreset("gpt2-tiny"), /*seed=*/2);
  absl::Status status = LoadLlmcCheckpoint(path, loaded);
  ASSERT_TRUE(status.ok()) << status;
  const auto a = saved->named_parameters();
  const auto b = loaded->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i].value(), b[i].value())) << a[i].key();
  }
}

TEST_F(LlmcCheckpointTest, HeaderAndSizeFollowLlmcLayout) {
  const ModelConfig config = *ModelConfig::FromPreset("gpt2-tiny");
  Gpt2 model(config, /*seed=*/1);
  const std::string path = Path("tiny.bin");
  ASSERT_TRUE(SaveLlmcCheckpoint(model, path).ok());
  const std::vector<char> bytes = ReadBytes(path);

  const std::array<int32_t, 256> h = Header(bytes);
  EXPECT_EQ(h[0], 20240326);
  EXPECT_EQ(h[1], 3);
  EXPECT_EQ(h[2], 256);    // maxT
  EXPECT_EQ(h[3], 50257);  // V
  EXPECT_EQ(h[4], 2);      // L
  EXPECT_EQ(h[5], 4);      // NH
  EXPECT_EQ(h[6], 128);    // C
  EXPECT_EQ(h[7], 50304);  // Vp
  for (int i = 8; i < 256; ++i) EXPECT_EQ(h[i], 0) << i;

  // Sizes summed per llm.c's fill_in_parameter_sizes, independently of
  // NumParameters().
  const int64_t vp = 50304, c = 128, l = 2, max_t = 256;
  const int64_t floats = vp * c + max_t * c + l * c + l * c + l * 3 * c * c +
                         l * 3 * c + l * c * c + l * c + l * c + l * c +
                         l * 4 * c * c + l * 4 * c + l * c * 4 * c + l * c + c +
                         c;
  EXPECT_EQ(static_cast<int64_t>(bytes.size()), 1024 + 4 * floats);

  // Spot-check the order: wte first, lnfb last, qkvw of layer 1 after that
  // of layer 0 and after all of ln1w / ln1b.
  const auto* weights = reinterpret_cast<const float*>(bytes.data() + 1024);
  EXPECT_EQ(weights[0], model->wte()->weight[0][0].item<float>());
  EXPECT_EQ(weights[floats - 1], model->ln_f()->bias[c - 1].item<float>());
  const int64_t qkvw_layer1 = vp * c + max_t * c + 2 * l * c + 3 * c * c + 5;
  EXPECT_EQ(
      weights[qkvw_layer1],
      model->block(1)->attn()->c_attn()->weight.view(-1)[5].item<float>());
}

TEST_F(LlmcCheckpointTest, ReadConfigNamesTheMatchingPreset) {
  Gpt2 model(*ModelConfig::FromPreset("gpt2-tiny"));
  const std::string path = Path("tiny.bin");
  ASSERT_TRUE(SaveLlmcCheckpoint(model, path).ok());
  absl::StatusOr<ModelConfig> config = ReadLlmcConfig(path);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->name, "gpt2-tiny");
  EXPECT_TRUE(config->SameShape(model->config()));

  SmallCheckpointBytes();
  config = ReadLlmcConfig(Path("small.bin"));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->name, "custom");
  EXPECT_TRUE(config->SameShape(Small()));
}

TEST_F(LlmcCheckpointTest, SaveLeavesNoTemporaryFileBehind) {
  SmallCheckpointBytes();
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
    names.push_back(entry.path().filename().string());
  }
  EXPECT_THAT(names, ::testing::ElementsAre("small.bin"));
}

TEST_F(LlmcCheckpointTest, SaveIntoMissingDirectoryFails) {
  Gpt2 model(Small());
  absl::Status status =
      SaveLlmcCheckpoint(model, Path("no/such/dir/model.bin"));
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(status.message(), HasSubstr("no/such/dir/model.bin"));
}

struct CorruptCase {
  const char* name;
  void (*corrupt)(std::vector<char>& bytes);
  absl::StatusCode code;
  const char* must_mention;
};

TEST_F(LlmcCheckpointTest, CorruptFilesAreRejectedWithClearErrors) {
  const std::vector<char> good = SmallCheckpointBytes();
  const std::vector<CorruptCase> cases = {
      {"bad_magic", [](std::vector<char>& b) { SetHeaderInt(b, 0, 12345); },
       absl::StatusCode::kInvalidArgument, "bad magic number 12345"},
      {"bf16", [](std::vector<char>& b) { SetHeaderInt(b, 1, 5); },
       absl::StatusCode::kInvalidArgument, "bf16"},
      {"version_7", [](std::vector<char>& b) { SetHeaderInt(b, 1, 7); },
       absl::StatusCode::kInvalidArgument, "unsupported version 7"},
      {"truncated", [](std::vector<char>& b) { b.resize(b.size() - 4); },
       absl::StatusCode::kDataLoss, "truncated"},
      {"header_only_part", [](std::vector<char>& b) { b.resize(100); },
       absl::StatusCode::kDataLoss, "truncated"},
      {"trailing_bytes", [](std::vector<char>& b) { b.resize(b.size() + 8); },
       absl::StatusCode::kDataLoss, "too long"},
      {"zero_heads", [](std::vector<char>& b) { SetHeaderInt(b, 5, 0); },
       absl::StatusCode::kInvalidArgument, "n_head"},
  };
  for (const CorruptCase& c : cases) {
    std::vector<char> bytes = good;
    c.corrupt(bytes);
    const std::string path = Path(std::string(c.name) + ".bin");
    WriteBytes(path, bytes);

    absl::StatusOr<ModelConfig> config = ReadLlmcConfig(path);
    ASSERT_FALSE(config.ok()) << c.name;
    EXPECT_EQ(config.status().code(), c.code) << c.name;
    EXPECT_THAT(config.status().message(), HasSubstr(c.must_mention)) << c.name;
    EXPECT_THAT(config.status().message(), HasSubstr(path)) << c.name;

    Gpt2 model(Small());
    EXPECT_EQ(LoadLlmcCheckpoint(path, model).code(), c.code) << c.name;
  }
}

TEST_F(LlmcCheckpointTest, MissingFileIsNotFound) {
  Gpt2 model(Small());
  absl::Status status = LoadLlmcCheckpoint(Path("absent.bin"), model);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr("absent.bin"));
}

TEST_F(LlmcCheckpointTest, LoadRefusesAModelOfAnotherShapeAndLeavesItAlone) {
  SmallCheckpointBytes();
  ModelConfig other = Small();
  other.n_layer = 3;
  Gpt2 model(other, /*seed=*/4);
  const torch::Tensor before = model->wte()->weight.clone();
  absl::Status status = LoadLlmcCheckpoint(Path("small.bin"), model);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("n_layer=2"));
  EXPECT_THAT(status.message(), HasSubstr("n_layer=3"));
  EXPECT_TRUE(torch::equal(before, model->wte()->weight));
}

}  // namespace llmc_checkpoint_test
}  // namespace shardtrain
