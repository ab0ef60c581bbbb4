// What a checkpoint becomes outside training, without ranks or LibTorch: the
// model in llm.c's format, and a summary (`shardtrain checkpoint inspect` and
// `export`).
#ifndef SHARDTRAIN_WORKER_ENGINE_TRAIN_CHECKPOINT_EXPORT_H_
#define SHARDTRAIN_WORKER_ENGINE_TRAIN_CHECKPOINT_EXPORT_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/train/checkpoint_format.h"

namespace shardtrain {

// The checkpoint directory `path` names: a checkpoint itself, a run's --out
// or its checkpoints/ folder (then its newest complete checkpoint).
absl::StatusOr<std::string> ResolveCheckpointDir(const std::string& path);

// Writes the checkpoint's model weights to `path` as llm.c's fp32 model file
// (worker/engine/model/llmc_layout.h), atomically. Errors name a missing or
// misshapen tensor.
absl::Status ExportCheckpointAsLlmc(CheckpointReader& reader,
                                    const std::string& path);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_TRAIN_CHECKPOINT_EXPORT_H_
