#include "server/slurm_backend.h"

#include <cstdlib>
#include <filesystem>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/slurm_job_launcher.h"

namespace shardtrain {
namespace {

// What the scheduler may hand out: one slot per rank Slurm can place at once
// in the partition. Slurm decides where; this only keeps jobs that could
// never fit in shardtraind's queue.
absl::StatusOr<std::vector<DeviceInfo>> SlurmSlots(
    SlurmClient& slurm, const SlurmOptions& options) {
  absl::StatusOr<std::vector<SlurmNode>> nodes = slurm.Nodes();
  if (!nodes.ok()) {
    return absl::UnavailableError(
        absl::StrCat("--launcher slurm: cannot ask Slurm for its nodes: ",
                     nodes.status().message()));
  }
  absl::StatusOr<std::vector<SlurmPartition>> partitions = slurm.Partitions();
  if (!partitions.ok()) {
    return absl::UnavailableError(
        absl::StrCat("--launcher slurm: cannot ask Slurm for its partitions: ",
                     partitions.status().message()));
  }
  absl::StatusOr<int> slots = SlurmSlotCount(*nodes, *partitions, options);
  if (!slots.ok()) return slots.status();
  std::vector<DeviceInfo> devices;
  for (int i = 0; i < *slots; ++i) {
    DeviceInfo device;
    device.index = i;
    device.kind = options.gpus_per_node > 0 ? v1::GPU : v1::CPU;
    device.name =
        options.gpus_per_node > 0 ? "Slurm GPU slot" : "Slurm CPU slot";
    devices.push_back(device);
  }
  return devices;
}

class SlurmBackend : public Backend {
 public:
  SlurmBackend(std::unique_ptr<SlurmClient> client,
               std::vector<DeviceInfo> slots, const SlurmOptions& options)
      : client_(std::move(client)),
        slots_(std::move(slots)),
        launcher_(client_.get(), options) {}

  const std::vector<DeviceInfo>& devices() const override { return slots_; }
  AttemptLauncher& launcher() override { return launcher_; }

  void DescribeCluster(v1::Cluster* cluster) override {
    cluster->set_node_group_kind("partition");
    cluster->set_backend_note(
        "the slots above are shardtraind's queue limit; Slurm places the "
        "ranks");
    // The call still answers (with backend_error) when Slurm does not.
    absl::StatusOr<std::vector<SlurmNode>> nodes = client_->Nodes();
    absl::StatusOr<std::vector<SlurmPartition>> partitions =
        client_->Partitions();
    if (!nodes.ok() || !partitions.ok()) {
      cluster->set_backend_error(absl::StrCat(
          "Slurm did not answer: ",
          (!nodes.ok() ? nodes.status() : partitions.status()).message()));
      return;
    }
    for (const SlurmNode& node : *nodes) {
      v1::ClusterNode* out = cluster->add_nodes();
      out->set_name(node.name);
      out->set_address(node.address);
      out->set_state(node.state);
      out->set_cpus(node.cpus);
      out->set_cpus_allocated(node.cpus_allocated);
      out->set_gpus(node.gpus);
      for (const std::string& p : node.partitions) out->add_groups(p);
    }
    for (const SlurmPartition& partition : *partitions) {
      v1::NodeGroup* out = cluster->add_node_groups();
      out->set_name(partition.name);
      out->set_state(partition.state);
      out->set_nodes(partition.nodes);
      out->set_total_nodes(partition.total_nodes);
      out->set_total_cpus(partition.total_cpus);
      out->set_is_default(partition.is_default);
    }
  }

 private:
  // Asked from the supervisor (launcher_) and gRPC threads (DescribeCluster):
  // CommandSlurmClient runs one command per call and keeps no state.
  const std::unique_ptr<SlurmClient> client_;
  const std::vector<DeviceInfo> slots_;
  SlurmJobLauncher launcher_;
};

}  // namespace

void SlurmBackendKind::AddFlags(CLI::App& app) {
  app.add_option("--slurm-partition", options_.partition,
                 "partition jobs are submitted to (default: Slurm's)");
  app.add_option("--slurm-tasks-per-node", options_.tasks_per_node,
                 "CPU ranks per node")
      ->capture_default_str();
  app.add_option("--slurm-gpus-per-node", options_.gpus_per_node,
                 "GPUs (= ranks) per node; 0: CPU ranks")
      ->capture_default_str();
  app.add_option("--slurm-cpus-per-task", options_.cpus_per_task,
                 "cores (threads) of a CPU rank")
      ->capture_default_str();
  app.add_option("--slurm-sbatch-arg", options_.extra_sbatch_args,
                 "extra sbatch argument, e.g. --slurm-sbatch-arg=--account=ml "
                 "(repeatable)");
}

absl::Status SlurmBackendKind::Validate(const BackendContext& context) const {
  const std::string& worker_listen = context.worker_listen;
  if (worker_listen.empty() || absl::StartsWith(worker_listen, "unix:")) {
    return absl::InvalidArgumentError(
        "--launcher slurm needs --worker-listen HOST:PORT, an address of "
        "this host that Slurm's nodes can reach (ranks report there)");
  }
  const std::string host = worker_listen.substr(0, worker_listen.rfind(':'));
  if (host == "0.0.0.0" || host == "[::]" || host == "::") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--worker-listen: ", worker_listen,
        " is every address of this host; give the one the nodes reach "
        "(workers are told to dial it)"));
  }
  if (options_.tasks_per_node < 1 || options_.gpus_per_node < 0 ||
      options_.cpus_per_task < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--slurm-tasks-per-node and --slurm-cpus-per-task must be >= 1, "
        "--slurm-gpus-per-node >= 0; got ",
        options_.tasks_per_node, ", ", options_.cpus_per_task, ", ",
        options_.gpus_per_node));
  }
  // Slurm's commands wait a minute for a configuration file that is not
  // there: say so at once instead.
  if (const char* conf = std::getenv("SLURM_CONF");
      conf != nullptr && *conf != '\0' && !std::filesystem::exists(conf)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--launcher slurm: SLURM_CONF names ", conf, ", which does not exist"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Backend>> SlurmBackendKind::Create(
    const BackendContext&) {
  auto client = std::make_unique<CommandSlurmClient>(options_);
  absl::StatusOr<std::vector<DeviceInfo>> slots = SlurmSlots(*client, options_);
  if (!slots.ok()) return slots.status();
  return std::make_unique<SlurmBackend>(std::move(client), std::move(*slots),
                                        options_);
}

}  // namespace shardtrain
