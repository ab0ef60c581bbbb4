#include "server/cluster_service.h"

namespace shardtrain {

grpc::Status ClusterServiceImpl::GetCluster(grpc::ServerContext* context,
                                            const v1::GetClusterRequest*,
                                            v1::Cluster* response) {
  if (grpc::Status s = authorizer_->Check(*context); !s.ok()) return s;
  const ClusterView view = manager_->Cluster();
  for (size_t i = 0; i < view.devices.size(); ++i) {
    const DeviceInfo& info = view.devices[i];
    v1::Device* device = response->add_devices();
    device->set_index(info.index);
    device->set_kind(info.kind);
    device->set_name(info.name);
    device->set_memory_bytes(info.memory_bytes);
    device->set_job_id(view.holders[i].job_id);
    device->set_rank(view.holders[i].job_id.empty() ? -1
                                                    : view.holders[i].rank);
  }
  for (const v1::Job& job : view.queue) {
    v1::QueuedJob* queued = response->add_queue();
    queued->set_job_id(job.id());
    queued->set_priority(job.spec().priority());
    queued->set_reason(job.state_reason());
  }
  response->set_version(SHARDTRAIN_VERSION);
  response->set_launcher(slurm_ != nullptr ? "slurm" : "local");
  if (slurm_ == nullptr) return grpc::Status::OK;
  // Slurm's view; the call still answers (with slurm_error) when Slurm
  // does not.
  absl::StatusOr<std::vector<SlurmNode>> nodes = slurm_->Nodes();
  absl::StatusOr<std::vector<SlurmPartition>> partitions = slurm_->Partitions();
  if (!nodes.ok() || !partitions.ok()) {
    response->set_slurm_error(std::string(
        (!nodes.ok() ? nodes.status() : partitions.status()).message()));
    return grpc::Status::OK;
  }
  for (const SlurmNode& node : *nodes) {
    v1::SlurmNode* out = response->add_slurm_nodes();
    out->set_name(node.name);
    out->set_address(node.address);
    out->set_state(node.state);
    out->set_cpus(node.cpus);
    out->set_cpus_allocated(node.cpus_allocated);
    out->set_gpus(node.gpus);
    for (const std::string& p : node.partitions) out->add_partitions(p);
  }
  for (const SlurmPartition& partition : *partitions) {
    v1::SlurmPartition* out = response->add_slurm_partitions();
    out->set_name(partition.name);
    out->set_state(partition.state);
    out->set_nodes(partition.nodes);
    out->set_total_nodes(partition.total_nodes);
    out->set_total_cpus(partition.total_cpus);
    out->set_is_default(partition.is_default);
  }
  return grpc::Status::OK;
}

}  // namespace shardtrain
