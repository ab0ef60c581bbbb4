#include "worker/engine/support/adamw.h"

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

int64_t AdamW::StepChunkElements(const torch::Device& device) {
  return device.is_cpu() ? (int64_t{1} << 20) : (int64_t{64} << 20);
}

namespace {

// Matching pieces of a parameter, its gradient and its two moments.
struct Lists {
  std::vector<torch::Tensor> param, grad, exp_avg, exp_avg_sq;
  int64_t numel = 0;
};

}  // namespace

void AdamW::Step(double lr) {
  torch::NoGradGuard no_grad;
  ++step_;
  const double bias_correction1 = 1 - std::pow(options_.beta1, step_);
  const double bias_correction2 = 1 - std::pow(options_.beta2, step_);
  const double step_size = lr / bias_correction1;
  const double bias_correction2_sqrt = std::sqrt(bias_correction2);

  auto update = [&](Lists& b, double weight_decay) {
    if (b.param.empty()) return;
    if (weight_decay != 0) at::_foreach_mul_(b.param, 1 - lr * weight_decay);
    at::_foreach_mul_(b.exp_avg, options_.beta1);
    at::_foreach_add_(b.exp_avg, b.grad, 1 - options_.beta1);
    at::_foreach_mul_(b.exp_avg_sq, options_.beta2);
    at::_foreach_addcmul_(b.exp_avg_sq, b.grad, b.grad, 1 - options_.beta2);
    std::vector<torch::Tensor> denom = at::_foreach_sqrt(b.exp_avg_sq);
    at::_foreach_div_(denom, bias_correction2_sqrt);
    at::_foreach_add_(denom, options_.eps);
    at::_foreach_addcdiv_(b.param, b.exp_avg, denom, -step_size);
    b = Lists();
  };

  // Batches never mix weight decays, devices or dtypes.
  Lists batch;
  double batch_decay = 0;
  for (Slot& slot : slots_) {
    const torch::Tensor& grad = slot.param.grad();
    if (!grad.defined()) continue;
    const int64_t limit = StepChunkElements(slot.param.device());
    if (!batch.param.empty() &&
        (slot.weight_decay != batch_decay ||
         batch.param.front().device() != slot.param.device() ||
         batch.param.front().scalar_type() != slot.param.scalar_type())) {
      update(batch, batch_decay);
    }
    batch_decay = slot.weight_decay;
    const bool flat = slot.param.is_contiguous() && grad.is_contiguous();
    const int64_t n = slot.param.numel();
    const int64_t piece = flat ? limit : n;
    for (int64_t start = 0; start < n; start += piece) {
      const int64_t len = std::min(piece, n - start);
      if (batch.numel + len > limit) update(batch, batch_decay);
      auto part = [&](const torch::Tensor& t) {
        return flat ? t.view({-1}).narrow(0, start, len) : t;
      };
      batch.param.push_back(part(slot.param));
      batch.grad.push_back(part(grad));
      batch.exp_avg.push_back(part(slot.exp_avg));
      batch.exp_avg_sq.push_back(part(slot.exp_avg_sq));
      batch.numel += len;
    }
  }
  update(batch, batch_decay);
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

std::pair<torch::Tensor, torch::Tensor> AdamW::StateOf(
    const torch::Tensor& param) const {
  for (const Slot& slot : slots_) {
    if (slot.param.data_ptr() == param.data_ptr() &&
        slot.param.numel() == param.numel()) {
      return {slot.exp_avg, slot.exp_avg_sq};
    }
  }
  return {};
}

}  // namespace shardtrain
