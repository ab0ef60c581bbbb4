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
#include "core/model/gpt2_config.h"

namespace shardtrain {

// The additive causal mask (0 on and below the diagonal, -inf above) used by
// the masked-softmax attention of LibTorch 1.x; LibTorch 2.x uses fused
// scaled-dot-product attention and never builds it. One instance is shared by
// all blocks of a model. It is deliberately neither a parameter nor a buffer:
// it is a pure function of block_size, so it has no place in checkpoints,
// DDP's broadcast or FSDP's flat parameters. Not thread-safe (neither is a
// module's forward).
class CausalMask {
 public:
  explicit CausalMask(int64_t block_size) : block_size_(block_size) {}
  CausalMask(const CausalMask&) = delete;
  CausalMask& operator=(const CausalMask&) = delete;

  // A [t, t] view of the mask with the device and dtype of `like`. Built on
  // first use and again only when the device or dtype changes.
  torch::Tensor Get(int64_t t, const torch::Tensor& like);

 private:
  const int64_t block_size_;
  torch::Tensor mask_;  // [block_size, block_size]
};

// Megatron-LM's two operators of a tensor-parallel group of T ranks, for a
// model whose attention and MLP hold 1/T of each weight
// (Gpt2Impl::ShardForTensorParallel). The strategy that owns the group
// implements them over its communicator.
class TensorParallelOps {
 public:
  virtual ~TensorParallelOps() = default;
  virtual int64_t rank() const = 0;
  virtual int64_t size() const = 0;
  // f, entering a column-parallel layer: x as is; in backward, its gradient
  // summed over the group.
  virtual torch::Tensor Enter(const torch::Tensor& x) = 0;
  // g, leaving a row-parallel layer: x summed over the group; in backward,
  // the gradient as is.
  virtual torch::Tensor Leave(const torch::Tensor& x) = 0;
};

// A contiguous run of a parameter's elements, flattened row-major.
struct FlatRun {
  int64_t offset = 0;
  int64_t length = 0;
};

// How tensor-parallel rank `rank` of `size` holds the global parameter
// `name` of shape `global` (Megatron's split): the runs of the flattened
// global tensor that, concatenated, are its local tensor flattened; and the
// local shape. attn.c_attn (C -> 3C) and mlp.c_fc (C -> 4C) are
// column-parallel: the rank holds its rows of the weight and bias, c_attn's
// by heads (its rows of each of q, k and v). attn.c_proj and mlp.c_proj are
// row-parallel: its columns of the weight. wte is vocabulary-parallel: the
// rank holds its 1/T of the rows. The row-parallel biases, the LayerNorms and
// wpe are whole on every rank (one run).
std::vector<FlatRun> TensorParallelRuns(const std::string& name,
                                        const std::vector<int64_t>& global,
                                        int64_t rank, int64_t size);
std::vector<int64_t> TensorParallelShape(const std::string& name,
                                         const std::vector<int64_t>& global,
                                         int64_t size);

// Multi-head causal self-attention: [B,T,C] -> [B,T,C].
class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  CausalSelfAttentionImpl(const Gpt2Config& config,
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
  explicit MlpImpl(const Gpt2Config& config);
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
  BlockImpl(const Gpt2Config& config, std::shared_ptr<CausalMask> mask);
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
// strategy may run the pieces one at a time.
class Gpt2Impl : public torch::nn::Module {
 public:
  // `config` must Validate() (checked; a bad one throws c10::Error). The new
  // model is initialised as by InitWeights(seed).
  explicit Gpt2Impl(const Gpt2Config& config, uint64_t seed = 0);

  // idx: [B,T] int64 token ids in [0, vocab_size), T <= block_size.
  // Returns logits [B,T,vocab_size] (float32 when the model is).
  torch::Tensor forward(const torch::Tensor& idx);
  // wte(idx) + wpe[0:T] -> [B,T,C].
  torch::Tensor Embed(const torch::Tensor& idx);
  // ln_f, then the tied LM head: [B,T,C] -> logits [B,T,vocab_size].
  torch::Tensor Head(const torch::Tensor& x);
  // ln_f, then the mean cross-entropy of the tied head against `targets`
  // [B,T], without materialising the logits (LmHeadLoss). Equal to
  // CrossEntropyLoss(Head(x), targets) to float rounding, gradients too.
  torch::Tensor HeadLoss(const torch::Tensor& x, const torch::Tensor& targets);
  // HeadLoss(blocks(Embed(idx)), targets): the training objective. The
  // blocks run through RunBlock.
  torch::Tensor ForwardLoss(const torch::Tensor& idx,
                            const torch::Tensor& targets);

  // Block `i` on x. Under grad mode, a block chosen by
  // set_activation_checkpointing keeps only its input for backward (not the
  // ~16 C floats per token autograd saves inside it) and recomputes its
  // forward, under the same autocast state, when backward reaches it; its
  // parameters' gradients accumulate as without. The recomputation reads
  // the block's members again, so under FSDP they must point at gathered
  // parameters when its backward runs.
  torch::Tensor RunBlock(int64_t i, const torch::Tensor& x);
  // Recompute every `every`-th block: 0-based blocks every-1, 2*every-1, ...
  // (ActivationCheckpointEvery in train/train_config.h); 0: none.
  void set_activation_checkpointing(int64_t every) {
    checkpoint_every_ = every;
  }
  int64_t activation_checkpointing() const { return checkpoint_every_; }
  bool IsRecomputed(int64_t i) const {
    return checkpoint_every_ > 0 && (i + 1) % checkpoint_every_ == 0;
  }

  // GPT-2 initialisation, a pure function of (config, seed) on any device:
  // one pass over named_parameters() in order, drawing from a CPU generator
  // seeded with `seed`: biases 0, LayerNorm weights 1, attn.c_proj and
  // mlp.c_proj weights N(0, 0.02 / sqrt(2 * n_layer)), every other weight
  // N(0, 0.02); then the padded rows of wte are zeroed. The Python reference
  // (bench/reference/gpt2_reference.py) does the same and gets the same bits
  // on CPU (gpt2_reference_parity_test.cc).
  void InitWeights(uint64_t seed);

  const Gpt2Config& config() const { return config_; }
  torch::nn::Embedding& wte() { return wte_; }  // [padded_vocab_size, C]
  torch::nn::Embedding& wpe() { return wpe_; }  // [block_size, C]
  // The blocks h.0 ... h.{L-1} as registered ("h"); each element is a Block.
  torch::nn::ModuleList& blocks() { return h_; }
  Block& block(int64_t i) { return blocks_.at(static_cast<size_t>(i)); }
  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  torch::nn::LayerNorm& ln_f() { return ln_f_; }

  // Tensor parallelism: every block's attention and MLP parameters and wte's
  // rows replaced by rank tp->rank()'s slices of them (TensorParallelRuns),
  // the blocks run through `tp`, which must outlive the model's use. The
  // LayerNorms, the row-parallel biases and wpe stay whole. Embed, Head,
  // HeadLoss, ForwardLoss and forward() then throw: the strategy runs the
  // vocabulary-parallel embedding and head (strategy/vocab_parallel.h).
  // InvalidArgument, naming the numbers, when T does not divide the heads
  // (hence C and 4C) or the padded vocabulary.
  absl::Status ShardForTensorParallel(TensorParallelOps* tp);

  // The weight and bias members each module's forward() reads, by parameter
  // name ("h.0.attn.c_attn.weight"). Usually the parameters themselves;
  // under FSDP, views of a gathered buffer (the registered parameters are
  // then empty), so export and FSDP both go through these.
  std::map<std::string, torch::Tensor*> MemberTensors();

 private:
  const Gpt2Config config_;
  torch::nn::Embedding wte_{nullptr};
  torch::nn::Embedding wpe_{nullptr};
  torch::nn::ModuleList h_{nullptr};
  std::vector<Block> blocks_;  // The same modules as h_, typed.
  torch::nn::LayerNorm ln_f_{nullptr};
  int64_t checkpoint_every_ = 0;

  // Throws (naming `what`) when wte holds a tensor-parallel slice.
  void CheckWholeVocabulary(const char* what) const;
};
TORCH_MODULE(Gpt2);

// Validates `config` and builds a model initialised with InitWeights(seed).
// Errors: the config's, or LibTorch's (e.g. out of memory), as a Status.
absl::StatusOr<Gpt2> CreateGpt2(const Gpt2Config& config, uint64_t seed);

// Mean cross-entropy over all B*T positions. logits: [B,T,V] (or [N,V]);
// targets: [B,T] (or [N]) int64 in [0, V). Equal to ATen's cross_entropy to
// float rounding, but fused to spare three [N, V] temporaries (see gpt2.cc);
// its gradient is not itself differentiable.
torch::Tensor CrossEntropyLoss(const torch::Tensor& logits,
                               const torch::Tensor& targets);

// Mean cross-entropy of a tied LM head, hidden @ weight[0:vocab_size]^T,
// against `targets`, without the [N, vocab_size] logits or their gradient:
// rows of `hidden` go through in chunks whose logits take at most
// `chunk_bytes` (0: LmHeadChunkBytes of the device). hidden: [..., C] (after
// ln_f); weight: [V_pad, C], V_pad >= vocab_size (padding rows are never
// scored); targets: hidden's leading shape, int64 in [0, vocab_size).
//
// The loss ends the graph, so backward follows at once: when hidden or weight
// requires grad, their gradients are computed chunk by chunk during this
// forward pass and backward only scales them. The head then costs the three
// matrix products of an unfused one, and at most one chunk of logits is
// alive. weight must be a contiguous leaf if it requires grad: its gradient,
// [V_pad, C] with the padding rows zero, is added to weight.grad() directly
// in backward rather than returned to autograd, which would hold it until
// the tied embedding's backward, the last of all. Under
// CUDA autocast the products run in its dtype, the softmax in fp32. Not
// twice differentiable.
torch::Tensor LmHeadLoss(const torch::Tensor& hidden,
                         const torch::Tensor& weight, int64_t vocab_size,
                         const torch::Tensor& targets, int64_t chunk_bytes = 0);

// The logits budget of one LmHeadLoss chunk on `device`: HeadChunkBytes
// (gpt2_config.h) for this process's compute threads on CPU (OpenBLAS's
// threads when it does the products, else ATen's).
int64_t LmHeadChunkBytes(const torch::Device& device);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_MODEL_GPT2_H_
