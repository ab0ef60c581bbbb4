// What Hugging Face's GPT-2 and Llama readers (hf_gpt2.h, hf_llama.h) share:
// config.json's settings read with the same refusals, and each stored weight
// checked against the shape the config gives it.
#ifndef SHARDTRAIN_CORE_MODEL_HF_SETTINGS_H_
#define SHARDTRAIN_CORE_MODEL_HF_SETTINGS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/model/safetensors.h"
#include "nlohmann/json.hpp"

namespace shardtrain {

// How deep config.json and a weights index may nest before they are parsed:
// real ones nest two or three levels (rope_scaling, quantization_config);
// the bound keeps a hostile file (100,000 levels) from anything that
// recurses on its values.
inline constexpr int kMaxHfJsonNesting = 64;

// A positive integer setting (at most 2^31); `fallback` 0: required.
absl::StatusOr<int64_t> HfIntSetting(const nlohmann::json& json,
                                     const char* name, int64_t fallback = 0);
// A number setting; `fallback` when absent or null.
absl::StatusOr<double> HfNumberSetting(const nlohmann::json& json,
                                       const char* name, double fallback);
// true or false; `fallback` when absent or null.
absl::StatusOr<bool> HfFlagSetting(const nlohmann::json& json, const char* name,
                                   bool fallback);
// A string setting as it is, any other value as its JSON text (a bounded
// excerpt: JsonExcerpt); `fallback` when absent or null.
std::string HfTextSetting(const nlohmann::json& json, const char* name,
                          const char* fallback);

// `entry` (tensor `name` of the model at `label`) has the shape `expected`
// and a dtype the readers widen (F32, F16, BF16); else InvalidArgument
// naming it.
absl::Status CheckHfWeight(const std::string& label, const std::string& name,
                           const SafetensorsEntry& entry,
                           const std::vector<int64_t>& expected);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_MODEL_HF_SETTINGS_H_
