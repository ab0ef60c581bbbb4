#include "core/model/gpt2_config.h"

#include <algorithm>
#include <array>
#include <cstdint>
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

namespace shardtrain {
namespace {

struct Preset {
  const char* name;
  int64_t block_size, n_layer, n_head, n_embd;
};

// Smallest first. gpt2-tiny and gpt2-mini are sized for CPU runs (a training
// step of batch 8 takes well under a second, respectively about a second, on
// two cores); the rest are the published GPT-2 sizes.
constexpr std::array<Preset, 6> kPresets = {{
    {"gpt2-tiny", 256, 2, 4, 128},
    {"gpt2-mini", 512, 4, 4, 256},
    {"gpt2", 1024, 12, 12, 768},
    {"gpt2-medium", 1024, 24, 16, 1024},
    {"gpt2-large", 1024, 36, 20, 1280},
    {"gpt2-xl", 1024, 48, 25, 1600},
}};

constexpr int64_t kGpt2VocabSize = 50257;
constexpr int64_t kVocabPadMultiple = 64;
constexpr absl::string_view kCustomPrefix = "custom:";

// Upper bounds keep NumParameters() and FLOPs far from int64/double trouble
// and reject typos (an extra zero) before anything is allocated.
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxEmbd = 65536;
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
  return absl::StrJoin(Gpt2Config::PresetNames(), ", ");
}

}  // namespace

absl::StatusOr<Gpt2Config> Gpt2Config::FromPreset(std::string_view name) {
  for (const Preset& p : kPresets) {
    if (name != p.name) continue;
    Gpt2Config config;
    config.name = p.name;
    config.block_size = p.block_size;
    config.vocab_size = kGpt2VocabSize;
    config.padded_vocab_size = RoundUp(kGpt2VocabSize, kVocabPadMultiple);
    config.n_layer = p.n_layer;
    config.n_head = p.n_head;
    config.n_embd = p.n_embd;
    return config;
  }
  const std::string near = NearestName(ToAbsl(name), PresetNames());
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown model preset \"", ToAbsl(name), "\"",
      near.empty() ? "" : absl::StrCat(" (did you mean ", near, "?)"),
      "; allowed: ", AllowedPresets(),
      ", or custom:n_layer=<int>,n_head=<int>,n_embd=<int>[,block_size=<int>]"
      "[,vocab_size=<int>][,padded_vocab_size=<int>]"));
}

std::vector<std::string> Gpt2Config::PresetNames() {
  std::vector<std::string> names;
  names.reserve(kPresets.size());
  for (const Preset& p : kPresets) names.emplace_back(p.name);
  return names;
}

absl::Status Gpt2Config::Validate() const {
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
  return absl::OkStatus();
}

bool Gpt2Config::SameShape(const Gpt2Config& other) const {
  return block_size == other.block_size && vocab_size == other.vocab_size &&
         padded_vocab_size == other.padded_vocab_size &&
         n_layer == other.n_layer && n_head == other.n_head &&
         n_embd == other.n_embd;
}

int64_t Gpt2Config::NumParameters() const {
  const int64_t c = n_embd;
  // ln_1 (2C) + c_attn (3C*C + 3C) + attn.c_proj (C*C + C) + ln_2 (2C)
  // + c_fc (4C*C + 4C) + mlp.c_proj (4C*C + C).
  const int64_t per_block = 12 * c * c + 13 * c;
  return padded_vocab_size * c + block_size * c + n_layer * per_block + 2 * c;
}

double Gpt2Config::FlopsPerToken(int64_t seq_len) const {
  const double n = static_cast<double>(NumParameters() - block_size * n_embd);
  const double attention =
      12.0 * static_cast<double>(n_layer) * static_cast<double>(n_head) *
      static_cast<double>(head_size()) * static_cast<double>(seq_len);
  return 6.0 * n + attention;
}

std::string Gpt2Config::ToSpec() const {
  absl::StatusOr<Gpt2Config> preset = FromPreset(name);
  if (preset.ok() && preset->SameShape(*this)) return name;
  return absl::StrCat(kCustomPrefix, "n_layer=", n_layer, ",n_head=", n_head,
                      ",n_embd=", n_embd, ",block_size=", block_size,
                      ",vocab_size=", vocab_size,
                      ",padded_vocab_size=", padded_vocab_size);
}

absl::StatusOr<Gpt2Config> ParseModelSpec(std::string_view std_spec) {
  absl::string_view spec = absl::StripAsciiWhitespace(ToAbsl(std_spec));
  if (!absl::ConsumePrefix(&spec, kCustomPrefix)) {
    absl::StatusOr<Gpt2Config> config =
        Gpt2Config::FromPreset(std::string_view(spec.data(), spec.size()));
    if (!config.ok()) return config.status();
    return config;
  }

  struct Field {
    absl::string_view name;
    int64_t* value;
    bool required;
    bool seen = false;
  };
  Gpt2Config config;
  config.name = "custom";
  config.block_size = 1024;
  config.vocab_size = kGpt2VocabSize;
  config.padded_vocab_size = -1;  // Derived from vocab_size unless given.
  config.n_layer = config.n_head = config.n_embd = -1;
  std::array<Field, 6> fields = {{
      {"n_layer", &config.n_layer, true},
      {"n_head", &config.n_head, true},
      {"n_embd", &config.n_embd, true},
      {"block_size", &config.block_size, false},
      {"vocab_size", &config.vocab_size, false},
      {"padded_vocab_size", &config.padded_vocab_size, false},
  }};
  auto allowed_fields = [&fields] {
    return absl::StrJoin(fields, ", ", [](std::string* out, const Field& f) {
      absl::StrAppend(out, f.name);
    });
  };

  for (absl::string_view item : absl::StrSplit(spec, ',')) {
    item = absl::StripAsciiWhitespace(item);
    std::vector<absl::string_view> kv = absl::StrSplit(item, '=');
    if (kv.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("model spec \"custom:", spec, "\": item \"", item,
                       "\" is not <field>=<int>; fields: ", allowed_fields()));
    }
    const absl::string_view key = absl::StripAsciiWhitespace(kv[0]);
    const absl::string_view text = absl::StripAsciiWhitespace(kv[1]);
    Field* field = nullptr;
    for (Field& f : fields) {
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
    if (!absl::SimpleAtoi(text, field->value)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model spec: field ", key, " = \"", text, "\" is not an integer"));
    }
  }
  for (const Field& f : fields) {
    if (f.required && !f.seen) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model spec: custom model needs field ", f.name,
          " (required: n_layer, n_head, n_embd; optional: block_size, "
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
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  return config;
}

int64_t HeadChunkBytes(bool accelerator, int64_t compute_threads) {
  if (accelerator) return int64_t{512} << 20;
  return (int64_t{128} << 20) * std::max<int64_t>(1, compute_threads);
}

}  // namespace shardtrain
