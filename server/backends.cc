#include "server/backends.h"

#include <memory>

#include "server/local_backend.h"
#include "server/slurm_backend.h"

namespace shardtrain {

BackendRegistry BuiltinBackends() {
  BackendRegistry registry;
  (void)registry.Add(std::make_unique<LocalBackendKind>());
  (void)registry.Add(std::make_unique<SlurmBackendKind>());
  return registry;
}

}  // namespace shardtrain
