// What a checkpoint becomes outside training, without ranks or LibTorch: the
// model in llm.c's format or Hugging Face's, and a summary (`shardtrain
// checkpoint inspect` and `export`). Also where a model's weights are read
// from, whatever holds them (a checkpoint, an llm.c file, a Hugging Face
// directory): `export` and --init-from.
#ifndef SHARDTRAIN_CORE_CHECKPOINT_CHECKPOINT_EXPORT_H_
#define SHARDTRAIN_CORE_CHECKPOINT_CHECKPOINT_EXPORT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/checkpoint/checkpoint_format.h"
#include "core/model/llmc_layout.h"
#include "core/model/model_config.h"

namespace shardtrain {

// The checkpoint directory `path` names: a checkpoint itself, a run's --out
// or its checkpoints/ folder (then its newest complete checkpoint).
absl::StatusOr<std::string> ResolveCheckpointDir(const std::string& path);

// Writes the checkpoint's model weights to `path` as llm.c's fp32 model file
// (core/model/llmc_layout.h), atomically. Errors name a missing or
// misshapen tensor.
absl::Status ExportCheckpointAsLlmc(CheckpointReader& reader,
                                    const std::string& path);

// A model's weights wherever they are stored, read tensor by tensor.
struct ModelWeights {
  ModelConfig config;
  // "checkpoint DIR (step N)", "llm.c model FILE", "Hugging Face model DIR".
  std::string description;
  // A checkpoint's: the data folder its run trained on ("" when unknown).
  std::string data;
  // Our names of the model's tensors in `read`'s order (ModelParameterNames:
  // llm.c's order for GPT-2, the model's own for Llama), shaped as
  // ModelParameterShapes says.
  std::vector<std::string> names;
  // Reads tensor `index` of `names`; valid while this lives.
  WeightReader read;
  std::shared_ptr<void> source;  // what `read` reads from
};

// A model's tensors as the formats carry them: llm.c's order for GPT-2
// (LlmcParameterNames), the model's own for Llama (LlamaParameterNames).
std::vector<std::string> ModelParameterNames(const ModelConfig& config);
std::vector<std::vector<int64_t>> ModelParameterShapes(
    const ModelConfig& config);

// Opens `path`: a Hugging Face directory (config.json and model.safetensors
// or its sharded index: GPT-2, Llama or Qwen 2 by model_type), an llm.c model
// file, a checkpoint, a run's --out or its checkpoints/ folder (the latest
// checkpoint; a finished run without one: the model it wrote, model.bin or
// the Hugging Face directory a Llama run's output is). Headers and shapes
// are checked here; errors name the path and what is wrong.
absl::StatusOr<ModelWeights> OpenModelWeights(const std::string& path);

// Writes `weights` as llm.c's fp32 model file, atomically (GPT-2 only; a
// Llama model is refused, naming --to hf).
absl::Status WriteLlmcModel(const ModelWeights& weights,
                            const std::string& path);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_CHECKPOINT_CHECKPOINT_EXPORT_H_
