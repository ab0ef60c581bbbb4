#include "worker/engine/train/memory_tracker.h"

#include <c10/core/CPUAllocator.h>
#include <malloc.h>

#include <atomic>
#ifdef SHARDTRAIN_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include "worker/engine/torch_compat.h"

namespace shardtrain {
namespace {

// Wraps LibTorch's CPU allocator; each DataPtr carries the size it was given
// so the free can be subtracted exactly.
class TrackingCpuAllocator final : public c10::Allocator {
 public:
  explicit TrackingCpuAllocator(c10::Allocator* base) : base_(base) {}

#ifdef SHARDTRAIN_TORCH_ALLOCATOR_HAS_COPY_DATA
  c10::DataPtr allocate(size_t nbytes) override { return Allocate(nbytes); }
  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);
  }
#else
  c10::DataPtr allocate(size_t nbytes) const override {
    return Allocate(nbytes);
  }
#endif

  int64_t current() const { return current_.load(); }
  int64_t peak() const { return peak_.load(); }
  void ResetPeak() { peak_.store(current_.load()); }

 private:
  struct Allocation {
    c10::DataPtr inner;
    int64_t bytes;
    TrackingCpuAllocator* owner;
  };

  c10::DataPtr Allocate(size_t nbytes) const {
    c10::DataPtr inner = base_->allocate(nbytes);
    void* data = inner.get();
    const c10::Device device = inner.device();
    auto* self = const_cast<TrackingCpuAllocator*>(this);
    auto* allocation =
        new Allocation{std::move(inner), static_cast<int64_t>(nbytes), self};
    self->Add(allocation->bytes);
    return c10::DataPtr(data, allocation, &Free, device);
  }

  static void Free(void* context) {
    auto* allocation = static_cast<Allocation*>(context);
    allocation->owner->current_.fetch_sub(allocation->bytes);
    delete allocation;  // releases the inner DataPtr
  }

  void Add(int64_t bytes) {
    const int64_t now = current_.fetch_add(bytes) + bytes;
    int64_t seen = peak_.load();
    while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
    }
  }

  c10::Allocator* base_;
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
};

TrackingCpuAllocator& CpuTracker() {
  // Leaked on purpose: tensors may be freed during static destruction.
  static auto* tracker = [] {
    auto* t = new TrackingCpuAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(t, /*priority=*/100);
    return t;
  }();
  return *tracker;
}

}  // namespace

void RetainFreedHostMemory() {
  // Serve every block from the heap (no per-allocation mmap/munmap) and never
  // trim it, so the pages of one step's activations are reused by the next.
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, INT32_MAX);
}

MemoryTracker& MemoryTracker::Get() {
  static auto* tracker = new MemoryTracker();
  return *tracker;
}

MemoryTracker::MemoryTracker() { CpuTracker(); }

MemorySnapshot MemoryTracker::Snapshot(const torch::Device& device) const {
  MemorySnapshot snapshot;
#ifdef SHARDTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    const auto stats =
        c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    snapshot.allocated_bytes = stats.allocated_bytes[0].current;
    snapshot.peak_bytes = stats.allocated_bytes[0].peak;
    snapshot.reserved_bytes = stats.reserved_bytes[0].current;
    return snapshot;
  }
#endif
  (void)device;
  snapshot.allocated_bytes = CpuTracker().current();
  snapshot.peak_bytes = CpuTracker().peak();
  snapshot.reserved_bytes = snapshot.allocated_bytes;
  return snapshot;
}

void MemoryTracker::ResetPeak(const torch::Device& device) {
#ifdef SHARDTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
    return;
  }
#endif
  (void)device;
  CpuTracker().ResetPeak();
}

}  // namespace shardtrain
