#include "server/local_backend.h"

#include <utility>
#include <vector>

#include "server/local_job_launcher.h"
#include "server/nvml.h"

namespace shardtrain {
namespace {

class LocalBackend : public Backend {
 public:
  LocalBackend(std::vector<DeviceInfo> devices, ProcessSpawner* processes,
               LocalJobLauncher::LostDevices lost)
      : devices_(std::move(devices)), launcher_(processes, std::move(lost)) {}

  const std::vector<DeviceInfo>& devices() const override { return devices_; }
  AttemptLauncher& launcher() override { return launcher_; }

 private:
  const std::vector<DeviceInfo> devices_;
  LocalJobLauncher launcher_;
};

// The GPUs (indices into `gpus`) NVML no longer answers for (fallen off the
// bus, Xid 79): they cannot run a rank.
LocalJobLauncher::LostDevices WatchGpus(const Nvml* nvml,
                                        const std::vector<DeviceInfo>& gpus) {
  if (nvml == nullptr || gpus.empty() || gpus.front().kind != v1::GPU) {
    return nullptr;
  }
  return [nvml, gpus] {
    std::vector<int> gone;
    for (size_t d = 0; d < gpus.size(); ++d) {
      if (!nvml->Info(gpus[d].index).has_value()) {
        gone.push_back(static_cast<int>(d));
      }
    }
    return gone;
  };
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> LocalBackendKind::Create(
    const BackendContext& context) {
  absl::StatusOr<std::vector<DeviceInfo>> devices =
      DiscoverDevices(context.devices, context.nvml);
  if (!devices.ok()) return devices.status();
  LocalJobLauncher::LostDevices lost = WatchGpus(context.nvml, *devices);
  return std::make_unique<LocalBackend>(std::move(*devices), context.processes,
                                        std::move(lost));
}

}  // namespace shardtrain
