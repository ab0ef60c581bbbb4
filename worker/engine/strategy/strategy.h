// Strategy: how the model, its gradients and its optimizer state are spread
// over ranks. The trainer drives every strategy through the same calls
// (ForwardBackward, ClipGradNorm, OptimizerStep); the collectives, if any,
// happen behind them.
#ifndef SHARDTRAIN_WORKER_ENGINE_STRATEGY_STRATEGY_H_
#define SHARDTRAIN_WORKER_ENGINE_STRATEGY_STRATEGY_H_

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/model/causal_lm.h"
#include "worker/engine/strategy/placement.h"
#include "worker/engine/support/adamw.h"

namespace shardtrain {

struct StrategyOptions {
  torch::Device device = torch::kCPU;
  int64_t rank = 0;
  int64_t world_size = 1;
  // Ranks on this rank's node (HSDP's default shard group); 0: unknown.
  int64_t ranks_per_node = 0;
  std::string precision =
      "fp32";  // fp32 | bf16 (CUDA: autocast / bf16 compute)
  AdamWOptions adamw;
  double weight_decay = 0.1;  // applied to matrices (dim >= 2) only
  // The compute dtype, forced; Undefined: ComputeDtype's rule. Tests force
  // bf16 on CPU to check what mixed precision does on a GPU.
  torch::ScalarType compute_dtype = torch::ScalarType::Undefined;
};

// The dtype the matrix products run in: bf16 under CUDA mixed precision
// (--precision bf16), else fp32. Master weights, AdamW's state, the
// accumulation of micro-batch gradients and the reductions of gradients stay
// fp32 either way.
inline torch::ScalarType ComputeDtype(const StrategyOptions& options) {
  if (options.compute_dtype != torch::ScalarType::Undefined) {
    return options.compute_dtype;
  }
  return options.device.is_cuda() && options.precision == "bf16"
             ? torch::kBFloat16
             : torch::kFloat;
}

// One contiguous range of a global state tensor that a rank holds:
// elements [offset, offset + data.numel()) of tensor `name` (of global shape
// `shape`) flattened row-major. `data` is a 1-D fp32 view of the rank's own
// state, so a load writes into it in place.
struct StateSlice {
  std::string name;  // "model.<param>", "optim.exp_avg.<param>", ...
  std::vector<int64_t> shape;
  int64_t offset = 0;
  torch::Tensor data;
};

class CheckpointReader;

// One micro-batch of a step: token ids [B, T] and their next tokens [B, T].
struct Batch {
  torch::Tensor inputs;
  torch::Tensor targets;
};

class Strategy {
 public:
  virtual ~Strategy() = default;

  virtual std::string name() const = 0;
  virtual int64_t rank() const { return 0; }
  virtual int64_t world_size() const { return 1; }
  // How the ranks are arranged, for the log ("" when the name says it all):
  // HSDP's shard and replica groups, a pipeline's stages.
  virtual std::string layout() const { return ""; }
  // This rank's place among the data-parallel replicas, which see different
  // data: the rank and world size, except under pipeline stages, whose
  // ranks of one replica all see its batch.
  virtual int64_t data_parallel_rank() const { return rank(); }
  virtual int64_t data_parallel_size() const { return world_size(); }
  // This rank's pipeline stage; -1 without pipeline stages.
  virtual int64_t pipeline_stage() const { return -1; }

  // Takes a model initialised identically on every rank, places it on the
  // device (and shards or replicates it) and builds the optimizer.
  virtual absl::Status Setup(CausalLm model) = 0;

  // A whole step's forward and backward: the gradient of the mean of the
  // micro-batches' mean losses, accumulated over `batches` (equal sizes)
  // and synchronised once, after the last. Returns that mean loss (detached,
  // on the device; this replica's under data parallelism). The trainer
  // calls this; the default runs ForwardBackward on each micro-batch in
  // turn, which is what a data-parallel strategy does, while a pipeline
  // schedules the step's micro-batches across its stages.
  virtual torch::Tensor ForwardBackwardStep(const std::vector<Batch>& batches);

  // Forward and backward of one micro-batch; the gradient is that of
  // loss * loss_scale. `sync` is false on accumulation micro-steps, where a
  // distributed strategy skips its gradient communication. Returns the
  // micro-batch's mean loss (detached, unscaled) on the device.
  virtual torch::Tensor ForwardBackward(const torch::Tensor& inputs,
                                        const torch::Tensor& targets,
                                        double loss_scale, bool sync) = 0;

  // Global L2 norm of the accumulated gradient over all parameters and ranks,
  // before clipping, each element counted once (ClipGradientNorm over
  // HeldPieces). When max_norm > 0 the gradient is scaled so its norm is at
  // most max_norm (as torch.nn.utils.clip_grad_norm_). Collective.
  double ClipGradNorm(double max_norm);

  // One AdamW update at `lr`, then zeroes the gradients.
  virtual void OptimizerStep(double lr) = 0;

  // Mean loss of a batch without building a graph (evaluation).
  virtual torch::Tensor ForwardLoss(const torch::Tensor& inputs,
                                    const torch::Tensor& targets) = 0;

  // Mean of a per-rank value over all ranks (identity on one rank).
  virtual double AllReduceMean(double value) = 0;
  virtual void Barrier() {}

  // The model and optimizer state this rank holds, as ranges of global
  // tensors: "model.<param>" and "optim.exp_avg.<param>",
  // "optim.exp_avg_sq.<param>" under the model's parameter names. With
  // `to_save`, only the ranges this rank writes (a tensor every rank holds
  // is written once: each rank writes an even share); otherwise everything
  // it holds, which a load fills.
  std::vector<StateSlice> StateSlices(bool to_save);
  // Every gradient this rank holds once a step's backward and its
  // synchronisation are done, as ranges of global tensors ("grad.<param>",
  // views of the memory the optimizer reads, zeros where none was made),
  // so that any mesh's gradients can be put together and compared tensor by
  // tensor with one device's. A rank holding a range another also holds
  // (replicas) gives it too.
  std::vector<StateSlice> GradientSlices();
  // Every piece of the model's parameters this rank holds, with its
  // placement on the mesh (placement.h): the three calls above are computed
  // from these alone.
  virtual std::vector<HeldPiece> HeldPieces() = 0;
  // AdamW's step count (its bias correction).
  virtual int64_t optimizer_steps() const = 0;
  virtual void set_optimizer_steps(int64_t steps) = 0;

  // This rank's slices into the checkpoint directory `dir`
  // (core/checkpoint/checkpoint_format.h); rank 0 then writes
  // checkpoint.json with `training` (plus the optimizer's step count) as its
  // training record. Collective; fails on every rank when one fails.
  absl::Status SaveCheckpoint(const std::string& dir,
                              const nlohmann::json& training = {});
  // Fills this rank's state from checkpoint `dir`, whatever strategy and
  // world size wrote it: each slice reads exactly its range. Errors name the
  // tensor that is missing or shaped differently (another model).
  absl::Status LoadCheckpoint(const std::string& dir);
  // The same from a checkpoint already opened (its metadata read once).
  absl::Status LoadCheckpoint(CheckpointReader& reader);

  // The whole model in the family's own format (llm.c's for GPT-2):
  // every tensor put together from the ranks' pieces (GatherWhole), one at
  // a time, and pointed at by rank 0's model, which writes `path`.
  // Collective.
  absl::Status ExportModel(const std::string& path);

  // Bytes of parameters, gradients and optimizer state this rank holds.
  virtual int64_t ModelStateBytes() const = 0;

  virtual CommStats TakeCommStats() { return {}; }

  // The optimizer (after Setup): StateSlices reads its moments.
  virtual const AdamW& optimizer() const = 0;
  // Where this rank's tensors live.
  virtual torch::Device device() const = 0;
  // The model this rank trains (after Setup): its members are what this
  // rank holds of each parameter, or nothing.
  virtual CausalLmImpl& model() = 0;

 protected:
  // The ranks over which HeldPieces() cover every element: the run's world;
  // nullptr on one rank.
  virtual Communicator* placement_world() const = 0;
  // Setup records the name and global shape of each of `model`'s
  // parameters before any is split or sharded: the tensors an export puts
  // together, the same on every rank.
  void RecordGlobalShapes(CausalLmImpl& model);
  const std::map<std::string, std::vector<int64_t>>& global_shapes() const {
    return global_shapes_;
  }

 private:
  std::map<std::string, std::vector<int64_t>> global_shapes_;
};

// Sum over `tensors` of their squared L2 norms, as a 0-dim double tensor on
// `device`, without a temporary the size of a tensor. Empty or undefined
// tensors count zero.
torch::Tensor SumOfSquares(const std::vector<torch::Tensor>& tensors,
                           const torch::Device& device);

// Parameters split as nanoGPT and Megatron train: matrices and embeddings
// decay, biases and norm gains do not.
std::vector<AdamW::Group> WeightDecayGroups(
    const std::vector<torch::Tensor>& params, double weight_decay);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_STRATEGY_STRATEGY_H_
