// Import and export of GPT-2 weights in llm.c's model file layout
// (karpathy/llm.c, train_gpt2.py write_model / train_gpt2.c
// gpt2_build_from_checkpoint), so pretrained GPT-2 can be fine-tuned here and
// our models read by llm.c and other tools.
//
// Layout: a header of 256 little-endian int32
//   [0] 20240326 (magic)  [1] 3 (version: fp32 weights)  [2] maxT (block_size)
//   [3] V (vocab_size)     [4] L (n_layer)  [5] NH (n_head)  [6] C (n_embd)
//   [7] Vp (padded_vocab_size), the rest 0
// followed by the fp32 tensors, each layer-stacked one after the other:
//   wte [Vp,C]  wpe [maxT,C]  ln1w [L,C]  ln1b [L,C]  qkvw [L,3C,C]
//   qkvb [L,3C]  attprojw [L,C,C]  attprojb [L,C]  ln2w [L,C]  ln2b [L,C]
//   fcw [L,4C,C]  fcb [L,4C]  fcprojw [L,C,4C]  fcprojb [L,C]  lnfw [C]
//   lnfb [C]
// Matrices are [out, in], as torch::nn::Linear stores them, so the file is
// 1024 + 4 * Gpt2Config::NumParameters() bytes exactly. Version 5 (bf16)
// files are recognised and refused.
#ifndef SHARDTRAIN_WORKER_ENGINE_MODEL_LLMC_CHECKPOINT_H_
#define SHARDTRAIN_WORKER_ENGINE_MODEL_LLMC_CHECKPOINT_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/model/gpt2.h"
#include "worker/engine/model/gpt2_config.h"

namespace shardtrain {

inline constexpr int32_t kLlmcModelMagic = 20240326;
inline constexpr int32_t kLlmcModelVersionFp32 = 3;
inline constexpr int32_t kLlmcModelVersionBf16 = 5;
inline constexpr int64_t kLlmcHeaderBytes = 256 * sizeof(int32_t);

// Writes `model`'s weights (from any device) to `path`: first to a temporary
// file beside it, flushed to disk, then renamed over `path`, so a reader never
// sees a torn file.
absl::Status SaveLlmcCheckpoint(Gpt2& model, const std::string& path);

// The config stored in the header of `path` (named after a preset when the
// dimensions match one, else "custom"). Checks the magic, the version, the
// dimensions and that the file size matches the layout exactly.
absl::StatusOr<Gpt2Config> ReadLlmcConfig(const std::string& path);

// Reads the weights of `path` into `model` (on any device). The file's config
// must have the model's shape. Every check runs before the model is touched;
// only a read that fails midway (the file changing underneath) leaves the
// model partly loaded.
absl::Status LoadLlmcCheckpoint(const std::string& path, Gpt2& model);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_MODEL_LLMC_CHECKPOINT_H_
