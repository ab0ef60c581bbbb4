#include "client/step_metrics_csv.h"

#include <charconv>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/run/step_metrics.h"
#include "proto/job_config.h"

namespace shardtrain::cli {
namespace {

// The shortest text that reads back as the same double.
std::string ExactDouble(double value) {
  char buffer[32];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, result.ptr);
}

}  // namespace

std::string StepMetricsCsv(const std::vector<v1::StepMetrics>& steps) {
  std::vector<std::string> cells;
  for (const StepField& f : StepFields()) cells.push_back(f.name);
  std::string out = absl::StrCat(absl::StrJoin(cells, ","), "\n");
  for (const v1::StepMetrics& p : steps) {
    const StepMetrics m = StepMetricsFromProto(p);
    cells.clear();
    for (const StepField& f : StepFields()) {
      if (f.presence == StepField::Presence::kOptional && !f.PresentIn(m)) {
        cells.emplace_back();
      } else if (f.is_integer()) {
        cells.push_back(absl::StrCat(m.*f.int_member));
      } else {
        cells.push_back(ExactDouble(m.*f.double_member));
      }
    }
    absl::StrAppend(&out, absl::StrJoin(cells, ","), "\n");
  }
  return out;
}

}  // namespace shardtrain::cli
