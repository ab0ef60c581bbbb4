// Hugging Face's GPT-2 on disk (transformers' GPT2LMHeadModel directory),
// read and written without LibTorch or Python:
//
//   config.json         GPT2Config: n_embd, n_layer, n_head, n_positions,
//                       vocab_size, activation_function, ...
//   model.safetensors   the weights (safetensors.h), named
//                       "transformer.wte.weight",
//                       "transformer.h.0.ln_1.weight",
//                       ... "transformer.ln_f.bias"; the LM head is tied to wte
//                       and not stored
//
// Two differences from our model's tensors (llmc_layout.h) are converted on
// the way in and out:
//  - Hugging Face's GPT-2 uses Conv1D, whose weight is [in, out]: c_attn,
//    c_proj and c_fc weights are stored transposed against our [out, in];
//  - wte holds vocab_size rows there, padded_vocab_size here: the padding
//    rows (zero, never predicted) are dropped on export and zero on import;
//    a non-default padding is kept in the file's metadata.
// Both are exact copies, so export then import is bit for bit.
//
// Imported configs must describe the model we build: tanh GELU
// ("gelu_new"/"gelu_pytorch_tanh"), inner size 4 * n_embd, layer norm eps
// 1e-5, tied embeddings, attention scaled by 1/sqrt(head size). Dropout
// settings are ignored (we train without dropout).
#ifndef SHARDTRAIN_CORE_MODEL_HF_GPT2_H_
#define SHARDTRAIN_CORE_MODEL_HF_GPT2_H_

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/model/llmc_layout.h"
#include "core/model/model_config.h"
#include "core/model/safetensors.h"

namespace shardtrain {

inline constexpr char kHfConfigFile[] = "config.json";
inline constexpr char kHfWeightsFile[] = "model.safetensors";

// True when `path` is a directory holding config.json (what --init-from and
// `checkpoint export` take for a Hugging Face model).
bool IsHfModelDir(const std::string& path);

// config.json for `config` (GPT2LMHeadModel, float32).
std::string HfModelConfigJson(const ModelConfig& config);

// The config.json text as our config; errors name the setting we cannot
// build. `padded_vocab_size` 0: vocab_size rounded up as ParseModelSpec does.
absl::StatusOr<ModelConfig> ParseHfModelConfig(std::string_view json_text,
                                               int64_t padded_vocab_size = 0);

// Writes config.json and model.safetensors for a model shaped `config` into
// `dir` (created if missing), each atomically; `read` supplies the weights
// in llm.c's order (LlmcParameterNames).
absl::Status WriteHfGpt2(const ModelConfig& config, const WeightReader& read,
                         const std::string& dir);

// The Hugging Face name of one of our parameters: "h.0.attn.c_attn.weight" ->
// "transformer.h.0.attn.c_attn.weight".
std::string HfGpt2TensorName(const std::string& ours);

// A Hugging Face GPT-2 directory opened for reading, its weights served in
// llm.c's order and shapes.
class HfGpt2Reader {
 public:
  // Checks config.json and that model.safetensors holds every weight with
  // its shape (names with or without the "transformer." prefix; the
  // attention-mask buffers and a tied lm_head are ignored); nothing is read
  // beyond the headers.
  static absl::StatusOr<std::unique_ptr<HfGpt2Reader>> Open(
      const std::string& dir);

  const ModelConfig& config() const { return config_; }
  // Tensor `index` of LlmcParameterNames(config()) into `out`, transposed to
  // [out, in] and padded as our model holds it.
  absl::Status Read(size_t index, float* out) const;

 private:
  HfGpt2Reader(ModelConfig config, SafetensorsFile file,
               std::vector<size_t> entries)
      : config_(std::move(config)),
        names_(LlmcParameterNames(config_)),
        file_(std::move(file)),
        entries_(std::move(entries)) {}

  ModelConfig config_;
  std::vector<std::string> names_;  // LlmcParameterNames(config_)
  SafetensorsFile file_;
  std::vector<size_t> entries_;  // file_.tensors() index, in llm.c order
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_MODEL_HF_GPT2_H_
