// Exact memory accounting for StepMetrics.
//
// On CPU a tracking allocator, installed in front of LibTorch's CPU allocator,
// counts every tensor byte allocated and freed, so current and peak figures are
// exact tensor bytes (not RSS). On CUDA the caching allocator's own statistics
// are read. Tensors allocated before Install() are not counted.
#ifndef SHARDTRAIN_WORKER_ENGINE_SUPPORT_MEMORY_TRACKER_H_
#define SHARDTRAIN_WORKER_ENGINE_SUPPORT_MEMORY_TRACKER_H_

#include <torch/types.h>

#include <cstdint>

#include "absl/status/status.h"

namespace shardtrain {

struct MemorySnapshot {
  int64_t allocated_bytes = 0;  // live tensor bytes now
  int64_t peak_bytes = 0;       // most live bytes since the last ResetPeak
  int64_t reserved_bytes = 0;   // held by the allocator (CPU: = allocated)
};

class MemoryTracker {
 public:
  // Process-wide; installs the CPU tracking allocator on first use.
  static MemoryTracker& Get();

  MemorySnapshot Snapshot(const torch::Device& device) const;
  void ResetPeak(const torch::Device& device);
  // Caps this process's tensor memory on `device` at `bytes` (0: no cap),
  // as a device with that much memory would: on CPU the tracking allocator
  // refuses an allocation that would take the live bytes past the cap (a
  // c10::Error "CPU out of memory: ... past the memory cap of ..."); on CUDA
  // the caching allocator gets the matching fraction of the device.
  // InvalidArgument when a CUDA device has less memory than the cap.
  absl::Status SetLimit(const torch::Device& device, int64_t bytes);

 private:
  MemoryTracker();
};

// Keeps freed host memory inside the process instead of returning it to the
// OS after every step. LibTorch's CPU allocator takes activations and logits
// from malloc; glibc serves large blocks with mmap and trims the heap top, so
// each step would fault the same pages in again (measured in bench/RESULTS.md).
// Process-wide; call once at start-up.
void RetainFreedHostMemory();

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_SUPPORT_MEMORY_TRACKER_H_
