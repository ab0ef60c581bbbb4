#include "server/device_inventory.h"

#include <sched.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "server/nvml.h"

namespace shardtrain {

int UsableCores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    return std::max(1, CPU_COUNT(&set));
  }
  return std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
}

absl::StatusOr<std::vector<DeviceInfo>> DiscoverDevices(
    const DeviceOptions& options, const Nvml* nvml) {
  if (options.kind != "auto" && options.kind != "gpu" &&
      options.kind != "cpu") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--device-kind: got '", options.kind, "'; expected auto, gpu or cpu"));
  }
  if (options.cpu_slots < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cpu-slots: got ", options.cpu_slots, "; must be >= 0"));
  }
  std::vector<DeviceInfo> devices;
  if (options.kind != "cpu" && nvml != nullptr) {
    for (int i = 0; i < nvml->DeviceCount(); ++i) {
      DeviceInfo d;
      d.index = i;
      d.kind = v1::GPU;
      if (auto info = nvml->Info(i)) {
        d.name = info->name;
        d.memory_bytes = info->memory_total_bytes;
      }
      devices.push_back(d);
    }
  }
  if (!devices.empty()) return devices;
  if (options.kind == "gpu") {
    return absl::FailedPreconditionError(
        "--device-kind gpu: no NVIDIA GPU found (libnvidia-ml.so.1 missing or "
        "no devices)");
  }
  const int slots = options.cpu_slots > 0 ? options.cpu_slots : UsableCores();
  const int64_t memory =
      static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  for (int i = 0; i < slots; ++i) {
    DeviceInfo d;
    d.index = i;
    d.kind = v1::CPU;
    d.name = "cpu slot";
    d.memory_bytes = memory / slots;
    devices.push_back(d);
  }
  return devices;
}

}  // namespace shardtrain
