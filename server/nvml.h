// Nvml: the few NVIDIA Management Library calls the coordinator needs, loaded
// at run time (dlopen of libnvidia-ml.so.1, which ships with the driver), so
// shardtraind builds and runs on hosts without NVIDIA software.
#ifndef SHARDTRAIN_SERVER_NVML_H_
#define SHARDTRAIN_SERVER_NVML_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace shardtrain {

struct GpuInfo {
  std::string name;
  int64_t memory_total_bytes = 0;
};

struct GpuUsage {
  double utilization_ratio = 0;  // 0..1, busy share of the last sample period
  int64_t memory_used_bytes = 0;
  double power_watts = 0;
};

class Nvml {
 public:
  // nullptr when the library or the driver is absent.
  static std::unique_ptr<Nvml> Load();
  ~Nvml();
  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;

  int DeviceCount() const;
  std::optional<GpuInfo> Info(int index) const;
  std::optional<GpuUsage> Usage(int index) const;

 private:
  struct Api;
  explicit Nvml(std::unique_ptr<Api> api);
  std::unique_ptr<Api> api_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_NVML_H_
