// WorkerServiceImpl: what a job's workers call (register, report progress,
// heartbeat). JobManager refuses identities that are not a live rank of the
// job's current attempt with its secret.
#ifndef SHARDTRAIN_SERVER_WORKER_SERVICE_H_
#define SHARDTRAIN_SERVER_WORKER_SERVICE_H_

#include "server/job_manager.h"
#include "shardtrain/v1/worker_service.grpc.pb.h"

namespace shardtrain {

class WorkerServiceImpl final : public v1::WorkerService::Service {
 public:
  explicit WorkerServiceImpl(JobManager* manager) : manager_(manager) {}

  grpc::Status Register(grpc::ServerContext* context,
                        const v1::RegisterRequest* request,
                        v1::RegisterResponse* response) override;
  grpc::Status ReportProgress(grpc::ServerContext* context,
                              const v1::ReportProgressRequest* request,
                              v1::ReportProgressResponse* response) override;
  grpc::Status Heartbeat(grpc::ServerContext* context,
                         const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override;

 private:
  JobManager* const manager_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_WORKER_SERVICE_H_
