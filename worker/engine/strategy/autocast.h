// ScopedAutocast: mixed precision for the forward pass on CUDA with
// --precision bf16 (fp32 master weights, bf16 matmuls); a no-op otherwise.
#ifndef SHARDTRAIN_WORKER_ENGINE_STRATEGY_AUTOCAST_H_
#define SHARDTRAIN_WORKER_ENGINE_STRATEGY_AUTOCAST_H_

#include <ATen/autocast_mode.h>
#include <torch/types.h>

#include <string>

#include "worker/engine/torch_compat.h"

namespace shardtrain {

class ScopedAutocast {
 public:
  ScopedAutocast(const torch::Device& device, const std::string& precision)
      : active_(device.is_cuda() && precision == "bf16") {
    if (!active_) return;
    torch_compat::SetCudaAutocast(true, at::kBFloat16);
  }
  ~ScopedAutocast() {
    if (!active_) return;
    torch_compat::SetCudaAutocast(false, at::kBFloat16);
    at::autocast::clear_cache();
  }
  ScopedAutocast(const ScopedAutocast&) = delete;
  ScopedAutocast& operator=(const ScopedAutocast&) = delete;

  bool active() const { return active_; }

 private:
  bool active_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_STRATEGY_AUTOCAST_H_
