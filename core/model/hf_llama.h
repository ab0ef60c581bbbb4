// Hugging Face's Llama family on disk (transformers' LlamaForCausalLM, and
// Qwen2ForCausalLM for the layout with q/k/v biases), read and written
// without LibTorch or Python:
//
//   config.json                     LlamaConfig / Qwen2Config: hidden_size,
//                                   intermediate_size, num_hidden_layers,
//                                   num_attention_heads, num_key_value_heads,
//                                   rope_theta, rope_scaling, rms_norm_eps,
//                                   tie_word_embeddings, ...
//   model.safetensors               the weights, named "model.embed_tokens.
//                                   weight", "model.layers.0.self_attn.
//                                   q_proj.weight", ..., "model.norm.weight"
//                                   and, untied, "lm_head.weight"
//   or model.safetensors.index.json the same split over several files (its
//                                   weight_map names each tensor's file)
//
// Our parameters are Hugging Face's names without "model." (lm_head keeps
// its name), with the same [out, in] layout; the embedding and an untied head
// hold vocab_size rows there and padded_vocab_size here (zero rows, never
// scored), dropped on export and zero on import. Both directions are exact
// copies. F32, F16 and BF16 tensors are read (widened exactly); everything is
// written as F32.
//
// Imported configs must describe the model we build: SiLU MLP without
// biases, head_dim = hidden_size / num_attention_heads, rope_scaling none or
// Llama 3's; a Llama config with attention_bias (which biases o_proj too) is
// refused, Qwen 2's q/k/v biases are taken. Every refusal names the setting.
#ifndef SHARDTRAIN_CORE_MODEL_HF_LLAMA_H_
#define SHARDTRAIN_CORE_MODEL_HF_LLAMA_H_

#include <cstdint>
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

inline constexpr char kHfWeightsIndexFile[] = "model.safetensors.index.json";
// transformers' save_pretrained default (max_shard_size "5GB").
inline constexpr int64_t kHfMaxShardBytes = 5'000'000'000;

// A Llama model's parameter names as LlamaImpl registers them
// ("embed_tokens.weight", "layers.0.input_layernorm.weight", ...), in that
// order, and their shapes (the embedding and head padded).
std::vector<std::string> LlamaParameterNames(const ModelConfig& config);
std::vector<std::vector<int64_t>> LlamaParameterShapes(
    const ModelConfig& config);

// "layers.0.mlp.up_proj.weight" -> "model.layers.0.mlp.up_proj.weight";
// "lm_head.weight" stays.
std::string HfLlamaTensorName(const std::string& ours);

// The model_type of a config.json text ("gpt2" when it names none, "" when
// it is not a JSON object or nests deeper than kMaxHfJsonNesting).
std::string HfModelType(std::string_view json_text);

// config.json for `config` (LlamaForCausalLM; Qwen2ForCausalLM with
// attention biases).
std::string HfLlamaConfigJson(const ModelConfig& config);

// config.json's text (model_type "llama" or "qwen2") as our config; errors
// name the setting we cannot build.
absl::StatusOr<ModelConfig> ParseHfLlamaConfig(std::string_view json_text);

// Writes config.json and the weights for a model shaped `config` into `dir`
// (created if missing), each file atomically: model.safetensors, or, when
// the weights exceed `max_shard_bytes`, model-0000i-of-0000n.safetensors
// files of at most that much (a larger tensor alone in its file) and
// model.safetensors.index.json. `read` supplies the weights in
// LlamaParameterNames order.
absl::Status WriteHfLlama(const ModelConfig& config, const WeightReader& read,
                          const std::string& dir,
                          int64_t max_shard_bytes = kHfMaxShardBytes);

// A Hugging Face Llama directory opened for reading, its weights served in
// LlamaParameterNames order and shapes.
class HfLlamaReader {
 public:
  // Checks config.json and that the weights (one file, or the files the
  // index names, each inside `dir`) hold every weight once with its shape;
  // nothing is read beyond the headers.
  static absl::StatusOr<std::unique_ptr<HfLlamaReader>> Open(
      const std::string& dir);

  const ModelConfig& config() const { return config_; }
  // Tensor `index` of LlamaParameterNames(config()) into `out`, padded as
  // our model holds it.
  absl::Status Read(size_t index, float* out) const;

 private:
  HfLlamaReader() = default;

  ModelConfig config_;
  std::vector<std::string> names_;
  std::vector<SafetensorsFile> files_;
  // For each of names_: (file, entry) in files_.
  std::vector<std::pair<size_t, size_t>> entries_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_MODEL_HF_LLAMA_H_
