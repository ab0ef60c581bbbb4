#include "server/cluster_service.h"

namespace shardtrain {
namespace {

// The deprecated slurm_* fields, copied from the generic ones for clients
// written against 0.x (shardtrain/v1/cluster_service.proto).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
void FillDeprecatedAliases(v1::Cluster* cluster) {
  for (const v1::ClusterNode& node : cluster->nodes()) {
    v1::SlurmNode* out = cluster->add_slurm_nodes();
    out->set_name(node.name());
    out->set_address(node.address());
    out->set_state(node.state());
    out->set_cpus(node.cpus());
    out->set_cpus_allocated(node.cpus_allocated());
    out->set_gpus(node.gpus());
    *out->mutable_partitions() = node.groups();
  }
  for (const v1::NodeGroup& group : cluster->node_groups()) {
    v1::SlurmPartition* out = cluster->add_slurm_partitions();
    out->set_name(group.name());
    out->set_state(group.state());
    out->set_nodes(group.nodes());
    out->set_total_nodes(group.total_nodes());
    out->set_total_cpus(group.total_cpus());
    out->set_is_default(group.is_default());
  }
  cluster->set_slurm_error(cluster->backend_error());
}
#pragma GCC diagnostic pop

}  // namespace

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
    queued->set_priority(job.priority());
    queued->set_reason(job.state_reason());
    queued->set_owner(job.owner());
    queued->set_world_size(job.spec().world_size());
    if (job.id() == view.head && view.head_predicted_start.has_value()) {
      queued->set_predicted_start_unix_ms(
          absl::ToUnixMillis(*view.head_predicted_start));
    }
  }
  response->set_version(SHARDTRAIN_VERSION);
  response->set_launcher(backend_name_);
  backend_->DescribeCluster(response);
  FillDeprecatedAliases(response);
  return grpc::Status::OK;
}

}  // namespace shardtrain
