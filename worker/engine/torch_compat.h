// What differs between the LibTorch releases shardtrain builds against —
// Debian 12's 1.13 (CPU), Debian 13's 2.6 (CPU and CUDA 12.4) and the
// LibTorch of a PyTorch 2.x install — in one place. Code elsewhere asks for a
// feature (SHARDTRAIN_TORCH_HAS_...) or calls a helper from here; no other
// file compares TORCH_VERSION_* itself. cmake/TorchCompat.cmake holds the
// build-side half (C++ standard, ABI, nccl.h).
#ifndef SHARDTRAIN_WORKER_ENGINE_TORCH_COMPAT_H_
#define SHARDTRAIN_WORKER_ENGINE_TORCH_COMPAT_H_

#include <ATen/autocast_mode.h>
#include <torch/version.h>

#define SHARDTRAIN_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||             \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// 1.13 is the oldest: from it on the c10d work handle is c10d::Work
// (Work.hpp) and TCPStore takes TCPStoreOptions.
#if !SHARDTRAIN_TORCH_AT_LEAST(1, 13)
#error "shardtrain needs LibTorch 1.13 or newer"
#endif

// 2.0: at::scaled_dot_product_attention (fused attention kernels).
#if SHARDTRAIN_TORCH_AT_LEAST(2, 0)
#define SHARDTRAIN_TORCH_HAS_SDPA 1
#endif

// 2.3: c10::Allocator::allocate is no longer const, and every allocator
// implements copy_data.
#if SHARDTRAIN_TORCH_AT_LEAST(2, 3)
#define SHARDTRAIN_TORCH_ALLOCATOR_HAS_COPY_DATA 1
#endif

// 2.4: ProcessGroupNCCL::shutdown() (2.x warns when a group is destroyed
// without it or abort()); TCPStoreOptions::useLibUV, true by default, which a
// LibTorch built without libuv (Debian 13's) refuses at construction.
#if SHARDTRAIN_TORCH_AT_LEAST(2, 4)
#define SHARDTRAIN_TORCH_NCCL_HAS_SHUTDOWN 1
#define SHARDTRAIN_TORCH_TCPSTORE_HAS_LIBUV 1
#endif

namespace shardtrain::torch_compat {

// CUDA autocast, whose API became per device type in 2.4.
inline void SetCudaAutocast(bool enabled, at::ScalarType dtype) {
#if SHARDTRAIN_TORCH_AT_LEAST(2, 4)
  if (enabled) at::autocast::set_autocast_dtype(at::kCUDA, dtype);
  at::autocast::set_autocast_enabled(at::kCUDA, enabled);
#else
  if (enabled) at::autocast::set_autocast_gpu_dtype(dtype);
  at::autocast::set_enabled(enabled);
#endif
}

inline bool CudaAutocastEnabled() {
#if SHARDTRAIN_TORCH_AT_LEAST(2, 4)
  return at::autocast::is_autocast_enabled(at::kCUDA);
#else
  return at::autocast::is_enabled();
#endif
}

}  // namespace shardtrain::torch_compat

#endif  // SHARDTRAIN_WORKER_ENGINE_TORCH_COMPAT_H_
