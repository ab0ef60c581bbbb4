// AdamW with decoupled weight decay, the same arithmetic as PyTorch's
// single-tensor torch.optim.AdamW, over arbitrary tensors: full parameters
// (single, DDP) or flat shards (FSDP). Parameters are grouped by weight decay.
//
// Step() runs multi-tensor (_foreach_) kernels over batches of at most
// StepChunkElements() elements, large tensors split into pieces: few kernel
// launches on a GPU, and its one temporary (the denominator) bounded by the
// batch, not the largest parameter, on every device.
#ifndef SHARDTRAIN_WORKER_ENGINE_SUPPORT_ADAMW_H_
#define SHARDTRAIN_WORKER_ENGINE_SUPPORT_ADAMW_H_

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace shardtrain {

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
};

class AdamW {
 public:
  struct Group {
    std::vector<torch::Tensor> params;  // leaf tensors whose grad() is used
    double weight_decay = 0;
  };

  AdamW(std::vector<Group> groups, const AdamWOptions& options);

  // One update at learning rate `lr` from each parameter's .grad(); a
  // parameter without a gradient is skipped.
  void Step(double lr);
  void ZeroGrad();

  int64_t step_count() const { return step_; }
  // Elements per multi-tensor batch: 1 Mi on CPU (4 MiB of temporary), 64 Mi
  // on an accelerator.
  static int64_t StepChunkElements(const torch::Device& device);
  // Bytes of optimizer state (exp_avg + exp_avg_sq).
  int64_t StateBytes() const;

  void set_step_count(int64_t step) { step_ = step; }
  // The state of `param`, one of the tensors this optimizer updates (the
  // same memory: a parameter, or a view of a shard): {exp_avg, exp_avg_sq},
  // undefined tensors when it updates no such tensor.
  std::pair<torch::Tensor, torch::Tensor> StateOf(
      const torch::Tensor& param) const;

 private:
  struct Slot {
    torch::Tensor param;
    torch::Tensor exp_avg;
    torch::Tensor exp_avg_sq;
    double weight_decay;
  };
  std::vector<Slot> slots_;
  AdamWOptions options_;
  int64_t step_ = 0;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_SUPPORT_ADAMW_H_
