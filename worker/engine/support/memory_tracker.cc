#include "worker/engine/support/memory_tracker.h"

#include <c10/core/CPUAllocator.h>
#include <malloc.h>

#include <atomic>
#include <new>
#ifdef SHARDTRAIN_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>
#endif

#include "absl/strings/str_cat.h"
#include "core/run/step_metrics.h"
#include "worker/engine/torch_compat.h"

namespace shardtrain {
namespace {

// Wraps LibTorch's CPU allocator. Each block carries, in a header before
// its data, the size it was given (so the free subtracts it exactly) and its
// owner: the data pointer is its own context, as LibTorch's raw_allocate
// (used by some CPU kernels for scratch, e.g. bf16 matrix products)
// requires of an allocator.
class TrackingCpuAllocator final : public c10::Allocator {
 public:
  explicit TrackingCpuAllocator(c10::Allocator* base)
      : base_(base), base_deleter_(base->raw_deleter()) {
    TORCH_CHECK(base_deleter_ != nullptr,
                "memory tracker: LibTorch's CPU allocator has no raw deleter");
  }

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
  c10::DeleterFnPtr raw_deleter() const override { return &Free; }

  int64_t current() const { return current_.load(); }
  void set_limit(int64_t bytes) { limit_.store(bytes); }
  int64_t peak() const { return peak_.load(); }
  void ResetPeak() { peak_.store(current_.load()); }

 private:
  // Before each block's data; as large as LibTorch's alignment, so the data
  // stays aligned as the base allocator aligns.
  struct Header {
    int64_t bytes;
    TrackingCpuAllocator* owner;
  };
  static constexpr size_t kHeaderBytes = 64;
  static_assert(sizeof(Header) <= kHeaderBytes);

  c10::DataPtr Allocate(size_t nbytes) const {
    const int64_t limit = limit_.load();
    if (limit > 0) {
      const int64_t now = current_.load();
      if (now + static_cast<int64_t>(nbytes) > limit) {
        TORCH_CHECK(false, "CPU out of memory: tried to allocate ",
                    FormatBytes(static_cast<int64_t>(nbytes)), " with ",
                    FormatBytes(now), " in use, past the memory cap of ",
                    FormatBytes(limit), " per rank (--memory-cap)");
      }
    }
    auto* self = const_cast<TrackingCpuAllocator*>(this);
    char* block =
        static_cast<char*>(base_->raw_allocate(nbytes + kHeaderBytes));
    new (block) Header{static_cast<int64_t>(nbytes), self};
    self->Add(static_cast<int64_t>(nbytes));
    void* data = block + kHeaderBytes;
    return c10::DataPtr(data, data, &Free, c10::Device(c10::DeviceType::CPU));
  }

  static void Free(void* data) {
    if (data == nullptr) return;
    char* block = static_cast<char*>(data) - kHeaderBytes;
    const Header header = *reinterpret_cast<const Header*>(block);
    header.owner->current_.fetch_sub(header.bytes);
    header.owner->base_deleter_(block);
  }

  void Add(int64_t bytes) {
    const int64_t now = current_.fetch_add(bytes) + bytes;
    int64_t seen = peak_.load();
    while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
    }
  }

  c10::Allocator* base_;
  c10::DeleterFnPtr base_deleter_;
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<int64_t> limit_{0};  // 0: none
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

absl::Status MemoryTracker::SetLimit(const torch::Device& device,
                                     int64_t bytes) {
#ifdef SHARDTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    if (bytes <= 0) return absl::OkStatus();
    size_t free_bytes = 0, device_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &device_bytes) != cudaSuccess ||
        device_bytes == 0) {
      return absl::InternalError("memory cap: cannot read the GPU's memory");
    }
    if (static_cast<size_t>(bytes) > device_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("memory cap: ", FormatBytes(bytes), " is more than the ",
                       FormatBytes(static_cast<int64_t>(device_bytes)), " of ",
                       device.str()));
    }
    c10::cuda::CUDACachingAllocator::setMemoryFraction(
        static_cast<double>(bytes) / static_cast<double>(device_bytes),
        device.index());
    return absl::OkStatus();
  }
#endif
  (void)device;
  CpuTracker().set_limit(bytes);
  return absl::OkStatus();
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
