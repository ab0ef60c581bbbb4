// The safetensors format and Hugging Face's GPT-2 layout, without LibTorch:
// what we write is what the format specifies, what we read back is bit for
// bit what was written, and a malformed file is refused saying why.
#include "core/model/hf_gpt2.h"

#include <sys/stat.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/read_roots.h"
#include "core/model/llmc_layout.h"
#include "core/model/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace shardtrain {
namespace {

using ::testing::HasSubstr;

class HfFormatTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = ::testing::TempDir() + "hf_format_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Path(const std::string& name) const { return dir_ / name; }

  static std::string Read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  static void Write(const std::string& path, const std::string& bytes) {
    std::ofstream(path, std::ios::binary) << bytes;
  }
  // A file from a header's JSON text and data bytes, as the format lays
  // them out.
  static std::string File(const std::string& header, const std::string& data) {
    std::string out(8, '\0');
    const uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
    return out + header + data;
  }

  std::filesystem::path dir_;
};

// A small model's weights, random but with wte's padding rows zero, as our
// model holds them.
std::vector<std::vector<float>> RandomWeights(const ModelConfig& config,
                                              uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<std::vector<float>> weights;
  for (const std::vector<int64_t>& shape : LlmcParameterShapes(config)) {
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    std::vector<float> w(static_cast<size_t>(numel));
    for (float& x : w) x = normal(rng);
    weights.push_back(std::move(w));
  }
  std::fill(weights[0].begin() + config.vocab_size * config.n_embd,
            weights[0].end(), 0.0f);
  return weights;
}

WeightReader ReaderOf(const std::vector<std::vector<float>>& weights) {
  return [&weights](size_t index, float* out) {
    std::copy(weights[index].begin(), weights[index].end(), out);
    return absl::OkStatus();
  };
}

ModelConfig SmallConfig() {
  return *ParseModelSpec(
      "custom:n_layer=2,n_head=2,n_embd=16,block_size=32,vocab_size=100");
}

TEST_F(HfFormatTest, WritesTheLayoutTheFormatSpecifies) {
  const std::vector<float> a = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, -0.5f};
  const std::vector<float> b = {42.0f};
  ASSERT_TRUE(WriteSafetensors(Path("x.safetensors"),
                               {{"a",
                                 {2, 3},
                                 [&](float* out) {
                                   std::copy(a.begin(), a.end(), out);
                                   return absl::OkStatus();
                                 }},
                                {"b",
                                 {},
                                 [&](float* out) {
                                   *out = b[0];
                                   return absl::OkStatus();
                                 }}},
                               {{"format", "pt"}})
                  .ok());

  const std::string bytes = Read(Path("x.safetensors"));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | static_cast<uint8_t>(bytes[i]);
  ASSERT_LE(8 + n, bytes.size());
  EXPECT_EQ((8 + n) % 8, 0u) << "the data starts 8-byte aligned";
  const std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.front(), '{');
  const nlohmann::json json = nlohmann::json::parse(header);
  EXPECT_EQ(json["__metadata__"]["format"], "pt");
  EXPECT_EQ(json["a"]["dtype"], "F32");
  EXPECT_EQ(json["a"]["shape"], nlohmann::json({2, 3}));
  EXPECT_EQ(json["a"]["data_offsets"], nlohmann::json({0, 24}));
  EXPECT_EQ(json["b"]["shape"], nlohmann::json::array());
  EXPECT_EQ(json["b"]["data_offsets"], nlohmann::json({24, 28}));
  ASSERT_EQ(bytes.size(), 8 + n + 28);
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + n, a.data(), 24), 0);
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + n + 24, b.data(), 4), 0);

  absl::StatusOr<SafetensorsFile> file =
      SafetensorsFile::Open(Path("x.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  std::vector<float> back(6);
  ASSERT_TRUE(file->ReadAsFloat(*file->Find("a"), back.data()).ok());
  EXPECT_EQ(back, a);
}

TEST_F(HfFormatTest, HalfAndBfloat16AreWidenedExactly) {
  // F16: 1, -2, 65504 (largest), 2^-24 (smallest subnormal), +inf.
  const std::vector<uint16_t> f16 = {0x3c00, 0xc000, 0x7bff, 0x0001, 0x7c00};
  // BF16: 1, -3.
  const std::vector<uint16_t> bf16 = {0x3f80, 0xc040};
  std::string data(reinterpret_cast<const char*>(f16.data()), 10);
  data.append(reinterpret_cast<const char*>(bf16.data()), 4);
  Write(Path("h.safetensors"),
        File(R"({"h":{"dtype":"F16","shape":[5],"data_offsets":[0,10]},)"
             R"("b":{"dtype":"BF16","shape":[2],"data_offsets":[10,14]}})",
             data));
  absl::StatusOr<SafetensorsFile> file =
      SafetensorsFile::Open(Path("h.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  std::vector<float> h(5), b(2);
  ASSERT_TRUE(file->ReadAsFloat(*file->Find("h"), h.data()).ok());
  ASSERT_TRUE(file->ReadAsFloat(*file->Find("b"), b.data()).ok());
  EXPECT_EQ(h[0], 1.0f);
  EXPECT_EQ(h[1], -2.0f);
  EXPECT_EQ(h[2], 65504.0f);
  EXPECT_EQ(h[3], std::ldexp(1.0f, -24));
  EXPECT_TRUE(std::isinf(h[4]) && h[4] > 0);
  EXPECT_EQ(b[0], 1.0f);
  EXPECT_EQ(b[1], -3.0f);
}

TEST_F(HfFormatTest, AMalformedFileIsRefusedSayingWhy) {
  const std::string f32x2(8, '\0');
  const std::string ok_entry =
      R"("t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const struct {
    std::string name, bytes, error;
  } cases[] = {
      {"shorter than the length", "\x05\x00\x00", "truncated"},
      {"header past the end", File("{}", "").substr(0, 9), "truncated"},
      {"huge header", std::string("\x01\x00\x00\x01\x00\x00\x00\x00", 8),
       "at most"},
      {"not an object", File("[1,2]", ""), "start with '{'"},
      {"not JSON", File("{\"t\":", ""), "not a JSON object"},
      {"nested deep", File("{\"t\":{\"a\":[[[[1]]]]}}", ""), "nests deeper"},
      {"a name twice", File("{" + ok_entry + "," + ok_entry + "}", f32x2),
       "has the key 't' twice"},
      {"a key twice in an entry",
       File(
           R"({"t":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
           f32x2),
       "has the key 'dtype' twice"},
      {"too many dimensions",
       File(
           R"({"t":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,2],"data_offsets":[0,8]}})",
           f32x2),
       "more than 16 dimensions"},
      {"unknown dtype",
       File(R"({"t":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", f32x2),
       "dtype \"F33\""},
      {"negative dim",
       File(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})",
            f32x2),
       "non-negative integer"},
      {"span is not the shape's bytes",
       File(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", f32x2),
       "needs 12 bytes but data_offsets span 8"},
      {"huge shape",
       File(
           R"({"t":{"dtype":"F32","shape":[4611686018427387903,4611686018427387903],"data_offsets":[0,8]}})",
           f32x2),
       "needs more than the file's"},
      {"data cut short", File("{" + ok_entry + "}", f32x2.substr(0, 5)),
       "truncated file"},
      {"a hole",
       File(R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", f32x2),
       "leaving a hole"},
      {"overlap",
       File(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
            R"("u":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
            f32x2),
       "overlapping"},
      {"bytes after the tensors", File("{" + ok_entry + "}", f32x2 + "xx"),
       "not part of any tensor"},
      {"metadata not strings", File(R"({"__metadata__":{"n":1}})", ""),
       "__metadata__.n"},
      {"extra key",
       File(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})",
            f32x2),
       "exactly dtype, shape and data_offsets"},
  };
  for (const auto& c : cases) {
    Write(Path("bad.safetensors"), c.bytes);
    absl::StatusOr<SafetensorsFile> file =
        SafetensorsFile::Open(Path("bad.safetensors"));
    ASSERT_FALSE(file.ok()) << c.name;
    EXPECT_THAT(file.status().message(), HasSubstr(c.error)) << c.name;
    EXPECT_THAT(file.status().message(), HasSubstr("bad.safetensors"))
        << c.name;
  }
  // A zero-sized tensor whose other dimensions are huge: 0 elements, and
  // no overflow on the way.
  Write(
      Path("zero.safetensors"),
      File(
          R"({"z":{"dtype":"F32","shape":[2305843009213693952,2305843009213693952,0],"data_offsets":[0,0]},)"
          R"("__metadata__":null})",
          ""));
  absl::StatusOr<SafetensorsFile> zero =
      SafetensorsFile::Open(Path("zero.safetensors"));
  ASSERT_TRUE(zero.ok()) << zero.status();
  EXPECT_EQ(zero->Find("z")->numel(), 0);

  EXPECT_EQ(SafetensorsFile::Open(Path("missing")).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(HfFormatTest, ExportThenImportIsBitExact) {
  const ModelConfig config = SmallConfig();
  const std::vector<std::vector<float>> weights = RandomWeights(config, 7);
  ASSERT_TRUE(WriteHfGpt2(config, ReaderOf(weights), Path("hf")).ok());

  absl::StatusOr<std::unique_ptr<HfGpt2Reader>> reader =
      HfGpt2Reader::Open(Path("hf"));
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_TRUE((*reader)->config().SameShape(config));
  for (size_t i = 0; i < weights.size(); ++i) {
    std::vector<float> back(weights[i].size(), -1.0f);
    ASSERT_TRUE((*reader)->Read(i, back.data()).ok());
    EXPECT_EQ(std::memcmp(back.data(), weights[i].data(), back.size() * 4), 0)
        << LlmcParameterNames(config)[i];
  }
}

TEST_F(HfFormatTest, StoresHuggingFaceNamesShapesAndConv1dTransposition) {
  const ModelConfig config = SmallConfig();  // C = 16, V = 100 (padded 128)
  const std::vector<std::vector<float>> weights = RandomWeights(config, 8);
  ASSERT_TRUE(WriteHfGpt2(config, ReaderOf(weights), Path("hf")).ok());

  const nlohmann::json json =
      nlohmann::json::parse(Read(Path("hf/config.json")));
  EXPECT_EQ(json["architectures"], nlohmann::json({"GPT2LMHeadModel"}));
  EXPECT_EQ(json["model_type"], "gpt2");
  EXPECT_EQ(json["n_embd"], 16);
  EXPECT_EQ(json["n_layer"], 2);
  EXPECT_EQ(json["n_head"], 2);
  EXPECT_EQ(json["n_positions"], 32);
  EXPECT_EQ(json["vocab_size"], 100);
  EXPECT_EQ(json["activation_function"], "gelu_new");
  EXPECT_EQ(json["tie_word_embeddings"], true);

  absl::StatusOr<SafetensorsFile> file =
      SafetensorsFile::Open(Path("hf/model.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata().at("format"), "pt");
  EXPECT_EQ(file->tensors().front().name, "transformer.wte.weight");
  EXPECT_EQ(file->Find("transformer.wte.weight")->shape,
            (std::vector<int64_t>{100, 16}))
      << "the padding rows are not stored";
  EXPECT_EQ(file->Find("lm_head.weight"), nullptr) << "tied to wte";
  // c_attn: ours [3C, C] = [out, in]; Hugging Face's Conv1D [C, 3C].
  const std::vector<std::string> names = LlmcParameterNames(config);
  const size_t c_attn =
      std::find(names.begin(), names.end(), "h.1.attn.c_attn.weight") -
      names.begin();
  const SafetensorsEntry* stored =
      file->Find("transformer.h.1.attn.c_attn.weight");
  ASSERT_NE(stored, nullptr);
  EXPECT_EQ(stored->shape, (std::vector<int64_t>{16, 48}));
  std::vector<float> hf(16 * 48);
  ASSERT_TRUE(file->ReadAsFloat(*stored, hf.data()).ok());
  for (int64_t out = 0; out < 48; ++out) {
    for (int64_t in = 0; in < 16; ++in) {
      ASSERT_EQ(hf[in * 48 + out], weights[c_attn][out * 16 + in]);
    }
  }
}

TEST_F(HfFormatTest, ReadsFilesWithoutThePrefixAndIgnoresBuffersAndTiedHead) {
  // As the original "gpt2" upload names them: "h.0.attn.c_attn.weight", with
  // the attention-mask buffers and no prefix.
  const ModelConfig config = SmallConfig();
  const std::vector<std::vector<float>> weights = RandomWeights(config, 9);
  ASSERT_TRUE(WriteHfGpt2(config, ReaderOf(weights), Path("hf")).ok());
  absl::StatusOr<SafetensorsFile> written =
      SafetensorsFile::Open(Path("hf/model.safetensors"));
  ASSERT_TRUE(written.ok());
  std::vector<SafetensorsTensor> renamed;
  for (const SafetensorsEntry& e : written->tensors()) {
    renamed.push_back(
        {e.name.substr(std::strlen("transformer.")), e.shape,
         [&, e](float* out) { return written->ReadAsFloat(e, out); }});
  }
  renamed.push_back({"h.0.attn.bias", {1, 1, 32, 32}, [](float* out) {
                       std::fill(out, out + 32 * 32, 1.0f);
                       return absl::OkStatus();
                     }});
  renamed.push_back({"lm_head.weight", {100, 16}, [&](float* out) {
                       std::copy(weights[0].begin(), weights[0].begin() + 1600,
                                 out);
                       return absl::OkStatus();
                     }});
  std::filesystem::create_directories(Path("plain"));
  std::filesystem::copy_file(Path("hf/config.json"), Path("plain/config.json"));
  ASSERT_TRUE(
      WriteSafetensors(Path("plain/model.safetensors"), renamed, {}).ok());

  absl::StatusOr<std::unique_ptr<HfGpt2Reader>> reader =
      HfGpt2Reader::Open(Path("plain"));
  ASSERT_TRUE(reader.ok()) << reader.status();
  std::vector<float> wte(weights[0].size());
  ASSERT_TRUE((*reader)->Read(0, wte.data()).ok());
  EXPECT_EQ(wte, weights[0]);
}

TEST_F(HfFormatTest, ANonDefaultVocabularyPaddingSurvivesTheRoundTrip) {
  const ModelConfig config = *ParseModelSpec(
      "custom:n_layer=1,n_head=2,n_embd=16,block_size=32,vocab_size=100,"
      "padded_vocab_size=160");
  const std::vector<std::vector<float>> weights = RandomWeights(config, 10);
  ASSERT_TRUE(WriteHfGpt2(config, ReaderOf(weights), Path("hf")).ok());
  absl::StatusOr<std::unique_ptr<HfGpt2Reader>> reader =
      HfGpt2Reader::Open(Path("hf"));
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->config().padded_vocab_size, 160);
}

TEST_F(HfFormatTest, APaddingTheTensorsCannotHoldIsRefused) {
  // The padding is metadata: believed, 16,777,216 rows made an export
  // allocate and write 8 GiB from a 27 MB input.
  const ModelConfig config = *ParseModelSpec(
      "custom:n_layer=1,n_head=2,n_embd=16,block_size=32,vocab_size=100,"
      "padded_vocab_size=160");
  const std::vector<std::vector<float>> weights = RandomWeights(config, 10);
  ASSERT_TRUE(WriteHfGpt2(config, ReaderOf(weights), Path("hf")).ok());
  const std::string file = Read(Path("hf/model.safetensors"));
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = length << 8 | uint8_t(file[i]);
  std::string header = file.substr(8, length);
  const std::string from = "\"shardtrain.padded_vocab_size\":\"160\"";
  ASSERT_NE(header.find(from), std::string::npos) << header;
  header.replace(header.find(from), from.size(),
                 "\"shardtrain.padded_vocab_size\":\"16777216\"");
  Write(Path("hf/model.safetensors"), File(header, file.substr(8 + length)));
  absl::StatusOr<std::unique_ptr<HfGpt2Reader>> reader =
      HfGpt2Reader::Open(Path("hf"));
  ASSERT_EQ(reader.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(reader.status().message(),
              HasSubstr("padded_vocab_size = 16777216 pads vocab_size 100 "
                        "beyond 1024"));
}

TEST_F(HfFormatTest, UnderAPathRootFilesLinkedOutsideAreRefusedUnread) {
  const ModelConfig config = SmallConfig();
  const std::vector<std::vector<float>> weights = RandomWeights(config, 12);
  std::filesystem::create_directories(Path("root"));
  std::filesystem::create_directories(Path("outside"));
  ASSERT_TRUE(WriteHfGpt2(config, ReaderOf(weights), Path("root/hf")).ok());
  // The outside file's first 8 bytes, read as a header length, once showed
  // in the error ("a header of 4995128901736877908 bytes").
  Write(Path("outside/secret"), "SECRET-BYTES-OF-SOMEONE-ELSE");
  std::filesystem::remove(Path("root/hf/model.safetensors"));
  std::filesystem::create_symlink(Path("outside/secret"),
                                  Path("root/hf/model.safetensors"));
  const std::string root = std::filesystem::canonical(Path("root")).string();
  ::setenv(kReadRootsEnv, root.c_str(), 1);
  absl::StatusOr<std::unique_ptr<HfGpt2Reader>> reader =
      HfGpt2Reader::Open(Path("root/hf"));
  ::unsetenv(kReadRootsEnv);
  ASSERT_EQ(reader.status().code(), absl::StatusCode::kPermissionDenied)
      << reader.status();
  EXPECT_THAT(reader.status().message(),
              HasSubstr("outside the directories jobs may read"));
  EXPECT_THAT(std::string(reader.status().message()),
              ::testing::Not(::testing::ContainsRegex("SECRET|header of")));
}

TEST_F(HfFormatTest, AConfigThatIsAFifoIsRefusedWithoutWaiting) {
  std::filesystem::create_directories(Path("hf"));
  ASSERT_EQ(::mkfifo(Path("hf/config.json").c_str(), 0600), 0);
  absl::StatusOr<std::unique_ptr<HfGpt2Reader>> reader =
      HfGpt2Reader::Open(Path("hf"));
  EXPECT_THAT(reader.status().message(), HasSubstr("a FIFO"));
}

TEST_F(HfFormatTest, ExportRefusesWeightsInThePaddingRows) {
  const ModelConfig config = SmallConfig();
  std::vector<std::vector<float>> weights = RandomWeights(config, 11);
  weights[0].back() = 1.0f;
  const absl::Status s = WriteHfGpt2(config, ReaderOf(weights), Path("hf"));
  EXPECT_THAT(s.message(), HasSubstr("padding row 127"));
  EXPECT_FALSE(std::filesystem::exists(Path("hf/model.safetensors")));
}

TEST_F(HfFormatTest, ConfigsWeCannotBuildAreRefusedNamingTheSetting) {
  const std::string base =
      R"("n_embd":16,"n_layer":2,"n_head":2,"n_positions":32,"vocab_size":100)";
  EXPECT_TRUE(ParseHfModelConfig("{" + base + "}").ok());
  EXPECT_EQ(ParseHfModelConfig("{" + base + "}")->padded_vocab_size, 128);
  EXPECT_EQ(
      ParseHfModelConfig(HfModelConfigJson(*ModelConfig::FromPreset("gpt2")))
          ->name,
      "gpt2");
  const struct {
    std::string extra, error;
  } cases[] = {
      {R"("activation_function":"relu")", "activation_function is \"relu\""},
      {R"("n_inner":100)", "n_inner is 100"},
      {R"("tie_word_embeddings":false)", "tie_word_embeddings is false"},
      {R"("layer_norm_epsilon":1e-6)", "layer_norm_epsilon"},
      {R"("scale_attn_by_inverse_layer_idx":true)",
       "scale_attn_by_inverse_layer_idx is true"},
      {R"("model_type":"llama")", "model_type is \"llama\""},
  };
  for (const auto& c : cases) {
    absl::StatusOr<ModelConfig> config =
        ParseHfModelConfig("{" + base + "," + c.extra + "}");
    ASSERT_FALSE(config.ok()) << c.extra;
    EXPECT_THAT(config.status().message(), HasSubstr(c.error));
  }
  EXPECT_THAT(ParseHfModelConfig(R"({"n_layer":2})").status().message(),
              HasSubstr("no \"n_embd\""));
  EXPECT_THAT(ParseHfModelConfig("{\"n_embd\":-3}").status().message(),
              HasSubstr("not a positive integer"));
  EXPECT_THAT(ParseHfModelConfig("not json").status().message(),
              HasSubstr("not a JSON object"));
  // Nested 100,000 deep: refused before it is parsed, never recursed on.
  const std::string deep =
      std::string(100'000, '[') + std::string(100'000, ']');
  EXPECT_THAT(ParseHfModelConfig("{" + base + ",\"n_inner\":" + deep + "}")
                  .status()
                  .message(),
              HasSubstr("nests 100001 levels deep"));
}

TEST_F(HfFormatTest, AMissingOrMisshapenWeightIsRefusedNamingIt) {
  const ModelConfig config = SmallConfig();
  const std::vector<std::vector<float>> weights = RandomWeights(config, 12);
  ASSERT_TRUE(WriteHfGpt2(config, ReaderOf(weights), Path("hf")).ok());
  // Another config with a larger block: wpe no longer fits.
  std::string text = Read(Path("hf/config.json"));
  nlohmann::json json = nlohmann::json::parse(text);
  json["n_positions"] = 64;
  Write(Path("hf/config.json"), json.dump());
  EXPECT_THAT(HfGpt2Reader::Open(Path("hf")).status().message(),
              HasSubstr("transformer.wpe.weight is [32, 16], but config.json's "
                        "model needs [64, 16]"));
  // One layer more than the file has.
  json["n_positions"] = 32;
  json["n_layer"] = 3;
  Write(Path("hf/config.json"), json.dump());
  EXPECT_THAT(HfGpt2Reader::Open(Path("hf")).status().message(),
              HasSubstr("has no transformer.h.2.ln_1.weight"));
  // A weight that is not GPT-2's.
  json["n_layer"] = 1;
  Write(Path("hf/config.json"), json.dump());
  EXPECT_THAT(HfGpt2Reader::Open(Path("hf")).status().message(),
              HasSubstr("holds 'transformer.h.1."));
  std::filesystem::remove(Path("hf/model.safetensors"));
  EXPECT_THAT(HfGpt2Reader::Open(Path("hf")).status().message(),
              HasSubstr("model.safetensors"));
}

}  // namespace
}  // namespace shardtrain
