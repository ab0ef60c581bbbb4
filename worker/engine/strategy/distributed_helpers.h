// What the distributed strategies (DDP, FSDP) share: gradient-ready hooks on
// leaves, turning a failed collective into the exception the Strategy calls
// throw, and the mean of a metric over ranks.
#ifndef SHARDTRAIN_WORKER_ENGINE_STRATEGY_DISTRIBUTED_HELPERS_H_
#define SHARDTRAIN_WORKER_ENGINE_STRATEGY_DISTRIBUTED_HELPERS_H_

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "worker/engine/comm/communicator.h"

namespace torch::autograd {
struct Node;
}  // namespace torch::autograd

namespace shardtrain {

// Calls a function each time a leaf's gradient accumulator has added a
// backward's contribution to .grad() (for DDP's buckets and FSDP's
// reduce-scatters). The hooks are removed when this object dies, so a graph
// that outlives the strategy never calls into it. Not thread-safe to Add()
// while a backward runs.
class GradReadyHooks {
 public:
  GradReadyHooks() = default;
  ~GradReadyHooks();
  GradReadyHooks(const GradReadyHooks&) = delete;
  GradReadyHooks& operator=(const GradReadyHooks&) = delete;

  // `leaf` must require grad; `on_ready` runs on the thread doing backward.
  void Add(const torch::Tensor& leaf, std::function<void()> on_ready);

 private:
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> keys_;
};

// A collective failed: the step cannot go on with partial results, and the
// Strategy calls that have no Status throw, as LibTorch does: c10::Error
// "<strategy>: <what> failed: <status>".
void ThrowIfFailed(const absl::Status& status, std::string_view strategy,
                   std::string_view what);

// The mean of `value` over all ranks (one all-reduce on `device`).
double AllReduceMean(Communicator& comm, double value,
                     const torch::Device& device, std::string_view strategy);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_STRATEGY_DISTRIBUTED_HELPERS_H_
