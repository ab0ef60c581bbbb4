// CausalLmImpl: what the parallelisms see of a decoder-only language model.
// Every strategy works through this interface and none names a model family,
// so a new family is its model file (a CausalLmImpl), its tensor-parallel
// plan (TensorParallelRuns) and its planner shapes.
//
// The model is the pipeline of pieces every causal LM has, which a strategy
// may run one at a time (a pipeline stage runs some of them, FSDP gathers
// them one by one):
//
//   idx [B,T] -> token embedding -> FinishEmbedding -> block 0 ... block L-1
//             -> FinalNorm -> the head's cross-entropy against the targets
//
// Each parameter has a place in that pipeline (PlaceOf): the token embedding
// (the head may be tied to it; a vocabulary-parallel strategy shards its
// rows, and an untied head's),
// the other inputs of the first block (learned positions), a block, or the
// output side (the final norm). A block is the unit FSDP gathers and frees,
// activation checkpointing recomputes and pipeline stages are cut between.
//
// The loss functions every causal LM ends in (a fused cross-entropy and the
// chunked head that never materialises the logits) are declared here too.
#ifndef SHARDTRAIN_WORKER_ENGINE_MODEL_CAUSAL_LM_H_
#define SHARDTRAIN_WORKER_ENGINE_MODEL_CAUSAL_LM_H_

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/plan/pipeline_plan.h"

namespace shardtrain {

// The additive causal mask (0 on and below the diagonal, -inf above) used by
// the masked-softmax attention of LibTorch 1.x; LibTorch 2.x uses fused
// scaled-dot-product attention and never builds it. One instance is shared by
// all blocks of a model. It is deliberately neither a parameter nor a buffer:
// it is a pure function of the sequence length, so it has no place in
// checkpoints, DDP's broadcast or FSDP's flat parameters. Sized for the
// longest sequence seen, not the model's longest (Llama 3's 131,072
// positions would make it 64 GiB). Not thread-safe (neither is a module's
// forward).
class CausalMask {
 public:
  // `block_size`: the longest sequence Get may be asked for.
  explicit CausalMask(int64_t block_size) : block_size_(block_size) {}
  CausalMask(const CausalMask&) = delete;
  CausalMask& operator=(const CausalMask&) = delete;

  // A [t, t] view of the mask with the device and dtype of `like`. Built on
  // first use and again only when t grows or the device or dtype changes.
  torch::Tensor Get(int64_t t, const torch::Tensor& like);

 private:
  const int64_t block_size_;
  torch::Tensor mask_;  // [n, n], n the longest t asked for
};

// Megatron-LM's two operators of a tensor-parallel group of T ranks, for a
// model whose blocks hold 1/T of each split weight
// (CausalLmImpl::ShardForTensorParallel). The strategy that owns the group
// implements them over its communicator.
class TensorParallelOps {
 public:
  virtual ~TensorParallelOps() = default;
  virtual int64_t rank() const = 0;
  virtual int64_t size() const = 0;
  // g, leaving a row-parallel layer: x summed over the group; in backward,
  // the gradient as is.
  virtual torch::Tensor Leave(const torch::Tensor& x) = 0;
  // f, entering the column-parallel projections that read x (Megatron's
  // identity forward whose backward sums the gradient over the group),
  // fused with them:
  // y_i = x W_iᵀ + b_i for rows `x` [N, C] (1 to 3 weights, each bias
  // optional). In backward the input gradient Σ dY_i W_i is made first and
  // its sum over the group launched at once, asynchronously; the weights'
  // and biases' gradients are computed while it is in flight (Megatron's
  // overlap of the input-gradient all-reduce), then it is waited for.
  virtual std::vector<torch::Tensor> EnterLinear(
      const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
      const std::vector<torch::Tensor>& biases) = 0;
  // How many input-gradient sums EnterLinear's backward has overlapped with
  // weight gradients so far.
  virtual int64_t overlapped_input_gradients() const = 0;
};

// A contiguous run of a parameter's elements, flattened row-major.
struct FlatRun {
  int64_t offset = 0;
  int64_t length = 0;
};

// Where a parameter sits in the model's pipeline of pieces.
enum class ParamRole {
  kTokenEmbedding,  // [padded vocabulary, hidden]; a tied head reads it
  kInput,           // read by FinishEmbedding (learned positions)
  kBlock,           // a block's
  kOutput,          // read by FinalNorm, or an untied head
};
struct ParamPlace {
  ParamRole role = ParamRole::kInput;
  int64_t block = -1;  // kBlock: which
};

// The sizes a strategy needs.
struct ModelDims {
  int64_t vocab_size = 0;         // rows the head scores
  int64_t padded_vocab_size = 0;  // rows of the token embedding
  int64_t hidden_size = 0;        // the residual stream's width
  int64_t max_seq_len = 0;        // the longest sequence
  int64_t num_blocks = 0;
};

class CausalLmImpl : public torch::nn::Module {
 public:
  ~CausalLmImpl() override = default;

  virtual ModelDims dims() const = 0;
  int64_t num_blocks() const { return dims().num_blocks; }

  // The whole model on one rank. idx: [B,T] int64 token ids in
  // [0, vocab_size), T <= max_seq_len.
  // Logits [B,T,vocab_size].
  virtual torch::Tensor forward(const torch::Tensor& idx) = 0;
  // The input of block 0: [B,T,C].
  virtual torch::Tensor Embed(const torch::Tensor& idx) = 0;
  // FinalNorm, then the mean cross-entropy of the head (head_weight) against
  // `targets` [B,T], without materialising the logits (LmHeadLoss).
  virtual torch::Tensor HeadLoss(const torch::Tensor& x,
                                 const torch::Tensor& targets) = 0;
  // HeadLoss(blocks(Embed(idx)), targets): the training objective, the
  // blocks through RunBlock.
  torch::Tensor ForwardLoss(const torch::Tensor& idx,
                            const torch::Tensor& targets);

  // The pieces a strategy runs itself (the vocabulary-parallel ones
  // replace the token embedding's lookup and the head):
  // The token embedding's weight [padded_vocab_size, C], the module member
  // its lookup (and a tied head) read.
  virtual torch::Tensor& token_embedding() = 0;
  // The parameter name of token_embedding().
  virtual std::string token_embedding_name() const = 0;
  // The weight the head scores with, [padded_vocab_size, C], and its name:
  // the token embedding's when the head is tied to it (a model whose head
  // is untied overrides both; its head is on the output side, kOutput).
  virtual torch::Tensor& head_weight() { return token_embedding(); }
  virtual std::string head_weight_name() const {
    return token_embedding_name();
  }
  bool tied_head() const {
    return head_weight_name() == token_embedding_name();
  }
  // The input of block 0 from the token embeddings [B,T,C] of a batch:
  // learned positions added, or the embeddings as they are.
  virtual torch::Tensor FinishEmbedding(const torch::Tensor& tokens) = 0;
  // The norm before the head: [B,T,C] -> [B,T,C].
  virtual torch::Tensor FinalNorm(const torch::Tensor& x) = 0;

  // Block `i` on x. Under grad mode, a block chosen by
  // set_activation_checkpointing keeps only its input for backward and
  // recomputes its forward, under the same autocast state, when backward
  // reaches it; its parameters' gradients accumulate as without. The
  // recomputation reads the block's members again, so under FSDP they must
  // point at gathered parameters when its backward runs.
  torch::Tensor RunBlock(int64_t i, const torch::Tensor& x);
  // Recompute every `every`-th block: 0-based blocks every-1, 2*every-1, ...
  // (ActivationCheckpointEvery in core/run/train_config.h); 0: none.
  void set_activation_checkpointing(int64_t every) {
    checkpoint_every_ = every;
  }
  int64_t activation_checkpointing() const { return checkpoint_every_; }
  bool IsRecomputed(int64_t i) const {
    return checkpoint_every_ > 0 && (i + 1) % checkpoint_every_ == 0;
  }

  // Where parameter `name` sits (PlaceOf of a name the model does not have:
  // kInput).
  virtual ParamPlace PlaceOf(const std::string& name) const = 0;
  // Block `i`'s module path ("h.3"), the name of its FSDP unit.
  virtual std::string BlockName(int64_t i) const = 0;

  // The tensor-parallel plan: how tensor-parallel rank `rank` of `size`
  // holds the global parameter `name` of shape `global` (Megatron's split):
  // the runs of the flattened global tensor that, concatenated, are its
  // local tensor flattened; and the local shape. A tensor every rank holds
  // whole is one run.
  virtual std::vector<FlatRun> TensorParallelRuns(
      const std::string& name, const std::vector<int64_t>& global, int64_t rank,
      int64_t size) const = 0;
  virtual std::vector<int64_t> TensorParallelShape(
      const std::string& name, const std::vector<int64_t>& global,
      int64_t size) const = 0;
  // Every split parameter replaced by rank tp->rank()'s slice of it
  // (TensorParallelRuns), the blocks run through `tp`, which must outlive
  // the model's use. Embed, HeadLoss, ForwardLoss and forward() then throw:
  // the strategy runs the vocabulary-parallel embedding and head.
  // InvalidArgument, naming the numbers, when T does not divide what the
  // plan splits.
  virtual absl::Status ShardForTensorParallel(TensorParallelOps* tp) = 0;
  // What one of `size` tensor-parallel ranks runs, for the log: "2 of 4
  // heads and ...".
  virtual std::string DescribeTensorParallel(int64_t size) const = 0;

  // The pipeline's cut points: the blocks cut into `stages` contiguous
  // stages at `split` when it is given, else balanced by the family's
  // per-block costs at `seq_len` (core/plan/pipeline_plan.h's
  // PartitionPipeline, whose refusals it returns).
  // With `virtual_stages` V, stages x V model stages (interleaved).
  virtual absl::StatusOr<std::vector<PipelineStage>> PipelineCuts(
      int64_t seq_len, int64_t stages, const std::vector<int64_t>& split,
      int64_t virtual_stages = 1) const = 0;

  // The weight and bias members each module's forward() reads, by parameter
  // name. Usually the parameters themselves; under FSDP, views of a
  // gathered buffer (the registered parameters are then empty), so export
  // and FSDP both go through these.
  virtual std::map<std::string, torch::Tensor*> MemberTensors() = 0;

  // The whole model's weights in the family's own file format at `path`.
  virtual absl::Status ExportWeights(const std::string& path) = 0;

  // Block `i`'s forward, never recomputed (RunBlock decides).
  virtual torch::Tensor BlockForward(int64_t i, const torch::Tensor& x) = 0;

 private:
  int64_t checkpoint_every_ = 0;
};

// A shared handle on any model family, made from a TORCH_MODULE holder or a
// shared_ptr of a CausalLmImpl subclass.
class CausalLm {
 public:
  CausalLm() = default;
  CausalLm(std::nullptr_t) {}  // NOLINT: as torch's holders
  template <typename Impl,
            typename = std::enable_if_t<std::is_base_of_v<CausalLmImpl, Impl>>>
  CausalLm(std::shared_ptr<Impl> impl)  // NOLINT: implicit, as a holder
      : impl_(std::move(impl)) {}
  template <typename Impl,
            typename = std::enable_if_t<std::is_base_of_v<CausalLmImpl, Impl>>>
  CausalLm(const torch::nn::ModuleHolder<Impl>& holder)  // NOLINT: same
      : impl_(holder.ptr()) {}

  CausalLmImpl* operator->() const { return impl_.get(); }
  CausalLmImpl& operator*() const { return *impl_; }
  bool is_empty() const { return impl_ == nullptr; }
  const std::shared_ptr<CausalLmImpl>& ptr() const { return impl_; }

 private:
  std::shared_ptr<CausalLmImpl> impl_;
};

// Mean cross-entropy over all B*T positions. logits: [B,T,V] (or [N,V]);
// targets: [B,T] (or [N]) int64 in [0, V). Equal to ATen's cross_entropy to
// float rounding, but fused to spare three [N, V] temporaries (see
// causal_lm.cc); its gradient is not itself differentiable.
torch::Tensor CrossEntropyLoss(const torch::Tensor& logits,
                               const torch::Tensor& targets);

// Mean cross-entropy of a tied LM head, hidden @ weight[0:vocab_size]^T,
// against `targets`, without the [N, vocab_size] logits or their gradient:
// rows of `hidden` go through in chunks whose logits take at most
// `chunk_bytes` (0: LmHeadChunkBytes of the device). hidden: [..., C] (after
// the final norm); weight: [V_pad, C], V_pad >= vocab_size (padding rows are
// never scored); targets: hidden's leading shape, int64 in [0, vocab_size).
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
// (core/model/model_config.h) for this process's compute threads on CPU
// (OpenBLAS's threads when it does the products, else ATen's).
int64_t LmHeadChunkBytes(const torch::Device& device);

// For a model's ShardForTensorParallel: each of `model`'s parameters
// replaced by rank `rank`'s slice of `size` under its tensor-parallel plan.
void SliceForTensorParallel(CausalLmImpl& model, int64_t rank, int64_t size);

// --- Weight gradients apart (zero-bubble pipelines) ---
//
// zb-h1 runs a micro-batch's backward in two: B, the input's gradient,
// which the stage before waits for, and later W, the weights' gradients,
// which nobody waits for (core/plan/pipeline_plan.h). While a
// WeightGradients store is current on the thread (DeferWeightGradients,
// around the micro-batch's forward and its B), the models' projections
// (ProjectLinear) leave their weight and bias gradients to it: their
// backward makes the input's gradient only, and keeps the layer's input and
// output gradient; Run() makes the rest (two products per layer) and hands
// them to autograd at the weights, so they accumulate, and their hooks fire,
// as any gradient's. The products of tensor-parallel layers and of the
// head are not deferred.
class WeightGradients {
 public:
  // A projection's backward: `input` [N, in] and `grad_output` [N, out] as
  // the product ran (bf16 under CUDA mixed precision), `weight` and `bias`
  // (may be undefined) the tensors the forward read.
  void Add(torch::Tensor input, torch::Tensor grad_output, torch::Tensor weight,
           torch::Tensor bias);
  // Every gradient kept, made and accumulated in one backward call; empty
  // after.
  void Run();
  int64_t size() const { return static_cast<int64_t>(deferred_.size()); }
  // The tensors whose gradients Run() will hand over (weights, biases).
  std::vector<torch::Tensor> Tensors() const;

 private:
  struct Deferred {
    torch::Tensor input, grad_output, weight, bias;
  };
  std::vector<Deferred> deferred_;
};

// Makes `store` the thread's current store for its lifetime (the previous
// one after). Null: nothing deferred.
class DeferWeightGradients {
 public:
  explicit DeferWeightGradients(WeightGradients* store);
  ~DeferWeightGradients();
  DeferWeightGradients(const DeferWeightGradients&) = delete;
  DeferWeightGradients& operator=(const DeferWeightGradients&) = delete;

 private:
  WeightGradients* previous_;
};

// at::linear(x, weight, bias) for the models' projections (x [N, in]): its
// weight and bias gradients left to the current WeightGradients store when
// there is one and autograd records.
torch::Tensor ProjectLinear(const torch::Tensor& x, const torch::Tensor& weight,
                            const torch::Tensor& bias);

// The weight and bias members of `model`'s Linear, LayerNorm and Embedding
// modules by parameter name: MemberTensors of a model built of those.
std::map<std::string, torch::Tensor*> LinearNormEmbeddingMembers(
    torch::nn::Module& model);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_MODEL_CAUSAL_LM_H_
