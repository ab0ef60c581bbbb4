#include "server/worker_service.h"

#include <vector>

#include "server/grpc_status.h"

namespace shardtrain {

grpc::Status WorkerServiceImpl::Register(grpc::ServerContext*,
                                         const v1::RegisterRequest* request,
                                         v1::RegisterResponse*) {
  return ToGrpcStatus(manager_->RegisterWorker(request->worker()));
}

grpc::Status WorkerServiceImpl::ReportProgress(
    grpc::ServerContext*, const v1::ReportProgressRequest* request,
    v1::ReportProgressResponse* response) {
  const std::vector<v1::StepMetrics> steps(request->steps().begin(),
                                           request->steps().end());
  absl::StatusOr<bool> cancel =
      manager_->ReportProgress(request->worker(), steps);
  if (!cancel.ok()) return ToGrpcStatus(cancel.status());
  response->set_cancel(*cancel);
  return grpc::Status::OK;
}

grpc::Status WorkerServiceImpl::Heartbeat(grpc::ServerContext*,
                                          const v1::HeartbeatRequest* request,
                                          v1::HeartbeatResponse* response) {
  absl::StatusOr<bool> cancel = manager_->Heartbeat(request->worker());
  if (!cancel.ok()) return ToGrpcStatus(cancel.status());
  response->set_cancel(*cancel);
  return grpc::Status::OK;
}

}  // namespace shardtrain
