// llm.c's GPT-2 model file layout without LibTorch: the header and the order
// of the tensors (karpathy/llm.c, train_gpt2.py write_model). The model's
// import and export (llmc_checkpoint.h) and the export of a sharded
// checkpoint (core/checkpoint/checkpoint_export.h) both follow it.
//
// A header of 256 little-endian int32
//   [0] 20240326 (magic)  [1] 3 (version: fp32 weights)  [2] maxT (block_size)
//   [3] V (vocab_size)     [4] L (n_layer)  [5] NH (n_head)  [6] C (n_embd)
//   [7] Vp (padded_vocab_size), the rest 0
// followed by the fp32 tensors, each layer-stacked one after the other:
//   wte [Vp,C]  wpe [maxT,C]  ln1w [L,C]  ln1b [L,C]  qkvw [L,3C,C]
//   qkvb [L,3C]  attprojw [L,C,C]  attprojb [L,C]  ln2w [L,C]  ln2b [L,C]
//   fcw [L,4C,C]  fcb [L,4C]  fcprojw [L,C,4C]  fcprojb [L,C]  lnfw [C]
//   lnfb [C]
// Matrices are [out, in], as torch::nn::Linear stores them, so the file is
// 1024 + 4 * ModelConfig::NumParameters() bytes exactly.
#ifndef SHARDTRAIN_CORE_MODEL_LLMC_LAYOUT_H_
#define SHARDTRAIN_CORE_MODEL_LLMC_LAYOUT_H_

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/input_file.h"
#include "core/model/model_config.h"

namespace shardtrain {

inline constexpr int32_t kLlmcModelMagic = 20240326;
inline constexpr int32_t kLlmcModelVersionFp32 = 3;
inline constexpr int32_t kLlmcModelVersionBf16 = 5;
inline constexpr int64_t kLlmcHeaderBytes = 256 * sizeof(int32_t);

using LlmcHeader = std::array<int32_t, 256>;

// The config stored in the header of `path` (named after a preset when the
// dimensions match one, else "custom"). Checks the magic, the version, the
// dimensions and that the file size matches the layout exactly.
absl::StatusOr<ModelConfig> ReadLlmcConfig(const std::string& path);
absl::StatusOr<ModelConfig> ReadLlmcConfig(const InputFile& file);

// The header of an fp32 file of a model shaped as `config`.
LlmcHeader MakeLlmcHeader(const ModelConfig& config);

// Supplies the model's tensor `index` (in LlmcParameterNames order, shaped
// as LlmcParameterShapes says) as float32 into `out`: how a model's weights
// travel between formats (llm.c, Hugging Face, our checkpoints).
using WeightReader = std::function<absl::Status(size_t index, float* out)>;

// The model's parameter names (as Gpt2 names them: "wte.weight",
// "h.0.ln_1.weight", ...) in the file's order.
std::vector<std::string> LlmcParameterNames(const ModelConfig& config);
// Their shapes, in the same order ([out, in] for matrices).
std::vector<std::vector<int64_t>> LlmcParameterShapes(
    const ModelConfig& config);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_MODEL_LLMC_LAYOUT_H_
