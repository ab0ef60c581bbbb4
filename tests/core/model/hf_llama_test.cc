// Hugging Face's Llama layout, without LibTorch: the published configs of
// SmolLM2 and Llama 3.2 read as our presets, what we write reads back bit for
// bit (one file or sharded), half-precision weights widen exactly, and what
// we cannot build is refused naming the setting.
#include "core/model/hf_llama.h"

#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/model/model_config.h"
#include "core/model/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace shardtrain {
namespace {

using ::testing::HasSubstr;

// SmolLM2-135M's and Llama-3.2-1B's config.json as published.
constexpr char kSmolLm2Config[] = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false,
  "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 0,
  "hidden_act": "silu", "hidden_size": 576,
  "initializer_range": 0.041666666666666664, "intermediate_size": 1536,
  "is_llama_config": true, "max_position_embeddings": 8192,
  "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30,
  "num_key_value_heads": 3, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_interleaved": false, "rope_scaling": null, "rope_theta": 100000,
  "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "transformers_version": "4.40.1", "use_cache": true, "vocab_size": 49152})";
constexpr char kLlama32Config[] = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false,
  "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001,
  "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
  "initializer_range": 0.02, "intermediate_size": 8192,
  "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 16,
  "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
                   "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192,
                   "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true,
  "torch_dtype": "bfloat16", "transformers_version": "4.45.0.dev0",
  "use_cache": true, "vocab_size": 128256})";

class HfLlamaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = ::testing::TempDir() + "hf_llama_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Path(const std::string& name) const { return dir_ / name; }
  static void Write(const std::string& path, const std::string& bytes) {
    std::ofstream(path, std::ios::binary) << bytes;
  }
  static std::string Read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  std::filesystem::path dir_;
};

// A small untied model with Qwen's q/k/v biases and Llama 3's scaling.
ModelConfig SmallConfig() {
  return *ParseModelSpec(
      "custom-llama:n_layer=2,n_head=4,n_kv_head=2,n_embd=16,"
      "intermediate_size=24,block_size=32,vocab_size=100,tie_embeddings=0,"
      "attention_bias=1,rope_theta=500000,rope_scaling_factor=8");
}

// Random weights with the vocabulary's padding rows zero, as our model
// holds them.
std::vector<std::vector<float>> RandomWeights(const ModelConfig& config,
                                              uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<std::vector<float>> weights;
  const std::vector<std::string> names = LlamaParameterNames(config);
  const std::vector<std::vector<int64_t>> shapes = LlamaParameterShapes(config);
  for (size_t i = 0; i < names.size(); ++i) {
    int64_t numel = 1;
    for (int64_t d : shapes[i]) numel *= d;
    std::vector<float> w(static_cast<size_t>(numel));
    for (float& x : w) x = normal(rng);
    if (names[i] == "embed_tokens.weight" || names[i] == "lm_head.weight") {
      std::fill(w.begin() + config.vocab_size * config.n_embd, w.end(), 0.0f);
    }
    weights.push_back(std::move(w));
  }
  return weights;
}

WeightReader ReaderOf(const std::vector<std::vector<float>>& weights) {
  return [&weights](size_t index, float* out) {
    std::copy(weights[index].begin(), weights[index].end(), out);
    return absl::OkStatus();
  };
}

void ExpectReadsBack(HfLlamaReader& reader,
                     const std::vector<std::vector<float>>& weights) {
  for (size_t i = 0; i < weights.size(); ++i) {
    std::vector<float> got(weights[i].size(), -1.0f);
    ASSERT_TRUE(reader.Read(i, got.data()).ok()) << i;
    EXPECT_EQ(got, weights[i]) << LlamaParameterNames(reader.config())[i];
  }
}

TEST_F(HfLlamaTest, PublishedConfigsReadAsOurPresets) {
  absl::StatusOr<ModelConfig> smol = ParseHfLlamaConfig(kSmolLm2Config);
  ASSERT_TRUE(smol.ok()) << smol.status();
  EXPECT_EQ(smol->name, "smollm2-135m");
  absl::StatusOr<ModelConfig> llama = ParseHfLlamaConfig(kLlama32Config);
  ASSERT_TRUE(llama.ok()) << llama.status();
  EXPECT_EQ(llama->name, "llama3.2-1b");
  EXPECT_EQ(llama->rope_scaling.factor, 32);
  EXPECT_EQ(HfModelType(kLlama32Config), "llama");
  // What we write for a preset reads back as that preset.
  for (const char* preset : {"llama3.1-8b", "smollm2-135m", "llama-tiny"}) {
    const ModelConfig config = *ModelConfig::FromPreset(preset);
    absl::StatusOr<ModelConfig> again =
        ParseHfLlamaConfig(HfLlamaConfigJson(config));
    ASSERT_TRUE(again.ok()) << preset << ": " << again.status();
    EXPECT_TRUE(again->SameShape(config)) << preset;
    EXPECT_EQ(again->name, preset);
  }
}

TEST_F(HfLlamaTest, ExportThenImportIsBitExactWithQwensBiases) {
  const ModelConfig config = SmallConfig();
  const std::vector<std::vector<float>> weights = RandomWeights(config, 3);
  ASSERT_TRUE(WriteHfLlama(config, ReaderOf(weights), Path("hf")).ok());
  const nlohmann::json json =
      nlohmann::json::parse(Read(Path("hf/config.json")));
  // Biases on q, k and v only are Qwen 2's layout.
  EXPECT_EQ(json["architectures"][0], "Qwen2ForCausalLM");
  EXPECT_EQ(json["num_key_value_heads"], 2);
  EXPECT_EQ(json["rope_scaling"]["rope_type"], "llama3");
  EXPECT_FALSE(json["tie_word_embeddings"].get<bool>());
  absl::StatusOr<SafetensorsFile> file =
      SafetensorsFile::Open(Path("hf/model.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_NE(file->Find("model.layers.1.self_attn.v_proj.bias"), nullptr);
  EXPECT_EQ(file->Find("model.embed_tokens.weight")->shape,
            (std::vector<int64_t>{100, 16}));
  EXPECT_EQ(file->Find("lm_head.weight")->shape,
            (std::vector<int64_t>{100, 16}));
  absl::StatusOr<std::unique_ptr<HfLlamaReader>> reader =
      HfLlamaReader::Open(Path("hf"));
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_TRUE((*reader)->config().SameShape(config));
  ExpectReadsBack(**reader, weights);
}

// Above the shard size the weights go to several files and an index, as
// transformers' save_pretrained writes them; the reader follows the index.
TEST_F(HfLlamaTest, LargeModelsAreShardedWithAnIndex) {
  const ModelConfig config = SmallConfig();
  const std::vector<std::vector<float>> weights = RandomWeights(config, 4);
  ASSERT_TRUE(WriteHfLlama(config, ReaderOf(weights), Path("hf"),
                           /*max_shard_bytes=*/8000)
                  .ok());
  EXPECT_FALSE(std::filesystem::exists(Path("hf/model.safetensors")));
  const nlohmann::json index =
      nlohmann::json::parse(Read(Path("hf/model.safetensors.index.json")));
  std::set<std::string> files;
  int64_t numel = 0;
  for (const auto& [name, file] : index["weight_map"].items()) {
    files.insert(file.get<std::string>());
  }
  for (const auto& w : weights) numel += static_cast<int64_t>(w.size());
  EXPECT_GT(files.size(), 2u);
  EXPECT_TRUE(files.count("model-00001-of-0000" + std::to_string(files.size()) +
                          ".safetensors"));
  EXPECT_EQ(index["weight_map"].size(), weights.size());
  // The total counts the vocabulary's rows without our padding.
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(),
            4 * (numel - 2 * (config.padded_vocab_size - 100) * 16));
  absl::StatusOr<std::unique_ptr<HfLlamaReader>> reader =
      HfLlamaReader::Open(Path("hf"));
  ASSERT_TRUE(reader.ok()) << reader.status();
  ExpectReadsBack(**reader, weights);

  // An index naming a file outside the directory is refused.
  nlohmann::json bad = index;
  bad["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors";
  Write(Path("hf/model.safetensors.index.json"), bad.dump());
  absl::StatusOr<std::unique_ptr<HfLlamaReader>> refused =
      HfLlamaReader::Open(Path("hf"));
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("must lie in the directory"));
}

// Published weights are bfloat16: read widened, exactly.
TEST_F(HfLlamaTest, Bfloat16WeightsAreWidenedExactly) {
  const ModelConfig config = *ParseModelSpec(
      "custom-llama:n_layer=1,n_head=2,n_embd=4,intermediate_size=2,"
      "vocab_size=2,block_size=8");
  std::filesystem::create_directories(Path("bf16"));
  Write(Path("bf16/config.json"), HfLlamaConfigJson(config));
  // Every tensor's elements: bf16 1.0 (0x3f80), -3.0 (0xc040) alternating.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  std::string data;
  const std::vector<std::string> names = LlamaParameterNames(config);
  const std::vector<std::vector<int64_t>> shapes = LlamaParameterShapes(config);
  for (size_t i = 0; i < names.size(); ++i) {
    std::vector<int64_t> shape = shapes[i];
    if (names[i] == "embed_tokens.weight") shape[0] = 2;
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    const size_t begin = data.size();
    for (int64_t e = 0; e < numel; ++e) {
      const uint16_t v = e % 2 == 0 ? 0x3f80 : 0xc040;
      data.append(reinterpret_cast<const char*>(&v), 2);
    }
    header[HfLlamaTensorName(names[i])] = {
        {"dtype", "BF16"},
        {"shape", shape},
        {"data_offsets", {begin, data.size()}}};
  }
  const std::string text = header.dump();
  std::string file(8, '\0');
  for (int b = 0; b < 8; ++b) {
    file[b] = static_cast<char>(static_cast<uint64_t>(text.size()) >> (8 * b));
  }
  Write(Path("bf16/model.safetensors"), file + text + data);
  absl::StatusOr<std::unique_ptr<HfLlamaReader>> reader =
      HfLlamaReader::Open(Path("bf16"));
  ASSERT_TRUE(reader.ok()) << reader.status();
  std::vector<float> embed(config.padded_vocab_size * 4, 9.0f);
  ASSERT_TRUE((*reader)->Read(0, embed.data()).ok());
  EXPECT_EQ(embed[0], 1.0f);
  EXPECT_EQ(embed[1], -3.0f);
  EXPECT_EQ(embed[7], -3.0f);
  // Our padding rows past the two of the vocabulary are zero.
  EXPECT_EQ(embed[8], 0.0f);
  EXPECT_EQ(embed.back(), 0.0f);
}

TEST_F(HfLlamaTest, ConfigsWeCannotBuildAreRefusedNamingTheSetting) {
  struct Case {
    const char* change;  // a JSON patch of kLlama32Config's keys
    const char* says;
  };
  for (const Case& c : {
           Case{R"({"model_type": "mistral"})", "model_type is \"mistral\""},
           Case{R"({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})",
                "rope_scaling.rope_type is \"yarn\""},
           Case{R"({"attention_bias": true})", "attention_bias is true"},
           Case{R"({"hidden_act": "gelu"})", "hidden_act is \"gelu\""},
           Case{R"({"head_dim": 128})", "head_dim is 128"},
           Case{R"({"num_key_value_heads": 5})", "n_kv_head = 5"},
           Case{R"({"mlp_bias": true})", "mlp_bias is true"},
           Case{R"({"rope_interleaved": true})", "rope_interleaved is true"},
       }) {
    nlohmann::json json = nlohmann::json::parse(kLlama32Config);
    json.merge_patch(nlohmann::json::parse(c.change));
    absl::StatusOr<ModelConfig> config = ParseHfLlamaConfig(json.dump());
    ASSERT_FALSE(config.ok()) << c.change;
    EXPECT_THAT(std::string(config.status().message()), HasSubstr(c.says))
        << c.change;
  }
}

TEST_F(HfLlamaTest, AMissingOrMisshapenWeightIsRefusedNamingIt) {
  const ModelConfig config = SmallConfig();
  const std::vector<std::vector<float>> weights = RandomWeights(config, 5);
  ASSERT_TRUE(WriteHfLlama(config, ReaderOf(weights), Path("hf")).ok());
  // Another model's config over these weights: 3 key/value heads' shapes.
  nlohmann::json json = nlohmann::json::parse(Read(Path("hf/config.json")));
  json["num_hidden_layers"] = 3;
  Write(Path("hf/config.json"), json.dump());
  absl::StatusOr<std::unique_ptr<HfLlamaReader>> missing =
      HfLlamaReader::Open(Path("hf"));
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr("no tensor model.layers.2.input_layernorm.weight"));
  json["num_hidden_layers"] = 2;
  json["intermediate_size"] = 32;
  Write(Path("hf/config.json"), json.dump());
  absl::StatusOr<std::unique_ptr<HfLlamaReader>> misshapen =
      HfLlamaReader::Open(Path("hf"));
  ASSERT_FALSE(misshapen.ok());
  EXPECT_THAT(std::string(misshapen.status().message()),
              HasSubstr("model.layers.0.mlp.gate_proj.weight is [24, 16], but "
                        "config.json's model needs [32, 16]"));
}

// config.json nested 100,000 deep in head_dim or rope_scaling is refused,
// naming the file, before anything recurses on it (an error quoting
// head_dim once overflowed the stack, ending a job's rank with SIGSEGV).
TEST_F(HfLlamaTest, DeeplyNestedConfigIsRefusedNamingTheFile) {
  const ModelConfig config = SmallConfig();
  const std::vector<std::vector<float>> weights = RandomWeights(config, 5);
  ASSERT_TRUE(WriteHfLlama(config, ReaderOf(weights), Path("hf")).ok());
  const std::string deep =
      std::string(100'000, '[') + std::string(100'000, ']');
  for (const char* field : {"head_dim", "rope_scaling"}) {
    nlohmann::json json = nlohmann::json::parse(kLlama32Config);
    json.erase(field);
    std::string text = json.dump();
    text.insert(text.size() - 1, ",\"" + std::string(field) + "\":" + deep);

    absl::StatusOr<ModelConfig> parsed = ParseHfLlamaConfig(text);
    ASSERT_FALSE(parsed.ok()) << field;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(parsed.status().message()),
                HasSubstr("nests 100001 levels deep"));

    Write(Path("hf/config.json"), text);
    absl::StatusOr<std::unique_ptr<HfLlamaReader>> reader =
        HfLlamaReader::Open(Path("hf"));
    ASSERT_FALSE(reader.ok()) << field;
    EXPECT_EQ(reader.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(reader.status().message()),
                HasSubstr(Path("hf") + ": config.json: the JSON nests"));
  }
}

// A shallow but huge value is quoted in an error as a short excerpt.
TEST_F(HfLlamaTest, HugeSettingIsQuotedShort) {
  for (const nlohmann::json& change : {
           nlohmann::json{{"head_dim", std::vector<int>(100'000, 64)}},
           nlohmann::json{{"rope_scaling", std::string(1 << 20, 'x')}},
           nlohmann::json{{"hidden_size", std::vector<int>(100'000, 1)}},
           nlohmann::json{{"model_type", std::vector<int>(100'000, 1)}},
       }) {
    nlohmann::json json = nlohmann::json::parse(kLlama32Config);
    json.merge_patch(change);
    absl::StatusOr<ModelConfig> config = ParseHfLlamaConfig(json.dump());
    ASSERT_FALSE(config.ok());
    EXPECT_LT(config.status().message().size(), 400u)
        << config.status().message().substr(0, 400);
  }
}

}  // namespace
}  // namespace shardtrain
