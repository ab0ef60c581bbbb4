// ScopedAutocast: mixed precision for the forward pass on CUDA with
// --precision bf16 (fp32 master weights, bf16 matmuls); a no-op otherwise.
// Wraps the LibTorch autocast API, whose names changed in 2.4.
#ifndef SHARDTRAIN_WORKER_ENGINE_STRATEGY_AUTOCAST_H_
#define SHARDTRAIN_WORKER_ENGINE_STRATEGY_AUTOCAST_H_

#include <ATen/autocast_mode.h>
#include <torch/types.h>
#include <torch/version.h>

#include <string>

namespace shardtrain {

class ScopedAutocast {
 public:
  ScopedAutocast(const torch::Device& device, const std::string& precision)
      : active_(device.is_cuda() && precision == "bf16") {
    if (!active_) return;
#if TORCH_VERSION_MAJOR > 2 || \
    (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCUDA, true);
#else
    at::autocast::set_autocast_gpu_dtype(at::kBFloat16);
    at::autocast::set_enabled(true);
#endif
  }
  ~ScopedAutocast() {
    if (!active_) return;
#if TORCH_VERSION_MAJOR > 2 || \
    (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    at::autocast::set_autocast_enabled(at::kCUDA, false);
#else
    at::autocast::set_enabled(false);
#endif
    at::autocast::clear_cache();
  }
  ScopedAutocast(const ScopedAutocast&) = delete;
  ScopedAutocast& operator=(const ScopedAutocast&) = delete;

 private:
  bool active_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_STRATEGY_AUTOCAST_H_
