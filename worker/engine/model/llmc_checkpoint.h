// Import and export of GPT-2 weights in llm.c's model file layout
// (karpathy/llm.c, train_gpt2.py write_model / train_gpt2.c
// gpt2_build_from_checkpoint), so pretrained GPT-2 can be fine-tuned here and
// our models read by llm.c and other tools.
//
// The layout is llmc_layout.h's. Version 5 (bf16) files are recognised and
// refused.
#ifndef SHARDTRAIN_WORKER_ENGINE_MODEL_LLMC_CHECKPOINT_H_
#define SHARDTRAIN_WORKER_ENGINE_MODEL_LLMC_CHECKPOINT_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/model/llmc_layout.h"
#include "core/model/model_config.h"
#include "worker/engine/model/gpt2.h"

namespace shardtrain {

// Writes `model`'s weights (from any device) to `path`: first to a temporary
// file beside it, flushed to disk, then renamed over `path`, so a reader never
// sees a torn file.
absl::Status SaveLlmcCheckpoint(Gpt2& model, const std::string& path);

// Reads the weights of `path` into `model` (on any device). The file's config
// must have the model's shape. Every check runs before the model is touched;
// only a read that fails midway (the file changing underneath) leaves the
// model partly loaded.
absl::Status LoadLlmcCheckpoint(const std::string& path, Gpt2& model);

// Reads every weight of `model` (on any device) from `read`, in llm.c's
// order: the import of any format (core/checkpoint/checkpoint_export.h's
// OpenModelWeights). The caller has checked the shapes.
absl::Status LoadWeights(const WeightReader& read, Gpt2& model);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_MODEL_LLMC_CHECKPOINT_H_
