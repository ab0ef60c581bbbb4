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
  return grpc::Status::OK;
}

}  // namespace shardtrain
