#include "core/model/model_config.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "common/nearest_name.h"
#include "core/model/hf_llama.h"

namespace shardtrain {
namespace {

struct Preset {
  const char* name;
  ModelFamily family;
  int64_t block_size, n_layer, n_head, n_embd;
  // Llama's; vocab 0: GPT-2's.
  int64_t n_kv_head = 0, intermediate_size = 0, vocab = 0;
  double rope_theta = 10000;
  double rope_factor = 0;  // Llama 3's scaling, low 1, high 4, from 8192
  bool tied = true;
};

constexpr ModelFamily kGpt2 = ModelFamily::kGpt2;
constexpr ModelFamily kLlama = ModelFamily::kLlama;

// Smallest first. gpt2-tiny, gpt2-mini, llama-tiny and llama-mini are sized
// for CPU runs (a training step of batch 8 takes well under a second,
// respectively about a second, on two cores) and read GPT-2's tokens
// (vocabulary 50257), with grouped-query attention. The rest are the
// published shapes: GPT-2's sizes, and of Hugging Face's config.json,
// SmolLM2-135M, Llama-3.2-1B, Llama-3.1-8B and Llama-3.1-70B.
constexpr std::array<Preset, 12> kPresets = {{
    {"llama-tiny", kLlama, 256, 2, 4, 128, 2, 384},
    {"gpt2-tiny", kGpt2, 256, 2, 4, 128},
    {"llama-mini", kLlama, 512, 4, 8, 256, 2, 768},
    {"gpt2-mini", kGpt2, 512, 4, 4, 256},
    {"gpt2", kGpt2, 1024, 12, 12, 768},
    {"smollm2-135m", kLlama, 8192, 30, 9, 576, 3, 1536, 49152, 100000},
    {"gpt2-medium", kGpt2, 1024, 24, 16, 1024},
    {"gpt2-large", kGpt2, 1024, 36, 20, 1280},
    {"llama3.2-1b", kLlama, 131072, 16, 32, 2048, 8, 8192, 128256, 500000, 32},
    {"gpt2-xl", kGpt2, 1024, 48, 25, 1600},
    {"llama3.1-8b", kLlama, 131072, 32, 32, 4096, 8, 14336, 128256, 500000, 8,
     false},
    {"llama3.1-70b", kLlama, 131072, 80, 64, 8192, 8, 28672, 128256, 500000, 8,
     false},
}};

constexpr int64_t kGpt2VocabSize = 50257;
constexpr absl::string_view kCustomPrefix = "custom:";
constexpr absl::string_view kCustomLlamaPrefix = "custom-llama:";

// Upper bounds keep NumParameters() and FLOPs far from int64/double trouble
// and reject typos (an extra zero) before anything is allocated.
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxEmbd = 65536;
constexpr int64_t kMaxMlp = 1 << 20;
constexpr int64_t kMaxBlockSize = 1 << 20;
constexpr int64_t kMaxVocab = 1 << 24;

// Debian's Abseil keeps its own string_view type; the public API takes
// std::string_view and converts at the door.
absl::string_view ToAbsl(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

int64_t RoundUp(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

absl::Status CheckRange(absl::string_view field, int64_t value, int64_t max) {
  if (value < 1 || value > max) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model field ", field, " = ", value, ": must be in [1, ", max, "]"));
  }
  return absl::OkStatus();
}

std::string AllowedPresets() {
  return absl::StrJoin(ModelConfig::PresetNames(), ", ");
}

// A double as the spec writes it back: the shortest form that reads back
// the same.
std::string FormatDouble(double v) {
  char buf[32];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

}  // namespace

const char* ModelFamilyName(ModelFamily family) {
  return family == ModelFamily::kLlama ? "llama" : "gpt2";
}

std::vector<std::string> ModelFamilyNames() {
  std::vector<std::string> names;
  for (ModelFamily family : {ModelFamily::kGpt2, ModelFamily::kLlama}) {
    names.push_back(ModelFamilyName(family));
  }
  return names;
}

absl::StatusOr<ModelConfig> ModelConfig::FromPreset(std::string_view name) {
  for (const Preset& p : kPresets) {
    if (name != p.name) continue;
    ModelConfig config;
    config.name = p.name;
    config.family = p.family;
    config.block_size = p.block_size;
    config.vocab_size = p.vocab > 0 ? p.vocab : kGpt2VocabSize;
    config.padded_vocab_size = RoundUp(config.vocab_size, kVocabPadMultiple);
    config.n_layer = p.n_layer;
    config.n_head = p.n_head;
    config.n_embd = p.n_embd;
    if (p.family == ModelFamily::kLlama) {
      config.n_kv_head = p.n_kv_head;
      config.intermediate_size = p.intermediate_size;
      config.rope_theta = p.rope_theta;
      config.rope_scaling.factor = p.rope_factor;
      config.tie_embeddings = p.tied;
    }
    return config;
  }
  const std::string near = NearestName(ToAbsl(name), PresetNames());
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown model preset \"", ToAbsl(name), "\"",
      near.empty() ? "" : absl::StrCat(" (did you mean ", near, "?)"),
      "; allowed: ", AllowedPresets(),
      ", custom:n_layer=<int>,n_head=<int>,n_embd=<int>[,block_size=<int>]"
      "[,vocab_size=<int>][,padded_vocab_size=<int>] (GPT-2), or "
      "custom-llama:n_layer=<int>,n_head=<int>,n_embd=<int>,"
      "intermediate_size=<int>[,n_kv_head=<int>][,...]"));
}

std::vector<std::string> ModelConfig::PresetNames() {
  std::vector<std::string> names;
  names.reserve(kPresets.size());
  for (const Preset& p : kPresets) names.emplace_back(p.name);
  return names;
}

absl::Status ModelConfig::Validate() const {
  for (absl::Status s :
       {CheckRange("n_layer", n_layer, kMaxLayers),
        CheckRange("n_head", n_head, kMaxEmbd),
        CheckRange("n_embd", n_embd, kMaxEmbd),
        CheckRange("block_size", block_size, kMaxBlockSize),
        CheckRange("vocab_size", vocab_size, kMaxVocab),
        CheckRange("padded_vocab_size", padded_vocab_size, kMaxVocab)}) {
    if (!s.ok()) return s;
  }
  if (n_embd % n_head != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model field n_embd = ", n_embd,
                     ": must be a multiple of n_head = ", n_head));
  }
  if (padded_vocab_size < vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("model field padded_vocab_size = ", padded_vocab_size,
                     ": must be at least vocab_size = ", vocab_size));
  }
  if (!is_llama()) return absl::OkStatus();
  for (absl::Status s :
       {CheckRange("n_kv_head", n_kv_head, n_head),
        CheckRange("intermediate_size", intermediate_size, kMaxMlp)}) {
    if (!s.ok()) return s;
  }
  if (n_head % n_kv_head != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model field n_kv_head = ", n_kv_head,
                     ": must divide n_head = ", n_head,
                     " (each key/value head serves n_head / n_kv_head query "
                     "heads)"));
  }
  if (head_size() % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model fields n_embd = ", n_embd, ", n_head = ", n_head,
        ": the head size ", head_size(),
        " must be even (rotary positions turn pairs of its dimensions)"));
  }
  if (!(rope_theta > 1) || !(rope_theta < 1e12)) {
    return absl::InvalidArgumentError(
        absl::StrCat("model field rope_theta = ", FormatDouble(rope_theta),
                     ": must be in (1, 1e12)"));
  }
  if (!(norm_eps > 0) || !(norm_eps < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("model field norm_eps = ", FormatDouble(norm_eps),
                     ": must be in (0, 1)"));
  }
  const RopeScaling& r = rope_scaling;
  if (r.factor != 0 &&
      (!(r.factor >= 1) || !(r.factor <= 1024) || !(r.low_freq_factor > 0) ||
       !(r.high_freq_factor > r.low_freq_factor) ||
       r.original_max_position_embeddings < 1 ||
       r.original_max_position_embeddings > kMaxBlockSize)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model rope scaling (factor ", FormatDouble(r.factor), ", low ",
        FormatDouble(r.low_freq_factor), ", high ",
        FormatDouble(r.high_freq_factor), ", original ",
        r.original_max_position_embeddings,
        "): factor must be in [1, 1024] (0: none), 0 < low_freq_factor < "
        "high_freq_factor, original_max_position_embeddings in [1, ",
        kMaxBlockSize, "]"));
  }
  return absl::OkStatus();
}

bool ModelConfig::SameShape(const ModelConfig& other) const {
  const bool same = family == other.family && block_size == other.block_size &&
                    vocab_size == other.vocab_size &&
                    padded_vocab_size == other.padded_vocab_size &&
                    n_layer == other.n_layer && n_head == other.n_head &&
                    n_embd == other.n_embd;
  if (!same || !is_llama()) return same;
  return n_kv_head == other.n_kv_head &&
         intermediate_size == other.intermediate_size &&
         rope_theta == other.rope_theta && rope_scaling == other.rope_scaling &&
         norm_eps == other.norm_eps && tie_embeddings == other.tie_embeddings &&
         attention_bias == other.attention_bias;
}

int64_t ModelConfig::BlockParameters() const {
  const int64_t c = n_embd;
  if (!is_llama()) {
    // ln_1 (2C) + c_attn (3C*C + 3C) + attn.c_proj (C*C + C) + ln_2 (2C)
    // + c_fc (4C*C + 4C) + mlp.c_proj (4C*C + C).
    return 12 * c * c + 13 * c;
  }
  // Two RMSNorms (C each), q (C*C), k and v (C * kv*hs each), o (C*C), gate,
  // up and down (C*I each), the q, k, v biases when present.
  const int64_t kv = n_kv_head * head_size();
  const int64_t biases = attention_bias ? c + 2 * kv : 0;
  return 2 * c + 2 * c * c + 2 * c * kv + 3 * c * intermediate_size + biases;
}

int64_t ModelConfig::InputParameters() const {
  return is_llama() ? 0 : block_size * n_embd;  // wpe
}

int64_t ModelConfig::OutputParameters() const {
  const int64_t norm = is_llama() ? n_embd : 2 * n_embd;
  return norm + (tied_head() ? 0 : padded_vocab_size * n_embd);
}

int64_t ModelConfig::NumParameters() const {
  return padded_vocab_size * n_embd + InputParameters() +
         n_layer * BlockParameters() + OutputParameters();
}

double ModelConfig::FlopsPerToken(int64_t seq_len) const {
  const int64_t lookups =
      InputParameters() + (tied_head() ? 0 : padded_vocab_size * n_embd);
  const double n = static_cast<double>(NumParameters() - lookups);
  const double attention =
      12.0 * static_cast<double>(n_layer) * static_cast<double>(n_head) *
      static_cast<double>(head_size()) * static_cast<double>(seq_len);
  return 6.0 * n + attention;
}

std::string ModelConfig::ToSpec() const {
  absl::StatusOr<ModelConfig> preset = FromPreset(name);
  if (preset.ok() && preset->SameShape(*this)) return name;
  std::string spec = absl::StrCat(
      is_llama() ? kCustomLlamaPrefix : kCustomPrefix, "n_layer=", n_layer,
      ",n_head=", n_head, ",n_embd=", n_embd, ",block_size=", block_size,
      ",vocab_size=", vocab_size, ",padded_vocab_size=", padded_vocab_size);
  if (!is_llama()) return spec;
  absl::StrAppend(&spec, ",n_kv_head=", n_kv_head,
                  ",intermediate_size=", intermediate_size,
                  ",rope_theta=", FormatDouble(rope_theta),
                  ",norm_eps=", FormatDouble(norm_eps),
                  ",tie_embeddings=", tie_embeddings ? 1 : 0,
                  ",attention_bias=", attention_bias ? 1 : 0);
  if (rope_scaling.factor != 0) {
    absl::StrAppend(
        &spec, ",rope_scaling_factor=", FormatDouble(rope_scaling.factor),
        ",rope_low_freq_factor=", FormatDouble(rope_scaling.low_freq_factor),
        ",rope_high_freq_factor=", FormatDouble(rope_scaling.high_freq_factor),
        ",rope_original_max_position_embeddings=",
        rope_scaling.original_max_position_embeddings);
  }
  return spec;
}

namespace {

// One field of a custom spec: an integer, a number or a 0/1 flag.
struct SpecField {
  absl::string_view name;
  int64_t* integer = nullptr;
  double* number = nullptr;
  bool* flag = nullptr;
  bool required = false;
  bool seen = false;
};

absl::Status SetField(SpecField& field, absl::string_view text) {
  if (field.integer != nullptr) {
    if (absl::SimpleAtoi(text, field.integer)) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("model spec: field ",
                                                   field.name, " = \"", text,
                                                   "\" is not an integer"));
  }
  if (field.number != nullptr) {
    if (absl::SimpleAtod(text, field.number) && std::isfinite(*field.number)) {
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "model spec: field ", field.name, " = \"", text, "\" is not a number"));
  }
  if (text == "0" || text == "1") {
    *field.flag = text == "1";
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "model spec: field ", field.name, " = \"", text, "\" must be 0 or 1"));
}

}  // namespace

absl::StatusOr<ModelConfig> ParseModelSpec(std::string_view std_spec) {
  absl::string_view spec = absl::StripAsciiWhitespace(ToAbsl(std_spec));
  const bool llama = absl::ConsumePrefix(&spec, kCustomLlamaPrefix);
  if (!llama && !absl::ConsumePrefix(&spec, kCustomPrefix)) {
    absl::StatusOr<ModelConfig> config =
        ModelConfig::FromPreset(std::string_view(spec.data(), spec.size()));
    if (!config.ok()) return config.status();
    return config;
  }
  const absl::string_view prefix = llama ? kCustomLlamaPrefix : kCustomPrefix;

  ModelConfig config;
  config.name = "custom";
  config.family = llama ? ModelFamily::kLlama : ModelFamily::kGpt2;
  config.block_size = 1024;
  config.vocab_size = kGpt2VocabSize;
  config.padded_vocab_size = -1;  // Derived from vocab_size unless given.
  config.n_layer = config.n_head = config.n_embd = -1;
  config.n_kv_head = llama ? -1 : 0;  // -1: n_head unless given
  config.intermediate_size = llama ? -1 : 0;
  std::vector<SpecField> fields = {
      {"n_layer", &config.n_layer, nullptr, nullptr, true},
      {"n_head", &config.n_head, nullptr, nullptr, true},
      {"n_embd", &config.n_embd, nullptr, nullptr, true},
      {"block_size", &config.block_size},
      {"vocab_size", &config.vocab_size},
      {"padded_vocab_size", &config.padded_vocab_size},
  };
  if (llama) {
    RopeScaling& r = config.rope_scaling;
    const std::vector<SpecField> more = {
        {"intermediate_size", &config.intermediate_size, nullptr, nullptr,
         true},
        {"n_kv_head", &config.n_kv_head},
        {"rope_theta", nullptr, &config.rope_theta},
        {"norm_eps", nullptr, &config.norm_eps},
        {"tie_embeddings", nullptr, nullptr, &config.tie_embeddings},
        {"attention_bias", nullptr, nullptr, &config.attention_bias},
        {"rope_scaling_factor", nullptr, &r.factor},
        {"rope_low_freq_factor", nullptr, &r.low_freq_factor},
        {"rope_high_freq_factor", nullptr, &r.high_freq_factor},
        {"rope_original_max_position_embeddings",
         &r.original_max_position_embeddings},
    };
    fields.insert(fields.end(), more.begin(), more.end());
  }
  auto allowed_fields = [&fields] {
    return absl::StrJoin(fields, ", ",
                         [](std::string* out, const SpecField& f) {
                           absl::StrAppend(out, f.name);
                         });
  };

  for (absl::string_view item : absl::StrSplit(spec, ',')) {
    item = absl::StripAsciiWhitespace(item);
    std::vector<absl::string_view> kv = absl::StrSplit(item, '=');
    if (kv.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("model spec \"", prefix, spec, "\": item \"", item,
                       "\" is not <field>=", llama ? "<value>" : "<int>",
                       "; fields: ", allowed_fields()));
    }
    const absl::string_view key = absl::StripAsciiWhitespace(kv[0]);
    const absl::string_view text = absl::StripAsciiWhitespace(kv[1]);
    SpecField* field = nullptr;
    for (SpecField& f : fields) {
      if (f.name == key) field = &f;
    }
    if (field == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("model spec: unknown field \"", key,
                       "\"; allowed fields: ", allowed_fields()));
    }
    if (field->seen) {
      return absl::InvalidArgumentError(
          absl::StrCat("model spec: field ", key, " given twice"));
    }
    field->seen = true;
    if (absl::Status s = SetField(*field, text); !s.ok()) return s;
  }
  for (const SpecField& f : fields) {
    if (f.required && !f.seen) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model spec: custom model needs field ", f.name,
          llama ? " (required: n_layer, n_head, n_embd, intermediate_size)"
                : " (required: n_layer, n_head, n_embd; optional: block_size, "
                  "vocab_size, padded_vocab_size)"));
    }
  }
  if (config.padded_vocab_size == -1) {
    // An out-of-range vocab_size is left for Validate() to name.
    config.padded_vocab_size =
        config.vocab_size >= 1 && config.vocab_size <= kMaxVocab
            ? RoundUp(config.vocab_size, kVocabPadMultiple)
            : config.vocab_size;
  }
  if (config.n_kv_head == -1) config.n_kv_head = config.n_head;
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  return config;
}

std::string ExportedModelFileName(const ModelConfig& config) {
  return config.is_llama() ? "model.safetensors" : "model.bin";
}

std::string ExportedModelConfigJson(const ModelConfig& config) {
  return config.is_llama() ? HfLlamaConfigJson(config) : "";
}

int64_t HeadChunkBytes(bool accelerator, int64_t compute_threads) {
  if (accelerator) return int64_t{512} << 20;
  return (int64_t{128} << 20) * std::max<int64_t>(1, compute_threads);
}

}  // namespace shardtrain
