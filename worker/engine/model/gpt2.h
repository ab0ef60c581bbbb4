// GPT-2 exactly as nanoGPT builds it (model.py), as LibTorch modules:
//
//   idx [B,T] -> wte(idx) + wpe[0:T] -> h.0 ... h.{L-1} -> ln_f -> x @ wte^T
//   Block:  x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))          (pre-LN)
//   attn:   c_attn -> q,k,v -> causal softmax(q k^T / sqrt(hs)) v -> c_proj
//   mlp:    c_fc (C -> 4C) -> GELU (tanh approximation) -> c_proj (4C -> C)
//
// Parameter names follow GPT-2/nanoGPT without the "transformer." prefix:
// wte, wpe, h.<i>.ln_1, h.<i>.attn.c_attn, h.<i>.attn.c_proj, h.<i>.ln_2,
// h.<i>.mlp.c_fc, h.<i>.mlp.c_proj, ln_f. Linear weights are [out, in], as in
// nanoGPT and llm.c. The LM head is tied to wte: there is no lm_head
// parameter. wte has padded_vocab_size rows but logits are computed against
// its first vocab_size rows only, so padding never enters the softmax, its
// rows stay zero and never receive gradient.
//
// Differences from nanoGPT, on purpose: no dropout (GPT-2 pretraining
// settings in nanoGPT use 0.0, and dropout would break the bit-for-bit
// comparisons between strategies); weights are initialised in one seeded pass
// over the parameters (see Gpt2Impl::InitWeights) instead of module.apply().
//
// The attention, MLP and block modules live here rather than in files of
// their own: they are the parts of one model, read together (as in nanoGPT's
// model.py), and each extra translation unit that includes LibTorch costs a
// long compile.
#ifndef SHARDTRAIN_WORKER_ENGINE_MODEL_GPT2_H_
#define SHARDTRAIN_WORKER_ENGINE_MODEL_GPT2_H_

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/model/model_config.h"
#include "worker/engine/model/causal_lm.h"

namespace shardtrain {

// GPT-2's tensor-parallel plan (Megatron's split, Gpt2Impl::
// TensorParallelRuns): attn.c_attn (C -> 3C) and mlp.c_fc (C -> 4C) are
// column-parallel: the rank holds its rows of the weight and bias, c_attn's
// by heads (its rows of each of q, k and v). attn.c_proj and mlp.c_proj are
// row-parallel: its columns of the weight. wte is vocabulary-parallel: the
// rank holds its 1/T of the rows. The row-parallel biases, the LayerNorms and
// wpe are whole on every rank (one run).

// Multi-head causal self-attention: [B,T,C] -> [B,T,C].
class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  CausalSelfAttentionImpl(const ModelConfig& config,
                          std::shared_ptr<CausalMask> mask);
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::Linear& c_attn() { return c_attn_; }  // C -> 3C: q, k, v
  torch::nn::Linear& c_proj() { return c_proj_; }  // C -> C, residual
  // Runs n_head / T heads through `tp` (the weights already sliced).
  void set_tensor_parallel(TensorParallelOps* tp) { tp_ = tp; }

 private:
  const int64_t n_head_;
  const int64_t n_embd_;
  std::shared_ptr<CausalMask> mask_;
  TensorParallelOps* tp_ = nullptr;
  torch::nn::Linear c_attn_{nullptr};
  torch::nn::Linear c_proj_{nullptr};
};
TORCH_MODULE(CausalSelfAttention);

// Position-wise MLP: [B,T,C] -> [B,T,C] through 4C with tanh-GELU.
class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const ModelConfig& config);
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::Linear& c_fc() { return c_fc_; }      // C -> 4C
  torch::nn::Linear& c_proj() { return c_proj_; }  // 4C -> C, residual
  // Runs 4C / T hidden units through `tp` (the weights already sliced).
  void set_tensor_parallel(TensorParallelOps* tp) { tp_ = tp; }

 private:
  TensorParallelOps* tp_ = nullptr;
  torch::nn::Linear c_fc_{nullptr};
  torch::nn::Linear c_proj_{nullptr};
};
TORCH_MODULE(Mlp);

// One transformer block, the unit FSDP gathers and frees: [B,T,C] -> [B,T,C].
class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const ModelConfig& config, std::shared_ptr<CausalMask> mask);
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::LayerNorm& ln_1() { return ln_1_; }
  CausalSelfAttention& attn() { return attn_; }
  torch::nn::LayerNorm& ln_2() { return ln_2_; }
  Mlp& mlp() { return mlp_; }

 private:
  torch::nn::LayerNorm ln_1_{nullptr};
  CausalSelfAttention attn_{nullptr};
  torch::nn::LayerNorm ln_2_{nullptr};
  Mlp mlp_{nullptr};
};
TORCH_MODULE(Block);

// The whole model. forward() == Head(blocks in order(Embed(idx))), so a
// strategy may run the pieces one at a time (causal_lm.h).
class Gpt2Impl : public CausalLmImpl {
 public:
  // `config` must Validate() (checked; a bad one throws c10::Error). The new
  // model is initialised as by InitWeights(seed).
  explicit Gpt2Impl(const ModelConfig& config, uint64_t seed = 0);

  ModelDims dims() const override;
  // Returns logits [B,T,vocab_size] (float32 when the model is).
  torch::Tensor forward(const torch::Tensor& idx) override;
  // wte(idx) + wpe[0:T] -> [B,T,C].
  torch::Tensor Embed(const torch::Tensor& idx) override;
  // ln_f, then the tied LM head: [B,T,C] -> logits [B,T,vocab_size].
  torch::Tensor Head(const torch::Tensor& x);
  // ln_f, then the mean cross-entropy of the tied head against `targets`
  // [B,T] (LmHeadLoss). Equal to CrossEntropyLoss(Head(x), targets) to
  // float rounding, gradients too.
  torch::Tensor HeadLoss(const torch::Tensor& x,
                         const torch::Tensor& targets) override;

  torch::Tensor& token_embedding() override { return wte_->weight; }
  std::string token_embedding_name() const override { return "wte.weight"; }
  // tokens + wpe[0:T].
  torch::Tensor FinishEmbedding(const torch::Tensor& tokens) override;
  torch::Tensor FinalNorm(const torch::Tensor& x) override { return ln_f_(x); }
  torch::Tensor BlockForward(int64_t i, const torch::Tensor& x) override;

  // wte: the token embedding; wpe: input; h.<i>.*: block i; ln_f: output.
  ParamPlace PlaceOf(const std::string& name) const override;
  std::string BlockName(int64_t i) const override;

  std::vector<FlatRun> TensorParallelRuns(const std::string& name,
                                          const std::vector<int64_t>& global,
                                          int64_t rank,
                                          int64_t size) const override;
  std::vector<int64_t> TensorParallelShape(const std::string& name,
                                           const std::vector<int64_t>& global,
                                           int64_t size) const override;
  // Tensor parallelism: every block's attention and MLP parameters and wte's
  // rows replaced by rank tp->rank()'s slices of them, the blocks run
  // through `tp`. The LayerNorms, the row-parallel biases and wpe stay
  // whole. InvalidArgument, naming the numbers, when T does not divide the
  // heads (hence C and 4C) or the padded vocabulary.
  absl::Status ShardForTensorParallel(TensorParallelOps* tp) override;
  std::string DescribeTensorParallel(int64_t size) const override;
  absl::StatusOr<std::vector<PipelineStage>> PipelineCuts(
      int64_t seq_len, int64_t stages, const std::vector<int64_t>& split,
      int64_t virtual_stages) const override {
    return PartitionPipeline(config_, seq_len, stages, split, virtual_stages);
  }

  std::map<std::string, torch::Tensor*> MemberTensors() override;
  // llm.c's model file (llmc_checkpoint.h).
  absl::Status ExportWeights(const std::string& path) override;

  // GPT-2 initialisation, a pure function of (config, seed) on any device:
  // one pass over named_parameters() in order, drawing from a CPU generator
  // seeded with `seed`: biases 0, LayerNorm weights 1, attn.c_proj and
  // mlp.c_proj weights N(0, 0.02 / sqrt(2 * n_layer)), every other weight
  // N(0, 0.02); then the padded rows of wte are zeroed. The Python reference
  // (bench/reference/gpt2_reference.py) does the same and gets the same bits
  // on CPU (gpt2_reference_parity_test.cc).
  void InitWeights(uint64_t seed);

  const ModelConfig& config() const { return config_; }
  torch::nn::Embedding& wte() { return wte_; }  // [padded_vocab_size, C]
  torch::nn::Embedding& wpe() { return wpe_; }  // [block_size, C]
  // The blocks h.0 ... h.{L-1} as registered ("h"); each element is a Block.
  torch::nn::ModuleList& blocks() { return h_; }
  Block& block(int64_t i) { return blocks_.at(static_cast<size_t>(i)); }
  torch::nn::LayerNorm& ln_f() { return ln_f_; }

 private:
  const ModelConfig config_;
  torch::nn::Embedding wte_{nullptr};
  torch::nn::Embedding wpe_{nullptr};
  torch::nn::ModuleList h_{nullptr};
  std::vector<Block> blocks_;  // The same modules as h_, typed.
  torch::nn::LayerNorm ln_f_{nullptr};

  // Throws (naming `what`) when wte holds a tensor-parallel slice.
  void CheckWholeVocabulary(const char* what) const;
};
TORCH_MODULE(Gpt2);

// Validates `config` and builds a model initialised with InitWeights(seed).
// Errors: the config's, or LibTorch's (e.g. out of memory), as a Status.
absl::StatusOr<Gpt2> CreateGpt2(const ModelConfig& config, uint64_t seed);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_MODEL_GPT2_H_
