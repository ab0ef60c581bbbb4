#include "server/nvml.h"

#include <dlfcn.h>

namespace shardtrain {

// The subset of nvml.h used here, declared by hand so no NVIDIA headers are
// needed at build time. Signatures as in NVML's public, stable ABI.
namespace {
using nvmlReturn_t = int;
using nvmlDevice_t = struct nvmlDevice_st*;
struct nvmlMemory_t {
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};
struct nvmlUtilization_t {
  unsigned int gpu;
  unsigned int memory;
};
constexpr nvmlReturn_t kNvmlSuccess = 0;
}  // namespace

struct Nvml::Api {
  void* handle = nullptr;
  nvmlReturn_t (*init)() = nullptr;
  nvmlReturn_t (*shutdown)() = nullptr;
  nvmlReturn_t (*device_count)(unsigned int*) = nullptr;
  nvmlReturn_t (*device_by_index)(unsigned int, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*device_name)(nvmlDevice_t, char*, unsigned int) = nullptr;
  nvmlReturn_t (*memory_info)(nvmlDevice_t, nvmlMemory_t*) = nullptr;
  nvmlReturn_t (*utilization)(nvmlDevice_t, nvmlUtilization_t*) = nullptr;
  nvmlReturn_t (*power_usage)(nvmlDevice_t, unsigned int*) = nullptr;

  nvmlDevice_t Device(int index) const {
    nvmlDevice_t device = nullptr;
    if (device_by_index(static_cast<unsigned int>(index), &device) !=
        kNvmlSuccess) {
      return nullptr;
    }
    return device;
  }
};

std::unique_ptr<Nvml> Nvml::Load() {
  void* handle = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return nullptr;
  auto api = std::make_unique<Api>();
  api->handle = handle;
  auto bind = [handle](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(
        dlsym(handle, name));
    return fn != nullptr;
  };
  const bool ok = bind(api->init, "nvmlInit_v2") &&
                  bind(api->shutdown, "nvmlShutdown") &&
                  bind(api->device_count, "nvmlDeviceGetCount_v2") &&
                  bind(api->device_by_index, "nvmlDeviceGetHandleByIndex_v2") &&
                  bind(api->device_name, "nvmlDeviceGetName") &&
                  bind(api->memory_info, "nvmlDeviceGetMemoryInfo") &&
                  bind(api->utilization, "nvmlDeviceGetUtilizationRates") &&
                  bind(api->power_usage, "nvmlDeviceGetPowerUsage");
  if (!ok || api->init() != kNvmlSuccess) {
    dlclose(handle);
    return nullptr;
  }
  return std::unique_ptr<Nvml>(new Nvml(std::move(api)));
}

Nvml::Nvml(std::unique_ptr<Api> api) : api_(std::move(api)) {}

Nvml::~Nvml() {
  api_->shutdown();
  dlclose(api_->handle);
}

int Nvml::DeviceCount() const {
  unsigned int count = 0;
  if (api_->device_count(&count) != kNvmlSuccess) return 0;
  return static_cast<int>(count);
}

std::optional<GpuInfo> Nvml::Info(int index) const {
  nvmlDevice_t device = api_->Device(index);
  if (device == nullptr) return std::nullopt;
  GpuInfo info;
  char name[96] = {};
  if (api_->device_name(device, name, sizeof(name)) == kNvmlSuccess) {
    info.name = name;
  }
  nvmlMemory_t memory{};
  if (api_->memory_info(device, &memory) == kNvmlSuccess) {
    info.memory_total_bytes = static_cast<int64_t>(memory.total);
  }
  return info;
}

std::optional<GpuUsage> Nvml::Usage(int index) const {
  nvmlDevice_t device = api_->Device(index);
  if (device == nullptr) return std::nullopt;
  GpuUsage usage;
  nvmlUtilization_t utilization{};
  if (api_->utilization(device, &utilization) == kNvmlSuccess) {
    usage.utilization_ratio = utilization.gpu / 100.0;
  }
  nvmlMemory_t memory{};
  if (api_->memory_info(device, &memory) == kNvmlSuccess) {
    usage.memory_used_bytes = static_cast<int64_t>(memory.used);
  }
  unsigned int milliwatts = 0;
  if (api_->power_usage(device, &milliwatts) == kNvmlSuccess) {
    usage.power_watts = milliwatts / 1000.0;
  }
  return usage;
}

}  // namespace shardtrain
