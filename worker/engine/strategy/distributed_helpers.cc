#include "worker/engine/strategy/distributed_helpers.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <utility>

namespace shardtrain {
namespace {

// The operator() signature is the same in LibTorch 1.13 and 2.x; 2.x only
// adds a virtual compiled_args() with a default, used by compiled autograd
// (torch.compile), which never runs these graphs.
class GradReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  explicit GradReadyHook(std::function<void()> on_ready)
      : on_ready_(std::move(on_ready)) {}

  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    on_ready_();
    return outputs;
  }

 private:
  std::function<void()> on_ready_;
};

}  // namespace

GradReadyHooks::~GradReadyHooks() {
  for (size_t i = 0; i < accumulators_.size(); ++i) {
    accumulators_[i]->del_post_hook(keys_[i]);
  }
}

void GradReadyHooks::Add(const torch::Tensor& leaf,
                         std::function<void()> on_ready) {
  // The accumulator must be kept alive for its hooks to keep firing.
  std::shared_ptr<torch::autograd::Node> accumulator =
      torch::autograd::impl::grad_accumulator(leaf);
  keys_.push_back(accumulator->add_post_hook(
      std::make_unique<GradReadyHook>(std::move(on_ready))));
  accumulators_.push_back(std::move(accumulator));
}

void ThrowIfFailed(const absl::Status& status, std::string_view strategy,
                   std::string_view what) {
  TORCH_CHECK(status.ok(), strategy, ": ", what,
              " failed: ", status.ToString());
}

double AllReduceMean(Communicator& comm, double value,
                     const torch::Device& device, std::string_view strategy) {
  torch::Tensor t = torch::full(
      {1}, value, torch::TensorOptions().dtype(torch::kDouble).device(device));
  ThrowIfFailed(comm.AllReduce(t)->Wait(), strategy, "all-reduce of a metric");
  return t.item<double>() / static_cast<double>(comm.world_size());
}

}  // namespace shardtrain
