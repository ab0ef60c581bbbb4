#include "core/model/hf_llama.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "common/input_file.h"
#include "common/json_excerpt.h"
#include "core/model/hf_settings.h"
#include "nlohmann/json.hpp"

namespace shardtrain {
namespace {

constexpr char kConfigFile[] = "config.json";
constexpr char kWeightsFile[] = "model.safetensors";
constexpr char kLlamaPrefix[] = "model.";
// config.json is a page of settings; an index names a few thousand tensors.
constexpr int64_t kMaxConfigBytes = int64_t{1} << 20;
constexpr int64_t kMaxIndexBytes = int64_t{16} << 20;
constexpr size_t kMaxShardFiles = 4096;

bool IsVocabularyRows(const std::string& ours) {
  return ours == "embed_tokens.weight" || ours == "lm_head.weight";
}

// The tensor's shape in the Hugging Face file: vocab_size rows, not padded.
std::vector<int64_t> LlamaHfShape(const ModelConfig& config,
                                  const std::string& ours,
                                  std::vector<int64_t> shape) {
  if (IsVocabularyRows(ours)) shape[0] = config.vocab_size;
  return shape;
}

// Buffers older transformers versions saved beside the weights.
bool IsIgnoredLlamaTensor(const std::string& name) {
  return absl::EndsWith(name, ".self_attn.rotary_emb.inv_freq");
}

}  // namespace

std::vector<std::string> LlamaParameterNames(const ModelConfig& config) {
  std::vector<std::string> names = {"embed_tokens.weight"};
  for (int64_t i = 0; i < config.n_layer; ++i) {
    const std::string b = absl::StrCat("layers.", i, ".");
    names.push_back(b + "input_layernorm.weight");
    for (const char* proj : {"q_proj", "k_proj", "v_proj"}) {
      names.push_back(absl::StrCat(b, "self_attn.", proj, ".weight"));
      if (config.attention_bias) {
        names.push_back(absl::StrCat(b, "self_attn.", proj, ".bias"));
      }
    }
    names.push_back(b + "self_attn.o_proj.weight");
    names.push_back(b + "post_attention_layernorm.weight");
    for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
      names.push_back(absl::StrCat(b, "mlp.", proj, ".weight"));
    }
  }
  names.push_back("norm.weight");
  if (!config.tied_head()) names.push_back("lm_head.weight");
  return names;
}

std::vector<std::vector<int64_t>> LlamaParameterShapes(
    const ModelConfig& config) {
  const int64_t c = config.n_embd, hs = config.head_size();
  const int64_t q = config.n_head * hs, kv = config.n_kv_head * hs;
  const int64_t mlp = config.intermediate_size;
  std::vector<std::vector<int64_t>> shapes;
  for (const std::string& name : LlamaParameterNames(config)) {
    std::vector<int64_t> shape;
    if (IsVocabularyRows(name)) {
      shape = {config.padded_vocab_size, c};
    } else if (absl::EndsWith(name, "norm.weight")) {
      shape = {c};
    } else if (absl::StrContains(name, "q_proj.")) {
      shape = absl::EndsWith(name, ".bias") ? std::vector<int64_t>{q}
                                            : std::vector<int64_t>{q, c};
    } else if (absl::StrContains(name, "k_proj.") ||
               absl::StrContains(name, "v_proj.")) {
      shape = absl::EndsWith(name, ".bias") ? std::vector<int64_t>{kv}
                                            : std::vector<int64_t>{kv, c};
    } else if (absl::StrContains(name, "o_proj.")) {
      shape = {c, q};
    } else if (absl::StrContains(name, "down_proj.")) {
      shape = {c, mlp};
    } else {  // gate_proj, up_proj
      shape = {mlp, c};
    }
    shapes.push_back(std::move(shape));
  }
  return shapes;
}

std::string HfLlamaTensorName(const std::string& ours) {
  return absl::StartsWith(ours, "lm_head.") ? ours
                                            : absl::StrCat(kLlamaPrefix, ours);
}

std::string HfModelType(std::string_view json_text) {
  if (JsonNestingDepth(json_text) > kMaxHfJsonNesting) return "";
  const nlohmann::json json =
      nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object()) return "";
  return HfTextSetting(json, "model_type", "gpt2");
}

std::string HfLlamaConfigJson(const ModelConfig& config) {
  // Llama's attention_bias biases o_proj as well; q/k/v biases alone are
  // Qwen 2's layout.
  const bool qwen = config.attention_bias;
  nlohmann::ordered_json json = {
      {"architectures", {qwen ? "Qwen2ForCausalLM" : "LlamaForCausalLM"}},
      {"model_type", qwen ? "qwen2" : "llama"},
      {"vocab_size", config.vocab_size},
      {"hidden_size", config.n_embd},
      {"intermediate_size", config.intermediate_size},
      {"num_hidden_layers", config.n_layer},
      {"num_attention_heads", config.n_head},
      {"num_key_value_heads", config.n_kv_head},
      {"head_dim", config.head_size()},
      {"max_position_embeddings", config.block_size},
      {"rms_norm_eps", config.norm_eps},
      {"rope_theta", config.rope_theta},
      {"hidden_act", "silu"},
      {"attention_dropout", 0.0},
      {"initializer_range", 0.02},
      {"tie_word_embeddings", config.tie_embeddings},
      {"use_cache", true},
      {"torch_dtype", "float32"},
      {"bos_token_id", nullptr},
      {"eos_token_id", nullptr},
  };
  if (!qwen) {
    json["attention_bias"] = false;
    json["mlp_bias"] = false;
    json["pretraining_tp"] = 1;
  } else {
    json["use_sliding_window"] = false;
  }
  const RopeScaling& r = config.rope_scaling;
  if (r.factor != 0) {
    json["rope_scaling"] = {{"rope_type", "llama3"},
                            {"factor", r.factor},
                            {"low_freq_factor", r.low_freq_factor},
                            {"high_freq_factor", r.high_freq_factor},
                            {"original_max_position_embeddings",
                             r.original_max_position_embeddings}};
  } else {
    json["rope_scaling"] = nullptr;
  }
  return json.dump(2) + "\n";
}

absl::StatusOr<ModelConfig> ParseHfLlamaConfig(std::string_view json_text) {
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
  const std::string type = HfTextSetting(json, "model_type", "");
  if (type != "llama" && type != "qwen2") {
    return absl::InvalidArgumentError(absl::StrCat(
        "model_type is \"", type,
        "\"; the Llama family loads as \"llama\" (LlamaForCausalLM) or "
        "\"qwen2\" (Qwen2ForCausalLM)"));
  }
  ModelConfig config;
  config.family = ModelFamily::kLlama;
  for (auto [field, name] :
       {std::pair{&config.n_embd, "hidden_size"},
        std::pair{&config.intermediate_size, "intermediate_size"},
        std::pair{&config.n_layer, "num_hidden_layers"},
        std::pair{&config.n_head, "num_attention_heads"},
        std::pair{&config.vocab_size, "vocab_size"},
        std::pair{&config.block_size, "max_position_embeddings"}}) {
    absl::StatusOr<int64_t> v = HfIntSetting(json, name);
    if (!v.ok()) return v.status();
    *field = *v;
  }
  absl::StatusOr<int64_t> kv =
      HfIntSetting(json, "num_key_value_heads", config.n_head);
  if (!kv.ok()) return kv.status();
  config.n_kv_head = *kv;
  if (json.contains("head_dim") && !json["head_dim"].is_null() &&
      json["head_dim"] != nlohmann::json(config.n_embd / config.n_head)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head_dim is ", JsonExcerpt(json["head_dim"]),
        "; the model's heads are hidden_size / num_attention_heads = ",
        config.n_embd / config.n_head));
  }
  absl::StatusOr<bool> interleaved =
      HfFlagSetting(json, "rope_interleaved", false);
  if (!interleaved.ok()) return interleaved.status();
  if (*interleaved) {
    return absl::InvalidArgumentError(
        "rope_interleaved is true; the model turns each head's first and "
        "second halves (Hugging Face's rotate-half), not interleaved pairs");
  }
  if (const std::string act = HfTextSetting(json, "hidden_act", "silu");
      act != "silu") {
    return absl::InvalidArgumentError(absl::StrCat(
        "hidden_act is \"", act, "\"; the model's MLP is SwiGLU (\"silu\")"));
  }
  absl::StatusOr<bool> mlp_bias = HfFlagSetting(json, "mlp_bias", false);
  if (!mlp_bias.ok()) return mlp_bias.status();
  if (*mlp_bias) {
    return absl::InvalidArgumentError(
        "mlp_bias is true; the model's MLP has no biases");
  }
  absl::StatusOr<bool> bias = HfFlagSetting(json, "attention_bias", false);
  if (!bias.ok()) return bias.status();
  if (type == "llama" && *bias) {
    return absl::InvalidArgumentError(
        "attention_bias is true; a Llama model with it biases o_proj too, and "
        "the model biases q, k and v only (Qwen 2's layout, model_type "
        "\"qwen2\")");
  }
  config.attention_bias = type == "qwen2";
  absl::StatusOr<bool> tied = HfFlagSetting(json, "tie_word_embeddings", false);
  if (!tied.ok()) return tied.status();
  config.tie_embeddings = *tied;
  absl::StatusOr<double> theta = HfNumberSetting(json, "rope_theta", 10000);
  if (!theta.ok()) return theta.status();
  config.rope_theta = *theta;
  absl::StatusOr<double> eps = HfNumberSetting(json, "rms_norm_eps", 1e-6);
  if (!eps.ok()) return eps.status();
  config.norm_eps = *eps;
  if (json.contains("rope_scaling") && !json["rope_scaling"].is_null()) {
    const nlohmann::json& r = json["rope_scaling"];
    if (!r.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rope_scaling is ", JsonExcerpt(r), ", not an object or null"));
    }
    const std::string rope_type =
        HfTextSetting(r, "rope_type", HfTextSetting(r, "type", "").c_str());
    if (rope_type != "llama3") {
      return absl::InvalidArgumentError(absl::StrCat(
          "rope_scaling.rope_type is \"", rope_type,
          "\"; the model scales rotary frequencies as Llama 3 does "
          "(\"llama3\") or not at all (null)"));
    }
    RopeScaling& s = config.rope_scaling;
    for (auto [field, name] :
         {std::pair{&s.factor, "factor"},
          std::pair{&s.low_freq_factor, "low_freq_factor"},
          std::pair{&s.high_freq_factor, "high_freq_factor"}}) {
      absl::StatusOr<double> v = HfNumberSetting(r, name, -1);
      if (!v.ok() || *v < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("rope_scaling.", name, " is missing or not a number"));
      }
      *field = *v;
    }
    absl::StatusOr<int64_t> original =
        HfIntSetting(r, "original_max_position_embeddings");
    if (!original.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("rope_scaling: ", original.status().message()));
    }
    s.original_max_position_embeddings = *original;
  }
  config.padded_vocab_size = (config.vocab_size + kVocabPadMultiple - 1) /
                             kVocabPadMultiple * kVocabPadMultiple;
  config.name = "custom";
  for (const std::string& preset : ModelConfig::PresetNames()) {
    if (ModelConfig::FromPreset(preset)->SameShape(config)) {
      config.name = preset;
    }
  }
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  return config;
}

absl::Status WriteHfLlama(const ModelConfig& config, const WeightReader& read,
                          const std::string& dir, int64_t max_shard_bytes) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create ", dir, ": ", ec.message()));
  }
  const std::vector<std::string> names = LlamaParameterNames(config);
  const std::vector<std::vector<int64_t>> shapes = LlamaParameterShapes(config);
  // Shards in order, each at most max_shard_bytes of F32 (a larger tensor
  // alone).
  std::vector<std::vector<SafetensorsTensor>> shards(1);
  int64_t shard_bytes = 0, total_bytes = 0;
  for (size_t index = 0; index < names.size(); ++index) {
    SafetensorsTensor t;
    t.name = HfLlamaTensorName(names[index]);
    t.shape = LlamaHfShape(config, names[index], shapes[index]);
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    const int64_t padded_numel =
        numel / t.shape[0] * shapes[index][0];  // our rows
    const bool vocab = IsVocabularyRows(names[index]);
    const std::string name = names[index];
    t.fill = [&read, index, numel, padded_numel, vocab,
              name](float* out) -> absl::Status {
      if (!vocab) return read(index, out);
      // The first vocab_size rows; the padding must be the zeros an import
      // puts back, or the round trip would not be exact.
      std::vector<float> buffer(static_cast<size_t>(padded_numel));
      if (absl::Status s = read(index, buffer.data()); !s.ok()) return s;
      for (int64_t i = numel; i < padded_numel; ++i) {
        if (buffer[i] != 0.0f) {
          return absl::FailedPreconditionError(
              absl::StrCat(name,
                           "'s padding rows (past vocab_size) are not "
                           "zero; Hugging Face's format has no room "
                           "for them"));
        }
      }
      std::copy(buffer.begin(), buffer.begin() + numel, out);
      return absl::OkStatus();
    };
    const int64_t bytes = 4 * numel;
    if (shard_bytes > 0 && shard_bytes + bytes > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(std::move(t));
    shard_bytes += bytes;
    total_bytes += bytes;
  }
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  const fs::path root(dir);
  if (shards.size() == 1) {
    if (absl::Status s = WriteSafetensors((root / kWeightsFile).string(),
                                          shards[0], metadata);
        !s.ok()) {
      return s;
    }
  } else {
    nlohmann::ordered_json index = {
        {"metadata", {{"total_size", total_bytes}}},
        {"weight_map", nlohmann::ordered_json::object()}};
    std::map<std::string, std::string> weight_map;
    for (size_t i = 0; i < shards.size(); ++i) {
      char file[64];
      std::snprintf(file, sizeof(file), "model-%05zu-of-%05zu.safetensors",
                    i + 1, shards.size());
      for (const SafetensorsTensor& t : shards[i]) weight_map[t.name] = file;
      if (absl::Status s =
              WriteSafetensors((root / file).string(), shards[i], metadata);
          !s.ok()) {
        return s;
      }
    }
    for (const auto& [name, file] : weight_map) {
      index["weight_map"][name] = file;
    }
    if (absl::Status s = WriteFileAtomically(
            (root / kHfWeightsIndexFile).string(), index.dump(2) + "\n");
        !s.ok()) {
      return s;
    }
  }
  return WriteFileAtomically((root / kConfigFile).string(),
                             HfLlamaConfigJson(config));
}

absl::StatusOr<std::unique_ptr<HfLlamaReader>> HfLlamaReader::Open(
    const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string label = absl::StrCat("Hugging Face model ", dir);
  const fs::path root(dir);
  absl::StatusOr<std::string> config_text = ReadInputFile(
      (root / kConfigFile).string(), kMaxConfigBytes, "a model config");
  if (!config_text.ok()) {
    return absl::Status(
        config_text.status().code(),
        absl::StrCat(label, ": ", config_text.status().message()));
  }
  absl::StatusOr<ModelConfig> config = ParseHfLlamaConfig(*config_text);
  if (!config.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        label, ": ", kConfigFile, ": ", config.status().message()));
  }
  std::unique_ptr<HfLlamaReader> reader(new HfLlamaReader());
  reader->config_ = *config;
  reader->names_ = LlamaParameterNames(*config);

  // The weight files: one, or those the index names (plain names inside
  // the directory).
  std::vector<std::string> files;
  std::error_code ec;
  if (fs::exists(root / kHfWeightsIndexFile, ec)) {
    absl::StatusOr<std::string> index_text =
        ReadInputFile((root / kHfWeightsIndexFile).string(), kMaxIndexBytes,
                      "a weights index");
    if (!index_text.ok()) {
      return absl::Status(
          index_text.status().code(),
          absl::StrCat(label, ": ", index_text.status().message()));
    }
    if (absl::Status s = CheckJsonNesting(*index_text, kMaxHfJsonNesting,
                                          kHfWeightsIndexFile);
        !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(label, ": ", s.message()));
    }
    const nlohmann::json index =
        nlohmann::json::parse(*index_text, nullptr, /*allow_exceptions=*/false);
    if (index.is_discarded() || !index.is_object() ||
        !index.contains("weight_map") || !index["weight_map"].is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(label, ": ", kHfWeightsIndexFile,
                       " is not a JSON object with a \"weight_map\""));
    }
    std::set<std::string> named;
    for (const auto& [tensor, file] : index["weight_map"].items()) {
      if (!file.is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(label, ": ", kHfWeightsIndexFile, ": the file of ",
                         tensor, " is ", JsonExcerpt(file), ", not a name"));
      }
      const std::string name = file.get<std::string>();
      if (name.empty() || name.find('/') != std::string::npos ||
          name.find('\\') != std::string::npos || name == "." || name == "..") {
        return absl::InvalidArgumentError(absl::StrCat(
            label, ": ", kHfWeightsIndexFile, " names '", name, "' for ",
            tensor, "; weight files must lie in the directory"));
      }
      named.insert(name);
    }
    if (named.size() > kMaxShardFiles) {
      return absl::InvalidArgumentError(
          absl::StrCat(label, ": ", kHfWeightsIndexFile, " names ",
                       named.size(), " files, more than ", kMaxShardFiles));
    }
    files.assign(named.begin(), named.end());
  } else {
    files.push_back(kWeightsFile);
  }
  for (const std::string& file : files) {
    absl::StatusOr<SafetensorsFile> opened =
        SafetensorsFile::Open((root / file).string());
    if (!opened.ok()) {
      return absl::Status(opened.status().code(),
                          absl::StrCat(label, ": ", opened.status().message()));
    }
    reader->files_.push_back(*std::move(opened));
  }

  // Every weight, once, with its shape; nothing else but what is ignored.
  const std::vector<std::vector<int64_t>> shapes =
      LlamaParameterShapes(*config);
  std::map<std::string, size_t> wanted;  // Hugging Face name -> our index
  for (size_t i = 0; i < reader->names_.size(); ++i) {
    wanted[HfLlamaTensorName(reader->names_[i])] = i;
  }
  constexpr size_t kNone = SIZE_MAX;
  reader->entries_.assign(reader->names_.size(), {kNone, kNone});
  for (size_t f = 0; f < reader->files_.size(); ++f) {
    const std::vector<SafetensorsEntry>& tensors = reader->files_[f].tensors();
    for (size_t e = 0; e < tensors.size(); ++e) {
      const std::string& name = tensors[e].name;
      if (IsIgnoredLlamaTensor(name)) continue;
      // A tied model may store the head anyway: it is the embedding.
      if (name == "lm_head.weight" && config->tied_head()) continue;
      auto it = wanted.find(name);
      if (it == wanted.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            label, ": ", files[f], " holds '", name,
            "', which is not a weight of model ", config->ToSpec()));
      }
      if (reader->entries_[it->second].first != kNone) {
        return absl::InvalidArgumentError(
            absl::StrCat(label, ": ", name, " is stored twice"));
      }
      if (absl::Status s =
              CheckHfWeight(label, name, tensors[e],
                            LlamaHfShape(*config, reader->names_[it->second],
                                         shapes[it->second]));
          !s.ok()) {
        return s;
      }
      reader->entries_[it->second] = {f, e};
    }
  }
  for (size_t i = 0; i < reader->names_.size(); ++i) {
    if (reader->entries_[i].first == kNone) {
      return absl::InvalidArgumentError(absl::StrCat(
          label, ": no tensor ", HfLlamaTensorName(reader->names_[i]), " in ",
          absl::StrJoin(files, ", ")));
    }
  }
  return reader;
}

absl::Status HfLlamaReader::Read(size_t index, float* out) const {
  if (index >= names_.size()) {
    return absl::OutOfRangeError(absl::StrCat("no weight ", index));
  }
  const auto [f, e] = entries_[index];
  const SafetensorsEntry& entry = files_[f].tensors()[e];
  if (absl::Status s = files_[f].ReadAsFloat(entry, out); !s.ok()) return s;
  if (IsVocabularyRows(names_[index])) {
    std::fill(out + entry.numel(),
              out + config_.padded_vocab_size * config_.n_embd, 0.0f);
  }
  return absl::OkStatus();
}

}  // namespace shardtrain
