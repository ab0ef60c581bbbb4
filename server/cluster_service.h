// ClusterServiceImpl: the devices, who holds them, the queue, and the
// backend's own view (its nodes and node groups).
#ifndef SHARDTRAIN_SERVER_CLUSTER_SERVICE_H_
#define SHARDTRAIN_SERVER_CLUSTER_SERVICE_H_

#include <string>

#include "server/backend.h"
#include "server/job_manager.h"
#include "server/request_authorizer.h"
#include "shardtrain/v1/cluster_service.grpc.pb.h"

namespace shardtrain {

class ClusterServiceImpl final : public v1::ClusterService::Service {
 public:
  // `backend` (named `backend_name`) describes its nodes on each call; all
  // three outlive the service.
  ClusterServiceImpl(JobManager* manager, const RequestAuthorizer* authorizer,
                     Backend* backend, std::string backend_name)
      : manager_(manager),
        authorizer_(authorizer),
        backend_(backend),
        backend_name_(std::move(backend_name)) {}

  grpc::Status GetCluster(grpc::ServerContext* context,
                          const v1::GetClusterRequest* request,
                          v1::Cluster* response) override;

 private:
  JobManager* const manager_;
  const RequestAuthorizer* const authorizer_;
  Backend* const backend_;
  const std::string backend_name_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_CLUSTER_SERVICE_H_
