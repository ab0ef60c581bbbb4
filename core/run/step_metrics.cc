#include "core/run/step_metrics.h"

#include <cmath>
#include <cstdio>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

namespace shardtrain {

std::string FormatBytes(int64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (std::fabs(value) >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  if (unit == 0) return absl::StrCat(bytes, " B");
  return absl::StrFormat("%.1f %s", value, kUnits[unit]);
}

std::string FormatDuration(double seconds) {
  if (seconds < 1) return absl::StrFormat("%.0f ms", seconds * 1e3);
  if (seconds < 60) return absl::StrFormat("%.2f s", seconds);
  const auto total = static_cast<int64_t>(std::llround(seconds));
  if (total < 3600) return absl::StrFormat("%dm%02ds", total / 60, total % 60);
  return absl::StrFormat("%dh%02dm", total / 3600, (total % 3600) / 60);
}

absl::StatusOr<int64_t> ParseBytes(absl::string_view text) {
  const absl::string_view trimmed = absl::StripAsciiWhitespace(text);
  size_t split = 0;
  while (split < trimmed.size() &&
         (absl::ascii_isdigit(trimmed[split]) || trimmed[split] == '.')) {
    ++split;
  }
  double number = 0;
  const std::string unit =
      absl::AsciiStrToUpper(absl::StripAsciiWhitespace(trimmed.substr(split)));
  static const std::pair<const char*, double> kUnits[] = {
      {"", 1},
      {"B", 1},
      {"K", 1 << 10},
      {"KI", 1 << 10},
      {"KIB", 1 << 10},
      {"KB", 1e3},
      {"M", 1 << 20},
      {"MI", 1 << 20},
      {"MIB", 1 << 20},
      {"MB", 1e6},
      {"G", 1 << 30},
      {"GI", 1 << 30},
      {"GIB", 1 << 30},
      {"GB", 1e9},
      {"T", 1099511627776.0},
      {"TI", 1099511627776.0},
      {"TIB", 1099511627776.0},
      {"TB", 1e12}};
  double scale = 0;
  for (const auto& [name, factor] : kUnits) {
    if (unit == name) scale = factor;
  }
  if (split == 0 || scale == 0 ||
      !absl::SimpleAtod(trimmed.substr(0, split), &number) ||
      !(number * scale >= 1) || number * scale > 9.0e18) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", absl::CHexEscape(text),
        "' is not a size: expected a positive number with an optional unit, "
        "as 80GiB, 512MiB, 1.5G or 4096"));
  }
  return static_cast<int64_t>(number * scale);
}

std::string FormatThousands(int64_t value) {
  std::string digits = absl::StrCat(value < 0 ? -value : value);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return value < 0 ? "-" + out : out;
}

std::string StepMetrics::FormatLine() const {
  return absl::StrFormat(
      "step %d/%d | loss %.4f | norm %.2f | lr %.1e | %s | %.1f%% MFU | %s "
      "tok/s | mem %s",
      step, total_steps, loss, grad_norm, lr, FormatDuration(step_seconds),
      mfu * 100, FormatThousands(std::llround(tokens_per_second)),
      FormatBytes(memory_peak_bytes));
}

namespace {

StepField MakeField(const char* name, const char* unit,
                    StepField::Presence presence, StepField::Series series,
                    const char* series_name, const char* help,
                    int64_t StepMetrics::*member) {
  StepField f{name, unit, presence, series, series_name, help};
  f.int_member = member;
  return f;
}

StepField MakeField(const char* name, const char* unit,
                    StepField::Presence presence, StepField::Series series,
                    const char* series_name, const char* help,
                    double StepMetrics::*member) {
  StepField f{name, unit, presence, series, series_name, help};
  f.double_member = member;
  return f;
}

}  // namespace

const std::vector<StepField>& StepFields() {
#define SHARDTRAIN_STEP_ENTRY(type, name, initial, unit, presence, series, \
                              series_name, help)                           \
  MakeField(#name, unit, StepField::Presence::presence,                    \
            StepField::Series::series, series_name, help, &StepMetrics::name),
  static const std::vector<StepField> fields = {
      SHARDTRAIN_STEP_FIELDS(SHARDTRAIN_STEP_ENTRY)};
#undef SHARDTRAIN_STEP_ENTRY
  return fields;
}

bool StepField::PresentIn(const StepMetrics& m) const {
  switch (presence) {
    case Presence::kOptional:
      return Value(m) >= 0;
    case Presence::kWithStage:
      return m.pipeline_stage >= 0;
    default:
      return true;
  }
}

std::string StepMetrics::ToJson() const {
  nlohmann::json j = nlohmann::json::object();
  for (const StepField& f : StepFields()) {
    if (!f.PresentIn(*this)) continue;
    if (f.is_integer()) {
      j[f.name] = this->*f.int_member;
    } else {
      j[f.name] = this->*f.double_member;
    }
  }
  return j.dump();
}

absl::StatusOr<StepMetrics> StepMetrics::FromJson(const std::string& line) {
  try {
    const nlohmann::json j = nlohmann::json::parse(line);
    StepMetrics m;
    for (const StepField& f : StepFields()) {
      const bool required = f.presence == StepField::Presence::kRequired;
      if (!required && !j.contains(f.name)) continue;  // keeps `initial`
      const nlohmann::json& value = j.at(f.name);
      if (f.is_integer()) {
        m.*f.int_member = value.get<int64_t>();
      } else {
        m.*f.double_member = value.get<double>();
      }
    }
    return m;
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a StepMetrics JSON line: ", e.what()));
  }
}

}  // namespace shardtrain
