#include "worker/engine/strategy/strategy.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <utility>

namespace shardtrain {

torch::Tensor SumOfSquares(const std::vector<torch::Tensor>& tensors,
                           const torch::Device& device) {
  torch::Tensor sum = torch::zeros(
      {}, torch::TensorOptions().dtype(torch::kDouble).device(device));
  // On a GPU one multi-tensor norm per device and dtype (its tree reductions
  // are accurate). On CPU ATen's float norm accumulates in float, off by
  // ~1e-4 relative over GPT-2's 6M-element embedding, which would make the
  // sharded and unsharded norms disagree: pieces of 1 Mi elements are summed
  // in double instead (an 8 MiB temporary).
  constexpr int64_t kPiece = int64_t{1} << 20;
  std::map<std::pair<std::string, int>, std::vector<torch::Tensor>> groups;
  for (const torch::Tensor& t : tensors) {
    if (!t.defined() || t.numel() == 0) continue;
    if (t.is_cpu()) {
      const torch::Tensor flat = t.reshape({-1});
      for (int64_t start = 0; start < flat.numel(); start += kPiece) {
        const torch::Tensor piece =
            flat.narrow(0, start, std::min(kPiece, flat.numel() - start))
                .to(torch::kDouble);
        sum += at::dot(piece, piece).to(device);
      }
      continue;
    }
    groups[{t.device().str(), static_cast<int>(t.scalar_type())}].push_back(t);
  }
  for (const auto& [key, group] : groups) {
    const torch::Tensor norms = at::stack(at::_foreach_norm(group, 2));
    sum += norms.to(device, torch::kDouble).pow(2).sum();
  }
  return sum;
}

std::vector<AdamW::Group> WeightDecayGroups(
    const std::vector<torch::Tensor>& params, double weight_decay) {
  AdamW::Group decay{{}, weight_decay};
  AdamW::Group no_decay{{}, 0.0};
  for (const torch::Tensor& p : params) {
    (p.dim() >= 2 ? decay : no_decay).params.push_back(p);
  }
  return {decay, no_decay};
}

}  // namespace shardtrain
