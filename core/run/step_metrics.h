// StepMetrics: what one rank measured in one optimizer step, and the one
// place that formats it for people (the step line) and for machines (JSON).
// Torch-free: the coordinator and the CLI read the same struct.
#ifndef SHARDTRAIN_CORE_RUN_STEP_METRICS_H_
#define SHARDTRAIN_CORE_RUN_STEP_METRICS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardtrain {

// The per-step fields, each declared once: what a rank measured in one
// optimizer step. From this list come the StepMetrics members, the
// metrics.jsonl object (ToJson/FromJson), the v1::StepMetrics conversion
// (proto/job_config.cc, by field name; the store and the Python client hold
// that message), the CSV of `shardtrain metrics --csv` and compare's runs
// (client/step_metrics_csv.cc) and the per-rank Prometheus series
// (server/metrics_exporter.cc). A field added here goes everywhere;
// job.proto and docs/metrics.md are checked against it
// (tests/server/step_fields_test.cc names the place that lacks one).
//
// X(type, name, initial, unit, presence, series kind, series, help):
//   name      the C++ member, the JSON key, the proto field, the CSV column;
//   presence  kRequired: FromJson refuses a line without it;
//             kDefaulted: a line without it (an older writer's) reads as
//               `initial`;
//             kOptional: absent while below 0 (no JSON key, no proto
//               field, an empty CSV cell);
//             kWithStage: written only when pipeline_stage is present;
//   series    the Prometheus series (kNone: none), labelled job, strategy,
//             mesh, rank (and stage for kWithStage fields).
#define SHARDTRAIN_STEP_FIELDS(X)                                              \
  X(int64_t, step, 0, "", kRequired, kGauge, "shardtrain_train_step",          \
    "Last optimizer step reported (1-based)")                                  \
  X(int64_t, total_steps, 0, "", kDefaulted, kNone, "",                        \
    "Optimizer steps the run takes")                                           \
  X(int64_t, epoch, 0, "", kDefaulted, kNone, "",                              \
    "Epoch of the step (0-based)")                                             \
  X(int64_t, rank, 0, "", kRequired, kNone, "", "The rank that measured it")   \
  X(double, loss, 0, "", kRequired, kGauge, "shardtrain_train_loss",           \
    "Training loss of the last step, mean over all ranks")                     \
  X(double, grad_norm, 0, "", kRequired, kGauge, "shardtrain_grad_norm",       \
    "Global gradient norm of the last step, before clipping")                  \
  X(double, lr, 0, "", kRequired, kGauge, "shardtrain_learning_rate",          \
    "Learning rate of the last step")                                          \
  X(double, step_seconds, 0, "seconds", kRequired, kHistogram,                 \
    "shardtrain_step_duration_seconds", "Optimizer step wall time")            \
  X(int64_t, tokens, 0, "tokens", kDefaulted, kCounter,                        \
    "shardtrain_tokens_total",                                                 \
    "Tokens trained on (all ranks), per reporting rank")                       \
  X(double, tokens_per_second, 0, "tokens/s", kRequired, kGauge,               \
    "shardtrain_tokens_per_second",                                            \
    "Tokens per second of the last step (all ranks)")                          \
  X(double, mfu, 0, "ratio", kRequired, kGauge, "shardtrain_mfu_ratio",        \
    "Model FLOPs utilisation of the last step (0..1)")                         \
  X(int64_t, memory_allocated_bytes, 0, "bytes", kRequired, kGauge,            \
    "shardtrain_memory_allocated_bytes",                                       \
    "Tensor memory allocated at the end of the last step")                     \
  X(int64_t, memory_peak_bytes, 0, "bytes", kRequired, kGauge,                 \
    "shardtrain_memory_peak_bytes", "Peak tensor memory during the last step") \
  X(int64_t, memory_reserved_bytes, 0, "bytes", kRequired, kGauge,             \
    "shardtrain_memory_reserved_bytes",                                        \
    "Memory reserved by the allocator (CUDA caching allocator; equals "        \
    "allocated on CPU)")                                                       \
  X(int64_t, model_state_bytes, 0, "bytes", kDefaulted, kNone, "",             \
    "Parameters, gradients and optimizer state the rank holds")                \
  X(double, comm_seconds, 0, "seconds", kDefaulted, kCounter,                  \
    "shardtrain_comm_seconds_total",                                           \
    "Seconds the rank spent blocked on collectives")                           \
  X(int64_t, comm_bytes, 0, "bytes", kDefaulted, kCounter,                     \
    "shardtrain_comm_bytes_total", "Bytes the rank sent through collectives")  \
  X(int64_t, comm_inter_group_bytes, 0, "bytes", kDefaulted, kCounter,         \
    "shardtrain_comm_inter_group_bytes_total",                                 \
    "Of those, bytes sent between HSDP's shard groups (its replicas' "         \
    "all-reduce, usually between nodes); 0 for the other strategies")          \
  X(int64_t, comm_tensor_parallel_bytes, 0, "bytes", kDefaulted, kCounter,     \
    "shardtrain_comm_tensor_parallel_bytes_total",                             \
    "Of those, bytes sent within the rank's tensor-parallel group (the "       \
    "activations' all-reduces and the vocabulary-parallel head); 0 without")   \
  X(int64_t, pipeline_stage, -1, "", kOptional, kNone, "",                     \
    "With pipeline stages, the rank's stage (the series' stage label)")        \
  X(double, pipeline_bubble_seconds, 0, "seconds", kWithStage, kGauge,         \
    "shardtrain_pipeline_bubble_seconds",                                      \
    "Seconds the rank's pipeline stage waited on its neighbours' "             \
    "activations and gradients in the last step (its share of the bubble)")    \
  X(int64_t, p2p_bytes, 0, "bytes", kWithStage, kCounter,                      \
    "shardtrain_p2p_bytes_total",                                              \
    "Bytes the rank's pipeline stage sent its neighbours point-to-point "      \
    "(activations and their gradients)")                                       \
  X(double, val_loss, -1, "", kOptional, kGauge, "shardtrain_val_loss",        \
    "Validation loss of the last eval")

struct StepMetrics {
#define SHARDTRAIN_STEP_MEMBER(type, name, initial, ...) type name = initial;
  SHARDTRAIN_STEP_FIELDS(SHARDTRAIN_STEP_MEMBER)
#undef SHARDTRAIN_STEP_MEMBER

  // `step 12/500 | loss 5.4312 | norm 1.23 | lr 6.0e-04 | 312 ms |
  //  38.1% MFU | 52,410 tok/s | mem 1.2 GiB`
  std::string FormatLine() const;
  // One JSON object on one line (no trailing newline).
  std::string ToJson() const;
  static absl::StatusOr<StepMetrics> FromJson(const std::string& line);
};

// One entry of SHARDTRAIN_STEP_FIELDS, for the code that walks them all.
struct StepField {
  enum class Presence { kRequired, kDefaulted, kOptional, kWithStage };
  enum class Series { kNone, kGauge, kCounter, kHistogram };
  const char* name;
  const char* unit;  // "" for a count or a plain number
  Presence presence;
  Series series;
  const char* series_name;  // "" when series is kNone
  const char* help;
  // Exactly one is set: the member holding the field.
  int64_t StepMetrics::*int_member = nullptr;
  double StepMetrics::*double_member = nullptr;

  bool is_integer() const { return int_member != nullptr; }
  double Value(const StepMetrics& m) const {
    return is_integer() ? static_cast<double>(m.*int_member) : m.*double_member;
  }
  void Set(StepMetrics& m, double value) const {
    if (is_integer()) {
      m.*int_member = static_cast<int64_t>(value);
    } else {
      m.*double_member = value;
    }
  }
  // Whether `m` carries the field (kOptional: not below 0; kWithStage: a
  // pipeline stage is present).
  bool PresentIn(const StepMetrics& m) const;
};

// Every field, in declaration order.
const std::vector<StepField>& StepFields();

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

#endif  // SHARDTRAIN_CORE_RUN_STEP_METRICS_H_
