// StepMetrics: what one rank measured in one optimizer step, and the one
// place that formats it for people (the step line) and for machines (JSON).
// Torch-free: the coordinator and the CLI read the same struct.
#ifndef SHARDTRAIN_CORE_TRAIN_STEP_METRICS_H_
#define SHARDTRAIN_CORE_TRAIN_STEP_METRICS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardtrain {

struct StepMetrics {
  int64_t step = 0;  // 1-based optimizer step
  int64_t total_steps = 0;
  int64_t epoch = 0;  // 0-based
  int64_t rank = 0;
  double loss = 0;       // mean training loss of the step over all ranks
  double grad_norm = 0;  // global, before clipping
  double lr = 0;
  double step_seconds = 0;
  int64_t tokens = 0;  // tokens processed in this step, all ranks
  double tokens_per_second = 0;
  double mfu = 0;  // model FLOPs utilisation, ratio in [0, 1]
  int64_t memory_allocated_bytes = 0;  // at the end of the step
  int64_t memory_peak_bytes = 0;       // peak during the step
  int64_t memory_reserved_bytes = 0;
  int64_t model_state_bytes = 0;  // parameters + gradients + optimizer state
  double comm_seconds = 0;        // time blocked on collectives
  int64_t comm_bytes = 0;         // bytes sent through collectives
  // Of comm_bytes, those between HSDP's shard groups (its replicas'
  // all-reduce; usually between nodes). 0 for the other strategies.
  int64_t comm_inter_group_bytes = 0;
  // Of comm_bytes, those within the rank's tensor-parallel group (the
  // activations' all-reduces and the vocabulary-parallel head). 0 without.
  int64_t comm_tensor_parallel_bytes = 0;
  // With pipeline stages: the rank's stage, the seconds it waited on its
  // neighbours' activations and gradients this step (its share of the
  // pipeline bubble), and the bytes it sent them point-to-point. Stage -1
  // (and the other two 0) without pipeline stages.
  int64_t pipeline_stage = -1;
  double pipeline_bubble_seconds = 0;
  int64_t p2p_bytes = 0;
  double val_loss = -1;  // < 0: no eval at this step

  // `step 12/500 | loss 5.4312 | norm 1.23 | lr 6.0e-04 | 312 ms |
  //  38.1% MFU | 52,410 tok/s | mem 1.2 GiB`
  std::string FormatLine() const;
  // One JSON object on one line (no trailing newline).
  std::string ToJson() const;
  static absl::StatusOr<StepMetrics> FromJson(const std::string& line);
};

// Human units, used by every report: "1.2 GiB", "312 ms", "52,410".
std::string FormatBytes(int64_t bytes);
std::string FormatDuration(double seconds);
std::string FormatThousands(int64_t value);
// A size as users write it: "80GiB", "512 MiB", "1.5G", "4096": binary
// units (K, M, G, T, with or without "iB"), decimal ones for "KB", "MB",
// "GB", "TB", plain bytes without a unit. InvalidArgument naming the text
// otherwise (or for a size that is not positive or overflows).
absl::StatusOr<int64_t> ParseBytes(absl::string_view text);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_TRAIN_STEP_METRICS_H_
