#include "worker/engine/strategy/strategy.h"

namespace shardtrain {

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
