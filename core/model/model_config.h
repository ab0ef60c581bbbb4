// ModelConfig: the shape of a model of one of the families the engine builds,
// its presets, its parameter count and its FLOPs per token. Torch-free, so the
// CLI and the coordinator can validate and describe a model without linking
// LibTorch.
#ifndef SHARDTRAIN_CORE_MODEL_MODEL_CONFIG_H_
#define SHARDTRAIN_CORE_MODEL_MODEL_CONFIG_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace shardtrain {

// The decoder-only families the engine builds.
enum class ModelFamily {
  // GPT-2 as nanoGPT builds it: learned positions, pre-LN LayerNorm with
  // biases, 4C GELU MLP, multi-head attention, the head tied to wte.
  kGpt2,
  // Llama as Hugging Face's LlamaForCausalLM builds it: RMSNorm, rotary
  // positions (rotate-half), grouped-query attention, SwiGLU MLP, no biases
  // (attention biases optional: Qwen 2.5's layout), tied or untied head.
  kLlama,
};
// "gpt2", "llama".
const char* ModelFamilyName(ModelFamily family);
// Every family's name, in ModelFamily's order: what the programs' help
// lists.
std::vector<std::string> ModelFamilyNames();

// The default padding of a vocabulary: padded_vocab_size is vocab_size
// rounded up to a multiple of this.
inline constexpr int64_t kVocabPadMultiple = 64;

// Llama 3's rotary frequency scaling (rope_scaling.rope_type = "llama3");
// factor 0: none.
struct RopeScaling {
  double factor = 0;
  double low_freq_factor = 1;
  double high_freq_factor = 4;
  int64_t original_max_position_embeddings = 8192;
  bool operator==(const RopeScaling& o) const {
    return factor == o.factor && low_freq_factor == o.low_freq_factor &&
           high_freq_factor == o.high_freq_factor &&
           original_max_position_embeddings ==
               o.original_max_position_embeddings;
  }
};

// Dimensions of a model. The defaults are GPT-2 124M. The names are GPT-2's;
// Hugging Face's Llama config calls them num_hidden_layers (n_layer),
// num_attention_heads (n_head), num_key_value_heads (n_kv_head),
// hidden_size (n_embd), max_position_embeddings (block_size).
struct ModelConfig {
  // Preset name ("gpt2-tiny", "llama3.2-1b", ...) or "custom".
  std::string name = "custom";
  ModelFamily family = ModelFamily::kGpt2;
  // Maximum sequence length (GPT-2: rows of the position embedding).
  int64_t block_size = 1024;
  // Tokens the model predicts; the LM head produces this many logits.
  int64_t vocab_size = 50257;
  // Rows of the token embedding (and of an untied head): vocab_size rounded
  // up (to a multiple of 64 by default) for faster matrix products. Rows at
  // or past vocab_size are zero and never predicted.
  int64_t padded_vocab_size = 50304;
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_embd = 768;

  // Llama family only (GPT-2: kv heads = n_head, 4C MLP, tied head).
  // Key/value heads; a divisor of n_head (0 in a GPT-2 config).
  int64_t n_kv_head = 0;
  // The SwiGLU MLP's hidden units.
  int64_t intermediate_size = 0;
  double rope_theta = 10000;
  RopeScaling rope_scaling;
  double norm_eps = 1e-5;  // RMSNorm's epsilon
  // The head shares the token embedding's weight (tie_word_embeddings).
  bool tie_embeddings = true;
  // q, k and v projections with biases (Qwen 2.5).
  bool attention_bias = false;

  // The config of a named preset. The error lists the allowed names.
  static absl::StatusOr<ModelConfig> FromPreset(std::string_view name);
  // Preset names, smallest model first.
  static std::vector<std::string> PresetNames();

  // OK when every dimension is positive and within sane bounds, n_embd is a
  // multiple of n_head, n_kv_head divides n_head, the head size is even
  // (rotary positions) and padded_vocab_size >= vocab_size. Errors name the
  // field and the allowed values.
  absl::Status Validate() const;

  // True when both configs describe the same model (every dimension and
  // option equal; the name is ignored).
  bool SameShape(const ModelConfig& other) const;

  bool is_llama() const { return family == ModelFamily::kLlama; }
  // n_embd / n_head.
  int64_t head_size() const { return n_embd / n_head; }
  // Key/value heads: n_head for GPT-2.
  int64_t kv_heads() const { return is_llama() ? n_kv_head : n_head; }
  // The MLP's hidden units: 4 * n_embd for GPT-2.
  int64_t mlp_hidden() const {
    return is_llama() ? intermediate_size : 4 * n_embd;
  }
  // Whether the head is the token embedding (always for GPT-2).
  bool tied_head() const { return !is_llama() || tie_embeddings; }

  // The parameters of one block, of the input side (GPT-2's learned
  // positions) and of the output side (the final norm, an untied head).
  int64_t BlockParameters() const;
  int64_t InputParameters() const;
  int64_t OutputParameters() const;
  // Every parameter, counting the padded rows of the token embedding and
  // counting a tied LM head once: "gpt2" -> 124,475,904,
  // "llama3.1-8b" -> 8,030,261,248.
  int64_t NumParameters() const;

  // Training FLOPs (forward + backward) per token at sequence length seq_len,
  // nanoGPT's estimate_mfu() convention (PaLM paper, appendix B):
  //   6 * N + 12 * n_layer * n_head * head_size * seq_len
  // where N counts the parameters of matrix products: every parameter but
  // GPT-2's position embedding and an untied token embedding (lookups; a
  // tied one stays because it is the head's product). The second term is
  // attention's QK^T and AV products, counted without the causal halving.
  double FlopsPerToken(int64_t seq_len) const;

  // A spec that ParseModelSpec() turns back into this config: the preset name
  // when the name is a preset whose shape matches, else the "custom:" form.
  std::string ToSpec() const;
};

// Parses a model spec, one of:
//   <preset>                    e.g. "gpt2-mini", "llama-tiny"
//                               (see ModelConfig::PresetNames)
//   custom:<field>=<int>,...    GPT-2, e.g.
//   "custom:n_layer=4,n_head=4,n_embd=256" custom-llama:<field>=<value>,...
//                               Llama, e.g. "custom-llama:n_layer=2,n_head=4,
//                               n_kv_head=2,n_embd=128,intermediate_size=384"
// GPT-2's custom fields: n_layer, n_head, n_embd (required), block_size
// (default 1024), vocab_size (default 50257), padded_vocab_size (default:
// vocab_size rounded up to a multiple of 64). Llama's add n_kv_head (default
// n_head), intermediate_size (required), rope_theta (default 10000),
// norm_eps (1e-5), tie_embeddings (0 or 1, default 1), attention_bias (0 or
// 1, default 0) and rope_scaling_factor, rope_low_freq_factor,
// rope_high_freq_factor, rope_original_max_position_embeddings (Llama 3's
// scaling; factor 0, the default: none). Spaces around fields are ignored.
// The result is validated; errors name the offending field and the allowed
// values.
absl::StatusOr<ModelConfig> ParseModelSpec(std::string_view spec);

// The file a finished run writes its model to, in its family's format:
// "model.bin" (llm.c's) for GPT-2, "model.safetensors" (Hugging Face's
// names) for Llama.
std::string ExportedModelFileName(const ModelConfig& config);
// The config.json a finished run writes beside that file when its format
// needs one (model.safetensors: the run's output is then a Hugging Face
// directory, which --init-from and `checkpoint export` open); "" when the
// file carries its shape (llm.c's header).
std::string ExportedModelConfigJson(const ModelConfig& config);

// The logits budget of one chunk of the chunked LM head (LmHeadLoss in
// gpt2.h), for the model and for the memory plan alike. 512 MiB on an
// accelerator. On CPU 128 MiB per compute thread of the rank: each chunk
// adds its product into wte's whole [V, C] gradient, a pass over memory whose
// cost against the chunk's matrix products grows with the threads doing
// them, so fewer, larger chunks pay when more threads compute
// (bench/RESULTS.md §6: 16 MiB chunks cost 10-12% of the step at one thread,
// 15-30% at two; 128 MiB per thread is within noise of the fastest).
int64_t HeadChunkBytes(bool accelerator, int64_t compute_threads);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_MODEL_MODEL_CONFIG_H_
