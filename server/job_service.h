// JobServiceImpl: the JobService RPCs, thin over JobManager: check the
// caller's token, translate the request, map the Status.
#ifndef SHARDTRAIN_SERVER_JOB_SERVICE_H_
#define SHARDTRAIN_SERVER_JOB_SERVICE_H_

#include "server/access_policy.h"
#include "server/job_manager.h"
#include "server/request_authorizer.h"
#include "shardtrain/v1/job_service.grpc.pb.h"

namespace shardtrain {

class JobServiceImpl final : public v1::JobService::Service {
 public:
  // Both must outlive the service.
  // `streams` bounds each client's open WatchJob/StreamLogs calls.
  JobServiceImpl(JobManager* manager, const RequestAuthorizer* authorizer,
                 StreamLimiter* streams)
      : manager_(manager), authorizer_(authorizer), streams_(streams) {}

  grpc::Status SubmitJob(grpc::ServerContext* context,
                         const v1::SubmitJobRequest* request,
                         v1::Job* response) override;
  grpc::Status GetJob(grpc::ServerContext* context,
                      const v1::GetJobRequest* request,
                      v1::Job* response) override;
  grpc::Status ListJobs(grpc::ServerContext* context,
                        const v1::ListJobsRequest* request,
                        v1::ListJobsResponse* response) override;
  grpc::Status CancelJob(grpc::ServerContext* context,
                         const v1::CancelJobRequest* request,
                         v1::Job* response) override;
  grpc::Status WatchJob(grpc::ServerContext* context,
                        const v1::WatchJobRequest* request,
                        grpc::ServerWriter<v1::WatchJobEvent>* writer) override;
  grpc::Status GetJobMetrics(grpc::ServerContext* context,
                             const v1::GetJobMetricsRequest* request,
                             v1::GetJobMetricsResponse* response) override;
  grpc::Status StreamLogs(grpc::ServerContext* context,
                          const v1::StreamLogsRequest* request,
                          grpc::ServerWriter<v1::LogLine>* writer) override;

 private:
  JobManager* const manager_;
  const RequestAuthorizer* const authorizer_;
  StreamLimiter* const streams_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_JOB_SERVICE_H_
