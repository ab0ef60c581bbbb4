#include "core/train/step_metrics.h"

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

std::string StepMetrics::ToJson() const {
  nlohmann::json j = {
      {"step", step},
      {"total_steps", total_steps},
      {"epoch", epoch},
      {"rank", rank},
      {"loss", loss},
      {"grad_norm", grad_norm},
      {"lr", lr},
      {"step_seconds", step_seconds},
      {"tokens", tokens},
      {"tokens_per_second", tokens_per_second},
      {"mfu", mfu},
      {"memory_allocated_bytes", memory_allocated_bytes},
      {"memory_peak_bytes", memory_peak_bytes},
      {"memory_reserved_bytes", memory_reserved_bytes},
      {"model_state_bytes", model_state_bytes},
      {"comm_seconds", comm_seconds},
      {"comm_bytes", comm_bytes},
      {"comm_inter_group_bytes", comm_inter_group_bytes},
      {"comm_tensor_parallel_bytes", comm_tensor_parallel_bytes},
  };
  if (pipeline_stage >= 0) {
    j["pipeline_stage"] = pipeline_stage;
    j["pipeline_bubble_seconds"] = pipeline_bubble_seconds;
    j["p2p_bytes"] = p2p_bytes;
  }
  if (val_loss >= 0) j["val_loss"] = val_loss;
  return j.dump();
}

absl::StatusOr<StepMetrics> StepMetrics::FromJson(const std::string& line) {
  try {
    const nlohmann::json j = nlohmann::json::parse(line);
    StepMetrics m;
    m.step = j.at("step").get<int64_t>();
    m.total_steps = j.value("total_steps", int64_t{0});
    m.epoch = j.value("epoch", int64_t{0});
    m.rank = j.at("rank").get<int64_t>();
    m.loss = j.at("loss").get<double>();
    m.grad_norm = j.at("grad_norm").get<double>();
    m.lr = j.at("lr").get<double>();
    m.step_seconds = j.at("step_seconds").get<double>();
    m.tokens = j.value("tokens", int64_t{0});
    m.tokens_per_second = j.at("tokens_per_second").get<double>();
    m.mfu = j.at("mfu").get<double>();
    m.memory_allocated_bytes = j.at("memory_allocated_bytes").get<int64_t>();
    m.memory_peak_bytes = j.at("memory_peak_bytes").get<int64_t>();
    m.memory_reserved_bytes = j.at("memory_reserved_bytes").get<int64_t>();
    m.model_state_bytes = j.value("model_state_bytes", int64_t{0});
    m.comm_seconds = j.value("comm_seconds", 0.0);
    m.comm_bytes = j.value("comm_bytes", int64_t{0});
    m.comm_inter_group_bytes = j.value("comm_inter_group_bytes", int64_t{0});
    m.comm_tensor_parallel_bytes =
        j.value("comm_tensor_parallel_bytes", int64_t{0});
    m.pipeline_stage = j.value("pipeline_stage", int64_t{-1});
    m.pipeline_bubble_seconds = j.value("pipeline_bubble_seconds", 0.0);
    m.p2p_bytes = j.value("p2p_bytes", int64_t{0});
    m.val_loss = j.value("val_loss", -1.0);
    return m;
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a StepMetrics JSON line: ", e.what()));
  }
}

}  // namespace shardtrain
