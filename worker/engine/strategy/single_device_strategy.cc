#include "worker/engine/strategy/single_device_strategy.h"

#include <torch/torch.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "worker/engine/model/llmc_checkpoint.h"
#include "worker/engine/strategy/autocast.h"
#include "worker/engine/train/tensor_file.h"

namespace shardtrain {

SingleDeviceStrategy::SingleDeviceStrategy(const StrategyOptions& options)
    : options_(options) {}

absl::Status SingleDeviceStrategy::Setup(Gpt2 model) {
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

absl::Status SingleDeviceStrategy::SaveCheckpoint(const std::string& dir) {
  NamedTensors model_state;
  for (const auto& item : model_->named_parameters()) {
    model_state.emplace_back(item.key(), item.value());
  }
  if (absl::Status s = SaveTensorFile(dir + "/model.pt", model_state);
      !s.ok()) {
    return s;
  }
  return SaveTensorFile(dir + "/optimizer.pt", optimizer_->StateTensors());
}

absl::Status SingleDeviceStrategy::LoadCheckpoint(const std::string& dir) {
  absl::StatusOr<NamedTensors> model_state = LoadTensorFile(dir + "/model.pt");
  if (!model_state.ok()) return model_state.status();
  torch::NoGradGuard no_grad;
  auto params = model_->named_parameters();
  size_t loaded = 0;
  for (const auto& [name, tensor] : *model_state) {
    torch::Tensor* target = params.find(name);
    if (target == nullptr || target->sizes() != tensor.sizes()) {
      return absl::DataLossError(absl::StrCat(
          dir, "/model.pt: parameter '", name,
          "' does not match the model (wrong --model for this checkpoint?)"));
    }
    target->copy_(tensor);
    ++loaded;
  }
  if (loaded != params.size()) {
    return absl::DataLossError(absl::StrCat(dir, "/model.pt holds ", loaded,
                                            " of the model's ", params.size(),
                                            " parameters"));
  }
  absl::StatusOr<NamedTensors> optimizer_state =
      LoadTensorFile(dir + "/optimizer.pt");
  if (!optimizer_state.ok()) return optimizer_state.status();
  return optimizer_->LoadStateTensors(*optimizer_state);
}

absl::Status SingleDeviceStrategy::ExportModel(const std::string& path) {
  return SaveLlmcCheckpoint(model_, path);
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
