#include "worker/engine/train/adamw.h"

#include <torch/torch.h>

#include <cmath>
#include <map>

#include "absl/strings/str_cat.h"

namespace shardtrain {

AdamW::AdamW(std::vector<Group> groups, const AdamWOptions& options)
    : options_(options) {
  for (Group& group : groups) {
    for (torch::Tensor& p : group.params) {
      slots_.push_back(Slot{p, torch::zeros_like(p), torch::zeros_like(p),
                            group.weight_decay});
    }
  }
}

void AdamW::Step(double lr) {
  torch::NoGradGuard no_grad;
  ++step_;
  const double bias_correction1 = 1 - std::pow(options_.beta1, step_);
  const double bias_correction2 = 1 - std::pow(options_.beta2, step_);
  const double step_size = lr / bias_correction1;
  const double bias_correction2_sqrt = std::sqrt(bias_correction2);
  for (Slot& slot : slots_) {
    const torch::Tensor& grad = slot.param.grad();
    if (!grad.defined()) continue;
    if (slot.weight_decay != 0) slot.param.mul_(1 - lr * slot.weight_decay);
    slot.exp_avg.mul_(options_.beta1).add_(grad, 1 - options_.beta1);
    slot.exp_avg_sq.mul_(options_.beta2)
        .addcmul_(grad, grad, 1 - options_.beta2);
    torch::Tensor denom =
        (slot.exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(options_.eps);
    slot.param.addcdiv_(slot.exp_avg, denom, -step_size);
  }
}

void AdamW::ZeroGrad() {
  for (Slot& slot : slots_) {
    torch::Tensor& grad = slot.param.mutable_grad();
    if (grad.defined()) grad.zero_();
  }
}

int64_t AdamW::StateBytes() const {
  int64_t bytes = 0;
  for (const Slot& slot : slots_) {
    bytes += slot.exp_avg.nbytes() + slot.exp_avg_sq.nbytes();
  }
  return bytes;
}

std::vector<std::pair<std::string, torch::Tensor>> AdamW::StateTensors() const {
  std::vector<std::pair<std::string, torch::Tensor>> state;
  state.emplace_back("step", torch::tensor(step_, torch::kInt64));
  for (size_t i = 0; i < slots_.size(); ++i) {
    state.emplace_back(absl::StrCat("exp_avg.", i), slots_[i].exp_avg);
    state.emplace_back(absl::StrCat("exp_avg_sq.", i), slots_[i].exp_avg_sq);
  }
  return state;
}

absl::Status AdamW::LoadStateTensors(
    const std::vector<std::pair<std::string, torch::Tensor>>& state) {
  std::map<std::string, torch::Tensor> by_name(state.begin(), state.end());
  auto find = [&](const std::string& name) -> const torch::Tensor* {
    auto it = by_name.find(name);
    return it == by_name.end() ? nullptr : &it->second;
  };
  const torch::Tensor* step = find("step");
  if (step == nullptr) {
    return absl::DataLossError("optimizer state has no 'step'");
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < slots_.size(); ++i) {
    for (auto [name, target] :
         {std::pair{absl::StrCat("exp_avg.", i), &slots_[i].exp_avg},
          std::pair{absl::StrCat("exp_avg_sq.", i), &slots_[i].exp_avg_sq}}) {
      const torch::Tensor* saved = find(name);
      if (saved == nullptr || saved->sizes() != target->sizes()) {
        return absl::DataLossError(absl::StrCat(
            "optimizer state '", name, "' is missing or has the wrong shape"));
      }
      target->copy_(*saved);
    }
  }
  step_ = step->item<int64_t>();
  return absl::OkStatus();
}

}  // namespace shardtrain
