#include "client/step_metrics_csv.h"

#include <charconv>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

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
  std::string out =
      "step,total_steps,epoch,rank,loss,grad_norm,lr,step_seconds,tokens,"
      "tokens_per_second,mfu,memory_allocated_bytes,memory_peak_bytes,"
      "memory_reserved_bytes,model_state_bytes,comm_seconds,comm_bytes,"
      "comm_inter_group_bytes,comm_tensor_parallel_bytes,pipeline_stage,"
      "pipeline_bubble_seconds,p2p_bytes,val_loss\n";
  for (const v1::StepMetrics& m : steps) {
    absl::StrAppend(
        &out,
        absl::StrJoin(
            {absl::StrCat(m.step()),
             absl::StrCat(m.total_steps()),
             absl::StrCat(m.epoch()),
             absl::StrCat(m.rank()),
             ExactDouble(m.loss()),
             ExactDouble(m.grad_norm()),
             ExactDouble(m.lr()),
             ExactDouble(m.step_seconds()),
             absl::StrCat(m.tokens()),
             ExactDouble(m.tokens_per_second()),
             ExactDouble(m.mfu()),
             absl::StrCat(m.memory_allocated_bytes()),
             absl::StrCat(m.memory_peak_bytes()),
             absl::StrCat(m.memory_reserved_bytes()),
             absl::StrCat(m.model_state_bytes()),
             ExactDouble(m.comm_seconds()),
             absl::StrCat(m.comm_bytes()),
             absl::StrCat(m.comm_inter_group_bytes()),
             absl::StrCat(m.comm_tensor_parallel_bytes()),
             m.has_pipeline_stage() ? absl::StrCat(m.pipeline_stage())
                                    : std::string(),
             ExactDouble(m.pipeline_bubble_seconds()),
             absl::StrCat(m.p2p_bytes()),
             m.has_val_loss() ? ExactDouble(m.val_loss()) : std::string()},
            ","),
        "\n");
  }
  return out;
}

}  // namespace shardtrain::cli
