// DeviceInventory: the devices shardtraind schedules onto. GPUs found through
// NVML when the driver is present, otherwise (or with --device-kind cpu) CPU
// slots. One kind per coordinator: every job runs on that kind.
#ifndef SHARDTRAIN_SERVER_DEVICE_INVENTORY_H_
#define SHARDTRAIN_SERVER_DEVICE_INVENTORY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "shardtrain/v1/job.pb.h"

namespace shardtrain {

class Nvml;

struct DeviceInfo {
  int index = 0;
  v1::DeviceKind kind = v1::CPU;
  std::string name;
  int64_t memory_bytes = 0;
};

struct DeviceOptions {
  std::string kind = "auto";  // auto | gpu | cpu
  int cpu_slots = 0;          // CPU slots; 0 = one per core
};

// The devices to schedule onto. InvalidArgument for an unknown kind or
// negative slot count; FailedPrecondition for kind gpu without NVML GPUs.
absl::StatusOr<std::vector<DeviceInfo>> DiscoverDevices(
    const DeviceOptions& options, const Nvml* nvml);

// Cores this process may use (its CPU affinity), at least 1.
int UsableCores();

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_DEVICE_INVENTORY_H_
