#include "worker/engine/strategy/single_device_strategy.h"

#include <torch/torch.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "worker/engine/strategy/autocast.h"
#include "worker/engine/support/tensor_file.h"

namespace shardtrain {

SingleDeviceStrategy::SingleDeviceStrategy(const StrategyOptions& options)
    : options_(options) {}

absl::Status SingleDeviceStrategy::Setup(CausalLm model) {
  model_ = std::move(model);
  model_->to(options_.device);
  optimizer_ = std::make_unique<AdamW>(
      WeightDecayGroups(model_->parameters(), options_.weight_decay),
      options_.adamw);
  return absl::OkStatus();
}

torch::Tensor SingleDeviceStrategy::ForwardBackward(
    const torch::Tensor& inputs, const torch::Tensor& targets,
    double loss_scale, bool /*sync*/) {
  torch::Tensor loss;
  {
    ScopedAutocast autocast(options_.device, options_.precision);
    loss = model_->ForwardLoss(inputs, targets);
  }
  (loss * loss_scale).backward();
  return loss.detach();
}

double SingleDeviceStrategy::ClipGradNorm(double max_norm) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  for (const torch::Tensor& p : model_->parameters()) grads.push_back(p.grad());
  const double norm =
      std::sqrt(SumOfSquares(grads, options_.device).item<double>());
  if (max_norm > 0) {
    const double coef = max_norm / (norm + 1e-6);
    if (coef < 1) {
      for (const torch::Tensor& p : model_->parameters()) {
        if (p.grad().defined()) p.grad().mul_(coef);
      }
    }
  }
  return norm;
}

void SingleDeviceStrategy::OptimizerStep(double lr) {
  optimizer_->Step(lr);
  optimizer_->ZeroGrad();
}

torch::Tensor SingleDeviceStrategy::ForwardLoss(const torch::Tensor& inputs,
                                                const torch::Tensor& targets) {
  torch::NoGradGuard no_grad;
  ScopedAutocast autocast(options_.device, options_.precision);
  return model_->ForwardLoss(inputs, targets);
}

std::vector<StateSlice> SingleDeviceStrategy::StateSlices(bool /*to_save*/) {
  std::vector<StateSlice> slices;
  for (const auto& item : model_->named_parameters()) {
    const torch::Tensor& p = item.value();
    const std::vector<int64_t> shape = p.sizes().vec();
    slices.push_back({"model." + item.key(), shape, 0, p.detach().view(-1)});
    const auto [exp_avg, exp_avg_sq] = optimizer_->StateOf(p);
    slices.push_back(
        {"optim.exp_avg." + item.key(), shape, 0, exp_avg.view(-1)});
    slices.push_back(
        {"optim.exp_avg_sq." + item.key(), shape, 0, exp_avg_sq.view(-1)});
  }
  return slices;
}

std::vector<StateSlice> SingleDeviceStrategy::GradientSlices() {
  std::vector<StateSlice> slices;
  for (const auto& item : model_->named_parameters()) {
    torch::Tensor p = item.value();  // the same tensor: its grad is set
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    slices.push_back(
        {"grad." + item.key(), p.sizes().vec(), 0, p.grad().view(-1)});
  }
  return slices;
}

int64_t SingleDeviceStrategy::optimizer_steps() const {
  return optimizer_->step_count();
}

void SingleDeviceStrategy::set_optimizer_steps(int64_t steps) {
  optimizer_->set_step_count(steps);
}

absl::Status SingleDeviceStrategy::ExportModel(const std::string& path) {
  return model_->ExportWeights(path);
}

int64_t SingleDeviceStrategy::ModelStateBytes() const {
  int64_t bytes = optimizer_->StateBytes();
  for (const torch::Tensor& p : model_->parameters()) {
    bytes += p.nbytes();
    if (p.grad().defined()) bytes += p.grad().nbytes();
  }
  return bytes;
}

}  // namespace shardtrain
