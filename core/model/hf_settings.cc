#include "core/model/hf_settings.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/json_excerpt.h"

namespace shardtrain {

absl::StatusOr<int64_t> HfIntSetting(const nlohmann::json& json,
                                     const char* name, int64_t fallback) {
  if (!json.contains(name) || json[name].is_null()) {
    if (fallback > 0) return fallback;
    return absl::InvalidArgumentError(absl::StrCat("no \"", name, "\""));
  }
  const nlohmann::json& v = json[name];
  if (!v.is_number_integer() || v.get<int64_t>() <= 0 ||
      v.get<int64_t>() > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "\"", name, "\" is ", JsonExcerpt(v), ", not a positive integer"));
  }
  return v.get<int64_t>();
}

absl::StatusOr<double> HfNumberSetting(const nlohmann::json& json,
                                       const char* name, double fallback) {
  if (!json.contains(name) || json[name].is_null()) return fallback;
  if (!json[name].is_number()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "\"", name, "\" is ", JsonExcerpt(json[name]), ", not a number"));
  }
  return json[name].get<double>();
}

absl::StatusOr<bool> HfFlagSetting(const nlohmann::json& json, const char* name,
                                   bool fallback) {
  if (!json.contains(name) || json[name].is_null()) return fallback;
  if (!json[name].is_boolean()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "\"", name, "\" is ", JsonExcerpt(json[name]), ", not true or false"));
  }
  return json[name].get<bool>();
}

std::string HfTextSetting(const nlohmann::json& json, const char* name,
                          const char* fallback) {
  if (!json.contains(name) || json[name].is_null()) return fallback;
  return json[name].is_string() ? json[name].get<std::string>()
                                : JsonExcerpt(json[name]);
}

absl::Status CheckHfWeight(const std::string& label, const std::string& name,
                           const SafetensorsEntry& entry,
                           const std::vector<int64_t>& expected) {
  if (entry.shape != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        label, ": ", name, " is [", absl::StrJoin(entry.shape, ", "),
        "], but config.json's model needs [", absl::StrJoin(expected, ", "),
        "]"));
  }
  if (entry.dtype != "F32" && entry.dtype != "F16" && entry.dtype != "BF16") {
    return absl::InvalidArgumentError(
        absl::StrCat(label, ": ", name, " is ", entry.dtype,
                     "; weights must be F32, F16 or BF16"));
  }
  return absl::OkStatus();
}

}  // namespace shardtrain
