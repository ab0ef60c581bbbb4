// Backend: where a job's ranks run — this host's processes, a Slurm cluster,
// a fake in tests. A backend is one row of a BackendRegistry (a BackendKind)
// and one file pair; it owns everything that differs between backends:
//   - its flags (`--<name>-...`), bound to the row's own settings, and their
//     validation against the coordinator's (Validate);
//   - the devices or slots the scheduler hands out (Backend::devices);
//   - the AttemptLauncher that starts, polls, signals and cleans up attempts;
//   - its part of the cluster view (nodes, node groups, a note), asked on
//     every GetCluster.
// The coordinator picks the row named by `--launcher` and never names one;
// the JobManager sees only the AttemptLauncher. server/backends.cc lists the
// rows shardtraind is built with (docs/design.md: "Adding a backend").
#ifndef SHARDTRAIN_SERVER_BACKEND_H_
#define SHARDTRAIN_SERVER_BACKEND_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/attempt_launcher.h"
#include "server/device_inventory.h"
#include "server/process_spawner.h"
#include "shardtrain/v1/cluster_service.pb.h"

namespace CLI {
class App;
}  // namespace CLI

namespace shardtrain {

class Nvml;

// The coordinator's settings and parts a backend may use. Pointers outlive
// the backend built from them.
struct BackendContext {
  DeviceOptions devices;       // --device-kind, --cpu-slots
  const Nvml* nvml = nullptr;  // null without NVML
  // Spawns local processes (fork/exec; a fake in tests).
  ProcessSpawner* processes = nullptr;
  // --worker-listen as given: empty for the Unix socket in the state dir.
  std::string worker_listen;
};

// A built backend: what the coordinator schedules onto and launches with.
class Backend {
 public:
  virtual ~Backend() = default;

  // The devices (or slots) the scheduler hands out, one kind for all.
  virtual const std::vector<DeviceInfo>& devices() const = 0;

  // Starts and supervises attempts; lives as long as the backend.
  virtual AttemptLauncher& launcher() = 0;

  // Fills the backend's part of `cluster` (nodes, node_groups,
  // node_group_kind, backend_note, backend_error when its source does not
  // answer). Called from gRPC threads, concurrently; may run slow commands.
  virtual void DescribeCluster(v1::Cluster* cluster) { (void)cluster; }
};

// One row of the registry: a backend's name, flags and factory.
class BackendKind {
 public:
  virtual ~BackendKind() = default;

  // The `--launcher` value that picks this row ("local", "slurm").
  virtual std::string name() const = 0;
  // A few words for `--launcher`'s help.
  virtual std::string summary() const = 0;

  // Adds this backend's flags to shardtraind's, bound to this row.
  virtual void AddFlags(CLI::App& app) { (void)app; }

  // Checks this row's settings (and the coordinator's that concern it)
  // before anything is opened; InvalidArgument names the flag.
  virtual absl::Status Validate(const BackendContext& context) const {
    (void)context;
    return absl::OkStatus();
  }

  // Builds the backend: discovers its devices or slots and makes its
  // launcher. An error names what could not be reached.
  virtual absl::StatusOr<std::unique_ptr<Backend>> Create(
      const BackendContext& context) = 0;
};

// The backends a coordinator can run, by name.
class BackendRegistry {
 public:
  // AlreadyExists for a second row with the same name.
  absl::Status Add(std::unique_ptr<BackendKind> kind);
  // Null when none is called `name`.
  BackendKind* Find(const std::string& name) const;
  // InvalidArgument naming the registered ones when none is called `name`.
  absl::StatusOr<BackendKind*> Get(const std::string& name) const;
  // In registration order.
  std::vector<std::string> Names() const;
  // Every row's flags, and `--launcher`'s help naming the rows.
  void AddFlags(CLI::App& app);
  std::string LauncherHelp() const;

 private:
  std::vector<std::unique_ptr<BackendKind>> kinds_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_BACKEND_H_
