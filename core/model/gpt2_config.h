// Gpt2Config: the shape of a GPT-2 model, its presets, its parameter count and
// its FLOPs per token. Torch-free, so the CLI and the coordinator can validate
// and describe a model without linking LibTorch.
#ifndef SHARDTRAIN_CORE_MODEL_GPT2_CONFIG_H_
#define SHARDTRAIN_CORE_MODEL_GPT2_CONFIG_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace shardtrain {

// Dimensions of a GPT-2 (nanoGPT) model. The defaults are GPT-2 124M.
struct Gpt2Config {
  // Preset name ("gpt2-tiny", "gpt2", ...) or "custom".
  std::string name = "custom";
  // Maximum sequence length (rows of the position embedding).
  int64_t block_size = 1024;
  // Tokens the model predicts; the LM head produces this many logits.
  int64_t vocab_size = 50257;
  // Rows of the token embedding: vocab_size rounded up (to a multiple of 64 by
  // default) for faster matrix products. Rows at or past vocab_size are zero
  // and never predicted.
  int64_t padded_vocab_size = 50304;
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_embd = 768;

  // The config of a named preset. The error lists the allowed names.
  static absl::StatusOr<Gpt2Config> FromPreset(std::string_view name);
  // Preset names, smallest model first.
  static std::vector<std::string> PresetNames();

  // OK when every dimension is positive and within sane bounds, n_embd is a
  // multiple of n_head and padded_vocab_size >= vocab_size. Errors name the
  // field and the allowed values.
  absl::Status Validate() const;

  // True when both configs describe the same tensors (every dimension equal;
  // the name is ignored).
  bool SameShape(const Gpt2Config& other) const;

  // n_embd / n_head.
  int64_t head_size() const { return n_embd / n_head; }

  // Every parameter, counting the padded rows of the token embedding and
  // counting the tied LM head once: "gpt2" -> 124,475,904.
  int64_t NumParameters() const;

  // Training FLOPs (forward + backward) per token at sequence length seq_len,
  // nanoGPT's estimate_mfu() convention (PaLM paper, appendix B):
  //   6 * N + 12 * n_layer * n_head * head_size * seq_len
  // where N is nanoGPT's get_num_params(): every parameter except the
  // position embedding (the token embedding stays because, tied to the LM
  // head, it is a matrix product). The second term is attention's QK^T and
  // AV products, counted without the causal halving.
  double FlopsPerToken(int64_t seq_len) const;

  // A spec that ParseModelSpec() turns back into this config: the preset name
  // when the name is a preset whose shape matches, else the "custom:" form.
  std::string ToSpec() const;
};

// Parses a model spec, one of:
//   <preset>                    e.g. "gpt2-mini" (see Gpt2Config::PresetNames)
//   custom:<field>=<int>,...    e.g. "custom:n_layer=4,n_head=4,n_embd=256"
// Custom fields: n_layer, n_head, n_embd (required), block_size (default
// 1024), vocab_size (default 50257), padded_vocab_size (default: vocab_size
// rounded up to a multiple of 64). Spaces around fields are ignored. The
// result is validated; errors name the offending field and the allowed values.
absl::StatusOr<Gpt2Config> ParseModelSpec(std::string_view spec);

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

#endif  // SHARDTRAIN_CORE_MODEL_GPT2_CONFIG_H_
