// DdpStrategy: DistributedDataParallel. Every rank holds a full replica of the
// model and of the optimizer state and trains on its own slice of the global
// batch; after each sync micro-step's backward the gradients are averaged over
// ranks, so every rank takes the identical optimizer step.
//
// The local math (forward, backward, clipping, AdamW, checkpoint files) is
// SingleDeviceStrategy's, unchanged; this class adds what PyTorch's Reducer
// does around it (worker/engine/strategy/gradient_buckets.h):
//   - Setup broadcasts every parameter (and buffer) from rank 0, so the
//     replicas start identical even if the ranks built different models.
//   - Parameters are packed into buckets of about `bucket_mb` MiB in reverse
//     parameter order, the order backward produces their gradients. Each
//     parameter's .grad() is a view into its bucket's flat buffer ("gradient
//     as bucket view"): backward accumulates straight into the bucket, no copy.
//   - A post-hook on each parameter's gradient accumulator counts down its
//     bucket; when the bucket is complete its AllReduce is launched at once,
//     while backward is still computing the gradients of earlier layers.
//     Buckets are launched strictly in index order, so every rank issues the
//     same collectives in the same order even if hooks fired differently.
//   - Micro-steps with sync=false only accumulate locally; the sync micro-step
//     reduces the accumulated total.
#ifndef SHARDTRAIN_WORKER_ENGINE_STRATEGY_DDP_STRATEGY_H_
#define SHARDTRAIN_WORKER_ENGINE_STRATEGY_DDP_STRATEGY_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "worker/engine/strategy/distributed_helpers.h"
#include "worker/engine/strategy/gradient_buckets.h"
#include "worker/engine/strategy/single_device_strategy.h"
#include "worker/engine/strategy/strategy.h"

namespace shardtrain {

class DdpStrategy final : public Strategy {
 public:
  using Clock = std::chrono::steady_clock;

  // When the last sync micro-step launched each bucket's AllReduce (index =
  // bucket) and when its backward pass returned. A launch earlier than
  // backward_end overlapped communication with computation; buckets whose
  // gradient hook never fired are launched after backward_end.
  using OverlapTrace = GradientBuckets::OverlapTrace;

  // `comm` must outlive this strategy; its rank and world size are used (not
  // options.rank / world_size, which should agree). Buckets hold at most
  // `bucket_mb` MiB of gradient unless one parameter alone is larger.
  DdpStrategy(const StrategyOptions& options, Communicator* comm,
              double bucket_mb = 25);
  ~DdpStrategy() override;

  DdpStrategy(const DdpStrategy&) = delete;
  DdpStrategy& operator=(const DdpStrategy&) = delete;

  std::string name() const override { return "ddp"; }
  // Collective: every rank must call it. Errors: a failed broadcast.
  absl::Status Setup(CausalLm model) override;
  // Collective when `sync` is true. A failed all-reduce throws c10::Error
  // (the interface has no Status here), naming the collective.
  torch::Tensor ForwardBackward(const torch::Tensor& inputs,
                                const torch::Tensor& targets, double loss_scale,
                                bool sync) override;
  // Local: after the sync micro-step every rank holds the same gradient.
  void OptimizerStep(double lr) override;
  torch::Tensor ForwardLoss(const torch::Tensor& inputs,
                            const torch::Tensor& targets) override;
  double AllReduceMean(double value) override;
  void Barrier() override;
  int64_t rank() const override { return comm_->rank(); }
  int64_t world_size() const override { return comm_->world_size(); }
  // Every rank holds every tensor; each saves 1/world of each (contiguous
  // ranges), and loads all of it.
  std::vector<HeldPiece> HeldPieces() override;
  const AdamW& optimizer() const override { return local_.optimizer(); }
  torch::Device device() const override { return options_.device; }
  CausalLmImpl& model() override { return local_.model(); }
  int64_t optimizer_steps() const override { return local_.optimizer_steps(); }
  void set_optimizer_steps(int64_t steps) override {
    local_.set_optimizer_steps(steps);
  }
  // Parameters, gradients (= the bucket buffers) and optimizer state.
  int64_t ModelStateBytes() const override;
  CommStats TakeCommStats() override { return comm_->TakeStats(); }

  int64_t num_buckets() const {
    return static_cast<int64_t>(BucketParameterIndices().size());
  }
  // For each bucket, the indices into model->parameters() it holds, in the
  // order they sit in its buffer.
  std::vector<std::vector<int64_t>> BucketParameterIndices() const;
  OverlapTrace last_overlap_trace() const;

 private:
  Communicator* placement_world() const override { return comm_; }

  StrategyOptions options_;
  Communicator* const comm_;
  const int64_t bucket_bytes_;
  SingleDeviceStrategy local_;
  // The buckets over the model's parameters (Setup).
  std::unique_ptr<GradientBuckets> buckets_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_STRATEGY_DDP_STRATEGY_H_
