// The local backend (`--launcher local`, the default): ranks are processes
// on this host, one per device — GPUs found through NVML, else CPU slots
// (server/device_inventory.h) — started by LocalJobLauncher. A GPU NVML no
// longer answers for is reported lost, so an elastic job continues without
// it. It has no flags of its own beyond --device-kind and --cpu-slots and
// no nodes to show.
#ifndef SHARDTRAIN_SERVER_LOCAL_BACKEND_H_
#define SHARDTRAIN_SERVER_LOCAL_BACKEND_H_

#include <memory>
#include <string>

#include "server/backend.h"

namespace shardtrain {

class LocalBackendKind : public BackendKind {
 public:
  std::string name() const override { return "local"; }
  std::string summary() const override { return "fork/exec on this host"; }
  absl::StatusOr<std::unique_ptr<Backend>> Create(
      const BackendContext& context) override;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_LOCAL_BACKEND_H_
