// The Llama family as Hugging Face's LlamaForCausalLM builds it (modeling_
// llama.py), as LibTorch modules:
//
//   idx [B,T] -> embed_tokens(idx) -> layers.0 ... layers.{L-1} -> norm
//             -> lm_head (or embed_tokens' weight when tied)
//   Block:  x = x + self_attn(input_layernorm(x))
//           x = x + mlp(post_attention_layernorm(x))                (pre-norm)
//   self_attn: q_proj, k_proj, v_proj -> rotary positions on q and k ->
//              causal softmax(q k^T / sqrt(hs)) v, each key/value head
//              serving n_head / n_kv_head query heads -> o_proj
//   mlp:    down_proj(silu(gate_proj(x)) * up_proj(x))               (SwiGLU)
//   RMSNorm: x / sqrt(mean(x^2) + eps) * weight, in fp32
//
// Parameter names are Hugging Face's without the "model." prefix:
// embed_tokens, layers.<i>.input_layernorm, layers.<i>.self_attn.{q,k,v,o}_
// proj, layers.<i>.post_attention_layernorm, layers.<i>.mlp.{gate,up,down}_
// proj, norm, and lm_head when the head is untied. Linear weights are
// [out, in]; no biases but q, k and v's under attention_bias (Qwen 2.5).
// Rotary positions follow Hugging Face's rotate-half convention (the first
// and second halves of each head's dimensions are the pairs turned), with
// Llama 3's frequency scaling when the config has it. The embedding and an
// untied head have padded_vocab_size rows; rows past vocab_size are zero and
// never scored.
//
// Initialisation: every weight N(0, 0.02) (Hugging Face's initializer_range),
// biases 0, norms 1, in one seeded pass over the parameters as GPT-2's.
#ifndef SHARDTRAIN_WORKER_ENGINE_MODEL_LLAMA_H_
#define SHARDTRAIN_WORKER_ENGINE_MODEL_LLAMA_H_

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/model/model_config.h"
#include "worker/engine/model/causal_lm.h"

namespace shardtrain {

// Root-mean-square normalisation over the last dimension, computed in fp32
// and returned in the input's dtype (Hugging Face's LlamaRMSNorm).
class RmsNormImpl : public torch::nn::Module {
 public:
  RmsNormImpl(int64_t size, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;  // [size]

 private:
  double eps_;
};
TORCH_MODULE(RmsNorm);

// The rotary tables of a model, shared by its blocks: cos and sin [t, hs]
// for positions 0 ... t-1, Hugging Face's inverse frequencies (with Llama 3's
// scaling) computed in fp32. Neither parameters nor buffers: a pure function
// of the config. Built on first use and again when t, the device or the
// dtype changes.
class RotaryTable {
 public:
  explicit RotaryTable(const ModelConfig& config);
  RotaryTable(const RotaryTable&) = delete;
  RotaryTable& operator=(const RotaryTable&) = delete;

  // {cos, sin}, each [t, hs], in the device and dtype of `like`.
  std::pair<torch::Tensor, torch::Tensor> Get(int64_t t,
                                              const torch::Tensor& like);
  // The inverse frequencies [hs / 2], fp32 on the CPU.
  const torch::Tensor& inverse_frequencies() const { return inv_freq_; }

 private:
  torch::Tensor inv_freq_;
  torch::Tensor cos_, sin_;
};

// x * cos + rotate_half(x) * sin over the last dimension; x [..., T, hs].
torch::Tensor ApplyRotary(const torch::Tensor& x, const torch::Tensor& cos,
                          const torch::Tensor& sin);

// Llama's tensor-parallel plan (LlamaImpl::TensorParallelRuns): q_proj by
// query heads, k_proj and v_proj by key/value heads, gate_proj and up_proj
// by rows (column-parallel); o_proj and down_proj by columns (row-parallel);
// embed_tokens and lm_head by vocabulary rows. The norms are whole.

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  LlamaAttentionImpl(const ModelConfig& config,
                     std::shared_ptr<RotaryTable> rotary,
                     std::shared_ptr<CausalMask> mask);
  torch::Tensor forward(const torch::Tensor& x);
  void set_tensor_parallel(TensorParallelOps* tp) { tp_ = tp; }

 private:
  const int64_t n_head_, n_kv_head_, head_size_;
  std::shared_ptr<RotaryTable> rotary_;
  std::shared_ptr<CausalMask> mask_;
  TensorParallelOps* tp_ = nullptr;
  torch::nn::Linear q_proj_{nullptr}, k_proj_{nullptr}, v_proj_{nullptr},
      o_proj_{nullptr};
};
TORCH_MODULE(LlamaAttention);

class LlamaMlpImpl : public torch::nn::Module {
 public:
  explicit LlamaMlpImpl(const ModelConfig& config);
  torch::Tensor forward(const torch::Tensor& x);
  void set_tensor_parallel(TensorParallelOps* tp) { tp_ = tp; }

 private:
  TensorParallelOps* tp_ = nullptr;
  torch::nn::Linear gate_proj_{nullptr}, up_proj_{nullptr}, down_proj_{nullptr};
};
TORCH_MODULE(LlamaMlp);

class LlamaBlockImpl : public torch::nn::Module {
 public:
  LlamaBlockImpl(const ModelConfig& config, std::shared_ptr<RotaryTable> rotary,
                 std::shared_ptr<CausalMask> mask);
  torch::Tensor forward(const torch::Tensor& x);
  LlamaAttention& self_attn() { return self_attn_; }
  LlamaMlp& mlp() { return mlp_; }

 private:
  RmsNorm input_layernorm_{nullptr};
  LlamaAttention self_attn_{nullptr};
  RmsNorm post_attention_layernorm_{nullptr};
  LlamaMlp mlp_{nullptr};
};
TORCH_MODULE(LlamaBlock);

class LlamaImpl : public CausalLmImpl {
 public:
  // `config` must be a Llama config that Validates (checked; throws
  // c10::Error). Initialised as by InitWeights(seed).
  explicit LlamaImpl(const ModelConfig& config, uint64_t seed = 0);

  ModelDims dims() const override;
  torch::Tensor forward(const torch::Tensor& idx) override;
  torch::Tensor Embed(const torch::Tensor& idx) override;
  torch::Tensor HeadLoss(const torch::Tensor& x,
                         const torch::Tensor& targets) override;

  torch::Tensor& token_embedding() override { return embed_tokens_->weight; }
  std::string token_embedding_name() const override {
    return "embed_tokens.weight";
  }
  torch::Tensor& head_weight() override;
  std::string head_weight_name() const override;
  torch::Tensor FinishEmbedding(const torch::Tensor& tokens) override {
    return tokens;
  }
  torch::Tensor FinalNorm(const torch::Tensor& x) override { return norm_(x); }
  torch::Tensor BlockForward(int64_t i, const torch::Tensor& x) override;

  // embed_tokens: the token embedding; layers.<i>.*: block i; norm and
  // lm_head: output.
  ParamPlace PlaceOf(const std::string& name) const override;
  std::string BlockName(int64_t i) const override;

  std::vector<FlatRun> TensorParallelRuns(const std::string& name,
                                          const std::vector<int64_t>& global,
                                          int64_t rank,
                                          int64_t size) const override;
  std::vector<int64_t> TensorParallelShape(const std::string& name,
                                           const std::vector<int64_t>& global,
                                           int64_t size) const override;
  // InvalidArgument, naming the numbers, when T does not divide the query
  // heads, the key/value heads, the MLP's hidden units or the padded
  // vocabulary.
  absl::Status ShardForTensorParallel(TensorParallelOps* tp) override;
  std::string DescribeTensorParallel(int64_t size) const override;
  absl::StatusOr<std::vector<PipelineStage>> PipelineCuts(
      int64_t seq_len, int64_t stages, const std::vector<int64_t>& split,
      int64_t virtual_stages) const override {
    return PartitionPipeline(config_, seq_len, stages, split, virtual_stages);
  }

  std::map<std::string, torch::Tensor*> MemberTensors() override;
  // Hugging Face's model.safetensors (hf_llama.h's layout); see the .cc.
  absl::Status ExportWeights(const std::string& path) override;

  void InitWeights(uint64_t seed);
  const ModelConfig& config() const { return config_; }

 private:
  const ModelConfig config_;
  torch::nn::Embedding embed_tokens_{nullptr};
  torch::nn::ModuleList layers_{nullptr};
  std::vector<LlamaBlock> blocks_;  // The same modules as layers_, typed.
  RmsNorm norm_{nullptr};
  torch::nn::Linear lm_head_{nullptr};  // untied heads only

  // Throws (naming `what`) when `weight` holds a tensor-parallel slice.
  void CheckWholeVocabulary(const char* what,
                            const torch::Tensor& weight) const;
};
TORCH_MODULE(Llama);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_MODEL_LLAMA_H_
