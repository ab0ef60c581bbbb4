// ClusterServiceImpl: the devices, who holds them, and the queue.
#ifndef SHARDTRAIN_SERVER_CLUSTER_SERVICE_H_
#define SHARDTRAIN_SERVER_CLUSTER_SERVICE_H_

#include "server/job_manager.h"
#include "server/request_authorizer.h"
#include "server/slurm.h"
#include "shardtrain/v1/cluster_service.grpc.pb.h"

namespace shardtrain {

class ClusterServiceImpl final : public v1::ClusterService::Service {
 public:
  // `slurm`: set under --launcher slurm; its nodes and partitions are asked
  // for on each call.
  ClusterServiceImpl(JobManager* manager, const RequestAuthorizer* authorizer,
                     SlurmClient* slurm = nullptr)
      : manager_(manager), authorizer_(authorizer), slurm_(slurm) {}

  grpc::Status GetCluster(grpc::ServerContext* context,
                          const v1::GetClusterRequest* request,
                          v1::Cluster* response) override;

 private:
  JobManager* const manager_;
  const RequestAuthorizer* const authorizer_;
  SlurmClient* const slurm_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_CLUSTER_SERVICE_H_
