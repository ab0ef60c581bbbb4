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
  RecordGlobalShapes(*model_);
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

std::vector<HeldPiece> SingleDeviceStrategy::HeldPieces() {
  std::vector<HeldPiece> pieces;
  for (const auto& item : model_->named_parameters()) {
    pieces.push_back({Placement::Whole(item.key(), item.value().sizes().vec()),
                      item.value(),
                      {}});
  }
  return pieces;
}

int64_t SingleDeviceStrategy::optimizer_steps() const {
  return optimizer_->step_count();
}

void SingleDeviceStrategy::set_optimizer_steps(int64_t steps) {
  optimizer_->set_step_count(steps);
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
