// RequestAuthorizer: with --auth-token-file, every JobService and
// ClusterService call must carry `authorization: Bearer <token>`.
// WorkerService calls are authorized by the job's secret instead (workers are
// the coordinator's own children), and the health and reflection services
// stay open so probes and grpcurl's `list` work.
#ifndef SHARDTRAIN_SERVER_REQUEST_AUTHORIZER_H_
#define SHARDTRAIN_SERVER_REQUEST_AUTHORIZER_H_

#include <grpcpp/server_context.h>

#include <string>

#include "absl/status/statusor.h"
#include "server/grpc_status.h"

namespace shardtrain {

class RequestAuthorizer {
 public:
  // Empty token: every call is allowed.
  explicit RequestAuthorizer(std::string token) : token_(std::move(token)) {}

  // Reads the token from `path` (surrounding whitespace trimmed); errors
  // name the file. An empty file is an error.
  static absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

  // OK, or UNAUTHENTICATED saying what was missing or wrong.
  grpc::Status Check(const grpc::ServerContext& context) const;

  bool enabled() const { return !token_.empty(); }

  // A unary call's body: Check, then `call` (returning
  // absl::StatusOr<Response>), whose value becomes `*response` and whose
  // error becomes the call's status (ToGrpcStatus).
  template <typename Response, typename Call>
  grpc::Status Serve(const grpc::ServerContext& context, Response* response,
                     Call&& call) const {
    if (grpc::Status s = Check(context); !s.ok()) return s;
    absl::StatusOr<Response> result = call();
    if (!result.ok()) return ToGrpcStatus(result.status());
    *response = std::move(*result);
    return grpc::Status::OK;
  }

 private:
  std::string token_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_REQUEST_AUTHORIZER_H_
