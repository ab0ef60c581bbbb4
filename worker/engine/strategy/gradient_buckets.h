// GradientBuckets: the average of a set of parameters' gradients over a
// group of replicas, reduced while the backward that completes them runs —
// what PyTorch's DDP Reducer does, shared by every strategy that replicates
// (DDP; a pipeline stage's or a tensor-parallel slice's replicas).
//
//   - The parameters are packed into buckets of about `bucket_bytes` in
//     reverse order, the order backward produces their gradients. Each
//     parameter's .grad() is a view into its bucket's flat buffer ("gradient
//     as bucket view"): backward accumulates straight into the bucket.
//   - A post-hook on each parameter's gradient accumulator counts down its
//     bucket during an armed backward; a complete bucket's all-reduce is
//     launched at once, while backward still computes earlier layers'
//     gradients. Buckets launch strictly in index order, so every replica
//     issues the same collectives in the same order.
//   - Backwards that are not armed only accumulate (gradient accumulation,
//     a pipeline's earlier micro-batches); Finish() launches what the armed
//     one left, waits and divides by the group's size.
#ifndef SHARDTRAIN_WORKER_ENGINE_STRATEGY_GRADIENT_BUCKETS_H_
#define SHARDTRAIN_WORKER_ENGINE_STRATEGY_GRADIENT_BUCKETS_H_

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/strategy/distributed_helpers.h"

namespace shardtrain {

class GradientBuckets {
 public:
  using Clock = std::chrono::steady_clock;

  // When the last armed backward launched each bucket's all-reduce (index =
  // bucket) and when Finish() began. A launch earlier than backward_end
  // overlapped communication with computation.
  struct OverlapTrace {
    std::vector<Clock::time_point> bucket_launch;
    Clock::time_point backward_end;
  };

  // `params` (leaves that require grad) and `replicas` must outlive this
  // object; `strategy` names the caller in errors ("ddp", "pipeline").
  GradientBuckets(std::vector<torch::Tensor> params, Communicator* replicas,
                  int64_t bucket_bytes, std::string strategy);
  GradientBuckets(const GradientBuckets&) = delete;
  GradientBuckets& operator=(const GradientBuckets&) = delete;

  // Every parameter copied from the group's rank 0, through the buckets (a
  // few large broadcasts). Collective.
  absl::Status BroadcastFromRankZero();

  // Makes every parameter's .grad() its view of its bucket again if
  // something replaced it, keeping the accumulated values.
  void AttachGradViews();
  // The next backward is the last before the reduction (armed), or one
  // that only accumulates.
  void Arm(bool armed);
  // The next backward is the step's last for the parameters `indices` (into
  // `params`; e.g. one chunk of an interleaved pipeline stage): their hooks
  // count down their buckets from then on. The first call after Arm(false)
  // starts the armed reduction; later calls add parameters to it.
  void ArmParameters(const std::vector<int64_t>& indices);
  // The parameters `indices` are complete although their hooks fired
  // before they were armed (zb-h1: those whose last gradient came with the
  // last B, armed at the last W): counted down as if their hooks fired now.
  void MarkReady(const std::vector<int64_t>& indices);
  // After the armed backward: launches the buckets not launched yet (a
  // parameter outside the graph never fires its hook), waits for all and
  // divides each by the group's size. Throws c10::Error naming the strategy
  // when an all-reduce fails.
  void Finish();

  // For each bucket, the indices into `params` it holds, in buffer order.
  std::vector<std::vector<int64_t>> BucketParameterIndices() const;
  OverlapTrace last_overlap_trace() const;

 private:
  struct Bucket {
    torch::Tensor flat;            // 1-D; each member's grad is a view of it
    std::vector<int64_t> params;   // indices into params_
    std::vector<int64_t> offsets;  // element offset of each member in flat
    // Guarded by mutex_ while an armed backward runs:
    int64_t pending = 0;             // members whose gradient is not ready
    std::unique_ptr<CommWork> work;  // the in-flight all-reduce, if launched
  };

  void BuildBuckets(int64_t bucket_bytes);
  // A new reduction: nothing ready or launched; `armed` or only
  // accumulating. The parameters' arming is the caller's.
  void Reset(bool armed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Called by the gradient-accumulator hook of params_[index].
  void OnGradReady(int64_t index);
  // Launches the consecutive complete buckets from next_launch_ on; with
  // `force`, every bucket not launched yet.
  void LaunchReadyBuckets(bool force) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  std::vector<torch::Tensor> params_;
  Communicator* const replicas_;
  const std::string strategy_;
  std::vector<int64_t> bucket_of_param_;
  std::vector<Bucket> buckets_;
  // Hooks run on the autograd engine's thread while the caller is blocked in
  // backward(); the mutex orders them with the caller.
  mutable absl::Mutex mutex_;
  bool armed_ ABSL_GUARDED_BY(mutex_) = false;
  std::vector<bool> param_ready_ ABSL_GUARDED_BY(mutex_);
  std::vector<bool> param_armed_ ABSL_GUARDED_BY(mutex_);
  size_t next_launch_ ABSL_GUARDED_BY(mutex_) = 0;
  OverlapTrace trace_ ABSL_GUARDED_BY(mutex_);
  // Declared last: removed first, before anything the hooks touch.
  GradReadyHooks hooks_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_STRATEGY_GRADIENT_BUCKETS_H_
