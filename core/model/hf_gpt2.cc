#include "core/model/hf_gpt2.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "common/input_file.h"
#include "common/json_excerpt.h"
#include "core/model/hf_settings.h"
#include "nlohmann/json.hpp"

namespace shardtrain {
namespace {

constexpr char kPrefix[] = "transformer.";
// Where a non-default padding of wte is kept (Hugging Face has no such
// setting; the rows are dropped from the file either way).
constexpr char kPaddedVocabKey[] = "shardtrain.padded_vocab_size";

int64_t DefaultPadding(int64_t vocab_size) {
  return (vocab_size + kVocabPadMultiple - 1) / kVocabPadMultiple *
         kVocabPadMultiple;
}

// Conv1D weights: stored [in, out] by Hugging Face, [out, in] by us.
bool IsConv1dWeight(const std::string& ours) {
  return absl::EndsWith(ours, ".attn.c_attn.weight") ||
         absl::EndsWith(ours, ".attn.c_proj.weight") ||
         absl::EndsWith(ours, ".mlp.c_fc.weight") ||
         absl::EndsWith(ours, ".mlp.c_proj.weight");
}

// The tensor's shape in the Hugging Face file.
std::vector<int64_t> HfShape(const ModelConfig& config, const std::string& ours,
                             const std::vector<int64_t>& shape) {
  if (ours == "wte.weight") return {config.vocab_size, config.n_embd};
  if (IsConv1dWeight(ours)) return {shape[1], shape[0]};
  return shape;
}

// Tensors a Hugging Face GPT-2 file may hold that are not weights we read:
// the causal-mask buffers of older transformers versions, and the LM head,
// which is tied to wte (the config refuses untied heads).
bool IsIgnoredTensor(const std::string& name) {
  std::string n = name;
  if (absl::StartsWith(n, kPrefix)) n = n.substr(sizeof(kPrefix) - 1);
  return n == "lm_head.weight" || (absl::StartsWith(n, "h.") &&
                                   (absl::EndsWith(n, ".attn.bias") ||
                                    absl::EndsWith(n, ".attn.masked_bias")));
}

void Transpose(const float* in, int64_t rows, int64_t cols, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = in[r * cols + c];
  }
}

// config.json is a page of settings; 1 MiB is far more than any has.
absl::StatusOr<std::string> ReadText(const std::string& path) {
  return ReadInputFile(path, int64_t{1} << 20, "a model config");
}

// The padding a model may carry beyond its vocabulary: Hugging Face files
// drop the padded rows, so the metadata's figure is checked against what
// any trainer pads to (a multiple of 128 times the tensor-parallel degree, up
// to 1,024) rather than believed.
constexpr int64_t kMaxVocabPadMultiple = 1024;

}  // namespace

bool IsHfModelDir(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_directory(path, ec) &&
         std::filesystem::exists(std::filesystem::path(path) / kHfConfigFile,
                                 ec);
}

std::string HfGpt2TensorName(const std::string& ours) {
  return absl::StrCat(kPrefix, ours);
}

std::string HfModelConfigJson(const ModelConfig& config) {
  nlohmann::ordered_json json = {
      {"architectures", {"GPT2LMHeadModel"}},
      {"model_type", "gpt2"},
      {"vocab_size", config.vocab_size},
      {"n_positions", config.block_size},
      {"n_ctx", config.block_size},
      {"n_embd", config.n_embd},
      {"n_layer", config.n_layer},
      {"n_head", config.n_head},
      {"n_inner", nullptr},
      {"activation_function", "gelu_new"},
      {"layer_norm_epsilon", 1e-5},
      {"resid_pdrop", 0.0},
      {"embd_pdrop", 0.0},
      {"attn_pdrop", 0.0},
      {"initializer_range", 0.02},
      {"scale_attn_weights", true},
      {"scale_attn_by_inverse_layer_idx", false},
      {"tie_word_embeddings", true},
      {"use_cache", true},
      {"torch_dtype", "float32"},
  };
  // GPT-2's <|endoftext|> when the vocabulary has it; else none (GPT2Config's
  // default, 50256, would name a token past the vocabulary).
  const nlohmann::ordered_json end_of_text =
      config.vocab_size > 50256 ? nlohmann::ordered_json(50256) : nullptr;
  json["bos_token_id"] = end_of_text;
  json["eos_token_id"] = end_of_text;
  return json.dump(2) + "\n";
}

absl::StatusOr<ModelConfig> ParseHfModelConfig(std::string_view json_text,
                                               int64_t padded_vocab_size) {
  if (absl::Status s =
          CheckJsonNesting(json_text, kMaxHfJsonNesting, "the JSON");
      !s.ok()) {
    return s;
  }
  const nlohmann::json json =
      nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object()) {
    return absl::InvalidArgumentError("not a JSON object");
  }
  auto text = [&](const char* name, const char* fallback) {
    return HfTextSetting(json, name, fallback);
  };
  if (const std::string type = text("model_type", "gpt2"); type != "gpt2") {
    return absl::InvalidArgumentError(absl::StrCat(
        "model_type is \"", type, "\"; only GPT-2 (\"gpt2\") models load"));
  }
  ModelConfig config;
  for (auto [field, name] : {std::pair{&config.n_embd, "n_embd"},
                             std::pair{&config.n_layer, "n_layer"},
                             std::pair{&config.n_head, "n_head"},
                             std::pair{&config.vocab_size, "vocab_size"}}) {
    absl::StatusOr<int64_t> v = HfIntSetting(json, name);
    if (!v.ok()) return v.status();
    *field = *v;
  }
  absl::StatusOr<int64_t> positions = HfIntSetting(
      json, json.contains("n_positions") ? "n_positions" : "n_ctx");
  if (!positions.ok()) return positions.status();
  config.block_size = *positions;
  const std::string activation = text("activation_function", "gelu_new");
  if (activation != "gelu_new" && activation != "gelu_pytorch_tanh") {
    return absl::InvalidArgumentError(
        absl::StrCat("activation_function is \"", activation,
                     "\"; the model uses GPT-2's tanh GELU (\"gelu_new\")"));
  }
  if (json.contains("n_inner") && !json["n_inner"].is_null() &&
      json["n_inner"] != nlohmann::json(4 * config.n_embd)) {
    return absl::InvalidArgumentError(
        absl::StrCat("n_inner is ", JsonExcerpt(json["n_inner"]),
                     "; the model's MLP is 4 * n_embd = ", 4 * config.n_embd));
  }
  if (json.contains("layer_norm_epsilon") &&
      (!json["layer_norm_epsilon"].is_number() ||
       json["layer_norm_epsilon"].get<double>() != 1e-5)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer_norm_epsilon is ", JsonExcerpt(json["layer_norm_epsilon"]),
        "; the model's layer norms use 1e-5"));
  }
  for (auto [name, wanted, why] :
       {std::tuple{"tie_word_embeddings", true,
                   "the LM head is tied to the token embedding"},
        std::tuple{"scale_attn_weights", true,
                   "attention is scaled by 1/sqrt(head size)"},
        std::tuple{"scale_attn_by_inverse_layer_idx", false,
                   "attention is not scaled by layer"}}) {
    absl::StatusOr<bool> v = HfFlagSetting(json, name, wanted);
    if (!v.ok()) return v.status();
    if (*v != wanted) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " is ", *v ? "true" : "false", "; in the model ", why));
    }
  }
  const int64_t most_padding = (config.vocab_size + kMaxVocabPadMultiple - 1) /
                               kMaxVocabPadMultiple * kMaxVocabPadMultiple;
  if (padded_vocab_size > most_padding) {
    return absl::InvalidArgumentError(absl::StrCat(
        kPaddedVocabKey, " = ", padded_vocab_size, " pads vocab_size ",
        config.vocab_size, " beyond ", most_padding, " (the next multiple of ",
        kMaxVocabPadMultiple,
        "); the file's metadata disagrees with its tensors"));
  }
  config.padded_vocab_size = padded_vocab_size > 0
                                 ? padded_vocab_size
                                 : DefaultPadding(config.vocab_size);
  config.name = "custom";
  for (const std::string& preset : ModelConfig::PresetNames()) {
    if (ModelConfig::FromPreset(preset)->SameShape(config))
      config.name = preset;
  }
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  return config;
}

absl::Status WriteHfGpt2(const ModelConfig& config, const WeightReader& read,
                         const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create ", dir, ": ", ec.message()));
  }
  const std::vector<std::string> names = LlmcParameterNames(config);
  const std::vector<std::vector<int64_t>> shapes = LlmcParameterShapes(config);
  // Hugging Face's order: wte, wpe, then block by block, then ln_f.
  std::vector<size_t> order = {0, 1};
  for (int64_t layer = 0; layer < config.n_layer; ++layer) {
    for (size_t member = 0; member < 12; ++member) {
      order.push_back(2 + member * config.n_layer + layer);
    }
  }
  order.push_back(names.size() - 2);
  order.push_back(names.size() - 1);

  std::vector<SafetensorsTensor> tensors;
  for (size_t index : order) {
    const std::string& ours = names[index];
    const std::vector<int64_t> shape = shapes[index];
    SafetensorsTensor t;
    t.name = HfGpt2TensorName(ours);
    t.shape = HfShape(config, ours, shape);
    const int64_t vocab = config.vocab_size;
    t.fill = [&read, index, ours, shape, vocab](float* out) -> absl::Status {
      int64_t numel = 1;
      for (int64_t d : shape) numel *= d;
      std::vector<float> buffer(static_cast<size_t>(numel));
      if (absl::Status s = read(index, buffer.data()); !s.ok()) return s;
      if (IsConv1dWeight(ours)) {
        Transpose(buffer.data(), shape[0], shape[1], out);
        return absl::OkStatus();
      }
      // wte: the first vocab_size rows; the padding must be the zeros an
      // import puts back, or the round trip would not be exact.
      const int64_t kept = ours == "wte.weight" ? vocab * shape[1] : numel;
      for (int64_t i = kept; i < numel; ++i) {
        if (buffer[i] != 0.0f) {
          return absl::FailedPreconditionError(absl::StrCat(
              "wte's padding row ", i / shape[1], " (past vocab_size ", vocab,
              ") is not zero; Hugging Face's format has no room for it"));
        }
      }
      std::copy(buffer.begin(), buffer.begin() + kept, out);
      return absl::OkStatus();
    };
    tensors.push_back(std::move(t));
  }
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  if (config.padded_vocab_size != DefaultPadding(config.vocab_size)) {
    metadata[kPaddedVocabKey] = std::to_string(config.padded_vocab_size);
  }
  const std::string weights = (std::filesystem::path(dir) / kHfWeightsFile);
  if (absl::Status s = WriteSafetensors(weights, tensors, metadata); !s.ok()) {
    return s;
  }
  return WriteFileAtomically(
      (std::filesystem::path(dir) / kHfConfigFile).string(),
      HfModelConfigJson(config));
}

absl::StatusOr<std::unique_ptr<HfGpt2Reader>> HfGpt2Reader::Open(
    const std::string& dir) {
  const std::string label = absl::StrCat("Hugging Face model ", dir);
  const std::filesystem::path root(dir);
  absl::StatusOr<std::string> config_text =
      ReadText((root / kHfConfigFile).string());
  if (!config_text.ok()) {
    return absl::Status(
        config_text.status().code(),
        absl::StrCat(label, ": ", config_text.status().message()));
  }
  absl::StatusOr<SafetensorsFile> file =
      SafetensorsFile::Open((root / kHfWeightsFile).string());
  if (!file.ok()) {
    return absl::Status(file.status().code(),
                        absl::StrCat(label, ": ", file.status().message()));
  }
  int64_t padded = 0;
  if (auto it = file->metadata().find(kPaddedVocabKey);
      it != file->metadata().end() && !absl::SimpleAtoi(it->second, &padded)) {
    return absl::InvalidArgumentError(absl::StrCat(
        label, ": metadata ", kPaddedVocabKey, " is not an integer"));
  }
  absl::StatusOr<ModelConfig> config = ParseHfModelConfig(*config_text, padded);
  if (!config.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        label, ": ", kHfConfigFile, ": ", config.status().message()));
  }
  // Every weight, once, with its shape; nothing else but what is ignored.
  const std::vector<std::string> names = LlmcParameterNames(*config);
  const std::vector<std::vector<int64_t>> shapes = LlmcParameterShapes(*config);
  std::map<std::string, size_t> wanted;  // unprefixed name -> llm.c index
  for (size_t i = 0; i < names.size(); ++i) wanted[names[i]] = i;
  std::vector<size_t> entries(names.size(), SIZE_MAX);
  const std::vector<SafetensorsEntry>& tensors = file->tensors();
  for (size_t e = 0; e < tensors.size(); ++e) {
    const std::string& name = tensors[e].name;
    if (IsIgnoredTensor(name)) continue;
    const std::string ours = absl::StartsWith(name, kPrefix)
                                 ? name.substr(sizeof(kPrefix) - 1)
                                 : name;
    auto it = wanted.find(ours);
    if (it == wanted.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          label, ": ", kHfWeightsFile, " holds '", name,
          "', which is not a weight of GPT2LMHeadModel ", config->ToSpec()));
    }
    if (entries[it->second] != SIZE_MAX) {
      return absl::InvalidArgumentError(absl::StrCat(
          label, ": ", kHfWeightsFile, " holds ", ours,
          " twice (with and without the \"transformer.\" prefix)"));
    }
    if (absl::Status s =
            CheckHfWeight(label, name, tensors[e],
                          HfShape(*config, ours, shapes[it->second]));
        !s.ok()) {
      return s;
    }
    entries[it->second] = e;
  }
  for (size_t i = 0; i < names.size(); ++i) {
    if (entries[i] == SIZE_MAX) {
      return absl::InvalidArgumentError(absl::StrCat(
          label, ": ", kHfWeightsFile, " has no ", HfGpt2TensorName(names[i])));
    }
  }
  return std::unique_ptr<HfGpt2Reader>(
      new HfGpt2Reader(*config, std::move(*file), std::move(entries)));
}

absl::Status HfGpt2Reader::Read(size_t index, float* out) const {
  if (index >= names_.size()) {
    return absl::OutOfRangeError(absl::StrCat("no weight ", index));
  }
  const std::string& ours = names_[index];
  const SafetensorsEntry& entry = file_.tensors()[entries_[index]];
  if (IsConv1dWeight(ours)) {
    std::vector<float> stored(static_cast<size_t>(entry.numel()));
    if (absl::Status s = file_.ReadAsFloat(entry, stored.data()); !s.ok()) {
      return s;
    }
    Transpose(stored.data(), entry.shape[0], entry.shape[1], out);
    return absl::OkStatus();
  }
  if (absl::Status s = file_.ReadAsFloat(entry, out); !s.ok()) return s;
  if (ours == "wte.weight") {
    std::fill(out + entry.numel(),
              out + config_.padded_vocab_size * config_.n_embd, 0.0f);
  }
  return absl::OkStatus();
}

}  // namespace shardtrain
